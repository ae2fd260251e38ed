"""Stage boundaries from per-layer costs: the split whose simulated step is shortest.

``plan_stages(layer_costs, num_stages, num_microbatches=M)`` takes what one micro-batch costs
in each layer of a model (``LayerCost``: forward, input-gradient and weight-gradient seconds,
the bytes it holds) and the embedding's and head's costs apart, and chooses how many
consecutive layers each stage holds (``graphpipe.splits``: every middle stage at least one;
the first and the last may hold none besides the embedding and the head). A split is judged
by the schedule's dataflow timing (``graphpipe.timing.cell_times``, the ideal the runtime
aims at; ``Costs.p2p`` latency on every cross-rank input) with each stage's own F / B / I / W
costs, the sums of its layers'. An overlapped ``F&B`` pair costs its F plus its B (no gain
from overlapping is assumed).

The search (``_Search``):

1. seeds: the even split (``splits.layers_per_stage``); the split that minimises the most
   work (``F + B``) of one stage (bisection on that bound, each stage greedily as long as it
   fits); on a V placement (rank ``r`` holds stages ``r`` and ``2N-1-r``) the split that
   minimises the most work of one rank (bisection on the bound; per rank, for every
   left/right frontier reached so far, the longest right stage that fits beside each left
   stage: linear in the ranks, quadratic in the layers, in numpy);
2. refinement, from every seed: the best move of one boundary by one layer while one
   shortens the simulated step (ties broken by the sum of the squared per-rank work, which
   walks plateaus towards balance); when none does, the first move of one layer between two
   stages further apart that does, then boundary moves again; the best result wins.

It is a local search, not an exhaustive one (``tests/test_planner.py`` holds it within 0.5%
of the exhaustive optimum on small random cases, and to the known optimum where it is known
by hand), and the even split wins ties. Every split visited is simulated once (a cache): 80
layers over 16 stages take about 2,000 simulations (``tests/benchmarks/bench_planner.py``;
the time is in docs/planning.md). With a ``memory_budget`` the search minimises first how far
the peak memory of the fullest rank is over it, then the step; ``schedule="auto"`` searches
each schedule that places two stages on every rank (``dualpipev``, ``zbv``) and keeps the
fastest that fits. Nothing that fits is ``MemoryBudgetExceeded`` (a ``ValueError``) naming
the shortfall.

Peak memory of a rank (``StagePlan.peak_memory_bytes``): its stages' ``parameter_bytes``
(counted once for ``tied_parameter_bytes`` when the first and the last stage share a rank),
plus the most that its actions, in its program order, hold at once: an ``F`` takes its
stage's ``activation_bytes`` until its ``B`` or ``I``; an ``I`` hands over to
``weight_grad_bytes`` until its ``W``; an overlapped pair counts its ``F`` before its ``B``
(as ``simulate.RankStats.peak_activations`` does).

Owns: nothing (functions and values). May touch: nothing. Imports numpy, not torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from graphpipe import packed
from graphpipe.costs import Costs
from graphpipe.schedules import SCHEDULES, ScheduleKind
from graphpipe.splits import check_layers_per_stage, layers_per_stage
from graphpipe.timing import cell_times

__all__ = [
    "AUTO_SCHEDULES",
    "LayerCost",
    "MemoryBudgetExceeded",
    "StagePlan",
    "plan_stages",
    "predict_step",
]

AUTO_SCHEDULES = ("dualpipev", "zbv")
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
        return "\n".join(lines)


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
    head on the last).
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

    def stage_vectors(self, counts: Sequence[int]) -> np.ndarray:
        """Per stage, the summed ``LayerCost.vector`` (with the embedding and the head)."""
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return self.prefix[bounds[1:]] - self.prefix[bounds[:-1]] + self.extra

    def _per_cell(self, table: np.ndarray) -> np.ndarray:
        """``table[stage, op]`` summed over each cell's parts (0 for a flush)."""
        out = np.where(self.has1, table[self.st1, self.op1], 0.0)
        return out + np.where(self.has2, table[self.st2, self.op2], 0.0)

    def makespan(self, vec: np.ndarray) -> float:
        times = cell_times(self.cells, self.placement, self._per_cell(vec[:, :4]), self.p2p)
        if not times.complete(self.cells):  # a generated schedule always runs to its end
            raise RuntimeError(f"{self.kind.name}: the dataflow timing did not complete")
        return times.makespan

    def peaks(self, vec: np.ndarray) -> list[int]:
        """Each rank's predicted peak memory in bytes (see the module doc)."""
        act, wg = vec[:, 4], vec[:, 5]
        delta = np.stack([act, -act, wg - act, -wg], axis=1)  # F, B, I, W
        # the parts of a pair one after the other (its F first), as the simulator counts
        parts = np.stack(
            [
                np.where(self.has1, delta[self.st1, self.op1], 0.0),
                np.where(self.has2, delta[self.st2, self.op2], 0.0),
            ],
            axis=1,
        )
        held = np.cumsum(parts.reshape(-1))
        out = []
        params = np.bincount(self.owner, weights=vec[:, 6], minlength=self.num_ranks)
        params[self.owner[0]] -= self.tied
        for r in range(self.num_ranks):
            lo, hi = 2 * int(self.offsets[r]), 2 * int(self.offsets[r + 1])
            base = held[lo - 1] if lo else 0.0
            top = float((held[lo:hi] - base).max(initial=0.0))
            out.append(round(params[r] + max(top, 0.0)))
        return out

    def rank_work(self, vec: np.ndarray) -> np.ndarray:
        """Per rank, the F + B work of one micro-batch through its stages."""
        return np.bincount(self.owner, weights=vec[:, 0] + vec[:, 1], minlength=self.num_ranks)

    def stage_costs(self, vec: np.ndarray) -> tuple[Costs, ...]:
        return tuple(
            Costs(F=float(v[0]), B=float(v[1]), I=float(v[2]), W=float(v[3]), p2p=self.p2p)
            for v in vec
        )


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
    """The split minimising the most F + B of one stage (greedy under a bisected bound)."""
    work = model.prefix[:, 0] + model.prefix[:, 1]
    extra = model.extra[:, 0] + model.extra[:, 1]
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
    """On a V placement (rank r: stages r and S-1-r), the split minimising the most F + B of
    one rank; None for another placement."""
    n, stages, n_layers = model.num_ranks, model.num_stages, model.num_layers
    if stages != 2 * n or any(model.owner[s] != model.owner[stages - 1 - s] for s in range(n)):
        return None
    work = model.prefix[:, 0] + model.prefix[:, 1]
    extra = model.extra[:, 0] + model.extra[:, 1]
    # suffix[q]: the work of the last q layers
    suffix = work[-1] - work[::-1]

    def feasible(bound: float) -> list[int] | None:
        # frontier: p (left layers taken) -> (q right layers taken, parent p, a, c)
        frontier: dict[int, tuple[int, int, int, int]] = {0: (0, -1, 0, 0)}
        history = []
        for r in range(n - 1):
            middle = r >= 1
            left_extra, right_extra = extra[r], extra[stages - 1 - r]
            reserve = stages - 2 - 2 * r  # middle stages after this rank: one layer each
            nxt: dict[int, tuple[int, int, int, int]] = {}
            for p, (q, *_rest) in frontier.items():
                avail = n_layers - p - q - reserve
                if avail < 0:
                    continue
                a = np.arange(1 if middle else 0, avail + 1)
                left = work[p + a] - work[p] + left_extra
                room = bound - left - right_extra
                ok = room >= -abs(bound) * 1e-12
                a, room = a[ok], room[ok]
                if not len(a):
                    continue
                # the most c with suffix[q + c] - suffix[q] <= room
                c = np.searchsorted(suffix, suffix[q] + room * (1 + 1e-12), side="right") - 1 - q
                c = np.minimum(c, avail - a)
                good = c >= (1 if middle else 0)
                for ai, ci in zip(a[good].tolist(), c[good].tolist()):
                    key = p + ai
                    if key not in nxt or nxt[key][0] < q + ci:
                        nxt[key] = (q + ci, p, ai, ci)
            if not nxt:
                return None
            # keep the Pareto front: a state with fewer layers on both sides is dominated
            front, best_q = {}, -1
            for p in sorted(nxt, reverse=True):
                if nxt[p][0] > best_q:
                    front[p], best_q = nxt[p], nxt[p][0]
            history.append(front)
            frontier = front
        # the last rank (stages n-1 and n, side by side) takes what is left
        middle = n >= 2
        best = None
        for p, (q, *_rest) in frontier.items():
            rest = n_layers - p - q
            if rest < (2 if middle else 0):
                continue
            load = work[n_layers - q] - work[p] + extra[n - 1] + extra[n]
            if load <= bound * (1 + 1e-12):
                best = (p, q, rest)
                break
        if best is None:
            return None
        p, q, rest = best
        # split `rest` between stages n-1 and n as evenly in work as the bounds allow
        lo_a = 1 if middle else 0
        options = np.arange(lo_a, rest - lo_a + 1)
        left = work[p + options] - work[p] + extra[n - 1]
        right = work[n_layers - q] - work[p + options] + extra[n]
        a_mid = int(options[np.argmin(np.maximum(left, right))])
        counts = [0] * stages
        counts[n - 1], counts[n] = a_mid, rest - a_mid
        for r in range(n - 2, -1, -1):
            _, parent, a, c = history[r][p]
            counts[r], counts[stages - 1 - r] = a, c
            p = parent
        return counts

    hi = float(work[-1] + extra.sum())
    return _bisect(feasible, 0.0, hi)


# --------------------------------------------------------------------------------------------
# The search


class _Search:
    """The seeds, then one-boundary moves, every split simulated once (see the module doc)."""

    def __init__(self, model: _Model, memory_budget: float | None) -> None:
        self.model, self.budget = model, memory_budget
        self.cache: dict[tuple[int, ...], tuple[float, float, float]] = {}

    def score(self, counts: Sequence[int]) -> tuple[float, float, float]:
        """``(bytes over the budget, makespan, sum of squared rank work)``: smaller is better."""
        key = tuple(counts)
        found = self.cache.get(key)
        if found is None:
            vec = self.model.stage_vectors(key)
            over = 0.0
            if self.budget is not None:
                over = max(0.0, max(self.model.peaks(vec)) - self.budget)
            work = self.model.rank_work(vec)
            found = (over, self.model.makespan(vec), float((work * work).sum()))
            self.cache[key] = found
        return found

    @staticmethod
    def better(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
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

    def _moves(self, counts: list[int], far: bool):
        """Splits one move away: a boundary by one layer, or (``far``) one layer from any
        stage to any other (every boundary between them moves by one)."""
        n = len(counts)
        pairs = (
            [(i, j) for i in range(n) for j in range(n) if abs(i - j) > 1]
            if far
            else [(i, i + d) for i in range(n) for d in (-1, 1) if 0 <= i + d < n]
        )
        for src, dst in pairs:
            cand = list(counts)
            cand[src] -= 1
            cand[dst] += 1
            if self.valid(cand):
                yield cand

    def refine(self, counts: list[int]) -> list[int]:
        """Moves as long as one improves: the best near move, else the first far one that
        helps."""
        best, best_score = list(counts), self.score(counts)
        far = False
        while True:
            step = None
            for cand in self._moves(best, far):
                s = self.score(cand)
                if self.better(s, best_score) and (step is None or self.better(s, step[1])):
                    step = (cand, s)
                    if far:
                        break  # the first far move that helps: near moves go on from there
            if step is None:
                if far:
                    return best
                far = True
                continue
            best, best_score = step
            far = False

    def run(self, even: list[int]) -> list[int]:
        seeds = [even]
        for make in (_stage_balanced, _rank_balanced):
            seed = make(self.model)
            if seed is not None and self.valid(seed) and seed not in seeds:
                seeds.append(seed)
        seeds.sort(key=lambda c: _Key(self, self.score(c)))
        results = [self.refine(seed) for seed in seeds]
        results.sort(key=lambda c: _Key(self, self.score(c)))
        return results[0]


class _Key:
    """A sort key from a score and ``_Search.better``."""

    __slots__ = ("score", "search")

    def __init__(self, search: _Search, score: tuple[float, float, float]) -> None:
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
) -> StagePlan:
    """Choose how many of the model's layers each of ``num_stages`` stages holds.

    layer_costs: per decoder layer, in model order, what one micro-batch costs there.
    num_microbatches: micro-batches per step (the costs are one micro-batch's).
    schedule: a name of ``graphpipe.schedules.SCHEDULES`` (``num_stages`` must be a multiple
        of its stages per rank), or ``"auto"``: the fastest of ``AUTO_SCHEDULES`` that fits
        ``memory_budget``.
    first_costs / last_costs: the embedding (stage 0) and the head with the loss (the last
        stage), which stay there whatever the split; None: nothing.
    memory_budget: bytes per rank; the plan's predicted peak on every rank must fit, or it
        raises ``MemoryBudgetExceeded`` (a ``ValueError``) naming the shortfall of the split
        that comes closest.
    p2p: seconds each cross-rank input arrives after it is computed.
    tied_parameter_bytes: parameter bytes that ``first_costs`` and ``last_costs`` both count
        (a tied embedding and head), held once by a rank that holds both stages.

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
    if memory_budget is not None and (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, (int, float))
        or not memory_budget > 0
    ):
        raise ValueError(f"memory_budget must be a number of bytes > 0, got {memory_budget!r}")
    if isinstance(p2p, bool) or not isinstance(p2p, (int, float)) or not p2p >= 0:
        raise ValueError(f"p2p must be a number of seconds >= 0, got {p2p!r}")
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
        plans.append(_plan(model, memory_budget))
    if not plans:
        raise ValueError('schedule="auto": no schedule runs here: ' + "; ".join(refused))
    fitting = [
        p for p in plans if memory_budget is None or max(p.peak_memory_bytes) <= memory_budget
    ]
    if not fitting:
        closest = min(plans, key=lambda p: max(p.peak_memory_bytes))
        peaks = closest.peak_memory_bytes
        rank = max(range(len(peaks)), key=peaks.__getitem__)
        short = peaks[rank] - memory_budget
        raise MemoryBudgetExceeded(
            f"no split fits memory_budget={memory_budget:.0f} bytes: the closest "
            f"({closest.schedule}, {closest.num_microbatches} micro-batches, layers per stage "
            f"{list(closest.layers_per_stage)}) needs {peaks[rank]} bytes on rank {rank}, "
            f"{short:.0f} bytes ({short / 2**20:.1f} MiB) more than the budget",
            closest,
            short,
        )
    return min(fitting, key=lambda p: p.predicted_step_s)


def _plan(model: _Model, memory_budget: float | None) -> StagePlan:
    even = layers_per_stage(model.num_layers, model.num_stages)
    search = _Search(model, memory_budget)
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
        memory_budget=None if memory_budget is None else round(memory_budget),
        simulations=len(search.cache),
    )


def predict_step(
    stage_costs: Sequence[Costs], *, num_microbatches: int, schedule: str = "dualpipev"
) -> float:
    """The simulated step of a split given by each stage's costs (``StagePlan.stage_costs``,
    or costs measured some other way; ``p2p`` is the first stage's), by the same dataflow
    timing the planner judges splits with: what ``StagePlan.predicted_step_s`` is for the
    plan's own costs."""
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
