"""Backend dispatch rules of graphpipe.kernels (GRAPHPIPE_KERNELS) and capture safety."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import graphpipe.kernels as kernels
from graphpipe.kernels import _dispatch, cross_entropy, rms_norm, rms_norm_residual, swiglu
from graphpipe.kernels._dispatch import (
    interpreter_problem,
    interpreter_ready,
    kernel_mode,
    use_triton,
)


def _ops(device):
    """One call of each public op on tiny inputs; returns the outputs' grad_fn names."""
    x = torch.randn(2, 37, device=device, requires_grad=True)
    w = torch.ones(37, device=device)
    target = torch.tensor([1, -100], device=device)
    outs = [rms_norm(x, w), rms_norm_residual(x, x, w)[0], swiglu(x, x), cross_entropy(x, target)]
    return [type(o.grad_fn).__name__ for o in outs]


TRITON_NAMES = [
    "_RMSNormFnBackward",
    "_RMSNormResidualFnBackward",
    "_SwiGLUFnBackward",
    "_CrossEntropyFnBackward",
]


def test_public_exports():
    assert sorted(kernels.__all__) == ["cross_entropy", "rms_norm", "rms_norm_residual", "swiglu"]
    for name in kernels.__all__:
        assert callable(getattr(kernels, name))


@pytest.mark.parametrize(
    ("value", "mode"),
    [(None, "auto"), ("", "auto"), ("auto", "auto"), ("TORCH", "torch"), (" triton ", "triton")],
)
def test_kernel_mode_parsing(value, mode, monkeypatch):
    if value is None:
        monkeypatch.delenv("GRAPHPIPE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("GRAPHPIPE_KERNELS", value)
    assert kernel_mode() == mode


def test_bad_value_raises_value_error_naming_it(monkeypatch):
    monkeypatch.setenv("GRAPHPIPE_KERNELS", "cudnn-please")
    with pytest.raises(ValueError, match="cudnn-please"):
        rms_norm(torch.randn(2, 8), torch.ones(8))
    with pytest.raises(ValueError, match="cudnn-please"):
        cross_entropy(torch.randn(2, 8), torch.tensor([0, 1]))


def test_cpu_default_is_torch_reference(monkeypatch):
    monkeypatch.delenv("GRAPHPIPE_KERNELS", raising=False)
    names = _ops("cpu")
    assert not set(names) & set(TRITON_NAMES), names


def test_forced_torch_uses_reference(monkeypatch, device):
    monkeypatch.setenv("GRAPHPIPE_KERNELS", "torch")
    names = _ops(device)
    assert not set(names) & set(TRITON_NAMES), names


@pytest.mark.usefixtures("triton_loop_path")  # _ops calls RMSNorm and cross-entropy too
def test_forced_triton_uses_kernels(device):
    assert _ops(device) == TRITON_NAMES


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "broken"),
    [
        ("3.6.0", "2.5.2", True),  # the lent GPU machine's image
        ("3.6.0", "2.4.0", True),
        ("3.5.1", "2.4.6", True),
        ("3.6.0", "2.3.5", False),  # numpy 2.3 only warns (DeprecationWarning)
        ("3.7.0", "2.5.2", False),  # Triton 3.7 squeezes the array before int()
        ("3.9.0", "2.4.6", False),
        ("3.10.0+git1234", "2.10.0rc1", False),
    ],
)
def test_interpreter_problem_is_triton_before_3_7_with_numpy_from_2_4(
    triton_version, numpy_version, broken
):
    why = interpreter_problem(triton_version, numpy_version)
    assert (why is not None) == broken
    if broken:
        assert triton_version in why and numpy_version in why and "numpy < 2.4" in why


@pytest.mark.usefixtures("triton_path")
def test_forced_triton_on_cpu_names_the_interpreter_problem(monkeypatch):
    """Where the interpreter cannot run a loop over a run-time bound, forcing Triton on CPU
    raises naming the versions for RMSNorm and cross-entropy, before any kernel starts;
    SwiGLU (no such loop) still runs."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA the compiled kernels run: the interpreter is not involved")
    reason = interpreter_problem("3.6.0", "2.5.2")
    monkeypatch.setattr(_dispatch, "interpreter_problem", lambda: reason)
    x = torch.randn(2, 37, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0's interpreter .* numpy 2\.5\.2"):
        rms_norm(x, torch.ones(37))
    with pytest.raises(RuntimeError, match=r"numpy < 2\.4 or Triton >= 3\.7"):
        rms_norm_residual(x, x, torch.ones(37))
    with pytest.raises(RuntimeError, match="GRAPHPIPE_KERNELS=torch"):
        cross_entropy(x, torch.tensor([1, -100]))
    assert type(swiglu(x, x).grad_fn).__name__ == "_SwiGLUFnBackward"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_is_triton(monkeypatch):
    monkeypatch.delenv("GRAPHPIPE_KERNELS", raising=False)
    assert _ops("cuda") == TRITON_NAMES


def test_forced_triton_on_cpu_without_interpreter_env_raises(monkeypatch):
    monkeypatch.setenv("GRAPHPIPE_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        swiglu(torch.zeros(3), torch.zeros(3))


_CHILD = textwrap.dedent(
    """
    import json, os, torch
    import graphpipe.kernels as k
    x, w = torch.randn(2, 8), torch.ones(8)
    result = {"auto_ok": bool(torch.isfinite(k.rms_norm(x, w)).all())}
    os.environ["GRAPHPIPE_KERNELS"] = "triton"
    for key in ("unset", "set_after_import"):
        if key == "set_after_import":
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            k.rms_norm(x, w)
            result[key] = "no error"
        except RuntimeError as exc:
            result[key] = str(exc)
    print(json.dumps(result))
    """
)


def test_forced_triton_without_interpreter_raises_in_fresh_process():
    """A fresh interpreter with TRITON_INTERPRET unset at import: forcing Triton on CPU
    raises (and still raises if the variable is set only after the import)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GRAPHPIPE_KERNELS")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["auto_ok"] is True
    assert "TRITON_INTERPRET=1" in result["unset"]
    assert "before" in result["unset"]
    assert "after graphpipe.kernels was imported" in result["set_after_import"]


def test_interpreter_state_is_consistent():
    """Under this conftest the CPU kernels are interpreted (or CUDA is present)."""
    if not torch.cuda.is_available() and not interpreter_ready():
        pytest.skip("graphpipe.kernels was imported before tests/kernels/conftest.py ran")
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_no_host_sync(monkeypatch):
    """All four ops, forward and backward, capture into one CUDA graph with no host sync,
    and replaying it reproduces eager results."""
    monkeypatch.delenv("GRAPHPIPE_KERNELS", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, generator=gen)
    target = torch.randint(0, 128, (64,), device="cuda", generator=gen)
    target[:3] = -100
    params = [t.requires_grad_() for t in (x, res, w)]

    def step():
        normed, h = rms_norm_residual(x, res, w)
        act = swiglu(normed[:, :128], normed[:, 128:])
        loss = cross_entropy(act, target) + rms_norm(h, w).float().square().mean()
        return (loss, *torch.autograd.grad(loss, params))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()  # also compiles the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")  # belt and braces: capture rejects syncs too
        try:
            captured = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        torch.testing.assert_close(got, want)
