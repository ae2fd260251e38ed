#!/usr/bin/env bash
# The project's whole test suite, on CPU, with the versions of the lent GPU machine's image:
# Python 3.12, torch 2.11.0, Triton 3.6.0, numpy 2.5.2, pytest, pytest-benchmark.
#
#   nice bash profiles/gpu_image_suite.sh [PYTEST ARGS...]    # default: the whole suite
#
# Builds (once) a venv in $GPU_IMAGE_VENV (default .venv-gpu-image/ in the repository root),
# installs the project into it without its dependencies (they are pinned here instead), then
# runs `python -m pytest -q PYTEST ARGS` there and prints how long the set-up and the suite
# took. The venv is rebuilt when the pins below change. Exits with pytest's status.
#
# torch: the CPU build (`--index-url https://download.pytorch.org/whl/cpu`) is tried first;
# where that index cannot be reached, PyPI's torch 2.11.0 is installed, which is the image's
# own build (CUDA 13.0, `2.11.0+cu130` there) and runs on CPU as well: it pulls the CUDA
# libraries (about 3 GB). GPU_IMAGE_PYTHON names the interpreter (default: python3.12 on
# PATH, else pyenv's 3.12.x).
#
# Measured: see docs/gpu-check.md (the whole suite, 2 shared vCPUs, no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=2.11.0
TRITON=3.6.0
NUMPY=2.5.2
TEST_PINS=("pytest>=8" "pytest-benchmark>=4")
pins="python3.12 torch==$TORCH triton==$TRITON numpy==$NUMPY ${TEST_PINS[*]}"

venv=${GPU_IMAGE_VENV:-.venv-gpu-image}
python=
for candidate in ${GPU_IMAGE_PYTHON:-} "$(command -v python3.12 || true)" \
  "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12; do
  # a pyenv shim is on PATH even where it refuses to run 3.12: try each one
  if [[ -n $candidate && -x $candidate ]] &&
    "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [[ -z $python ]]; then
  echo "gpu_image_suite.sh: no Python 3.12 found (set GPU_IMAGE_PYTHON)" >&2
  exit 2
fi

t0=$SECONDS
if [[ ! -f $venv/.pins || $(cat "$venv/.pins") != "$pins" ]]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q)
  if ! "${pip[@]}" --retries 0 --timeout 20 --index-url https://download.pytorch.org/whl/cpu \
    "torch==$TORCH" 2>"$venv/cpu-index.log"; then
    echo "gpu_image_suite.sh: no torch $TORCH from the CPU index (pip's words in" \
      "$venv/cpu-index.log); PyPI's torch $TORCH instead" >&2
    "${pip[@]}" "torch==$TORCH"
  fi
  "${pip[@]}" "torch==$TORCH" "triton==$TRITON" "numpy==$NUMPY" "${TEST_PINS[@]}" setuptools
  "${pip[@]}" --no-deps --no-build-isolation -e .
  echo "$pins" >"$venv/.pins"
fi
"$venv/bin/python" - <<EOF
import sys, numpy, torch, triton
got = (sys.version_info[:2], torch.__version__.split("+")[0], triton.__version__, numpy.__version__)
want = ((3, 12), "$TORCH", "$TRITON", "$NUMPY")
print("versions:", sys.version.split()[0], torch.__version__, triton.__version__, numpy.__version__)
assert got == want, f"the venv holds {got}, not {want}"
EOF
setup_s=$((SECONDS - t0))

t1=$SECONDS
rc=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" || rc=$?
suite_s=$((SECONDS - t1))
echo "gpu_image_suite.sh: set-up ${setup_s} s, suite ${suite_s} s, pytest exit ${rc}" \
  "($(nproc) CPUs, $(date -u +%Y-%m-%d))"
exit "$rc"
