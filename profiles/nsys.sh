#!/usr/bin/env bash
# Nsight Systems profile of graphpipe on CUDA, turned into graphpipe profile's report.
#
#   profiles/nsys.sh [OUT] [-- graphpipe train arguments]
#
# 1. `nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node` runs `graphpipe train`
#    (nsys follows the spawned rank processes) and writes OUT.nsys-rep (open it in the
#    Nsight Systems GUI);
# 2. `nsys export --type sqlite` writes OUT.sqlite;
# 3. `graphpipe profile --from-nsys OUT.sqlite --out OUT.profile` writes
#    OUT.profile/report.json and OUT.profile/timeline.svg from the NVTX ranges of the last
#    PROFILE_STEPS (default 3) steps of every rank and prints the table; the GPU clock is
#    used when the export holds the CUDA trace (each range projected onto the GPU work it
#    launched); set CLOCK=host for the host-side ranges;
# 4. `nsys stats --report nvtx_sum` writes OUT_nvtx_sum.csv (time per range name).
#
# Default workload: `graphpipe train --device cuda --ranks 1 --steps 10 --capture action`,
# one rank because NCCL refuses two ranks on one GPU; pass --ranks N on an N-GPU machine.
#
# Ranges (NVTX domain "graphpipe" with the nvtx package; without it, torch.cuda.nvtx's default
# domain): `step` per training step, `3F5` / `0I2` / `4W1` per action,
# `(0F5;7B2)OVERLAP_F_B` per overlapped pair, `wait ...` per communication wait; with
# capture="action" the replay of each action's CUDA graph sits inside its range, with
# capture="step" the whole step graph sits inside `step` (the report then says that only the
# whole step is visible). --cuda-graph-trace=node shows the kernels inside the graphs and
# ties each to the cudaGraphLaunch inside its range. (Not run on the CPU-only development
# machine: untested there; the analysis of step 3 is tested on CPU with SQLite files written
# in nsys's schema.)
set -euo pipefail

OUT=${1:-/tmp/graphpipe-nsys}
shift || true
if [[ "${1:-}" == "--" ]]; then
    shift
fi
ARGS=("$@")
if [[ ${#ARGS[@]} -eq 0 ]]; then
    ARGS=(--device cuda --ranks 1 --steps 10 --capture action)
fi
CLOCK_ARGS=()
if [[ -n "${CLOCK:-}" ]]; then
    CLOCK_ARGS=(--clock "$CLOCK")
fi

nsys profile \
    --trace=cuda,nvtx,osrt \
    --cuda-graph-trace=node \
    --sample=none \
    --force-overwrite=true \
    --output="$OUT" \
    python -m graphpipe train "${ARGS[@]}"

nsys export --type=sqlite --force-overwrite=true --output="$OUT.sqlite" "$OUT.nsys-rep"
python -m graphpipe profile --from-nsys "$OUT.sqlite" --out "$OUT.profile" \
    --steps "${PROFILE_STEPS:-3}" "${CLOCK_ARGS[@]}"
nsys stats --report nvtx_sum --format csv --output "$OUT" "$OUT.nsys-rep"
echo "wrote $OUT.nsys-rep, $OUT.sqlite, $OUT.profile/ and ${OUT}_nvtx_sum.csv"
