"""FSDP2-sharded stages inside the step: unshard early, accumulate, reduce-scatter once.

A stage sharded with ``fully_shard(stage, mesh=dp_mesh)`` (its blocks optionally sharded too)
runs under every schedule, with ``dp_group=mesh.get_group("dp")`` passed for the loss. FSDP's
own hooks would all-gather and reduce-scatter around every micro-batch's forward and backward,
and its post-backward would fire after an ``I`` whose weight gradients a later ``W`` still
adds. So, per training step (torch's recipe for pipelines, the one ``PipelineStage`` uses):

* **At the start of the step** (the first instruction), every FSDP module of this rank gets
  ``set_requires_gradient_sync(False)``, ``set_is_last_backward(False)`` and
  ``set_reshard_after_backward(False)``: FSDP's hooks only accumulate the unsharded
  gradients, whatever the order of ``F``, ``I``, ``B`` and ``W``; and each module's
  all-gather is posted (``unshard(async_op=True)``, waited for by FSDP's pre-forward), so the
  parameters are unsharded before the stage's first compute. With
  ``reshard_after_forward=False`` they then stay unsharded until the stage's gradients are
  final; with ``True`` FSDP reshards after every forward and gathers again for the next
  forward or backward (less memory, more all-gathers), as it does outside a pipeline.
* **After the stage's last ``B``, ``I`` or ``W`` of the step** (``StepHooks.after_grads``) the
  flags are set back and FSDP's post-backward runs for every parameter group of the stage
  (the reduce-scatter into the sharded ``.grad``, then the reshard), then its root's final
  callback; the rest of the step goes on.
* **Gradients and the loss.** FSDP divides the reduce-scattered gradients by the dp size (the
  mean over the replicas); with ``loss_reduction="sum"`` the divide factor is set to 1. The
  parameters FSDP manages are left out of graphpipe's own data-parallel averaging
  (``managed``); the loss is averaged over ``dp_group`` as for replicated stages.
* **Inference** (``pipe.forward``) resharding is FSDP's own, and the modules are resharded
  at the end of the call.
* **Capture** needs ``reshard_after_forward=False`` (gathering and freeing around every
  micro-batch inside a captured step is refused) and ``capture="step"`` (per-action graphs
  would have FSDP2's collectives and frees run between them): a ``ValueError`` says so.

torch offers no public call for "reduce-scatter the accumulated gradients now", so this part
reaches into FSDP2's state the way ``torch.distributed.pipelining`` does
(``fully_shard.state(m)._state_ctx.all_states``, ``FSDPParamGroup.post_backward``,
``_root_post_backward_final_callback``; torch 2.11 keeps one parameter group per state where
2.13 keeps a list: ``param_groups`` reads either).

Owns: the flags it sets on the FSDP modules. May touch: the FSDP modules of this rank's
stages (their state, their all-gathers and reduce-scatters, their sharded ``.grad``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..core.context import RankContext
from ..core.program import StepHooks, Trailing
from .accumulation import GradSync

__all__ = ["ShardedStages", "check_fsdp", "fsdp_modules", "param_groups"]


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules inside ``module`` (itself included), in module order; none when FSDP
    was never imported (a module never imported cannot have sharded a stage)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [m for m in module.modules() if isinstance(m, fsdp.FSDPModule)]


def _roots(mods: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of ``mods`` that no other one contains (each one FSDP root)."""
    inner = {id(c) for m in mods for c in m.modules() if c is not m}
    return [m for m in mods if id(m) not in inner]


def param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: ``_fsdp_param_groups`` (torch 2.13), or the one
    ``_fsdp_param_group`` (None when it manages no parameter) of torch 2.11 and 2.12."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


def _root_groups(root: nn.Module) -> list[Any]:
    """Every parameter group of the FSDP2 states under ``root`` (its own and its inner
    modules')."""
    from torch.distributed.fsdp import fully_shard

    states = fully_shard.state(root)._state_ctx.all_states
    return [group for st in states for group in param_groups(st)]


def _reshards_after_forward(module: nn.Module) -> bool:
    """Whether FSDP reshards ``module``'s parameters after forward (its policy)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    return any(g.post_forward_mesh_info is not None for g in param_groups(state))


class ShardedStages:
    """The FSDP2 stages of one pipeline rank (see the module doc).

    ctx: the rank. loss_reduction: ``"mean"`` or ``"sum"``. What it runs inside the steps:
    ``step_hooks`` (training) and ``infer_hooks``. The capture policy is checked before
    (``check_fsdp``).
    """

    name = "fsdp"

    def __init__(
        self, ctx: RankContext, loss_reduction: str, grad_sync: GradSync | None = None
    ) -> None:
        self.stage_ids = ctx.stage_ids
        self.grad_sync = grad_sync if grad_sync is not None else GradSync()
        self.modules = {li: fsdp_modules(m) for li, m in enumerate(ctx.modules)}
        self.roots = {li: _roots(ms) for li, ms in self.modules.items()}
        self.all = [m for ms in self.modules.values() for m in ms]
        self.managed = {id(p) for m in self.all for p in m.parameters()}
        self.started = False
        if not self.all:
            return
        if loss_reduction == "sum":
            for m in self.all:  # the sum over the replicas, not their mean
                m.set_gradient_divide_factor(1.0)

    def step_hooks(self) -> StepHooks:
        """In the training step: ``begin`` first, each stage's ``finish`` after its last
        gradient."""
        if not self.all:
            return StepHooks()
        return StepHooks(
            first=(self.begin,),
            after_grads=tuple(
                (s, functools.partial(self.finish, li))
                for li, s in enumerate(self.stage_ids)
                if self.roots[li]
            ),
            after_weights=tuple(
                (s, functools.partial(self.fold, li))
                for li, s in enumerate(self.stage_ids)
                if self.roots[li]
            ),
        )

    def fold(self, li: int) -> None:
        """After a ``W`` of local stage ``li``: its deferred weight gradients, written into
        the unsharded ``.grad`` (the parameter dtype), go into FSDP2's accumulated gradient
        now, as FSDP's post-backward does with autograd's after every backward. Else a later
        backward's autograd would add its gradient to them in the parameter dtype first:
        one rounding more under bf16 parameters with a float32 ``reduce_dtype``."""
        for root in self.roots[li]:
            for group in _root_groups(root):
                for p in group.fsdp_params:
                    p.accumulate_unsharded_grad_if_needed()
                    p.to_accumulated_grad_if_needed()

    def infer_hooks(self) -> StepHooks:
        """After a forward-only run: ``reshard``."""
        if not self.all:
            return StepHooks()
        return StepHooks(trailing=(Trailing(handler=self.reshard, name="fsdp reshard"),))

    def begin(self) -> None:
        """The start of a training step: accumulate only, and post every all-gather."""
        for m in self.all:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for m in self.roots_all():
            m.set_is_last_backward(False)
        if self.started:  # FSDP initializes its roots in their first forward
            for m in self.all:
                m.unshard(async_op=True)
        self.started = True

    def roots_all(self) -> list[nn.Module]:
        return [m for ms in self.roots.values() for m in ms]

    def finish(self, li: int) -> None:
        """Local stage ``li``'s gradients are final: reduce-scatter them and reshard. Inside
        ``no_sync`` nothing: the unsharded gradients go on accumulating (and the parameters
        stay unsharded) until the step that reduces."""
        from torch.distributed.fsdp import fully_shard

        if not self.grad_sync.sync:
            return
        for m in self.modules[li]:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
        for root in self.roots[li]:
            root.set_is_last_backward(True)
            for group in _root_groups(root):
                group.post_backward()
            fully_shard.state(root)._root_post_backward_final_callback()

    def reshard(self) -> None:
        """The end of an inference call: free the unsharded parameters."""
        for m in self.all:
            m.reshard()


def check_fsdp(modules: Sequence[nn.Module], capture: str | None, dp_group: Any) -> None:
    """Before the ranks join (no collective): FSDP stages need ``dp_group`` (the loss is
    averaged over it), and capture needs ``reshard_after_forward=False``; ``ValueError``
    naming the module otherwise."""
    mods = [m for stage in modules for m in fsdp_modules(stage)]
    if not mods:
        return
    if dp_group is None:
        raise ValueError(
            f"the stages hold FSDP2 modules ({type(mods[0]).__name__}): pass "
            "dp_group=mesh.get_group('dp'), the group they are sharded over, so that the "
            "loss is the mean over the replicas"
        )
    if capture == "action":
        raise ValueError(
            f"capture='action' with FSDP2 modules ({type(mods[0]).__name__}): FSDP2's "
            "all-gathers and reduce-scatters would run between the per-action graphs, "
            "freeing and re-allocating the parameters the graphs read, and a graph's "
            "pre-forward would wait on an all-gather started outside it; use capture='step' "
            "(one graph holds them all)"
        )
    if capture is not None:
        eager = [m for m in mods if _reshards_after_forward(m)]
        if eager:
            name = type(eager[0]).__name__
            raise ValueError(
                f"capture={capture!r} with an FSDP2 module ({name}) that reshards after "
                "forward: a captured step cannot gather and free the parameters around "
                "every micro-batch; shard it with fully_shard(..., "
                "reshard_after_forward=False) (the parameters then stay unsharded from "
                "the stage's first compute to its last gradient action)"
            )
