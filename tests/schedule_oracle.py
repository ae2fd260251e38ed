"""The schedule half's algorithms as they were before they moved onto arrays: an oracle.

``graphpipe.schedule.timing``, ``lower`` and ``simulate`` compute on ``schedule.packed`` arrays so
that they scale; the tests check that they give what these object-by-object versions (the
code of commit 0938455, trimmed to what the oracle needs) give on small schedules. The replay
that names what is wrong (``_Replay`` in ``check_dependencies``) is the same code in both and
is imported from ``graphpipe.schedule.validate``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence

from graphpipe.schedule.ir import Action, Op, Placement
from graphpipe.schedule.lower import Step, channel, comms_needed, comms_produced, matching, peer
from graphpipe.schedule.simulate import Costs, RankStats, SimResult, TimelineRecord, WaitRecord
from graphpipe.schedule.timing import DataflowTimes, Durations, Produced, producer
from graphpipe.schedule.validate import (
    ScheduleError,
    check_dependencies,
    grid_cells,
    schedule_error,
)

# --------------------------------------------------------------------------------------------
# timing


def dataflow_times(
    cells: Mapping[int, Sequence[Action | None]],
    placement: Placement,
    durations: Durations,
    latency: float = 0.0,
) -> DataflowTimes:
    """Time ``cells`` (per rank, compute cells in order; ``None`` takes no time) by data
    dependencies alone, ``latency`` added to every input that crosses ranks."""
    last = placement.last_stage
    done: dict[Produced, float] = {}
    starts: dict[int, list[float]] = {r: [] for r in cells}
    ends: dict[int, list[float]] = {r: [] for r in cells}
    free = dict.fromkeys(cells, 0.0)
    progress = True
    while progress:
        progress = False
        for rank, seq in cells.items():
            while len(starts[rank]) < len(seq):
                cell = seq[len(starts[rank])]
                parts = cell.parts() if cell is not None else ()
                ready = free[rank]
                blocked = False
                for p in parts:
                    need = producer(p, last)
                    if need is None:
                        continue
                    t = done.get(need)
                    if t is None:
                        blocked = True
                        break
                    if placement.rank_of(need[1]) != rank:
                        t += latency
                    ready = max(ready, t)
                if blocked:
                    break
                end = ready + (durations(cell) if cell is not None else 0.0)
                starts[rank].append(ready)
                ends[rank].append(end)
                free[rank] = end
                for p in parts:
                    if p.op is not Op.W:
                        done[(Op.F if p.op is Op.F else Op.B, p.stage, p.microbatch)] = end
                progress = True
    return DataflowTimes(starts, ends, done)


# --------------------------------------------------------------------------------------------
# lower

RECEIVES = ("timed", "start", "plain")


def lower(
    schedule: Mapping[int, Sequence[Action]],
    placement: Placement,
    *,
    durations: Durations | None = None,
    latency: float = 0.0,
    receives: str = "timed",
) -> dict[int, list[Step]]:
    """Add communication: per rank, one ``Step`` per compute cell plus a final flush if needed.

    ``receives="plain"`` gives the plain rule (step k: sends of compute k-1, receives of
    compute k); ``receives="timed"`` (the default) applies ``post_receives_early``, timed
    with ``durations`` (default: ``simulate.Costs()``'s F=1, B=2, I=1, W=1) and ``latency``
    per message, and ``receives="start"`` posts every receive at the start.
    """
    if receives not in RECEIVES:
        raise ValueError(f"receives must be one of {RECEIVES}, got {receives!r}")
    lowered = _lower_plain(schedule, placement)
    if receives == "plain":
        return lowered
    return post_receives_early(lowered, placement, durations, latency, at_start=receives == "start")


def _lower_plain(
    schedule: Mapping[int, Sequence[Action]], placement: Placement
) -> dict[int, list[Step]]:
    lowered: dict[int, list[Step]] = {}
    for rank in sorted(schedule):
        steps: list[Step] = []
        pending_sends: tuple[Action, ...] = ()
        for compute in schedule[rank]:
            if not compute.is_compute:
                raise ValueError(
                    f"lower() takes a compute-only schedule, got {compute} on rank {rank}"
                )
            steps.append(Step(pending_sends + comms_needed(compute, placement), compute))
            pending_sends = comms_produced(compute, placement)
        if pending_sends:
            steps.append(Step(pending_sends, None))
        lowered[rank] = steps
    return lowered


_SENDS = frozenset({Op.SEND_F, Op.SEND_B})
_DEFAULT_DURATIONS = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}  # = simulate.Costs()


def _default_duration(action: Action) -> float:
    """``simulate.Costs()``'s figures: F=1, B=2, I=1, W=1, an overlap pair the sum of its parts."""
    return sum(_DEFAULT_DURATIONS[p.op] for p in action.parts())


def _edge(c: Action, rank: int, placement: Placement) -> tuple[int, int]:
    """The directed rank pair ``(sender, receiver)`` a comm action travels on."""
    other = peer(c, placement)
    return (rank, other) if c.op in _SENDS else (other, rank)


def post_receives_early(
    lowered: Mapping[int, Sequence[Step]],
    placement: Placement,
    durations: Durations | None = None,
    latency: float = 0.0,
    at_start: bool = False,
) -> dict[int, list[Step]]:
    """Post each receive in the last batch its rank issues, in the dataflow timing, no later
    than the moment its data is sent (``at_start``: in the first batch); keep receives in send
    order per directed rank pair; order each batch as sends, then receives by (sender's step,
    place in the sender's batch).

    Sends never move; receives only move earlier. Pure: returns new Steps. A receive whose
    data cannot be timed (a dependency cycle) stays where it is, for ``simulate`` to report.
    """
    cells = {r: [s.compute for s in steps] for r, steps in lowered.items()}
    times = dataflow_times(cells, placement, durations or _default_duration, latency)
    # The batch of step k is issued when compute k-1 ends (at 0 for k = 0).
    issued = {r: [0.0] + times.ends[r][:-1] for r in lowered}
    sent_at: dict[Action, tuple[int, int]] = {}  # a send -> (its step, place in the batch)
    for steps in lowered.values():
        for k, step in enumerate(steps):
            for i, c in enumerate(step.comms):
                if c.op in _SENDS:
                    sent_at[c] = (k, i)
    where: dict[Action, int] = {}  # a receive -> its batch
    on_edge: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for r, steps in lowered.items():
        for k, step in enumerate(steps):
            for c in step.comms:
                if c.op in _SENDS:
                    continue
                where[c] = k
                on_edge[_edge(c, r, placement)].append(c)
                if at_start:
                    where[c] = 0
                    continue
                ready = times.done.get(_sent_data(c))
                if ready is not None and k < len(issued[r]):
                    where[c] = max(0, bisect.bisect_right(issued[r], ready, hi=k + 1) - 1)
    for recvs in on_edge.values():
        recvs.sort(key=lambda c: sent_at.get(matching(c), (len(where), 0)))
        for later, earlier in zip(reversed(recvs), list(reversed(recvs))[1:]):
            where[earlier] = min(where[earlier], where[later])
    out: dict[int, list[Step]] = {}
    for r, steps in lowered.items():
        batches: list[list[Action]] = [[c for c in s.comms if c.op in _SENDS] for s in steps]
        recvs = sorted(
            (c for s in steps for c in s.comms if c.op not in _SENDS),
            key=lambda c: sent_at.get(matching(c), (len(where), 0)),
        )
        for c in recvs:
            batches[where[c]].append(c)
        out[r] = [Step(tuple(b), s.compute) for b, s in zip(batches, steps, strict=True)]
    return out


def _sent_data(recv: Action) -> tuple[Op, int, int]:
    """What the matching send carries, in ``dataflow_times``' terms."""
    send = matching(recv)
    return (Op.F if send.op is Op.SEND_F else Op.B, send.stage, send.microbatch)


# --------------------------------------------------------------------------------------------
# simulate

_Lowered = Mapping[int, Sequence[Step]]
_Cells = dict[int, list[str]]
_Edge = tuple[int, int]


def simulate(lowered: _Lowered, placement: Placement, costs: Costs | None = None) -> SimResult:
    """Run ``lowered`` (from ``lower.lower``) under the asynchronous model; see the module doc.

    Raises ``ScheduleError`` on a broken dependency or a deadlock.
    """
    costs = costs or Costs()
    cells = grid_cells(lowered)
    check_dependencies(lowered, placement)
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
        raise schedule_error("deadlock: no rank can progress", cells, stuck, "blocked")
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
        raise schedule_error(
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
        return schedule_error("deadlock: no rank can progress", self.cells, problems, "blocked")


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
