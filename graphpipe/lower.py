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

The runtime is asynchronous: a step *posts* its batch of sends and receives and goes on; a
compute waits only for the receives it reads; sends complete in the background (and are
waited for at the end of the step). So a send never blocks, and the only thing that can stall
a rank is data that has not arrived. What the lowering decides is *when* each receive is
posted, since a transfer starts only once both of its ends are posted:

1. The plain rule (``early_receives=False``): step ``k``'s batch is the sends produced by
   compute ``k-1`` followed by the receives compute ``k`` needs; one last
   ``Step(comms, None)`` flushes the sends of the final compute.
2. ``post_receives_early`` (the default, ``receives="timed"``): time the computes by data
   dependencies alone (``graphpipe.timing``, with ``durations`` and ``latency``), and post
   each receive in the last batch the receiver issues no later than the moment its data is
   sent, so that the transfer starts the moment the data exists. Receives only move earlier.
   Then, per directed rank pair, receives are posted in the order the messages are sent (a
   receive read late is posted no later than the receive of any message sent after it):
   every directed rank pair is one FIFO, which is what one communicator per directed rank
   pair needs.
3. ``receives="start"``: every receive in the first batch of the step, in send order per
   directed rank pair. No timing to get wrong: every send finds its receive posted. What it
   costs is memory: every incoming message's buffer lives from the start of the step. The
   runtime's default on gloo, whose rendezvous makes a send that comes before its receive
   wait for a hop through the sender's device thread (``Pipeline(receives=...)``).

``transfers`` groups the messages of each directed rank pair into *transfers*: the longest
runs of consecutive messages that leave in one batch of the sender and arrive in one batch of
the receiver. A transfer is one group of P2P ops (one NCCL group, one gloo packet) at both
ends, so both ends group every message the same way by construction.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from graphpipe.ir import Action, Op, Placement, Schedule
from graphpipe.timing import Durations, dataflow_times

__all__ = [
    "RECEIVES",
    "Step",
    "Transfer",
    "channel",
    "comms_needed",
    "comms_produced",
    "forward_only",
    "lower",
    "matching",
    "peer",
    "post_receives_early",
    "transfers",
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


RECEIVES = ("timed", "start")
"""When ``lower`` posts the receives (see the module doc)."""


def lower(
    schedule: Mapping[int, Sequence[Action]],
    placement: Placement,
    *,
    durations: Durations | None = None,
    latency: float = 0.0,
    early_receives: bool = True,
    receives: str = "timed",
) -> dict[int, list[Step]]:
    """Add communication: per rank, one ``Step`` per compute cell plus a final flush if needed.

    ``early_receives=False`` gives the plain rule (step k: sends of compute k-1, receives of
    compute k). Otherwise ``receives="timed"`` (the default) applies ``post_receives_early``,
    timed with ``durations`` (default: ``simulate.Costs()``'s F=1, B=2, I=1, W=1) and
    ``latency`` per message, and ``receives="start"`` posts every receive at the start.
    """
    if receives not in RECEIVES:
        raise ValueError(f"receives must be one of {RECEIVES}, got {receives!r}")
    lowered = _lower_plain(schedule, placement)
    if not early_receives:
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
# Posting receives early

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
# Transfers


@dataclass(frozen=True, slots=True)
class Transfer:
    """Consecutive messages on one directed rank pair that leave in one batch of the sender
    and arrive in one batch of the receiver: one group of P2P ops at both ends.

    src / dst: the sending and the receiving rank.
    index: the transfer's place on its rank pair (0, 1, ...), the same at both ends.
    sends: the ``SEND_*`` actions, in order; the receiver posts their ``matching`` receives.
    send_step / recv_step: the step whose batch posts it, on the sender / the receiver.
    """

    src: int
    dst: int
    index: int
    sends: tuple[Action, ...]
    send_step: int
    recv_step: int

    @property
    def recvs(self) -> tuple[Action, ...]:
        return tuple(matching(s) for s in self.sends)

    def __str__(self) -> str:
        messages = " ".join(map(str, self.sends))
        return f"rank {self.src} -> rank {self.dst} #{self.index} ({messages})"


def transfers(lowered: Mapping[int, Sequence[Step]], placement: Placement) -> list[Transfer]:
    """Every transfer of ``lowered``, per directed rank pair in order.

    Raises ``ValueError`` when a rank pair's messages are not received in the order they are
    sent, or a message has no other end (``simulate`` reports such programs with the grid).
    """
    sent: dict[tuple[int, int], list[tuple[Action, int]]] = defaultdict(list)
    got: dict[tuple[int, int], list[tuple[Action, int]]] = defaultdict(list)
    for r in sorted(lowered):
        for k, step in enumerate(lowered[r]):
            for c in step.comms:
                side = sent if c.op in _SENDS else got
                side[_edge(c, r, placement)].append((c, k))
    out: list[Transfer] = []
    for edge in sorted(set(sent) | set(got)):
        sends, recvs = sent[edge], got[edge]
        if [matching(s) for s, _ in sends] != [c for c, _ in recvs]:
            raise ValueError(
                f"rank {edge[0]} -> rank {edge[1]}: messages are sent as "
                f"{[str(s) for s, _ in sends]} but received as {[str(c) for c, _ in recvs]}"
            )
        run: list[Action] = []
        index = 0
        for i, ((s, ks), (_, kr)) in enumerate(zip(sends, recvs)):
            run.append(s)
            if i + 1 == len(sends) or (sends[i + 1][1], recvs[i + 1][1]) != (ks, kr):
                out.append(Transfer(edge[0], edge[1], index, tuple(run), ks, kr))
                run, index = [], index + 1
    return out
