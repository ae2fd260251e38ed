"""Weights tied across pipeline ranks: copies kept equal, their gradients summed in the step.

A weight used by two stages on one rank is one ``Parameter`` and needs nothing. A weight used
by stages on different ranks (an input embedding tied to the output head when stage 0 and the
last stage are on different ranks, as under 1F1B) lives as one copy per rank, and the model
marks each copy with ``graphpipe.mark_tied(param, name)``. Then:

* **At construction** the ranks exchange the names they hold (one object all-gather over the
  pipeline group, only when some rank marked a parameter); the ranks that hold copies of the
  same names get a process group of their own (one per distinct set of holders, of the
  pipeline group's backend, created by the members only), and every copy starts from the one
  on the lowest pipeline rank (a broadcast).
* **In every training step**, after the stages' gradients are final (a trailing instruction
  of the program, ``tied grads``, after the data-parallel reductions when there are any: both
  are sums, so the order does not change the result), each holder set's gradients are summed
  over its ranks (and over several local copies of one name) in one flat all-reduce, and
  written back into every copy: the copies see the gradient of the one weight they stand for
  and stay equal under any deterministic optimizer.
* **A clipped norm** counts the weight once: ``counted_elsewhere`` names the copies whose
  norm another rank counts.

Owns: the tie groups and their flat buffers. May touch: the ``.grad`` (and, at construction,
the data) of the marked parameters, the tie groups, the pipeline group (one all-gather of the
names at construction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.roles import tied_name

from ..coordination.faults import CommFailure
from ..core.context import RankContext
from ..core.program import StepHooks, Trailing
from ..core.tensors import grad_or_zeros
from .accumulation import GradSync, in_window

__all__ = ["TiedWeights"]


class _HolderSet:
    """The tie names held by one set of ranks, and this rank's copies of them."""

    __slots__ = ("flat", "group", "names", "params", "size")

    def __init__(
        self, names: list[str], params: list[list[nn.Parameter]], group: Any, size: int
    ) -> None:
        self.names, self.params, self.group, self.size = names, params, group, size
        self.flat: torch.Tensor | None = None


class TiedWeights:
    """The tied weights of one pipeline rank (see the module doc)."""

    name = "tied grads"

    def __init__(self, ctx: RankContext, grad_sync: GradSync | None = None) -> None:
        self.grad_sync = grad_sync if grad_sync is not None else GradSync()
        local: dict[str, list[nn.Parameter]] = {}
        for p in ctx.parameters():
            name = tied_name(p)
            if name is not None:
                local.setdefault(name, []).append(p)
        self.sets: list[_HolderSet] = []
        self.counted_elsewhere: set[int] = set()
        holders = self._gather(ctx, sorted(local))
        if holders is None:
            return
        by_set: dict[tuple[int, ...], list[str]] = {}
        for name, ranks in sorted(holders.items()):
            by_set.setdefault(tuple(ranks), []).append(name)
        backend = dist.get_backend(ctx.group) if ctx.group is not None else None
        for ranks, names in sorted(by_set.items()):
            group = None
            if len(ranks) > 1:
                members = [ctx.global_ranks[r] for r in ranks]
                group = dist.new_group(members, backend=backend, use_local_synchronization=True)
            if ctx.rank not in ranks:
                continue
            params = [local[name] for name in names]
            if ctx.rank != ranks[0]:
                self.counted_elsewhere |= {id(p) for ps in params for p in ps}
            for ps in params:  # several local copies of one name: the first counts
                self.counted_elsewhere |= {id(p) for p in ps[1:]}
            hs = _HolderSet(names, params, group, len(ranks))
            self._start_equal(hs, ctx.global_ranks[ranks[0]])
            self.sets.append(hs)
        if self.sets:
            self.grad_sync.add(self.divide_existing)

    def step_hooks(self) -> StepHooks:
        """In the training step: the sum of the tied copies (``reduce``), trailing."""
        if not self.sets:
            return StepHooks()
        return StepHooks(trailing=(Trailing(handler=self.reduce, name=self.name),))

    @staticmethod
    def _gather(ctx: RankContext, mine: Sequence[str]) -> dict[str, list[int]] | None:
        """``{name: [pipeline ranks holding it]}`` over the pipeline (None: no rank marked
        any parameter)."""
        if ctx.num_ranks == 1:
            return {name: [0] for name in mine} or None
        flag = torch.tensor([len(mine)], dtype=torch.int64)
        if dist.get_backend(ctx.group) == "nccl":
            flag = flag.to(ctx.device)
        dist.all_reduce(flag, group=ctx.group)
        if int(flag.item()) == 0:
            return None
        every: list[Any] = [None] * ctx.num_ranks
        dist.all_gather_object(every, list(mine), group=ctx.group)
        holders: dict[str, list[int]] = {}
        for rank, names in enumerate(every):
            for name in names:
                holders.setdefault(name, []).append(rank)
        return holders

    @staticmethod
    def _start_equal(hs: _HolderSet, src: int) -> None:
        """Every copy from the lowest rank's first copy."""
        with torch.no_grad():
            for ps in hs.params:
                if hs.group is not None:
                    dist.broadcast(ps[0].data, src=src, group=hs.group)
                for p in ps[1:]:
                    p.data.copy_(ps[0].data)

    def divide_existing(self) -> None:
        """The start of a step: a gradient already there (every copy holds the same sum) is
        divided by the number of holder ranks, and the other local copies of a name start at
        zero, so that the sum adds this step's gradients only (runtime/parts/accumulation.py). Not
        the copies an open no-sync window holds (``in_window``; opened by this pipeline or by
        another over the same weights): each holds its own unreduced sum, which the window's
        reducing step sums."""
        with torch.no_grad():
            for hs in self.sets:
                for ps in hs.params:
                    if in_window(ps[0]):
                        continue
                    g = ps[0].grad
                    if g is not None and hs.size > 1:
                        g.div_(hs.size)
                    for p in ps[1:]:
                        if p.grad is not None:
                            p.grad.zero_()

    def reduce(self) -> None:
        """Sum each name's gradients over its copies and write the sum into every copy
        (nothing inside ``no_sync``)."""
        if not self.grad_sync.sync:
            return
        for hs in self.sets:
            grads = []
            for ps in hs.params:
                g = grad_or_zeros(ps[0])
                for p in ps[1:]:
                    g = g + grad_or_zeros(p)
                grads.append(g)
            if hs.group is not None and len({g.dtype for g in grads}) > 1:
                for g in grads:  # copies of several dtypes: one reduction each
                    _all_reduce(g, hs.group, self.name)
                sums = grads
            elif hs.group is not None:
                if hs.flat is None:
                    total = sum(g.numel() for g in grads)
                    hs.flat = torch.empty(total, dtype=grads[0].dtype, device=grads[0].device)
                torch.cat([g.reshape(-1) for g in grads], out=hs.flat)
                _all_reduce(hs.flat, hs.group, self.name)
                sums = hs.flat.split([g.numel() for g in grads])
            else:
                sums = grads
            for ps, s in zip(hs.params, sums, strict=True):
                for p in ps:
                    p.grad.copy_(s.view_as(p.grad))


def _all_reduce(t: torch.Tensor, group: Any, what: str) -> None:
    try:
        dist.all_reduce(t, group=group, async_op=True).wait()
    except RuntimeError as e:
        raise CommFailure(None, what, e.with_traceback(None)) from None
