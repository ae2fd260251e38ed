# Fused cross-entropy over a [rows, vocab] logits matrix (Triton forward and backward).
#
# Memory-traffic floor, per logit (E = rows * vocab elements, element size s bytes; the
# per-row target, loss and logsumexp are O(rows) and left out). Read by
# tests/benchmarks/bench_kernels.py through CROSS_ENTROPY_TRAFFIC_FLOOR (elements moved
# per logit, multiply by E * s):
#
#   fwd: read logits                        = 1 s bytes / element
#   bwd: read logits, write dlogits         = 2 s bytes / element
#
# Forward: one program per row runs an online softmax over the vocab in BLOCK-wide
# chunks, storing the row loss and the row logsumexp (float32). Backward: one program per
# row writes (softmax - onehot) * grad_output / n_valid straight into the single
# [rows, vocab] gradient tensor that autograd receives (no temporary, no rescale pass).
# The mean's divisor n_valid stays a device tensor (no host sync); with zero valid rows
# the loss is 0 / 0 = nan, exactly like torch.nn.functional.cross_entropy. Ignored rows
# read no logits and get zero gradient. Targets outside [0, vocab) (other than
# ignore_index) are not checked (that would need a sync): results for them are undefined.
"""Fused cross-entropy kernel: ``cross_entropy(logits, target)``."""

from __future__ import annotations

import torch

from ._dispatch import LaunchConfig, device_guard, tl, triton, use_triton

CROSS_ENTROPY_TRAFFIC_FLOOR: tuple[int, int] = (1, 2)
IGNORE_INDEX = -100
_MAX_BLOCK = 4096
_FLOAT32_LOWEST = -3.4028234663852886e38


# --------------------------------------------------------------------------- kernels


@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,
    target_ptr,
    loss_ptr,
    lse_ptr,
    n_cols,
    stride_row,
    ignore_index,
    FLOAT32_LOWEST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    # Running max starts at the lowest finite float so exp(m - m_new) never sees
    # (-inf) - (-inf); an all -inf row still ends at lse = -inf and loss nan, like torch.
    m = tl.full([], FLOAT32_LOWEST, tl.float32)
    d = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    x_target = tl.load(base + target, mask=valid, other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_target, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    logits_ptr,
    target_ptr,
    lse_ptr,
    grad_out_ptr,
    n_valid_ptr,
    dlogits_ptr,
    n_cols,
    stride_row,
    stride_grad_row,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    grad_base = dlogits_ptr + row * stride_grad_row
    cols = tl.arange(0, BLOCK)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    lse = tl.load(lse_ptr + row)
    # max(n_valid, 1): with no valid row nothing uses the scale, so avoid 0 / 0 there.
    scale = tl.load(grad_out_ptr).to(tl.float32) / tl.maximum(tl.load(n_valid_ptr), 1.0)
    # Ignored rows read nothing (zero load width); their gradient is written as zeros.
    n_load = tl.where(valid, n_cols, 0)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        mask = idx < n_cols
        x = tl.load(base + idx, mask=idx < n_load, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        g = tl.where(idx == target, p - 1.0, p) * scale
        g = tl.where(valid, g, 0.0)
        tl.store(grad_base + idx, g.to(dlogits_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers


def cross_entropy_config(n_cols: int, block_size: int | None = None) -> LaunchConfig:
    """The launch configuration for a vocab of ``n_cols``: one program per row looping over
    ``n_chunks`` chunks of ``block`` logits; ``block_size`` overrides the chunk width."""
    block = block_size or min(_MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1)))
    if block & (block - 1):
        raise ValueError(f"block_size must be a power of two, got {block}")
    num_warps = 8 if block >= 2048 else 4 if block >= 512 else 1
    return LaunchConfig(block, num_warps, triton.cdiv(max(n_cols, 1), block))


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(1) == 1 or logits.shape[1] <= 1 else logits.contiguous()


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    ``logits`` is 2-D with unit column stride, ``target`` 1-D int64. Returns
    ``(loss, lse, n_valid)``: the mean loss over non-ignored rows (0-d, ``logits.dtype``),
    the float32 per-row logsumexp and the float32 0-d count of non-ignored rows, all
    device tensors.
    """
    n_rows, n_cols = logits.shape
    cfg = cross_entropy_config(n_cols, block_size)
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows > 0:
        with device_guard(logits):
            _cross_entropy_fwd_kernel[(n_rows,)](
                logits,
                target,
                loss_rows,
                lse,
                n_cols,
                logits.stride(0),
                ignore_index,
                FLOAT32_LOWEST=_FLOAT32_LOWEST,
                BLOCK=cfg.block,
                num_warps=cfg.num_warps,
            )
    n_valid = (target != ignore_index).sum().to(torch.float32)
    loss = (loss_rows.sum() / n_valid).to(logits.dtype)
    return loss, lse, n_valid


def cross_entropy_backward(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    block_size: int | None = None,
) -> torch.Tensor:
    """Launch the backward kernel; returns ``d loss / d logits``.

    The result is the only [rows, vocab] allocation: the kernel writes the scaled
    gradient ``(softmax - onehot) * grad_output / n_valid`` into it in ``logits.dtype``.
    """
    n_rows, n_cols = logits.shape
    cfg = cross_entropy_config(n_cols, block_size)
    grad = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    if n_rows > 0:
        with device_guard(logits):
            _cross_entropy_bwd_kernel[(n_rows,)](
                logits,
                target,
                lse,
                grad_output,
                n_valid,
                grad,
                n_cols,
                logits.stride(0),
                grad.stride(0),
                ignore_index,
                BLOCK=cfg.block,
                num_warps=cfg.num_warps,
            )
    return grad


# --------------------------------------------------------------------------- autograd


class _CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        block_size: int | None,
    ) -> torch.Tensor:
        logits = _as_rows(logits)
        loss, lse, n_valid = cross_entropy_forward(logits, target, ignore_index, block_size)
        ctx.save_for_backward(logits, target, lse, n_valid)
        ctx.ignore_index = ignore_index
        ctx.block_size = block_size
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, target, lse, n_valid = ctx.saved_tensors
        grad = cross_entropy_backward(
            grad_output, logits, target, lse, n_valid, ctx.ignore_index, ctx.block_size
        )
        return grad, None, None, None


# --------------------------------------------------------------------------- public API


def cross_entropy_reference(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """``F.cross_entropy`` (mean over non-ignored rows) computed in float32."""
    loss = torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index)
    return loss.to(logits.dtype)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of 2-D ``logits`` [rows, vocab] against 1-D int64 ``target``.

    Same value as ``torch.nn.functional.cross_entropy(logits, target)`` with
    ``ignore_index=-100``: the mean over rows whose target is not ``ignore_index`` (nan
    when there are none). Computed in float32, returned in ``logits.dtype``.
    ``block_size`` (power of two) overrides the Triton vocab chunk width; tests use it to
    force several chunks per row. Triton on CUDA, torch reference on CPU; see
    ``graphpipe.kernels._dispatch`` for the ``GRAPHPIPE_KERNELS`` override.
    """
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(
            "cross_entropy expects logits [rows, vocab] and target [rows], got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    target = target.long().contiguous()  # no-ops for the usual contiguous int64 target
    if use_triton(logits, runtime_loops=True):
        return _CrossEntropyFn.apply(logits, target, ignore_index, block_size)
    return cross_entropy_reference(logits, target, ignore_index)


__all__ = [
    "CROSS_ENTROPY_TRAFFIC_FLOOR",
    "IGNORE_INDEX",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_config",
    "cross_entropy_forward",
    "cross_entropy_reference",
]
