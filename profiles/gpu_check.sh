#!/usr/bin/env bash
# Every GPU check in one call, written for the lent machine as it is: one H200, python3 with
# torch and Triton, pytest, no nvtx package, no package registry. Finishes in under eight
# minutes: each check runs under `timeout`, within a budget for all of them (default 420 s;
# a check that would start too late is recorded as skipped).
#
#   bash profiles/gpu_check.sh [OUTDIR]        # default: $OUT, else /tmp/graphpipe-gpu
#
# Writes OUTDIR/gpu_check.json (one entry per check: name, status passed/failed/skipped,
# seconds, figures) and prints it; OUTDIR/gpu_check.log holds every check's output. Exits 1
# when a check failed. GPU_CHECK_ONLY=name,name runs only those checks (the CPU test of this
# script uses it); GPU_CHECK_BUDGET_S changes the budget.
#
# The checks (profiles/README.md says what each proves):
#   install           pip install --no-deps --no-build-isolation --no-index -e . (fallback:
#                     a graphpipe/kernels link), so that graphpipe.kernels imports
#   capture_llama     one-rank DualPipeV, capture="step"/"action" vs eager: residual MLP
#                     (bitwise; autograd and fused B), built-in Llama with the Triton
#                     kernels in fp32 and bf16
#   moe_capture       one-rank DualPipeV of the MoE Llama (its overlapped pairs through the
#                     stage's hook), captured per step and per action vs eager; EP 2 over
#                     NCCL when two GPUs are visible
#   kernels_in_graph  each Triton kernel, fwd + bwd, captured in a CUDA graph vs its reference
#   nccl_capture      one-rank NCCL process group, all_reduce captured in a graph, replayed
#   action_ranges     torch.profiler trace: each action's range encloses its cudaGraphLaunch
#   replay_sweep      eager vs replay step time, launch-bound to compute-bound
#   kernel_bandwidth  kernel GB/s against the measured device-to-device copy bandwidth
#   kernel_tests      tests/kernels on the GPU, including the sm_90 compile without spills
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${1:-${OUT:-/tmp/graphpipe-gpu}}
mkdir -p "$out"
work=$(mktemp -d)
log="$out/gpu_check.log"
: >"$log"
budget=${GPU_CHECK_BUDGET_S:-420}
deadline=$((SECONDS + budget))
only=${GPU_CHECK_ONLY:-}

export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 # deterministic cuBLAS, for the bitwise comparisons
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

cleanup() {
  # The install fallback's link, if this run made it.
  if [[ -L graphpipe/kernels && -f "$work/install.figures.json" ]] &&
    grep -q created_link "$work/install.figures.json"; then
    rm -f graphpipe/kernels
  fi
  rm -rf "$work"
}
trap cleanup EXIT

summary() { python3 profiles/gpu_summary.py "$@"; }

# check NAME WANT_S CMD...: run CMD under timeout (WANT_S, or less if the budget runs out);
# it may write figures to $GPU_CHECK_FIGURES and pytest's JUnit report to $work/NAME.xml.
check() {
  local name=$1 want=$2
  shift 2
  if [[ -n $only && ",$only," != *",$name,"* ]]; then
    return 0
  fi
  local left=$((deadline - SECONDS))
  if ((left < 30)); then
    summary skip --dir "$work" --name "$name" --reason "only ${left} s left of the ${budget} s budget"
    return 0
  fi
  local limit=$((want < left ? want : left))
  echo "== $name (limit ${limit} s): $*" | tee -a "$log"
  local started
  started=$(date +%s.%N)
  GPU_CHECK_FIGURES="$work/$name.figures.json" timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  cat "$work/$name.log" >>"$log"
  summary record --dir "$work" --name "$name" --rc "$rc" --started "$started" --limit "$limit" |
    tee -a "$log"
}

pytest_check() { # pytest_check NAME WANT_S PATHS...
  local name=$1 want=$2
  shift 2
  check "$name" "$want" python3 -m pytest -q -rA -p no:cacheprovider "$@" \
    --junitxml="$work/$name.xml"
}

check install 90 python3 profiles/gpu_summary.py install --repo "$repo" \
  --figures "$work/install.figures.json" --pip-timeout 75
pytest_check capture_llama 150 tests/gpu/test_capture_gpu.py
pytest_check moe_capture 60 tests/gpu/test_moe_capture_gpu.py
pytest_check kernels_in_graph 60 tests/gpu/test_kernels_graph_gpu.py
pytest_check nccl_capture 45 tests/gpu/test_nccl_capture_gpu.py
pytest_check action_ranges 60 tests/gpu/test_action_ranges_gpu.py
check replay_sweep 90 bash -c 'python3 profiles/gpu_replay_bench.py --steps 15 --json "$GPU_CHECK_FIGURES"'
check kernel_bandwidth 60 bash -c \
  'python3 tests/benchmarks/bench_kernels.py --no-compile --json "$GPU_CHECK_FIGURES"'
pytest_check kernel_tests 120 tests/kernels

summary merge --dir "$work" --out "$out/gpu_check.json" | tee -a "$log"
python3 - "$out/gpu_check.json" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
for c in summary["checks"]:
    print(f"{c['name']:<18} {c['status']:<8} {c['seconds']:>7.1f} s  {c.get('reason', '')}")
print(f"overall: {summary['status']}")
sys.exit(1 if summary["status"] == "failed" else 0)
EOF
