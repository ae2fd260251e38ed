"""Gradient clipping by the global norm over every rank of a pipeline (and its replicas).

``graphpipe.clip_grad_norm_(pipe, max_norm, norm_type)`` (``GradClipper.clip``) computes the
norm of the gradients of every parameter of the whole model, each counted once, and scales
them all by
``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule):

* on each rank, the parameters of its local stages, deduplicated (a tied weight shared by two
  local stages counts once; a weight tied across ranks, ``graphpipe.mark_tied``, on its
  lowest rank only), give ``sum |g|^p`` (for ``inf``: ``max |g|``);
* those partial sums are all-reduced over the **pipeline group** only: every parameter lives
  on exactly one pipeline rank, and after the data-parallel reduction of the step
  (``data_parallel``) every replica holds the same gradients, so reducing over the replicas
  too would count each parameter ``D`` times (and every replica computes the same norm);
* expert parameters (mixture of experts) differ across the pipeline's ``expert_groups.
  ep_group``, each rank holding ``E / ep`` of every MoE block's experts: their share is
  reduced over that group first;
* DTensor gradients (tensor parallel, FSDP2) count their local shard, reduced over the mesh
  dims that shard them (a replicated dim holds copies: counted once);
* the scale is a tensor, applied with no host synchronization (no ``.item()``, no branch on
  the norm), so it can run inside a captured step.

``Pipeline(..., clip_grad_norm=max_norm)`` runs it inside every training step
(``GradClipper.in_step``), as a trailing instruction of the program after the data-parallel
reductions (in the static step and its CUDA graph under capture, before
``capture_optimizer`` steps); the norm is then
``pipe.grad_norm``. May touch: the ``.grad`` of the pipeline's parameters (scaled in place),
the pipeline group (one all-reduce of one element).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.meta import is_dtensor
from graphpipe.roles import ExpertGroups, is_expert

from ..core.context import RankContext
from ..core.program import StepHooks, Trailing
from ..core.tensors import local_shard
from .accumulation import GradSync

__all__ = ["GradClipper", "check_clip_args"]


def check_clip_args(max_norm: float, norm_type: float) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; ``ValueError`` naming a bad one."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type <= 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return float(max_norm), float(norm_type)


class GradClipper:
    """Clips the gradients of one pipeline rank's parameters by the global norm.

    ctx: the rank (its parameters, pipeline group, device). expert_groups: the pipeline's
    ``ExpertGroups`` (None without sharded experts). ``norm``: the norm of the last in-step
    clip (``in_step``).
    """

    def __init__(
        self,
        ctx: RankContext,
        expert_groups: ExpertGroups | None = None,
        counted_elsewhere: set[int] = frozenset(),
    ) -> None:
        self.ctx = ctx
        self.counted_elsewhere = counted_elsewhere  # ids of tied copies another rank counts
        self.ep_group = expert_groups.ep_group if expert_groups is not None else None
        self.norm: torch.Tensor | None = None
        self._reduced: Any = None

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient of this rank by the global norm; return the norm (see the
        module doc). Every rank of the pipeline calls it."""
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        ctx = self.ctx
        params = [p for p in ctx.parameters() if p.grad is not None]
        grads = [local_shard(p.grad) for p in params]
        dtype = torch.float32
        for g in grads:
            dtype = torch.promote_types(dtype, g.dtype)
        inf = math.isinf(norm_type)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        local = None
        parts = []
        for groups, share in self._shares(params).items():
            part = _partial(share, norm_type, dtype, ctx.device)
            for g in groups:  # the shards of these gradients on other ranks
                dist.all_reduce(part, op=op, group=g)
            parts.append(part)
            local = part if local is None else torch.maximum(local, part) if inf else local + part
        if local is None:
            local = torch.zeros((), dtype=dtype, device=ctx.device)
        if ctx.num_ranks > 1:
            dist.all_reduce(local, op=op, group=ctx.group)
        # Held until the next clip: the gloo worker thread that reduced them may release its
        # work after this returns, and must not be the one to free their Python objects
        # (it would need the GIL, fatal at interpreter exit: runtime/coordination/lifetime.py).
        self._reduced = (local, parts)
        total = local if inf else local.pow(1.0 / norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dt, gs in by_dtype.items():
            torch._foreach_mul_(gs, scale.to(dt))
        return total

    def _shares(self, params: list[nn.Parameter]) -> dict[tuple, list[torch.Tensor]]:
        """This rank's gradients by the groups whose ranks hold their other shards: none for a
        plain gradient (counted once: a tied copy another rank counts is left out), the ep
        group for sharded experts, a DTensor's mesh dims that shard it (tensor parallel,
        FSDP2; replicated dims hold copies and count once)."""
        shares: dict[tuple, list[torch.Tensor]] = {(): []}
        skip = self.counted_elsewhere
        ep = self.ep_group
        sharded_experts = ep is not None and dist.get_world_size(ep) > 1
        for p in params:
            if id(p) in skip:
                continue
            g = p.grad
            groups: tuple = ()
            if is_dtensor(g):
                groups = _shard_groups(g)
                g = g.to_local()
            elif sharded_experts and is_expert(p):
                groups = (ep,)
            shares.setdefault(groups, []).append(g)
        return shares

    def in_step(
        self,
        max_norm: float,
        norm_type: float,
        grad_sync: GradSync | None = None,
        captured: bool = False,
    ) -> StepHooks:
        """The hooks that make every run of the training program end with ``clip`` (installed
        after the data-parallel reductions, when there are any): a trailing instruction in a
        ``clip_grad_norm`` range. The norm of the last step is ``norm``. Inside
        ``no_sync`` (``grad_sync.sync`` false) nothing is clipped: the gradients are this
        rank's partial sums; the step that reduces them clips the accumulated total.
        ``captured``: the step is captured, and ``norm`` is one tensor that every step
        (every capture's replays) writes: an assignment would be baked into the capture
        that made it."""
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        sync = grad_sync if grad_sync is not None else GradSync()

        def clip() -> None:
            if not sync.sync:
                return
            norm = self.clip(max_norm, norm_type)
            if captured and self.norm is not None and self.norm.dtype == norm.dtype:
                self.norm.copy_(norm)
            else:
                self.norm = norm

        return StepHooks(trailing=(Trailing(handler=clip, name="clip_grad_norm"),))


def _partial(
    grads: list[torch.Tensor], norm_type: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``sum |g|^p`` over ``grads`` (``max |g|`` for ``inf``), 0-dim ``dtype``."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack([n.to(dtype) for n in torch._foreach_norm(grads, norm_type)])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def _shard_groups(g: Any) -> tuple:
    """The process groups of the mesh dims that shard the DTensor gradient ``g``."""
    groups = []
    for dim, placement in enumerate(g.placements):
        if placement.is_partial():
            raise ValueError(
                f"a gradient of shape {list(g.shape)} is a DTensor with a pending reduction "
                f"({g.placements}): clip after the gradients are reduced"
            )
        if placement.is_shard():
            groups.append(g.device_mesh.get_group(dim))
    return tuple(groups)
