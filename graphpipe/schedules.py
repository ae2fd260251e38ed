"""Schedule generators: DualPipeV and two baselines (1F1B, ZB-V) on the same IR.

Each generator is a pure function ``(num_ranks, num_microbatches) -> Schedule`` returning the
compute-only per-rank programs (no communication; ``lower.lower`` adds it). Where the stages
live is an ``ir.Placement``; ``SCHEDULES`` maps a schedule's name to its generator and
placement:

==========  ============  =====================================================
name        stages        placement
==========  ============  =====================================================
dualpipev   2N            V: rank r holds stage r and stage 2N-1-r
zbv         2N            V, as above (the zero-bubble paper's ZB-V)
1f1b        N             one stage per rank: rank r holds stage r
==========  ============  =====================================================

Micro-batch numbers in the generated actions increase by one per (stage, op kind), starting
at 0; each deferred weight-gradient action ``W`` names its stage and micro-batch explicitly.

A generator does not check what it built: ``simulate.validate`` and ``simulate.dataflow`` do
(the tests run them on every generator), and ``simulate.resolve_schedule`` runs them on what
a pipeline is given.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from graphpipe.ir import Action, Op, Placement, Schedule

__all__ = [
    "SCHEDULES",
    "ScheduleKind",
    "dualpipev",
    "one_f_one_b",
    "zbv",
]


# --------------------------------------------------------------------------------------------
# A small helper that numbers micro-batches and tracks deferred weight gradients


class _RankProgram:
    """Builds one rank's action list.

    Micro-batch numbers are handed out per (stage, forward/backward); every ``I`` is appended
    to a pending list and each ``W`` names the oldest pending entry (optionally of one stage).
    """

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next_f: dict[int, int] = {}
        self._next_b: dict[int, int] = {}
        self._pending: deque[tuple[int, int]] = deque()

    def f(self, stage: int) -> Action:
        """The next forward of ``stage`` (not yet emitted)."""
        mb = self._next_f.get(stage, 0)
        self._next_f[stage] = mb + 1
        return Action(stage, Op.F, mb)

    def b(self, stage: int, defer_w: bool = False) -> Action:
        """The next backward of ``stage``: ``I`` (W deferred) if ``defer_w`` else a full ``B``."""
        mb = self._next_b.get(stage, 0)
        self._next_b[stage] = mb + 1
        if defer_w:
            self._pending.append((stage, mb))
            return Action(stage, Op.I, mb)
        return Action(stage, Op.B, mb)

    def w(self, stage: int | None = None) -> Action:
        """The ``W`` of the oldest pending ``I`` (of ``stage`` when given)."""
        if stage is None:
            s, mb = self._pending.popleft()
        else:
            s, mb = next(p for p in self._pending if p[0] == stage)
            self._pending.remove((s, mb))
        return Action(s, Op.W, mb)

    def has_pending(self, stage: int) -> bool:
        """Whether an ``I`` of ``stage`` still waits for its ``W``."""
        return any(s == stage for s, _ in self._pending)

    def emit(self, *actions: Action) -> None:
        self.actions.extend(actions)

    def overlap(self, forward: Action, backward: Action) -> None:
        """Emit the overlap pair ``(forward;backward)OVERLAP_F_B``."""
        self.actions.append(Action.overlap(forward, backward))


def _check_sizes(num_ranks: int, num_microbatches: int, min_microbatches: int, name: str) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1 for {name}, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1 for {name}, got {num_microbatches}")
    if num_microbatches < min_microbatches:
        raise ValueError(
            f"num_microbatches must be >= 2 * num_ranks = {min_microbatches} for {name}, "
            f"got {num_microbatches}"
        )


# --------------------------------------------------------------------------------------------
# DualPipeV


def _dualpipev_rank(rank: int, n: int, m: int) -> list[Action]:
    """Rank ``rank``'s DualPipeV program; the steps are DUALPIPEV.md's table, line by line."""
    p = _RankProgram()
    s0, s1 = rank, 2 * n - 1 - rank  # phase 0 (the way down), phase 1 (the way back)
    last_rank = rank == n - 1

    # Step 1 (nF0): 2(N-r-1) x F s0
    for _ in range(2 * (n - rank - 1)):
        p.emit(p.f(s0))

    # Step 2 (nF0F1): r+1 x (F s0, F s1)
    for _ in range(rank + 1):
        p.emit(p.f(s0), p.f(s1))

    # Step 3 (nI1W1F1): N-r-1 x (I s1, W oldest, F s1)
    for _ in range(n - rank - 1):
        p.emit(p.b(s1, defer_w=True))
        p.emit(p.w())
        p.emit(p.f(s1))

    # Step 4 (main): overlap(F s0, B s1), overlap(F s1, B s0)
    #   M-2N+r+1 units; on rank N-1 the first unit's first pair runs F s0 then B s1 plainly.
    for i in range(m - 2 * n + rank + 1):
        if i == 0 and last_rank:
            p.emit(p.f(s0))
            p.emit(p.b(s1))
        else:
            p.overlap(p.f(s0), p.b(s1))
        p.overlap(p.f(s1), p.b(s0))

    # Step 5 (nB1F1B0): N-r-1 x (B s1, overlap(F s1, B s0))
    for _ in range(n - rank - 1):
        p.emit(p.b(s1))
        p.overlap(p.f(s1), p.b(s0))

    # Step 6 (nB1B0): r+1 x (B s1, B s0); the second half defers W (they become I):
    #   odd r: both backwards from iteration (r+1)//2 on; even r: from that iteration's B s0.
    half = (rank + 1) // 2
    for i in range(rank + 1):
        p.emit(p.b(s1, defer_w=i > half or (i == half and rank % 2 == 1)))
        p.emit(p.b(s0, defer_w=i >= half))

    # Step 7 (nWB0): N-r-1 x (W oldest, I s0)
    for _ in range(n - rank - 1):
        p.emit(p.w())
        p.emit(p.b(s0, defer_w=True))

    # Step 8 (nW): r+1 x W oldest
    for _ in range(rank + 1):
        p.emit(p.w())

    return p.actions


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DeepSeek's DualPipeV: ``2N`` stages in a V over ``N`` ranks, ``M >= 2N`` micro-batches.

    Rank ``r`` runs stage ``r`` and stage ``2N-1-r``. Forward/backward pairs of the two
    stages run as overlap units in the steady state; the W of a few backwards is deferred to
    fill bubbles. Same order as DeepSeek's ``dualpipev.py`` and torch's ``ScheduleDualPipeV``.
    """
    _check_sizes(num_ranks, num_microbatches, 2 * num_ranks, "DualPipeV")
    return {r: _dualpipev_rank(r, num_ranks, num_microbatches) for r in range(num_ranks)}


# --------------------------------------------------------------------------------------------
# Baselines


def _one_f_one_b_rank(rank: int, n: int, m: int) -> list[Action]:
    p = _RankProgram()
    warmup = min(n - rank - 1, m)
    # Warm-up: N-r-1 forwards fill the pipe below this rank.
    for _ in range(warmup):
        p.emit(p.f(rank))
    # Steady state: one forward, one backward.
    for _ in range(m - warmup):
        p.emit(p.f(rank), p.b(rank))
    # Cool-down: the backwards of the warm-up forwards.
    for _ in range(warmup):
        p.emit(p.b(rank))
    return p.actions


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Classic 1F1B (PipeDream-flush): ``N`` stages, one per rank, full backward ``B``."""
    _check_sizes(num_ranks, num_microbatches, 1, "1F1B")
    return {r: _one_f_one_b_rank(r, num_ranks, num_microbatches) for r in range(num_ranks)}


def _zbv_rank(rank: int, n: int, m: int) -> list[Action]:
    """ZB-V (zero-bubble paper, section 6) for one rank, generated for ``max(M, 2N-1)``
    micro-batches; the caller drops the actions of micro-batches ``>= M``."""
    p = _RankProgram()
    s0, s1 = rank, 2 * n - 1 - rank
    total = max(m, 2 * n - 1)
    count_f = {s0: 0, s1: 0}

    def f(stage: int) -> Action:
        count_f[stage] += 1
        return p.f(stage)

    # Warm-up 1: 2(N-r)-1 forwards of the first chunk.
    for _ in range(2 * (n - rank) - 1):
        p.emit(f(s0))
    # Warm-up 2: r x (F s1, F s0).
    for _ in range(rank):
        p.emit(f(s1), f(s0))
    # Warm-up 3: N-r x (F s1, I s1, W s1): the V's turn starts the first backwards.
    for _ in range(n - rank):
        p.emit(f(s1), p.b(s1, defer_w=True), p.w(s1))
    # Steady state: (F s0,) I s0, W s0, F s1, I s1, W s1 until every forward ran.
    while count_f[s1] < count_f[s0] or count_f[s0] < total:
        if count_f[s0] < total:
            p.emit(f(s0))
        p.emit(p.b(s0, defer_w=True), p.w(s0))
        p.emit(f(s1), p.b(s1, defer_w=True), p.w(s1))
    # Cool-down 1: r x (I s0, I s1), their W deferred.
    for _ in range(rank):
        p.emit(p.b(s0, defer_w=True), p.b(s1, defer_w=True))
    # Cool-down 2: N-r x (I s0, W s0 oldest).
    for _ in range(n - rank):
        p.emit(p.b(s0, defer_w=True), p.w(s0))
    # Drain: the remaining W of s1, then of s0, oldest first.
    for stage in (s1, s0):
        while p.has_pending(stage):
            p.emit(p.w(stage))
    return p.actions


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V from the zero-bubble paper (arXiv 2401.10241, section 6): 2N stages in a V, the
    backward split into ``I`` and ``W``. Same order as torch's ``ScheduleZBVZeroBubble`` with
    its idle cells dropped. ``M < 2N-1`` runs the ``2N-1`` schedule without the missing
    micro-batches, as torch does."""
    _check_sizes(num_ranks, num_microbatches, 1, "ZB-V")

    def keep(action: Action) -> bool:
        return all(part.microbatch < num_microbatches for part in action.parts())

    return {
        r: [a for a in _zbv_rank(r, num_ranks, num_microbatches) if keep(a)]
        for r in range(num_ranks)
    }


# --------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True, slots=True)
class ScheduleKind:
    """A named schedule generator and where its stages live.

    name: the registry key (``graphpipe schedule --schedule NAME``).
    build: ``(num_ranks, num_microbatches) -> Schedule``; raises ValueError on bad sizes.
    style: the placement style (see ``ir.stage_to_rank``).
    stages_per_rank: stages each rank runs (``num_stages = stages_per_rank * num_ranks``).
    summary: one line for help texts.
    """

    name: str
    build: Callable[[int, int], Schedule]
    style: str
    stages_per_rank: int
    summary: str

    def placement(self, num_ranks: int) -> Placement:
        """This schedule's placement on ``num_ranks`` ranks."""
        return Placement.from_style(num_ranks, self.style, self.stages_per_rank)

    def num_stages(self, num_ranks: int) -> int:
        """How many stages the model is split into on ``num_ranks`` ranks."""
        return self.stages_per_rank * num_ranks

    def __call__(self, num_ranks: int, num_microbatches: int) -> tuple[Schedule, Placement]:
        """The schedule and its placement."""
        return self.build(num_ranks, num_microbatches), self.placement(num_ranks)


SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind("dualpipev", dualpipev, "v", 2, "DeepSeek DualPipeV: 2N stages, M >= 2N"),
        ScheduleKind("1f1b", one_f_one_b, "loop", 1, "classic 1F1B: N stages, one per rank"),
        ScheduleKind("zbv", zbv, "v", 2, "zero-bubble ZB-V: 2N stages in a V, I/W split"),
    )
}
"""Schedules by name."""
