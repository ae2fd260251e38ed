"""Validation: whether a schedule or a lowered program can run, and what is wrong if not.

Below ``simulate`` in the schedule half (``ir`` -> ``packed`` -> ``generators`` -> ``timing`` ->
``lower`` -> ``validate`` -> ``simulate``): the runtime imports ``resolve_schedule`` from here
without the execution model.

* ``ScheduleError`` and ``format_grid``: a schedule that cannot run is reported as the whole
  rank x step grid, the failing cells marked ``*cell*``, one line of reason per marked cell.
* ``validate`` (a compute-only schedule) and ``resolve_schedule`` (what a pipeline is given:
  a name in ``generators.SCHEDULES`` or a user's ``{rank: [Action, ...]}``, validated, with its
  placement); ``check_complete``: the deadlock report of a dataflow timing.
* ``check_dependencies`` / ``check_messages``: a lowered program's inputs received before
  they are read, sends after their data exists, messages that pair up per rank pair.

Each check has two forms, and both stay for one reason: the array form (``validate_cells``,
``ProgramPart.dependencies_ok``; linear, a chunk of ranks at a time, on ``packed``
codes) only answers whether something is wrong, and the replay of ``Action`` objects
(``_Replay``) names what, on the way to an error only. The tests hold the two equal
(``tests/test_schedule_arrays.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import ClassVar

import numpy as np

from graphpipe.schedule import packed
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.ir import Action, Op, Placement
from graphpipe.schedule.lower import Step, channel, matching, peer
from graphpipe.schedule.packed import Cells, Programs
from graphpipe.schedule.timing import CellTimes, cell_times

__all__ = [
    "Lowered",
    "ProgramPart",
    "ScheduleError",
    "check_complete",
    "check_dependencies",
    "check_messages",
    "format_grid",
    "grid_cells",
    "resolve_schedule",
    "schedule_error",
    "validate",
    "validate_cells",
]

Lowered = Mapping[int, Sequence[Step]]
"""A lowered schedule: per rank, its ``lower.Step``s."""
_Edge = tuple[int, int]  # (sending rank, receiving rank)
_SENDS = (Op.SEND_F, Op.SEND_B)


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


def schedule_error(
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
# A compute-only schedule


def validate(
    schedule: Mapping[int, Sequence[Action]], placement: Placement, num_microbatches: int
) -> None:
    """Check a compute-only schedule; raise ``ScheduleError`` (grid + reasons) if it is wrong.

    Checks: the ranks are the placement's; each action runs on its stage's rank; each stage
    runs micro-batches 0..M-1 exactly once forward and once backward (B or I); each I has
    exactly one later W on the same rank for the same stage and micro-batch, and each W one
    earlier I; F runs before the backward of each (stage, micro-batch); across a local edge
    (the V-turn) the producing stage runs first.

    Why two forms stay: this replay names each wrong cell; ``validate_cells`` only says
    whether one is wrong, linearly on arrays, and calls this to name it.
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
        raise schedule_error("invalid schedule:", cells, problems, "invalid")


def resolve_schedule(
    schedule: str | Mapping[int, Sequence[Action]], n: int, m: int
) -> tuple[dict[int, list[Action]], Placement, str]:
    """``schedule`` (a name in ``SCHEDULES``, or a compute-only ``{rank: [Action, ...]}``) for
    ``n`` ranks and ``m`` micro-batches: the schedule, its placement and its name, validated
    (``validate``; a schedule whose ranks deadlock each other raises too, as
    ``simulate.dataflow`` would)."""
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
    cells, costs = packed.encode_schedule(built), Costs()
    # what simulate.dataflow reports: a ScheduleError, with the grid, if ranks deadlock
    check_complete(cells, cell_times(cells, placement, costs.durations(cells), costs.p2p))
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


def check_complete(cells: Cells, times: CellTimes) -> None:
    """The deadlock report of a dataflow timing (``times``: ``timing.cell_times`` of
    ``cells``): a rank whose cells could not all be timed raises ``ScheduleError``."""
    if times.complete(cells):
        return
    names = cells.names()
    stuck = [
        (r, t, "waits for data that is never computed")
        for r, t, size in zip(cells.ranks, times.timed.tolist(), np.diff(cells.offsets).tolist())
        if t < size
    ]
    raise schedule_error("deadlock: no rank can progress", names, stuck, "blocked")


# --------------------------------------------------------------------------------------------
# A lowered program


def grid_cells(lowered: Lowered) -> dict[int, list[str]]:
    """The grid's text of a lowered program: per rank, ``str()`` of each step's compute
    (``"flush"`` for none)."""
    return {
        r: ["flush" if s.compute is None else str(s.compute) for s in lowered[r]] for r in lowered
    }


def check_dependencies(lowered: Lowered, placement: Placement) -> None:
    """Static per-rank checks: every input is there before a compute uses it (received, or
    computed on this rank), every send's data was computed before the send, every comm is
    issued by its stage's rank, every W follows its I. Raises ``ScheduleError`` naming each
    broken one."""
    cells = grid_cells(lowered)
    problems: list[tuple[int, int, str]] = []
    for rank in sorted(lowered):
        replay = _Replay(rank, placement, receives=True)
        for k, step in enumerate(lowered[rank]):
            problems += [(rank, k, why) for c in step.comms if (why := replay.comm(c))]
            if step.compute is not None:
                problems += [(rank, k, why) for why in replay.compute(step.compute, k)]
    if problems:
        raise schedule_error("broken dependency:", cells, problems, "broken")


def check_messages(lowered: Lowered, placement: Placement) -> None:
    """Raise ``ScheduleError`` naming every message whose two ends do not pair up: the i-th
    message each rank sends to a peer is the i-th receive the peer posts from it."""
    cells = grid_cells(lowered)
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
        raise schedule_error(
            "broken dependency (unmatched or out-of-order messages):", cells, problems, "broken"
        )


# --------------------------------------------------------------------------------------------
# Checks on arrays: the fast gates; the replays above explain what they find


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
    op, key = packed.op_of(codes), packed.key_of(codes)
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
    codes, ranks, order = packed.parts_of(cells, 2 * np.arange(len(cells), dtype=np.int64))
    mb = cells.mb_bound
    local_stages = _local_stages(placement, cells.ranks)
    if not _compute_ok(codes, ranks, order, placement, mb, local_stages, None):
        return False
    remap, count = local_stages
    op, stage, micro = packed.op_of(codes), packed.stage_of(codes, mb), packed.micro_of(codes, mb)
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
    ``validate`` on the decoded schedule (the same ``ScheduleError``). Why two forms stay:
    the arrays are linear and say only whether; the replay names what."""
    if not _schedule_ok(cells, placement, num_microbatches):
        validate(packed.decode_schedule(cells), placement, num_microbatches)
        raise AssertionError("validate_cells found a problem that validate does not report")


class ProgramPart:
    """The programs of some ranks (``Programs.part`` of rank indices ``lo`` to ``hi``) and,
    computed once for the checks that read them, per comm: its step (in the part), rank,
    op, key, stage, micro-batch, source and destination stage. ``c0`` / ``g0``: the part's
    first comm and step in the whole programs. ``simulate`` adds what its run reads."""

    def __init__(self, programs: Programs, lo: int, hi: int) -> None:
        self.programs = part = programs.part(lo, hi)
        self.g0 = int(programs.steps.offsets[lo])
        self.c0 = int(programs.comm_offsets[self.g0])
        mb = part.steps.mb_bound
        self.step = part.comm_step()
        per_rank = np.diff(part.comm_offsets[part.steps.offsets])
        self.rank = np.repeat(np.asarray(part.steps.ranks, dtype=np.int64), per_rank)
        self.op, self.key = packed.op_of(part.comms), packed.key_of(part.comms)
        self.stage, self.micro = np.divmod(self.key, mb)
        self.src, self.dst = packed.comm_ends(part.comms, mb)
        self.is_send = (self.op == packed.SEND_F) | (self.op == packed.SEND_B)

    def dependencies_ok(self, placement: Placement) -> bool:
        """Whether ``check_dependencies`` finds nothing wrong here, without naming it."""
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
        parts, part_rank, order = packed.parts_of(
            steps, 3 * np.arange(len(steps), dtype=np.int64) + 1
        )
        size = count * mb
        received = tuple(
            packed.first_at(size, local_key[op == c], where[op == c])
            for c in (packed.RECV_F, packed.RECV_B)
        )
        if not _compute_ok(parts, part_rank, order, placement, mb, local_stages, received):  # type: ignore[arg-type]
            return False
        p_op, p_key = packed.op_of(parts), packed.key_of(parts)
        p_local = remap[p_key // mb] * mb + p_key % mb
        for send, made in (
            (packed.SEND_F, p_op == packed.F),
            (packed.SEND_B, (p_op == packed.B) | (p_op == packed.I)),
        ):
            done = packed.first_at(size, p_local[made], order[made])
            if not (done[local_key[op == send]] < where[op == send]).all():
                return False
        return True
