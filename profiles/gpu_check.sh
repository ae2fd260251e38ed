#!/usr/bin/env bash
# Every GPU check in one call (meant to finish in under eight minutes on one H200):
# the GPU tests (capture, MoE capture, compiled Triton kernels), the eager-vs-replay
# benchmark, the kernel benchmark and the MoE pair, then a short summary.
# Usage: bash profiles/gpu_check.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/graphpipe-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>&1 | tee "$out/gpus.txt"
status=0
timeout 240 python -m pytest -q tests/gpu tests/kernels 2>&1 | tee "$out/gpu_tests.txt" || status=1
timeout 150 python profiles/gpu_replay_bench.py --steps 20 2>&1 | tee "$out/replay_bench.txt" || status=1
timeout 90 python tests/benchmarks/bench_kernels.py --no-compile 2>&1 | tee "$out/kernel_bench.txt" || status=1
# tests/gpu above includes the MoE capture (test_moe_capture_gpu.py); the MoE pair on one GPU:
timeout 60 graphpipe bench --regime moe --device cuda --ranks 1 --steps 10 2>&1 | tee "$out/moe_bench.txt" || status=1
echo "== summary =="
tail -n 1 "$out/gpu_tests.txt"
tail -n 5 "$out/replay_bench.txt"
exit $status
