"""The passes on arrays (``schedule.packed``) give what the object-by-object algorithms gave
(``tests.schedule_oracle``), errors included; each of their ways (rounds or work list, one
chunk or many, the dataflow shortcut or the event loop) gives the same; and ``figures``
builds no object per action. (What an action costs at 64 and 256 ranks is a benchmark:
``tests/benchmarks/bench_schedule.py``.)"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

import graphpipe.schedule.packed as packed
import graphpipe.schedule.timing as timing
from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.ir import Action, Op
from graphpipe.schedule.lower import Step, lower, lower_cells
from graphpipe.schedule.simulate import Costs, dataflow, figures, simulate
from graphpipe.schedule.timing import cell_times, dataflow_times
from graphpipe.schedule.validate import ScheduleError, validate, validate_cells
from tests import schedule_oracle as oracle

COSTS = [
    Costs(),
    Costs(F=1.1, B=2.3, I=0.7, W=0.45, p2p=0.13),  # inexact in binary: rounding shows
    Costs(F=1, B=2, FB=2.5, p2p=0.05),
]
CASES = [
    (name, n, m)
    for name in sorted(SCHEDULES)
    for n, m in [(1, 2), (1, 4), (2, 4), (2, 7), (3, 6), (3, 10), (5, 10), (5, 16), (8, 16)]
] + [(name, n, m) for name in ("1f1b", "zbv") for n, m in [(3, 2), (5, 3), (4, 1)]]
RECEIVES = [
    {"receives": "plain"},
    {"receives": "timed"},
    {"receives": "start"},
]


def _in_rank_order(records) -> list:
    """The oracle's records grouped by rank (each rank's in program order, as simulate's)."""
    return sorted(records, key=lambda r: r.rank)


def _outcome(run):
    try:
        return run()
    except (ScheduleError, ValueError) as e:
        return type(e).__name__, str(e)


# --------------------------------------------------------------------------------------------
# Equal to the object-by-object algorithms


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_generators_lowering_timing_and_dataflow_equal_the_old_algorithms(name, n, m) -> None:
    schedule, placement = SCHEDULES[name](n, m)
    for costs in COSTS:
        got = dataflow_times(schedule, placement, costs.of, costs.p2p)
        assert got == oracle.dataflow_times(schedule, placement, costs.of, costs.p2p)
        assert dataflow(schedule, placement, costs) == oracle.dataflow(schedule, placement, costs)
        for how in RECEIVES:
            kwargs = {"durations": costs.of, "latency": costs.p2p, **how}
            assert lower(schedule, placement, **kwargs) == oracle.lower(
                schedule, placement, **kwargs
            ), (costs, how)


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_simulate_and_figures_equal_the_old_algorithms(name, n, m) -> None:
    schedule, placement = SCHEDULES[name](n, m)
    for costs in COSTS:
        for how in RECEIVES:
            lowered = oracle.lower(
                schedule, placement, durations=costs.of, latency=costs.p2p, **how
            )
            want = _outcome(lambda: oracle.simulate(lowered, placement, costs))  # noqa: B023
            got = _outcome(lambda: simulate(lowered, placement, costs))  # noqa: B023
            if isinstance(want, tuple):  # the plain rule breaks a V's FIFO: the same error
                assert got == want, (costs, how)
                continue
            assert got.makespan == want.makespan and got.ranks == want.ranks, (costs, how)
            assert got.timeline == tuple(_in_rank_order(want.timeline)), (costs, how)
            assert got.waits == tuple(_in_rank_order(want.waits)), (costs, how)
            assert got.channel_order == want.channel_order, (costs, how)
        kind = SCHEDULES[name]
        found = figures(kind.cells(n, m), placement, m, costs)
        ideal = oracle.dataflow(schedule, placement, costs)
        run = oracle.simulate(
            oracle.lower(schedule, placement, durations=costs.of, latency=costs.p2p),
            placement,
            costs,
        )
        assert (found.makespan, found.ranks) == (run.makespan, run.ranks), costs
        assert found.dataflow_makespan == ideal.makespan, costs


@pytest.mark.parametrize(
    "schedule",
    [
        {0: [], 1: []},
        {0: [Action(0, Op.F, 0)], 1: []},
        {0: [], 1: [Action(1, Op.F, 0)]},
        {0: [Action(0, Op.F, 0), Action(0, Op.W, 0)], 1: [Action(1, Op.F, 0), Action(1, Op.I, 0)]},
    ],
)
def test_empty_and_broken_programs_equal_the_old_algorithms(schedule) -> None:
    placement = SCHEDULES["1f1b"].placement(2)
    for how in RECEIVES:
        lowered = lower(schedule, placement, **how)
        assert lowered == oracle.lower(schedule, placement, **how)
        want = _outcome(lambda: oracle.simulate(lowered, placement))  # noqa: B023
        got = _outcome(lambda: simulate(lowered, placement))  # noqa: B023
        if isinstance(want, tuple):
            assert got == want
        else:
            assert (got.makespan, got.ranks, got.waits) == (want.makespan, want.ranks, want.waits)
    want = _outcome(lambda: oracle.dataflow(schedule, placement))
    assert _outcome(lambda: dataflow(schedule, placement)) == want


def _mutations(schedule, rng: random.Random, count: int):
    """Small edits of a schedule: a cell moved, swapped with another, dropped or doubled."""
    ranks = sorted(schedule)
    for _ in range(count):
        edited = {r: list(cells) for r, cells in schedule.items()}
        r = rng.choice(ranks)
        cells = edited[r]
        i, j = rng.randrange(len(cells)), rng.randrange(len(cells))
        kind = rng.choice(("move", "swap", "drop", "double", "elsewhere"))
        if kind == "move":
            cells.insert(j, cells.pop(i))
        elif kind == "swap":
            cells[i], cells[j] = cells[j], cells[i]
        elif kind == "drop":
            cells.pop(i)
        elif kind == "double":
            cells.insert(j, cells[i])
        else:
            edited[rng.choice(ranks)].insert(0, cells.pop(i))
        yield edited


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_array_checks_reject_exactly_what_validate_rejects(name: str) -> None:
    rng = random.Random(23)
    schedule, placement = SCHEDULES[name](3, 7)
    rejected = 0
    for edited in _mutations(schedule, rng, 150):
        want = _outcome(lambda: validate(edited, placement, 7))  # noqa: B023
        cells = packed.encode_schedule(edited)
        got = _outcome(lambda: validate_cells(cells, placement, 7))  # noqa: B023
        assert got == want
        rejected += want is not None
    assert 50 < rejected < 150  # both kinds of verdict were tried


def _lowered_mutations(lowered, rng: random.Random, count: int):
    """Small edits of a lowered program: a comm moved to another step, dropped or doubled, a
    compute moved."""
    ranks = sorted(lowered)
    for _ in range(count):
        edited = {r: list(steps) for r, steps in lowered.items()}
        r = rng.choice(ranks)
        steps = edited[r]
        i, j = rng.randrange(len(steps)), rng.randrange(len(steps))
        if rng.random() < 0.3 or not steps[i].comms:
            a, b = steps[i], steps[j]
            steps[i], steps[j] = Step(a.comms, b.compute), Step(b.comms, a.compute)
        else:
            comms = list(steps[i].comms)
            c = comms.pop(rng.randrange(len(comms)))
            kind = rng.choice(("move", "drop", "double"))
            steps[i] = Step(tuple(comms + [c] if kind == "double" else comms), steps[i].compute)
            if kind == "move":
                steps[j] = Step(steps[j].comms + (c,), steps[j].compute)
        yield edited


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_simulate_names_every_broken_program_as_the_old_algorithm_did(name: str) -> None:
    rng = random.Random(8)
    schedule, placement = SCHEDULES[name](3, 7)
    costs = Costs(F=1, B=2, p2p=0.25)
    lowered = lower(schedule, placement, durations=costs.of, latency=costs.p2p)
    kinds = set()
    for edited in _lowered_mutations(lowered, rng, 120):
        want = _outcome(lambda: oracle.simulate(edited, placement, costs))  # noqa: B023
        got = _outcome(lambda: simulate(edited, placement, costs))  # noqa: B023
        if isinstance(want, tuple):
            assert got == want
            kinds.add(want[1].split(":")[0])
        else:
            assert (got.makespan, got.ranks) == (want.makespan, want.ranks)
            assert got.timeline == tuple(_in_rank_order(want.timeline))
            kinds.add("runs")
    assert {"runs", "broken dependency"} <= kinds


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_deadlocks_are_named_as_the_old_algorithm_named_them(name: str) -> None:
    # Schedules that each rank could run alone (validate passes) but whose ranks wait for
    # each other: the run and the dataflow deadlock, with the same report as before.
    rng = random.Random(5)
    schedule, placement = SCHEDULES[name](3, 7)
    costs = Costs(F=1, B=2, p2p=0.25)
    deadlocks = 0
    for edited in _mutations(schedule, rng, 300):
        if _outcome(lambda: validate(edited, placement, 7)) is not None:  # noqa: B023
            continue
        for how in RECEIVES[1:]:
            lowered = oracle.lower(edited, placement, durations=costs.of, **how)
            want = _outcome(lambda: oracle.simulate(lowered, placement, costs))  # noqa: B023
            got = _outcome(lambda: simulate(lowered, placement, costs))  # noqa: B023
            assert got == want if isinstance(want, tuple) else got.ranks == want.ranks
            deadlocks += isinstance(want, tuple) and want[1].startswith("deadlock")
        want = _outcome(lambda: oracle.dataflow(edited, placement, costs))  # noqa: B023
        assert _outcome(lambda: dataflow(edited, placement, costs)) == want  # noqa: B023
    assert deadlocks > 3


# --------------------------------------------------------------------------------------------
# Every way the same


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_rounds_and_the_work_list_time_alike(name: str, monkeypatch) -> None:
    kind = SCHEDULES[name]
    cells, placement = kind.cells(40, 81), kind.placement(40)
    steps = lower_cells(cells, placement, receives="plain").steps
    for costs in COSTS:
        rounds = cell_times(steps, placement, costs.durations(steps), costs.p2p)
        monkeypatch.setattr(timing, "_ROUND_MIN", 10**9)
        work_list = cell_times(steps, placement, costs.durations(steps), costs.p2p)
        monkeypatch.undo()
        for a, b in (
            (rounds.starts, work_list.starts),
            (rounds.ends, work_list.ends),
            (rounds.done, work_list.done),
            (rounds.timed, work_list.timed),
        ):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_one_chunk_or_many_give_the_same(name: str, monkeypatch) -> None:
    kind = SCHEDULES[name]
    n, m = 12, 27
    cells, placement = kind.cells(n, m), kind.placement(n)
    costs = COSTS[1]
    whole = lower_cells(cells, placement, durations=costs.durations(cells), latency=costs.p2p)
    found = figures(cells, placement, m, costs)
    monkeypatch.setattr(packed, "CHUNK", 7)  # a rank or two per chunk
    assert len(whole.chunks()) > 5
    parts = lower_cells(cells, placement, durations=costs.durations(cells), latency=costs.p2p)
    np.testing.assert_array_equal(whole.comms, parts.comms)
    np.testing.assert_array_equal(whole.comm_offsets, parts.comm_offsets)
    assert figures(cells, placement, m, costs) == found


def test_the_dataflow_shortcut_needs_sends_right_after_their_producers() -> None:
    # A send moved one step later: the run is no longer the dataflow timing; figures must
    # fall back to the event loop (which simulate always runs) and agree with it.
    schedule, placement = SCHEDULES["1f1b"](2, 3)
    lowered = lower(schedule, placement)
    first = lowered[0]
    send = next(c for c in first[1].comms if c.op is Op.SEND_F)
    first[1] = Step(tuple(c for c in first[1].comms if c != send), first[1].compute)
    first[2] = Step((send, *first[2].comms), first[2].compute)
    slow = simulate(lowered, placement)
    assert slow.makespan > dataflow(schedule, placement).makespan  # 1F0 waited for the send
    assert slow.makespan == oracle.simulate(lowered, placement).makespan


def test_packed_cells_round_trip_and_name_their_cells() -> None:
    schedule = {0: [Action(0, Op.F, 0), Action.overlap(Action(0, Op.F, 1), Action(3, Op.I, 7))]}
    cells = packed.encode_schedule(schedule)
    assert packed.decode_schedule(cells) == schedule
    assert cells.names() == {0: [str(a) for a in schedule[0]]}
    kind = SCHEDULES["dualpipev"]
    generated = kind.cells(4, 9)
    assert generated.names() == {r: [str(a) for a in s] for r, s in kind.build(4, 9).items()}
    for costs in COSTS:
        cost = costs.durations(generated)
        assert cost.tolist() == [costs.of(a) for s in kind.build(4, 9).values() for a in s]


# --------------------------------------------------------------------------------------------
# No object per action


def test_figures_hold_no_object_per_action(monkeypatch) -> None:
    # graphpipe schedule's path never builds an Action per cell (what made 1024 ranks need
    # more than 2 GB): decoding is only for an error's report.
    kind = SCHEDULES["zbv"]
    cells = kind.cells(16, 40)

    def refuse(*args, **kwargs):
        raise AssertionError("an Action was decoded")

    costs = COSTS[1]
    schedule = kind.build(16, 40)
    run = simulate(
        lower(schedule, kind.placement(16), durations=costs.of, latency=costs.p2p),
        kind.placement(16),
        costs,
    )
    monkeypatch.setattr(packed, "action_of", refuse)
    monkeypatch.setattr(packed, "cell_of", refuse)
    found = figures(cells, kind.placement(16), 40, replace(costs))
    assert (found.makespan, found.ranks) == (run.makespan, run.ranks)
