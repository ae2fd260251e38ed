"""The schedule as arrays: what the passes run on, so that they scale to thousands of ranks.

A schedule of 1024 ranks and 2048 micro-batches has ten million actions; as ``Action``
objects (and their lowered steps) it does not fit in 2 GB, as arrays it takes a few
hundred MB. So the passes (``timing``, ``lower``, ``simulate``) compute on the forms here, and
their ``Action`` functions encode their input and decode their output: the runtime and users
see only ``Action`` objects. Only this module and the passes know the codes.

A plain action is one integer, its *code*: ``(stage * mb_bound + microbatch) * 16 + op``,
with ``op`` its index in ``OPS``; its *key* ``stage * mb_bound + microbatch`` names the (stage,
micro-batch) pair. Only the accessors here (``op_of``, ``key_of``, ``code_from``,
``stage_of``, ``micro_of``) know the bit layout; the passes call them.

* ``Cells``: per-rank sequences of cells (a compute-only schedule, or the compute cells of a
  lowered one), all ranks end to end. A cell is its first part's code and, for an
  ``OVERLAP_F_B`` pair, its second part's code (``-1`` for a plain cell); the ``None`` cell
  of a lowered program's final flush is ``first = -1``.
* ``Programs``: a lowered schedule, its steps as ``Cells`` and the comm codes of each step.

Encoding and decoding are exact: ``decode_schedule(encode_schedule(s)) == s``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from graphpipe.schedule.ir import Action, Op

__all__ = [
    "CHUNK",
    "OPS",
    "Cells",
    "Programs",
    "action_of",
    "cell_name",
    "cell_of",
    "code_dtype",
    "code_from",
    "code_of",
    "comm_ends",
    "comm_slot",
    "concat",
    "decode_schedule",
    "encode_lowered",
    "encode_schedule",
    "first_at",
    "is_recv",
    "is_send",
    "key_of",
    "last_at",
    "micro_of",
    "offsets_of",
    "op_of",
    "parts_of",
    "stage_of",
]

OPS = (Op.F, Op.B, Op.I, Op.W, Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)
"""The plain ops, in code order."""
F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B = range(8)  # noqa: E741 - the ops' names
_INDEX = {op: i for i, op in enumerate(OPS)}

CHUNK = 1 << 18
"""Comms per chunk for the passes that go rank by rank (``Programs.chunks``): their
temporaries stay some tens of MB whatever the schedule's size."""


_OP_BITS = 4
"""Bits of a code that hold its op: ``OPS`` takes 8 of the 16 values, the rest is room for the
actions a composition may add to a schedule (unshard, reshard, reduce gradients: torch's
``_ComputationType`` has them) without changing the layout."""
_OP_MASK = (1 << _OP_BITS) - 1

Codes = TypeVar("Codes", int, np.ndarray)
"""One code (an ``int``) or an integer array of them: the accessors give the same kind."""


def op_of(codes: Codes) -> Codes:
    """The op of each code (its index in ``OPS``)."""
    return codes & _OP_MASK


def key_of(codes: Codes) -> Codes:
    """The key (``stage * mb_bound + microbatch``) of each code."""
    return codes >> _OP_BITS


def code_from(keys: Codes, ops: Codes | int) -> Codes:
    """The code of each (key, op): the inverse of ``key_of`` and ``op_of``."""
    return (keys << _OP_BITS) + ops


def stage_of(codes: Codes, mb_bound: int) -> Codes:
    """The stage of each code."""
    return key_of(codes) // mb_bound


def micro_of(codes: Codes, mb_bound: int) -> Codes:
    """The micro-batch of each code."""
    return key_of(codes) % mb_bound


def comm_slot(codes: Codes) -> Codes:
    """The slot of each comm code: ``key * 2`` for a ``SEND_F`` / ``RECV_F``, ``+ 1`` for a
    ``SEND_B`` / ``RECV_B`` (a table of slots holds one entry per message direction)."""
    return key_of(codes) * 2 + (op_of(codes) >= SEND_B)


def is_send(codes: np.ndarray) -> np.ndarray:
    """Whether each code is a ``SEND_F`` or ``SEND_B``."""
    op = op_of(codes)
    return (op == SEND_F) | (op == SEND_B)


def is_recv(codes: np.ndarray) -> np.ndarray:
    """Whether each code is a ``RECV_F`` or ``RECV_B``."""
    op = op_of(codes)
    return (op == RECV_F) | (op == RECV_B)


def code_of(action: Action, mb_bound: int) -> int:
    """The code of a plain action."""
    return code_from(action.stage * mb_bound + action.microbatch, _INDEX[action.op])


def action_of(code: int, mb_bound: int) -> Action:
    """The plain action of a code."""
    stage, mb = divmod(key_of(code), mb_bound)
    return Action(stage, OPS[op_of(code)], mb)


def cell_of(first: int, second: int, mb_bound: int) -> Action | None:
    """The cell ``(first, second)``: an overlap pair, a plain action, or None (``first < 0``)."""
    if first < 0:
        return None
    if second < 0:
        return action_of(first, mb_bound)
    return Action.overlap(action_of(first, mb_bound), action_of(second, mb_bound))


def _name(code: int, mb_bound: int) -> str:
    stage, mb = divmod(key_of(code), mb_bound)
    return f"{stage}{OPS[op_of(code)].value}{mb}"


def cell_name(first: int, second: int, mb_bound: int) -> str:
    """``str()`` of the cell, without building it (``"flush"`` for None, as ``simulate``
    writes it in the grid)."""
    if first < 0:
        return "flush"
    if second < 0:
        return _name(first, mb_bound)
    return f"({_name(first, mb_bound)};{_name(second, mb_bound)}){Op.OVERLAP_F_B.value}"


@dataclass(frozen=True, eq=False)
class Cells:
    """Per-rank cell sequences, all ranks end to end (see the module doc).

    ranks: the ranks, ascending; rank ``ranks[i]``'s cells are ``offsets[i] : offsets[i+1]``.
    first / second: int64 codes per cell.
    mb_bound: more than every micro-batch index in the codes.
    """

    ranks: tuple[int, ...]
    offsets: np.ndarray
    first: np.ndarray
    second: np.ndarray
    mb_bound: int

    def __len__(self) -> int:
        return len(self.first)

    def rank_of_cell(self) -> np.ndarray:
        """The rank of every cell."""
        return np.repeat(np.asarray(self.ranks, dtype=np.int64), np.diff(self.offsets))

    def stage_bound(self) -> int:
        """More than every stage in the codes."""
        keys = key_of(np.concatenate([self.first[self.first >= 0], self.second[self.second >= 0]]))
        return int(keys.max()) // self.mb_bound + 1 if len(keys) else 0

    def chunks(self, limit: int | None = None) -> list[tuple[int, int]]:
        """Ranges ``(i, j)`` of rank indices, in order and covering all ranks, of at most
        ``limit`` cells together (or one rank; see ``Programs.chunks``)."""
        return _chunks(np.diff(self.offsets), limit)

    def part(self, lo: int, hi: int) -> Cells:
        """The cells of rank indices ``lo`` to ``hi`` (views, not copies)."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        offsets = self.offsets[lo : hi + 1] - a
        return Cells(self.ranks[lo:hi], offsets, self.first[a:b], self.second[a:b], self.mb_bound)

    def decode(self) -> dict[int, list[Action | None]]:
        """Per rank, the cells as ``Action`` objects (None for a flush)."""
        first, second, mb = self.first.tolist(), self.second.tolist(), self.mb_bound
        return {
            r: [cell_of(first[i], second[i], mb) for i in range(lo, hi)]
            for r, lo, hi in zip(self.ranks, self.offsets[:-1].tolist(), self.offsets[1:].tolist())
        }

    def names(self) -> dict[int, list[str]]:
        """Per rank, ``str()`` of every cell (``"flush"`` for None)."""
        return dict(self.rows())

    def rows(self) -> Iterator[tuple[int, list[str]]]:
        """``(rank, str() of its every cell)`` per rank, in rank order, one at a time."""
        mb = self.mb_bound
        for i, r in enumerate(self.ranks):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            first, second = self.first[lo:hi].tolist(), self.second[lo:hi].tolist()
            yield r, [cell_name(f, s, mb) for f, s in zip(first, second)]


@dataclass(frozen=True, eq=False)
class Programs:
    """A lowered schedule: each step's compute cell (``steps``, None for a flush) and the
    comm codes its batch posts, ``comms[comm_offsets[g] : comm_offsets[g+1]]`` for step ``g``
    (steps numbered across all ranks, end to end)."""

    steps: Cells
    comm_offsets: np.ndarray
    comms: np.ndarray

    def part(self, lo: int, hi: int) -> Programs:
        """The programs of rank indices ``lo`` to ``hi`` (views, not copies)."""
        steps = self.steps.part(lo, hi)
        g0, g1 = int(self.steps.offsets[lo]), int(self.steps.offsets[hi])
        c0, c1 = int(self.comm_offsets[g0]), int(self.comm_offsets[g1])
        return Programs(steps, self.comm_offsets[g0 : g1 + 1] - c0, self.comms[c0:c1])

    def comm_step(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The step of every comm (of steps ``lo`` to ``hi``)."""
        hi = len(self.steps) if hi is None else hi
        counts = np.diff(self.comm_offsets[lo : hi + 1])
        return np.repeat(np.arange(lo, hi, dtype=np.int64), counts)

    def chunks(self, limit: int | None = None) -> list[tuple[int, int]]:
        """Ranges ``(i, j)`` of rank indices, in order and covering all ranks, whose steps
        post at most ``limit`` comms together (or are one rank): passes that work rank by
        rank take them a chunk at a time, to bound their temporary arrays."""
        return _chunks(np.diff(self.comm_offsets[self.steps.offsets]), limit)


def parts_of(cells: Cells, base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every part of ``cells`` (codes), its rank and its place in its rank's order (``base``
    per cell for the first part, ``base + 1`` for the second)."""
    rank = cells.rank_of_cell()
    has1, has2 = cells.first >= 0, cells.second >= 0
    codes = np.concatenate([cells.first[has1], cells.second[has2]])
    ranks = np.concatenate([rank[has1], rank[has2]])
    order = np.concatenate([base[has1], base[has2] + 1])
    return codes, ranks, order


_SOURCE = np.asarray([0, 0, 0, 0, 0, -1, 0, +1])  # per op: a comm's source stage - its stage
_TARGET = np.asarray([0, 0, 0, 0, +1, 0, -1, 0])  # and its destination stage - its stage


def comm_ends(codes: np.ndarray, mb_bound: int) -> tuple[np.ndarray, np.ndarray]:
    """``lower.channel`` on codes: the (source, destination) stage of every comm code."""
    op, stage = op_of(codes), stage_of(codes, mb_bound)
    return stage + _SOURCE[op], stage + _TARGET[op]


def offsets_of(counts: np.ndarray) -> np.ndarray:
    """``[0, counts[0], counts[0] + counts[1], ...]``: where each of a run of groups starts;
    int32 while the total fits."""
    total = int(np.sum(counts, dtype=np.int64))
    out = np.zeros(len(counts) + 1, dtype=np.int32 if total < 2**31 else np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def first_at(size: int, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per key (0 .. size-1), the first of ``values`` (ascending) at it; the largest int64
    where none."""
    out = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)
    if len(keys) and np.bincount(keys, minlength=size).max() > 1:
        np.minimum.at(out, keys, values)  # a key twice: the first one
    else:
        out[keys] = values
    return out


def last_at(size: int, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per key (0 .. size-1), the last of ``values`` (ascending) at it; -1 where none."""
    out = np.full(size, -1, dtype=np.int64)
    if len(keys) and np.bincount(keys, minlength=size).max() > 1:
        np.maximum.at(out, keys, values)  # a key twice: the last one
    else:
        out[keys] = values
    return out


def _chunks(sizes: np.ndarray, limit: int | None) -> list[tuple[int, int]]:
    limit = CHUNK if limit is None else limit
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes.tolist()):
        if i > start and total + n > limit:
            out.append((start, i))
            start, total = i, 0
        total += n
    out.append((start, len(sizes)))
    return out


def _mb_bound(cells: Iterable[Action | None]) -> int:
    top = -1
    for cell in cells:
        if cell is not None:
            for part in cell.parts():
                top = max(top, part.microbatch)
    return top + 1


def _encode_cells(
    per_rank: Mapping[int, Sequence[Action | None]], mb_bound: int
) -> tuple[Cells, list[Action | None]]:
    ranks = tuple(sorted(per_rank))
    first: list[int] = []
    second: list[int] = []
    flat: list[Action | None] = []
    offsets = [0]
    for r in ranks:
        for cell in per_rank[r]:
            flat.append(cell)
            if cell is None:
                first.append(-1)
                second.append(-1)
            elif cell.sub is None:
                first.append(code_of(cell, mb_bound))
                second.append(-1)
            else:
                first.append(code_of(cell.sub[0], mb_bound))
                second.append(code_of(cell.sub[1], mb_bound))
        offsets.append(len(first))
    cells = Cells(
        ranks,
        np.asarray(offsets, dtype=np.int64),
        np.asarray(first, dtype=np.int64),
        np.asarray(second, dtype=np.int64),
        mb_bound,
    )
    return cells, flat


def encode_schedule(schedule: Mapping[int, Sequence[Action | None]]) -> Cells:
    """A compute-only schedule (or any per-rank cell sequences) as ``Cells``."""
    mb_bound = max(1, _mb_bound(c for cells in schedule.values() for c in cells))
    return _encode_cells(schedule, mb_bound)[0]


def encode_lowered(lowered: Mapping[int, Sequence[object]]) -> tuple[Programs, list[Action | None]]:
    """A lowered schedule (``{rank: [Step, ...]}``) as ``Programs``, and its compute cells in
    the order of the steps (the objects themselves, for results that name them)."""
    computes = {r: [s.compute for s in steps] for r, steps in lowered.items()}
    comms = [c for r in sorted(lowered) for s in lowered[r] for c in s.comms]
    mb_bound = max(1, _mb_bound(c for cells in computes.values() for c in cells), _mb_bound(comms))
    cells, flat = _encode_cells(computes, mb_bound)
    counts = [len(s.comms) for r in sorted(lowered) for s in lowered[r]]
    comm_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=comm_offsets[1:])
    codes = np.asarray([code_of(c, mb_bound) for c in comms], dtype=np.int64)
    return Programs(cells, comm_offsets, codes), flat


def decode_schedule(cells: Cells) -> dict[int, list[Action]]:
    """``Cells`` of a compute-only schedule back as ``{rank: [Action, ...]}``."""
    return cells.decode()  # type: ignore[return-value]  # no flush in a schedule


def code_dtype(stage_bound: int, mb_bound: int) -> type:
    """int32 for the codes of stages below ``stage_bound`` (and their neighbours) and
    micro-batches below ``mb_bound`` where they fit, else int64: half the memory for every
    schedule up to some 11 000 stages x 11 000 micro-batches."""
    return np.int32 if ((stage_bound + 2) * mb_bound) << _OP_BITS < 2**31 else np.int64


def concat(
    ranks: Sequence[int],
    per_rank: Iterable[tuple[Sequence[int], Sequence[int]]],
    mb_bound: int,
    stage_bound: int,
) -> Cells:
    """``Cells`` from per-rank ``(first, second)`` code sequences, rank ``ranks[i]`` the
    i-th; each is made an array as it comes (a generator can build one rank at a time)."""
    dtype = code_dtype(stage_bound, mb_bound)
    firsts, seconds = [], []
    for first, second in per_rank:
        firsts.append(np.asarray(first, dtype=dtype))
        seconds.append(np.asarray(second, dtype=dtype))
    offsets = np.zeros(len(firsts) + 1, dtype=np.int64)
    np.cumsum([len(f) for f in firsts], out=offsets[1:])
    empty = [np.zeros(0, dtype=dtype)]
    return Cells(
        tuple(ranks),
        offsets,
        np.concatenate(firsts or empty),
        np.concatenate(seconds or empty),
        mb_bound,
    )
