"""Gradient accumulation across ``step`` calls: each call adds its own gradients, nothing more.

A user who grows the batch by calling ``pipe.step`` several times without zeroing expects
``.grad`` to hold the sum of every call's gradients, as one process accumulating backward
passes does. The cross-rank reductions inside a step (the data-parallel all-reduce, the sum
of the copies of a weight tied across ranks, the expert data-parallel sum) act on the whole
``.grad``, so a gradient already there from an earlier call would be reduced again: a sum
over ``k`` ranks turns the earlier, already reduced ``G`` into ``k * G``.

So every part that reduces declares, per parameter, the factor ``alpha`` that its reduction
applies to a gradient that is the same on every member (``k`` for a sum over ``k`` ranks,
``1`` for an average, ``E / D`` for the expert sum over ``E`` holders divided by the dp size
``D``), and at the start of the step (the program's first instruction, also inside a captured
step) the gradients that are already there are divided by that factor: the reduction then
turns ``G / alpha + g_rank`` into ``G + reduce(g)``. Division by a power of two is exact; by
another factor it rounds once (relative 2^-53 in float64). Parameters whose ``.grad`` is
``None`` cost nothing (``optimizer.zero_grad()``'s default); an average (``alpha = 1``) costs
nothing. Several local copies of one tied name (``ps[1:]``) start the step at zero instead:
after the last reduction every copy holds the same sum.

``Pipeline.no_sync()`` skips the reductions (and the in-step clipping) of the steps inside it:
each rank accumulates its own unreduced gradients, and the first step after it reduces
everything the window accumulated, as ``DistributedDataParallel.no_sync`` does. The gradients
already there when the window opens are divided by ``alpha`` at its first step only.

Owns: the sync state (``sync``, ``window``) and the list of scaling hooks. May touch: through
its hooks, the ``.grad`` of the reduced parameters (in place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from .program import StepHooks

__all__ = ["GradSync", "divide_existing"]


class GradSync:
    """Whether the current step reduces its gradients across ranks (see the module doc).

    ``sync``: the step reduces (False inside ``no_sync``). ``window``: an earlier step of an
    open no-sync window already divided the existing gradients. ``hooks``: the reducing
    parts' scaling functions, called at the start of a step that opens a window (or of any
    step outside one).
    """

    name = "grad accumulation"

    def __init__(self) -> None:
        self.sync = True
        self.window = False
        self.hooks: list[Callable[[], None]] = []

    def add(self, hook: Callable[[], None]) -> None:
        """Register ``hook`` (divides the existing gradients it reduces)."""
        self.hooks.append(hook)

    def step_hooks(self) -> StepHooks:
        """``begin`` at the start of the training step, once a part registered a hook."""
        return StepHooks(first=(self.begin,)) if self.hooks else StepHooks()

    def begin(self) -> None:
        """The start of a training step: divide the gradients already there, unless an open
        no-sync window did at its first step."""
        if not self.window:
            for hook in self.hooks:
                hook()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The steps inside do not reduce (``Pipeline.no_sync``)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def end(self) -> None:
        """The end of a training step: a no-sync step leaves the window open."""
        self.window = not self.sync

    def reset(self) -> None:
        """After a failed step (its gradients hold partial sums: the user zeroes them)."""
        self.window = False


def divide_existing(
    grads: Iterable[tuple[torch.nn.Parameter, float]],
    shard: Callable[[torch.Tensor], torch.Tensor] = lambda g: g,
) -> None:
    """``p.grad /= alpha`` for every ``(p, alpha)`` whose ``.grad`` exists (``shard``: the part
    of the gradient the reduction sums, a DTensor's local shard)."""
    for p, alpha in grads:
        g = p.grad
        if g is not None:
            shard(g).div_(alpha)
