"""Schedule generators: DualPipeV against torch's order and DUALPIPEV.md's counts; baselines."""

from __future__ import annotations

import os
from collections import Counter, deque
from pathlib import Path

import pytest

from graphpipe.schedule.generators import SCHEDULES, dualpipev, one_f_one_b, zbv
from graphpipe.schedule.ir import BACKWARD_OPS, Op, Placement, format_csv, load_csv, stage_to_rank
from tests.torch_oracle import as_strings, dualpipev_rows, zbv_rows

GOLDEN = Path(__file__).parent / "golden" / "dualpipev_n4_m10.csv"


def _dualpipev_sizes() -> list[tuple[int, int]]:
    sizes = []
    for n in range(1, 9):
        for m in sorted({2 * n, 2 * n + 1, 2 * n + 3, 3 * n + 2, 20} - set(range(2 * n))):
            sizes.append((n, m))
    return sizes


def _strings(schedule) -> dict[int, list[str]]:
    return {r: [str(a) for a in actions] for r, actions in schedule.items()}


@pytest.mark.parametrize(("n", "m"), _dualpipev_sizes())
def test_dualpipev_equals_torchs_order(n: int, m: int) -> None:
    assert _strings(dualpipev(n, m)) == as_strings(dualpipev_rows(n, m))


@pytest.mark.parametrize(("n", "m"), _dualpipev_sizes())
def test_dualpipev_counts_per_stage_and_rank(n: int, m: int) -> None:
    for rank, actions in dualpipev(n, m).items():
        parts = [p for cell in actions for p in cell.parts()]
        for stage in (rank, 2 * n - 1 - rank):
            forwards = [p.microbatch for p in parts if p.stage == stage and p.op is Op.F]
            backwards = [p.microbatch for p in parts if p.stage == stage and p.op in BACKWARD_OPS]
            assert forwards == list(range(m))
            assert backwards == list(range(m))
        assert sum(p.op is Op.W for p in parts) == 2 * n - rank - 1
        assert {p.stage for p in parts} == {rank, 2 * n - 1 - rank}


@pytest.mark.parametrize(("n", "m"), _dualpipev_sizes())
def test_dualpipev_w_names_the_oldest_pending_i(n: int, m: int) -> None:
    for actions in dualpipev(n, m).values():
        pending: deque[tuple[int, int]] = deque()
        for p in (p for cell in actions for p in cell.parts()):
            if p.op is Op.I:
                pending.append((p.stage, p.microbatch))
            elif p.op is Op.W:
                assert (p.stage, p.microbatch) == pending.popleft()
        assert not pending


@pytest.mark.parametrize(("n", "m"), [(1, 2), (3, 7), (4, 10)])
def test_dualpipev_overlap_pairs_hold_a_forward_and_a_full_backward(n: int, m: int) -> None:
    pairs = [a for actions in dualpipev(n, m).values() for a in actions if a.op is Op.OVERLAP_F_B]
    assert pairs
    assert all(f.op is Op.F and b.op is Op.B for f, b in (p.parts() for p in pairs))


def test_dualpipev_step_4_on_the_last_rank_starts_with_a_plain_f_then_b() -> None:
    n, m = 4, 10
    last = dualpipev(n, m)[n - 1]
    first_pair = next(i for i, a in enumerate(last) if a.op is Op.OVERLAP_F_B)
    assert [str(a) for a in last[first_pair - 2 : first_pair + 1]] == [
        "3F4",
        "4B0",
        "(4F4;3B0)OVERLAP_F_B",
    ]


@pytest.mark.parametrize(
    ("n", "m", "message"),
    [
        (4, 5, "num_microbatches must be >= 2 * num_ranks = 8 for DualPipeV, got 5"),
        (2, 3, "num_microbatches must be >= 2 * num_ranks = 4 for DualPipeV, got 3"),
        (0, 4, "num_ranks must be >= 1 for DualPipeV, got 0"),
        (-2, 4, "num_ranks must be >= 1 for DualPipeV, got -2"),
        (2, 0, "num_microbatches must be >= 1 for DualPipeV, got 0"),
    ],
)
def test_dualpipev_rejects_bad_sizes_saying_what_is_allowed(n: int, m: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        dualpipev(n, m)
    assert str(info.value) == message


@pytest.mark.parametrize("build", [one_f_one_b, zbv])
@pytest.mark.parametrize(("n", "m"), [(0, 4), (2, 0), (-1, -1)])
def test_baselines_reject_non_positive_sizes(build, n: int, m: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        build(n, m)


def test_golden_dualpipev_n4_m10() -> None:
    text = format_csv(dualpipev(4, 10))
    if os.environ.get("GRAPHPIPE_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text, newline="")
    assert GOLDEN.read_bytes().decode() == text  # byte-exact, \r\n line ends as torch writes
    assert load_csv(GOLDEN) == dualpipev(4, 10)


# --------------------------------------------------------------------------------------------
# Placement and registry


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_v_placement_puts_stage_r_and_2n_minus_1_minus_r_on_rank_r(n: int) -> None:
    placement = Placement.from_style(n, "v", 2)
    assert placement.num_stages == 2 * n
    for r in range(n):
        assert placement.stages_of(r) == (r, 2 * n - 1 - r)
        assert stage_to_rank(r, n, "v") == stage_to_rank(2 * n - 1 - r, n, "v") == r


def test_loop_placement_is_round_robin() -> None:
    assert [stage_to_rank(s, 3, "loop") for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert Placement.from_style(3, "loop").stage_to_rank == (0, 1, 2)


@pytest.mark.parametrize(
    ("args", "match"),
    [((0, 2, "zigzag"), "unknown placement style"), ((8, 4, "v"), "stage must be 0 .. 7")],
)
def test_stage_to_rank_rejects_bad_input(args, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stage_to_rank(*args)


def test_placement_rejects_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="entries"):
        Placement(2, 4, (0, 1, 1))
    with pytest.raises(ValueError, match="outside"):
        Placement(2, 2, (0, 2))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("n", [1, 2, 4])
def test_registry_placement_matches_the_stages_each_rank_runs(name: str, n: int) -> None:
    kind = SCHEDULES[name]
    schedule, placement = kind(n, 2 * n + 1)
    assert placement == kind.placement(n) == Placement.from_schedule(schedule)
    assert placement.num_stages == kind.num_stages(n) == {"1f1b": n}.get(name, 2 * n)


# --------------------------------------------------------------------------------------------
# Baselines


@pytest.mark.parametrize(("n", "m"), [(1, 1), (2, 2), (4, 3), (4, 8), (5, 11)])
def test_one_f_one_b_warms_up_alternates_and_cools_down(n: int, m: int) -> None:
    for rank, actions in one_f_one_b(n, m).items():
        warmup = min(n - rank - 1, m)
        ops = [a.op for a in actions]
        assert ops[:warmup] == [Op.F] * warmup
        assert ops[warmup : warmup + 2 * (m - warmup)] == [Op.F, Op.B] * (m - warmup)
        assert ops[len(ops) - warmup :] == [Op.B] * warmup
        assert [a.microbatch for a in actions if a.op is Op.F] == list(range(m))
        assert [a.microbatch for a in actions if a.op is Op.B] == list(range(m))
        assert {a.stage for a in actions} == {rank}


@pytest.mark.parametrize("n", range(1, 7))
def test_zbv_equals_torchs_order_without_idle_cells(n: int) -> None:
    for m in range(1, 3 * n + 3):
        assert _strings(zbv(n, m)) == as_strings(zbv_rows(n, m)), (n, m)


@pytest.mark.parametrize(("n", "m"), [(1, 1), (2, 3), (3, 6), (4, 11)])
def test_zbv_splits_every_backward_into_i_and_w(n: int, m: int) -> None:
    for rank, actions in zbv(n, m).items():
        counts = Counter((a.stage, a.op) for a in actions)
        for stage in (rank, 2 * n - 1 - rank):
            assert counts[(stage, Op.F)] == counts[(stage, Op.I)] == counts[(stage, Op.W)] == m
        assert not any(a.op in (Op.B, Op.OVERLAP_F_B) for a in actions)
