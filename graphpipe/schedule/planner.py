"""Stage boundaries from per-layer costs: the split whose simulated step is shortest.

``plan_stages(layer_costs, num_stages, num_microbatches=M)`` takes what one micro-batch costs
in each layer of a model (``LayerCost``: forward, input-gradient and weight-gradient seconds,
the bytes it holds) and the embedding's and head's costs apart, and chooses how many
consecutive layers each stage holds (``graphpipe.schedule.splits``: every middle stage at least one;
the first and the last may hold none besides the embedding and the head). A split is judged
by the schedule's dataflow timing (``graphpipe.schedule.timing.cell_times``, the ideal the runtime
aims at; ``Costs.p2p`` latency on every cross-rank input) with each stage's own F / B / I / W
costs, the sums of its layers'. An overlapped ``F&B`` pair costs its F plus its B (no gain
from overlapping is assumed).

The search (``_Search``):

1. seeds: the even split (``splits.layers_per_stage``); the split that minimises the most
   work of one stage (bisection on that bound, each stage greedily as long as it fits); on a
   V placement (rank ``r`` holds stages ``r`` and ``2N-1-r``) the split that minimises the
   most work of one rank (bisection on the bound; per rank, for every left/right frontier
   reached so far, the longest right stage that fits beside each left stage), and the split
   that gives every rank the same work and each rank's two stages equal shares. Work is F,
   B, I and W weighted by how often the schedule runs each (``_Model.work``);
2. refinement, from every seed: the best move of one boundary by one layer while one
   shortens the simulated step, repeated while it helps (ties broken by the sum of the
   squared per-rank work, which walks plateaus towards balance); when none does, the first
   move of one layer between two stages further apart that does (from the busiest ranks to
   the idlest, at most ``_FAR_MOVES`` of them), then boundary moves again; the best result
   wins.

The moves of one step are simulated together (``_Model.makespan_batch``: the cells in
dependency levels, one level of every split per numpy operation, the same arithmetic as
``cell_times``, so the same times to the last bit) and every split once (a cache). It is a
local search, not an exhaustive one (``tests/test_planner.py`` holds it within 0.5% of the
exhaustive optimum on small random cases, and to the known optimum where it is known by
hand), and the even split wins ties. ``progress`` receives a ``PlanProgress`` after every
batch, with a step no split can beat (``_Model.step_bound``). The time for 256 layers over 64
stages is in docs/planning.md.

With a ``memory_budget`` the search minimises first how far the peak memory of the fullest
rank is over it, then the step. Which splits fit is then decided exactly (``_Fitting``: a
dynamic program over the layers each stage, or each rank's pair of stages, can take, with
the number of ways to get there): when a few fit (``_ENUMERATE``), all of them are simulated;
when the moves reached none, the search goes on from one that fits; when none fits, it is
``MemoryBudgetExceeded`` (a ``ValueError``) naming the split whose fullest rank holds the
least (bisection on the budget) and its shortfall. ``schedule="auto"`` plans each schedule
that places two stages on every rank (``dualpipev``, ``zbv``) and chooses by ``choose_plan``.

Peak memory of a rank (``StagePlan.peak_memory_bytes``): its stages' ``parameter_bytes``
(counted once for ``tied_parameter_bytes`` when the first and the last stage share a rank),
plus the most that its actions, in its program order, hold at once: an ``F`` takes its
stage's ``activation_bytes`` until its ``B`` or ``I``; an ``I`` hands over to
``weight_grad_bytes`` until its ``W``; an overlapped pair counts its ``F`` before its ``B``
(as ``simulate.RankStats.peak_activations`` does).

Owns: nothing (functions and values). May touch: nothing. Imports numpy, not torch.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from graphpipe.schedule import packed
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.generators import SCHEDULES, ScheduleKind
from graphpipe.schedule.ir import KINDS
from graphpipe.schedule.splits import check_layers_per_stage, layers_per_stage
from graphpipe.schedule.timing import cell_times, data_columns

__all__ = [
    "AUTO_SCHEDULES",
    "LayerCost",
    "MemoryBudgetExceeded",
    "PlanCandidate",
    "PlanProgress",
    "StagePlan",
    "choose_plan",
    "plan_stages",
    "predict_step",
]

AUTO_SCHEDULES = tuple(name for name, kind in KINDS.items() if kind.auto)
"""What ``schedule="auto"`` chooses among: the schedules that place two stages on each rank
(so ``num_stages`` stages run on ``num_stages / 2`` ranks whichever is chosen)."""

_REL = 1e-9  # makespans closer than this (relative) are a tie


@dataclass(frozen=True, slots=True)
class LayerCost:
    """What one micro-batch costs in one layer (or in the embedding, or the head and loss).

    forward / backward_input / backward_weight: seconds of its F, of the input-gradient part
        of its backward (``I``) and of the deferred weight-gradient part (``W``).
    backward: seconds of its full backward (``B``); None: ``backward_input +
        backward_weight``.
    activation_bytes: what it holds from its forward until its backward (B or I).
    weight_grad_bytes: what it holds from its ``I`` until its ``W``.
    parameter_bytes: what it holds for the whole step (parameters, their gradients, and
        whatever optimizer state the caller counts).
    """

    forward: float
    backward_input: float
    backward_weight: float
    backward: float | None = None
    activation_bytes: int = 0
    weight_grad_bytes: int = 0
    parameter_bytes: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "backward":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"LayerCost.{f.name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LayerCost.{f.name} must be finite and >= 0, got {value!r}")
            if f.name.endswith("_bytes") and not float(value).is_integer():
                raise ValueError(
                    f"LayerCost.{f.name} must be a whole number of bytes, got {value!r}"
                )

    @property
    def full_backward(self) -> float:
        """``backward``, or ``backward_input + backward_weight`` when it is None."""
        if self.backward is None:
            return self.backward_input + self.backward_weight
        return self.backward

    def vector(self) -> list[float]:
        """``[F, B, I, W, activation, weight-grad, parameter bytes]`` (the planner's sums)."""
        return [
            self.forward,
            self.full_backward,
            self.backward_input,
            self.backward_weight,
            self.activation_bytes,
            self.weight_grad_bytes,
            self.parameter_bytes,
        ]


_ZERO = LayerCost(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class PlanCandidate:
    """One plan a choice was made among (``StagePlan.candidates``): its schedule and
    micro-batches, its predicted step, the peak of its fullest rank and whether that fits
    the memory budget, and the even split's peak on the same schedule."""

    schedule: str
    num_microbatches: int
    predicted_step_s: float
    peak_memory_bytes: int
    even_peak_memory_bytes: int
    fits: bool = True


@dataclass(frozen=True)
class PlanProgress:
    """Where a search stands (``plan_stages(progress=...)`` gets one after every batch of
    simulations).

    phase: ``"searching"`` (moves from the seeds), ``"memory"`` (the exact check of which
        splits fit the budget), or, when none fits, the range of bytes in which the least
        any split needs is known to lie so far.
    best_step_s: the best split's simulated step so far; best_over_budget_bytes: how far its
        fullest rank is over the budget (0: it fits).
    bound_s: no split's step is shorter (``best_step_s / bound_s - 1`` bounds what is left
        to gain).
    """

    schedule: str
    num_microbatches: int
    phase: str
    simulations: int
    elapsed_s: float
    best_step_s: float
    best_over_budget_bytes: float
    bound_s: float


@dataclass(frozen=True)
class StagePlan:
    """What ``plan_stages`` chose, beside the even split on the same schedule.

    schedule / num_ranks / num_microbatches: the schedule the plan is for.
    layers_per_stage: the layers of each stage (``build_stages(..., layers_per_stage=...)``,
        ``split_hf_causal_lm(..., layers_per_stage=...)``, ``--layers-per-stage``).
    predicted_step_s: the simulated step of that split (seconds, or the costs' unit).
    stage_costs: each stage's F, B, I, W (``Costs``, ``p2p`` the latency simulated).
    peak_memory_bytes: each rank's predicted peak (see the module doc).
    even_layers_per_stage / even_predicted_step_s / even_stage_costs /
        even_peak_memory_bytes: the same for the even split.
    memory_budget: the budget the plan was held to (None: none).
    simulations: how many splits the search simulated.
    candidates: the plans this one was chosen among (``choose_plan``: ``schedule="auto"``,
        several micro-batch counts), this one included; empty when there was no choice.
    tie_margin: the fraction of the fastest step within which candidates counted as tied.
    """

    schedule: str
    num_ranks: int
    num_microbatches: int
    layers_per_stage: tuple[int, ...]
    predicted_step_s: float
    stage_costs: tuple[Costs, ...]
    peak_memory_bytes: tuple[int, ...]
    even_layers_per_stage: tuple[int, ...]
    even_predicted_step_s: float
    even_stage_costs: tuple[Costs, ...]
    even_peak_memory_bytes: tuple[int, ...]
    memory_budget: int | None = None
    simulations: int = 0
    candidates: tuple[PlanCandidate, ...] = ()
    tie_margin: float = 0.0

    @property
    def speedup(self) -> float:
        """The even split's predicted step over the plan's (>= 1 unless memory forced it)."""
        if self.predicted_step_s <= 0:
            return 1.0
        return self.even_predicted_step_s / self.predicted_step_s

    def as_dict(self) -> dict:
        """Plain JSON-ready data."""
        out = asdict(self)
        for key in ("stage_costs", "even_stage_costs"):
            out[key] = [{k: v for k, v in c.items() if v is not None} for c in out[key]]
        for key in ("layers_per_stage", "even_layers_per_stage"):
            out[key] = list(out[key])
        out["speedup"] = self.speedup
        return out

    def format(self, unit: str = "ms", scale: float = 1e3) -> str:
        """The plan beside the even split, as lines of text (times times ``scale`` in
        ``unit``)."""

        def t(x: float) -> str:
            return f"{x * scale:.4g}"

        def mib(x: int) -> str:
            return f"{x / 2**20:.1f}"

        head = (
            f"{self.schedule}: {self.num_ranks} ranks, {len(self.layers_per_stage)} stages, "
            f"{self.num_microbatches} micro-batches"
        )
        if self.memory_budget is not None:
            head += f"; memory budget {mib(self.memory_budget)} MiB per rank"
        lines = [
            head,
            f"{'':<8}{'layers per stage':<28}{'step ' + unit:>12}{'peak MiB (max rank)':>22}",
        ]
        for name, counts, step, peaks in (
            ("planned", self.layers_per_stage, self.predicted_step_s, self.peak_memory_bytes),
            (
                "even",
                self.even_layers_per_stage,
                self.even_predicted_step_s,
                self.even_peak_memory_bytes,
            ),
        ):
            text = ",".join(map(str, counts))
            lines.append(f"{name:<8}{text:<28}{t(step):>12}{mib(max(peaks)):>22}")
        lines.append(
            f"planned / even: {1 / self.speedup:.3f} of the even split's step "
            f"({self.simulations} splits simulated)"
        )
        lines.append(f"stage  layers  F {unit:<6} B {unit:<6} I {unit:<6} W {unit:<6} rank")
        for s, (count, c) in enumerate(zip(self.layers_per_stage, self.stage_costs)):
            rank = _stage_rank(self.schedule, self.num_ranks, s)
            lines.append(
                f"{s:>5}  {count:>6}  {t(c.F):<8} {t(c.B):<8} {t(c.I):<8} {t(c.W):<8} {rank}"
            )
        lines.append("rank  peak MiB planned  peak MiB even")
        for r, (p, e) in enumerate(zip(self.peak_memory_bytes, self.even_peak_memory_bytes)):
            lines.append(f"{r:>4}  {mib(p):>16}  {mib(e):>13}")
        if len(self.candidates) > 1:
            lines += self._choice_lines(t, mib, unit)
        return "\n".join(lines)

    def choice(self) -> str:
        """Why this plan was chosen among ``candidates`` (the rule of ``choose_plan``), one
        clause; empty when there was no choice."""
        if len(self.candidates) < 2:
            return ""
        fitting = [c for c in self.candidates if c.fits]
        fastest = min(c.predicted_step_s for c in fitting)
        tied = [c for c in fitting if _within(c.predicted_step_s, fastest, self.tie_margin)]
        margin = f"the {100 * self.tie_margin:.3g}% tie margin"
        if len(tied) == 1:
            rule = f"the fastest, by more than {margin}" if self.tie_margin else "the fastest"
        else:
            within = f"within {margin} of" if self.tie_margin else "tied for"
            rule = f"of the {len(tied)} {within} the fastest, the least memory on the even split"
        if len(fitting) < len(self.candidates):
            rule += f"; {len(self.candidates) - len(fitting)} over the memory budget"
        return rule

    def _choice_lines(
        self, t: Callable[[float], str], mib: Callable[[int], str], unit: str
    ) -> list[str]:
        lines = [
            f"chosen: {self.schedule} with {self.num_microbatches} micro-batches, {self.choice()}",
            f"{'candidate':<26}{'step ' + unit:>12}{'vs chosen':>11}{'peak MiB':>10}"
            f"{'even split':>12}",
        ]
        for c in self.candidates:
            name = f"{c.schedule}, {c.num_microbatches} micro-batches"
            if (c.schedule, c.num_microbatches) == (self.schedule, self.num_microbatches):
                versus = "chosen"
            elif self.predicted_step_s > 0:
                versus = f"{c.predicted_step_s / self.predicted_step_s - 1:+.1%}"
            else:
                versus = ""
            fits = "" if c.fits else "  over the budget"
            lines.append(
                f"{name:<26}{t(c.predicted_step_s):>12}{versus:>11}"
                f"{mib(c.peak_memory_bytes):>10}{mib(c.even_peak_memory_bytes):>12}{fits}"
            )
        return lines


class MemoryBudgetExceeded(ValueError):
    """No split fits the memory budget: ``closest`` is the plan that comes closest (its peak
    on its fullest rank is ``shortfall`` bytes over the budget)."""

    def __init__(self, message: str, closest: StagePlan, shortfall: float) -> None:
        super().__init__(message)
        self.closest, self.shortfall = closest, shortfall


def _stage_rank(schedule: str, num_ranks: int, stage: int) -> int:
    return SCHEDULES[schedule].placement(num_ranks).rank_of(stage)


# --------------------------------------------------------------------------------------------
# Timing and memory of one split


class _Model:
    """One schedule on its ranks, with the costs of every layer: times and memory of a split.

    ``prefix[k]`` is the sum of the first ``k`` layers' ``LayerCost.vector``; a stage holding
    layers ``a .. b-1`` costs ``prefix[b] - prefix[a]`` (plus the embedding on stage 0, the
    head on the last). The ``*_batch`` methods take many splits at once (a leading axis).
    """

    def __init__(
        self,
        kind: ScheduleKind,
        num_ranks: int,
        num_microbatches: int,
        layers: Sequence[LayerCost],
        first: LayerCost,
        last: LayerCost,
        p2p: float,
        tied_parameter_bytes: int,
    ) -> None:
        self.kind, self.num_ranks, self.m, self.p2p = kind, num_ranks, num_microbatches, p2p
        self.cells = kind.cells(num_ranks, num_microbatches)
        self.placement = kind.placement(num_ranks)
        self.num_stages = self.placement.num_stages
        self.num_layers = len(layers)
        vectors = np.asarray([c.vector() for c in layers], dtype=np.float64).reshape(-1, 7)
        self.prefix = np.concatenate([np.zeros((1, 7)), np.cumsum(vectors, axis=0)])
        self.extra = np.zeros((self.num_stages, 7))
        self.extra[0] += first.vector()
        self.extra[-1] += last.vector()
        owner = np.asarray(self.placement.stage_to_rank, dtype=np.int64)
        self.owner = owner
        self.tied = tied_parameter_bytes if owner[0] == owner[-1] else 0
        cells, mb = self.cells, self.cells.mb_bound
        has2 = cells.second >= 0
        self.has1 = cells.first >= 0
        self.has2 = has2
        first_code = np.where(self.has1, cells.first, 0)
        second_code = np.where(has2, cells.second, 0)
        self.op1, self.st1 = packed.op_of(first_code), packed.stage_of(first_code, mb)
        self.op2, self.st2 = packed.op_of(second_code), packed.stage_of(second_code, mb)
        self.offsets = cells.offsets
        # how often each stage runs each of F, B, I and W in a step
        self.op_counts = np.zeros((self.num_stages, 4))
        np.add.at(self.op_counts, (self.st1[self.has1], self.op1[self.has1]), 1.0)
        np.add.at(self.op_counts, (self.st2[has2], self.op2[has2]), 1.0)
        self._order_levels()
        self._peak_rows()

    # ---- the split's stages

    def stage_vectors(self, counts: Sequence[int]) -> np.ndarray:
        """Per stage, the summed ``LayerCost.vector`` (with the embedding and the head)."""
        return self.stage_vectors_batch(np.asarray([counts], dtype=np.int64))[0]

    def stage_vectors_batch(self, counts: np.ndarray) -> np.ndarray:
        """``stage_vectors`` of each row of ``counts`` (``[splits, stages]``)."""
        bounds = np.zeros((len(counts), self.num_stages + 1), dtype=np.int64)
        np.cumsum(counts, axis=1, out=bounds[:, 1:])
        return self.prefix[bounds[:, 1:]] - self.prefix[bounds[:, :-1]] + self.extra

    # ---- time

    def _per_cell(self, table: np.ndarray) -> np.ndarray:
        """``table[stage, op]`` summed over each cell's parts (0 for a flush)."""
        out = np.where(self.has1, table[self.st1, self.op1], 0.0)
        return out + np.where(self.has2, table[self.st2, self.op2], 0.0)

    def _durations(self, vecs: np.ndarray) -> np.ndarray:
        """``_per_cell`` of each split's F, B, I, W (``vecs``: ``[splits, stages, 7]``), in
        level order, ``[cells, splits]``: the same sums (a plain cell's part plus nothing
        is the part itself, a flush is 0)."""
        flat = np.ascontiguousarray(vecs[:, :, :4].reshape(len(vecs), -1).T)
        out = np.take(flat, self.level_part1, axis=0)
        out[self.level_pairs] += np.take(flat, self.level_part2[self.level_pairs], axis=0)
        out[self.level_flushes] = 0.0
        return out

    def makespan(self, vec: np.ndarray) -> float:
        times = cell_times(self.cells, self.placement, self._per_cell(vec[:, :4]), self.p2p)
        if not times.complete(self.cells):  # a generated schedule always runs to its end
            raise RuntimeError(f"{self.kind.name}: the dataflow timing did not complete")
        return times.makespan

    def _order_levels(self) -> None:
        """Group the cells into levels whose inputs (the rank's previous cell, the data each
        part reads) all come from earlier levels, for ``makespan_batch``: the rule of
        ``timing.cell_times``, encoded as it encodes it."""
        cells = self.cells
        size, columns = data_columns(cells, self.placement)
        need1, remote1, made1, need2, remote2, made2 = columns
        known = np.zeros(size + 2, dtype=bool)
        known[size] = True
        pos, stop = cells.offsets[:-1].copy(), cells.offsets[1:]
        active = np.flatnonzero(pos < stop)
        levels = []
        while len(active):
            g = pos[active]
            ready = known[need1[g]] & known[need2[g]]
            if not ready.any():  # a generated schedule has no dependency cycle
                raise RuntimeError(f"{self.kind.name}: the dataflow timing did not complete")
            g = g[ready]
            levels.append(g)
            known[made1[g]] = True
            known[made2[g]] = True
            pos[active[ready]] += 1
            active = active[pos[active] < stop[active]]
        order = np.concatenate(levels) if levels else np.zeros(0, dtype=np.int64)
        rank_index = np.repeat(np.arange(len(cells.ranks)), np.diff(cells.offsets))
        self.level_order = order
        self.level_pairs = np.flatnonzero(self.has1[order] & self.has2[order])
        self.level_flushes = np.flatnonzero(~self.has1[order])
        self.level_part1 = (self.st1 * 4 + self.op1)[order]
        self.level_part2 = (self.st2 * 4 + self.op2)[order]
        # per level: its cells' ranks, the items both parts read and make, which reads cross
        # ranks, and where its cells' durations are (in level order)
        self.levels = []
        lo = 0
        for g in levels:
            hi = lo + len(g)
            self.levels.append(
                (
                    rank_index[g],
                    np.stack([need1[g], need2[g]]),
                    np.stack([made1[g], made2[g]]),
                    np.stack([remote1[g], remote2[g]])[:, :, None],
                    lo,
                    hi,
                )
            )
            lo = hi
        self.items = size + 2
        self._done: np.ndarray | None = None  # makespan_batch's times of the items, reused

    def makespan_batch(self, vecs: np.ndarray) -> np.ndarray:
        """``makespan`` of each split (``vecs``: ``[splits, stages, 7]``), level by level for
        all splits at once: the same operations as ``cell_times`` (a cell starts at the latest
        of its rank being free and its inputs done, ``p2p`` added across ranks), so the same
        times to the last bit."""
        n = len(vecs)
        durations = self._durations(vecs)
        if self._done is None or self._done.shape[1] < n:
            self._done = np.empty((self.items, n))
        # every item is written before it is read (the levels' order) but `nothing` (-inf)
        done = self._done[:, :n]
        done[self.items - 2] = -np.inf
        free = np.zeros((len(self.cells.ranks), n))
        p2p = self.p2p
        for rk, need, made, remote, lo, hi in self.levels:
            x = done[need]
            if p2p:
                x = np.where(remote, x + p2p, x)
            end = np.maximum(np.maximum(free[rk], x[0]), x[1])
            end += durations[lo:hi]
            done[made] = end
            free[rk] = end
        return free.max(axis=0, initial=0.0)

    # ---- memory

    def _peak_rows(self) -> None:
        """Per rank, after each part of its program, how many micro-batches' activations
        (``F`` until ``B`` / ``I``) and weight-gradient inputs (``I`` until ``W``) each of its
        stages holds, keeping only the rows no other row exceeds in every count (and the
        empty one): a rank's held bytes peak at the largest of these rows times its stages'
        bytes, whatever the split."""
        mb, n = self.cells.mb_bound, self.num_ranks
        parts = np.stack(
            [np.where(self.has1, self.cells.first, -1), np.where(self.has2, self.cells.second, -1)],
            axis=1,
        ).reshape(-1)
        valid = parts >= 0
        op = np.where(valid, packed.op_of(np.maximum(parts, 0)), -1)
        stage = packed.stage_of(np.maximum(parts, 0), mb)
        d_act = (op == packed.F).astype(np.int64) - ((op == packed.B) | (op == packed.I))
        d_wg = (op == packed.I).astype(np.int64) - (op == packed.W)
        self.rank_stages = [np.flatnonzero(self.owner == r) for r in range(n)]
        self.rows: list[np.ndarray] = []  # per rank: [rows, 2 * its stages] (act..., wg...)
        for r, mine in enumerate(self.rank_stages):
            k = len(mine)
            lo, hi = 2 * int(self.offsets[r]), 2 * int(self.offsets[r + 1])
            at = np.flatnonzero(valid[lo:hi])
            local = np.searchsorted(mine, stage[lo:hi][at])
            delta = np.zeros((hi - lo + 1, 2 * k), dtype=np.int64)  # row 0: nothing held yet
            np.add.at(delta, (at + 1, local), d_act[lo:hi][at])
            np.add.at(delta, (at + 1, k + local), d_wg[lo:hi][at])
            rows = np.unique(np.cumsum(delta, axis=0), axis=0)
            covered = (rows[None, :, :] >= rows[:, None, :]).all(axis=2)
            np.fill_diagonal(covered, False)
            self.rows.append(rows[~covered.any(axis=1)])
        # flattened, for peaks_batch: each row's coefficient of (stage, act or wg) pairs
        self.row_rank_start = np.cumsum([0] + [len(x) for x in self.rows[:-1]])
        self.row_coef = np.concatenate(self.rows).astype(np.float64)
        cols = [np.concatenate([mine, mine]) for mine in self.rank_stages]
        kinds = [np.repeat([4, 5], len(mine)) for mine in self.rank_stages]
        self.row_stage = np.concatenate([np.tile(c, (len(x), 1)) for c, x in zip(cols, self.rows)])
        self.row_kind = np.concatenate([np.tile(c, (len(x), 1)) for c, x in zip(kinds, self.rows)])

    def peaks_batch(self, vecs: np.ndarray) -> np.ndarray:
        """Each rank's predicted peak memory in bytes for each split (``[splits, ranks]``;
        see the module doc): its stages' parameter bytes (the tied ones once) plus the
        most its actions hold at once."""
        held = np.zeros((len(vecs), len(self.row_coef)))
        for j in range(self.row_coef.shape[1]):
            held += self.row_coef[:, j] * vecs[:, self.row_stage[:, j], self.row_kind[:, j]]
        top = np.maximum.reduceat(held, self.row_rank_start, axis=1)
        params = np.zeros((len(vecs), self.num_ranks))
        for s, r in enumerate(self.owner.tolist()):
            params[:, r] += vecs[:, s, 6]
        params[:, self.owner[0]] -= self.tied
        return params + top

    def peaks(self, vec: np.ndarray) -> list[int]:
        """Each rank's predicted peak memory in bytes (see the module doc)."""
        return [int(x) for x in self.peaks_batch(vec[None])[0]]

    # ---- balance

    def rank_work_batch(self, vecs: np.ndarray) -> np.ndarray:
        """Per split and rank, the compute of its cells in one step (each stage's F, B, I
        and W times how often the schedule runs them there)."""
        busy = (vecs[:, :, :4] * self.op_counts).sum(axis=2)
        work = np.zeros((len(vecs), self.num_ranks))
        for s, r in enumerate(self.owner.tolist()):
            work[:, r] += busy[:, s]
        return work

    def work(self) -> tuple[np.ndarray, np.ndarray]:
        """The seeds' measure of work: per layer prefix and per stage (the embedding, the
        head), F, B, I and W weighted by how often the schedule runs each, on average over
        the stages."""
        weight = self.op_counts.mean(axis=0)
        return self.prefix[:, :4] @ weight, self.extra[:, :4] @ weight

    def stage_costs(self, vec: np.ndarray) -> tuple[Costs, ...]:
        return tuple(
            Costs(F=float(v[0]), B=float(v[1]), I=float(v[2]), W=float(v[3]), p2p=self.p2p)
            for v in vec
        )

    def step_bound(self) -> float:
        """A step no split can beat: the busiest rank computes at least the average (each
        layer, wherever it goes, costs at least what the cheapest stage's mix of F, B, I and
        W makes it), and one micro-batch goes through every F, then every B or I, in turn."""
        per_layer = self.prefix[1:, :4] - self.prefix[:-1, :4]
        cheapest = (per_layer @ self.op_counts.T).min(axis=1, initial=np.inf)
        total = cheapest[np.isfinite(cheapest)].sum()
        total += (self.extra[:, :4] * self.op_counts).sum()
        path = per_layer[:, 0].sum() + np.minimum(per_layer[:, 1], per_layer[:, 2]).sum()
        path += (self.extra[:, 0] + np.minimum(self.extra[:, 1], self.extra[:, 2])).sum()
        return float(max(total / self.num_ranks, path))


# --------------------------------------------------------------------------------------------
# Seeds


def _bisect(feasible, lo: float, hi: float, iterations: int = 40):
    """The smallest bound in ``[lo, hi]`` (to about ``hi * 1e-9``) for which ``feasible``
    returns a split, and that split (``feasible(hi)`` must return one)."""
    best = feasible(hi)
    for _ in range(iterations):
        if hi - lo <= max(abs(hi), 1e-300) * 1e-9:
            break
        mid = (lo + hi) / 2
        found = feasible(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return best


def _stage_balanced(model: _Model) -> list[int] | None:
    """The split minimising the most work of one stage (``_Model.work``; greedy under a
    bisected bound)."""
    work, extra = model.work()
    n_layers, stages = model.num_layers, model.num_stages

    def feasible(bound: float) -> list[int] | None:
        counts, pos = [], 0
        for s in range(stages):
            middle_after = max(stages - 2 - s, 0)  # middle stages after s, one layer each
            if s == stages - 1:
                k = n_layers - pos
            else:
                room = bound - extra[s]
                if room < 0:
                    return None
                end = int(np.searchsorted(work, work[pos] + room, side="right")) - 1
                k = min(end - pos, n_layers - pos - middle_after)
                if 0 < s and k < 1:
                    return None
            if work[pos + k] - work[pos] + extra[s] > bound * (1 + 1e-12):
                return None
            counts.append(k)
            pos += k
        return counts

    hi = float(work[-1] + extra.sum())
    return _bisect(feasible, 0.0, hi)


def _rank_balanced(model: _Model) -> list[int] | None:
    """On a V placement (rank r: stages r and S-1-r), the split minimising the most work of
    one rank (``_Model.work``; bisection on that bound: per rank, for every left/right
    frontier reached so far, the longest right stage that fits beside each left stage,
    keeping the frontiers no other one passes on both sides); None for another placement."""
    n, stages, n_layers = model.num_ranks, model.num_stages, model.num_layers
    if stages != 2 * n or any(model.owner[s] != model.owner[stages - 1 - s] for s in range(n)):
        return None
    work, extra = model.work()
    suffix = work[-1] - work[::-1]  # suffix[q]: the work of the last q layers
    slack = 1 + 1e-12

    def feasible(bound: float) -> list[int] | None:
        # the frontier: left layers taken p, right layers taken q (p descending)
        fp, fq = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        history = []  # per rank, per p reached: (parent p, a, c)
        for r in range(n - 1):
            least = 1 if r >= 1 else 0
            reserve = stages - 2 - 2 * r  # middle stages after this rank: one layer each
            a = np.arange(least, n_layers + 1)[None, :]
            p, q = fp[:, None], fq[:, None]
            avail = n_layers - p - q - reserve
            end = np.minimum(p + a, n_layers)
            room = bound - (work[end] - work[p] + extra[r]) - extra[stages - 1 - r]
            target = suffix[np.minimum(q, n_layers)] + room * slack
            c = np.searchsorted(suffix, target.ravel(), side="right").reshape(room.shape)
            c = np.minimum(c - 1 - q, avail - a)
            ok = (a <= avail) & (room >= -abs(bound) * 1e-12) & (c >= least)
            if not ok.any():
                return None
            rows, cols = np.nonzero(ok)  # frontier order, then a ascending
            key = fp[rows] + a[0, cols]
            reach = fq[rows] + c[rows, cols]
            # per p reached, the most q (the first that reaches it)
            order = np.lexsort((np.arange(len(key)), -reach, key))
            key, reach, rows, cols = key[order], reach[order], rows[order], cols[order]
            first = np.ones(len(key), dtype=bool)
            first[1:] = key[1:] != key[:-1]
            key, reach, rows, cols = key[first], reach[first], rows[first], cols[first]
            # keep the front: descending p, a state with fewer layers on both sides is passed
            key, reach, rows, cols = key[::-1], reach[::-1], rows[::-1], cols[::-1]
            before = np.maximum.accumulate(np.concatenate([[-1], reach[:-1]]))
            front = reach > before
            key, reach, rows, cols = key[front], reach[front], rows[front], cols[front]
            parent = np.full(n_layers + 1, -1, dtype=np.int64)
            taken = np.zeros((n_layers + 1, 2), dtype=np.int64)
            parent[key] = fp[rows]
            taken[key, 0] = a[0, cols]
            taken[key, 1] = reach - fq[rows]
            history.append((parent, taken))
            fp, fq = key, reach
        # the last rank (stages n-1 and n, side by side) takes what is left
        middle = n >= 2
        rest = n_layers - fp - fq
        load = work[n_layers - fq] - work[fp] + extra[n - 1] + extra[n]
        ok = (rest >= (2 if middle else 0)) & (load <= bound * slack)
        if not ok.any():
            return None
        i = int(np.argmax(ok))
        p, q, rest_i = int(fp[i]), int(fq[i]), int(rest[i])
        # split `rest` between stages n-1 and n as evenly in work as the bounds allow
        lo_a = 1 if middle else 0
        options = np.arange(lo_a, rest_i - lo_a + 1)
        left = work[p + options] - work[p] + extra[n - 1]
        right = work[n_layers - q] - work[p + options] + extra[n]
        a_mid = int(options[np.argmin(np.maximum(left, right))])
        counts = [0] * stages
        counts[n - 1], counts[n] = a_mid, rest_i - a_mid
        for r in range(n - 2, -1, -1):
            parent, taken = history[r]
            counts[r], counts[stages - 1 - r] = int(taken[p, 0]), int(taken[p, 1])
            p = int(parent[p])
        return counts

    hi = float(work[-1] + extra.sum())
    return _bisect(feasible, 0.0, hi)


def _rank_targeted(model: _Model) -> list[int] | None:
    """On a V placement (rank r: stages r and S-1-r), every rank the same work
    (``_Model.work``) and each rank's two stages as equal as its embedding or head allows:
    the boundaries where the layers' summed work is nearest those targets. None for another
    placement."""
    n, stages, n_layers = model.num_ranks, model.num_stages, model.num_layers
    if stages != 2 * n or any(model.owner[s] != model.owner[stages - 1 - s] for s in range(n)):
        return None
    work, extra = model.work()
    per_rank = (work[-1] + extra.sum()) / n
    target = np.full(stages, per_rank / 2) - extra  # each stage's layers' work
    # rank 0 holds the embedding and the head: its layers even the two stages out
    rank0 = max(per_rank - extra[0] - extra[-1], 0.0)
    left = min(max((rank0 + extra[-1] - extra[0]) / 2, 0.0), rank0)
    target[0], target[-1] = left, rank0 - left
    target = np.maximum(target, 0.0)
    goals = np.cumsum(target)[:-1] * (work[-1] / max(target.sum(), 1e-300))
    counts, pos = [], 0
    for s, goal in enumerate(goals.tolist()):
        after = max(stages - 2 - s, 0)  # middle stages after s, one layer each
        low = pos + (1 if s > 0 else 0)
        high = n_layers - after
        if low > high:
            return None
        end = int(np.searchsorted(work, goal))
        best = min(
            (b for b in (end - 1, end) if low <= b <= high),
            key=lambda b: abs(work[b] - goal),
            default=min(max(end, low), high),
        )
        counts.append(best - pos)
        pos = best
    counts.append(n_layers - pos)
    return counts


# --------------------------------------------------------------------------------------------
# Memory: which splits fit a budget, exactly

_ENUMERATE = 2048
"""With a memory budget that at most this many splits fit, the search simulates them all (a
few fitting splits lie apart, where moves of one layer do not lead from one to another)."""

_MANY = _ENUMERATE + 1
"""``_Fitting`` counts ways up to this and no further (saturating: the sums stay exact
integers, and ``min(count, _MANY)`` is all the search asks)."""


def _rank_weights(model: _Model, rank: int) -> tuple[list[np.ndarray], np.ndarray]:
    """For ``rank`` and each of its peak rows (``_Model.rows``), per stage of the rank: the
    prefix sums over the layers of that row's bytes (parameters + the row's counts times the
    activation and weight-gradient bytes), ``[rows, layers + 1]`` each, and the embedding's
    or head's bytes of each stage, ``[rows, stages]``. The rank fits a budget when, for
    every row, its stages' bytes sum to at most the budget (plus any tied bytes)."""
    rows = model.rows[rank].astype(np.float64)
    mine = model.rank_stages[rank]
    k = len(mine)
    pre, extra = model.prefix, model.extra
    prefixes, extras = [], np.zeros((len(rows), k))
    for j, s in enumerate(mine.tolist()):
        act, wg = rows[:, j : j + 1], rows[:, k + j : k + j + 1]
        prefixes.append(pre[None, :, 6] + act * pre[None, :, 4] + wg * pre[None, :, 5])
        extras[:, j] = extra[s, 6] + act[:, 0] * extra[s, 4] + wg[:, 0] * extra[s, 5]
    return prefixes, extras


class _Fitting:
    """Which splits fit ``budget`` bytes on every rank, exactly, for the two placements the
    schedules use (``exact(model)``): one stage per rank, stage by stage, or a V (rank r:
    stages r and S-1-r), rank by rank inwards. Each step keeps every position (per stage:
    where it can start; per V rank: how many layers the outer ranks' left and right stages
    took) with the number of ways to reach it (up to ``_MANY``): a stage's or rank's bytes
    only grow with its layers, so from each position the layers it can take form a range.
    ``count`` is how many splits fit (``_MANY``: more than ``_ENUMERATE``); ``splits(limit)``
    lists up to ``limit`` of them."""

    def __init__(self, model: _Model, budget: float) -> None:
        self.model = model
        n, n_layers = model.num_ranks, model.num_layers
        self.chain = model.owner.tolist() == list(range(n))
        self.limit = [budget + (model.tied if r == model.owner[0] else 0) for r in range(n)]
        self.weights = [_rank_weights(model, r) for r in range(n)]
        self.ways: list[np.ndarray] = []
        if self.chain:
            self._chain()
        else:
            self._v()
        self.count = min(int((self.final_ways[:, None] * self.final_fits).sum()), _MANY)
        del n_layers

    @staticmethod
    def exact(model: _Model) -> bool:
        n, owner = model.num_ranks, model.owner.tolist()
        return owner in (list(range(n)), [*range(n), *range(n - 1, -1, -1)])

    # ---- one stage per rank: ways[s][p], the ways stage s can start at layer p

    def _chain(self) -> None:
        model, stages, n_layers = self.model, self.model.num_stages, self.model.num_layers
        ways = np.zeros(n_layers + 1, dtype=np.int64)
        ways[0] = 1
        self.ways.append(ways)
        for s in range(stages - 1):
            (pre,), extras = self.weights[s]
            least = 1 if s > 0 else 0
            starts = np.flatnonzero(ways)
            end = np.full(len(starts), n_layers - max(stages - 2 - s, 0))
            room = self.limit[s] - extras[:, 0]
            for k in range(len(pre)):
                top = np.searchsorted(pre[k], pre[k, starts] + room[k], side="right") - 1
                end = np.minimum(end, top)
            ok = end >= starts + least
            diff = np.zeros(n_layers + 2, dtype=np.int64)
            np.add.at(diff, starts[ok] + least, ways[starts[ok]])
            np.add.at(diff, end[ok] + 1, -ways[starts[ok]])
            ways = np.minimum(np.cumsum(diff)[: n_layers + 1], _MANY)
            self.ways.append(ways)
        self.final_states = np.flatnonzero(ways)
        self.final_ways = ways[self.final_states]
        (pre,), extras = self.weights[-1]
        load = pre[:, n_layers, None] - pre[:, self.final_states] + extras[:, :1]
        self.final_fits = (load <= self.limit[model.owner[-1]]).all(axis=0)[:, None]

    def _chain_before(self, s: int, end: int) -> np.ndarray:
        """The starts of stage ``s`` from which it can end at ``end`` within the budget."""
        (pre,), extras = self.weights[s]
        least = 1 if s > 0 else 0
        starts = np.flatnonzero(self.ways[s][: max(end - least + 1, 0)])
        load = pre[:, end, None] - pre[:, starts] + extras[:, :1]
        return starts[(load <= self.limit[s]).all(axis=0)]

    # ---- V: ways[r][p, q], the ways ranks before r can take p layers left and q right

    def _v(self) -> None:
        n, stages, n_layers = self.model.num_ranks, self.model.num_stages, self.model.num_layers
        ways = np.zeros((n_layers + 1, n_layers + 1), dtype=np.int64)
        ways[0, 0] = 1
        self.ways.append(ways)
        for r in range(n - 1):
            (left, right), extras = self.weights[r]
            tail = right[:, -1:] - right[:, ::-1]  # the bytes of the last j layers, per row
            least = 0 if r == 0 else 1
            reserve = stages - 2 - 2 * r  # the middle stages inside this rank: a layer each
            room0 = self.limit[r] - extras.sum(axis=1)
            p, q = np.nonzero(ways)
            w = ways[p, q]
            diff = np.zeros((n_layers + 1, n_layers + 2), dtype=np.int64)
            a = least
            while len(p):
                most = n_layers - p - q - reserve - a  # the most the right stage may take
                keep = most >= least
                p, q, w, most = p[keep], q[keep], w[keep], most[keep]
                end = p + a
                room = room0[:, None] - (left[:, end] - left[:, p])
                for k in range(len(tail)):
                    top = np.searchsorted(tail[k], tail[k, q] + room[k], side="right") - 1 - q
                    most = np.minimum(most, top)
                # a position that fails at a fails at every larger a (the left stage grows)
                keep = most >= least
                p, q, w, most, end = p[keep], q[keep], w[keep], most[keep], end[keep]
                np.add.at(diff, (end, q + least), w)
                np.add.at(diff, (end, q + most + 1), -w)
                a += 1
            ways = np.minimum(np.cumsum(diff, axis=1)[:, : n_layers + 1], _MANY)
            self.ways.append(ways)
        # the innermost rank: stages n-1 and n side by side over what is left, split at x
        (left, right), extras = self.weights[n - 1]
        least = 0 if n == 1 else 1
        p, q = np.nonzero(ways)
        self.final_states = np.stack([p, q], axis=1)
        self.final_ways = ways[p, q]
        gap = left - right  # the load of a split at x is gap[x] - left[p] + right[end]
        rhs = self.limit[n - 1] - extras.sum(axis=1)[:, None] + left[:, p] - right[:, n_layers - q]
        fits = np.zeros((len(p), n_layers + 1), dtype=bool)
        block = 16  # splits x at a time: [rows, positions, block] comparisons
        for x0 in range(0, n_layers + 1, block):
            xs = np.arange(x0, min(x0 + block, n_layers + 1))
            inside = (xs[None, :] >= (p + least)[:, None]) & (
                xs[None, :] <= (n_layers - q - least)[:, None]
            )
            load = (gap[:, None, xs] <= rhs[:, :, None]).all(axis=0)
            fits[:, xs] = inside & load
        self.final_fits = fits

    def _v_before(self, r: int, pl: int, ql: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions before rank ``r`` from which it can take layers up to ``pl`` on the
        left and ``ql`` on the right within the budget."""
        (left, right), extras = self.weights[r]
        tail = right[:, -1:] - right[:, ::-1]
        least = 0 if r == 0 else 1
        p, q = np.nonzero(self.ways[r][: max(pl - least + 1, 0), : max(ql - least + 1, 0)])
        load = left[:, pl, None] - left[:, p] + tail[:, ql, None] - tail[:, q]
        ok = (load + extras.sum(axis=1)[:, None] <= self.limit[r]).all(axis=0)
        return p[ok], q[ok]

    # ---- the splits

    def splits(self, limit: int) -> list[list[int]]:
        """Up to ``limit`` splits that fit (all of them when ``count <= limit``), in a fixed
        order."""
        out: list[list[int]] = []
        model, stages, n_layers = self.model, self.model.num_stages, self.model.num_layers
        if self.chain:

            def back(s: int, end: int, bounds: list[int]) -> None:
                if s < 0:
                    out.append([b - a for a, b in itertools.pairwise(reversed(bounds))])
                    return
                for start in self._chain_before(s, end).tolist():
                    if len(out) >= limit:
                        return
                    back(s - 1, start, [*bounds, start])

            for i in np.flatnonzero(self.final_fits[:, 0]).tolist():
                if len(out) >= limit:
                    break
                start = int(self.final_states[i])
                back(stages - 2, start, [n_layers, start])
            return out
        n = model.num_ranks

        def back_v(r: int, pl: int, ql: int, counts: list[int]) -> None:
            if r < 0:
                out.append(list(counts))
                return
            p, q = self._v_before(r, pl, ql)
            for pp, qq in zip(p.tolist(), q.tolist()):
                if len(out) >= limit:
                    return
                counts[r], counts[stages - 1 - r] = pl - pp, ql - qq
                back_v(r - 1, pp, qq, counts)

        for i, x in zip(*np.nonzero(self.final_fits)):
            if len(out) >= limit:
                break
            pl, ql = (int(v) for v in self.final_states[i])
            counts = [0] * stages
            counts[n - 1], counts[n] = int(x) - pl, n_layers - ql - int(x)
            back_v(n - 2, pl, ql, counts)
        return out


def _least_memory(
    model: _Model,
    budget: int,
    known: Sequence[int],
    report: Callable[[int, int], None] | None = None,
) -> list[int]:
    """The split whose fullest rank holds the least, when none fits ``budget`` (``known`` is
    a split): bisection on the budget, each step exact; ``report(lo, hi)`` after each (the
    least lies above ``lo`` and at most at ``hi`` bytes)."""
    lo, hi = budget, max(model.peaks(model.stage_vectors(known)))
    best = list(known)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = _Fitting(model, mid).splits(1)
        if not found:
            lo = mid
        else:
            best = found[0]
            hi = max(model.peaks(model.stage_vectors(best)))
        if report is not None:
            report(lo, hi)
    return best


# --------------------------------------------------------------------------------------------
# The search

Score = tuple[float, float, float]

_FAR_MOVES = 512
"""The far moves one scan tries, busiest ranks to idlest first: all of them up to 23 stages;
beyond, a scan of all (``S * (S - 3) + 2``) would cost more than the rest of the search."""


class _Search:
    """The seeds, then one-boundary moves, every split simulated once (see the module doc)."""

    def __init__(
        self,
        model: _Model,
        memory_budget: int | None,
        progress: Callable[[PlanProgress], None] | None = None,
    ) -> None:
        self.model, self.budget, self.progress = model, memory_budget, progress
        self.cache: dict[tuple[int, ...], Score] = {}
        self.best: Score | None = None
        self.started = time.perf_counter()
        self.bound = model.step_bound()
        # splits simulated together: their times for every cell, at most some tens of MB
        self.batch = max(2 * model.num_stages, 4_000_000 // (model.items + len(model.cells)))

    def scores(self, splits: Sequence[tuple[int, ...]]) -> list[Score]:
        """``(bytes over the budget, makespan, sum of squared rank work)`` of each split:
        smaller is better. The splits not seen before are simulated together."""
        new = [c for c in dict.fromkeys(splits) if c not in self.cache]
        for at in range(0, len(new), self.batch):
            chunk = new[at : at + self.batch]
            vecs = self.model.stage_vectors_batch(np.asarray(chunk, dtype=np.int64))
            spans = self.model.makespan_batch(vecs)
            over = np.zeros(len(chunk))
            if self.budget is not None:
                over = np.maximum(self.model.peaks_batch(vecs).max(axis=1) - self.budget, 0.0)
            work = self.model.rank_work_batch(vecs)
            balance = (work * work).sum(axis=1)
            for c, o, m, w in zip(chunk, over.tolist(), spans.tolist(), balance.tolist()):
                score = (o, m, w)
                self.cache[c] = score
                if self.best is None or self.better(score, self.best):
                    self.best = score
            self._report("searching")
        return [self.cache[c] for c in splits]

    def score(self, counts: Sequence[int]) -> Score:
        return self.scores([tuple(counts)])[0]

    def _report(self, phase: str) -> None:
        if self.progress is not None and self.best is not None:
            self.progress(
                PlanProgress(
                    schedule=self.model.kind.name,
                    num_microbatches=self.model.m,
                    phase=phase,
                    simulations=len(self.cache),
                    elapsed_s=time.perf_counter() - self.started,
                    best_step_s=self.best[1],
                    best_over_budget_bytes=self.best[0],
                    bound_s=self.bound,
                )
            )

    @staticmethod
    def better(a: Score, b: Score) -> bool:
        """Whether score ``a`` beats ``b`` (makespans within ``_REL`` are a tie)."""
        if a[0] != b[0]:
            return a[0] < b[0]
        scale = max(abs(a[1]), abs(b[1]), 1e-300)
        if abs(a[1] - b[1]) > _REL * scale:
            return a[1] < b[1]
        return a[2] < b[2] * (1 - 1e-12)

    def valid(self, counts: Sequence[int]) -> bool:
        last = len(counts) - 1
        return all(c >= (1 if 0 < s < last else 0) for s, c in enumerate(counts))

    def _moves(self, counts: tuple[int, ...], far: bool) -> list[tuple[int, int]]:
        """The moves from ``counts``, as (from stage, to stage) pairs: each boundary by one
        layer, or (``far``) one layer from one stage to another further off (every boundary
        between them moves by one): those from the busiest ranks to the idlest first, at
        most ``_FAR_MOVES`` of them."""
        n = len(counts)
        if not far:
            pairs = [(i, i + d) for i in range(n) for d in (-1, 1) if 0 <= i + d < n]
        else:
            vec = self.model.stage_vectors(counts)
            stage = (vec[:, :4] * self.model.op_counts).sum(axis=1)
            rank = self.model.rank_work_batch(vec[None])[0][self.model.owner]
            pairs = sorted(
                ((i, j) for i in range(n) for j in range(n) if abs(i - j) > 1),
                key=lambda ij: (rank[ij[1]] - rank[ij[0]], stage[ij[1]] - stage[ij[0]], ij),
            )
        last = n - 1
        spare = [c > (1 if 0 < s < last else 0) for s, c in enumerate(counts)]
        return [(i, j) for i, j in pairs if spare[i]][: _FAR_MOVES if far else None]

    def _moved(self, counts: tuple[int, ...], src: int, dst: int) -> tuple[int, ...] | None:
        """``counts`` with one layer moved from stage ``src`` to ``dst``; None if invalid."""
        if counts[src] <= (1 if 0 < src < len(counts) - 1 else 0):
            return None
        cand = list(counts)
        cand[src] -= 1
        cand[dst] += 1
        return tuple(cand)

    def refine(self, counts: Sequence[int]) -> tuple[int, ...]:
        """Moves as long as one improves: the best near move (repeated while it helps),
        else the first far one that helps."""
        best = tuple(counts)
        best_score = self.score(best)
        far = False
        while True:
            step = None
            moves = self._moves(best, far)
            # near moves: all of them at once; far moves: a batch at a time, the first that helps
            size = self.batch if far else max(len(moves), 1)
            for at in range(0, len(moves), size):
                chunk = moves[at : at + size]
                splits = [self._moved(best, i, j) for i, j in chunk]
                for move, cand, s in zip(chunk, splits, self.scores(splits)):
                    if self.better(s, best_score) and (step is None or self.better(s, step[2])):
                        step = (move, cand, s)
                        if far:
                            break  # the first far move that helps: near moves go on from there
                if step is not None:
                    break
            if step is None:
                if far:
                    return best
                far = True
                continue
            (src, dst), best, best_score = step
            far = False
            # the same move again while it helps: a layer that should travel goes on
            while (cand := self._moved(best, src, dst)) is not None:
                s = self.score(cand)
                if not self.better(s, best_score):
                    break
                best, best_score = cand, s

    def run(self, even: list[int]) -> tuple[int, ...]:
        seeds = [tuple(even)]
        for make in (_stage_balanced, _rank_balanced, _rank_targeted):
            seed = make(self.model)
            if seed is not None and self.valid(seed) and tuple(seed) not in seeds:
                seeds.append(tuple(seed))
        self.scores(seeds)
        seeds.sort(key=lambda c: _Key(self, self.cache[c]))
        results = [self.refine(seed) for seed in seeds]
        best = min(results, key=lambda c: _Key(self, self.cache[c]))
        if self.budget is None or not _Fitting.exact(self.model):
            return best
        # which splits fit is decided exactly: moves of one layer may not reach them
        self._report("memory")
        fitting = _Fitting(self.model, self.budget)
        if not fitting.count:

            def report(lo: int, hi: int) -> None:
                self._report(
                    f"memory: none fits; the least a split needs is {(lo + 1) / 2**20:.1f} to "
                    f"{hi / 2**20:.1f} MiB"
                )

            found = [tuple(_least_memory(self.model, self.budget, best, report))]
        elif fitting.count <= _ENUMERATE:
            found = [tuple(c) for c in fitting.splits(_ENUMERATE)]
        elif self.cache[best][0] > 0:
            found = [tuple(fitting.splits(1)[0])]
        else:
            return best
        self.scores(found)
        top = min(found, key=lambda c: _Key(self, self.cache[c]))
        top = self.refine(top)
        return min((best, top), key=lambda c: _Key(self, self.cache[c]))


class _Key:
    """A sort key from a score and ``_Search.better``."""

    __slots__ = ("score", "search")

    def __init__(self, search: _Search, score: Score) -> None:
        self.search, self.score = search, score

    def __lt__(self, other: _Key) -> bool:
        return self.search.better(self.score, other.score)


# --------------------------------------------------------------------------------------------
# plan_stages


def _check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {name}={value!r}")
    return value


def _costs_list(layer_costs: Sequence[LayerCost]) -> list[LayerCost]:
    if isinstance(layer_costs, (str, bytes)) or not isinstance(layer_costs, Sequence):
        raise ValueError(
            f"layer_costs must be a list of LayerCost, got {type(layer_costs).__name__}"
        )
    out = list(layer_costs)
    for i, c in enumerate(out):
        if not isinstance(c, LayerCost):
            raise ValueError(f"layer_costs[{i}] must be a LayerCost, got {type(c).__name__}")
    return out


def _one_cost(name: str, value: LayerCost | None) -> LayerCost:
    if value is None:
        return _ZERO
    if not isinstance(value, LayerCost):
        raise ValueError(f"{name} must be a LayerCost or None, got {type(value).__name__}")
    return value


def plan_stages(
    layer_costs: Sequence[LayerCost],
    num_stages: int,
    *,
    num_microbatches: int,
    schedule: str = "dualpipev",
    first_costs: LayerCost | None = None,
    last_costs: LayerCost | None = None,
    memory_budget: float | None = None,
    p2p: float = 0.0,
    tied_parameter_bytes: int = 0,
    tie_margin: float = 0.0,
    progress: Callable[[PlanProgress], None] | None = None,
) -> StagePlan:
    """Choose how many of the model's layers each of ``num_stages`` stages holds.

    layer_costs: per decoder layer, in model order, what one micro-batch costs there.
    num_microbatches: micro-batches per step (the costs are one micro-batch's).
    schedule: a name of ``generators.SCHEDULES`` (``num_stages`` must be a multiple
        of its stages per rank), or ``"auto"``: one of ``AUTO_SCHEDULES`` that fits
        ``memory_budget``, by the rule of ``choose_plan`` (the fastest, or within
        ``tie_margin`` of it the one that holds least on the even split).
    first_costs / last_costs: the embedding (stage 0) and the head with the loss (the last
        stage), which stay there whatever the split; None: nothing.
    memory_budget: bytes per rank (whole bytes: a fraction is dropped); the plan's
        predicted peak on every rank must fit, or it raises ``MemoryBudgetExceeded`` (a
        ``ValueError``) naming the shortfall of the split whose fullest rank holds least.
    p2p: seconds each cross-rank input arrives after it is computed.
    tied_parameter_bytes: parameter bytes that ``first_costs`` and ``last_costs`` both count
        (a tied embedding and head), held once by a rank that holds both stages; at most
        the parameter bytes of each.
    tie_margin: for ``schedule="auto"``, see ``choose_plan`` (default 0: the fastest).
    progress: called with a ``PlanProgress`` after every batch of simulations (a large
        search takes seconds: a caller can show how far it is and how much it can still
        gain).

    Returns a ``StagePlan``: the chosen split, its simulated step, each stage's costs and each
    rank's predicted peak memory, beside the even split's (``splits.layers_per_stage``). The
    search is described in the module doc; the chosen split's step is never longer than the
    even split's unless the even split does not fit the budget.
    """
    layers = _costs_list(layer_costs)
    first, last = _one_cost("first_costs", first_costs), _one_cost("last_costs", last_costs)
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    _check_count("tied_parameter_bytes", tied_parameter_bytes, 0)
    for name, cost in (("first_costs", first), ("last_costs", last)):
        if tied_parameter_bytes > cost.parameter_bytes:
            raise ValueError(
                f"tied_parameter_bytes={tied_parameter_bytes} is more than {name}."
                f"parameter_bytes={cost.parameter_bytes:.0f}: the tied bytes are counted in "
                "both first_costs and last_costs, so they can be at most either's"
            )
    if memory_budget is not None and (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, (int, float))
        or not (math.isfinite(memory_budget) and memory_budget >= 1)
    ):
        raise ValueError(
            f"memory_budget must be a finite number of bytes >= 1, got {memory_budget!r}"
        )
    budget = None if memory_budget is None else math.floor(memory_budget)
    if (
        isinstance(p2p, bool)
        or not isinstance(p2p, (int, float))
        or not (math.isfinite(p2p) and p2p >= 0)
    ):
        raise ValueError(f"p2p must be a finite number of seconds >= 0, got {p2p!r}")
    _check_margin(tie_margin)
    if len(layers) < num_stages - 2:
        raise ValueError(
            f"{len(layers)} layers are too few for num_stages={num_stages}: every middle "
            f"stage needs one, so at least {num_stages - 2}"
        )
    if schedule == "auto":
        if num_stages % 2:
            raise ValueError(
                f'schedule="auto" chooses among {", ".join(AUTO_SCHEDULES)}, which place two '
                f"stages on each rank: num_stages={num_stages} is odd"
            )
        names = list(AUTO_SCHEDULES)
    elif isinstance(schedule, str) and schedule in SCHEDULES:
        names = [schedule]
    else:
        raise ValueError(
            f'unknown schedule {schedule!r}: expected "auto" or one of {sorted(SCHEDULES)}'
        )
    plans, refused = [], []
    for name in names:
        kind = SCHEDULES[name]
        if num_stages % kind.stages_per_rank:
            raise ValueError(
                f"{name} places {kind.stages_per_rank} stages on each rank: num_stages="
                f"{num_stages} is not a multiple of {kind.stages_per_rank}"
            )
        ranks = num_stages // kind.stages_per_rank
        try:
            model = _Model(
                kind, ranks, num_microbatches, layers, first, last, p2p, tied_parameter_bytes
            )
        except ValueError as e:  # the schedule's own sizes (DualPipeV: M >= 2N)
            if len(names) == 1:
                raise
            refused.append(f"{name}: {e}")
            continue
        plans.append(_plan(model, budget, progress))
    if not plans:
        raise ValueError('schedule="auto": no schedule runs here: ' + "; ".join(refused))
    return choose_plan(plans, tie_margin=tie_margin) if len(plans) > 1 else _checked(plans[0])


def _check_margin(tie_margin: object) -> None:
    if (
        isinstance(tie_margin, bool)
        or not isinstance(tie_margin, (int, float))
        or not (0 <= tie_margin < 1)
    ):
        raise ValueError(f"tie_margin must be a fraction in [0, 1), got {tie_margin!r}")


def _within(step: float, fastest: float, margin: float) -> bool:
    """Whether ``step`` is within ``margin`` of the ``fastest`` (ties of ``_REL`` included)."""
    return step <= fastest * (1 + margin) + _REL * abs(fastest)


def _fits(plan: StagePlan) -> bool:
    return plan.memory_budget is None or max(plan.peak_memory_bytes) <= plan.memory_budget


def _checked(plan: StagePlan) -> StagePlan:
    """``plan``, or ``MemoryBudgetExceeded`` naming its shortfall when it does not fit."""
    if _fits(plan):
        return plan
    peaks = plan.peak_memory_bytes
    rank = max(range(len(peaks)), key=peaks.__getitem__)
    short = peaks[rank] - plan.memory_budget
    raise MemoryBudgetExceeded(
        f"no split fits memory_budget={plan.memory_budget} bytes: the closest "
        f"({plan.schedule}, {plan.num_microbatches} micro-batches, layers per stage "
        f"{list(plan.layers_per_stage)}) needs {peaks[rank]} bytes on rank {rank}, "
        f"{short} bytes ({short / 2**20:.1f} MiB) more than the budget",
        plan,
        short,
    )


def choose_plan(plans: Sequence[StagePlan], *, tie_margin: float = 0.0) -> StagePlan:
    """The plan to use among ``plans`` (other schedules, other micro-batch counts), by a
    stated rule: of the plans that fit their memory budget, those whose predicted step is
    within ``tie_margin`` (a fraction) of the fastest are tied; of those, the one whose
    schedule and micro-batches hold least on the even split wins, then the one whose own
    fullest rank holds least, then the first in ``plans``. Measured costs vary from run to
    run: a margin keeps the choice between close plans from following that noise, and the
    even split's bytes, measured from shapes and independent of the split the noise chose,
    are the same in every run. Returns the plan with ``candidates`` (all of ``plans``) and
    ``tie_margin`` set; raises ``MemoryBudgetExceeded`` for the closest when none fits."""
    _check_margin(tie_margin)
    if not plans:
        raise ValueError("choose_plan: no plan given")
    fitting = [p for p in plans if _fits(p)]
    if not fitting:
        _checked(min(plans, key=lambda p: max(p.peak_memory_bytes) - p.memory_budget))
    fastest = min(p.predicted_step_s for p in fitting)
    tied = [p for p in fitting if _within(p.predicted_step_s, fastest, tie_margin)]
    # min keeps the first of equals
    chosen = min(tied, key=lambda p: (max(p.even_peak_memory_bytes), max(p.peak_memory_bytes)))
    candidates = tuple(
        PlanCandidate(
            p.schedule,
            p.num_microbatches,
            p.predicted_step_s,
            max(p.peak_memory_bytes),
            max(p.even_peak_memory_bytes),
            _fits(p),
        )
        for p in plans
    )
    return replace(chosen, candidates=candidates, tie_margin=float(tie_margin))


def _plan(
    model: _Model,
    memory_budget: int | None,
    progress: Callable[[PlanProgress], None] | None = None,
) -> StagePlan:
    even = layers_per_stage(model.num_layers, model.num_stages)
    search = _Search(model, memory_budget, progress)
    counts = check_layers_per_stage(search.run(even), model.num_layers, model.num_stages)
    if not search.better(search.score(counts), search.score(even)):
        counts = even  # equal (a tie): the even split, the one a user would pick anyway
    vec, even_vec = model.stage_vectors(counts), model.stage_vectors(even)
    return StagePlan(
        schedule=model.kind.name,
        num_ranks=model.num_ranks,
        num_microbatches=model.m,
        layers_per_stage=tuple(counts),
        predicted_step_s=model.makespan(vec),
        stage_costs=model.stage_costs(vec),
        peak_memory_bytes=tuple(model.peaks(vec)),
        even_layers_per_stage=tuple(even),
        even_predicted_step_s=model.makespan(even_vec),
        even_stage_costs=model.stage_costs(even_vec),
        even_peak_memory_bytes=tuple(model.peaks(even_vec)),
        memory_budget=memory_budget,
        simulations=len(search.cache),
    )


def predict_step(
    stage_costs: Sequence[Costs], *, num_microbatches: int, schedule: str = "dualpipev"
) -> float:
    """The simulated step of a split given by each stage's costs (``StagePlan.stage_costs``,
    or costs measured some other way; ``p2p`` is the first stage's), by the same dataflow
    timing the planner judges splits with: what ``StagePlan.predicted_step_s`` is for the
    plan's own costs."""
    _check_count("num_microbatches", num_microbatches)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {sorted(SCHEDULES)}")
    kind = SCHEDULES[schedule]
    n = len(stage_costs)
    if not n or n % kind.stages_per_rank:
        raise ValueError(
            f"{schedule} places {kind.stages_per_rank} stages on each rank: got {n} stage costs"
        )
    layers = [
        LayerCost(forward=c.F, backward_input=c.I, backward_weight=c.W, backward=c.B)
        for c in stage_costs
    ]
    none = LayerCost(forward=0.0, backward_input=0.0, backward_weight=0.0)
    model = _Model(
        kind,
        n // kind.stages_per_rank,
        num_microbatches,
        layers,
        none,
        none,
        stage_costs[0].p2p,
        0,
    )
    return model.makespan(model.stage_vectors([1] * n))
