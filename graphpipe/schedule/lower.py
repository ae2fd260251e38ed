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

1. The plain rule (``receives="plain"``): step ``k``'s batch is the sends produced by
   compute ``k-1`` followed by the receives compute ``k`` needs; one last
   ``Step(comms, None)`` flushes the sends of the final compute.
2. ``post_receives_early`` (the default, ``receives="timed"``): time the computes by data
   dependencies alone (``graphpipe.schedule.timing``, with ``durations`` and ``latency``), and post
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

``lower`` and ``post_receives_early`` take and give ``Action`` and ``Step`` objects;
``lower_cells`` and ``post_receives_early_cells`` do the work, on ``packed`` arrays,
a chunk of ranks at a time (linear in the number of actions).

``transfers`` groups the messages of each directed rank pair into *transfers*: the longest
runs of consecutive messages that leave in one batch of the sender and arrive in one batch of
the receiver. A transfer is one group of P2P ops (one NCCL group, one gloo packet) at both
ends, so both ends group every message the same way by construction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from graphpipe.schedule import packed
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.ir import Action, Op, Placement, Schedule
from graphpipe.schedule.packed import Cells, Programs
from graphpipe.schedule.timing import CellTimes, Durations, cell_times

__all__ = [
    "RECEIVES",
    "Step",
    "Transfer",
    "channel",
    "comm_codes",
    "comms_needed",
    "comms_produced",
    "decode_programs",
    "forward_only",
    "in_send_order",
    "lower",
    "lower_cells",
    "matching",
    "peer",
    "post_receives_early",
    "post_receives_early_cells",
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


RECEIVES = ("timed", "start", "plain")
"""When ``lower`` posts the receives (see the module doc); ``Pipeline(receives=...)`` takes
the same values."""


def lower(
    schedule: Mapping[int, Sequence[Action]],
    placement: Placement,
    *,
    durations: Durations | None = None,
    latency: float = 0.0,
    receives: str = "timed",
) -> dict[int, list[Step]]:
    """Add communication: per rank, one ``Step`` per compute cell plus a final flush if needed.

    ``receives="timed"`` (the default) applies ``post_receives_early``, timed with
    ``durations`` (default: ``simulate.Costs()``'s F=1, B=2, I=1, W=1) and ``latency`` per
    message; ``receives="start"`` posts every receive at the start; ``receives="plain"`` gives
    the plain rule (step k: sends of compute k-1, receives of compute k).

    One encoding of the rule: this encodes the schedule, runs ``lower_cells`` and decodes.
    """
    if receives not in RECEIVES:
        raise ValueError(f"receives must be one of {RECEIVES}, got {receives!r}")
    cells = packed.encode_schedule(schedule)
    flat = [c for r in cells.ranks for c in schedule[r]]
    _check_compute_only(cells)
    costs = _costs_of(flat, durations) if receives == "timed" else None
    programs = lower_cells(cells, placement, durations=costs, latency=latency, receives=receives)
    return decode_programs(programs, flat)


def lower_cells(
    cells: Cells,
    placement: Placement,
    *,
    durations: np.ndarray | None = None,
    latency: float = 0.0,
    receives: str = "timed",
) -> Programs:
    """``lower`` on ``packed.Cells``; ``durations[i]`` is the time of cell ``i`` (needed for
    ``receives="timed"``)."""
    if receives not in RECEIVES:
        raise ValueError(f"receives must be one of {RECEIVES}, got {receives!r}")
    programs, step_cell = _lower_plain(cells, placement)
    if receives == "plain":
        return programs
    if receives == "start":
        return post_receives_early_cells(programs, placement, None)
    if durations is None:
        raise ValueError("lower_cells(receives='timed') needs the durations of the cells")
    costs = np.where(step_cell >= 0, np.asarray(durations, dtype=np.float64)[step_cell], 0.0)
    times = cell_times(programs.steps, placement, costs, latency)
    return post_receives_early_cells(programs, placement, times)


def _costs_of(cells: Sequence[Action | None], durations: Durations | None) -> np.ndarray:
    cost = durations or _default_duration
    return np.asarray([0.0 if c is None else cost(c) for c in cells], dtype=np.float64)


def comm_codes(codes: np.ndarray, placement: Placement, mb: int) -> tuple[np.ndarray, np.ndarray]:
    """``comms_needed`` and ``comms_produced`` on codes: per plain action code (-1: none), the
    code of the receive it needs and of the send it produces (-1: none). The rule is the one
    of the object form: the tables ``_NEEDS`` and ``_PRODUCES``, a neighbour stage outside
    the placement (the batch, the loss) or on the same rank (the V-turn) needing no message."""
    stages = placement.num_stages
    owner = np.append(np.asarray(placement.stage_to_rank, dtype=np.int64), -1)
    op, key = packed.op_of(codes), packed.key_of(codes)
    valid = codes >= 0
    stage = np.where(valid, np.minimum(key // mb, stages), stages)  # stages: no such stage
    out = []
    for table in (_NEEDS, _PRODUCES):
        found = np.full(codes.shape, -1, dtype=codes.dtype)
        for compute, (comm, offset) in table.items():
            neighbour = stage + offset
            inside = (stage < stages) & (neighbour >= 0) & (neighbour < stages)
            remote = inside & (owner[np.where(inside, neighbour, stages)] != owner[stage])
            hit = valid & (op == packed.OPS.index(compute)) & remote
            found = np.where(hit, packed.code_from(key, packed.OPS.index(comm)), found)
        out.append(found)
    return out[0], out[1]


def _check_compute_only(cells: Cells) -> None:
    bad = np.flatnonzero((cells.first < 0) | (packed.op_of(cells.first) > packed.W))
    if len(bad):
        i = int(bad[0])
        rank = cells.ranks[int(np.searchsorted(cells.offsets, i, side="right")) - 1]
        cell = packed.cell_of(int(cells.first[i]), int(cells.second[i]), cells.mb_bound)
        raise ValueError(f"lower() takes a compute-only schedule, got {cell} on rank {rank}")


def _lower_plain(cells: Cells, placement: Placement) -> tuple[Programs, np.ndarray]:
    """The plain rule on ``Cells``, a chunk of ranks at a time; also, per step, the index of
    its cell (-1: a flush)."""
    _check_compute_only(cells)
    pieces = [_lower_ranks(cells.part(lo, hi), placement) for lo, hi in cells.chunks()]
    step_sizes = np.concatenate([np.diff(p.steps.offsets) for p, _ in pieces])
    step_offsets = np.zeros(len(step_sizes) + 1, dtype=np.int64)
    np.cumsum(step_sizes, out=step_offsets[1:])
    counts = np.concatenate([np.diff(p.comm_offsets) for p, _ in pieces])
    comm_offsets = packed.offsets_of(counts)
    base = cells.offsets[[lo for lo, _ in cells.chunks()]]
    step_cell = np.concatenate(
        [np.where(c >= 0, c + b, -1) for (_, c), b in zip(pieces, base.tolist())]
    )
    steps = Cells(
        cells.ranks,
        step_offsets,
        np.concatenate([p.steps.first for p, _ in pieces]),
        np.concatenate([p.steps.second for p, _ in pieces]),
        cells.mb_bound,
    )
    return Programs(steps, comm_offsets, np.concatenate([p.comms for p, _ in pieces])), step_cell


def _lower_ranks(cells: Cells, placement: Placement) -> tuple[Programs, np.ndarray]:
    """``_lower_plain`` of some ranks' cells (cell indices from 0)."""
    recv_a, send_a = comm_codes(cells.first, placement, cells.mb_bound)
    recv_b, send_b = comm_codes(cells.second, placement, cells.mb_bound)
    sizes = np.diff(cells.offsets)
    last = cells.offsets[1:] - 1
    flush = np.zeros(len(sizes), dtype=bool)
    if len(cells):  # a rank whose last compute sends gets a final flush
        at = np.maximum(last, 0)
        flush = (sizes > 0) & ((send_a[at] >= 0) | (send_b[at] >= 0))
    step_sizes = sizes + flush
    step_offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(step_sizes, out=step_offsets[1:])
    total = int(step_offsets[-1])
    # each step: its cell (-1 for a flush) and the cell before it on its rank (-1 for none)
    step_cell = np.full(total, -1, dtype=np.int32 if len(cells) < 2**31 else np.int64)
    within = np.arange(len(cells)) - np.repeat(cells.offsets[:-1], sizes)
    step_cell[np.repeat(step_offsets[:-1], sizes) + within] = np.arange(len(cells))
    before = np.full(total, -1, dtype=np.int64)
    is_cell = step_cell >= 0
    first_step = np.zeros(total, dtype=bool)
    first_step[step_offsets[:-1][step_sizes > 0]] = True
    before[1:] = np.where(first_step[1:], -1, np.where(is_cell[:-1], step_cell[:-1], -1))
    flush_at = step_offsets[1:][flush] - 1
    before[flush_at] = last[flush]

    def at(values: np.ndarray, index: np.ndarray) -> np.ndarray:
        return np.where(index >= 0, values[np.maximum(index, 0)], -1)

    # a step's batch: the sends of the cell before it, then the receives of its cell
    slots = np.stack(
        [at(send_a, before), at(send_b, before), at(recv_a, step_cell), at(recv_b, step_cell)],
        axis=1,
    )
    present = slots >= 0
    comm_offsets = packed.offsets_of(present.sum(axis=1))
    steps = Cells(
        cells.ranks,
        step_offsets,
        at(cells.first, step_cell),
        at(cells.second, step_cell),
        cells.mb_bound,
    )
    return Programs(steps, comm_offsets, slots[present]), step_cell


def decode_programs(
    programs: Programs, computes: Sequence[Action] | None = None
) -> dict[int, list[Step]]:
    """``Programs`` as Steps. ``computes``: the objects to use for the steps' computes that
    are not None, in step order (default: new ones, decoded)."""
    steps, mb = programs.steps, programs.steps.mb_bound
    comms = [packed.action_of(c, mb) for c in programs.comms.tolist()]
    bounds = programs.comm_offsets.tolist()
    if computes is None:
        computes = [c for cells in steps.decode().values() for c in cells if c is not None]
    flat = iter(computes)
    out: dict[int, list[Step]] = {}
    first = steps.first.tolist()
    for r, lo, hi in zip(steps.ranks, steps.offsets[:-1].tolist(), steps.offsets[1:].tolist()):
        out[r] = [
            Step(tuple(comms[bounds[g] : bounds[g + 1]]), None if first[g] < 0 else next(flat))
            for g in range(lo, hi)
        ]
    return out


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


def _default_duration(action: Action) -> float:
    """The cost of a cell when no durations are given: ``Costs()``'s."""
    return _DEFAULT_COSTS.of(action)


_DEFAULT_COSTS = Costs()


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
    One encoding of the rule: this encodes, runs ``post_receives_early_cells`` and decodes.
    """
    programs, computes = packed.encode_lowered(lowered)
    times = None
    if not at_start:
        costs = _costs_of(computes, durations)
        times = cell_times(programs.steps, placement, costs, latency)
    moved = post_receives_early_cells(programs, placement, times)
    return decode_programs(moved, [c for c in computes if c is not None])


def post_receives_early_cells(
    programs: Programs, placement: Placement, times: CellTimes | None, *, stay: bool = False
) -> Programs:
    """``post_receives_early`` on ``Programs``, timed by ``times`` (``timing.cell_times`` of
    the programs' steps); ``times=None`` posts every receive at the start. ``stay``: every
    receive stays in its batch (``times`` is not read) but for the send order per directed
    rank pair (``in_send_order``).

    Works a chunk of ranks at a time (``Programs.chunks``): what a receive needs from other
    ranks is where its matching send is posted, looked up in one table of all sends.
    """
    steps, mb, codes = programs.steps, programs.steps.mb_bound, programs.comms
    is_send = packed.is_send(codes)
    # every send's slot (key, direction) -> the last comm that posts it; every receive's slot
    slots = (max(steps.stage_bound(), placement.num_stages) + 2) * mb * 2
    sends = np.flatnonzero(is_send)
    sent = packed.last_at(slots, packed.comm_slot(codes[sends]), sends)
    received = np.zeros(slots, dtype=bool)
    recvs = np.flatnonzero(~is_send)
    received[packed.comm_slot(codes[recvs])] = True
    distinct = int(np.count_nonzero(received))  # receives that are not the same action
    del sends, recvs, received, is_send
    first_step = steps.offsets[:-1]
    widest = int(np.diff(programs.comm_offsets).max(initial=0))  # places in a batch: < widest
    # where each send is posted: (its step k on its rank, its place i in the batch) as one
    # number, k * widest + i, per slot (for the last comm that posts it)
    sent_at = np.full(slots, -1, dtype=np.int64)
    chunks = programs.chunks()
    for lo, hi in chunks:
        g0, g1 = int(steps.offsets[lo]), int(steps.offsets[hi])
        c0, c1 = int(programs.comm_offsets[g0]), int(programs.comm_offsets[g1])
        chunk, step = codes[c0:c1], programs.comm_step(g0, g1)
        mine = np.flatnonzero(packed.is_send(chunk))
        slot = packed.comm_slot(chunk[mine])
        last = sent[slot] == c0 + mine
        at_step = step[mine[last]]
        rank = np.searchsorted(steps.offsets, at_step, side="right") - 1
        place = c0 + mine[last] - programs.comm_offsets[at_step]
        sent_at[slot[last]] = (at_step - first_step[rank]) * widest + place
    new_codes, counts = [], []
    for lo, hi in chunks:
        g0, g1 = int(steps.offsets[lo]), int(steps.offsets[hi])
        c0, c1 = int(programs.comm_offsets[g0]), int(programs.comm_offsets[g1])
        chunk = codes[c0:c1]
        step = programs.comm_step(g0, g1)
        rank = np.searchsorted(steps.offsets, step, side="right") - 1  # rank index of a comm
        local = step - first_step[rank]  # k on its rank
        recv = np.flatnonzero(packed.is_recv(chunk))
        r_key, forward = packed.key_of(chunk[recv]), packed.op_of(chunk[recv]) == packed.RECV_F
        # the matching send: where it is posted (sender's k, i); none: (distinct, 0)
        sent_key = sent_at[np.where(forward, (r_key - mb) * 2, (r_key + mb) * 2 + 1)]
        sent_key = np.where(sent_key >= 0, sent_key, distinct * widest)
        # where each receive goes: the last batch issued no later than its data is sent
        where = local[recv]
        if stay:
            pass  # each in its own batch; the send order below moves some earlier
        elif times is None:
            where[:] = 0
        else:
            ready = times.done[np.where(forward, r_key - mb, r_key + mb) * 2 + ~forward]
            bounds = np.searchsorted(rank[recv], np.arange(lo, hi + 1)).tolist()
            for i in range(lo, hi):
                a, n = int(steps.offsets[i]), int(times.timed[i])
                issued = np.concatenate([[0.0], times.ends[a : a + n - 1]])  # batch k's time
                mine = np.arange(bounds[i - lo], bounds[i - lo + 1])
                mine = mine[~np.isnan(ready[mine]) & (where[mine] < len(issued))]
                if len(mine):
                    k = where[mine]
                    found_at = np.searchsorted(issued, ready[mine], side="right")
                    where[mine] = np.maximum(0, np.minimum(found_at, k + 1) - 1)
        # per directed rank pair, in send order: a receive goes no later than any after it
        owner = np.asarray(placement.stage_to_rank, dtype=np.int64)
        peer = owner[np.where(forward, r_key // mb - 1, r_key // mb + 1)]
        edge = peer * (len(owner) + 1) + rank[recv]
        by_edge = np.argsort(edge * (int(sent_key.max(initial=0)) + 1) + sent_key, kind="stable")
        group = np.concatenate([[0], np.cumsum(edge[by_edge][1:] != edge[by_edge][:-1])])
        span = int(where.max(initial=0)) + 1
        shifted = where[by_edge] + group * span
        where[by_edge] = np.minimum.accumulate(shifted[::-1])[::-1] - group * span
        # each batch: its sends as they were, then the receives by (sender's k, i)
        new_step = step.copy()
        new_step[recv] = step[recv] - local[recv] + where
        tie = np.zeros(len(chunk), dtype=np.int64)
        tie[recv] = sent_key + 1
        order = ((new_step - g0) * (int(tie.max(initial=0)) + 1)) + tie  # a send: tie 0
        final = np.argsort(order, kind="stable")
        new_codes.append(chunk[final])
        counts.append(np.bincount(new_step - g0, minlength=g1 - g0))
    comm_offsets = packed.offsets_of(np.concatenate(counts or [np.zeros(0, np.int64)]))
    return Programs(steps, comm_offsets, np.concatenate(new_codes or [codes[:0]]))


def in_send_order(
    lowered: Mapping[int, Sequence[Step]], placement: Placement
) -> dict[int, list[Step]]:
    """``lowered`` with each directed rank pair's receives posted in the order its messages
    are sent: a receive posted after the receive of a message sent later moves up to that
    receive's batch; every other receive stays where it is (sends never move, receives only
    move earlier). Each batch is then its sends, and its receives by the sender's (step,
    place in its batch), as ``post_receives_early`` orders them.

    What the runtime runs for ``receives="plain"``: under the plain rule alone a rank pair that
    carries two channels (the forward of one stage and the backward of another, as every rank
    pair of a V schedule does: ZB-V from 2 ranks, DualPipeV from 3) may read its messages in
    another order than they are sent, and a rank pair is one FIFO of messages, grouped into
    transfers the same way at both ends (``transfers``). Moving a receive earlier changes no
    data a compute reads: the message it waits for is sent where it was. A program whose pairs
    are received in send order already keeps every comm in its batch (only the order of the
    receives within a batch may change).
    """
    programs, computes = packed.encode_lowered(lowered)
    moved = post_receives_early_cells(programs, placement, None, stay=True)
    return decode_programs(moved, [c for c in computes if c is not None])


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
