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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from graphpipe.ir import WAIT_PREFIX, Action, Op, Placement
from graphpipe.lower import Step, channel, comms_needed, matching, peer
from graphpipe.schedules import SCHEDULES
from graphpipe.timing import dataflow_times

__all__ = [
    "Costs",
    "RankStats",
    "ScheduleError",
    "SimResult",
    "TimelineRecord",
    "WaitRecord",
    "dataflow",
    "format_grid",
    "resolve_schedule",
    "simulate",
    "validate",
]


class ScheduleError(ValueError):
    """A schedule that cannot run: the message holds the grid with the failing cells marked."""


# --------------------------------------------------------------------------------------------
# Costs


@dataclass(frozen=True, slots=True)
class Costs:
    """Execution times of one action, in any unit (the simulator's times use the same).

    F: forward of one micro-batch through one stage.
    B: full backward (input and weight gradients).
    I: backward for input gradients only.
    W: the deferred weight-gradient work of one I.
    FB: an overlapped (F, B) pair; None means F + B (no gain from overlapping).
    p2p: latency of each message, from the moment both of its ends are posted.
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the op's name
    W: float = 1.0
    FB: float | None = None
    p2p: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not value >= 0:
                raise ValueError(f"cost {f.name} must be >= 0, got {value}")

    @property
    def overlap(self) -> float:
        """The cost of an overlapped (F, B) pair."""
        return self.F + self.B if self.FB is None else self.FB

    def of(self, action: Action | None) -> float:
        """The cost of one compute cell (None, the final flush: 0)."""
        if action is None:
            return 0.0
        if action.op is Op.OVERLAP_F_B:
            forward, backward = action.parts()
            if backward.op is Op.B:
                return self.overlap
            return self.of(forward) + self.of(backward)
        return {Op.F: self.F, Op.B: self.B, Op.I: self.I, Op.W: self.W}[action.op]

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse ``"F=1,B=2,W=1,p2p=0.1"`` (``F&B`` is accepted for ``FB``); unnamed costs keep
        their defaults."""
        names = {f.name: f.name for f in fields(cls)} | {"F&B": "FB"}
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or key not in names:
                raise ValueError(
                    f"bad cost {item!r}: expected NAME=NUMBER with NAME one of "
                    f"{', '.join(n for n in names if n != 'F&B')}"
                )
            try:
                values[names[key]] = float(value)
            except ValueError:
                raise ValueError(f"bad cost {item!r}: {value!r} is not a number") from None
        return cls(**values)

    def __str__(self) -> str:
        return " ".join(f"{k}={v:g}" for k, v in asdict(self).items() if v is not None)


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
        return {
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "per_rank": [asdict(r) for r in self.ranks],
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
    cells = _cells(lowered)
    _check_dependencies(lowered, placement, cells)
    edges, channel_order = _match_edges(lowered, placement, cells)
    timeline, waits, finish = _Run(lowered, placement, costs, edges, cells).run()
    makespan = max(finish.values(), default=0.0)
    stats = tuple(
        _rank_stats(r, [s.compute for s in lowered[r]], timeline, makespan, waits)
        for r in sorted(lowered)
    )
    return SimResult(
        makespan=makespan,
        ranks=stats,
        timeline=tuple(timeline),
        channel_order=channel_order,
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
    times = dataflow_times(schedule, placement, costs.of, costs.p2p)
    if not times.complete(schedule):
        cells = {r: [str(a) for a in schedule[r]] for r in schedule}
        stuck = [
            (r, len(times.starts[r]), "waits for data that is never computed")
            for r in sorted(schedule)
            if len(times.starts[r]) < len(schedule[r])
        ]
        raise _error("deadlock: no rank can progress", cells, stuck, "blocked")
    timeline, waits = [], []
    for r in sorted(schedule):
        free = 0.0
        for a, start, end in zip(schedule[r], times.starts[r], times.ends[r], strict=True):
            if start > free:
                waits.append(WaitRecord(r, free, start, comms_needed(a, placement)))
            timeline.append(TimelineRecord(r, start, end, a))
            free = end
    makespan = times.makespan
    stats = tuple(_rank_stats(r, schedule[r], timeline, makespan, waits) for r in sorted(schedule))
    return SimResult(
        makespan=makespan,
        ranks=stats,
        timeline=tuple(timeline),
        channel_order={},
        waits=tuple(waits),
    )


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


class _Edges:
    """Messages per directed rank pair, in order: where each is posted at both ends."""

    def __init__(self) -> None:
        self.sends: dict[_Edge, list[tuple[Action, int]]] = defaultdict(list)  # (send, step)
        self.recvs: dict[_Edge, list[tuple[Action, int]]] = defaultdict(list)  # (recv, step)
        self.place: dict[Action, tuple[_Edge, int]] = {}  # a send or a receive -> (edge, i)


def _match_edges(
    lowered: _Lowered, placement: Placement, cells: _Cells
) -> tuple[_Edges, dict[tuple[int, int], tuple[int, ...]]]:
    """Pair the i-th message each rank sends to a peer with the i-th receive the peer posts
    from it; returns the pairing and the micro-batch order per channel."""
    edges = _Edges()
    for rank in sorted(lowered):
        for k, step in enumerate(lowered[rank]):
            for c in step.comms:
                other = peer(c, placement)
                if c.op in _SENDS:
                    edge, side = (rank, other), edges.sends
                else:
                    edge, side = (other, rank), edges.recvs
                edges.place[c] = (edge, len(side[edge]))
                side[edge].append((c, k))
    problems: list[tuple[int, int, str]] = []
    for edge in sorted(set(edges.sends) | set(edges.recvs)):
        src, dst = edge
        out, into = edges.sends[edge], edges.recvs[edge]
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
    order: dict[tuple[int, int], list[int]] = defaultdict(list)
    for edge in sorted(edges.sends):
        for s, _ in edges.sends[edge]:
            order[channel(s)].append(s.microbatch)
    return edges, {ch: tuple(mbs) for ch, mbs in sorted(order.items())}


class _Run:
    """The event loop of ``simulate``: advance every rank as far as its messages allow."""

    def __init__(
        self,
        lowered: _Lowered,
        placement: Placement,
        costs: Costs,
        edges: _Edges,
        cells: _Cells,
    ) -> None:
        self.lowered, self.placement, self.costs = lowered, placement, costs
        self.edges, self.cells = edges, cells
        self.posted: dict[Action, float] = {}  # a send or receive -> when it was posted
        self.arrived: dict[_Edge, list[float]] = defaultdict(list)  # per edge, in order

    def arrival(self, recv: Action) -> float | None:
        """When ``recv``'s message arrives; None while its send is not posted."""
        edge, i = self.edges.place[recv]
        done = self.arrived[edge]
        while len(done) <= i:
            j = len(done)
            send, _ = self.edges.sends[edge][j]
            other, _ = self.edges.recvs[edge][j]
            if send not in self.posted or other not in self.posted:
                return None
            travel = max(self.posted[send], self.posted[other]) + self.costs.p2p
            done.append(max(travel, done[-1]) if done else travel)
        return done[i]

    def run(self) -> tuple[list[TimelineRecord], list[WaitRecord], dict[int, float]]:
        ranks = sorted(self.lowered)
        pos = dict.fromkeys(ranks, 0)
        free = dict.fromkeys(ranks, 0.0)  # when the rank issues its next batch
        records: list[TimelineRecord] = []
        waits: list[WaitRecord] = []
        progress = True
        while progress:
            progress = False
            for r in ranks:
                steps = self.lowered[r]
                while pos[r] < len(steps):
                    step = steps[pos[r]]
                    for c in step.comms:
                        self.posted.setdefault(c, free[r])
                    needs = comms_needed(step.compute, self.placement) if step.compute else ()
                    arrivals = [self.arrival(c) for c in needs]
                    if None in arrivals:
                        break
                    start = max([free[r], *arrivals])
                    if start > free[r]:
                        waits.append(WaitRecord(r, free[r], start, needs))
                    if step.compute is not None:
                        end = start + self.costs.of(step.compute)
                        records.append(TimelineRecord(r, start, end, step.compute))
                        free[r] = end
                    pos[r] += 1
                    progress = True
        blocked = [r for r in ranks if pos[r] < len(self.lowered[r])]
        if blocked:
            raise self._deadlock(blocked, pos)
        finish = {}
        for r in ranks:
            sends = [c for s in self.lowered[r] for c in s.comms if c.op in _SENDS]
            finish[r] = max([free[r]] + [self._send_arrival(c) for c in sends])
        return records, waits, finish

    def _send_arrival(self, send: Action) -> float:
        edge, i = self.edges.place[send]
        self.arrival(self.edges.recvs[edge][i][0])
        return self.arrived[edge][i]

    def _deadlock(self, blocked: list[int], pos: dict[int, int]) -> ScheduleError:
        problems = []
        for r in blocked:
            k = pos[r]
            compute = self.lowered[r][k].compute
            for c in comms_needed(compute, self.placement) if compute else ():
                if self.arrival(c) is None:
                    p, j = peer(c, self.placement), pos[peer(c, self.placement)]
                    cell = self.cells[p][j] if j < len(self.cells[p]) else "the end"
                    problems.append(
                        (
                            r,
                            k,
                            f"{c} waits for rank {p} to post {matching(c)}; rank {p} is stuck "
                            f"at step {j} ({cell})",
                        )
                    )
        return _error("deadlock: no rank can progress", self.cells, problems, "blocked")


def _rank_stats(
    rank: int,
    computes: Sequence[Action | None],
    timeline: Sequence[TimelineRecord],
    makespan: float,
    waits: Sequence[WaitRecord] = (),
) -> RankStats:
    busy = sum(rec.end - rec.start for rec in timeline if rec.rank == rank)
    live = pending = peak_live = peak_pending = 0
    delta_live = {Op.F: 1, Op.B: -1, Op.I: -1, Op.W: 0}
    delta_pending = {Op.F: 0, Op.B: 0, Op.I: 1, Op.W: -1}
    for compute in computes:
        for a in compute.parts() if compute is not None else ():
            live += delta_live[a.op]
            pending += delta_pending[a.op]
            peak_live = max(peak_live, live)
            peak_pending = max(peak_pending, pending)
    idle = makespan - busy
    return RankStats(
        rank=rank,
        busy=busy,
        idle=idle,
        bubble_fraction=idle / makespan if makespan > 0 else 0.0,
        peak_activations=peak_live,
        peak_pending_w=peak_pending,
        recv_wait=sum(w.end - w.start for w in waits if w.rank == rank),
    )
