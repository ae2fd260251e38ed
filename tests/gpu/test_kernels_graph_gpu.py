"""Each Triton kernel, forward and backward, inside a captured CUDA graph, against its torch
reference (skipped without CUDA).

Per op, dtype and shape (RMSNorm on both of its paths: fused at 4096 columns, looped beyond
the fused cap), the op and its gradients are captured once; then, twice, new values are copied
into the graph's static inputs, the graph is replayed, and every output and gradient is
compared with the plain-torch reference run eagerly on the same values. That proves the
kernels capture (no host sync, no allocation outside the graph's pool) and that the replayed
graph reads its inputs rather than values baked in at capture. The largest differences are
the check's figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphpipe.kernels import cross_entropy, rms_norm, rms_norm_residual, swiglu
from graphpipe.kernels.cross_entropy import cross_entropy_reference
from graphpipe.kernels.rms_norm import (
    MAX_FUSED_WIDTH,
    rms_norm_reference,
    rms_norm_residual_reference,
)
from graphpipe.kernels.swiglu import swiglu_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (atol, rtol) for outputs and input gradients, as in tests/kernels; weight gradients sum
# over rows and get 4x the atol.
TOLS = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}

# op -> (Triton op, torch reference); their inputs are [rows, cols] tensors except the weight
# ([cols]) and the cross-entropy target ([rows]).
OPS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "rms_norm": (rms_norm, rms_norm_reference),
    "rms_norm_residual": (rms_norm_residual, rms_norm_residual_reference),
    "swiglu": (swiglu, swiglu_reference),
    "cross_entropy": (cross_entropy, cross_entropy_reference),
}

CASES = [
    ("rms_norm", 64, 4096),
    ("rms_norm", 8, MAX_FUSED_WIDTH + 37),  # the looped path, an awkward remainder
    ("rms_norm_residual", 64, 4096),
    ("rms_norm_residual", 8, MAX_FUSED_WIDTH + 37),
    ("swiglu", 64, 2731),
    ("cross_entropy", 64, 32000),
]


def _inputs(op: str, rows: int, cols: int, dtype: torch.dtype) -> tuple[list, list]:
    """(all arguments, the differentiable ones: a prefix of them), static tensors on the GPU."""

    def leaf(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="cuda", dtype=dtype).requires_grad_()

    if op == "rms_norm":
        args = [leaf(rows, cols), leaf(cols)]
        return args, args
    if op == "rms_norm_residual":
        args = [leaf(rows, cols), leaf(rows, cols), leaf(cols)]
        return args, args
    if op == "swiglu":
        args = [leaf(rows, cols), leaf(rows, cols)]
        return args, args
    logits = leaf(rows, cols)
    return [logits, torch.empty(rows, device="cuda", dtype=torch.int64)], [logits]


def _fill(args: list, cols: int, seed: int) -> None:
    """New values into the static inputs, in place."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for t in args:
            if t.dtype == torch.int64:
                t.copy_(torch.randint(0, cols, t.shape, device="cuda", generator=g))
                t[::7] = -100  # some ignored rows
            else:
                t.copy_(torch.randn(t.shape, device="cuda", generator=g, dtype=torch.float32))


def _outputs_and_grads(fn: Callable, args: list, diff: list, grad_seed: torch.Tensor) -> list:
    out = fn(*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    # Output gradients derived from a static tensor, so the graph and the reference use the
    # same ones.
    grads = [grad_seed.expand_as(o).to(o.dtype) if o.dim() else torch.ones_like(o) for o in outs]
    return outs + list(torch.autograd.grad(outs, diff, grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("op", "rows", "cols"), CASES, ids=[f"{o}-{r}x{c}" for o, r, c in CASES])
def test_kernel_in_a_captured_graph_matches_the_reference(op, rows, cols, dtype, gpu_figures):
    from graphpipe.kernels._dispatch import use_triton

    triton_fn, reference_fn = OPS[op]
    args, diff = _inputs(op, rows, cols, dtype)
    assert use_triton(args[0]), "GRAPHPIPE_KERNELS forces the torch path"
    grad_seed = torch.linspace(-1.0, 1.0, cols, device="cuda")
    _fill(args, cols, seed=0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and warm up outside the capture
        _outputs_and_grads(triton_fn, args, diff, grad_seed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _outputs_and_grads(triton_fn, args, diff, grad_seed)

    atol, rtol = TOLS[dtype]
    worst = 0.0
    try:
        for seed in (1, 2):
            _fill(args, cols, seed)
            graph.replay()
            ref_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
            expected = _outputs_and_grads(reference_fn, ref_args, ref_args[: len(diff)], grad_seed)
            torch.cuda.synchronize()
            for i, (got, want) in enumerate(zip(static, expected, strict=True)):
                tol = atol * 4 if got.dim() == 1 else atol  # [cols]: a weight gradient
                worst = max(worst, float((got.double() - want.double()).abs().max()))
                torch.testing.assert_close(
                    got, want, atol=tol, rtol=rtol, msg=lambda m, i=i: f"output {i}: {m}"
                )
    finally:
        graph.reset()
    gpu_figures.update(max_abs_diff=worst, atol=atol, rtol=rtol, replays=2)
