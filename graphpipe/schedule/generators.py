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

A generator does not check what it built: ``validate.validate`` and ``simulate.dataflow`` do
(the tests run them on every generator), and ``validate.resolve_schedule`` runs both checks
on what a pipeline is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from graphpipe.schedule import packed
from graphpipe.schedule.ir import KINDS, Placement, Schedule
from graphpipe.schedule.packed import Cells

__all__ = [
    "SCHEDULES",
    "ScheduleKind",
    "dualpipev",
    "one_f_one_b",
    "zbv",
]


# --------------------------------------------------------------------------------------------
# A small helper that numbers micro-batches and tracks deferred weight gradients


@dataclass(frozen=True, eq=False)
class _Column:
    """One column of a phase: a code per row; ``pending`` marks the I's whose W is deferred;
    ``w_stage`` (None: the oldest of any stage) for a column of W's, whose codes ``emit``
    fills in."""

    codes: np.ndarray
    pending: np.ndarray | None = None
    w_stage: int | None = None
    is_w: bool = False


class _RankProgram:
    """Builds one rank's program as codes (``graphpipe.schedule.packed``), a phase at a time.

    ``f`` / ``b`` hand out the next micro-batches of a stage (``count`` of them, one per row of
    the phase), ``w`` the W of the oldest pending I's (of one stage when given); ``emit``
    appends a phase: row by row, its cells in the order given (a pair is an overlap pair).
    Micro-batch numbers are handed out per (stage, forward/backward). A phase's I's are
    queued (row by row) before its W's are taken, oldest first: what queueing and taking
    them row by row gives, since a W never finds the queue empty there either.
    """

    def __init__(self, mb_bound: int) -> None:
        self.mb_bound = mb_bound
        self.first: list[np.ndarray] = []  # per phase, the cells' codes (a pair: its F)
        self.second: list[np.ndarray] = []  # a pair's B or I; -1 for a plain cell
        self._next_f: dict[int, int] = {}
        self._next_b: dict[int, int] = {}
        self._queue: list[tuple[int, int]] = []  # (stage, mb) of pending I's, oldest first
        self._taken = 0  # how many of the queue the W's of any stage took
        self._by_stage: dict[int, list[int]] = {}  # stage -> its pending mbs, oldest first
        self._taken_of: dict[int, int] = {}

    def _codes(self, stage: int, op: int, mbs: np.ndarray) -> np.ndarray:
        return packed.code_from(stage * self.mb_bound + mbs, op)

    def f(self, stage: int, count: int = 1) -> _Column:
        """The next ``count`` forwards of ``stage``."""
        mb = self._next_f.get(stage, 0)
        self._next_f[stage] = mb + count
        return _Column(self._codes(stage, packed.F, np.arange(mb, mb + count)))

    def b(self, stage: int, count: int = 1, defer_w: bool | np.ndarray = False) -> _Column:
        """The next ``count`` backwards of ``stage``: ``I`` (W deferred) where ``defer_w``,
        else a full ``B``."""
        mb = self._next_b.get(stage, 0)
        self._next_b[stage] = mb + count
        mbs = np.arange(mb, mb + count)
        defer = np.broadcast_to(np.asarray(defer_w, dtype=bool), (count,))
        codes = self._codes(stage, packed.B, mbs)
        codes[defer] = self._codes(stage, packed.I, mbs[defer])
        return _Column(codes, pending=defer)

    def w(self, count: int = 1, stage: int | None = None) -> _Column:
        """The W of the ``count`` oldest pending I's (of ``stage`` when given)."""
        return _Column(np.zeros(count, dtype=np.int64), w_stage=stage, is_w=True)

    def pending(self, stage: int) -> int:
        """How many I's of ``stage`` still wait for their W."""
        return len(self._by_stage.get(stage, ())) - self._taken_of.get(stage, 0)

    def emit(self, *cells: _Column | tuple[_Column, _Column]) -> None:
        """Append a phase: row ``i`` is the ``i``-th entry of every cell given, in order."""
        pairs = [c if isinstance(c, tuple) else (c, None) for c in cells]
        columns = [c for pair in pairs for c in pair if c is not None]
        rows, width = len(columns[0].codes), len(columns)
        # queue the I's row by row: by (row, column)
        where = [
            (i * width + j, c.codes[c.pending])
            for j, c in enumerate(columns)
            for i in [np.flatnonzero(c.pending)]
            if c.pending is not None
        ]
        if where:
            place = np.concatenate([w for w, _ in where])
            codes = np.concatenate([k for _, k in where])[np.argsort(place, kind="stable")]
            keys = packed.key_of(codes).tolist()
            self._queue.extend(keys)
            for key in keys:
                stage, mb = divmod(key, self.mb_bound)
                self._by_stage.setdefault(stage, []).append(mb)
        # then take the W's, row by row (column by column where they are of different
        # queues: each queue is taken in order either way)
        takers = [c for c in columns if c.is_w]
        if len({c.w_stage for c in takers}) == len(takers):
            for c in takers:
                c.codes[:] = self._take(c.w_stage, rows)
        else:
            for i in range(rows):
                for c in takers:
                    c.codes[i] = self._take(c.w_stage, 1)[0]
        self.first.append(np.stack([f.codes for f, _ in pairs], axis=1).ravel())
        second = [np.full(rows, -1) if b is None else b.codes for _, b in pairs]
        self.second.append(np.stack(second, axis=1).ravel())

    def _take(self, stage: int | None, count: int) -> np.ndarray:
        """The W codes of the ``count`` oldest pending I's (of ``stage`` when given); a
        program takes either by stage or oldest of all, never both."""
        if stage is None:
            assert not self._taken_of, "W's of one stage and of any stage in one program"
            keys = self._queue[self._taken : self._taken + count]
            self._taken += count
            out = packed.code_from(np.asarray(keys, dtype=np.int64), packed.W)
        else:
            assert not self._taken, "W's of one stage and of any stage in one program"
            k = self._taken_of.get(stage, 0)
            mbs = self._by_stage.get(stage, [])[k : k + count]
            self._taken_of[stage] = k + count
            keys = stage * self.mb_bound + np.asarray(mbs, dtype=np.int64)
            out = packed.code_from(keys, packed.W)
        if len(out) < count:
            raise IndexError(f"a W with no pending I (of stage {stage})")
        return out


def _cells(num_ranks: int, num_stages: int, mb_bound: int, rank_program) -> Cells:
    """The ``Cells`` of ``rank_program(r)`` for every rank, one rank's lists at a time."""

    def codes(r: int) -> tuple[np.ndarray, np.ndarray]:
        p = rank_program(r)
        return np.concatenate(p.first), np.concatenate(p.second)

    return packed.concat(range(num_ranks), map(codes, range(num_ranks)), mb_bound, num_stages)


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


def _dualpipev_rank(rank: int, n: int, m: int) -> _RankProgram:
    """Rank ``rank``'s DualPipeV program; the steps are DUALPIPEV.md's table, line by line
    (each step a phase: ``k x (...)`` is ``k`` rows of those cells)."""
    p = _RankProgram(m)
    s0, s1 = rank, 2 * n - 1 - rank  # phase 0 (the way down), phase 1 (the way back)
    last_rank = rank == n - 1

    # Step 1 (nF0): 2(N-r-1) x F s0
    k = 2 * (n - rank - 1)
    p.emit(p.f(s0, k))

    # Step 2 (nF0F1): r+1 x (F s0, F s1)
    k = rank + 1
    p.emit(p.f(s0, k), p.f(s1, k))

    # Step 3 (nI1W1F1): N-r-1 x (I s1, W oldest, F s1)
    k = n - rank - 1
    p.emit(p.b(s1, k, defer_w=True), p.w(k), p.f(s1, k))

    # Step 4 (main): overlap(F s0, B s1), overlap(F s1, B s0)
    #   M-2N+r+1 units; on rank N-1 the first unit's first pair runs F s0 then B s1 plainly.
    k = m - 2 * n + rank + 1
    if last_rank and k > 0:
        p.emit(p.f(s0), p.b(s1), (p.f(s1), p.b(s0)))
        k -= 1
    p.emit((p.f(s0, k), p.b(s1, k)), (p.f(s1, k), p.b(s0, k)))

    # Step 5 (nB1F1B0): N-r-1 x (B s1, overlap(F s1, B s0))
    k = n - rank - 1
    p.emit(p.b(s1, k), (p.f(s1, k), p.b(s0, k)))

    # Step 6 (nB1B0): r+1 x (B s1, B s0); the second half defers W (they become I):
    #   odd r: both backwards from iteration (r+1)//2 on; even r: from that iteration's B s0.
    k, half = rank + 1, (rank + 1) // 2
    i = np.arange(k)
    p.emit(
        p.b(s1, k, defer_w=(i > half) | ((i == half) & (rank % 2 == 1))),
        p.b(s0, k, defer_w=i >= half),
    )

    # Step 7 (nWB0): N-r-1 x (W oldest, I s0)
    k = n - rank - 1
    p.emit(p.w(k), p.b(s0, k, defer_w=True))

    # Step 8 (nW): r+1 x W oldest
    k = rank + 1
    p.emit(p.w(k))

    return p


def _dualpipev_cells(num_ranks: int, num_microbatches: int) -> Cells:
    _check_sizes(num_ranks, num_microbatches, 2 * num_ranks, "DualPipeV")
    return _cells(
        num_ranks,
        2 * num_ranks,
        num_microbatches,
        lambda r: _dualpipev_rank(r, num_ranks, num_microbatches),
    )


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DeepSeek's DualPipeV: ``2N`` stages in a V over ``N`` ranks, ``M >= 2N`` micro-batches.

    Rank ``r`` runs stage ``r`` and stage ``2N-1-r``. Forward/backward pairs of the two
    stages run as overlap units in the steady state; the W of a few backwards is deferred to
    fill bubbles. Same order as DeepSeek's ``dualpipev.py`` and torch's ``ScheduleDualPipeV``.
    """
    return packed.decode_schedule(_dualpipev_cells(num_ranks, num_microbatches))


# --------------------------------------------------------------------------------------------
# Baselines


def _one_f_one_b_rank(rank: int, n: int, m: int) -> _RankProgram:
    p = _RankProgram(m)
    warmup = min(n - rank - 1, m)
    # Warm-up: N-r-1 forwards fill the pipe below this rank.
    p.emit(p.f(rank, warmup))
    # Steady state: one forward, one backward.
    p.emit(p.f(rank, m - warmup), p.b(rank, m - warmup))
    # Cool-down: the backwards of the warm-up forwards.
    p.emit(p.b(rank, warmup))
    return p


def _one_f_one_b_cells(num_ranks: int, num_microbatches: int) -> Cells:
    _check_sizes(num_ranks, num_microbatches, 1, "1F1B")
    return _cells(
        num_ranks,
        num_ranks,
        num_microbatches,
        lambda r: _one_f_one_b_rank(r, num_ranks, num_microbatches),
    )


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Classic 1F1B (PipeDream-flush): ``N`` stages, one per rank, full backward ``B``."""
    return packed.decode_schedule(_one_f_one_b_cells(num_ranks, num_microbatches))


def _zbv_rank(rank: int, n: int, m: int) -> _RankProgram:
    """ZB-V (zero-bubble paper, section 6) for one rank, generated for ``max(M, 2N-1)``
    micro-batches; the caller drops the actions of micro-batches ``>= M``."""
    total = max(m, 2 * n - 1)
    p = _RankProgram(total)
    s0, s1 = rank, 2 * n - 1 - rank

    # Warm-up 1: 2(N-r)-1 forwards of the first chunk.
    k = 2 * (n - rank) - 1
    p.emit(p.f(s0, k))
    # Warm-up 2: r x (F s1, F s0).
    p.emit(p.f(s1, rank), p.f(s0, rank))
    # Warm-up 3: N-r x (F s1, I s1, W s1): the V's turn starts the first backwards.
    k = n - rank
    p.emit(p.f(s1, k), p.b(s1, k, defer_w=True), p.w(k, s1))
    # Steady state: (F s0,) I s0, W s0, F s1, I s1, W s1 until every forward ran: with F s0
    #   until s0 has run all `total`, then on while s1 has not.
    with_f0 = total - (2 * n - rank - 1)  # forwards of s0 so far: warm-ups 1 and 2
    k = with_f0
    p.emit(
        p.f(s0, k), p.b(s0, k, defer_w=True), p.w(k, s0),
        p.f(s1, k), p.b(s1, k, defer_w=True), p.w(k, s1),
    )  # fmt: skip
    k = max(0, total - (n + with_f0))  # forwards of s1 so far: warm-ups 2 and 3, and these
    p.emit(p.b(s0, k, defer_w=True), p.w(k, s0), p.f(s1, k), p.b(s1, k, defer_w=True), p.w(k, s1))
    # Cool-down 1: r x (I s0, I s1), their W deferred.
    p.emit(p.b(s0, rank, defer_w=True), p.b(s1, rank, defer_w=True))
    # Cool-down 2: N-r x (I s0, W s0 oldest).
    k = n - rank
    p.emit(p.b(s0, k, defer_w=True), p.w(k, s0))
    # Drain: the remaining W of s1, then of s0, oldest first.
    for stage in (s1, s0):
        p.emit(p.w(p.pending(stage), stage))
    return p


def _zbv_cells(num_ranks: int, num_microbatches: int) -> Cells:
    _check_sizes(num_ranks, num_microbatches, 1, "ZB-V")
    total = max(num_microbatches, 2 * num_ranks - 1)  # what _zbv_rank generates

    def kept(r: int) -> _RankProgram:
        """Rank r's program without the cells of a part of micro-batch >= M."""
        p = _zbv_rank(r, num_ranks, num_microbatches)
        first, second = np.concatenate(p.first), np.concatenate(p.second)
        keep = (packed.micro_of(first, total) < num_microbatches) & (
            (second < 0) | (packed.micro_of(second, total) < num_microbatches)
        )
        p.first, p.second = [first[keep]], [second[keep]]
        return p

    return _cells(num_ranks, 2 * num_ranks, total, kept)


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V from the zero-bubble paper (arXiv 2401.10241, section 6): 2N stages in a V, the
    backward split into ``I`` and ``W``. Same order as torch's ``ScheduleZBVZeroBubble`` with
    its idle cells dropped. ``M < 2N-1`` runs the ``2N-1`` schedule without the missing
    micro-batches, as torch does."""
    return packed.decode_schedule(_zbv_cells(num_ranks, num_microbatches))


# --------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True, slots=True)
class ScheduleKind:
    """A named schedule generator and where its stages live.

    name: the registry key (``graphpipe schedule --schedule NAME``).
    cells: ``(num_ranks, num_microbatches) -> packed.Cells``, the generator on arrays;
        raises ValueError on bad sizes.
    style: the placement style (see ``ir.stage_to_rank``).
    stages_per_rank: stages each rank runs (``num_stages = stages_per_rank * num_ranks``).
    summary: one line for help texts.
    """

    name: str
    cells: Callable[[int, int], Cells]
    style: str
    stages_per_rank: int
    summary: str

    def build(self, num_ranks: int, num_microbatches: int) -> Schedule:
        """The schedule as ``{rank: [Action, ...]}``; raises ValueError on bad sizes."""
        return packed.decode_schedule(self.cells(num_ranks, num_microbatches))

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
    name: ScheduleKind(name, globals()[k.cells], k.style, k.stages_per_rank, k.summary)
    for name, k in KINDS.items()
}
"""Schedules by name, one per entry of ``ir.KINDS`` (its generator: the ``cells`` it names)."""
