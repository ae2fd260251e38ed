"""Triton RMSNorm / fused residual RMSNorm against the torch reference, fwd and bwd."""

from __future__ import annotations

import pytest
import torch

from graphpipe.kernels import rms_norm, rms_norm_residual
from graphpipe.kernels.rms_norm import (
    LOOPED_BLOCK,
    MAX_FUSED_WIDTH,
    rms_norm_backward,
    rms_norm_config,
    rms_norm_forward,
    rms_norm_reference,
    rms_norm_residual_reference,
)

DTYPE_TOLS = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]
SHAPES = [(1, 37), (5, 129), (2, 3, 37), (7, 64), (3, 1)]


def _exact_add_tol(dtype: torch.dtype) -> dict[str, float]:
    """Tolerance for ``x + residual``: exact on GPU (round to nearest even, like torch).

    The Triton interpreter truncates float32 -> bfloat16 casts instead of rounding, so
    under it a bf16 sum may be one ulp (relative 2**-7) below torch's.
    """
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        return {"atol": 0.0, "rtol": 2.0**-7}
    return {"atol": 0.0, "rtol": 0.0}


def _leaf(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device, dtype).requires_grad_()


def _close(actual, expected, atol, rtol):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.usefixtures("triton_loop_path")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_rms_norm_matches_reference(shape, dtype, atol, rtol, device):
    x = _leaf(shape, dtype, device, 0, scale=3.0)
    w = _leaf(shape[-1:], dtype, device, 1)
    dy = _leaf(shape, dtype, device, 2).detach()

    y = rms_norm(x, w, eps=1e-6)
    assert type(y.grad_fn).__name__ == "_RMSNormFnBackward"  # really the Triton path
    dx, dw = torch.autograd.grad(y, (x, w), dy)

    y_ref = rms_norm_reference(x, w, eps=1e-6)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    _close(y, y_ref, atol, rtol)
    _close(dx, dx_ref, atol, rtol)
    # dweight sums over rows: allow for the bf16 rounding of a larger value.
    _close(dw, dw_ref, atol * 4, rtol)


@pytest.mark.usefixtures("triton_loop_path")
def test_rms_norm_bf16_input_fp32_weight(device):
    x = _leaf((4, 37), torch.bfloat16, device, 3)
    w = _leaf((37,), torch.float32, device, 4)
    y = rms_norm(x, w)
    assert y.dtype == torch.bfloat16
    dx, dw = torch.autograd.grad(y.float().square().sum(), (x, w))
    dx_ref, dw_ref = torch.autograd.grad(rms_norm_reference(x, w).float().square().sum(), (x, w))
    _close(y, rms_norm_reference(x, w), 2e-2, 2e-2)
    _close(dx, dx_ref, 5e-2, 2e-2)
    assert dw.dtype == torch.float32
    _close(dw, dw_ref, 5e-2, 2e-2)


@pytest.mark.usefixtures("triton_loop_path")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_rms_norm_residual_matches_reference(shape, dtype, atol, rtol, device):
    x = _leaf(shape, dtype, device, 5)
    res = _leaf(shape, dtype, device, 6, scale=2.0)
    w = _leaf(shape[-1:], dtype, device, 7)
    dy = _leaf(shape, dtype, device, 8).detach()
    dh = _leaf(shape, dtype, device, 9).detach()

    y, h = rms_norm_residual(x, res, w, 1e-5)
    assert type(y.grad_fn).__name__ == "_RMSNormResidualFnBackward"
    grads = torch.autograd.grad((y, h), (x, res, w), (dy, dh))

    y_ref, h_ref = rms_norm_residual_reference(x, res, w, 1e-5)
    grads_ref = torch.autograd.grad((y_ref, h_ref), (x, res, w), (dy, dh))
    _close(h, h_ref, **_exact_add_tol(dtype))  # the add is rounded once, like torch's
    _close(y, y_ref, atol, rtol)
    _close(grads[0], grads_ref[0], atol, rtol)
    _close(grads[1], grads_ref[1], atol, rtol)
    _close(grads[2], grads_ref[2], atol * 4, rtol)


@pytest.mark.usefixtures("triton_loop_path")
@pytest.mark.parametrize("used", ["normed", "new_residual"])
def test_rms_norm_residual_one_output_used(used, device):
    """Only one output reaches the loss: the other's gradient is None, not zeros."""
    x = _leaf((3, 37), torch.float32, device, 10)
    res = _leaf((3, 37), torch.float32, device, 11)
    w = _leaf((37,), torch.float32, device, 12)
    pick = 0 if used == "normed" else 1
    out = rms_norm_residual(x, res, w)[pick]
    out_ref = rms_norm_residual_reference(x, res, w)[pick]
    grads = torch.autograd.grad(out.pow(3).sum(), (x, res, w), allow_unused=True)
    grads_ref = torch.autograd.grad(out_ref.pow(3).sum(), (x, res, w), allow_unused=True)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        if g_ref is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            _close(g, g_ref, 1e-5, 1e-5)


@pytest.mark.usefixtures("triton_loop_path")
def test_rms_norm_residual_fp32_residual_stream(device):
    """bf16 branch output added to a float32 residual stream keeps the stream float32."""
    x = _leaf((2, 3, 37), torch.bfloat16, device, 13)
    res = _leaf((2, 3, 37), torch.float32, device, 14)
    w = _leaf((37,), torch.bfloat16, device, 15)
    y, h = rms_norm_residual(x, res, w)
    y_ref, h_ref = rms_norm_residual_reference(x, res, w)
    assert h.dtype == torch.float32
    _close(h, h_ref, **_exact_add_tol(torch.float32))
    _close(y, y_ref, 1e-5, 1e-5)
    loss = y.sum() + (h * h_ref.detach()).sum()
    dx, dres = torch.autograd.grad(loss, (x, res))
    loss_ref = y_ref.sum() + (h_ref * h_ref.detach()).sum()
    dx_ref, dres_ref = torch.autograd.grad(loss_ref, (x, res))
    _close(dx, dx_ref, 2e-2, 2e-2)
    _close(dres, dres_ref, 1e-4, 1e-4)


@pytest.mark.usefixtures("triton_loop_path")
def test_rms_norm_non_contiguous_input(device):
    base = _leaf((37, 6), torch.float32, device, 16)
    x = base.t()  # [6, 37] with column stride 6
    w = _leaf((37,), torch.float32, device, 17)
    y = rms_norm(x, w)
    _close(y, rms_norm_reference(x, w), 1e-5, 1e-5)
    (dbase,) = torch.autograd.grad(y.sum(), base)
    (dbase_ref,) = torch.autograd.grad(rms_norm_reference(x, w).sum(), base)
    _close(dbase, dbase_ref, 1e-5, 1e-5)


def test_config_is_fused_up_to_the_cap_and_looped_beyond():
    for n in (1, 37, 4096, MAX_FUSED_WIDTH):
        cfg = rms_norm_config(n)
        assert cfg.n_chunks == 1 and cfg.block >= n, (n, cfg)
    for n in (MAX_FUSED_WIDTH + 1, 16384, 65536, 131072 + 37):
        cfg = rms_norm_config(n)
        assert cfg.block == LOOPED_BLOCK and cfg.n_chunks == -(-n // LOOPED_BLOCK), (n, cfg)
    assert rms_norm_config(37, max_fused_width=16, looped_block=16).n_chunks == 3
    with pytest.raises(ValueError, match="n_cols=0"):
        rms_norm_config(0)


def _small_looped(n_cols: int):
    """The looped path on a small row: 16-column chunks (3 for 37 columns, 9 for 129)."""
    return rms_norm_config(n_cols, max_fused_width=8, looped_block=16)


@pytest.mark.usefixtures("triton_loop_path")
@pytest.mark.parametrize("shape", [(1, 37), (5, 129), (7, 64), (3, 17)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_looped_path_matches_reference(shape, residual, dtype, atol, rtol, device):
    """Launchers forced onto the looped path (rows in 16-column chunks), forward and
    backward (with the incoming new_residual gradient for the residual variant)."""
    cfg = _small_looped(shape[-1])
    assert cfg.n_chunks > 1
    x = _leaf(shape, dtype, device, 20, scale=3.0)
    res = _leaf(shape, dtype, device, 21) if residual else None
    w = _leaf(shape[-1:], dtype, device, 22)
    dy = _leaf(shape, dtype, device, 23).detach()
    dh = _leaf(shape, dtype, device, 24).detach() if residual else None

    with torch.no_grad():
        y, h, rstd = rms_norm_forward(x, w, 1e-6, residual=res, config=cfg)
        normed = h if residual else x
        dx, dw = rms_norm_backward(dy, normed, w, rstd, dh=dh, config=cfg)

    if residual:
        y_ref, h_ref = rms_norm_residual_reference(x, res, w, 1e-6)
        _close(h, h_ref, **_exact_add_tol(dtype))
        dx_ref, dw_ref = torch.autograd.grad((y_ref, h_ref), (x, w), (dy, dh))
    else:
        y_ref = rms_norm_reference(x, w, 1e-6)
        dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    _close(y, y_ref, atol, rtol)
    _close(dx, dx_ref, atol, rtol)
    _close(dw, dw_ref, atol * 4, rtol)


@pytest.mark.usefixtures("triton_loop_path")
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_rows_wider_than_the_fused_cap_take_the_looped_path(dtype, atol, rtol, device):
    """Through the public ops and autograd, at the smallest default looped width plus an
    awkward remainder: MAX_FUSED_WIDTH + 37 columns (3 chunks of LOOPED_BLOCK)."""
    shape = (3, MAX_FUSED_WIDTH + 37)
    assert rms_norm_config(shape[-1]).n_chunks == 3
    x = _leaf(shape, dtype, device, 30, scale=3.0)
    res = _leaf(shape, dtype, device, 31)
    w = _leaf(shape[-1:], dtype, device, 32)
    dy = _leaf(shape, dtype, device, 33).detach()

    y = rms_norm(x, w)
    assert type(y.grad_fn).__name__ == "_RMSNormFnBackward"
    y_ref = rms_norm_reference(x, w)
    _close(y, y_ref, atol, rtol)
    for got, want in zip(
        torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(y_ref, (x, w), dy), strict=True
    ):
        _close(got, want, atol * 4, rtol)

    yr, hr = rms_norm_residual(x, res, w)
    yr_ref, hr_ref = rms_norm_residual_reference(x, res, w)
    _close(hr, hr_ref, **_exact_add_tol(dtype))
    _close(yr, yr_ref, atol, rtol)
    grads = torch.autograd.grad(yr, (x, res, w), dy)
    grads_ref = torch.autograd.grad(yr_ref, (x, res, w), dy)
    for got, want in zip(grads, grads_ref, strict=True):
        _close(got, want, atol * 4, rtol)


def test_reference_matches_torch_rms_norm():
    x = torch.randn(4, 37)
    w = torch.randn(37)
    expected = torch.nn.functional.rms_norm(x, (37,), w, 1e-6)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), expected)
