"""Schedule generators: DualPipeV and two baselines (1F1B, ZB-V) on the same IR.

Each generator is a pure function ``(num_ranks, num_microbatches) -> Schedule`` returning the
compute-only per-rank programs (no communication; ``lower.lower`` adds it). Where the stages
live is a ``Placement``; ``SCHEDULES`` maps a schedule's name to its generator and placement:

==========  ============  =====================================================
name        stages        placement
==========  ============  =====================================================
dualpipev   2N            V: rank r holds stage r and stage 2N-1-r
zbv         2N            V, as above (the zero-bubble paper's ZB-V)
1f1b        N             one stage per rank: rank r holds stage r
==========  ============  =====================================================

Micro-batch numbers in the generated actions increase by one per (stage, op kind), starting
at 0; each deferred weight-gradient action ``W`` names its stage and micro-batch explicitly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from graphpipe.ir import Action, Op, Schedule

__all__ = [
    "SCHEDULES",
    "Placement",
    "ScheduleKind",
    "dualpipev",
    "one_f_one_b",
    "resolve_schedule",
    "stage_to_rank",
    "zbv",
]


# --------------------------------------------------------------------------------------------
# Placement


def _v_rank(stage: int, num_ranks: int) -> int:
    return stage if stage < num_ranks else 2 * num_ranks - 1 - stage


def _loop_rank(stage: int, num_ranks: int) -> int:
    return stage % num_ranks


_STYLES: dict[str, Callable[[int, int], int]] = {"v": _v_rank, "loop": _loop_rank}
"""Placement styles: ``v`` folds 2N stages into a V; ``loop`` deals stages round-robin."""


def stage_to_rank(stage: int, num_ranks: int, style: str) -> int:
    """The rank holding ``stage`` under ``style`` (``"v"``: 2N stages, ``"loop"``: round-robin).

    ``v``: stage ``s < N`` on rank ``s``, stage ``s >= N`` on rank ``2N-1-s``.
    ``loop``: stage ``s`` on rank ``s % N`` (with N stages: one stage per rank).
    """
    if style not in _STYLES:
        raise ValueError(f"unknown placement style {style!r}: expected one of {sorted(_STYLES)}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if stage < 0 or (style == "v" and stage >= 2 * num_ranks):
        limit = f"0 .. {2 * num_ranks - 1}" if style == "v" else ">= 0"
        raise ValueError(f"stage must be {limit} for style {style!r}, got {stage}")
    return _STYLES[style](stage, num_ranks)


@dataclass(frozen=True, slots=True)
class Placement:
    """Which rank holds which stage.

    num_ranks: pipeline ranks, 0 .. num_ranks-1.
    num_stages: model stages (chunks), 0 .. num_stages-1, in data-flow order.
    stage_to_rank: ``stage_to_rank[s]`` is the rank that runs stage ``s``.
    """

    num_ranks: int
    num_stages: int
    stage_to_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_stages < 1:
            raise ValueError(
                f"a placement needs num_ranks >= 1 and num_stages >= 1, "
                f"got {self.num_ranks} and {self.num_stages}"
            )
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} stages"
            )
        if bad := [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]:
            raise ValueError(f"stage_to_rank names ranks {bad} outside 0 .. {self.num_ranks - 1}")

    @classmethod
    def from_style(cls, num_ranks: int, style: str, stages_per_rank: int = 1) -> Placement:
        """``num_ranks * stages_per_rank`` stages placed by ``style`` (see ``stage_to_rank``)."""
        if style == "v" and stages_per_rank != 2:
            raise ValueError(f"style 'v' places 2 stages per rank, got {stages_per_rank}")
        num_stages = num_ranks * stages_per_rank
        ranks = tuple(stage_to_rank(s, num_ranks, style) for s in range(num_stages))
        return cls(num_ranks, num_stages, ranks)

    @classmethod
    def from_schedule(cls, schedule: Mapping[int, Sequence[Action]]) -> Placement:
        """The placement a compute-only schedule implies (each stage on the rank that runs it)."""
        owner: dict[int, int] = {}
        for rank, actions in schedule.items():
            for cell in actions:
                for part in cell.parts():
                    if owner.setdefault(part.stage, rank) != rank:
                        raise ValueError(
                            f"stage {part.stage} runs on ranks {owner[part.stage]} and {rank}"
                        )
        num_stages = max(owner, default=-1) + 1
        if missing := sorted(set(range(num_stages)) - set(owner)):
            raise ValueError(f"no rank runs stages {missing}")
        num_ranks = max(schedule, default=-1) + 1
        return cls(num_ranks, num_stages, tuple(owner[s] for s in range(num_stages)))

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @property
    def last_stage(self) -> int:
        """The stage that computes the loss."""
        return self.num_stages - 1


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
    style: the placement style (see ``stage_to_rank``).
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


def resolve_schedule(
    schedule: str | Mapping[int, Sequence[Action]], n: int, m: int
) -> tuple[dict[int, list[Action]], Placement, str]:
    """``schedule`` (a name in ``SCHEDULES``, or a compute-only ``{rank: [Action, ...]}``) for
    ``n`` ranks and ``m`` micro-batches: the schedule, its placement and its name, validated
    (``simulate.validate``; a schedule whose ranks deadlock each other raises too)."""
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: expected one of {sorted(SCHEDULES)}")
        built, placement = SCHEDULES[schedule](n, m)
        name = schedule
    elif isinstance(schedule, Mapping):
        built = {r: list(a) for r, a in schedule.items()}
        if sorted(built) != list(range(n)):
            raise ValueError(
                f"the schedule has ranks {sorted(built)}, but the pipeline has {n} ranks "
                f"(0 .. {n - 1})"
            )
        placement = Placement.from_schedule(built)
        name = "custom"
    else:
        raise TypeError(
            f"schedule must be a name ({', '.join(sorted(SCHEDULES))}) or a "
            f"{{rank: [Action, ...]}} mapping, got {type(schedule).__name__}"
        )
    from graphpipe.simulate import dataflow, validate

    validate(built, placement, m)
    dataflow(built, placement)  # raises ScheduleError, with the grid, if ranks deadlock
    return built, placement, name
