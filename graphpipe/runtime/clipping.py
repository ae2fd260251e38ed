"""Gradient clipping by the global norm over every rank of a pipeline (and its replicas).

``clip_grad_norm_(pipe, max_norm, norm_type)`` computes the norm of the gradients of every
parameter of the whole model, each counted once, and scales them all by
``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule):

* on each rank, the parameters of its local stages, deduplicated (a tied weight shared by two
  local stages counts once), give ``sum |g|^p`` (for ``inf``: ``max |g|``);
* those partial sums are all-reduced over the **pipeline group** only: every parameter lives
  on exactly one pipeline rank, and after the data-parallel reduction of the step
  (``data_parallel``) every replica holds the same gradients, so reducing over the replicas
  too would count each parameter ``D`` times (and every replica computes the same norm);
* expert parameters (mixture of experts) differ across the pipeline's ``expert_groups.
  ep_group``, each rank holding ``E / ep`` of every MoE block's experts: their share is
  reduced over that group first;
* the scale is a tensor, applied with no host synchronization (no ``.item()``, no branch on
  the norm), so it can run inside a captured step.

``Pipeline(..., clip_grad_norm=max_norm)`` runs it inside every training step, as a trailing
instruction of the program after the data-parallel reductions (in the static step and its
CUDA graph under capture, before ``capture_optimizer`` steps); the norm is then
``pipe.grad_norm``. May touch: the ``.grad`` of the pipeline's parameters (scaled in place),
the pipeline group (one all-reduce of one element).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from graphpipe.models.moe import is_expert_parameter

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["check_clip_args", "clip_grad_norm_", "clip_in_step"]


def check_clip_args(max_norm: float, norm_type: float) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; ``ValueError`` naming a bad one."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type <= 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return float(max_norm), float(norm_type)


def clip_grad_norm_(pipe: Pipeline, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``pipe``'s parameters by their global norm; return the norm.

    Call it on every rank of every replica after ``pipe.step`` (it all-reduces over the
    pipeline group). The norm is the same 0-dim tensor on every rank (float32, or float64
    when a gradient is float64), computed before clipping, as
    ``torch.nn.utils.clip_grad_norm_`` over the model's unique parameters returns it. No host
    synchronization: to clip inside a captured step, pass ``clip_grad_norm=max_norm`` to the
    pipeline instead (the norm is then ``pipe.grad_norm``).
    """
    max_norm, norm_type = check_clip_args(max_norm, norm_type)
    params = [p for p in pipe._params() if p.grad is not None]
    grads = [p.grad for p in params]
    dtype = torch.float32
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    ep = pipe.expert_groups.ep_group if pipe.expert_groups is not None else None
    if ep is not None and dist.get_world_size(ep) > 1:
        experts = [p.grad for p in params if is_expert_parameter(p)]
        share = _partial(experts, norm_type, dtype, pipe.device)
        dist.all_reduce(share, op=op, group=ep)  # every rank's share of the experts
        rest = _partial(
            [p.grad for p in params if not is_expert_parameter(p)], norm_type, dtype, pipe.device
        )
        local = torch.maximum(rest, share) if inf else rest + share
    else:
        local = _partial(grads, norm_type, dtype, pipe.device)
    if pipe.num_ranks > 1:
        dist.all_reduce(local, op=op, group=pipe.group)
    total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dt, gs in by_dtype.items():
        torch._foreach_mul_(gs, scale.to(dt))
    return total


def _partial(
    grads: list[torch.Tensor], norm_type: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``sum |g|^p`` over ``grads`` (``max |g|`` for ``inf``), 0-dim ``dtype``."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack([n.to(dtype) for n in torch._foreach_norm(grads, norm_type)])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def clip_in_step(pipe: Pipeline, max_norm: float, norm_type: float) -> None:
    """Make every training step of ``pipe`` end with ``clip_grad_norm_`` (after the
    data-parallel reductions, when there are any): a trailing instruction of its program, in
    a ``clip_grad_norm`` range. The norm of the last step is ``pipe.grad_norm``."""
    max_norm, norm_type = check_clip_args(max_norm, norm_type)

    def clip() -> None:
        pipe.grad_norm = clip_grad_norm_(pipe, max_norm, norm_type)

    pipe._train.append(handler=clip, name="clip_grad_norm")
