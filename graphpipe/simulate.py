"""Validation and timing of schedules: dependencies, deadlocks, bubble, peak memory.

``validate`` checks a compute-only schedule. ``simulate`` runs a lowered schedule
(``lower.lower``) under an execution model that is safe for both gloo and NCCL:

* each rank runs its ``Step``s in order; it *issues* step ``k``'s communication batch as soon
  as its compute ``k-1`` has finished;
* a batch completes only when every op in it is matched by the peer's op having been issued
  (a rendezvous, like an NCCL group: a send blocks its batch until the receive is posted),
  plus ``Costs.p2p`` for the data when the batch is not empty;
* then the step's compute runs for its cost.

Messages are matched per channel ``(source stage, destination stage)`` in order: the i-th send
on a channel meets the i-th receive. A receive without a send, a send never received, a
channel whose two ends disagree on the micro-batch order, or a compute whose inputs are not
there yet is a broken dependency; no rank able to progress is a deadlock. Both raise
``ScheduleError`` with the whole rank x step grid, the failing cells marked ``*cell*`` and one
line of reason per marked cell.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from graphpipe.ir import Action, Op
from graphpipe.lower import Step, channel, matching, peer
from graphpipe.schedules import Placement

__all__ = [
    "Costs",
    "RankStats",
    "ScheduleError",
    "SimResult",
    "TimelineRecord",
    "format_grid",
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
    p2p: latency added to each non-empty communication batch.
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
class RankStats:
    """Per-rank figures of a simulated run.

    busy: total compute time.
    idle: makespan - busy.
    bubble_fraction: idle / makespan.
    peak_activations: most micro-batches whose F ran but whose B/I has not, over the
        rank's stages together.
    peak_pending_w: most I actions waiting for their W at once.
    """

    rank: int
    busy: float
    idle: float
    bubble_fraction: float
    peak_activations: int
    peak_pending_w: int


@dataclass(frozen=True)
class SimResult:
    """What ``simulate`` found.

    makespan: time at which the last rank finishes.
    ranks: per-rank figures, in rank order.
    timeline: one record per compute cell, per rank in program order.
    channel_order: per channel (source stage, destination stage), the micro-batches in the
        order they cross it (the same on both ends, or simulate raises).
    rank_edge_fifo_consistent: whether, for every directed rank pair A -> B, the messages
        (of all channels together) leave A in the order B receives them; if not, one
        communicator per rank pair could mismatch them and the runtime needs one per channel.
    rank_edge_mismatches: one line per rank pair whose orders differ.
    """

    makespan: float
    ranks: tuple[RankStats, ...]
    timeline: tuple[TimelineRecord, ...]
    channel_order: dict[tuple[int, int], tuple[int, ...]] = field(repr=False)
    rank_edge_fifo_consistent: bool
    rank_edge_mismatches: tuple[str, ...] = ()

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
            "rank_edge_fifo_consistent": self.rank_edge_fifo_consistent,
            "rank_edge_mismatches": list(self.rank_edge_mismatches),
        }


# --------------------------------------------------------------------------------------------
# simulate

_Lowered = Mapping[int, Sequence[Step]]
_Slot = tuple[int, int, int]  # (rank, step, position in the step's batch)
_Wait = tuple[Action, int, int]  # (a comm of the step, the peer rank, the peer's step)
_Partners = dict[tuple[int, int], list[_Wait]]


_Cells = dict[int, list[str]]


def _cells(lowered: _Lowered) -> _Cells:
    return {
        r: ["flush" if s.compute is None else str(s.compute) for s in lowered[r]] for r in lowered
    }


def simulate(lowered: _Lowered, placement: Placement, costs: Costs | None = None) -> SimResult:
    """Run ``lowered`` (from ``lower.lower``) under the rendezvous model; see the module doc.

    Raises ``ScheduleError`` on a broken dependency or a deadlock.
    """
    costs = costs or Costs()
    cells = _cells(lowered)
    _check_dependencies(lowered, placement, cells)
    partners, channel_order = _match_channels(lowered, placement, cells)
    timeline, finish = _run(lowered, costs, partners, cells)
    makespan = max(finish.values(), default=0.0)
    stats = tuple(_rank_stats(r, lowered[r], timeline, makespan) for r in sorted(lowered))
    mismatches = _rank_edge_mismatches(lowered, placement)
    return SimResult(
        makespan=makespan,
        ranks=stats,
        timeline=tuple(timeline),
        channel_order=channel_order,
        rank_edge_fifo_consistent=not mismatches,
        rank_edge_mismatches=tuple(mismatches),
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


def _match_channels(
    lowered: _Lowered, placement: Placement, cells: _Cells
) -> tuple[_Partners, dict[tuple[int, int], tuple[int, ...]]]:
    """Pair the i-th send and the i-th receive of each channel.

    Returns ``partners[(rank, step)]`` = (comm, peer rank, peer step) for each of the step's
    comms, and the micro-batch order per channel.
    """
    sends: dict[tuple[int, int], list[tuple[_Slot, Action]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[_Slot, Action]]] = defaultdict(list)
    for rank in sorted(lowered):
        for k, step in enumerate(lowered[rank]):
            for i, c in enumerate(step.comms):
                side = sends if c.op in (Op.SEND_F, Op.SEND_B) else recvs
                side[channel(c)].append(((rank, k, i), c))
    problems: list[tuple[int, int, str]] = []
    partners: _Partners = defaultdict(list)
    for ch in sorted(set(sends) | set(recvs)):
        out, into = sends[ch], recvs[ch]
        for ((sr, sk, _), s), ((rr, rk, _), r) in zip(out, into, strict=False):
            if matching(s) != r:
                problems += [
                    (sr, sk, f"channel {ch}: {s} is met by {r} on rank {rr} step {rk}"),
                    (rr, rk, f"channel {ch}: {r} is met by {s} on rank {sr} step {sk}"),
                ]
            partners[(sr, sk)].append((s, rr, rk))
            partners[(rr, rk)].append((r, sr, sk))
        for (rank, k, _), c in out[len(into) :]:
            problems.append(
                (
                    rank,
                    k,
                    f"{c} is never received: rank {peer(c, placement)} posts no {matching(c)}",
                )
            )
        for (rank, k, _), c in into[len(out) :]:
            problems.append(
                (
                    rank,
                    k,
                    f"{c} has no matching send: rank {peer(c, placement)} posts no {matching(c)}",
                )
            )
    if problems:
        raise _error(
            "broken dependency (unmatched or out-of-order messages):", cells, problems, "broken"
        )
    order = {ch: tuple(c.microbatch for _, c in sends[ch]) for ch in sorted(sends)}
    return partners, order


def _run(
    lowered: _Lowered,
    costs: Costs,
    partners: _Partners,
    cells: _Cells,
) -> tuple[list[TimelineRecord], dict[int, float]]:
    """The event loop: advance every rank as far as its batches' peers allow. Returns the
    compute records and when each rank is done (its last batch included)."""
    ranks = sorted(lowered)
    pos = dict.fromkeys(ranks, 0)
    issued: dict[int, list[float]] = {r: [0.0] for r in ranks}  # issued[r][k]: step k's issue
    records: list[TimelineRecord] = []
    progress = True
    while progress:
        progress = False
        for r in ranks:
            while pos[r] < len(lowered[r]):
                k = pos[r]
                waits = partners.get((r, k), ())
                if any(pos[p] < j for _, p, j in waits):
                    break
                step = lowered[r][k]
                start = max([issued[r][k]] + [issued[p][j] for _, p, j in waits])
                start += costs.p2p if step.comms else 0.0
                end = start + costs.of(step.compute)
                if step.compute is not None:
                    records.append(TimelineRecord(r, start, end, step.compute))
                issued[r].append(end)
                pos[r] = k + 1
                progress = True
    blocked = [r for r in ranks if pos[r] < len(lowered[r])]
    if blocked:
        problems = []
        for r in blocked:
            k = pos[r]
            for c, p, j in partners.get((r, k), ()):
                if pos[p] < j:
                    problems.append(
                        (
                            r,
                            k,
                            f"{c} waits for rank {p} to post {matching(c)} at its step {j} "
                            f"({cells[p][j]}); rank {p} is stuck at step {pos[p]} "
                            f"({cells[p][pos[p]]})",
                        )
                    )
        raise _error("deadlock: no rank can progress", cells, problems, "blocked")
    return records, {r: issued[r][-1] for r in ranks}


def _rank_stats(
    rank: int, steps: Sequence[Step], timeline: Sequence[TimelineRecord], makespan: float
) -> RankStats:
    busy = sum(rec.end - rec.start for rec in timeline if rec.rank == rank)
    live = pending = peak_live = peak_pending = 0
    delta_live = {Op.F: 1, Op.B: -1, Op.I: -1, Op.W: 0}
    delta_pending = {Op.F: 0, Op.B: 0, Op.I: 1, Op.W: -1}
    for step in steps:
        for a in step.compute.parts() if step.compute is not None else ():
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
    )


def _rank_edge_mismatches(lowered: _Lowered, placement: Placement) -> list[str]:
    """Per directed rank pair A -> B: A's send order vs B's receive order, all kinds mixed."""
    sent: dict[tuple[int, int], list[Action]] = defaultdict(list)
    got: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for rank in sorted(lowered):
        for step in lowered[rank]:
            for c in step.comms:
                if c.op in (Op.SEND_F, Op.SEND_B):
                    sent[(rank, peer(c, placement))].append(matching(c))
                else:
                    got[(peer(c, placement), rank)].append(c)
    out = []
    for a, b in sorted(set(sent) | set(got)):
        s, g = sent[(a, b)], got[(a, b)]
        if s != g:
            i = next(
                (i for i, (x, y) in enumerate(zip(s, g, strict=False)) if x != y),
                min(len(s), len(g)),
            )
            want = s[i] if i < len(s) else "nothing"
            have = g[i] if i < len(g) else "nothing"
            out.append(
                f"rank {a} -> rank {b}: message {i} is sent for {want} but received as {have}"
            )
    return out
