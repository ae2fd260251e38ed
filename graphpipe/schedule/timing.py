"""Dataflow timing: when each compute cell of a schedule would run with nothing but its data
to wait for.

Each rank runs its cells in order; a cell starts when its rank is free and its inputs are
done: the forward input from stage ``s-1`` (``+ latency`` when that stage is on another
rank), the output gradient from stage ``s+1`` likewise. ``W`` waits for nothing but its rank.
This is the ideal the asynchronous runtime aims at: ``lower`` posts receives early enough
that, timed with the same costs, ``simulate`` reproduces these times exactly.

``dataflow_times`` takes ``Action`` objects; ``cell_times`` is the same on ``packed``
arrays (what the passes use), in rounds over all ranks at once and then a work list; each cell
is timed once, so the cost is linear in the number of cells.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from graphpipe.schedule import packed
from graphpipe.schedule.ir import BACKWARD_OPS, Action, Op, Placement
from graphpipe.schedule.packed import Cells

__all__ = ["CellTimes", "DataflowTimes", "Durations", "cell_times", "dataflow_times", "producer"]

Durations = Callable[[Action], float]
"""The time one compute cell takes (``simulate.Costs.of`` is one)."""

Produced = tuple[Op, int, int]
"""``(Op.F, stage, mb)``: a forward's output; ``(Op.B, stage, mb)``: a backward's input
gradient (from B or I)."""


def producer(part: Action, last_stage: int) -> Produced | None:
    """What a plain action reads from a neighbour stage, or None (the batch, the loss, W)."""
    if part.op is Op.F and part.stage > 0:
        return (Op.F, part.stage - 1, part.microbatch)
    if part.op in BACKWARD_OPS and part.stage < last_stage:
        return (Op.B, part.stage + 1, part.microbatch)
    return None


@dataclass(frozen=True)
class DataflowTimes:
    """The dataflow timing of per-rank cell sequences.

    starts / ends: per rank, the start and end of each cell that could be timed (a rank
        stuck on a dependency cycle stops short).
    done: when each forward output / input gradient was computed (the end of its cell).
    """

    starts: dict[int, list[float]]
    ends: dict[int, list[float]]
    done: dict[Produced, float]

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.ends.values() if e), default=0.0)

    def complete(self, cells: Mapping[int, Sequence[object]]) -> bool:
        """Whether every rank's every cell was timed."""
        return all(len(self.starts[r]) == len(cells[r]) for r in cells)


def dataflow_times(
    cells: Mapping[int, Sequence[Action | None]],
    placement: Placement,
    durations: Durations,
    latency: float = 0.0,
) -> DataflowTimes:
    """Time ``cells`` (per rank, compute cells in order; ``None`` takes no time) by data
    dependencies alone, ``latency`` added to every input that crosses ranks.

    One encoding of the rule: this encodes the cells, runs ``cell_times`` and decodes."""
    encoded = packed.encode_schedule(cells)
    flat = [c for r in encoded.ranks for c in cells[r]]
    costs = np.asarray([0.0 if c is None else durations(c) for c in flat], dtype=np.float64)
    times = cell_times(encoded, placement, costs, latency)
    bounds = dict(zip(encoded.ranks, encoded.offsets[:-1].tolist()))
    timed = dict(zip(encoded.ranks, times.timed.tolist()))
    starts = {r: times.starts[bounds[r] : bounds[r] + timed[r]].tolist() for r in cells}
    ends = {r: times.ends[bounds[r] : bounds[r] + timed[r]].tolist() for r in cells}
    computed = np.flatnonzero(~np.isnan(times.done))
    done: dict[Produced, float] = {}
    for index, t in zip(computed.tolist(), times.done[computed].tolist()):
        stage, mb = divmod(index >> 1, encoded.mb_bound)
        done[(Op.B if index & 1 else Op.F, stage, mb)] = t
    return DataflowTimes(starts, ends, done)


@dataclass(frozen=True, eq=False)
class CellTimes:
    """``dataflow_times`` on ``packed.Cells``.

    starts / ends: per cell (NaN for a cell not timed).
    timed: per rank (in ``Cells.ranks`` order), how many of its cells were timed.
    done: per data item, when it was computed (NaN: never); item ``key * 2`` is the forward
        output of ``key = packed.key_of(code)``, ``key * 2 + 1`` its input gradient (see
        ``data_item``).
    """

    starts: np.ndarray
    ends: np.ndarray
    timed: np.ndarray
    done: np.ndarray

    def complete(self, cells: Cells) -> bool:
        """Whether every rank's every cell was timed."""
        return bool((self.timed == np.diff(cells.offsets)).all())

    @property
    def makespan(self) -> float:
        ends = self.ends[~np.isnan(self.ends)]
        return float(ends.max()) if len(ends) else 0.0


def data_item(codes: np.ndarray, mb_bound: int, last_stage: int) -> np.ndarray:
    """Per plain action code, the data item (see ``CellTimes.done``) it reads from a
    neighbour stage, or -1 (``producer`` on codes); -1 codes give -1."""
    op, key = packed.op_of(codes), packed.key_of(codes)
    stage = key // mb_bound
    item = np.full(len(codes), -1, dtype=np.int64)
    forward = (codes >= 0) & (op == packed.F) & (stage > 0)
    item[forward] = (key[forward] - mb_bound) * 2
    backward = (codes >= 0) & ((op == packed.B) | (op == packed.I)) & (stage < last_stage)
    item[backward] = (key[backward] + mb_bound) * 2 + 1
    return item


def data_columns(cells: Cells, placement: Placement) -> tuple[int, list[np.ndarray]]:
    """The dataflow of ``cells`` as ``cell_times`` reads it: ``size`` (the number of data
    items) and, per cell, for its first part and then its second, three columns: the item it
    reads (``size`` when nothing: always known, at -inf), whether that item crosses ranks,
    and the item it makes (``size + 1`` when nothing: never read). The item columns are int32
    where the items fit."""
    mb = cells.mb_bound
    stages = max(cells.stage_bound(), placement.num_stages) + 1
    owner = np.full(stages + 1, -1, dtype=np.int64)
    owner[: placement.num_stages] = placement.stage_to_rank
    rank = cells.rank_of_cell()
    size = stages * mb * 2
    item = np.int32 if size + 2 < 2**31 else np.int64
    columns = []
    for codes in (cells.first, cells.second):
        need = data_item(codes, mb, placement.last_stage)
        remote = (need >= 0) & (owner[np.clip((need >> 1) // mb, 0, stages)] != rank)
        op = packed.op_of(codes)
        made = packed.key_of(codes) * 2 + (op != packed.F)
        made = np.where((codes >= 0) & (op != packed.W), made, size + 1)
        columns += [np.where(need >= 0, need, size).astype(item), remote, made.astype(item)]
    return size, columns


_ROUND_MIN = 32
"""``cell_times`` advances ranks in rounds while a round moves this many ranks on average: a
round costs some 25 numpy calls, about what the work list spends on 30 cells, so below this
the work list is the cheaper way (docs/benchmarks.md has the two ways' times on a large
schedule)."""


def cell_times(
    cells: Cells, placement: Placement, durations: np.ndarray, latency: float = 0.0
) -> CellTimes:
    """``dataflow_times`` on ``packed.Cells``, ``durations[i]`` the time of cell ``i``.

    Two ways to the same times, each visiting every cell once: rounds (every rank whose next
    cell has its inputs advances by that cell, all ranks at once in numpy; for many ranks) and a
    work list (a rank runs until a cell waits for data not yet computed, and is woken when that
    data is). Rounds run first while they advance enough ranks per round (``_ROUND_MIN``), the
    work list finishes. A cell's times depend only on its inputs', so neither the way nor the
    order of ranks changes them.
    """
    state = _State(cells, placement, durations, latency)
    if len(cells.ranks) >= _ROUND_MIN:
        state.rounds()
    state.work_list()
    return state.result()


class _State:
    """What ``cell_times`` knows so far, and the two ways to advance it.

    Per cell: the data items its parts read (``need1`` / ``need2``; the item ``size`` when
    nothing: always known, at -inf), whether each crosses ranks (``remote1`` / ``remote2``:
    ``latency`` is added),
    the items its parts make (``made1`` / ``made2``; the item ``size + 1`` when nothing: never
    read), its duration, its start and end. Per data item: whether it is computed (``known``)
    and when (``done``). Per rank: the next cell (``pos``) and when the rank is free.
    """

    def __init__(
        self, cells: Cells, placement: Placement, durations: np.ndarray, latency: float
    ) -> None:
        size, columns = data_columns(cells, placement)
        self.size = size
        self.latency = latency
        self.need1, self.remote1, self.made1, self.need2, self.remote2, self.made2 = columns
        self.dur = np.asarray(durations, dtype=np.float64)
        if (self.dur[cells.first < 0] != 0).any():  # a flush takes no time
            self.dur = np.where(cells.first >= 0, self.dur, 0.0)
        self.done = np.zeros(size + 2)
        self.known = np.zeros(size + 2, dtype=bool)
        self.done[size], self.known[size] = -np.inf, True
        self.starts = np.full(len(cells), np.nan)
        self.ends = np.full(len(cells), np.nan)
        self.offsets = cells.offsets
        self.pos = cells.offsets[:-1].copy()
        self.free = np.zeros(len(cells.ranks))

    def rounds(self) -> None:
        """Advance every rank whose next cell has its inputs by that cell, until a round
        moves too few ranks (on average since the start, with the first ``len(ranks)`` rounds
        free: filling a pipeline moves few)."""
        need1, need2, remote1, remote2 = self.need1, self.need2, self.remote1, self.remote2
        made1, made2, done, known = self.made1, self.made2, self.done, self.known
        latency = self.latency
        pos, free, stop = self.pos, self.free, self.offsets[1:]
        active = np.flatnonzero(pos < stop)
        credit = _ROUND_MIN * len(pos)
        while len(active) and credit >= 0:
            g = pos[active]
            ready = known[need1[g]] & known[need2[g]]
            ranks, g = active[ready], g[ready]
            if not len(g):
                return  # nothing can move: a dependency cycle (the work list says the same)
            x1, x2 = done[need1[g]], done[need2[g]]
            if latency:
                x1 = np.where(remote1[g], x1 + latency, x1)
                x2 = np.where(remote2[g], x2 + latency, x2)
            start = np.maximum(np.maximum(free[ranks], x1), x2)
            end = start + self.dur[g]
            self.starts[g], self.ends[g] = start, end
            done[made1[g]], done[made2[g]] = end, end
            known[made1[g]], known[made2[g]] = True, True
            free[ranks] = end
            pos[ranks] += 1
            active = active[pos[active] < stop[active]]
            credit += len(g) - _ROUND_MIN

    def work_list(self) -> None:
        """Advance the ranks from a work list until none can move."""
        need1, need2 = memoryview(self.need1), memoryview(self.need2)
        remote1, remote2 = memoryview(self.remote1), memoryview(self.remote2)
        latency = self.latency
        made1, made2, dur = (memoryview(a) for a in (self.made1, self.made2, self.dur))
        done, known = memoryview(self.done), memoryview(self.known)
        starts, ends = memoryview(self.starts), memoryview(self.ends)
        waited = bytearray(len(self.done))
        waiters: dict[int, list[int]] = {}
        stops = self.offsets[1:].tolist()
        pos, free = self.pos.tolist(), self.free.tolist()
        work = [i for i in range(len(pos)) if pos[i] < stops[i]]
        while work:
            i = work.pop()
            g, stop, t = pos[i], stops[i], free[i]
            wait_for = -1
            while g < stop:
                d1, d2 = need1[g], need2[g]
                if not known[d1]:
                    wait_for = d1
                    break
                if not known[d2]:
                    wait_for = d2
                    break
                start = t
                x = done[d1]
                if remote1[g]:
                    x += latency
                if x > start:
                    start = x
                x = done[d2]
                if remote2[g]:
                    x += latency
                if x > start:
                    start = x
                t = start + dur[g]
                starts[g] = start
                ends[g] = t
                d = made1[g]
                done[d] = t
                known[d] = True
                if waited[d]:
                    waited[d] = 0
                    work.extend(waiters.pop(d))
                d = made2[g]
                done[d] = t
                known[d] = True
                if waited[d]:
                    waited[d] = 0
                    work.extend(waiters.pop(d))
                g += 1
            pos[i], free[i] = g, t
            if wait_for >= 0:
                waiters.setdefault(wait_for, []).append(i)
                waited[wait_for] = 1
        self.pos[:] = pos
        self.free[:] = free

    def result(self) -> CellTimes:
        timed = self.pos - self.offsets[:-1]
        size = self.size
        done = np.where(self.known[:size], self.done[:size], np.nan)
        return CellTimes(self.starts, self.ends, timed, done)
