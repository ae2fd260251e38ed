"""Triton SwiGLU against the torch reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from graphpipe.kernels import swiglu
from graphpipe.kernels.swiglu import swiglu_reference

DTYPE_TOLS = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]
SHAPES = [(1, 37), (5, 129), (2, 3, 37), (4, 1500), (1,)]


def _leaf(shape, dtype, device, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device, dtype).requires_grad_()


def _check(gate, up, atol, rtol, dy=None):
    y = swiglu(gate, up)
    assert type(y.grad_fn).__name__ == "_SwiGLUFnBackward"  # really the Triton path
    y_ref = swiglu_reference(gate, up)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    dy = torch.randn_like(y) if dy is None else dy
    grads = torch.autograd.grad(y, (gate, up), dy)
    grads_ref = torch.autograd.grad(y_ref, (gate, up), dy)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape and g.dtype == g_ref.dtype
        torch.testing.assert_close(g, g_ref, atol=atol, rtol=rtol)


@pytest.mark.usefixtures("triton_path")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_swiglu_matches_reference(shape, dtype, atol, rtol, device):
    torch.manual_seed(0)
    _check(_leaf(shape, dtype, device, 0), _leaf(shape, dtype, device, 1), atol, rtol)


@pytest.mark.usefixtures("triton_path")
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_swiglu_chunked_projection(dtype, atol, rtol, device):
    """gate/up as strided halves of one fused projection, no copies required."""
    proj = _leaf((2, 3, 2 * 37), dtype, device, 2)
    gate, up = proj.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    y = swiglu(gate, up)
    torch.testing.assert_close(y, swiglu_reference(gate, up), atol=atol, rtol=rtol)
    dy = _leaf((2, 3, 37), dtype, device, 3).detach()
    (dproj,) = torch.autograd.grad(y, proj, dy)
    (dproj_ref,) = torch.autograd.grad(swiglu_reference(gate, up), proj, dy)
    torch.testing.assert_close(dproj, dproj_ref, atol=atol, rtol=rtol)


@pytest.mark.usefixtures("triton_path")
def test_swiglu_broadcast_grad_and_transposed_input(device):
    """A stride-0 incoming gradient (from .sum()) and a column-strided input."""
    gate = _leaf((37, 5), torch.float32, device, 4).t()
    up = _leaf((5, 37), torch.float32, device, 5)
    y = swiglu(gate, up)
    grads = torch.autograd.grad(y.sum(), (gate, up))
    grads_ref = torch.autograd.grad(swiglu_reference(gate, up).sum(), (gate, up))
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


def test_swiglu_shape_mismatch_raises(device):
    with pytest.raises(ValueError, match="shape"):
        swiglu(torch.zeros(2, 3, device=device), torch.zeros(2, 4, device=device))


def test_reference_is_silu_times_up():
    gate, up = torch.randn(4, 37), torch.randn(4, 37)
    torch.testing.assert_close(
        swiglu_reference(gate, up), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-6
    )
