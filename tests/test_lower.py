"""Lowering: which comms each action gets, where they go, and that the result runs."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.ir import Action, Op, Placement
from graphpipe.schedule.lower import (
    Step,
    channel,
    comms_needed,
    comms_produced,
    forward_only,
    in_send_order,
    lower,
    matching,
    peer,
    transfers,
)
from graphpipe.schedule.simulate import Costs, dataflow, simulate
from graphpipe.schedule.validate import ScheduleError

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
    schedule, placement, plain = _lowered(name, n, m, receives="plain")
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
def test_early_receives_keep_sends_and_only_move_receives_earlier(name, n, m) -> None:
    _, _, plain = _lowered(name, n, m, receives="plain")
    _, _, early = _lowered(name, n, m)
    for rank in plain:
        assert [s.compute for s in early[rank]] == [s.compute for s in plain[rank]]
        where = {}
        for lowered, tag in ((plain, "plain"), (early, "early")):
            for k, step in enumerate(lowered[rank]):
                for c in step.comms:
                    where[(tag, c)] = k
                sends = [c.op in SENDS for c in step.comms]
                assert sends == sorted(sends, reverse=True)  # sends first, then receives
        comms = {c for tag, c in where if tag == "plain"}
        assert Counter(c for tag, c in where if tag == "early") == Counter(comms)
        for c in comms:
            moved = where[("early", c)] - where[("plain", c)]
            assert moved == 0 if c.op in SENDS else moved <= 0


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_every_rank_pair_receives_in_the_order_it_sends(name, n, m) -> None:
    _, placement, lowered = _lowered(name, n, m)
    sent, got = defaultdict(list), defaultdict(list)
    for rank, steps in lowered.items():
        for step in steps:
            for c in step.comms:
                if c.op in SENDS:
                    sent[(rank, peer(c, placement))].append(matching(c))
                else:
                    got[(peer(c, placement), rank)].append(c)
    assert sent == got


def _as_the_runtime_lowers(schedule, placement, receives: str):
    """What ``Pipeline(receives=...)`` runs: ``receives="plain"`` in each rank pair's send
    order (``in_send_order``)."""
    lowered = lower(schedule, placement, receives=receives)
    return in_send_order(lowered, placement) if receives == "plain" else lowered


@pytest.mark.parametrize("receives", ["timed", "start", "plain"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("n", range(2, 9))
def test_transfers_are_grouped_the_same_at_both_ends(name: str, n: int, receives: str) -> None:
    # One transfer is one NCCL group (or gloo packet) at each end: NCCL calls a group whose
    # ops are grouped differently at the two ends undefined (NVIDIA/nccl#1279).
    for m in sorted({2 * n, 2 * n + 1, 3 * n + 2, 20}):
        schedule, placement = SCHEDULES[name](n, m)
        lowered = _as_the_runtime_lowers(schedule, placement, receives)
        found = transfers(lowered, placement)
        seen: Counter = Counter()
        for t in found:
            assert t.sends and all(peer(s, placement) == t.dst for s in t.sends)
            # all its messages leave in one batch of the sender and arrive in one batch of
            # the receiver, in the same order
            sender_batch = [c for c in lowered[t.src][t.send_step].comms if c in t.sends]
            receiver_batch = [c for c in lowered[t.dst][t.recv_step].comms if c in t.recvs]
            assert sender_batch == list(t.sends)
            assert receiver_batch == list(t.recvs)
            seen.update(t.sends)
        all_comms = [c for steps in lowered.values() for s in steps for c in s.comms]
        assert seen == Counter(c for c in all_comms if c.op in SENDS)
        # numbered in order on each rank pair; never two transfers for one pair of batches
        by_edge = defaultdict(list)
        for t in found:
            by_edge[(t.src, t.dst)].append(t)
        for ts in by_edge.values():
            assert [t.index for t in ts] == list(range(len(ts)))
            keys = [(t.send_step, t.recv_step) for t in ts]
            assert keys == sorted(set(keys))


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_in_send_order_moves_only_the_receives_a_rank_pair_reads_out_of_send_order(
    name, n, m
) -> None:
    # Issue 40 (c05, c06): receives="plain" on ZB-V (2+ ranks) and DualPipeV (3+ ranks) was
    # refused with "messages are sent as [...] but received as [...]": their rank pairs carry
    # two channels, read in another order than sent.
    schedule, placement, plain = _lowered(name, n, m, receives="plain")
    ordered = in_send_order(plain, placement)
    for rank in plain:
        assert [s.compute for s in ordered[rank]] == [s.compute for s in plain[rank]]
        where = {}
        for lowered, tag in ((plain, "plain"), (ordered, "ordered")):
            for k, step in enumerate(lowered[rank]):
                for c in step.comms:
                    where[(tag, c)] = k
                sends = [c.op in SENDS for c in step.comms]
                assert sends == sorted(sends, reverse=True)  # sends first, then receives
        comms = [c for tag, c in where if tag == "plain"]
        assert Counter(c for tag, c in where if tag == "ordered") == Counter(comms)
        for c in comms:
            moved = where[("ordered", c)] - where[("plain", c)]
            assert moved == 0 if c.op in SENDS else moved <= 0
    # received in send order on every rank pair, so transfers group both ends alike
    sent, got = defaultdict(list), defaultdict(list)
    for rank, steps in ordered.items():
        for k, step in enumerate(steps):
            for c in step.comms:
                if c.op in SENDS:
                    sent[(rank, peer(c, placement))].append(matching(c))
                else:
                    got[(peer(c, placement), rank)].append((c, k))
    for edge, recvs in got.items():
        assert [c for c, _ in recvs] == sent[edge], edge
        # a receive moved only as far as the next one in send order: each is in the batch
        # the plain rule gives it, or in the batch of a message sent after it
        plain_at = [_plain_step(plain, edge[1], c) for c, _ in recvs]
        for i, (c, k) in enumerate(recvs):
            assert k == min(plain_at[i:]), (edge, str(c))
    transfers(ordered, placement)
    assert simulate(ordered, placement, Costs()).makespan >= dataflow(schedule, placement).makespan
    one_channel = name == "1f1b" or n == 1 or (name == "dualpipev" and n == 2)
    if one_channel:  # already in send order: every comm stays in its batch
        for rank in plain:
            for a, b in zip(plain[rank], ordered[rank], strict=True):
                assert Counter(a.comms) == Counter(b.comms)


def _plain_step(lowered, rank: int, comm: Action) -> int:
    return next(k for k, s in enumerate(lowered[rank]) if comm in s.comms)


def test_transfers_reject_a_rank_pair_received_out_of_order() -> None:
    schedule, placement = SCHEDULES["1f1b"](2, 3)
    schedule[0][0], schedule[0][1] = schedule[0][1], schedule[0][0]  # 0F1 before 0F0
    with pytest.raises(ValueError, match="rank 0 -> rank 1: messages are sent as"):
        transfers(lower(schedule, placement, receives="plain"), placement)


def test_early_receives_hide_the_latency_the_plain_rule_exposes() -> None:
    # Asynchronous P2P never deadlocks on a send; but a receive posted only right before its
    # reader starts its transfer late. Posted early, the latency lands where dataflow puts it.
    costs = Costs(p2p=0.25)
    for name in ("dualpipev", "zbv", "1f1b"):
        schedule, placement = SCHEDULES[name](4, 12)
        ideal = dataflow(schedule, placement, costs).makespan
        early = lower(schedule, placement, durations=costs.of, latency=costs.p2p)
        assert simulate(early, placement, costs).makespan == pytest.approx(ideal)
        plain = lower(schedule, placement, receives="plain")
        if name == "1f1b":
            assert simulate(plain, placement, costs).makespan > ideal
        else:  # two channels share each rank pair, read in another order than sent
            with pytest.raises(ScheduleError, match="out-of-order"):
                simulate(plain, placement, costs)


@pytest.mark.parametrize(("name", "n", "m"), CASES)
def test_simulate_finds_no_deadlock(name: str, n: int, m: int) -> None:
    schedule, placement, lowered = _lowered(name, n, m)
    # receives timed with the same costs and no latency: the run is the dataflow ideal
    assert simulate(lowered, placement, Costs()).makespan == dataflow(schedule, placement).makespan


@pytest.mark.parametrize("costs", ["F=1,B=1,I=0.5,W=0.5", "F=1,B=2,FB=2.5,p2p=0.1"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lowering_timed_with_other_costs_runs_too(name: str, costs: str) -> None:
    c = Costs.parse(costs)
    for n in (2, 5):
        schedule, placement = SCHEDULES[name](n, 3 * n)
        ideal = dataflow(schedule, placement, c).makespan
        for durations in (None, c.of):  # timed with the default costs, or with these
            lowered = lower(schedule, placement, durations=durations, latency=c.p2p)
            assert simulate(lowered, placement, c).makespan >= ideal - 1e-9


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


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_receives_at_start_are_all_in_the_first_batch_and_run_as_dataflow(name: str) -> None:
    # Posted at the start, every receive waits only for its data: with free P2P the run is
    # pure dataflow, with latency it lands where dataflow puts it, as with timed receives.
    for n in (2, 3, 5):
        schedule, placement = SCHEDULES[name](n, 3 * n + 1)
        timed = lower(schedule, placement)
        start = lower(schedule, placement, receives="start")
        for rank, steps in start.items():
            recvs = [c for k, s in enumerate(steps) for c in s.comms if c.op not in SENDS and k]
            assert recvs == [], (rank, recvs)
            sends = [[c for c in s.comms if c.op in SENDS] for s in steps]
            assert sends == [[c for c in s.comms if c.op in SENDS] for s in timed[rank]]
            assert [s.compute for s in steps] == [s.compute for s in timed[rank]]
        for costs in (Costs(F=1, B=3, I=2, W=1), Costs(F=1, B=2, FB=2.5, p2p=0.3)):
            ideal = dataflow(schedule, placement, costs)
            result = simulate(start, placement, costs)
            assert result.makespan == pytest.approx(ideal.makespan), costs
            for got, want in zip(result.ranks, ideal.ranks, strict=True):
                assert got.idle == pytest.approx(want.idle), (costs, got.rank)


def test_lower_rejects_an_unknown_receive_policy() -> None:
    schedule, placement = SCHEDULES["1f1b"](2, 4)
    with pytest.raises(ValueError, match=r"receives must be one of .* got 'soon'"):
        lower(schedule, placement, receives="soon")
