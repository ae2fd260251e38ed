"""From ranges to the answer: per-rank step, busy, idle, bubble and communication wait, and
the simulator's prediction from the measured action costs.

Per rank and per analysed step (the last ``steps`` ``step`` ranges of every rank; a
profiled run holds exactly those):

* ``step_s``: the ``step`` range;
* ``busy_s``: the union of the compute-action ranges, clipped to the step;
* ``idle_s = step_s - busy_s`` (busy + idle = step up to float rounding);
* ``comm_wait_s``: the union of the ``wait ...`` ranges inside the step; of it,
  ``comm_wait_outside_actions_s`` falls outside every action range (waiting while idle);
* ``actions``: seconds per action name; ``other_ranges_s``: seconds per other range name.

The report gives the mean over the analysed steps of these per-step figures. A rank whose
steps hold no action range (a whole-step CUDA graph: ``capture="step"``) shows only
``step_s``: the other figures are None and a note says so.

The simulation costs each action at the median measured duration of its op on its stage (F,
B, I, W; an overlapped F&B pair whose backward is a full B: the median of that pair of
stages), with no P2P cost (``MeasuredCosts``), and runs the schedule's generator, ``lower``
and ``simulate`` with it.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.ir import Action, Op
from graphpipe.schedule.lower import lower
from graphpipe.schedule.simulate import SimResult, simulate
from graphpipe.schedule.validate import ScheduleError

from .ranges import Kind, Range, action_of

__all__ = ["Analysis", "MeasuredCosts", "StepFigures", "analyse", "measured_costs", "step_figures"]

_Spans = list[tuple[float, float]]


def _union(spans: _Spans) -> _Spans:
    """Sorted, disjoint spans covering the same time as ``spans``."""
    out: _Spans = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(spans: _Spans) -> float:
    return sum(e - s for s, e in spans)


def _minus(spans: _Spans, cut: _Spans) -> _Spans:
    """``spans`` without ``cut`` (both disjoint and sorted)."""
    out: _Spans = []
    for s, e in spans:
        for cs, ce in cut:
            if ce <= s or cs >= e:
                continue
            if cs > s:
                out.append((s, cs))
            s = max(s, ce)
        if e > s:
            out.append((s, e))
    return out


@dataclass(frozen=True)
class StepFigures:
    """One step of one rank (seconds); see the module doc."""

    step: Range
    busy_s: float
    comm_wait_s: float
    comm_wait_outside_actions_s: float
    actions: dict[str, float]
    other_ranges_s: dict[str, float]
    inside: tuple[Range, ...] = field(repr=False)  # the actions and waits, clipped

    @property
    def step_s(self) -> float:
        return self.step.seconds

    @property
    def has_actions(self) -> bool:
        return bool(self.actions)


def step_figures(step: Range, ranges: Sequence[Range]) -> StepFigures:
    """The figures of ``step`` from the rank's ``ranges`` (any order, any thread)."""
    busy: _Spans = []
    waits: _Spans = []
    actions: dict[str, float] = defaultdict(float)
    other: dict[str, float] = defaultdict(float)
    inside: list[Range] = []
    for r in ranges:
        s, e = max(r.start, step.start), min(r.end, step.end)
        if e < s or (e == s and r.start != r.end) or r is step:
            continue
        kind = r.kind
        if kind is Kind.ACTION:
            busy.append((s, e))
            actions[r.name] += e - s
        elif kind is Kind.WAIT:
            waits.append((s, e))
        elif kind is Kind.OTHER:
            other[r.name] += e - s
        else:
            continue  # another step range overlapping this one: not ours
        if kind in (Kind.ACTION, Kind.WAIT):
            inside.append(Range(r.rank, r.name, s, e, r.thread))
    busy_u, wait_u = _union(busy), _union(waits)
    return StepFigures(
        step=step,
        busy_s=_length(busy_u),
        comm_wait_s=_length(wait_u),
        comm_wait_outside_actions_s=_length(_minus(wait_u, busy_u)),
        actions=dict(actions),
        other_ranges_s=dict(other),
        inside=tuple(inside),
    )


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


@dataclass
class Analysis:
    """What ``analyse`` found: ``report`` is the JSON-ready report; ``steps[rank]`` the
    analysed steps' figures; ``picture_step`` the index (into those) of the step the
    timeline shows; ``simulation`` the simulator's result (None when unavailable) and
    ``costs`` the costs it ran with."""

    report: dict[str, Any]
    steps: dict[int, list[StepFigures]]
    picture_step: int
    simulation: SimResult | None
    costs: MeasuredCosts | None


def _rank_report(rank: int, figures: list[StepFigures]) -> dict[str, Any]:
    step_s = _mean([f.step_s for f in figures])
    wait = _mean([f.comm_wait_s for f in figures])
    wait_out = _mean([f.comm_wait_outside_actions_s for f in figures])
    other: dict[str, float] = defaultdict(float)
    for f in figures:
        for name, sec in f.other_ranges_s.items():
            other[name] += sec / len(figures)
    out: dict[str, Any] = {
        "rank": rank,
        "step_s": step_s,
        "busy_s": None,
        "idle_s": None,
        "bubble_fraction": None,
        "comm_wait_s": wait,
        "comm_wait_outside_actions_s": wait_out,
        "actions": {},
        "other_ranges_s": dict(sorted(other.items())),
        "visible": "step",
    }
    if all(f.has_actions for f in figures):
        busy = _mean([f.busy_s for f in figures])
        actions: dict[str, float] = defaultdict(float)
        for f in figures:
            for name, sec in f.actions.items():
                actions[name] += sec / len(figures)
        idle = step_s - busy
        out.update(
            busy_s=busy,
            idle_s=idle,
            bubble_fraction=idle / step_s if step_s > 0 else 0.0,
            actions=dict(actions),
            visible="actions",
        )
    return out


@dataclass(frozen=True)
class MeasuredCosts:
    """A cost model from measured durations, usable wherever ``simulate.Costs`` is (it has
    ``of`` and ``p2p``): the median seconds per (stage, op), per overlapped pair of stages
    (with a full B), and per op over all stages for a stage that never ran that op.

    per_stage: stage -> op (``F``, ``B``, ``I``, ``W``) -> median seconds.
    pairs: (forward stage, backward stage) -> median seconds of that overlapped F&B pair.
    overall: op (``F``, ``B``, ``I``, ``W``, ``FB``) -> median seconds over every stage.
    samples: op -> how many ranges the medians come from.
    p2p: seconds per communication batch (0: not measured).
    """

    per_stage: dict[int, dict[str, float]]
    pairs: dict[tuple[int, int], float]
    overall: dict[str, float]
    samples: dict[str, int]
    p2p: float = 0.0

    def of(self, action: Action | None) -> float:
        """Seconds of one compute cell (None, the final flush: 0)."""
        if action is None:
            return 0.0
        if action.op is Op.OVERLAP_F_B:
            forward, backward = action.parts()
            pair = (forward.stage, backward.stage)
            if backward.op is Op.B and pair in self.pairs:
                return self.pairs[pair]
            return self.of(forward) + self.of(backward)
        op = action.op.value
        return self.per_stage.get(action.stage, {}).get(op, self.overall.get(op, 0.0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "costs_s": {k: self.overall.get(k) for k in ("F", "B", "I", "W", "FB")},
            "stage_costs_s": {
                str(s): {op: c[op] for op in "FBIW" if op in c}
                for s, c in sorted(self.per_stage.items())
            },
            "overlap_pair_costs_s": {f"{f},{b}": sec for (f, b), sec in sorted(self.pairs.items())},
            "cost_samples": self.samples,
            "p2p_s": self.p2p,
        }


def measured_costs(steps: Mapping[int, Sequence[StepFigures]]) -> MeasuredCosts:
    """The medians of every analysed action range, per stage and op (see ``MeasuredCosts``)."""
    per_stage: dict[tuple[int, str], list[float]] = defaultdict(list)
    pairs: dict[tuple[int, int], list[float]] = defaultdict(list)
    overall: dict[str, list[float]] = defaultdict(list)
    for figures in steps.values():
        for f in figures:
            for name, sec in f.actions.items():
                action = action_of(name)
                if action is None:
                    continue
                if action.op is Op.OVERLAP_F_B:
                    forward, backward = action.parts()
                    if backward.op is Op.B:  # with I, the pair costs F + I
                        pairs[(forward.stage, backward.stage)].append(sec)
                        overall["FB"].append(sec)
                else:
                    per_stage[(action.stage, action.op.value)].append(sec)
                    overall[action.op.value].append(sec)
    stages: dict[int, dict[str, float]] = defaultdict(dict)
    for (stage, op), secs in per_stage.items():
        stages[stage][op] = statistics.median(secs)
    return MeasuredCosts(
        per_stage=dict(stages),
        pairs={k: statistics.median(v) for k, v in pairs.items()},
        overall={k: statistics.median(v) for k, v in overall.items()},
        samples={k: len(overall.get(k, ())) for k in ("F", "B", "I", "W", "FB")},
    )


def _simulated(
    steps: Mapping[int, list[StepFigures]], schedule: str, n: int, m: int | None
) -> tuple[dict[str, Any], SimResult | None, MeasuredCosts | None]:
    if not all(f.has_actions for figures in steps.values() for f in figures):
        return (
            {
                "available": False,
                "note": "no per-action ranges in every analysed step (only the whole step is "
                "visible): no measured action costs to simulate with",
            },
            None,
            None,
        )
    if m is None:
        return {"available": False, "note": "the number of micro-batches is unknown"}, None, None
    costs = measured_costs(steps)
    kind = SCHEDULES[schedule]
    try:
        sched, placement = kind(n, m)
        result = simulate(lower(sched, placement, durations=costs.of), placement, costs)
    except (ScheduleError, ValueError) as e:
        return (
            {"available": False, "note": f"cannot simulate {schedule} N={n} M={m}: {e}"},
            None,
            None,
        )
    worst = max(_mean([f.step_s for f in figs]) for figs in steps.values())
    sim = {
        "available": True,
        "schedule": schedule,
        **costs.as_dict(),
        "makespan_s": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "per_rank": [
            {
                "rank": r.rank,
                "busy_s": r.busy,
                "idle_s": r.idle,
                "bubble_fraction": r.bubble_fraction,
            }
            for r in result.ranks
        ],
        "measured_step_over_simulated": worst / result.makespan if result.makespan > 0 else None,
        "note": "each action costs the median of its op's measured durations on its stage "
        "(an overlapped pair: on its pair of stages) over the analysed steps; communication "
        "costs nothing here (p2p=0), so measured - simulated is the time lost to "
        "communication and to everything else outside the actions",
    }
    return sim, result, costs


def _check_schedule(
    steps: Mapping[int, list[StepFigures]], schedule: str, n: int, m: int | None
) -> list[str]:
    """Notes where a rank's actions differ from what the schedule gives it."""
    if m is None:
        return []
    try:
        sched, _ = SCHEDULES[schedule](n, m)
    except ValueError:
        return []
    notes = []
    for rank, figures in sorted(steps.items()):
        want = {str(a) for a in sched.get(rank, [])}
        for k, f in enumerate(figures):
            if not f.has_actions:
                continue
            got = set(f.actions)
            if got != want:
                missing, extra = sorted(want - got), sorted(got - want)
                notes.append(
                    f"rank {rank}, analysed step {k}: actions differ from {schedule} N={n} "
                    f"M={m}: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                    f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}"
                )
                break
    return notes


def _microbatches(by_rank: Mapping[int, Sequence[Range]]) -> int | None:
    seen = [
        p.microbatch
        for ranges in by_rank.values()
        for r in ranges
        if r.kind is Kind.ACTION
        for p in action_of(r.name).parts()
    ]
    return max(seen) + 1 if seen else None


def analyse(
    by_rank: Mapping[int, Sequence[Range]],
    *,
    steps: int | None = None,
    schedule: str = "dualpipev",
    microbatches: int | None = None,
    source: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> Analysis:
    """The report for the ranges of ranks ``0..N-1`` (``by_rank``).

    steps: analyse the last ``steps`` step ranges of every rank (default: all).
    schedule: the schedule that ran (a key of ``generators.SCHEDULES``).
    microbatches: M; default: one more than the largest micro-batch in the action names.
    source: what the ranges were read from, copied into the report.
    notes: lines to start the report's notes with.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {sorted(SCHEDULES)}")
    n = len(by_rank)
    if sorted(by_rank) != list(range(n)):
        raise ValueError(f"ranks must be 0..{n - 1}, got {sorted(by_rank)}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    notes = list(notes)
    per_rank_steps: dict[int, list[Range]] = {}
    for rank, ranges in by_rank.items():
        found = sorted((r for r in ranges if r.kind is Kind.STEP), key=lambda r: r.start)
        if not found:
            raise ValueError(f"rank {rank} has no {'step'!r} range: nothing to analyse")
        per_rank_steps[rank] = found
    count = min(len(s) for s in per_rank_steps.values())
    if steps is not None:
        count = min(count, steps)
        if count < steps:
            notes.append(f"only {count} step(s) on some rank: analysed {count}, not {steps}")
    elif len({len(s) for s in per_rank_steps.values()}) > 1:
        notes.append(f"ranks hold different numbers of steps: analysed the last {count} of each")
    figures = {
        rank: [step_figures(s, by_rank[rank]) for s in found[-count:]]
        for rank, found in per_rank_steps.items()
    }
    m = microbatches if microbatches is not None else _microbatches(by_rank)
    per_rank = [_rank_report(r, figures[r]) for r in range(n)]
    step_only = [p["rank"] for p in per_rank if p["visible"] == "step"]
    if step_only:
        notes.append(
            f"ranks {step_only}: only the whole step is visible (no action ranges inside the "
            "step, as with capture='step' on CUDA, where one graph replays the whole step): "
            "busy, idle, bubble and per-action figures are not measured"
        )
    waits = any(p["comm_wait_s"] > 0 for p in per_rank) or any(
        r.kind is Kind.WAIT for ranges in by_rank.values() for r in ranges
    )
    if not waits:
        notes.append(
            "no 'wait ...' ranges found: comm_wait_s is 0 because the runtime did not mark "
            "its communication waits, not because it never waited"
        )
    notes += _check_schedule(figures, schedule, n, m)
    simulated, result, costs = _simulated(figures, schedule, n, m)
    # the step the picture shows: the one whose slowest rank is the median over the steps
    slowest = [max(figures[r][k].step_s for r in figures) for k in range(count)]
    picture = sorted(range(count), key=lambda k: slowest[k])[(count - 1) // 2]
    report = {
        "ranks": n,
        "microbatches": m,
        "schedule": schedule,
        "source": dict(source or {}),
        "steps_analysed": count,
        "averaging": "mean over the analysed steps of each step's figures (the last "
        f"{count} step range(s) of every rank)",
        "comm_wait_ranges_found": waits,
        "per_rank": per_rank,
        "simulated": simulated,
        "timeline_step": picture,
        "notes": notes,
    }
    return Analysis(report, figures, picture, result, costs)
