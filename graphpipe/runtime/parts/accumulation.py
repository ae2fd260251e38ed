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

The window is a property of the **parameters**, not of the pipeline whose step opened it:
after a step inside ``no_sync`` every parameter of that pipeline is *in a window* (its
``.grad`` holds an unreduced sum), until a reducing step of any pipeline over it ends. So two
pipelines over the same stages (or the same tied weights) share it: a step of pipeline B after
a ``no_sync`` step of pipeline A divides nothing that A's window holds, and its reductions
reduce everything the window accumulated. The scaling hooks divide only the gradients of
parameters outside a window (``in_window``); the register of those in one is this module's
(weak references: a parameter that is gone leaves it). A captured pipeline's replayed step
divides whatever is there, so its step is refused while a window holds its parameters
(``check_captured``, a ``ValueError`` on every rank through the batch agreement).

Owns: the sync state (``sync``), the list of scaling hooks and the register of parameters in
a window. May touch: through its hooks, the ``.grad`` of the reduced parameters (in place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..core.program import StepHooks

__all__ = ["GradSync", "divide_existing", "in_window"]

# The parameters whose .grad holds the unreduced sum of an open no-sync window (by identity:
# a tensor's == is elementwise), whichever pipeline's step opened it. Empty unless a window is
# open somewhere: the per-parameter look-ups (a weak reference each) are skipped then.
_IN_WINDOW: WeakIdKeyDictionary = WeakIdKeyDictionary()


def in_window(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient holds an open no-sync window's unreduced sum (see the
    module doc): the scaling hooks leave such a gradient as it is."""
    return bool(_IN_WINDOW) and p in _IN_WINDOW


class GradSync:
    """Whether the current step reduces its gradients across ranks (see the module doc).

    ``params``: the pipeline's parameters, whose reductions its steps run or skip. ``sync``:
    the step reduces (False inside ``no_sync``). ``hooks``: the reducing parts' scaling
    functions, called at the start of every step; each divides only the gradients of its
    parameters that are outside a window (``in_window``).
    """

    name = "grad accumulation"

    def __init__(self, params: Iterable[torch.nn.Parameter] = ()) -> None:
        self.sync = True
        self.params = list(params)
        self.hooks: list[Callable[[], None]] = []

    @property
    def window(self) -> bool:
        """A no-sync window holds some of this pipeline's parameters (this pipeline's, or
        another's over the same parameters)."""
        return bool(_IN_WINDOW) and any(p in _IN_WINDOW for p in self.params)

    def add(self, hook: Callable[[], None]) -> None:
        """Register ``hook`` (divides the existing gradients it reduces, outside a window)."""
        self.hooks.append(hook)

    def step_hooks(self) -> StepHooks:
        """``begin`` at the start of the training step, once a part registered a hook."""
        return StepHooks(first=(self.begin,)) if self.hooks else StepHooks()

    def begin(self) -> None:
        """The start of a training step: divide the gradients already there, except those an
        open no-sync window holds (the hooks skip them)."""
        for hook in self.hooks:
            hook()

    def check_captured(self) -> None:
        """Before a captured pipeline's training step: ``ValueError`` while a no-sync window
        (another pipeline's) holds its parameters, since its replayed step divides and
        reduces whatever is there (the hooks' look-ups do not run in a replay)."""
        if self.hooks and self.window:  # only a part that divides can divide wrongly
            raise ValueError(
                "a no_sync() window of another pipeline holds this captured pipeline's "
                "parameters: its replayed step would divide and reduce their unreduced "
                "gradients as if reduced; run the window's reducing step on an eager pipeline "
                "first (or build this one without capture)"
            )

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The steps inside do not reduce (``Pipeline.no_sync``)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def end(self) -> None:
        """The end of a training step: a no-sync step leaves the pipeline's parameters in a
        window; a reducing one closes the window that held them."""
        if self.sync:
            self._close()
        else:
            for p in self.params:
                _IN_WINDOW[p] = True

    def reset(self) -> None:
        """After a failed step (its gradients hold partial sums: the user zeroes them)."""
        self._close()

    def _close(self) -> None:
        if _IN_WINDOW:  # nothing to look up unless a window is open somewhere
            for p in self.params:
                _IN_WINDOW.pop(p, None)


def divide_existing(
    grads: Iterable[tuple[torch.nn.Parameter, float]],
    shard: Callable[[torch.Tensor], torch.Tensor] = lambda g: g,
) -> None:
    """``p.grad /= alpha`` for every ``(p, alpha)`` whose ``.grad`` exists and that no open
    no-sync window holds (``shard``: the part of the gradient the reduction sums, a DTensor's
    local shard)."""
    windows = bool(_IN_WINDOW)
    for p, alpha in grads:
        g = p.grad
        if g is not None and not (windows and p in _IN_WINDOW):
            shard(g).div_(alpha)
