#!/usr/bin/env bash
# Every GPU check in one call, written for the lent machine as it is: one H200, python3 with
# torch 2.11 and Triton 3.6, pytest, no nvtx package, no package registry (nothing is
# installed from one). The checks run in order of value, each within its budget, all within
# 420 s (GPU_CHECK_BUDGET_S), so the run ends within 8 minutes; a check whose budget no longer
# fits is not started and is reported skipped for time.
#
#   bash profiles/gpu_check.sh [OUTDIR]        # default: $OUT, else /tmp/graphpipe-gpu
#
# Writes OUTDIR/gpu_check.json (per check: name, status passed/failed/skipped, seconds,
# budget, figures; the run's seconds and budget) and OUTDIR/gpu_check.log, prints a table,
# exits 1 when a check failed. GPU_CHECK_ONLY=name,name runs only those checks.
#
# The checks, their order and their budgets (and where each budget comes from) are in
# profiles/gpu_check.py; docs/gpu-check.md says what each proves.
set -uo pipefail
cd "$(dirname "$0")/.."
exec python3 profiles/gpu_check.py "$@"
