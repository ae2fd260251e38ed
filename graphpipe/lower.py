"""Lowering: a compute-only schedule -> per-rank ``Step``s with their P2P communication.

Data flow: stage ``s`` gets its forward input from stage ``s-1`` (stage 0: the batch) and its
output gradient from stage ``s+1`` (the last stage: the loss). An edge between two stages on
the same rank (the V-turn on rank N-1) needs no communication and gets none.

Per plain action (an overlap pair: its F part, then its B part):

=======  =========================================  ==========================================
op       needs before it runs                       produces after it runs
=======  =========================================  ==========================================
F s      ``RECV_F s`` if stage s-1 is remote        ``SEND_F s`` if stage s+1 is remote
B/I s    ``RECV_B s`` if stage s+1 is remote        ``SEND_B s`` if stage s-1 is remote
W s      nothing                                    nothing
=======  =========================================  ==========================================

The plain rule (``rendezvous_safe=False``): step ``k``'s batch is the sends produced by
compute ``k-1`` followed by the receives compute ``k`` needs; one last ``Step(comms, None)``
flushes the sends of the final compute.

The plain rule deadlocks DualPipeV and ZB-V for every N >= 2 once a batch blocks until each of
its ops is matched (a send waits for its receive to be posted, as in an NCCL group): rank r-1
sends its warm-up forwards faster than rank r posts their receives. DeepSeek's DualPipe posts
such receives early by hand (its steps 2 and 3). ``lower`` does it generally with two pure
passes; sends never move, receives only move to earlier batches:

1. ``align_receives``: time the computes by data dependencies alone (``durations``, default
   the simulator's default costs) and post each receive in the batch the receiver issues
   first at or after the moment its data is sent, so that both ends of a message meet without
   waiting. With uniform costs the rendezvous run then matches the dependency-only timing.
2. ``hoist_receives``: the safety net. Run the batches without timing; while every remaining
   rank is blocked, take the lowest blocked rank whose batch holds a send whose receive the
   peer has not posted yet, and move that receive into the batch the peer is stuck at. Then
   order each batch (sends first, then receives) so that on every directed rank pair messages
   leave in the order they are received (one communicator per rank pair keeps them matched).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from graphpipe.ir import BACKWARD_OPS, Action, Op, Schedule
from graphpipe.schedules import Placement

__all__ = [
    "Step",
    "align_receives",
    "channel",
    "comms_needed",
    "comms_produced",
    "forward_only",
    "hoist_receives",
    "lower",
    "matching",
    "peer",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a rank's lowered program.

    comms: SEND_*/RECV_* actions issued together as ONE batch before ``compute``.
    compute: the compute cell; None only for the final flush of sends.
    """

    comms: tuple[Action, ...]
    compute: Action | None

    def __str__(self) -> str:
        head = " ".join(str(c) for c in self.comms)
        body = "flush" if self.compute is None else str(self.compute)
        return f"[{head}] {body}" if head else body


# op -> (comm op, neighbour offset): which neighbour stage the data comes from / goes to.
_NEEDS: dict[Op, tuple[Op, int]] = {
    Op.F: (Op.RECV_F, -1),
    Op.B: (Op.RECV_B, +1),
    Op.I: (Op.RECV_B, +1),
}
_PRODUCES: dict[Op, tuple[Op, int]] = {
    Op.F: (Op.SEND_F, +1),
    Op.B: (Op.SEND_B, -1),
    Op.I: (Op.SEND_B, -1),
}
# comm op -> (source stage offset, destination stage offset) relative to the action's stage.
_CHANNEL: dict[Op, tuple[int, int]] = {
    Op.SEND_F: (0, +1),
    Op.RECV_F: (-1, 0),
    Op.SEND_B: (0, -1),
    Op.RECV_B: (+1, 0),
}
# comm op -> (the matching op on the peer, the peer action's stage offset).
_MATCH: dict[Op, tuple[Op, int]] = {
    Op.SEND_F: (Op.RECV_F, +1),
    Op.RECV_F: (Op.SEND_F, -1),
    Op.SEND_B: (Op.RECV_B, -1),
    Op.RECV_B: (Op.SEND_B, +1),
}


def _remote_comm(
    table: dict[Op, tuple[Op, int]], part: Action, placement: Placement
) -> tuple[Action, ...]:
    if part.op not in table:
        return ()
    comm_op, offset = table[part.op]
    neighbour = part.stage + offset
    if not 0 <= neighbour < placement.num_stages:
        return ()  # the batch or the loss: no neighbour
    if placement.rank_of(neighbour) == placement.rank_of(part.stage):
        return ()  # a local edge (the V-turn): elided
    return (Action(part.stage, comm_op, part.microbatch),)


def comms_needed(compute: Action, placement: Placement) -> tuple[Action, ...]:
    """The receives ``compute`` needs before it runs (overlap pair: F part, then B part)."""
    return tuple(c for p in compute.parts() for c in _remote_comm(_NEEDS, p, placement))


def comms_produced(compute: Action, placement: Placement) -> tuple[Action, ...]:
    """The sends ``compute`` produces (overlap pair: F part, then B part)."""
    return tuple(c for p in compute.parts() for c in _remote_comm(_PRODUCES, p, placement))


Durations = Callable[[Action], float]
"""The time one compute cell takes (``simulate.Costs.of`` is one)."""


def lower(
    schedule: Mapping[int, Sequence[Action]],
    placement: Placement,
    *,
    durations: Durations | None = None,
    rendezvous_safe: bool = True,
) -> dict[int, list[Step]]:
    """Add communication: per rank, one ``Step`` per compute cell plus a final flush if needed.

    ``rendezvous_safe=False`` gives the plain rule (step k: sends of compute k-1, receives of
    compute k). The default then applies ``align_receives`` (timed with ``durations``) and
    ``hoist_receives``; see the module doc.
    """
    lowered = _lower_plain(schedule, placement)
    if not rendezvous_safe:
        return lowered
    return hoist_receives(align_receives(lowered, placement, durations))


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


def channel(action: Action) -> tuple[int, int]:
    """``(source stage, destination stage)`` of a comm action.

    ``SEND_F s`` and ``RECV_F s+1`` are on ``(s, s+1)``; ``SEND_B s`` and ``RECV_B s-1`` on
    ``(s, s-1)``.
    """
    if action.op not in _CHANNEL:
        raise ValueError(f"channel() takes a SEND_*/RECV_* action, got {action}")
    src, dst = _CHANNEL[action.op]
    return action.stage + src, action.stage + dst


def peer(action: Action, placement: Placement) -> int:
    """The other rank of a comm action: the destination's rank for a send, the source's for a
    receive."""
    src, dst = channel(action)
    return placement.rank_of(dst if action.op in (Op.SEND_F, Op.SEND_B) else src)


def matching(action: Action) -> Action:
    """The peer's half of a comm action: ``SEND_F s m`` <-> ``RECV_F s+1 m``, ``SEND_B s m``
    <-> ``RECV_B s-1 m``."""
    if action.op not in _MATCH:
        raise ValueError(f"matching() takes a SEND_*/RECV_* action, got {action}")
    op, offset = _MATCH[action.op]
    return Action(action.stage + offset, op, action.microbatch)


def forward_only(schedule: Mapping[int, Sequence[Action]]) -> Schedule:
    """Inference: keep only the forwards (including the F of overlap pairs), in order."""
    return {
        rank: [part for cell in actions for part in cell.parts() if part.op is Op.F]
        for rank, actions in schedule.items()
    }


# --------------------------------------------------------------------------------------------
# Receive alignment

_DEFAULT_DURATIONS = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}  # = simulate.Costs()


def _default_duration(action: Action) -> float:
    """``simulate.Costs()``'s figures: F=1, B=2, I=1, W=1, an overlap pair the sum of its parts."""
    return sum(_DEFAULT_DURATIONS[p.op] for p in action.parts())


def _dependency_times(
    lowered: Mapping[int, Sequence[Step]], placement: Placement, durations: Durations
) -> tuple[dict[int, list[float]], dict[tuple[Op, int, int], float]]:
    """Time the computes by data dependencies alone (no communication cost or wait).

    Returns per rank the start of each step's compute (a rank stuck on a dependency cycle
    stops short), and the end of each forward ``(F, stage, mb)`` / backward ``(B, stage, mb)``.
    """
    last = placement.last_stage
    finished: dict[tuple[Op, int, int], float] = {}
    starts: dict[int, list[float]] = {r: [] for r in lowered}
    free = dict.fromkeys(lowered, 0.0)

    def needs(part: Action) -> tuple[Op, int, int] | None:
        if part.op is Op.F and part.stage > 0:
            return (Op.F, part.stage - 1, part.microbatch)
        if part.op in BACKWARD_OPS and part.stage < last:
            return (Op.B, part.stage + 1, part.microbatch)
        return None

    progress = True
    while progress:
        progress = False
        for rank, steps in lowered.items():
            while len(starts[rank]) < len(steps):
                compute = steps[len(starts[rank])].compute
                parts = compute.parts() if compute is not None else ()
                deps = [d for d in map(needs, parts) if d is not None]
                if any(d not in finished for d in deps):
                    break
                start = max([free[rank]] + [finished[d] for d in deps])
                free[rank] = start + (durations(compute) if compute is not None else 0.0)
                starts[rank].append(start)
                for p in parts:
                    if p.op is not Op.W:
                        kind = Op.F if p.op is Op.F else Op.B
                        finished[(kind, p.stage, p.microbatch)] = free[rank]
                progress = True
    return starts, finished


def align_receives(
    lowered: Mapping[int, Sequence[Step]],
    placement: Placement,
    durations: Durations | None = None,
) -> dict[int, list[Step]]:
    """Move each receive to the first batch whose compute starts, in the dependency-only
    timing, no earlier than the moment its data is computed: the batch the receiver issues
    when the sender issues the send. Receives only move earlier; order per channel is kept."""
    starts, finished = _dependency_times(lowered, placement, durations or _default_duration)
    sent_at = {Op.RECV_F: (Op.F, -1), Op.RECV_B: (Op.B, +1)}
    batches = {r: [list(s.comms) for s in lowered[r]] for r in lowered}
    for rank, steps in batches.items():
        for k, batch in enumerate(steps):
            for c in [c for c in batch if c.op in sent_at]:
                op, offset = sent_at[c.op]
                ready = finished.get((op, c.stage + offset, c.microbatch))
                if ready is None or k >= len(starts[rank]):
                    continue  # not timed (a dependency cycle): leave it for simulate to report
                j = bisect.bisect_left(starts[rank], ready, hi=k)
                if j < k:
                    batch.remove(c)
                    steps[j].append(c)
    return {
        r: [Step(tuple(b), s.compute) for b, s in zip(batches[r], lowered[r], strict=True)]
        for r in lowered
    }


# --------------------------------------------------------------------------------------------
# Receive hoisting


_SENDS = frozenset({Op.SEND_F, Op.SEND_B})


@dataclass(slots=True)
class _Message:
    """One send paired with its receive (the i-th of each on a channel); ``*_at`` are
    ``(rank, step)``, and ``recv_at`` changes when the receive is hoisted."""

    send: Action
    send_at: tuple[int, int]
    recv: Action
    recv_at: tuple[int, int]

    def other_end(self, rank: int) -> tuple[int, int]:
        return self.recv_at if self.send_at[0] == rank else self.send_at


def _pair(batches: Mapping[int, Sequence[Sequence[Action]]]) -> list[_Message]:
    """Pair the i-th send and the i-th receive of each channel; unpaired ops are left out
    (``simulate`` reports them)."""
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for rank in sorted(batches):
        for k, batch in enumerate(batches[rank]):
            for c in batch:
                (sends if c.op in _SENDS else recvs)[channel(c)].append((c, (rank, k)))
    return [
        _Message(s, s_at, r, r_at)
        for ch in sorted(sends)
        for (s, s_at), (r, r_at) in zip(sends[ch], recvs[ch], strict=False)
    ]


def hoist_receives(lowered: Mapping[int, Sequence[Step]]) -> dict[int, list[Step]]:
    """Make ``lowered`` run without deadlock when every batch blocks until all its ops are
    matched: move receives into earlier batches where a peer's send would otherwise wait
    forever, then order each batch (see the module doc). Pure: returns new Steps."""
    batches = {r: [list(s.comms) for s in lowered[r]] for r in lowered}
    messages = _pair(batches)
    touching: dict[tuple[int, int], list[_Message]] = defaultdict(list)
    for m in messages:
        touching[m.send_at].append(m)
        touching[m.recv_at].append(m)
    pos = dict.fromkeys(batches, 0)

    def can_complete(rank: int) -> bool:
        if pos[rank] >= len(batches[rank]):
            return False
        ends = (m.other_end(rank) for m in touching[(rank, pos[rank])])
        return all(pos[peer_rank] >= peer_step for peer_rank, peer_step in ends)

    while True:
        progress = True
        while progress:
            progress = False
            for rank in sorted(batches):
                while can_complete(rank):
                    pos[rank] += 1
                    progress = True
        stuck = next(
            (
                m
                for rank in sorted(batches)
                if pos[rank] < len(batches[rank])
                for m in touching[(rank, pos[rank])]
                if m.send_at[0] == rank and pos[m.recv_at[0]] < m.recv_at[1]
            ),
            None,
        )
        if stuck is None:
            break  # done, or blocked on data that is not computed yet (simulate reports it)
        peer_rank, old = stuck.recv_at
        batches[peer_rank][old].remove(stuck.recv)
        batches[peer_rank][pos[peer_rank]].append(stuck.recv)
        touching[stuck.recv_at].remove(stuck)
        stuck.recv_at = (peer_rank, pos[peer_rank])
        touching[stuck.recv_at].append(stuck)
    _order_batches(batches, messages)
    return {
        r: [Step(tuple(b), s.compute) for b, s in zip(batches[r], lowered[r], strict=True)]
        for r in lowered
    }


def _order_batches(batches: dict[int, list[list[Action]]], messages: list[_Message]) -> None:
    """Sends first, by (receiving step, channel); then receives, by (sending step, place in
    the sender's batch). Without deadlock no two messages of a rank pair cross (a later send
    received earlier would need each side to pass the other first), so this makes every
    directed rank pair's send order equal its receive order."""
    by_send = {(m.send_at, m.send): m for m in messages}
    by_recv = {(m.recv_at, m.recv): m for m in messages}
    for rank, steps in batches.items():
        for k, batch in enumerate(steps):
            sends = [c for c in batch if c.op in _SENDS]
            keys = []
            for c in sends:
                m = by_send.get(((rank, k), c))
                keys.append((m.recv_at[1] if m else -1, channel(c), c.microbatch))
            order = sorted(range(len(sends)), key=keys.__getitem__)
            steps[k] = [sends[i] for i in order] + [c for c in batch if c.op not in _SENDS]
    for rank, steps in batches.items():
        for k, batch in enumerate(steps):
            recvs = [c for c in batch if c.op not in _SENDS]
            keys = []
            for c in recvs:
                m = by_recv.get(((rank, k), c))
                if m is None:
                    keys.append((-1, -1))
                else:
                    sender_rank, sender_step = m.send_at
                    keys.append((sender_step, batches[sender_rank][sender_step].index(m.send)))
            order = sorted(range(len(recvs)), key=keys.__getitem__)
            steps[k] = [c for c in batch if c.op in _SENDS] + [recvs[i] for i in order]
