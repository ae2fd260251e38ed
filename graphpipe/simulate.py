"""Validation and timing of schedules: dependencies, deadlocks, bubble, peak memory.

The top pass of the schedule half (``ir`` -> ``schedules`` -> ``timing`` -> ``lower`` ->
``simulate``): it reads all of them and none reads it. ``validate`` checks a compute-only
schedule; ``resolve_schedule`` turns what a pipeline is given (a name in
``schedules.SCHEDULES`` or a user's ``{rank: [Action, ...]}``) into the validated schedule and
its placement. ``simulate`` runs a lowered schedule
(``lower.lower``) under the runtime's asynchronous execution model:

* each rank runs its ``Step``s in order; it *posts* step ``k``'s batch (sends and receives)
  as soon as its compute ``k-1`` has finished, and goes on without waiting for it;
* a message travels once both of its ends are posted, and arrives ``Costs.p2p`` later (and
  no earlier than the message before it on the same directed rank pair: each rank pair is
  one FIFO);
* a compute starts when its rank is free and every message it reads has arrived; sends
  complete in the background (a rank is done when its sends have arrived).

With ``p2p = 0`` this is pure dataflow (``dataflow``): an action starts when its inputs are
done and its rank is free, whatever the batches. With ``p2p > 0``, latency reaches the
critical path only where the dataflow forces it, provided each receive is posted no later
than its send (``lower`` times receives with the same costs to make sure of it).

Messages are matched per directed rank pair in order: the i-th message rank A sends to rank B
is the i-th receive B posts from A. A receive without a send, a send never received, a pair
whose two ends disagree on the order, or a compute whose inputs are not there yet is a broken
dependency; no rank able to progress is a deadlock. Both raise ``ScheduleError`` with the
whole rank x step grid, the failing cells marked ``*cell*`` and one line of reason per marked
cell.

Cost: linear in the number of actions. The checks and the run work on ``graphpipe.packed``
arrays, a chunk of ranks at a time; what they find wrong is then named by replaying the
``Action`` objects (``_Replay``: the same code, the same messages, only on the way to an error).
``figures`` is ``graphpipe schedule``'s path: the arrays from the generator to the
statistics, never one object per action (1024 ranks x 2048 micro-batches, 8.4 million cells:
docs/schedules.md has the figures). Where a lowered program's run is its dataflow timing
(``_as_dataflow``, the usual case for what ``lower`` makes) the event loop is not needed.
"""

from __future__ import annotations

import math
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import numpy as np

from graphpipe import packed
from graphpipe.costs import Costs
from graphpipe.ir import WAIT_PREFIX, Action, Op, Placement
from graphpipe.lower import (
    Step,
    channel,
    comm_codes,
    comms_needed,
    decode_programs,
    lower_cells,
    matching,
    peer,
    post_receives_early_cells,
)
from graphpipe.packed import Cells, Programs
from graphpipe.schedules import SCHEDULES
from graphpipe.timing import CellTimes, cell_times

__all__ = [
    "Costs",
    "Figures",
    "RankStats",
    "ScheduleError",
    "SimResult",
    "TimelineRecord",
    "WaitRecord",
    "dataflow",
    "figures",
    "format_grid",
    "resolve_schedule",
    "simulate",
    "validate",
    "validate_cells",
]


class ScheduleError(ValueError):
    """A schedule that cannot run: the message holds the grid with the failing cells marked."""


# --------------------------------------------------------------------------------------------
# The grid


def format_grid(
    cells: Mapping[int, Sequence[str]],
    marked: Mapping[int, int] | None = None,
    reasons: Iterable[str] = (),
    flag: str = "blocked",
) -> str:
    """The rank x step grid (rows: steps, columns: ranks), like torch's
    ``_format_pipeline_order``. ``marked[rank] = step`` wraps that cell as ``*cell*`` and
    ends its row with ``<-- {flag}: rank r``; ``reasons`` are appended one per line."""
    marked = dict(marked or {})
    ranks = sorted(cells)
    rows = max((len(cells[r]) for r in ranks), default=0)
    width = len(str(max(rows - 1, 0)))

    def cell(rank: int, step: int) -> str:
        text = cells[rank][step] if step < len(cells[rank]) else ""
        return f"*{text}*" if marked.get(rank) == step else text

    widths = {r: max([len(f"Rank {r}")] + [len(cell(r, k)) for k in range(rows)]) for r in ranks}
    label = " " * (len("Step ") + width + 2)
    lines = [(label + " ".join(f"Rank {r}".ljust(widths[r]) for r in ranks)).rstrip()]
    for k in range(rows):
        row = f"Step {k:0{width}d}: " + " ".join(cell(r, k).ljust(widths[r]) for r in ranks)
        flagged = [r for r in ranks if marked.get(r) == k]
        if flagged:
            row += f" <-- {flag}: " + ", ".join(f"rank {r}" for r in flagged)
        lines.append(row.rstrip())
    return "\n".join([*lines, *reasons]) + "\n"


def _error(
    title: str,
    cells: Mapping[int, Sequence[str]],
    problems: Sequence[tuple[int, int, str]],
    flag: str,
) -> ScheduleError:
    """A ScheduleError for ``problems`` = [(rank, step, reason)]: the first per rank is
    marked."""
    marked: dict[int, int] = {}
    for rank, step, _ in problems:
        marked.setdefault(rank, step)
    shown = problems[:20]
    reasons = [f"rank {r} step {k}: {why}" for r, k, why in shown]
    if len(problems) > len(shown):
        reasons.append(f"... and {len(problems) - len(shown)} more")
    return ScheduleError(f"{title}\n" + format_grid(cells, marked, reasons, flag))


# --------------------------------------------------------------------------------------------
# validate


def validate(
    schedule: Mapping[int, Sequence[Action]], placement: Placement, num_microbatches: int
) -> None:
    """Check a compute-only schedule; raise ``ScheduleError`` (grid + reasons) if it is wrong.

    Checks: the ranks are the placement's; each action runs on its stage's rank; each stage
    runs micro-batches 0..M-1 exactly once forward and once backward (B or I); each I has
    exactly one later W on the same rank for the same stage and micro-batch, and each W one
    earlier I; F runs before the backward of each (stage, micro-batch); across a local edge
    (the V-turn) the producing stage runs first.
    """
    cells = {r: [str(a) for a in schedule[r]] for r in schedule}
    problems: list[tuple[int, int, str]] = []
    if sorted(schedule) != list(range(placement.num_ranks)):
        raise ScheduleError(
            f"the schedule has ranks {sorted(schedule)}, the placement "
            f"0 .. {placement.num_ranks - 1}\n" + format_grid(cells)
        )
    replays = {r: _Replay(r, placement, receives=False) for r in schedule}
    for rank, replay in replays.items():
        for k, cell in enumerate(schedule[rank]):
            problems += [(rank, k, why) for why in replay.compute(cell, k)]
        problems += [(rank, k, why) for k, why in replay.unfinished()]
    for stage in range(placement.num_stages):
        rank = placement.rank_of(stage)
        forwards, backwards = replays[rank].forwards[stage], replays[rank].backwards[stage]
        for kind, seen in (("forwards", forwards), ("backwards (B or I)", backwards)):
            if sorted(seen) != list(range(num_microbatches)):
                problems.append(
                    (
                        rank,
                        len(cells[rank]),
                        f"stage {stage} runs {kind} of micro-batches {sorted(seen)}, "
                        f"expected each of 0 .. {num_microbatches - 1} once",
                    )
                )
    if problems:
        raise _error("invalid schedule:", cells, problems, "invalid")


def resolve_schedule(
    schedule: str | Mapping[int, Sequence[Action]], n: int, m: int
) -> tuple[dict[int, list[Action]], Placement, str]:
    """``schedule`` (a name in ``SCHEDULES``, or a compute-only ``{rank: [Action, ...]}``) for
    ``n`` ranks and ``m`` micro-batches: the schedule, its placement and its name, validated
    (``validate``; a schedule whose ranks deadlock each other raises too)."""
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
    validate(built, placement, m)
    dataflow(built, placement)  # raises ScheduleError, with the grid, if ranks deadlock
    return built, placement, name


class _Replay:
    """Replays one rank's actions in order and names each that runs before its inputs exist.

    With ``receives=True`` (lowered programs) an input from another rank must have come in by
    a ``RECV_*`` of this or an earlier step; without (compute-only schedules) it is assumed.
    """

    def __init__(self, rank: int, placement: Placement, receives: bool) -> None:
        self.rank, self.placement, self.receives = rank, placement, receives
        self.done_f: set[tuple[int, int]] = set()
        self.done_b: set[tuple[int, int]] = set()
        self.pending_w: dict[tuple[int, int], int] = {}  # (stage, mb) of an I -> its step
        self.received: set[Action] = set()
        self.forwards: dict[int, list[int]] = defaultdict(list)  # stage -> mbs, in order
        self.backwards: dict[int, list[int]] = defaultdict(list)

    def _local(self, stage: int) -> bool:
        return 0 <= stage < self.placement.num_stages and self.placement.rank_of(stage) == self.rank

    def _missing_input(self, a: Action, src: int, done: set, comm: Op, what: str) -> str | None:
        """Why the input of ``a`` from stage ``src`` is not there yet, or None."""
        if not 0 <= src < self.placement.num_stages:
            return None  # the batch or the loss
        if self._local(src):
            if (src, a.microbatch) in done:
                return None
            return f"{a} runs before its {what} from stage {src} on this rank"
        recv = Action(a.stage, comm, a.microbatch)
        if not self.receives or recv in self.received:
            return None
        return f"{a} runs before {recv} brings its {what}"

    def _forward(self, a: Action, step: int) -> str | None:
        self.forwards[a.stage].append(a.microbatch)
        self.done_f.add((a.stage, a.microbatch))
        return self._missing_input(a, a.stage - 1, self.done_f, Op.RECV_F, "input")

    def _backward(self, a: Action, step: int) -> str | None:
        key = (a.stage, a.microbatch)
        self.backwards[a.stage].append(a.microbatch)
        self.done_b.add(key)
        if a.op is Op.I:
            self.pending_w[key] = step
        if key not in self.done_f:
            return f"{a} runs before F of the same micro-batch"
        return self._missing_input(a, a.stage + 1, self.done_b, Op.RECV_B, "output gradient")

    def _weight(self, a: Action, step: int) -> str | None:
        if self.pending_w.pop((a.stage, a.microbatch), None) is None:
            return f"{a} has no earlier I without a W"
        return None

    _HANDLERS: ClassVar[dict[Op, Callable[[_Replay, Action, int], str | None]]] = {
        Op.F: _forward,
        Op.B: _backward,
        Op.I: _backward,
        Op.W: _weight,
    }

    def compute(self, cell: Action, step: int) -> list[str]:
        """Run one compute cell (an overlap pair: F part, then B part); the problems found."""
        if not cell.is_compute:
            return [f"{cell} is not a compute action"]
        problems = []
        for a in cell.parts():
            if a.stage >= self.placement.num_stages or self.placement.rank_of(a.stage) != self.rank:
                problems.append(f"{a}: stage {a.stage} does not run on rank {self.rank}")
            elif why := self._HANDLERS[a.op](self, a, step):
                problems.append(why)
        return problems

    def comm(self, c: Action) -> str | None:
        """Issue one comm; why it is wrong, or None."""
        if not c.is_comm or not all(0 <= s < self.placement.num_stages for s in channel(c)):
            return f"{c} is not a comm between two stages"
        if self.placement.rank_of(c.stage) != self.rank:
            return f"{c} is not a comm of a stage on rank {self.rank}"
        produced = {Op.SEND_F: self.done_f, Op.SEND_B: self.done_b}.get(c.op)
        if produced is None:
            self.received.add(c)
        elif (c.stage, c.microbatch) not in produced:
            return f"{c} sends data that is not computed yet"
        return None

    def unfinished(self) -> list[tuple[int, str]]:
        """(step, problem) for each I whose W never ran."""
        return [(k, f"{s}I{mb} has no later W") for (s, mb), k in sorted(self.pending_w.items())]


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class TimelineRecord:
    """One compute cell as it ran: rank, start and end time, and the action."""

    rank: int
    start: float
    end: float
    action: Action

    @property
    def label(self) -> str:
        return str(self.action)

    @property
    def op(self) -> str:
        return self.action.op.value

    @property
    def microbatch(self) -> int | None:
        return self.action.microbatch


@dataclass(frozen=True, slots=True)
class WaitRecord:
    """Time a free rank spent waiting for messages before a compute: rank, start, end, and the
    receives it waited for."""

    rank: int
    start: float
    end: float
    receives: tuple[Action, ...]

    @property
    def label(self) -> str:
        return WAIT_PREFIX + " ".join(map(str, self.receives))


@dataclass(frozen=True, slots=True)
class RankStats:
    """Per-rank figures of a simulated run.

    busy: total compute time.
    idle: makespan - busy.
    bubble_fraction: idle / makespan.
    peak_activations: most micro-batches whose F ran but whose B/I has not, over the
        rank's stages together.
    peak_pending_w: most I actions waiting for their W at once.
    recv_wait: the part of idle the rank spent free but waiting for a message (its data not
        computed yet, or in flight); the rest of idle is the tail after its last action.
    """

    rank: int
    busy: float
    idle: float
    bubble_fraction: float
    peak_activations: int
    peak_pending_w: int
    recv_wait: float = 0.0


@dataclass(frozen=True)
class SimResult:
    """What ``simulate`` (or ``dataflow``) found.

    makespan: time at which the last rank finishes.
    ranks: per-rank figures, in rank order.
    timeline: one record per compute cell, per rank in program order.
    channel_order: per channel (source stage, destination stage), the micro-batches in the
        order they cross it.
    waits: the times a free rank waited for messages.
    """

    makespan: float
    ranks: tuple[RankStats, ...]
    timeline: tuple[TimelineRecord, ...]
    channel_order: dict[tuple[int, int], tuple[int, ...]] = field(repr=False)
    waits: tuple[WaitRecord, ...] = ()

    @property
    def bubble_fraction(self) -> float:
        """The mean over ranks of idle / makespan."""
        return sum(r.bubble_fraction for r in self.ranks) / len(self.ranks)

    def as_dict(self) -> dict:
        """The statistics as plain JSON-ready data (without the timeline)."""
        return _statistics(self.makespan, self.ranks)


@dataclass(frozen=True)
class Figures:
    """What ``figures`` found: a simulated run's statistics, without its timeline.

    makespan / ranks: as in ``SimResult``.
    dataflow_makespan: the makespan of the pure ``dataflow`` timing.
    """

    makespan: float
    ranks: tuple[RankStats, ...]
    dataflow_makespan: float

    @property
    def bubble_fraction(self) -> float:
        """The mean over ranks of idle / makespan."""
        return sum(r.bubble_fraction for r in self.ranks) / len(self.ranks)

    def as_dict(self) -> dict:
        """The statistics as plain JSON-ready data, as ``SimResult.as_dict``."""
        return _statistics(self.makespan, self.ranks)


def _statistics(makespan: float, ranks: Sequence[RankStats]) -> dict:
    return {
        "makespan": makespan,
        "bubble_fraction": sum(r.bubble_fraction for r in ranks) / len(ranks),
        "per_rank": [asdict(r) for r in ranks],
    }


# --------------------------------------------------------------------------------------------
# simulate

_Lowered = Mapping[int, Sequence[Step]]
_Cells = dict[int, list[str]]
_Edge = tuple[int, int]  # (sending rank, receiving rank)
_SENDS = (Op.SEND_F, Op.SEND_B)


def _cells(lowered: _Lowered) -> _Cells:
    return {
        r: ["flush" if s.compute is None else str(s.compute) for s in lowered[r]] for r in lowered
    }


def simulate(lowered: _Lowered, placement: Placement, costs: Costs | None = None) -> SimResult:
    """Run ``lowered`` (from ``lower.lower``) under the asynchronous model; see the module doc.

    Raises ``ScheduleError`` on a broken dependency or a deadlock.
    """
    costs = costs or Costs()
    programs, computes = packed.encode_lowered(lowered)
    durations = np.asarray([0.0 if c is None else costs.of(c) for c in computes], np.float64)
    run = _run(programs, placement, durations, costs.p2p, lambda: lowered)
    timeline: list[TimelineRecord] = []
    waits: list[WaitRecord] = []
    starts, ends, issue = run.starts.tolist(), run.ends.tolist(), run.issue.tolist()
    g = 0
    for r in programs.steps.ranks:
        for step in lowered[r]:
            if starts[g] > issue[g]:
                needs = comms_needed(step.compute, placement) if step.compute else ()
                waits.append(WaitRecord(r, issue[g], starts[g], needs))
            if step.compute is not None:
                timeline.append(TimelineRecord(r, starts[g], ends[g], step.compute))
            g += 1
    return SimResult(
        makespan=run.makespan,
        ranks=_rank_stats(programs.steps, run.makespan, run.spans(), run.waited()),
        timeline=tuple(timeline),
        channel_order=run.channel_order(programs, placement),
        waits=tuple(waits),
    )


def dataflow(
    schedule: Mapping[int, Sequence[Action]], placement: Placement, costs: Costs | None = None
) -> SimResult:
    """The pure dataflow timing of a compute-only schedule: an action starts when its rank is
    free and its inputs are done (``costs.p2p`` later when they come from another rank).

    The ideal of the asynchronous runtime: ``simulate(lower(...))`` equals it when receives
    are posted in time. Raises ``ScheduleError`` when the schedule cannot run to the end.
    """
    costs = costs or Costs()
    cells = packed.encode_schedule(schedule)
    flat = [a for r in cells.ranks for a in schedule[r]]
    times = cell_times(cells, placement, np.asarray([costs.of(a) for a in flat]), costs.p2p)
    _check_complete(cells, times)
    timeline, waits = [], []
    starts, ends = times.starts.tolist(), times.ends.tolist()
    g = 0
    for r in cells.ranks:
        free = 0.0
        for a in schedule[r]:
            if starts[g] > free:
                waits.append(WaitRecord(r, free, starts[g], comms_needed(a, placement)))
            timeline.append(TimelineRecord(r, starts[g], ends[g], a))
            free = ends[g]
            g += 1
    spans = times.ends - times.starts
    previous = np.concatenate([[0.0], times.ends[:-1]])
    previous[cells.offsets[:-1][np.diff(cells.offsets) > 0]] = 0.0  # each rank starts free
    waited = np.where(times.starts > previous, times.starts - previous, 0.0)
    return SimResult(
        makespan=times.makespan,
        ranks=_rank_stats(cells, times.makespan, spans, waited),
        timeline=tuple(timeline),
        channel_order={},
        waits=tuple(waits),
    )


def _check_complete(cells: Cells, times: CellTimes) -> None:
    """``dataflow``'s deadlock report: a rank whose cells could not all be timed."""
    if times.complete(cells):
        return
    names = cells.names()
    stuck = [
        (r, t, "waits for data that is never computed")
        for r, t, size in zip(cells.ranks, times.timed.tolist(), np.diff(cells.offsets).tolist())
        if t < size
    ]
    raise _error("deadlock: no rank can progress", names, stuck, "blocked")


def figures(
    cells: Cells, placement: Placement, num_microbatches: int, costs: Costs | None = None
) -> Figures:
    """What ``graphpipe schedule`` reports, on ``packed.Cells`` and in time linear in the
    number of actions: ``validate_cells``, ``lower`` (receives timed with ``costs``),
    ``simulate`` and the ``dataflow`` makespan, without building a timeline.

    Equal to those functions on the decoded schedule; raises ``ScheduleError`` as they do.
    """
    costs = costs or Costs()
    validate_cells(cells, placement, num_microbatches)
    plain = lower_cells(cells, placement, early_receives=False)
    durations = costs.durations(plain.steps)
    times = cell_times(plain.steps, placement, durations, costs.p2p)
    programs = post_receives_early_cells(plain, placement, times)
    del plain  # its comms; the steps stay, in programs
    times = replace(times, done=times.done[:0])  # the data items' times are not needed now
    run = _run(programs, placement, durations, costs.p2p, lambda: decode_programs(programs), times)
    makespan = run.makespan
    ranks = _rank_stats(programs.steps, makespan, run.spans(), run.waited())
    del run
    if not times.complete(programs.steps):  # what dataflow() reports, on the schedule's cells
        _check_complete(cells, cell_times(cells, placement, costs.durations(cells), costs.p2p))
    return Figures(makespan=makespan, ranks=ranks, dataflow_makespan=times.makespan)


def _check_dependencies(lowered: _Lowered, placement: Placement, cells: _Cells) -> None:
    """Static per-rank checks: every input is there before a compute uses it (received, or
    computed on this rank), every send's data was computed before the send, every comm is
    issued by its stage's rank, every W follows its I."""
    problems: list[tuple[int, int, str]] = []
    for rank in sorted(lowered):
        replay = _Replay(rank, placement, receives=True)
        for k, step in enumerate(lowered[rank]):
            problems += [(rank, k, why) for c in step.comms if (why := replay.comm(c))]
            if step.compute is not None:
                problems += [(rank, k, why) for why in replay.compute(step.compute, k)]
    if problems:
        raise _error("broken dependency:", cells, problems, "broken")


def _explain_unmatched(lowered: _Lowered, placement: Placement, cells: _Cells) -> None:
    """Raise ``ScheduleError`` naming every message whose two ends do not pair up: the i-th
    message each rank sends to a peer is the i-th receive the peer posts from it."""
    sends: dict[_Edge, list[tuple[Action, int]]] = defaultdict(list)  # (send, step)
    recvs: dict[_Edge, list[tuple[Action, int]]] = defaultdict(list)  # (recv, step)
    for rank in sorted(lowered):
        for k, step in enumerate(lowered[rank]):
            for c in step.comms:
                other = peer(c, placement)
                if c.op in _SENDS:
                    sends[(rank, other)].append((c, k))
                else:
                    recvs[(other, rank)].append((c, k))
    problems: list[tuple[int, int, str]] = []
    for edge in sorted(set(sends) | set(recvs)):
        src, dst = edge
        out, into = sends[edge], recvs[edge]
        for i, ((s, sk), (r, rk)) in enumerate(zip(out, into, strict=False)):
            if matching(s) != r:
                problems += [
                    (
                        src,
                        sk,
                        f"rank {src} -> rank {dst}: message {i} is sent as {s} but rank "
                        f"{dst} receives it as {r} at its step {rk}",
                    ),
                    (
                        dst,
                        rk,
                        f"rank {src} -> rank {dst}: message {i} is received as {r} but "
                        f"rank {src} sends it as {s} at its step {sk}",
                    ),
                ]
        for c, k in out[len(into) :]:
            problems.append((src, k, f"{c} is never received: rank {dst} posts no {matching(c)}"))
        for c, k in into[len(out) :]:
            problems.append(
                (dst, k, f"{c} has no matching send: rank {src} posts no {matching(c)}")
            )
    if problems:
        raise _error(
            "broken dependency (unmatched or out-of-order messages):", cells, problems, "broken"
        )


# --------------------------------------------------------------------------------------------
# Checks on arrays: the fast gates; the replays above explain what they find


def _parts(cells: Cells, base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every part of ``cells`` (codes), its rank and its place in its rank's order (``base``
    per cell for the first part, ``base + 1`` for the second)."""
    rank = cells.rank_of_cell()
    has1, has2 = cells.first >= 0, cells.second >= 0
    codes = np.concatenate([cells.first[has1], cells.second[has2]])
    ranks = np.concatenate([rank[has1], rank[has2]])
    order = np.concatenate([base[has1], base[has2] + 1])
    return codes, ranks, order


def _weights_ok(key: np.ndarray, op: np.ndarray, order: np.ndarray, finished: bool) -> bool:
    """Each W follows an I of its (stage, micro-batch) with no W between; ``finished``: no I
    is left without its W (``_Replay._weight`` and ``unfinished``)."""
    sel = (op == packed.I) | (op == packed.W)
    k, o, w = key[sel], order[sel], op[sel] == packed.W
    by = np.lexsort((o, k))
    k, w = k[by], w[by]
    after_i = np.concatenate([[False], (k[1:] == k[:-1]) & ~w[:-1]])
    if (w & ~after_i).any():
        return False
    last = np.concatenate([k[1:] != k[:-1], [True]])
    return not (finished and (last & ~w).any())


def _local_stages(placement: Placement, ranks: Sequence[int]) -> tuple[np.ndarray, int]:
    """``(remap, count)``: the stages of ``ranks`` numbered 0 .. count-1 (``remap[s]``; -1 for
    another rank's stage), so that a table per (stage, micro-batch) of these ranks is small."""
    owner = np.asarray(placement.stage_to_rank, dtype=np.int64)
    mine = np.isin(owner, np.asarray(ranks, dtype=np.int64))
    remap = np.full(placement.num_stages + 1, -1, dtype=np.int64)  # [-1], [S]: no stage
    remap[np.flatnonzero(mine)] = np.arange(int(mine.sum()))
    return remap, int(mine.sum())


def _compute_ok(
    codes: np.ndarray,
    ranks: np.ndarray,
    order: np.ndarray,
    placement: Placement,
    mb: int,
    local_stages: tuple[np.ndarray, int],
    received: tuple[np.ndarray, np.ndarray] | None,
) -> bool:
    """``_Replay.compute`` for every part at once: on its stage's rank, its inputs there
    before it (a local neighbour's output computed, a remote one received when ``received``
    holds the first order of each ``RECV_F`` / ``RECV_B`` of these ranks, by local key), B/I
    after F, W after I. ``local_stages``: ``_local_stages`` of the ranks of ``codes``."""
    owner = np.asarray(placement.stage_to_rank, dtype=np.int64)
    stages = placement.num_stages
    op, key = codes & 7, codes >> 3
    stage, micro = key // mb, key % mb
    if (op > packed.W).any() or (stage >= stages).any() or (owner[stage] != ranks).any():
        return False
    remap, count = local_stages
    local_key = remap[stage] * mb + micro  # every part is on one of these ranks now
    size = count * mb
    forward = op == packed.F
    backward = (op == packed.B) | (op == packed.I)
    done_f = packed.first_at(size, local_key[forward], order[forward])
    done_b = packed.first_at(size, local_key[backward], order[backward])
    for sel, offset, done, comm in ((forward, -1, done_f, 0), (backward, +1, done_b, 1)):
        s, m, o = stage[sel], micro[sel], order[sel]
        src = s + offset
        inside = (src >= 0) & (src < stages)
        local = inside & (owner[np.clip(src, 0, stages - 1)] == owner[s])
        if not (done[remap[src[local]] * mb + m[local]] < o[local]).all():
            return False
        if received is not None:
            remote = inside & ~local
            if not (received[comm][local_key[sel][remote]] < o[remote]).all():
                return False
    if not (done_f[local_key[backward]] < order[backward]).all():
        return False
    return _weights_ok(local_key, op, order, finished=received is None)


def _schedule_ok(cells: Cells, placement: Placement, num_microbatches: int) -> bool:
    """Whether ``validate`` finds nothing wrong with ``cells``, without naming it (a chunk of
    ranks at a time: every check concerns the actions of one rank)."""
    if cells.ranks != tuple(range(placement.num_ranks)):
        return False
    return all(
        _ranks_ok(cells.part(lo, hi), placement, num_microbatches) for lo, hi in cells.chunks()
    )


def _ranks_ok(cells: Cells, placement: Placement, num_microbatches: int) -> bool:
    codes, ranks, order = _parts(cells, 2 * np.arange(len(cells), dtype=np.int64))
    mb = cells.mb_bound
    local_stages = _local_stages(placement, cells.ranks)
    if not _compute_ok(codes, ranks, order, placement, mb, local_stages, None):
        return False
    remap, count = local_stages
    op, stage, micro = codes & 7, (codes >> 3) // mb, (codes >> 3) % mb
    m = num_microbatches
    for sel in (op == packed.F, (op == packed.B) | (op == packed.I)):
        if (micro[sel] >= m).any():
            return False
        counts = np.bincount(remap[stage[sel]] * m + micro[sel], minlength=count * m)
        if not (counts == 1).all():  # each stage of these ranks: every micro-batch once
            return False
    return True


def validate_cells(cells: Cells, placement: Placement, num_microbatches: int) -> None:
    """``validate`` on ``packed.Cells``: the checks on arrays; what they find is reported by
    ``validate`` on the decoded schedule (the same ``ScheduleError``)."""
    if not _schedule_ok(cells, placement, num_microbatches):
        validate(packed.decode_schedule(cells), placement, num_microbatches)
        raise AssertionError("validate_cells found a problem that validate does not report")


_SOURCE = np.asarray([0, 0, 0, 0, 0, -1, 0, +1])  # per op: a comm's source stage - its stage
_TARGET = np.asarray([0, 0, 0, 0, +1, 0, -1, 0])  # and its destination stage - its stage


def _comm_ends(codes: np.ndarray, mb: int) -> tuple[np.ndarray, np.ndarray]:
    """``channel`` on codes: the (source, destination) stage of every comm code."""
    op, stage = codes & 7, (codes >> 3) // mb
    return stage + _SOURCE[op], stage + _TARGET[op]


class _Chunk:
    """The programs of some ranks (``Programs.part`` of rank indices ``lo`` to ``hi``) and,
    computed once for the checks that read them, per comm: its step (in the chunk), rank,
    op, key, stage, micro-batch, source and destination stage. ``c0`` / ``g0``: the chunk's
    first comm and step in the whole programs."""

    def __init__(self, programs: Programs, lo: int, hi: int) -> None:
        self.programs = part = programs.part(lo, hi)
        self.g0 = int(programs.steps.offsets[lo])
        self.c0 = int(programs.comm_offsets[self.g0])
        mb = part.steps.mb_bound
        self.step = part.comm_step()
        per_rank = np.diff(part.comm_offsets[part.steps.offsets])
        self.rank = np.repeat(np.asarray(part.steps.ranks, dtype=np.int64), per_rank)
        self.op, self.key = part.comms & 7, part.comms >> 3
        self.stage, self.micro = np.divmod(self.key, mb)
        self.src, self.dst = self.stage + _SOURCE[self.op], self.stage + _TARGET[self.op]
        self.is_send = (self.op == packed.SEND_F) | (self.op == packed.SEND_B)

    def dependencies_ok(self, placement: Placement) -> bool:
        """Whether ``_check_dependencies`` finds nothing wrong here, without naming it."""
        steps, mb, stages = self.programs.steps, self.programs.steps.mb_bound, placement.num_stages
        owner = np.asarray(placement.stage_to_rank, dtype=np.int64)
        op, where = self.op, 3 * self.step  # a step's comms come before its compute
        if (op < packed.SEND_F).any():
            return False
        ends = np.concatenate([self.src, self.dst]).astype(np.uint64)  # a negative: too large
        if (ends >= stages).any() or (owner[self.stage] != self.rank).any():
            return False
        local_stages = remap, count = _local_stages(placement, steps.ranks)
        local_key = remap[self.stage] * mb + self.micro
        parts, part_rank, order = _parts(steps, 3 * np.arange(len(steps), dtype=np.int64) + 1)
        size = count * mb
        received = tuple(
            packed.first_at(size, local_key[op == c], where[op == c])
            for c in (packed.RECV_F, packed.RECV_B)
        )
        if not _compute_ok(parts, part_rank, order, placement, mb, local_stages, received):  # type: ignore[arg-type]
            return False
        p_op, p_key = parts & 7, parts >> 3
        p_local = remap[p_key // mb] * mb + p_key % mb
        for send, made in (
            (packed.SEND_F, p_op == packed.F),
            (packed.SEND_B, (p_op == packed.B) | (p_op == packed.I)),
        ):
            done = packed.first_at(size, p_local[made], order[made])
            if not (done[local_key[op == send]] < where[op == send]).all():
                return False
        return True

    def rank_pairs(self, placement: Placement) -> np.ndarray:
        """Per comm, its directed rank pair ``sender * num_ranks + receiver``."""
        owner = np.asarray(placement.stage_to_rank, dtype=np.int64)
        pairs = placement.num_ranks
        return np.where(
            self.is_send,
            self.rank * pairs + owner[self.dst],
            owner[self.src] * pairs + self.rank,
        )

    def needs(self, placement: Placement, posted: np.ndarray) -> list[np.ndarray]:
        """Per step, the comm (index in the whole programs) of each receive its compute reads
        (of its first part, of its second; -1: none). ``posted``: per receive slot (``key * 2
        + 1`` for ``RECV_B``), the last comm that posts it (``_posted``)."""
        part = self.programs
        out = []
        for cells in (part.steps.first, part.steps.second):
            want, _ = comm_codes(cells, placement, part.steps.mb_bound)
            slot = (want >> 3) * 2 + ((want & 7) == packed.RECV_B)
            out.append(np.where(want >= 0, posted[np.maximum(slot, 0)], -1))
        return out

    def sent_when_made(self) -> bool:
        """Whether every send is posted in the step right after the compute that makes its
        data (SEND_F s m after F s m, SEND_B s m after B or I s m) on its rank."""
        steps = self.programs.steps
        sends = np.flatnonzero(self.is_send)
        step = self.step[sends]
        first_step = np.zeros(len(steps) + 1, dtype=bool)
        first_step[steps.offsets] = True
        if first_step[step].any():
            return False
        wants = np.where(self.op[sends] == packed.SEND_F, packed.F, packed.B)
        made = np.zeros(len(sends), dtype=bool)
        for part in (steps.first[step - 1], steps.second[step - 1]):
            part_op = np.where((part & 7) == packed.I, packed.B, part & 7)
            made |= (part >= 0) & ((part >> 3) == self.key[sends]) & (part_op == wants)
        return bool(made.all())


def _posted(programs: Programs, placement: Placement) -> np.ndarray:
    """Per receive slot (``key * 2``, ``+ 1`` for ``RECV_B``), the last comm posting it (-1:
    none); a valid program's comms are on stages of the placement."""
    codes = programs.comms
    recvs = np.flatnonzero(((codes & 7) == packed.RECV_F) | ((codes & 7) == packed.RECV_B))
    size = (placement.num_stages + 1) * programs.steps.mb_bound * 2
    slot = (codes[recvs] >> 3) * 2 + ((codes[recvs] & 7) == packed.RECV_B)
    inside = slot < size  # the others fail the checks
    return packed.last_at(size, slot[inside], recvs[inside])


@dataclass(frozen=True, eq=False)
class _Messages:
    """The messages of a lowered schedule per directed rank pair, in order: message ``j`` is
    posted by comm ``send[j]`` at the sender and ``recv[j]`` at the receiver; ``first[j]``:
    it is the first on its rank pair."""

    send: np.ndarray
    recv: np.ndarray
    first: np.ndarray


def _pair(codes: np.ndarray, rank_pair: np.ndarray, mb: int) -> _Messages | None:
    """Pair the i-th message each rank sends to a peer with the i-th receive the peer posts
    from it (``rank_pair``: per comm, see ``_Chunk.rank_pairs``); None when they do not match
    (``_explain_unmatched`` says why)."""
    is_send = ((codes & 7) == packed.SEND_F) | ((codes & 7) == packed.SEND_B)
    sends, recvs = np.flatnonzero(is_send), np.flatnonzero(~is_send)
    del is_send
    if len(sends) != len(recvs):
        return None
    index = np.int32 if len(codes) < 2**31 else np.int64
    sends = sends[np.argsort(rank_pair[sends], kind="stable")].astype(index)
    recvs = recvs[np.argsort(rank_pair[recvs], kind="stable")].astype(index)
    shift = mb * 8 + 1  # SEND_F s -> RECV_F s+1; SEND_B s -> RECV_B s-1
    for lo in range(0, len(sends), packed.CHUNK):
        s_, r_ = sends[lo : lo + packed.CHUNK], recvs[lo : lo + packed.CHUNK]
        if not (rank_pair[s_] == rank_pair[r_]).all():
            return None
        sent = codes[s_]
        matched = np.where((sent & 7) == packed.SEND_F, sent + shift, sent - shift + 2)
        if not (matched == codes[r_]).all():
            return None
    pair = rank_pair[sends]
    first = np.concatenate([[True], pair[1:] != pair[:-1]]) if len(sends) else pair > 0
    return _Messages(sends, recvs, first)


# --------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True, eq=False)
class _Outcome:
    """What ``_run`` found, per lowered step: when its batch was posted (``issue``), when its
    compute started (a flush: when it was reached) and ended (NaN for a flush)."""

    issue: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    makespan: float
    messages: _Messages

    def spans(self) -> np.ndarray:
        """Per step, its compute's end - start (NaN for a flush)."""
        return self.ends - self.starts

    def waited(self) -> np.ndarray:
        """Per step, how long its rank waited for messages before it (0: not at all)."""
        return np.where(self.starts > self.issue, self.starts - self.issue, 0.0)

    def channel_order(
        self, programs: Programs, placement: Placement
    ) -> dict[tuple[int, int], tuple[int, ...]]:
        """Per channel (source stage, destination stage), the micro-batches in the order
        they cross it."""
        mb = programs.steps.mb_bound
        sends = programs.comms[self.messages.send]
        src, dst = _comm_ends(sends, mb)
        order: dict[tuple[int, int], list[int]] = defaultdict(list)
        for s, d, micro in zip(src.tolist(), dst.tolist(), ((sends >> 3) % mb).tolist()):
            order[(s, d)].append(micro)
        return {ch: tuple(mbs) for ch, mbs in sorted(order.items())}


def _ints(values: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    return out


def _floats(values: np.ndarray) -> array:
    out = array("d")
    out.frombytes(np.ascontiguousarray(values, dtype=np.float64).tobytes())
    return out


def _run(
    programs: Programs,
    placement: Placement,
    durations: np.ndarray,
    p2p: float,
    steps_of: Callable[[], _Lowered],
    times: CellTimes | None = None,
) -> _Outcome:
    """The event loop of ``simulate`` on ``Programs``: advance every rank as far as its
    messages allow (see the module doc). ``durations``: per step, its compute's time;
    ``steps_of()``: the Steps, to explain a broken program with the replays. ``times``, if
    given, is ``cell_times`` of the steps with these durations and ``latency=p2p``: where
    the run equals it (``_as_dataflow``), the loop is not needed."""
    steps, codes = programs.steps, programs.comms
    pairs = placement.num_ranks
    rank_pair = np.empty(len(codes), dtype=np.int32 if pairs * pairs < 2**31 else np.int64)
    index = np.int32 if len(codes) < 2**31 else np.int64
    need_comm = [np.full(len(steps), -1, dtype=index) for _ in range(2)]
    posted = None
    sent_when_made = True
    for lo, hi in programs.chunks():  # the checks, and what the run reads, rank by rank
        chunk = _Chunk(programs, lo, hi)
        if not chunk.dependencies_ok(placement):
            lowered = steps_of()
            _check_dependencies(lowered, placement, _cells(lowered))
            raise AssertionError("the array checks found a broken dependency the replay does not")
        rank_pair[chunk.c0 : chunk.c0 + len(chunk.op)] = chunk.rank_pairs(placement)
        posted = _posted(programs, placement) if posted is None else posted
        for whole, part in zip(need_comm, chunk.needs(placement, posted)):
            whole[chunk.g0 : chunk.g0 + len(part)] = part
        sent_when_made = sent_when_made and chunk.sent_when_made()
        del chunk
    messages = _pair(codes, rank_pair, steps.mb_bound)
    del rank_pair
    if messages is None:
        lowered = steps_of()
        _explain_unmatched(lowered, placement, _cells(lowered))
        raise AssertionError("the array checks found unmatched messages the replay does not")
    # message j: the steps that post its two ends; per step: the messages its compute reads
    comm_step = programs.comm_step().astype(messages.send.dtype)
    send_step, recv_step = comm_step[messages.send], comm_step[messages.recv]
    del comm_step
    message_of = np.full(len(codes), -1, dtype=messages.recv.dtype)
    message_of[messages.recv] = np.arange(len(messages.recv), dtype=messages.recv.dtype)
    needs = [
        np.where(n >= 0, message_of[np.maximum(n, 0)], -1) if len(codes) else n for n in need_comm
    ]
    del message_of, need_comm
    edge_start = np.flatnonzero(messages.first)
    found = None
    if times is not None and sent_when_made:
        found = _as_dataflow(programs, times, needs, send_step, recv_step, edge_start, p2p)
    if found is not None:
        issue, starts, ends, arrival = found
    else:
        edge_of = np.cumsum(messages.first) - 1
        issue, starts, ends = _run_loop(
            steps,
            needs,
            durations,
            send_step,
            recv_step,
            edge_of,
            edge_start,
            p2p,
            placement,
            steps_of,
        )
        arrival = _arrivals(issue, send_step, recv_step, edge_start, p2p)
    # a rank is done when its last compute has ended and its sends have arrived
    finish = np.zeros(len(steps.ranks))
    for i in range(len(steps.ranks)):
        mine = ends[steps.offsets[i] : steps.offsets[i + 1]]
        mine = mine[~np.isnan(mine)]
        if len(mine):
            finish[i] = mine[-1]
    if len(arrival):  # the messages are in sender order (their rank pairs are)
        sender = np.searchsorted(steps.offsets, send_step, side="right") - 1
        first = np.flatnonzero(np.concatenate([[True], sender[1:] != sender[:-1]]))
        latest = np.maximum.reduceat(arrival, first)
        finish[sender[first]] = np.maximum(finish[sender[first]], latest)
    makespan = float(finish.max()) if len(finish) else 0.0
    return _Outcome(issue, starts, ends, makespan, messages)


def _arrivals(
    issue: np.ndarray,
    send_step: np.ndarray,
    recv_step: np.ndarray,
    edge_start: np.ndarray,
    p2p: float,
) -> np.ndarray:
    """Every message's arrival, from when each step's batch was posted: ``p2p`` after both
    of its ends are posted, and per rank pair in order no earlier than the one before it."""
    travel = np.maximum(issue[send_step], issue[recv_step]) + p2p
    bounds = np.append(edge_start, len(travel))
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        travel[lo:hi] = np.maximum.accumulate(travel[lo:hi])
    return travel


def _as_dataflow(
    programs: Programs,
    times: CellTimes,
    needs: list[np.ndarray],
    send_step: np.ndarray,
    recv_step: np.ndarray,
    edge_start: np.ndarray,
    p2p: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The run's (issue, start, end) per step and arrival per message when they are the
    dataflow ``times``, else None.

    For programs whose every send is posted in the step right after the compute that makes
    its data (``_Chunk.sent_when_made``, as ``lower`` posts them; the caller checks), a step
    waits for nothing the dataflow does not wait for: the run
    cannot deadlock where the dataflow completes, and the run's times are the one solution of
    its equations (each a max of earlier times plus a cost). So if the dataflow times satisfy
    those equations exactly (every compute starts when its rank is free and its messages have
    arrived, as the run computes them, in the same floating-point operations), they are the
    run's times, bit for bit. ``p2p`` must be the latency ``times`` was computed with.
    """
    steps = programs.steps
    if not times.complete(steps):
        return None
    # the run's equations, evaluated on the dataflow times
    issue = np.concatenate([[0.0], times.ends[:-1]])
    issue[steps.offsets[:-1][np.diff(steps.offsets) > 0]] = 0.0
    arrival = _arrivals(issue, send_step, recv_step, edge_start, p2p)
    start = issue.copy()
    for need in needs:
        has = need >= 0
        start[has] = np.maximum(start[has], arrival[need[has]])
    if not (start == times.starts).all():
        return None
    ends = np.where(steps.first >= 0, times.ends, np.nan)
    return issue, times.starts, ends, arrival


def _run_loop(
    steps: Cells,
    needs: list[np.ndarray],
    durations: np.ndarray,
    send_step: np.ndarray,
    recv_step: np.ndarray,
    edge_of: np.ndarray,
    edge_start: np.ndarray,
    p2p: float,
    placement: Placement,
    steps_of: Callable[[], _Lowered],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Advance the ranks from a work list: a rank runs its steps (posting each batch when it
    reaches it) until a compute reads a message whose other end is not posted yet, and is
    woken when the step that posts it is reached. Each step is visited once, each message's
    arrival computed once; the times do not depend on the order ranks are advanced in.
    Returns per step: when its batch was posted, its start and its end."""
    need1, need2 = _ints(needs[0]), _ints(needs[1])
    dur = _floats(np.where(steps.first >= 0, durations, 0.0))
    compute = bytearray((steps.first >= 0).astype(np.uint8))
    sstep, rstep, edge = _ints(send_step), _ints(recv_step), _ints(edge_of)
    estart = edge_start.tolist()
    upto = list(estart)  # per rank pair: its next message whose arrival is not known yet
    total = len(steps)
    issue, starts = array("d", bytes(8 * total)), array("d", bytes(8 * total))
    ends = array("d", [math.nan]) * total
    arrival = array("d", bytes(8 * len(sstep)))
    issued, awaited = bytearray(total), bytearray(total)
    waiters: dict[int, list[int]] = {}
    offsets = steps.offsets.tolist()
    pos, free = offsets[:-1], [0.0] * len(steps.ranks)
    work = list(range(len(steps.ranks)))[::-1]
    while work:
        i = work.pop()
        g, stop, t = pos[i], offsets[i + 1], free[i]
        blocked = -1
        while g < stop:
            if not issued[g]:
                issue[g] = t
                issued[g] = 1
                if awaited[g]:
                    awaited[g] = 0
                    work.extend(waiters.pop(g))
            start = t
            # the messages this compute reads: the arrival of each (and of those before it on
            # its rank pair, FIFO), once both ends of each are posted; two needs at most
            for m in (need1[g], need2[g]):
                if m < 0:
                    continue
                e = edge[m]
                j = upto[e]
                while j <= m:
                    ss, rs = sstep[j], rstep[j]
                    if not issued[ss]:
                        blocked = ss
                        break
                    if not issued[rs]:
                        blocked = rs
                        break
                    x, y = issue[ss], issue[rs]
                    a = (x if x > y else y) + p2p
                    if j != estart[e] and arrival[j - 1] > a:
                        a = arrival[j - 1]
                    arrival[j] = a
                    j += 1
                upto[e] = j
                if blocked >= 0:
                    break
                if arrival[m] > start:
                    start = arrival[m]
            if blocked >= 0:
                break
            starts[g] = start
            if compute[g]:
                t = start + dur[g]
                ends[g] = t
            g += 1
        pos[i], free[i] = g, t
        if blocked >= 0:
            waiters.setdefault(blocked, []).append(i)
            awaited[blocked] = 1
    stuck = [i for i in range(len(pos)) if pos[i] < offsets[i + 1]]
    if stuck:
        local = [p - lo for p, lo in zip(pos, offsets[:-1])]
        posted = [
            bool(issued[sstep[j]] and issued[rstep[j]]) for j in range(len(sstep))
        ]  # what the rank pairs can deliver: a message whose both ends are posted
        raise _deadlock(
            steps, [need1, need2], posted, edge, estart, local, stuck, placement, steps_of()
        )
    return (
        np.frombuffer(issue, dtype=np.float64).copy(),
        np.frombuffer(starts, dtype=np.float64).copy(),
        np.frombuffer(ends, dtype=np.float64).copy(),
    )


def _deadlock(
    steps: Cells,
    needs: list[array],
    posted: list[bool],
    edge: array,
    estart: list[int],
    local: list[int],
    stuck: list[int],
    placement: Placement,
    lowered: _Lowered,
) -> ScheduleError:
    """The deadlock report: each stuck rank's compute, and for each message it waits for,
    the peer that has not posted its end and where that peer is stuck."""
    cells = _cells(lowered)
    ranks = steps.ranks
    index_of = {r: i for i, r in enumerate(ranks)}
    offsets = steps.offsets.tolist()
    problems = []
    for i in stuck:
        r, k = ranks[i], local[i]
        compute = lowered[r][k].compute
        receives = comms_needed(compute, placement) if compute else ()
        wanted = [m for m in (needs[0][offsets[i] + k], needs[1][offsets[i] + k]) if m >= 0]
        for c, m in zip(receives, wanted):
            if all(posted[estart[edge[m]] : m + 1]):
                continue  # this one can arrive; the rank waits for another
            p = peer(c, placement)
            j = local[index_of[p]]
            cell = cells[p][j] if j < len(cells[p]) else "the end"
            problems.append(
                (
                    r,
                    k,
                    f"{c} waits for rank {p} to post {matching(c)}; rank {p} is stuck "
                    f"at step {j} ({cell})",
                )
            )
    return _error("deadlock: no rank can progress", cells, problems, "blocked")


# --------------------------------------------------------------------------------------------
# Statistics


def _rank_stats(
    cells: Cells, makespan: float, spans: np.ndarray, waited: np.ndarray
) -> tuple[RankStats, ...]:
    """Per rank of ``cells`` (a schedule, or the steps of a lowered one): busy time (the sum of
    ``spans``, each cell's end - start), recv_wait (of ``waited``) and the peaks of live
    activations and pending W over its actions in order."""
    out = []
    for lo, hi in cells.chunks():
        part = cells.part(lo, hi)
        base = int(cells.offsets[lo])
        codes, _, order = _parts(part, 2 * np.arange(len(part), dtype=np.int64))
        by = np.argsort(order, kind="stable")
        codes, cell = codes[by], order[by] // 2  # every part in program order, and its cell
        op = codes & 7
        live = np.select([op == packed.F, (op == packed.B) | (op == packed.I)], [1, -1], 0)
        pending = np.select([op == packed.I, op == packed.W], [1, -1], 0)
        part_bounds = np.searchsorted(cell, part.offsets).tolist()
        for i, r in enumerate(part.ranks):
            a, b = base + int(part.offsets[i]), base + int(part.offsets[i + 1])
            spent = spans[a:b]
            busy = sum(spent[part.first[a - base : b - base] >= 0].tolist())
            wait = waited[a:b]
            p, q = part_bounds[i], part_bounds[i + 1]
            peaks = [max(0, int(np.cumsum(d[p:q]).max(initial=0))) for d in (live, pending)]
            idle = makespan - busy
            out.append(
                RankStats(
                    rank=r,
                    busy=busy,
                    idle=idle,
                    bubble_fraction=idle / makespan if makespan > 0 else 0.0,
                    peak_activations=peaks[0],
                    peak_pending_w=peaks[1],
                    recv_wait=sum(wait[wait > 0].tolist()),
                )
            )
    return tuple(out)
