# Fused RMSNorm and fused residual-add + RMSNorm (Triton forward and backward).
#
# Memory-traffic floor, for an input of R rows x N columns with element size s bytes
# (E = R * N elements; the weight (N * s), per-row rstd (4 R) and the dweight partials
# are O(N + R) and left out). Read by tests/benchmarks/bench_kernels.py through
# RMS_NORM_TRAFFIC_FLOOR and RMS_NORM_RESIDUAL_TRAFFIC_FLOOR (elements moved per input
# element, multiply by E * s):
#
#   rms_norm           fwd: read x, write y                        = 2 s bytes / element
#                      bwd: read x, dy, write dx                   = 3 s bytes / element
#   rms_norm_residual  fwd: read x, residual, write y, new_residual = 4 s bytes / element
#                      bwd: read new_residual, dy, d(new_residual),
#                           write dx (returned for residual too)   = 4 s bytes / element
#
# Two paths, chosen by rms_norm_config from the row width N:
#
# * Fused (N <= MAX_FUSED_WIDTH = 8192): one program normalises one whole row held in
#   registers, which meets the floor above. The backward is persistent: a fixed number of
#   programs loop over rows, each accumulating a float32 partial dweight row; torch sums the
#   partials. Why 8192: compiled for sm_90 with the launch configuration below, every fused
#   kernel is free of register spills up to 8192 columns, and the backward spills from 16384
#   on (32 warps, 64 registers per thread, 136-184 bytes of stack frame per thread in fp32 and
#   bf16; tests/kernels/test_compile_sm90.py, cuobjdump of the cubin).
# * Looped (N > MAX_FUSED_WIDTH): rows go in LOOPED_BLOCK-wide chunks. The forward makes two
#   passes over its row (sum of squares, then normalise; the residual variant stores
#   new_residual in the first pass and reads it back in the second): +1 s bytes / element
#   over the floor, the second read mostly from L2. The backward first computes the per-row
#   dot product mean(x_hat * w * dy) (read x, dy), then runs the persistent kernel on a 2-D
#   grid (programs x chunks) with that dot product as an input: +2 s bytes / element.
"""Fused RMSNorm kernels: ``rms_norm`` and ``rms_norm_residual``."""

from __future__ import annotations

import torch

from ._dispatch import LaunchConfig, device_guard, num_persistent_programs, tl, triton, use_triton

MAX_FUSED_WIDTH = 8192
LOOPED_BLOCK = 4096
RMS_NORM_TRAFFIC_FLOOR: tuple[int, int] = (2, 3)
RMS_NORM_RESIDUAL_TRAFFIC_FLOOR: tuple[int, int] = (4, 4)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _load_normalised_input(x_ptr, res_ptr, h_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """The float32 values to normalise: x, or with a residual new_residual = x + residual,
    stored to h_ptr and rounded to its dtype (exactly what a consumer of new_residual sees)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    rstd_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = _load_normalised_input(x_ptr, res_ptr, h_ptr, offs, mask, HAS_RESIDUAL)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    tl.store(rstd_ptr + row, rstd)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fwd_looped_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    rstd_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    cols = tl.arange(0, BLOCK)
    sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        mask = idx < n_cols
        x = _load_normalised_input(x_ptr, res_ptr, h_ptr, base + idx, mask, HAS_RESIDUAL)
        sum_sq += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        mask = idx < n_cols
        # The second pass reads back what the first stored (each element by the thread that
        # stored it: same arange, same layout), i.e. the rounded new_residual.
        if HAS_RESIDUAL:
            x = tl.load(h_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + idx, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_dot_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dot_ptr,
    n_cols,
    BLOCK: tl.constexpr,
):
    # Per row: mean(x_hat * w * dy), the row reduction of the backward (looped path).
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    cols = tl.arange(0, BLOCK)
    rstd = tl.load(rstd_ptr + row)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        mask = idx < n_cols
        dy = tl.load(dy_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        acc += x * rstd * (dy * w)
    tl.store(dot_ptr + row, tl.sum(acc, axis=0) / n_cols)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dot_ptr,
    dh_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    n_cols,
    HAS_DH: tl.constexpr,
    LOOPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Fused: program (p, 0) holds whole rows. Looped: program (p, j) holds column chunk j of
    # its rows and reads the row reduction from dot_ptr.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, n_rows, n_programs):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        w_dy = dy * w
        # d/dx of x * rstd(x): rstd * (w dy - x_hat * mean(w dy * x_hat))
        if LOOPED:
            c = tl.load(dot_ptr + row)
        else:
            c = tl.sum(x_hat * w_dy, axis=0) / n_cols
        dx = (w_dy - x_hat * c) * rstd
        if HAS_DH:
            dx += tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask)


# --------------------------------------------------------------------------- launchers


def rms_norm_config(
    n_cols: int, *, max_fused_width: int = MAX_FUSED_WIDTH, looped_block: int = LOOPED_BLOCK
) -> LaunchConfig:
    """The launch configuration for rows of ``n_cols`` (both directions): the fused path up to
    ``max_fused_width`` columns, else ``looped_block``-wide chunks (``n_chunks > 1``). Tests
    lower the two limits to run the looped path on small rows."""
    if n_cols < 1:
        raise ValueError(f"rms_norm needs at least one column, got n_cols={n_cols}")
    if n_cols <= max_fused_width:
        block = triton.next_power_of_2(n_cols)
    else:
        block = looped_block
    # ~8 fp32 elements per thread per row tensor: 4096 columns -> 16 warps, 8192 -> 32 (the
    # cap). Measured spill-free on sm_90 at these settings (test_compile_sm90.py).
    num_warps = min(32, max(4, block // 256))
    return LaunchConfig(block, num_warps, triton.cdiv(n_cols, block))


def _check_2d(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("launcher expects a contiguous 2-D [rows, cols] tensor")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({x.shape[1]},)")


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch the forward kernel on contiguous 2-D ``x`` (and ``residual``).

    Returns ``(y, new_residual, rstd)``: ``new_residual`` is ``x + residual`` (``None``
    without a residual) in the promoted dtype of the two, ``y`` the RMSNorm of
    ``new_residual`` (or of ``x``) in that same dtype, and ``rstd`` the float32 per-row
    reciprocal RMS kept for the backward. ``config`` defaults to ``rms_norm_config``'s.
    """
    _check_2d(x, weight)
    h: torch.Tensor | None = None
    if residual is not None:
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError("residual must be contiguous and shaped like x")
        # Same dtype rule as torch's `x + residual` (e.g. a float32 residual stream).
        h = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device
        )
    n_rows, n_cols = x.shape
    cfg = config or rms_norm_config(n_cols)
    kernel = _rms_norm_fwd_looped_kernel if cfg.n_chunks > 1 else _rms_norm_fwd_kernel
    weight = weight.contiguous()
    y = torch.empty_like(x if h is None else h)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        with device_guard(x):
            kernel[(n_rows,)](
                x,
                residual if residual is not None else x,
                weight,
                y,
                h if h is not None else y,
                rstd,
                n_cols,
                eps,
                HAS_RESIDUAL=residual is not None,
                BLOCK=cfg.block,
                num_warps=cfg.num_warps,
            )
    return y, h, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None = None,
    *,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel(s); all row tensors contiguous 2-D.

    ``x`` is the tensor that was normalised (``new_residual`` for the residual variant),
    ``dh`` the incoming gradient of ``new_residual``, added to ``dx``. Returns
    ``(dx, dweight)`` with ``dx`` in ``x.dtype`` and ``dweight`` in ``weight.dtype``.
    ``config`` defaults to ``rms_norm_config``'s.
    """
    _check_2d(x, weight)
    if dy.shape != x.shape or not dy.is_contiguous():
        raise ValueError("dy must be contiguous and shaped like x")
    if dh is not None and (dh.shape != x.shape or not dh.is_contiguous()):
        raise ValueError("dh must be contiguous and shaped like x")
    n_rows, n_cols = x.shape
    cfg = config or rms_norm_config(n_cols)
    looped = cfg.n_chunks > 1
    weight = weight.contiguous()
    # Looped: ~as many programs in all as the fused path, split over the column chunks.
    n_programs = num_persistent_programs(x.device, n_rows)
    if looped:
        n_programs = triton.cdiv(n_programs, cfg.n_chunks)
    dx = torch.empty_like(x)
    dw_partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x.device)
    # Per-row dot products (looped path); the fused kernel ignores the argument.
    dot = torch.empty(n_rows, dtype=torch.float32, device=x.device) if looped else rstd
    with device_guard(x):
        if looped and n_rows > 0:
            _rms_norm_bwd_dot_kernel[(n_rows,)](
                dy, x, weight, rstd, dot, n_cols, BLOCK=cfg.block, num_warps=cfg.num_warps
            )
        _rms_norm_bwd_kernel[(n_programs, cfg.n_chunks)](
            dy,
            x,
            weight,
            rstd,
            dot,
            dh if dh is not None else dy,
            dx,
            dw_partial,
            n_rows,
            n_cols,
            HAS_DH=dh is not None,
            LOOPED=looped,
            BLOCK=cfg.block,
            num_warps=cfg.num_warps,
        )
    return dx, dw_partial.sum(0).to(weight.dtype)


# --------------------------------------------------------------------------- autograd


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _rows(x)
        y, _, rstd = rms_norm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(_rows(dy), x2, weight, rstd)
        return dx.view(ctx.x_shape), dw if ctx.needs_input_grad[1] else None, None


class _RMSNormResidualFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x2 = _rows(x)
        y, h, rstd = rms_norm_forward(x2, weight, eps, residual=_rows(residual))
        assert h is not None
        ctx.save_for_backward(h, weight, rstd)
        ctx.x_shape = x.shape
        ctx.dtypes = (x.dtype, residual.dtype)
        # An unused output gets None, not a materialised zero tensor.
        ctx.set_materialize_grads(False)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, dh: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        x_dtype, res_dtype = ctx.dtypes
        if dy is None:
            # Only new_residual was used: d(x + residual) passes dh straight through.
            if dh is None:
                return None, None, None, None
            return dh.to(x_dtype), dh.to(res_dtype), None, None
        dx, dw = rms_norm_backward(_rows(dy), h, weight, rstd, dh=None if dh is None else _rows(dh))
        dx = dx.view(ctx.x_shape)
        # x and residual get the same gradient (as torch's add backward does); `.to` is a
        # no-op unless the two had different dtypes.
        return dx.to(x_dtype), dx.to(res_dtype), dw if ctx.needs_input_grad[2] else None, None


# --------------------------------------------------------------------------- public API


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain-torch RMSNorm over the last dim, computed in float32, returned in ``x.dtype``."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


def rms_norm_residual_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``(rms_norm(x + residual), x + residual)``."""
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading dims): ``x / rms(x) * weight``.

    Computed in float32, returned in ``x.dtype``. Triton on CUDA, torch reference on CPU;
    see ``graphpipe.kernels._dispatch`` for the ``GRAPHPIPE_KERNELS`` override.
    """
    if use_triton(x, runtime_loops=True):
        return _RMSNormFn.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm.

    Returns ``(normed, new_residual)`` with ``new_residual = x + residual`` (torch's
    promoted dtype, so a float32 residual stream stays float32) and
    ``normed = rms_norm(new_residual, weight, eps)``. Gradients of both outputs flow
    back to ``x`` and ``residual``.
    """
    if use_triton(x, runtime_loops=True):
        return _RMSNormResidualFn.apply(x, residual, weight, eps)
    return rms_norm_residual_reference(x, residual, weight, eps)


__all__ = [
    "LOOPED_BLOCK",
    "MAX_FUSED_WIDTH",
    "RMS_NORM_RESIDUAL_TRAFFIC_FLOOR",
    "RMS_NORM_TRAFFIC_FLOOR",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_config",
    "rms_norm_forward",
    "rms_norm_reference",
    "rms_norm_residual",
    "rms_norm_residual_reference",
]
