"""Lowering: which comms each action gets, where they go, and that the result runs."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from graphpipe.ir import Action, Op
from graphpipe.lower import (
    Step,
    channel,
    comms_needed,
    comms_produced,
    forward_only,
    lower,
    matching,
    peer,
)
from graphpipe.schedules import SCHEDULES, Placement
from graphpipe.simulate import Costs, ScheduleError, simulate

SENDS = (Op.SEND_F, Op.SEND_B)


def _cases() -> list[tuple[str, int, int]]:
    cases = []
    for name in sorted(SCHEDULES):
        for n in range(1, 7):
            for m in sorted({2 * n, 2 * n + 1, 3 * n + 2}):
                cases.append((name, n, m))
    return cases


CASES = _cases()


def _lowered(name: str, n: int, m: int, **kwargs):
    schedule, placement = SCHEDULES[name](n, m)
    return schedule, placement, lower(schedule, placement, **kwargs)


def test_channel_peer_and_matching_follow_the_data_flow() -> None:
    v = Placement.from_style(4, "v", 2)  # stages 0..7 on ranks 0,1,2,3,3,2,1,0
    cases = [
        (Action(2, Op.SEND_F, 1), (2, 3), 3, Action(3, Op.RECV_F, 1)),
        (Action(3, Op.RECV_F, 1), (2, 3), 2, Action(2, Op.SEND_F, 1)),
        (Action(5, Op.SEND_B, 0), (5, 4), 3, Action(4, Op.RECV_B, 0)),
        (Action(4, Op.RECV_B, 0), (5, 4), 2, Action(5, Op.SEND_B, 0)),
        (Action(6, Op.SEND_F, 2), (6, 7), 0, Action(7, Op.RECV_F, 2)),
    ]
    for action, ch, other, match in cases:
        assert channel(action) == ch
        assert peer(action, v) == other
        assert matching(action) == match
        assert matching(match) == action
    with pytest.raises(ValueError):
        channel(Action(0, Op.F, 0))


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_every_send_has_its_receive_on_the_peer_in_the_same_channel_order(name, n, m) -> None:
    _, placement, lowered = _lowered(name, n, m)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, steps in lowered.items():
        for step in steps:
            for c in step.comms:
                assert placement.rank_of(c.stage) == rank  # issued by its stage's rank
                other = placement.rank_of(matching(c).stage)
                assert peer(c, placement) == other != rank
                side = sent if c.op in SENDS else received
                side[channel(c)].append(c.microbatch)
    assert set(sent) == set(received)
    for ch in sent:
        assert sent[ch] == received[ch], ch


@pytest.mark.parametrize("n", range(1, 7))
def test_v_turn_on_the_last_rank_gets_no_comm(n: int) -> None:
    _, _, lowered = _lowered("dualpipev", n, 2 * n + 1)
    channels = {channel(c) for steps in lowered.values() for s in steps for c in s.comms}
    assert (n - 1, n) not in channels
    assert (n, n - 1) not in channels
    expected = {(s, s + 1) for s in range(2 * n - 1)} | {(s + 1, s) for s in range(2 * n - 1)}
    assert channels == expected - {(n - 1, n), (n, n - 1)}


def test_a_one_rank_pipeline_has_no_comm_at_all() -> None:
    for name in SCHEDULES:
        _, _, lowered = _lowered(name, 1, 4)
        assert all(not s.comms for s in lowered[0])
        assert all(s.compute is not None for s in lowered[0])


def test_w_needs_and_produces_no_comm() -> None:
    placement = Placement.from_style(3, "v", 2)
    for stage in range(6):
        w = Action(stage, Op.W, 1)
        assert comms_needed(w, placement) == comms_produced(w, placement) == ()


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_plain_rule_sends_of_the_previous_compute_then_receives_of_this_one(name, n, m) -> None:
    schedule, placement, plain = _lowered(name, n, m, rendezvous_safe=False)
    for rank, actions in schedule.items():
        steps = plain[rank]
        assert [s.compute for s in steps if s.compute is not None] == actions
        previous: tuple[Action, ...] = ()
        for step, compute in zip(steps, actions, strict=False):
            assert step.comms == previous + comms_needed(compute, placement)
            if compute.op is Op.W:
                assert all(c.op in SENDS for c in step.comms)
            previous = comms_produced(compute, placement)
        if previous:
            assert steps[-1] == Step(previous, None)
        else:
            assert steps[-1].compute is not None


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_safe_lowering_keeps_sends_and_only_moves_receives_earlier(name, n, m) -> None:
    _, _, plain = _lowered(name, n, m, rendezvous_safe=False)
    _, _, safe = _lowered(name, n, m)
    for rank in plain:
        assert [s.compute for s in safe[rank]] == [s.compute for s in plain[rank]]
        where = {}
        for lowered, tag in ((plain, "plain"), (safe, "safe")):
            for k, step in enumerate(lowered[rank]):
                for c in step.comms:
                    where[(tag, c)] = k
                sends = [c.op in SENDS for c in step.comms]
                assert sends == sorted(sends, reverse=True)  # sends first, then receives
        comms = {c for tag, c in where if tag == "plain"}
        assert Counter(c for tag, c in where if tag == "safe") == Counter(comms)
        for c in comms:
            moved = where[("safe", c)] - where[("plain", c)]
            assert moved == 0 if c.op in SENDS else moved <= 0


def test_plain_rule_deadlocks_dualpipev_when_sends_block() -> None:
    # Why lower() moves receives: rank 0's warm-up sends run ahead of rank 1's receives.
    _, placement, plain = _lowered("dualpipev", 2, 4, rendezvous_safe=False)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(plain, placement)


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_simulate_finds_no_deadlock(name: str, n: int, m: int) -> None:
    _, placement, lowered = _lowered(name, n, m)
    result = simulate(lowered, placement, Costs())
    assert result.makespan > 0
    assert result.rank_edge_fifo_consistent, result.rank_edge_mismatches


@pytest.mark.parametrize("costs", ["F=1,B=1,I=0.5,W=0.5", "F=1,B=2,FB=2.5,p2p=0.1"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lowering_timed_with_other_costs_runs_too(name: str, costs: str) -> None:
    c = Costs.parse(costs)
    for n in (2, 5):
        schedule, placement = SCHEDULES[name](n, 3 * n)
        result = simulate(lower(schedule, placement, durations=c.of), placement, c)
        assert result.rank_edge_fifo_consistent


def test_forward_only_keeps_the_forwards_in_order() -> None:
    schedule, _ = SCHEDULES["dualpipev"](3, 7)
    inference = forward_only(schedule)
    for rank, actions in schedule.items():
        parts = [p for cell in actions for p in cell.parts()]
        assert inference[rank] == [p for p in parts if p.op is Op.F]
    assert any(a.op is Op.OVERLAP_F_B for a in schedule[0])  # pairs gave up their F
    assert len(inference[0]) == 2 * 7


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_forward_only_schedules_run_without_deadlock(name: str) -> None:
    for n in (1, 2, 4):
        schedule, placement = SCHEDULES[name](n, 2 * n + 1)
        result = simulate(lower(forward_only(schedule), placement), placement)
        assert all(rec.action.op is Op.F for rec in result.timeline)


def test_lower_rejects_comm_actions_in_a_compute_only_schedule() -> None:
    placement = Placement.from_style(2, "loop")
    with pytest.raises(ValueError, match="compute-only"):
        lower({0: [Action(0, Op.SEND_F, 0)], 1: []}, placement)
