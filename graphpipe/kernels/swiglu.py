# Fused SwiGLU activation: silu(gate) * up (Triton forward and backward).
#
# Memory-traffic floor, per element of gate (E elements, element size s bytes). Read by
# tests/benchmarks/bench_kernels.py through SWIGLU_TRAFFIC_FLOOR (elements moved per
# gate element, multiply by E * s):
#
#   fwd: read gate, up, write out           = 3 s bytes / element
#   bwd: read gate, up, dout, write dgate, dup = 5 s bytes / element
#
# gate and up may be row-strided views (e.g. the two halves of one fused projection,
# `proj(x).chunk(2, -1)`): the kernels take a row stride per tensor instead of copying.
"""Fused SwiGLU kernel: ``swiglu(gate, up) = silu(gate) * up``."""

from __future__ import annotations

import math

import torch

from ._dispatch import LaunchConfig, device_guard, tl, triton, use_triton

SWIGLU_TRAFFIC_FLOOR: tuple[int, int] = (3, 5)
_MAX_BLOCK = 1024


# --------------------------------------------------------------------------- kernels


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr,
    u_ptr,
    y_ptr,
    n_cols,
    stride_g,
    stride_u,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr,
    g_ptr,
    u_ptr,
    dg_ptr,
    du_ptr,
    n_cols,
    stride_dy,
    stride_g,
    stride_u,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # silu'(g) = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    out = row * n_cols + cols
    tl.store(dg_ptr + out, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + out, du.to(du_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """2-D [rows, cols] view with unit column stride, copying only when unavoidable."""
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1]) if t.dim() != 2 else t
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def swiglu_config(n_cols: int) -> LaunchConfig:
    """The launch configuration for rows of ``n_cols``: the grid is (rows, ``n_chunks``)."""
    block = min(_MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1)))
    num_warps = 4 if block >= 512 else 2 if block >= 128 else 1
    return LaunchConfig(block, num_warps, triton.cdiv(max(n_cols, 1), block))


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel on 2-D ``gate``/``up`` with unit column stride.

    Returns a contiguous ``silu(gate) * up`` in ``gate.dtype``.
    """
    n_rows, n_cols = gate.shape
    y = torch.empty(n_rows, n_cols, dtype=gate.dtype, device=gate.device)
    if y.numel() > 0:
        cfg = swiglu_config(n_cols)
        with device_guard(gate):
            _swiglu_fwd_kernel[(n_rows, cfg.n_chunks)](
                gate,
                up,
                y,
                n_cols,
                gate.stride(0),
                up.stride(0),
                BLOCK=cfg.block,
                num_warps=cfg.num_warps,
            )
    return y


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns contiguous ``(dgate, dup)``."""
    n_rows, n_cols = gate.shape
    dg = torch.empty(n_rows, n_cols, dtype=gate.dtype, device=gate.device)
    du = torch.empty(n_rows, n_cols, dtype=up.dtype, device=up.device)
    if dg.numel() > 0:
        cfg = swiglu_config(n_cols)
        with device_guard(gate):
            _swiglu_bwd_kernel[(n_rows, cfg.n_chunks)](
                dy,
                gate,
                up,
                dg,
                du,
                n_cols,
                dy.stride(0),
                gate.stride(0),
                up.stride(0),
                BLOCK=cfg.block,
                num_warps=cfg.num_warps,
            )
    return dg, du


# --------------------------------------------------------------------------- autograd


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g2, u2 = _as_rows(gate), _as_rows(up)
        y = swiglu_forward(g2, u2)
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g2, u2 = ctx.saved_tensors
        dg, du = swiglu_backward(_as_rows(dy), g2, u2)
        return dg.view(ctx.shape), du.view(ctx.shape)


# --------------------------------------------------------------------------- public API


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``silu(gate) * up`` computed in float32, returned in ``gate.dtype``."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up`` for same-shaped ``gate`` and ``up``.

    Computed in float32, returned in ``gate.dtype``. Triton on CUDA, torch reference on
    CPU; see ``graphpipe.kernels._dispatch`` for the ``GRAPHPIPE_KERNELS`` override.
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if use_triton(gate):
        if gate.dim() == 0:
            return _SwiGLUFn.apply(gate.reshape(1), up.reshape(1)).reshape(())
        return _SwiGLUFn.apply(gate, up)
    return swiglu_reference(gate, up)


__all__ = [
    "SWIGLU_TRAFFIC_FLOOR",
    "swiglu",
    "swiglu_backward",
    "swiglu_config",
    "swiglu_forward",
    "swiglu_reference",
]
