"""The IR's string and CSV forms: round trips, and compatibility with torch's in both ways."""

from __future__ import annotations

import csv

import pytest

from graphpipe.schedule.generators import SCHEDULES, dualpipev, zbv
from graphpipe.schedule.ir import Action, Op, dump_csv, format_csv, load_csv, parse_csv
from graphpipe.schedule.lower import lower
from tests.torch_oracle import TorchAction, dualpipev_rows, zbv_rows

SIZES = [(1, 2), (2, 4), (2, 7), (3, 6), (4, 10), (5, 13)]


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_every_dualpipev_action_round_trips_through_its_string(n: int, m: int) -> None:
    for actions in dualpipev(n, m).values():
        for action in actions:
            assert Action.parse(str(action)) == action
            for part in action.parts():
                assert Action.parse(str(part)) == part


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_every_comm_action_round_trips_through_its_string(n: int, m: int) -> None:
    schedule, placement = SCHEDULES["dualpipev"](n, m)
    comms = [c for steps in lower(schedule, placement).values() for s in steps for c in s.comms]
    assert all(c.is_comm for c in comms)
    assert [Action.parse(str(c)) for c in comms] == comms


def test_overlap_pair_string_is_torchs_notation() -> None:
    pair = Action.overlap(Action(0, Op.F, 5), Action(7, Op.B, 2))
    assert str(pair) == "(0F5;7B2)OVERLAP_F_B"
    assert pair.parts() == (Action(0, Op.F, 5), Action(7, Op.B, 2))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "F3",
        "0X3",
        "0F",
        "-1F0",
        "0F3x",
        "0 F 3",
        "(0F1)OVERLAP_F_B",
        "(0F1;7B2;3B1)OVERLAP_F_B",
        "(7B2;0F1)OVERLAP_F_B",
        "(0F1;7W2)OVERLAP_F_B",
        "(0F1;7B2)",
    ],
)
def test_bad_action_strings_raise_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_csv_round_trip_ours_to_ours(n: int, m: int, tmp_path) -> None:
    schedule = dualpipev(n, m)
    assert parse_csv(format_csv(schedule)) == schedule
    dump_csv(schedule, tmp_path / "s.csv")
    assert load_csv(tmp_path / "s.csv") == schedule


def _write_like_torch_dump_csv(path, rows: dict[int, list]) -> None:
    """What torch's ``_dump_csv(..., format="compute_only")`` does with pipeline_order."""
    with open(path, "w", newline="") as csvfile:
        writer = csv.writer(csvfile)
        for rank in rows:
            writer.writerow(rows[rank])


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_csv_written_by_torch_loads_here(n: int, m: int, tmp_path) -> None:
    path = tmp_path / "torch.csv"
    _write_like_torch_dump_csv(path, dualpipev_rows(n, m))
    assert load_csv(path) == dualpipev(n, m)


@pytest.mark.parametrize(("n", "m"), [(2, 2), (3, 4), (4, 9)])
def test_torch_csv_with_idle_cells_loads_without_them(n: int, m: int, tmp_path) -> None:
    rows = zbv_rows(n, m)
    assert any(a is None for actions in rows.values() for a in actions)  # idle cells present
    path = tmp_path / "zbv.csv"
    _write_like_torch_dump_csv(path, rows)
    assert load_csv(path) == zbv(n, m)


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_our_csv_parses_with_torchs_action_from_str(n: int, m: int) -> None:
    rows = list(csv.reader(format_csv(dualpipev(n, m)).splitlines()))
    theirs = [[TorchAction.from_str(cell) for cell in row] for row in rows]
    oracle = dualpipev_rows(n, m)
    assert theirs == [oracle[r] for r in range(n)]
