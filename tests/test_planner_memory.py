"""The planner's memory check against brute force over every split, on drawn cases
(hypothesis; skipped where it is not installed, as on the GPU image)."""

from __future__ import annotations

import pytest

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.planner import LayerCost, MemoryBudgetExceeded, plan_stages
from tests.test_planner import _every_split

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis")
st = hypothesis.strategies


@st.composite
def _memory_cases(draw) -> dict:
    """A small model with bytes, a schedule and a budget drawn among its splits' own peaks
    (so that some fit, or, one byte below the least, none)."""
    schedule = draw(st.sampled_from(["dualpipev", "zbv", "1f1b"]))
    kind = SCHEDULES[schedule]
    ranks = draw(st.integers(1, 3))
    stages = kind.num_stages(ranks)
    n_layers = draw(st.integers(max(stages - 2, 0), 7))
    m = draw(st.integers(2 * ranks, 2 * ranks + 3))
    small = st.integers(0, 100)

    def cost(**kw) -> LayerCost:
        return LayerCost(
            draw(st.floats(0.5, 2)), draw(st.floats(0.5, 2)), draw(st.floats(0, 2)), **kw
        )

    layers = [
        cost(
            activation_bytes=draw(small),
            weight_grad_bytes=draw(small),
            parameter_bytes=draw(st.integers(0, 1000)),
        )
        for _ in range(n_layers)
    ]
    first = cost(activation_bytes=draw(small), parameter_bytes=draw(st.integers(0, 1000)))
    last = cost(
        activation_bytes=draw(st.integers(0, 400)),
        weight_grad_bytes=draw(small),
        parameter_bytes=draw(st.integers(0, 1000)),
    )
    tied = draw(st.integers(0, min(first.parameter_bytes, last.parameter_bytes)))
    return {
        "layers": layers,
        "first": first,
        "last": last,
        "stages": stages,
        "ranks": ranks,
        "m": m,
        "schedule": schedule,
        "tied": tied,
        "pick": draw(st.floats(-0.01, 1)),  # where the budget falls among the peaks
    }


def _brute_force(case: dict) -> tuple[int, list[tuple[list[int], int, float]]]:
    """The budget of the case and, for every valid split, its peak (the fullest rank's, by
    the planner's own accounting) and its step."""
    from graphpipe.schedule.planner import _Model

    kind = SCHEDULES[case["schedule"]]
    model = _Model(
        kind,
        case["ranks"],
        case["m"],
        case["layers"],
        case["first"],
        case["last"],
        0.0,
        case["tied"],
    )
    rows = []
    for counts in _every_split(len(case["layers"]), case["stages"]):
        vec = model.stage_vectors(counts)
        rows.append((counts, max(model.peaks(vec)), model.makespan(vec)))
    peaks = sorted({peak for _, peak, _ in rows})
    pick = case["pick"]
    budget = peaks[0] - 1 if pick < 0 else peaks[min(int(pick * len(peaks)), len(peaks) - 1)]
    return max(budget, 1), rows


@hypothesis.settings(
    max_examples=150, deadline=None, derandomize=True, database=None, print_blob=True
)
@hypothesis.given(_memory_cases())
def test_a_split_that_fits_the_budget_is_found_and_the_fastest_of_them_chosen(case) -> None:
    """Brute force over every split: when one fits by its own peak accounting, the plan fits
    and is the fastest that fits (so few fit in these cases that all are simulated); when
    none fits, the refusal names the least any split needs."""
    budget, rows = _brute_force(case)
    kwargs = {
        "num_microbatches": case["m"],
        "schedule": case["schedule"],
        "first_costs": case["first"],
        "last_costs": case["last"],
        "tied_parameter_bytes": case["tied"],
        "memory_budget": budget,
    }
    fitting = [(counts, step) for counts, peak, step in rows if peak <= budget]
    if not fitting:
        with pytest.raises(MemoryBudgetExceeded) as info:
            plan_stages(case["layers"], case["stages"], **kwargs)
        least = min(peak for _, peak, _ in rows)
        assert info.value.shortfall == least - budget
        assert max(info.value.closest.peak_memory_bytes) == least
        return
    plan = plan_stages(case["layers"], case["stages"], **kwargs)
    assert max(plan.peak_memory_bytes) <= budget
    assert plan.predicted_step_s == pytest.approx(min(step for _, step in fitting), rel=1e-9)


@hypothesis.settings(
    max_examples=150, deadline=None, derandomize=True, database=None, print_blob=True
)
@hypothesis.given(_memory_cases())
def test_the_exact_memory_check_counts_and_lists_every_split_that_fits(case) -> None:
    from graphpipe.schedule.planner import _Fitting, _Model

    budget, rows = _brute_force(case)
    kind = SCHEDULES[case["schedule"]]
    model = _Model(
        kind,
        case["ranks"],
        case["m"],
        case["layers"],
        case["first"],
        case["last"],
        0.0,
        case["tied"],
    )
    fitting = _Fitting(model, budget)
    expected = sorted(counts for counts, peak, _ in rows if peak <= budget)
    assert fitting.count == len(expected)
    assert sorted(fitting.splits(10**6)) == expected
