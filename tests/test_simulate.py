"""Simulator and validator: error reports, costs, timing, and DualPipe's reference figures."""

from __future__ import annotations

import itertools
from dataclasses import asdict

import pytest

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.ir import Action, Op, Placement
from graphpipe.schedule.lower import Step, lower, peer
from graphpipe.schedule.simulate import Costs, dataflow, simulate
from graphpipe.schedule.validate import ScheduleError, format_grid, resolve_schedule, validate


def _run(name: str, n: int, m: int, costs: Costs | None = None):
    costs = costs or Costs()
    schedule, placement = SCHEDULES[name](n, m)
    return simulate(lower(schedule, placement, durations=costs.of), placement, costs)


# --------------------------------------------------------------------------------------------
# Error reports


def test_planted_deadlock_reports_the_grid_with_the_blocked_cells_marked() -> None:
    schedule, placement = SCHEDULES["dualpipev"](2, 4)
    # Rank 0 runs 3F0 first: it waits for rank 1's stage 2, which waits for rank 0's 0F0.
    schedule[0].insert(0, schedule[0].pop(3))
    validate(schedule, placement, 4)  # locally valid: the cycle spans two ranks
    with pytest.raises(ScheduleError) as info:
        simulate(lower(schedule, placement), placement)
    message = str(info.value)
    lines = message.splitlines()
    assert lines[0] == "deadlock: no rank can progress"
    assert lines[1].split() == ["Rank", "0", "Rank", "1"]
    assert lines[2].startswith("Step 00: *3F0*")
    assert "*1F0*" in lines[2]
    assert lines[2].endswith("<-- blocked: rank 0, rank 1")
    assert "Step 01: 0F0" in message  # the rest of the grid is there, unmarked
    assert "rank 0 step 0: 3RECV_F0 waits for rank 1 to post 2SEND_F0" in message
    assert "rank 1 step 0: 1RECV_F0 waits for rank 0 to post 0SEND_F0" in message


def test_receives_posted_out_of_send_order_are_a_broken_dependency() -> None:
    schedule, placement = SCHEDULES["1f1b"](2, 3)
    schedule[0][0], schedule[0][1] = schedule[0][1], schedule[0][0]  # 0F1 before 0F0
    # The plain rule posts rank 1's receives in the order it reads them (0 first): the rank
    # pair's FIFO would hand 0F1's data to 1RECV_F0.
    with pytest.raises(ScheduleError) as info:
        simulate(lower(schedule, placement, receives="plain"), placement)
    message = str(info.value)
    assert message.startswith("broken dependency")
    assert "*1F0*" in message and "<-- broken: rank 1" in message
    assert "rank 1 step 0: rank 0 -> rank 1: message 0 is received as 1RECV_F0" in message
    # lower() posts receives in send order per rank pair, so the same schedule runs.
    result = simulate(lower(schedule, placement), placement)
    assert result.channel_order[(0, 1)] == (1, 0, 2)


def test_receive_without_a_send_is_a_broken_dependency() -> None:
    placement = Placement.from_style(2, "loop")
    lowered = {
        0: [Step((), Action(0, Op.F, 0))],
        1: [Step((Action(1, Op.RECV_F, 0),), Action(1, Op.F, 0))],
    }
    with pytest.raises(ScheduleError, match="1RECV_F0 has no matching send: rank 0 posts no"):
        simulate(lowered, placement)


def test_compute_before_its_input_arrives_is_a_broken_dependency() -> None:
    placement = Placement.from_style(2, "loop")
    lowered = {0: [Step((), Action(0, Op.F, 0))], 1: [Step((), Action(1, Op.F, 0))]}
    with pytest.raises(ScheduleError, match="1F0 runs before 1RECV_F0 brings its input"):
        simulate(lowered, placement)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda s: s[0].remove(Action(7, Op.W, 0)), "7I0 has no later W"),
        (lambda s: s[0].insert(0, Action(7, Op.W, 9)), "7W9 has no earlier I without a W"),
        (lambda s: s[1].append(Action(0, Op.F, 0)), "0F0: stage 0 does not run on rank 1"),
        (lambda s: s[0].remove(Action(0, Op.F, 2)), "stage 0 runs forwards of micro-batches"),
        (lambda s: s[0].insert(0, s[0].pop(s[0].index(Action(7, Op.I, 0)))), "before F"),
        (
            lambda s: s[3].insert(0, s[3].pop(s[3].index(Action(4, Op.F, 0)))),
            "4F0 runs before its input from stage 3 on this rank",
        ),
    ],
)
def test_validate_reports_each_broken_rule_with_the_grid(edit, reason: str) -> None:
    schedule, placement = SCHEDULES["dualpipev"](4, 8)
    validate(schedule, placement, 8)
    edit(schedule)
    with pytest.raises(ScheduleError) as info:
        validate(schedule, placement, 8)
    message = str(info.value)
    assert message.startswith("invalid schedule:")
    assert "Rank 0" in message and "Rank 3" in message and "<-- invalid" in message
    assert reason in message


def test_format_grid_pads_columns_and_marks_cells() -> None:
    grid = format_grid({0: ["0F0", "0B0"], 1: ["1F0"]}, {1: 0}, ["why"])
    assert grid.splitlines() == [
        "        Rank 0 Rank 1",
        "Step 0: 0F0    *1F0*  <-- blocked: rank 1",
        "Step 1: 0B0",
        "why",
    ]


# --------------------------------------------------------------------------------------------
# Costs


def test_costs_parse_names_numbers_and_keeps_defaults() -> None:
    assert Costs.parse("F=1,B=2,W=1,p2p=0.1") == Costs(F=1, B=2, W=1, p2p=0.1)
    assert Costs.parse("F&B=2.5, I=0.5") == Costs(FB=2.5, I=0.5)
    assert Costs.parse("") == Costs()


@pytest.mark.parametrize(
    ("text", "match"),
    [("X=1", "bad cost 'X=1'"), ("F=abc", "not a number"), ("F", "NAME=NUMBER"), ("W=-1", ">= 0")],
)
def test_costs_parse_rejects_bad_input(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Costs.parse(text)


def test_cost_of_an_overlap_pair_is_fb_or_f_plus_b() -> None:
    pair = Action.overlap(Action(0, Op.F, 1), Action(7, Op.B, 0))
    assert Costs(F=1, B=2).of(pair) == 3
    assert Costs(F=1, B=2, FB=2.4).of(pair) == 2.4
    assert Costs(I=0.7).of(Action(0, Op.I, 0)) == 0.7
    assert Costs().of(None) == 0


# --------------------------------------------------------------------------------------------
# Timing and statistics


@pytest.mark.parametrize(("n", "m"), [(1, 1), (2, 4), (4, 8), (5, 3), (6, 13)])
def test_one_f_one_b_makespan_is_the_textbook_m_plus_n_minus_1_times_f_plus_b(n, m) -> None:
    costs = Costs(F=1.5, B=2.5)
    result = _run("1f1b", n, m, costs)
    assert result.makespan == pytest.approx((m + n - 1) * (costs.F + costs.B))
    assert max(r.peak_activations for r in result.ranks) == min(n, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_timeline_is_sequential_per_rank_with_the_costed_durations(name: str) -> None:
    costs = Costs(F=1, B=2.5, I=1.25, W=0.75, FB=3)
    result = _run(name, 3, 7, costs)
    for rank in range(3):
        records = [r for r in result.timeline if r.rank == rank]
        assert all(a.end <= b.start for a, b in itertools.pairwise(records))
        assert all(r.end - r.start == pytest.approx(costs.of(r.action)) for r in records)
        busy = sum(r.end - r.start for r in records)
        assert result.ranks[rank].busy == pytest.approx(busy)
        assert result.ranks[rank].idle == pytest.approx(result.makespan - busy)


def test_p2p_latency_lengthens_the_run() -> None:
    schedule, placement = SCHEDULES["dualpipev"](3, 8)
    costs = Costs(p2p=0.2)
    timed = lower(schedule, placement, durations=costs.of, latency=costs.p2p)
    slow = simulate(timed, placement, costs).makespan
    assert slow == dataflow(schedule, placement, costs).makespan  # where dataflow puts it
    assert slow > _run("dualpipev", 3, 8).makespan == DATAFLOW_MAKESPAN["dualpipev"](3, 8)


@pytest.mark.parametrize("n", range(2, 7))
def test_dualpipev_bubble_is_smaller_than_1f1bs(n: int) -> None:
    for costs in (Costs(), Costs(FB=2.5), Costs(F=1, B=1, I=0.5, W=0.5)):
        m = 4 * n
        assert (
            _run("dualpipev", n, m, costs).bubble_fraction
            < _run("1f1b", n, m, costs).bubble_fraction
        )


@pytest.mark.parametrize("n", range(1, 7))
@pytest.mark.parametrize(("w", "fb"), [(1, 3), (1, 2.5), (1, 2), (0.5, 2.5), (0.5, 1.5), (0.25, 2)])
def test_dualpipev_idle_equals_dualpipes_formula_where_it_applies(n: int, w: float, fb: float):
    # Where I = F, W <= F and F+W <= F&B <= F+B, the slowest rank idles exactly
    # (PP/2-1)(F&B+B-3W) with PP = 2N.
    costs = Costs(F=1, I=1, W=w, B=1 + w, FB=fb)
    formula = (n - 1) * (costs.overlap + costs.B - 3 * costs.W)
    for m in (2 * n, 3 * n + 1):
        result = _run("dualpipev", n, m, costs)
        assert max(r.idle for r in result.ranks) == pytest.approx(formula)


@pytest.mark.parametrize(
    "costs", [Costs(F=1, B=3, I=1, W=2), Costs(F=1, B=3, I=2, W=1), Costs(FB=2.2, p2p=0.1)]
)
def test_dualpipev_idle_grows_with_ranks_like_the_formula(costs: Costs) -> None:
    # Outside the formula's region the figures differ (W > F, I != F, p2p), the trend does not.
    idle = [max(r.idle for r in _run("dualpipev", n, 4 * n, costs).ranks) for n in range(1, 8)]
    assert idle[0] == 0
    assert all(a < b for a, b in itertools.pairwise(idle))


@pytest.mark.parametrize("n", range(1, 9))
def test_dualpipev_peak_activations_are_pp_plus_1(n: int) -> None:
    result = _run("dualpipev", n, 2 * n + 3)
    assert [r.peak_activations for r in result.ranks] == [2 * n + 1] * n  # PP+1, PP = 2N
    assert [r.peak_pending_w for r in result.ranks] == [r + 1 for r in range(n)]


def test_zbv_with_equal_f_i_w_has_a_smaller_bubble_than_1f1b() -> None:
    for n in (2, 4, 6):
        assert _run("zbv", n, 4 * n).bubble_fraction < _run("1f1b", n, 4 * n).bubble_fraction


def test_two_receives_from_one_peer_swapped_in_a_batch_are_a_broken_dependency() -> None:
    schedule, placement = SCHEDULES["dualpipev"](3, 8)
    lowered = lower(schedule, placement)
    # Swap two receives from the same peer inside one batch: each channel alone stays in
    # order, but the rank pair's FIFO would now match them crosswise.
    for rank, steps in lowered.items():
        for k, step in enumerate(steps):
            recvs = [i for i, c in enumerate(step.comms) if c.op in (Op.RECV_F, Op.RECV_B)]
            if len(recvs) == 2 and len({peer(step.comms[i], placement) for i in recvs}) == 1:
                comms = list(step.comms)
                comms[recvs[0]], comms[recvs[1]] = comms[recvs[1]], comms[recvs[0]]
                lowered[rank][k] = Step(tuple(comms), step.compute)
                with pytest.raises(ScheduleError, match=f"-> rank {rank}: message \\d+ is"):
                    simulate(lowered, placement)
                return
    pytest.fail("no batch with two receives from one peer")


# --------------------------------------------------------------------------------------------
# The asynchronous model against pure dataflow

# I > F, W < F, F > I, and an overlap pair cheaper than its parts.
DATAFLOW_COSTS = [
    Costs(F=1, B=3, I=2, W=1),
    Costs(F=1, B=1.5, I=1, W=0.5),
    Costs(F=2, B=3, I=1, W=2),
    Costs(F=1, B=2, I=1, W=1, FB=2.5),
]


def _microbatch_counts(n: int) -> list[int]:
    return sorted({2 * n, 2 * n + 1, 3 * n + 2, 20} - set(range(2 * n)))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("n", range(2, 9))
def test_with_free_p2p_the_async_run_is_pure_dataflow(name: str, n: int) -> None:
    for m in _microbatch_counts(n):
        schedule, placement = SCHEDULES[name](n, m)
        lowered = lower(schedule, placement)  # timed with the default costs, on purpose
        for costs in DATAFLOW_COSTS:
            ideal = dataflow(schedule, placement, costs)
            result = simulate(lowered, placement, costs)
            assert result.makespan == pytest.approx(ideal.makespan), (m, costs)
            for got, want in zip(result.ranks, ideal.ranks, strict=True):
                assert got.idle == pytest.approx(want.idle), (m, costs, got.rank)
                assert got.recv_wait == pytest.approx(want.recv_wait), (m, costs, got.rank)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_latency_lands_on_the_critical_path_only_where_dataflow_puts_it(name, n) -> None:
    for costs in (Costs(F=1, B=3, I=2, W=1, p2p=0.3), Costs(F=1, B=2, FB=2.5, p2p=0.05)):
        for m in (2 * n, 20):
            schedule, placement = SCHEDULES[name](n, m)
            lowered = lower(schedule, placement, durations=costs.of, latency=costs.p2p)
            ideal = dataflow(schedule, placement, costs)
            result = simulate(lowered, placement, costs)
            assert result.makespan == pytest.approx(ideal.makespan), (m, costs)
            assert (
                result.makespan
                > dataflow(schedule, placement, Costs(**{**asdict(costs), "p2p": 0.0})).makespan
            )


def test_simulated_waits_name_the_receives_and_fill_the_gaps() -> None:
    costs = Costs(F=1, B=2, p2p=0.5)
    schedule, placement = SCHEDULES["1f1b"](3, 6)
    lowered = lower(schedule, placement, durations=costs.of, latency=0.5)
    result = simulate(lowered, placement, costs)
    first = next(w for w in result.waits if w.rank == 1)
    assert first.start == 0 and first.end == pytest.approx(1.5)  # 0F0 (1) + latency (0.5)
    assert first.label == "wait 1RECV_F0"
    for r in result.ranks:
        last_end = max(t.end for t in result.timeline if t.rank == r.rank)
        assert r.idle == pytest.approx(r.recv_wait + result.makespan - last_end)


# --------------------------------------------------------------------------------------------
# Validation as a pass: what the generators build, and what a pipeline is given


# The makespans with Costs() (F=1, B=2, I=1, W=1: F + B = 3 per stage and micro-batch): 1F1B
# runs M + N - 1 slots of F + B; the V schedules keep each rank busy 2M (F + B) and idle
# DualPipe's (N - 1)(F&B + B - 3W) = 2(N - 1), ZB-V's N - 1.
DATAFLOW_MAKESPAN = {
    "1f1b": lambda n, m: 3 * (m + n - 1),
    "dualpipev": lambda n, m: 6 * m + 2 * (n - 1),
    "zbv": lambda n, m: 6 * m + (n - 1),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("n", "m"), [(1, 2), (2, 4), (3, 7), (4, 8), (5, 16)])
def test_every_generated_schedule_validates_and_runs_as_dataflow(name: str, n: int, m: int):
    schedule, placement = SCHEDULES[name](n, m)
    validate(schedule, placement, m)
    result = dataflow(schedule, placement)
    assert result.makespan == DATAFLOW_MAKESPAN[name](n, m)
    assert [r.busy for r in result.ranks] == [3 * m * len(placement.stages_of(r)) for r in range(n)]


def test_resolve_schedule_by_name_builds_and_places_it() -> None:
    built, placement, name = resolve_schedule("zbv", 3, 6)
    assert (built, placement) == SCHEDULES["zbv"](3, 6)
    assert name == "zbv"


def test_resolve_schedule_takes_a_users_mapping_and_implies_its_placement() -> None:
    users = {r: tuple(a) for r, a in SCHEDULES["1f1b"](2, 3)[0].items()}
    built, placement, name = resolve_schedule(users, 2, 3)
    assert built == {r: list(a) for r, a in users.items()} and name == "custom"
    assert placement == Placement.from_style(2, "loop")


@pytest.mark.parametrize(
    ("schedule", "error", "match"),
    [
        ("gpipe", ValueError, r"unknown schedule 'gpipe': expected one of \['1f1b', 'dualpipev'"),
        ({0: [Action(0, Op.F, 0)]}, ValueError, r"the schedule has ranks \[0\], but the pipe"),
        (["0F0"], TypeError, "schedule must be a name .* or a {rank: .* mapping, got list"),
    ],
)
def test_resolve_schedule_rejects_what_is_no_schedule(schedule, error, match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_schedule(schedule, 2, 4)


def test_resolve_schedule_validates_a_users_mapping_with_the_grid() -> None:
    schedule, _ = SCHEDULES["dualpipev"](2, 4)
    schedule[0].remove(Action(3, Op.W, 0))
    with pytest.raises(ScheduleError, match="invalid schedule:") as info:
        resolve_schedule(schedule, 2, 4)
    assert "3I0 has no later W" in str(info.value) and "<-- invalid: rank 0" in str(info.value)


def test_resolve_schedule_rejects_a_users_mapping_whose_ranks_deadlock() -> None:
    schedule, _ = SCHEDULES["dualpipev"](2, 4)
    schedule[0].insert(0, schedule[0].pop(3))  # 3F0 first: it waits for rank 1, which waits
    with pytest.raises(ScheduleError, match="deadlock: no rank can progress") as info:
        resolve_schedule(schedule, 2, 4)
    assert "*3F0*" in str(info.value)
