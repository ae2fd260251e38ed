"""The schedule as data: ``Op``, ``Action``, per-rank programs and where the stages live.

String forms follow ``torch.distributed.pipelining`` (``{stage}{op}{microbatch}``):
``0F3``, ``7I2``, ``5W1``, ``1SEND_F3`` and ``(0F5;7B2)OVERLAP_F_B`` for an overlap pair.
A compute-only schedule is ``{rank: [Action, ...]}``; CSV files hold one row per rank in
torch's compute-only format, so a file written by torch's ``_dump_csv`` loads here and ours
loads there.

A ``Placement`` says which rank runs which stage: every pass below (``generators``, ``timing``,
``lower``, ``simulate``, ``render``) and the runtime read it, so it lives here, under them.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = [
    "KINDS",
    "SCHEDULE_KINDS",
    "WAIT_PREFIX",
    "Action",
    "KindSpec",
    "Op",
    "Placement",
    "Schedule",
    "dump_csv",
    "format_csv",
    "load_csv",
    "parse_csv",
    "stage_to_rank",
    "write_csv",
]


@dataclass(frozen=True, slots=True)
class KindSpec:
    """What every layer needs to know of a built-in schedule, without its generator.

    summary: one line for help texts.
    style: the placement style (see ``stage_to_rank``): ``"v"`` or ``"loop"``.
    stages_per_rank: stages each rank runs (``num_stages = stages_per_rank * num_ranks``).
    cells: the name of its generator in ``generators``: ``(num_ranks, num_microbatches) ->
        packed.Cells``, raising ValueError on bad sizes.
    generated: ``(num_ranks, num_microbatches) ->`` the micro-batches the generator emits
        (the memory estimate of ``footprint`` sizes its arrays by it).
    auto: one of the schedules ``schedule="auto"`` chooses among (the planner).
    torch_name: its name among torch.distributed.pipelining's schedules (torchtitan's
        ``pipeline_parallel_schedule``), if torch has it.
    """

    summary: str
    style: str
    stages_per_rank: int
    cells: str
    generated: Callable[[int, int], int]
    auto: bool = False
    torch_name: str | None = None


def _all_microbatches(num_ranks: int, num_microbatches: int) -> int:
    return num_microbatches


KINDS: dict[str, KindSpec] = {
    "dualpipev": KindSpec(
        "DeepSeek DualPipeV: 2N stages, M >= 2N",
        "v",
        2,
        "_dualpipev_cells",
        _all_microbatches,
        auto=True,
        torch_name="DualPipeV",
    ),
    "1f1b": KindSpec(
        "classic 1F1B: N stages, one per rank",
        "loop",
        1,
        "_one_f_one_b_cells",
        _all_microbatches,
        torch_name="1F1B",
    ),
    "zbv": KindSpec(
        "zero-bubble ZB-V: 2N stages in a V, I/W split",
        "v",
        2,
        "_zbv_cells",
        lambda n, m: max(m, 2 * n - 1),  # M < 2N-1 runs the 2N-1 schedule's cells
        auto=True,
        torch_name="ZBVZeroBubble",
    ),
}
"""The built-in schedules by name: the one registry. A new schedule is an entry here and its
generator in ``generators`` (the ``cells`` it names); the command line, the memory estimate,
the planner and torchtitan's names read this table, and ``generators.SCHEDULES`` is built
from it. Plain data, so that a command-line parser needs no generator (and no numpy)."""

SCHEDULE_KINDS: dict[str, str] = {name: kind.summary for name, kind in KINDS.items()}
"""The built-in schedules by name, each with its line for help texts."""


class Op(str, enum.Enum):
    """What an ``Action`` does. The value is the token used in the string form."""

    F = "F"  # forward of one micro-batch through one stage
    B = "B"  # full backward: input and weight gradients
    I = "I"  # noqa: E741 - torch's name: backward for input gradients only
    W = "W"  # the deferred weight-gradient work of one earlier I
    OVERLAP_F_B = "OVERLAP_F_B"  # a forward and a backward issued as one unit
    SEND_F = "SEND_F"  # stage sends its forward output to the next stage
    RECV_F = "RECV_F"  # stage receives its forward input from the previous stage
    SEND_B = "SEND_B"  # stage sends its input gradient to the previous stage
    RECV_B = "RECV_B"  # stage receives its output gradient from the next stage

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W, Op.OVERLAP_F_B})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
BACKWARD_OPS = frozenset({Op.B, Op.I})

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)(OVERLAP_F_B)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One cell of the schedule grid.

    stage: the global stage index (0 .. 2N-1); -1 for an overlap pair.
    op: what runs.
    microbatch: the micro-batch index; None for an overlap pair.
    sub: for ``OVERLAP_F_B``, the (forward, backward) pair; None otherwise.
    """

    stage: int
    op: Op
    microbatch: int | None = None
    sub: tuple[Action, ...] | None = None

    def __post_init__(self) -> None:
        if self.op is Op.OVERLAP_F_B:
            if (
                self.sub is None
                or len(self.sub) != 2
                or self.sub[0].op is not Op.F
                or self.sub[1].op not in BACKWARD_OPS
            ):
                raise ValueError(
                    f"an OVERLAP_F_B action needs sub=(F action, B or I action), got {self.sub!r}"
                )
        elif self.sub is not None:
            raise ValueError(f"only OVERLAP_F_B takes sub-actions, got op {self.op.value}")
        elif self.microbatch is None or self.microbatch < 0 or self.stage < 0:
            raise ValueError(
                f"{self.op.value} needs a stage >= 0 and a micro-batch >= 0, "
                f"got stage={self.stage} microbatch={self.microbatch}"
            )

    @staticmethod
    def overlap(forward: Action, backward: Action) -> Action:
        """The overlap pair ``(forward;backward)OVERLAP_F_B``."""
        return Action(-1, Op.OVERLAP_F_B, None, (forward, backward))

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS

    def parts(self) -> tuple[Action, ...]:
        """The plain actions this cell runs: the pair for an overlap, else itself."""
        return self.sub if self.sub is not None else (self,)

    def __str__(self) -> str:
        if self.sub is not None:
            return f"({';'.join(str(a) for a in self.sub)}){self.op.value}"
        return f"{self.stage}{self.op.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the string form; the inverse of ``str(action)``."""
        s = text.strip()
        if m := _OVERLAP_RE.match(s):
            parts = m.group(1).split(";")
            if len(parts) != 2:
                raise ValueError(f"an overlap pair holds two actions, got {text!r}")
            return Action.overlap(Action.parse(parts[0]), Action.parse(parts[1]))
        if m := _ACTION_RE.match(s):
            return Action(int(m.group(1)), Op(m.group(2)), int(m.group(3)))
        raise ValueError(
            f"cannot parse action {text!r}: expected e.g. '0F3', '7I2', '1SEND_F3' "
            "or '(0F5;7B2)OVERLAP_F_B'"
        )


Schedule = dict[int, list[Action]]
"""Per-rank programs: ``{rank: [Action, ...]}`` with ranks 0 .. N-1."""

WAIT_PREFIX = "wait "
"""The label of time a rank spent waiting for messages starts with this, followed by what it
waited for (``wait 1RECV_F3 6RECV_B2``): the simulator's waits, the runtime's ranges and the
pictures all use it."""


def format_csv(schedule: Mapping[int, Sequence[Action | None]]) -> str:
    """Torch's compute-only CSV: one row per rank, in rank order, empty cell for idle."""
    buf = io.StringIO()
    write_csv((schedule[rank] for rank in sorted(schedule)), buf)
    return buf.getvalue()


def write_csv(rows: Iterable[Sequence[Action | str | None]], out: TextIO) -> None:
    """Write ``rows`` (one per rank, in rank order: actions or their strings, None for idle)
    to ``out`` in torch's compute-only CSV format, one row at a time."""
    writer = csv.writer(out, lineterminator="\r\n")  # csv.writer's default, as torch writes
    for row in rows:
        writer.writerow(["" if a is None else str(a) for a in row])


def parse_csv(text: str | Iterable[str]) -> Schedule:
    """Parse torch's compute-only CSV (row i = rank i). Empty cells (idle steps) are dropped."""
    lines = text.splitlines() if isinstance(text, str) else text
    out: Schedule = {}
    for rank, row in enumerate(csv.reader(lines)):
        actions = []
        for col, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                actions.append(Action.parse(cell))
            except ValueError as e:
                raise ValueError(f"CSV row {rank} (rank {rank}), column {col}: {e}") from None
        out[rank] = actions
    return out


def dump_csv(schedule: Mapping[int, Sequence[Action | None]], path: str | Path) -> None:
    """Write ``schedule`` to ``path`` in torch's compute-only CSV format."""
    Path(path).write_text(format_csv(schedule), newline="")


def load_csv(path: str | Path) -> Schedule:
    """Read a compute-only CSV written by torch's ``_dump_csv`` or by ``dump_csv``."""
    with open(path, newline="") as f:
        return parse_csv(f.read())


# --------------------------------------------------------------------------------------------
# Placement: which rank runs which stage


def _v_rank(stage: int, num_ranks: int) -> int:
    return stage if stage < num_ranks else 2 * num_ranks - 1 - stage


def _loop_rank(stage: int, num_ranks: int) -> int:
    return stage % num_ranks


_STYLES: dict[str, Callable[[int, int], int]] = {"v": _v_rank, "loop": _loop_rank}
"""Placement styles: ``v`` folds 2N stages into a V; ``loop`` deals stages round-robin."""


def stage_to_rank(stage: int, num_ranks: int, style: str) -> int:
    """The rank holding ``stage`` under ``style`` (``"v"``: 2N stages, ``"loop"``: round-robin).

    ``v``: stage ``s < N`` on rank ``s``, stage ``s >= N`` on rank ``2N-1-s``.
    ``loop``: stage ``s`` on rank ``s % N`` (with N stages: one stage per rank).
    """
    if style not in _STYLES:
        raise ValueError(f"unknown placement style {style!r}: expected one of {sorted(_STYLES)}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if stage < 0 or (style == "v" and stage >= 2 * num_ranks):
        limit = f"0 .. {2 * num_ranks - 1}" if style == "v" else ">= 0"
        raise ValueError(f"stage must be {limit} for style {style!r}, got {stage}")
    return _STYLES[style](stage, num_ranks)


@dataclass(frozen=True, slots=True)
class Placement:
    """Which rank holds which stage.

    num_ranks: pipeline ranks, 0 .. num_ranks-1.
    num_stages: model stages (chunks), 0 .. num_stages-1, in data-flow order.
    stage_to_rank: ``stage_to_rank[s]`` is the rank that runs stage ``s``.
    """

    num_ranks: int
    num_stages: int
    stage_to_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_stages < 1:
            raise ValueError(
                f"a placement needs num_ranks >= 1 and num_stages >= 1, "
                f"got {self.num_ranks} and {self.num_stages}"
            )
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} stages"
            )
        if bad := [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]:
            raise ValueError(f"stage_to_rank names ranks {bad} outside 0 .. {self.num_ranks - 1}")

    @classmethod
    def from_style(cls, num_ranks: int, style: str, stages_per_rank: int = 1) -> Placement:
        """``num_ranks * stages_per_rank`` stages placed by ``style`` (see ``stage_to_rank``)."""
        if style == "v" and stages_per_rank != 2:
            raise ValueError(f"style 'v' places 2 stages per rank, got {stages_per_rank}")
        num_stages = num_ranks * stages_per_rank
        ranks = tuple(stage_to_rank(s, num_ranks, style) for s in range(num_stages))
        return cls(num_ranks, num_stages, ranks)

    @classmethod
    def from_schedule(cls, schedule: Mapping[int, Sequence[Action]]) -> Placement:
        """The placement a compute-only schedule implies (each stage on the rank that runs it)."""
        owner: dict[int, int] = {}
        for rank, actions in schedule.items():
            for cell in actions:
                for part in cell.parts():
                    if owner.setdefault(part.stage, rank) != rank:
                        raise ValueError(
                            f"stage {part.stage} runs on ranks {owner[part.stage]} and {rank}"
                        )
        num_stages = max(owner, default=-1) + 1
        if missing := sorted(set(range(num_stages)) - set(owner)):
            raise ValueError(f"no rank runs stages {missing}")
        num_ranks = max(schedule, default=-1) + 1
        return cls(num_ranks, num_stages, tuple(owner[s] for s in range(num_stages)))

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @property
    def last_stage(self) -> int:
        """The stage that computes the loss."""
        return self.num_stages - 1
