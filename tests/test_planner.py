"""The stage planner (graphpipe.schedule.planner): splits whose optimum is known by hand, the
invariants of every plan, memory budgets and refusals. No timings: every cost is synthetic."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.planner import (
    AUTO_SCHEDULES,
    LayerCost,
    StagePlan,
    plan_stages,
)
from graphpipe.schedule.simulate import Costs, figures
from graphpipe.schedule.splits import layers_per_stage

LAYER = LayerCost(1.0, 1.0, 1.0)  # F = 1, I = 1, W = 1, so B = 2


def _exhaustive_best(layers, first, last, num_stages, m, schedule) -> float:
    """The shortest predicted step over every valid split (small cases only)."""
    best = None
    n = len(layers)
    for cuts in itertools.combinations_with_replacement(range(n + 1), num_stages - 1):
        bounds = [0, *cuts, n]
        counts = [bounds[i + 1] - bounds[i] for i in range(num_stages)]
        if any(c < 1 for c in counts[1:-1]):
            continue
        plan = _fixed(layers, first, last, counts, m, schedule)
        best = plan if best is None else min(best, plan)
    return best


def _fixed(layers, first, last, counts, m, schedule) -> float:
    """The predicted step of one split: the planner's own evaluation of it."""
    from graphpipe.schedule.planner import _Model

    kind = SCHEDULES[schedule]
    model = _Model(kind, len(counts) // kind.stages_per_rank, m, layers, first, last, 0.0, 0)
    return model.makespan(model.stage_vectors(counts))


def test_one_f_one_b_with_a_heavy_head_takes_the_known_optimum() -> None:
    # Two stages, 6 layers (F=1, B=2 each), the head worth 2 layers: (4, 2) gives both stages
    # F=4, B=8, and 1F1B of equal stages takes (M + S - 1)(F + B) = 5 * 12 = 60. The even
    # split (3, 3) leaves stage 1 at F=5, B=10: F0 + M (F1 + B1) + B0 = 3 + 60 + 6 = 69.
    plan = plan_stages([LAYER] * 6, 2, num_microbatches=4, schedule="1f1b", last_costs=LAYER_2)
    assert plan.layers_per_stage == (4, 2)
    assert plan.predicted_step_s == 60.0
    assert plan.even_layers_per_stage == (3, 3)
    assert plan.even_predicted_step_s == 69.0
    assert plan.stage_costs == (Costs(F=4, B=8, I=4, W=4), Costs(F=4, B=8, I=4, W=4))
    assert plan.speedup == pytest.approx(69 / 60)
    assert plan.num_ranks == 2 and plan.schedule == "1f1b"


LAYER_2 = LayerCost(2.0, 2.0, 2.0)


@pytest.mark.parametrize(("schedule", "n", "m"), [("dualpipev", 2, 8), ("zbv", 3, 6)])
def test_uniform_layers_keep_the_even_split_and_the_uniform_simulation(schedule, n, m) -> None:
    kind = SCHEDULES[schedule]
    stages = kind.num_stages(n)
    plan = plan_stages([LAYER] * (3 * stages), stages, num_microbatches=m, schedule=schedule)
    assert list(plan.layers_per_stage) == layers_per_stage(3 * stages, stages)
    uniform = figures(kind.cells(n, m), kind.placement(n), m, Costs(F=3, B=6, I=3, W=3))
    assert plan.predicted_step_s == pytest.approx(uniform.makespan, rel=1e-12)
    assert plan.predicted_step_s == plan.even_predicted_step_s


def test_dualpipev_with_a_head_worth_eight_layers_finds_the_exhaustive_optimum() -> None:
    # The model in layer units: 12 layers, the head (on rank 0 with the embedding)
    # about 8 layers of work. Rank 0 should hold few layers; the exhaustive search says which.
    head = LayerCost(8.0, 8.0, 8.0)
    plan = plan_stages([LAYER] * 12, 4, num_microbatches=8, last_costs=head)
    best = _exhaustive_best([LAYER] * 12, LayerCost(0, 0, 0), head, 4, 8, "dualpipev")
    assert plan.predicted_step_s == best
    assert plan.predicted_step_s < plan.even_predicted_step_s
    assert sum(plan.layers_per_stage) == 12
    work = [c.F + c.B for c in plan.stage_costs]
    assert work[0] + work[3] == work[1] + work[2]  # both ranks carry 30 units


@pytest.mark.parametrize("seed", range(8))
def test_random_costs_plan_within_half_a_percent_of_the_exhaustive_optimum(seed: int) -> None:
    """The search is local (module doc): on small random cases it lands within 0.5% of the
    best split, never worse than the even split, and the plan is a valid split."""
    rnd = random.Random(seed)
    schedule = ("dualpipev", "zbv", "1f1b")[seed % 3]
    stages = 4
    m = 8
    n_layers = rnd.randint(4, 10)
    layers = [
        LayerCost(rnd.uniform(0.5, 2), rnd.uniform(0.5, 2), rnd.uniform(0.2, 2))
        for _ in range(n_layers)
    ]
    first = LayerCost(rnd.uniform(0, 1), rnd.uniform(0, 1), 0.0)
    last = LayerCost(rnd.uniform(0, 8), rnd.uniform(0, 8), rnd.uniform(0, 8))
    plan = plan_stages(
        layers,
        stages,
        num_microbatches=m,
        schedule=schedule,
        first_costs=first,
        last_costs=last,
    )
    best = _exhaustive_best(layers, first, last, stages, m, schedule)
    assert plan.predicted_step_s <= best * 1.005
    assert plan.predicted_step_s <= plan.even_predicted_step_s
    assert sum(plan.layers_per_stage) == n_layers
    assert all(c >= 1 for c in plan.layers_per_stage[1:-1])
    assert plan.predicted_step_s == _fixed(layers, first, last, plan.layers_per_stage, m, schedule)


def test_eighty_layers_over_sixteen_stages_plan_in_a_bounded_number_of_simulations() -> None:
    rnd = random.Random(0)
    layers = [LayerCost(rnd.uniform(1, 2), rnd.uniform(1, 2), rnd.uniform(1, 2)) for _ in range(80)]
    plan = plan_stages(
        layers, 16, num_microbatches=32, first_costs=LAYER, last_costs=LayerCost(6, 6, 6)
    )
    assert sum(plan.layers_per_stage) == 80 and len(plan.layers_per_stage) == 16
    assert plan.predicted_step_s < plan.even_predicted_step_s
    # every split is simulated once; docs/planning.md quotes the time this takes
    assert plan.simulations < 5000


def test_peak_memory_counts_parameters_and_the_activations_in_flight() -> None:
    # 1F1B on 2 ranks: rank 0 has 2 micro-batches in flight at most, rank 1 one.
    layer = LayerCost(1.0, 1.0, 1.0, activation_bytes=10, parameter_bytes=1000)
    plan = plan_stages([layer] * 6, 2, num_microbatches=4, schedule="1f1b", last_costs=LAYER_2)
    assert plan.layers_per_stage == (4, 2)
    assert plan.peak_memory_bytes == (4000 + 2 * 40, 2000 + 20)
    assert plan.even_peak_memory_bytes == (3000 + 2 * 30, 3000 + 30)


@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
def test_held_bytes_follow_the_simulators_peak_activations_and_pending_w(schedule) -> None:
    # One layer per stage: activation bytes are held from F to B/I, weight-grad bytes from I
    # to W, so the peaks are the simulator's counts of each, times the bytes.
    kind = SCHEDULES[schedule]
    stats = figures(kind.cells(2, 8), kind.placement(2), 8).ranks
    acts = plan_stages(
        [LayerCost(1, 1, 1, activation_bytes=10)] * 4, 4, num_microbatches=8, schedule=schedule
    )
    assert acts.layers_per_stage == (1, 1, 1, 1)
    assert acts.peak_memory_bytes == tuple(10 * r.peak_activations for r in stats)
    held = plan_stages(
        [LayerCost(1, 1, 1, weight_grad_bytes=1000)] * 4, 4, num_microbatches=8, schedule=schedule
    )
    assert held.peak_memory_bytes == tuple(1000 * r.peak_pending_w for r in stats)
    assert max(r.peak_pending_w for r in stats) >= 1


def test_a_tied_weight_is_held_once_by_the_rank_of_the_first_and_last_stage() -> None:
    embed = LayerCost(0.0, 0.0, 0.0, parameter_bytes=500)
    kwargs = {"num_microbatches": 4, "first_costs": embed, "last_costs": embed}
    v = plan_stages([LAYER] * 4, 4, schedule="dualpipev", tied_parameter_bytes=500, **kwargs)
    untied = plan_stages([LAYER] * 4, 4, schedule="dualpipev", **kwargs)
    assert v.peak_memory_bytes[0] == untied.peak_memory_bytes[0] - 500
    loop = plan_stages([LAYER] * 4, 4, schedule="1f1b", tied_parameter_bytes=500, **kwargs)
    assert loop.peak_memory_bytes[0] == 500 and loop.peak_memory_bytes[3] == 500


def test_a_memory_budget_moves_layers_off_the_full_rank_or_refuses_naming_the_shortfall() -> None:
    layer = LayerCost(1.0, 1.0, 1.0, activation_bytes=10, parameter_bytes=1000)
    kwargs = {"num_microbatches": 4, "schedule": "1f1b", "last_costs": LAYER_2}
    plan = plan_stages([layer] * 6, 2, memory_budget=3500, **kwargs)
    assert plan.layers_per_stage == (3, 3)  # (4, 2) is faster but needs 4080 bytes on rank 0
    assert plan.predicted_step_s == 69.0
    assert max(plan.peak_memory_bytes) <= 3500 and plan.memory_budget == 3500
    with pytest.raises(ValueError) as info:
        plan_stages([layer] * 6, 2, memory_budget=2500, **kwargs)
    message = str(info.value)
    assert "no split fits memory_budget=2500 bytes" in message
    assert "layers per stage [3, 3]) needs 3060 bytes on rank 0, 560 bytes" in message


def test_auto_chooses_the_fastest_schedule_that_fits() -> None:
    layer = LayerCost(1.0, 1.0, 1.0, activation_bytes=10, weight_grad_bytes=5)
    plans = {s: plan_stages([layer] * 8, 4, num_microbatches=8, schedule=s) for s in AUTO_SCHEDULES}
    auto = plan_stages([layer] * 8, 4, num_microbatches=8, schedule="auto")
    fastest = min(plans.values(), key=lambda p: p.predicted_step_s)
    assert auto.schedule == fastest.schedule
    assert auto.predicted_step_s == fastest.predicted_step_s
    slower = max(plans.values(), key=lambda p: p.predicted_step_s)
    budget = max(slower.peak_memory_bytes)
    if max(fastest.peak_memory_bytes) > budget:  # only the slower one fits: auto takes it
        assert (
            plan_stages(
                [layer] * 8, 4, num_microbatches=8, schedule="auto", memory_budget=budget
            ).schedule
            == slower.schedule
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 0}, r"num_stages must be an int >= 1, got num_stages=0"),
        ({"num_microbatches": 0}, r"num_microbatches must be an int >= 1"),
        ({"schedule": "gpipe"}, r"unknown schedule 'gpipe'"),
        ({"schedule": "auto", "num_stages": 3}, r"num_stages=3 is odd"),
        ({"num_stages": 3}, r"dualpipev places 2 stages on each rank: num_stages=3"),
        ({"num_stages": 16}, r"4 layers are too few for num_stages=16"),
        ({"num_microbatches": 2}, r"num_microbatches must be >= 2 \* num_ranks = 4"),
        ({"memory_budget": -1}, r"memory_budget must be a finite number of bytes >= 1, got -1"),
        ({"memory_budget": float("inf")}, r"memory_budget must be a finite number .*, got inf"),
        ({"memory_budget": float("nan")}, r"memory_budget must be a finite number .*, got nan"),
        ({"p2p": float("inf")}, r"p2p must be a finite number of seconds >= 0, got inf"),
        ({"p2p": -1.0}, r"p2p must be a finite number of seconds >= 0, got -1.0"),
        ({"tie_margin": 1.5}, r"tie_margin must be a fraction in \[0, 1\), got 1.5"),
        ({"first_costs": 3.0}, r"first_costs must be a LayerCost or None, got float"),
        ({"layer_costs": [LAYER, 1.0]}, r"layer_costs\[1\] must be a LayerCost, got float"),
    ],
)
def test_bad_input_is_refused_naming_the_value(kwargs: dict, match: str) -> None:
    args = {"layer_costs": [LAYER] * 4, "num_stages": 4, "num_microbatches": 8} | kwargs
    with pytest.raises(ValueError, match=match):
        plan_stages(**args)


def test_a_layer_cost_must_be_finite_and_non_negative() -> None:
    with pytest.raises(ValueError, match=r"LayerCost.forward must be finite and >= 0, got -1"):
        LayerCost(-1, 0, 0)
    with pytest.raises(ValueError, match=r"LayerCost.backward_weight must be finite"):
        LayerCost(0, 0, float("nan"))
    assert LayerCost(1, 2, 3).full_backward == 5
    assert LayerCost(1, 2, 3, backward=4).full_backward == 4


def test_a_plan_prints_beside_the_even_split_and_as_json_data() -> None:
    plan = plan_stages([LAYER] * 6, 2, num_microbatches=4, schedule="1f1b", last_costs=LAYER_2)
    assert isinstance(plan, StagePlan)
    text = plan.format(unit="s", scale=1.0)
    assert "1f1b: 2 ranks, 2 stages, 4 micro-batches" in text
    assert "planned 4,2" in text and "even    3,3" in text
    data = plan.as_dict()
    assert data["layers_per_stage"] == [4, 2] and data["even_predicted_step_s"] == 69.0
    assert data["stage_costs"][0] == {"F": 4.0, "B": 8.0, "I": 4.0, "W": 4.0, "p2p": 0.0}


@pytest.mark.parametrize("schedule", ["dualpipev", "zbv", "1f1b"])
def test_predict_step_of_a_plans_stage_costs_is_its_prediction(schedule: str) -> None:
    from dataclasses import replace

    from graphpipe.schedule.planner import predict_step

    layer = LayerCost(forward=1.0, backward_input=1.5, backward_weight=0.5)
    head = LayerCost(forward=6.0, backward_input=6.0, backward_weight=6.0)
    plan = plan_stages([layer] * 10, 4, num_microbatches=8, schedule=schedule, last_costs=head)
    assert predict_step(plan.stage_costs, num_microbatches=8, schedule=schedule) == (
        plan.predicted_step_s
    )
    assert predict_step(plan.even_stage_costs, num_microbatches=8, schedule=schedule) == (
        plan.even_predicted_step_s
    )
    # without latency the step scales with the costs (a power of two: exact in binary)
    doubled = [replace(c, F=2 * c.F, B=2 * c.B, I=2 * c.I, W=2 * c.W) for c in plan.stage_costs]
    assert predict_step(doubled, num_microbatches=8, schedule=schedule) == 2 * plan.predicted_step_s


def test_predict_step_refuses_a_stage_count_the_schedule_cannot_place() -> None:
    from graphpipe.schedule.planner import predict_step

    with pytest.raises(ValueError, match="2 stages on each rank: got 3 stage costs"):
        predict_step([Costs()] * 3, num_microbatches=8)
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        predict_step([Costs()] * 4, num_microbatches=8, schedule="nope")


@pytest.mark.parametrize("bad", [8.0, 0, True, "8"])
def test_predict_step_refuses_a_microbatch_count_that_is_not_a_positive_int(bad: object) -> None:
    """p07: ``num_microbatches=8.0`` failed inside numpy ("ufunc 'left_shift' not supported")."""
    from graphpipe.schedule.planner import predict_step

    with pytest.raises(
        ValueError, match=rf"^num_microbatches must be an int >= 1, got num_microbatches={bad!r}$"
    ):
        predict_step([Costs()] * 4, num_microbatches=bad)


# --------------------------------------------------------------------------------------------
# Memory budgets: which splits fit is decided exactly (issue 40, p01), and the tied bytes


def _every_split(n_layers: int, num_stages: int) -> list[list[int]]:
    out = []
    for cuts in itertools.combinations_with_replacement(range(n_layers + 1), num_stages - 1):
        bounds = [0, *cuts, n_layers]
        counts = [bounds[i + 1] - bounds[i] for i in range(num_stages)]
        if all(c >= 1 for c in counts[1:-1]):
            out.append(counts)
    return out


def test_the_one_split_that_fits_is_found_where_the_moves_do_not_lead() -> None:
    # 1F1B on 3 ranks holds 3, 2 and 1 micro-batches' activations on stages 0, 1 and 2: the
    # layer of 1 byte fits a budget of 1 byte on stage 2 only, and stage 1 needs a layer, so
    # [0, 1, 2] (the slowest split) is the one that fits. The moves rank the splits over the
    # budget by their excess, then by their step: from the seeds [1, 1, 1] and [1, 2, 0] they
    # stop at [1, 2, 0] (1 byte over, step 28), two moves from it, and the search said "no
    # split fits" before which splits fit was decided exactly.
    light, heavy = LayerCost(1, 1, 0), LayerCost(1, 1, 0, activation_bytes=1)
    plan = plan_stages(
        [light, heavy, light],
        3,
        num_microbatches=6,
        schedule="1f1b",
        first_costs=light,
        last_costs=light,
        memory_budget=1,
    )
    assert plan.layers_per_stage == (0, 1, 2)
    assert plan.peak_memory_bytes == (0, 0, 1)


def test_tied_bytes_beyond_the_parameters_are_refused_naming_the_value() -> None:
    embed = LayerCost(0.0, 0.0, 0.0, parameter_bytes=500)
    kwargs = {"num_microbatches": 4, "first_costs": embed, "last_costs": LAYER}
    with pytest.raises(ValueError, match=r"tied_parameter_bytes=1000 is more than first_costs"):
        plan_stages([LAYER] * 4, 4, tied_parameter_bytes=1000, **{**kwargs, "last_costs": embed})
    with pytest.raises(
        ValueError, match=r"tied_parameter_bytes=500 is more than last_costs.parameter_bytes=0"
    ):
        plan_stages([LAYER] * 4, 4, tied_parameter_bytes=500, **kwargs)


def test_bytes_are_whole_numbers() -> None:
    with pytest.raises(ValueError, match=r"LayerCost.activation_bytes must be a whole number"):
        LayerCost(1, 1, 1, activation_bytes=0.5)
    assert LayerCost(1, 1, 1, parameter_bytes=1e9).parameter_bytes == 1e9


# --------------------------------------------------------------------------------------------
# The search at scale (issue 40, p04): many splits simulated at once, with progress


@pytest.mark.parametrize(
    ("schedule", "ranks", "m", "p2p"),
    [("dualpipev", 4, 12, 0.25), ("zbv", 3, 7, 0.0), ("1f1b", 5, 9, 0.5)],
)
def test_splits_simulated_together_take_exactly_the_dataflow_timing(
    schedule, ranks, m, p2p
) -> None:
    from graphpipe.schedule.planner import _Model

    rnd = random.Random(ranks)
    layers = [
        LayerCost(rnd.uniform(0.5, 2), rnd.uniform(0.5, 2), rnd.uniform(0.2, 2), rnd.uniform(1, 3))
        for _ in range(20)
    ]
    kind = SCHEDULES[schedule]
    model = _Model(kind, ranks, m, layers, LAYER, LAYER_2, p2p, 0)
    stages = kind.num_stages(ranks)
    splits = rnd.sample(_every_split(20, stages), 40)
    vecs = model.stage_vectors_batch(np.asarray(splits))
    batch = model.makespan_batch(vecs)
    assert batch.tolist() == [model.makespan(v) for v in vecs]  # to the last bit


def test_progress_reports_the_best_step_and_a_bound_no_split_beats() -> None:
    from graphpipe.schedule.planner import PlanProgress

    rnd = random.Random(0)
    layers = [LayerCost(rnd.uniform(1, 2), rnd.uniform(1, 2), rnd.uniform(1, 2)) for _ in range(40)]
    seen: list[PlanProgress] = []
    plan = plan_stages(
        layers, 16, num_microbatches=32, last_costs=LayerCost(6, 6, 6), progress=seen.append
    )
    assert seen and all(p.schedule == "dualpipev" and p.num_microbatches == 32 for p in seen)
    assert [p.simulations for p in seen] == sorted(p.simulations for p in seen)
    assert seen[-1].best_step_s == plan.predicted_step_s
    assert all(p.bound_s <= plan.predicted_step_s for p in seen)
    assert seen[-1].bound_s > 0.5 * plan.predicted_step_s


@pytest.mark.parametrize("seed", range(12))
def test_no_split_beats_the_bound_progress_reports(seed: int) -> None:
    from graphpipe.schedule.planner import _Model

    rnd = random.Random(seed)
    schedule = ("dualpipev", "zbv", "1f1b")[seed % 3]
    kind = SCHEDULES[schedule]
    ranks = 1 + seed % 3
    stages = kind.num_stages(ranks)
    n_layers = rnd.randint(max(stages - 2, 0), 7)
    layers = [
        LayerCost(
            rnd.uniform(0, 2),
            rnd.uniform(0, 2),
            rnd.uniform(0, 2),
            backward=rnd.choice([None, rnd.uniform(0, 4)]),
        )
        for _ in range(n_layers)
    ]
    head = LayerCost(rnd.uniform(0, 8), rnd.uniform(0, 8), rnd.uniform(0, 8), backward=3.0)
    model = _Model(kind, ranks, 2 * ranks + 2, layers, LAYER, head, 0.25 * (seed % 2), 0)
    bound = model.step_bound()
    steps = [model.makespan(model.stage_vectors(c)) for c in _every_split(n_layers, stages)]
    assert bound <= min(steps) * (1 + 1e-12)


# --------------------------------------------------------------------------------------------
# Choosing among plans (issue 38): a stated rule, the reason printed with the numbers


def _plan_of(schedule: str, step: float, peak: int, even_peak: int | None = None) -> StagePlan:
    costs = (Costs(),) * 4
    even = peak if even_peak is None else even_peak
    split = (1, 1, 1, 1)
    return StagePlan(
        schedule, 2, 8, split, step, costs, (peak,) * 2, split, step, costs, (even,) * 2
    )


def test_choose_plan_takes_what_holds_least_within_the_tie_margin() -> None:
    from graphpipe.schedule.planner import choose_plan

    zbv, dualpipev = _plan_of("zbv", 1.00, 2**20), _plan_of("dualpipev", 0.99, 2**21)
    # DualPipeV is 1% faster: strictly the fastest, but within a 3% margin of ZB-V
    assert choose_plan([zbv, dualpipev]).schedule == "dualpipev"
    chosen = choose_plan([dualpipev, zbv], tie_margin=0.03)
    assert chosen.schedule == "zbv"  # in either order: the rule does not depend on it
    assert choose_plan([zbv, dualpipev], tie_margin=0.03).schedule == "zbv"
    assert chosen.choice() == (
        "of the 2 within the 3% tie margin of the fastest, the least memory on the even split"
    )
    text = chosen.format()
    assert "chosen: zbv with 8 micro-batches, of the 2 within the 3% tie margin" in text
    assert "dualpipev, 8 micro-batches" in text and "-1.0%" in text
    far = _plan_of("dualpipev", 0.9, 2**21)
    assert choose_plan([zbv, far], tie_margin=0.03).choice() == (
        "the fastest, by more than the 3% tie margin"
    )
    # the even split's bytes decide before the plan's own (those follow the measured costs)
    a, b = _plan_of("zbv", 1.0, 2**22, even_peak=2**20), _plan_of("dualpipev", 1.0, 2**21, 2**21)
    assert choose_plan([b, a], tie_margin=0.03).schedule == "zbv"


def test_auto_with_a_margin_prefers_the_schedule_that_holds_less() -> None:
    # a full backward cheaper than I + W: DualPipeV (mostly B) is 12% faster than ZB-V (all
    # I and W), and holds more activations
    layer = LayerCost(1.0, 1.0, 1.0, backward=1.5, activation_bytes=10, weight_grad_bytes=5)
    plans = {s: plan_stages([layer] * 8, 4, num_microbatches=8, schedule=s) for s in AUTO_SCHEDULES}
    assert plans["dualpipev"].predicted_step_s < plans["zbv"].predicted_step_s
    assert max(plans["dualpipev"].even_peak_memory_bytes) > max(plans["zbv"].even_peak_memory_bytes)
    fastest = plan_stages([layer] * 8, 4, num_microbatches=8, schedule="auto")
    assert fastest.schedule == "dualpipev" and fastest.choice() == "the fastest"
    tied = plan_stages([layer] * 8, 4, num_microbatches=8, schedule="auto", tie_margin=0.2)
    assert tied.schedule == "zbv"
    assert {c.schedule for c in tied.candidates} == set(AUTO_SCHEDULES)
    assert tied.tie_margin == 0.2 and tied.as_dict()["candidates"][0]["schedule"] == "dualpipev"


def test_the_memory_check_stays_exact_where_the_splits_are_astronomically_many() -> None:
    # 160 layers over 40 stages: the ways to a position run past 1e30, where counting them in
    # floating point lost the small counts beside the large ones (1.2 million splits fitting
    # a budget none fits, positions marked reachable that were not). They are counted in
    # integers up to _MANY (saturating).
    from graphpipe.schedule.planner import _MANY, _Fitting, _Model

    rnd = random.Random(0)
    layers = [
        LayerCost(
            1,
            1,
            1,
            activation_bytes=rnd.randint(10**6, 2 * 10**6),
            weight_grad_bytes=rnd.randint(10**5, 10**6),
            parameter_bytes=rnd.randint(10**7, 2 * 10**7),
        )
        for _ in range(160)
    ]
    first = LayerCost(1, 1, 1, parameter_bytes=10**8)
    last = LayerCost(6, 6, 6, activation_bytes=10**7, parameter_bytes=10**8)
    model = _Model(SCHEDULES["dualpipev"], 20, 80, layers, first, last, 0.0, 0)
    # the least budget any split fits (bisection with this check): the 243 splits that fit
    # it hold exactly that on their fullest rank, by the peaks' own accounting
    least = 284_940_362
    assert _Fitting(model, least - 1).count == 0
    assert _Fitting(model, least - 1).splits(1) == []
    fitting = _Fitting(model, least)
    assert fitting.count == 243
    found = fitting.splits(1000)
    assert len({tuple(c) for c in found}) == 243
    vecs = model.stage_vectors_batch(np.asarray(found))
    assert (model.peaks_batch(vecs).max(axis=1) == least).all()
    assert _Fitting(model, least + 10**6).count == _MANY
