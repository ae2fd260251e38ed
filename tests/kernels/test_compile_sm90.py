"""Every Triton kernel compiles for sm_90 (H100/H200) without a GPU and without register spills.

``tests/kernels/sm90.py`` (run as a child process, since this session's kernels and
triton.language itself are defined under the interpreter) records the launches the real
launchers make, for RMSNorm at hidden 4096 / 8192 and at 16384 / 65536 / 131072 (the looped
path), SwiGLU at the built-in Llama's MLP width for hidden 4096 / 8192 and cross-entropy at
vocab 32000 / 128256, in fp32 and bf16, compiles each distinct binary with
``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` and reads its registers and stack
frame from the cubin. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from graphpipe.kernels.rms_norm import MAX_FUSED_WIDTH
from tests.kernels import sm90

ROOT = Path(__file__).resolve().parents[2]
CASE_IDS = [c.id for c in sm90.cases()]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    """The child's JSON report for every case (one child, each binary compiled once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    if out["missing"] is not None:
        pytest.skip(f"cannot compile for sm_90 here: {out['missing']}")
    return out


def test_the_cases_cover_the_required_shapes_and_the_looped_path():
    ids = set(CASE_IDS)
    for dtype in ("float32", "bfloat16"):
        assert {f"rms_norm-{h}-{dtype}" for h in (4096, 8192)} <= ids
        assert {f"cross_entropy-{v}-{dtype}" for v in (32000, 128256)} <= ids
        assert any(i.startswith("swiglu-") and i.endswith(dtype) for i in ids)
        wide = [c for c in sm90.cases() if c.op == "rms_norm" and c.n_cols > MAX_FUSED_WIDTH]
        assert {c.dtype for c in wide} == {"float32", "bfloat16"} and len(wide) >= 6


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_kernels_compile_for_sm90_without_spills(report, case_id):
    kernels = report["cases"][case_id]
    assert kernels, f"{case_id}: the launchers launched nothing"
    for k in kernels:
        assert "error" not in k, f"{case_id}: {k['kernel']} failed to compile:\n{k['error']}"
        assert k["stack_bytes"] == 0 and k["local_bytes"] == 0, (
            f"{case_id}: {k['kernel']} spills: {k['registers']} registers, "
            f"{k['stack_bytes']} bytes of stack frame, {k['local_bytes']} of local memory"
        )
        # 65536 registers per SM: more per thread than that allows at this warp count would
        # not launch at all.
        assert k["registers"] * k["num_warps"] * 32 <= 65536, (case_id, k)
        # Triton's own JIT binder derives the same signature and hints (None: private API
        # of this Triton differs, nothing to compare).
        assert k["matches_jit_binder"] is not False, (case_id, k["kernel"])


def test_wide_rms_norm_compiles_the_looped_kernels(report):
    """Beyond the fused cap the launchers switch to the looped kernels, and those are what
    compiled (the fused kernel at these widths spilled: 136-184 bytes of stack frame)."""
    for case in sm90.cases():
        if case.op != "rms_norm":
            continue
        names = {k["name"] for k in report["cases"][case.id]}
        if case.n_cols > MAX_FUSED_WIDTH:
            assert "_rms_norm_fwd_looped_kernel" in names and "_rms_norm_bwd_dot_kernel" in names
            assert "_rms_norm_fwd_kernel" not in names
        else:
            assert names == {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"}
