#!/usr/bin/env bash
# Nsight Systems profile of graphpipe on CUDA: NVTX ranges named after the schedule actions.
#
#   profiles/nsys.sh [OUT] [-- graphpipe bench arguments]
#
# OUT (default /tmp/graphpipe-nsys) gets OUT.nsys-rep (open it in the Nsight Systems GUI) and
# OUT_nvtx_sum.csv (time per range name). nsys follows the spawned rank processes. Default
# workload: `graphpipe bench --device cuda --ranks 1 --regime sweep --steps 10 --warmup 3`,
# one rank because NCCL refuses two ranks on one GPU; pass --ranks N on an N-GPU machine.
#
# Ranges (domain "graphpipe" with the nvtx package, the default domain through torch.cuda.nvtx
# without it): `step` per training step, `3F5` / `0I2` / `4W1` per action,
# `(0F5;7B2)OVERLAP_F_B` per overlapped pair; with capture="action" the replay of each
# action's CUDA graph sits inside its range, with capture="step" the whole step graph sits
# inside `step`. --cuda-graph-trace=node shows the kernels inside the graphs.
# (Not run on the CPU-only development machine: untested there.)
set -euo pipefail

OUT=${1:-/tmp/graphpipe-nsys}
shift || true
if [[ "${1:-}" == "--" ]]; then
    shift
fi
ARGS=("$@")
if [[ ${#ARGS[@]} -eq 0 ]]; then
    ARGS=(--device cuda --ranks 1 --regime sweep --steps 10 --warmup 3)
fi

nsys profile \
    --trace=cuda,nvtx,osrt \
    --cuda-graph-trace=node \
    --sample=none \
    --force-overwrite=true \
    --output="$OUT" \
    python -m graphpipe bench "${ARGS[@]}"

nsys stats --report nvtx_sum --format csv --output "$OUT" "$OUT.nsys-rep"
echo "wrote $OUT.nsys-rep and ${OUT}_nvtx_sum.csv"
