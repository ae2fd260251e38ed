"""The execution model: how long a schedule takes when the runtime runs it.

The top pass of the schedule half (``ir`` -> ``packed`` -> ``generators`` -> ``timing`` ->
``lower`` -> ``validate`` -> ``simulate``): it reads all of them and none reads it. What can run
and what is wrong is ``graphpipe.schedule.validate``'s; its public names are re-exported here,
so that the simulator's callers import both from one module. ``simulate`` runs a lowered
schedule (``lower.lower``) under the runtime's asynchronous execution model:

* each rank runs its ``Step``s in order; it *posts* step ``k``'s batch (sends and receives)
  as soon as its compute ``k-1`` has finished, and goes on without waiting for it;
* a message travels once both of its ends are posted, and arrives ``Costs.p2p`` later (and
  no earlier than the message before it on the same directed rank pair: each rank pair is
  one FIFO);
* a compute starts when its rank is free and every message it reads has arrived; sends
  complete in the background (a rank is done when its sends have arrived).

With ``p2p = 0`` this is pure dataflow (``dataflow``, which is ``timing.cell_times`` with a
timeline): an action starts when its inputs are done and its rank is free, whatever the
batches. With ``p2p > 0``, latency reaches the critical path only where the dataflow forces
it, provided each receive is posted no later than its send (``lower`` times receives with the
same costs to make sure of it).

Messages are matched per directed rank pair in order: the i-th message rank A sends to rank B
is the i-th receive B posts from A. A broken dependency (``validate.check_dependencies``,
``validate.check_messages``) or no rank able to progress (a deadlock) raises ``ScheduleError``
with the whole rank x step grid, the failing cells marked.

Cost: linear in the number of actions. The run works on ``packed`` arrays; its one
event loop (``_run_loop``) is skipped where a lowered program's run is its dataflow timing
(``_as_dataflow``, the usual case for what ``lower`` makes: then the run's times are
``cell_times``' bit for bit). ``figures`` is ``graphpipe schedule``'s path: the arrays from the
generator to the statistics, never one object per action (1024 ranks x 2048 micro-batches,
8.4 million cells: docs/schedules.md has the figures).
"""

from __future__ import annotations

import math
from array import array
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from graphpipe.schedule import packed
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.ir import WAIT_PREFIX, Action, Placement
from graphpipe.schedule.lower import (
    comm_codes,
    comms_needed,
    decode_programs,
    lower_cells,
    matching,
    peer,
    post_receives_early_cells,
)
from graphpipe.schedule.packed import Cells, Programs
from graphpipe.schedule.timing import CellTimes, cell_times
from graphpipe.schedule.validate import (
    Lowered,
    ProgramPart,
    ScheduleError,
    check_complete,
    check_dependencies,
    check_messages,
    format_grid,
    grid_cells,
    resolve_schedule,
    schedule_error,
    validate,
    validate_cells,
)

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


def simulate(lowered: Lowered, placement: Placement, costs: Costs | None = None) -> SimResult:
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
    check_complete(cells, times)
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
    plain = lower_cells(cells, placement, receives="plain")
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
        check_complete(cells, cell_times(cells, placement, costs.durations(cells), costs.p2p))
    return Figures(makespan=makespan, ranks=ranks, dataflow_makespan=times.makespan)


# --------------------------------------------------------------------------------------------
# What the run reads, on arrays


class _Chunk(ProgramPart):
    """A ``validate.ProgramPart`` and what the run reads of it."""

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
            slot = packed.comm_slot(want)
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
            op = packed.op_of(part)
            part_op = np.where(op == packed.I, packed.B, op)
            made |= (part >= 0) & (packed.key_of(part) == self.key[sends]) & (part_op == wants)
        return bool(made.all())


def _posted(programs: Programs, placement: Placement) -> np.ndarray:
    """Per receive slot (``key * 2``, ``+ 1`` for ``RECV_B``), the last comm posting it (-1:
    none); a valid program's comms are on stages of the placement."""
    codes = programs.comms
    recvs = np.flatnonzero(packed.is_recv(codes))
    size = (placement.num_stages + 1) * programs.steps.mb_bound * 2
    slot = packed.comm_slot(codes[recvs])
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
    (``validate.check_messages`` says why)."""
    is_send = packed.is_send(codes)
    sends, recvs = np.flatnonzero(is_send), np.flatnonzero(~is_send)
    del is_send
    if len(sends) != len(recvs):
        return None
    index = np.int32 if len(codes) < 2**31 else np.int64
    sends = sends[np.argsort(rank_pair[sends], kind="stable")].astype(index)
    recvs = recvs[np.argsort(rank_pair[recvs], kind="stable")].astype(index)
    for lo in range(0, len(sends), packed.CHUNK):
        s_, r_ = sends[lo : lo + packed.CHUNK], recvs[lo : lo + packed.CHUNK]
        if not (rank_pair[s_] == rank_pair[r_]).all():
            return None
        sent = codes[s_]
        key = packed.key_of(sent)  # SEND_F s -> RECV_F s+1; SEND_B s -> RECV_B s-1
        matched = np.where(
            packed.op_of(sent) == packed.SEND_F,
            packed.code_from(key + mb, packed.RECV_F),
            packed.code_from(key - mb, packed.RECV_B),
        )
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
        src, dst = packed.comm_ends(sends, mb)
        order: dict[tuple[int, int], list[int]] = defaultdict(list)
        for s, d, micro in zip(src.tolist(), dst.tolist(), packed.micro_of(sends, mb).tolist()):
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
    steps_of: Callable[[], Lowered],
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
            check_dependencies(steps_of(), placement)
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
        check_messages(steps_of(), placement)
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
    steps_of: Callable[[], Lowered],
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
    lowered: Lowered,
) -> ScheduleError:
    """The deadlock report: each stuck rank's compute, and for each message it waits for,
    the peer that has not posted its end and where that peer is stuck."""
    cells = grid_cells(lowered)
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
    return schedule_error("deadlock: no rank can progress", cells, problems, "blocked")


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
        codes, _, order = packed.parts_of(part, 2 * np.arange(len(part), dtype=np.int64))
        by = np.argsort(order, kind="stable")
        codes, cell = codes[by], order[by] // 2  # every part in program order, and its cell
        op = packed.op_of(codes)
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
