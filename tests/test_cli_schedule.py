"""``graphpipe schedule``: outputs, statistics, pictures and bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from graphpipe import cli
from graphpipe.cli import main
from graphpipe.schedule.generators import dualpipev
from graphpipe.schedule.ir import format_csv
from tests.torch_oracle import TorchAction, dualpipev_rows

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["schedule", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("n", "m"), [(1, 2), (4, 10), (3, 7)])
def test_csv_is_the_compute_only_csv_and_nothing_else(capsys, n: int, m: int) -> None:
    code, out, _ = _run(capsys, "--ranks", str(n), "--microbatches", str(m), "--format", "csv")
    assert code == 0
    assert out == format_csv(dualpipev(n, m))
    assert len(out.splitlines()) == n
    rows = [[TorchAction.from_str(cell) for cell in row] for row in csv.reader(out.splitlines())]
    oracle = dualpipev_rows(n, m)
    assert rows == [oracle[r] for r in range(n)]


def test_grid_prints_the_grid_the_statistics_and_dualpipes_figures(capsys) -> None:
    code, out, _ = _run(capsys, "--ranks", "4", "--microbatches", "10", "--costs", "FB=2.5")
    assert code == 0
    assert "Rank 0" in out and "Rank 3" in out and "(0F7;7B3)OVERLAP_F_B" in out
    assert "makespan" in out and "peak activations" in out and "peak pending W" in out
    assert "(PP/2-1)(F&B+B-3W)" in out and "PP+1" in out
    ref = next(line for line in out.splitlines() if "(PP/2-1)" in line)
    assert ref.split()[-4:] == ["4.5", "max", "idle", "4.5"]  # (4-1)(2.5+2-3) = 4.5
    assert "pure dataflow makespan" in out and "(no P2P latency exposed)" in out


def test_json_holds_the_statistics(capsys) -> None:
    code, out, _ = _run(capsys, "--ranks", "3", "--microbatches", "8", "--format", "json")
    assert code == 0
    stats = json.loads(out)
    assert stats["schedule"] == "dualpipev" and stats["stages"] == 6
    assert len(stats["per_rank"]) == 3
    assert stats["reference"]["bubble"] == 4.0  # (3-1)(3+2-3)
    assert stats["reference"]["simulated_max_idle"] == 4.0
    assert stats["reference"]["activations"] == 7
    assert stats["dataflow_makespan"] == stats["makespan"]  # no latency: pure dataflow
    assert all(0 <= r["recv_wait"] <= r["idle"] for r in stats["per_rank"])
    assert stats["makespan"] == pytest.approx(
        stats["per_rank"][0]["busy"] + stats["per_rank"][0]["idle"]
    )


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_baselines_run_from_the_command_line(capsys, name: str) -> None:
    code, out, _ = _run(
        capsys, "--ranks", "3", "--microbatches", "5", "--schedule", name, "--format", "json"
    )
    assert code == 0
    assert json.loads(out)["stages"] == {"1f1b": 3, "zbv": 6}[name]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["schedule", "--ranks", "4", "--microbatches", "5"], "num_microbatches must be >= 2"),
        (["schedule", "--ranks", "0", "--microbatches", "4"], "must be >= 1, got 0"),
        (["schedule", "--ranks", "x", "--microbatches", "4"], "expected a whole number"),
        (["schedule", "--ranks", "2"], "required"),
        (["schedule", "--ranks", "2", "--microbatches", "4", "--costs", "Q=1"], "bad cost"),
        (["schedule", "--ranks", "2", "--microbatches", "4", "--schedule", "gpipe"], "choice"),
        (["schedule", "--ranks", "2", "--microbatches", "4", "--out", "x.jpg"], ".svg"),
        ([], "choose a command"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "error:" in err and message in err and "Traceback" not in err


def test_out_writes_a_valid_svg(capsys, tmp_path) -> None:
    picture = tmp_path / "dualpipev.svg"
    code, out, err = _run(
        capsys, "--ranks", "2", "--microbatches", "4", "--format", "csv", "--out", str(picture)
    )
    assert code == 0
    assert out == format_csv(dualpipev(2, 4))  # the picture does not leak into the CSV
    assert f"wrote {picture}" in err
    root = ET.parse(picture).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "rank 0" in texts and "rank 1" in texts
    cells = sum(len(a.parts()) for actions in dualpipev(2, 4).values() for a in actions)
    assert len(list(root.iter("{http://www.w3.org/2000/svg}rect"))) > cells


def test_out_splits_overlapped_pairs_by_the_given_costs(capsys, tmp_path) -> None:
    picture = tmp_path / "p.svg"
    code, _, _ = _run(
        capsys, "--ranks", "2", "--microbatches", "4", "--costs", "F=1,B=3", "--out", str(picture)
    )
    assert code == 0
    svg = "{http://www.w3.org/2000/svg}"
    rects = list(ET.fromstring(picture.read_text()).iter(f"{svg}rect"))
    outlines = [r for r in rects if r.get("fill") == "none" and r.get("stroke-width") == "1.6"]
    boxes = {
        (r.get("x"), r.get("y")): r
        for r in rects
        if r.get("height") == "28.00" and r.get("fill") != "none"
    }
    pair = next(o for o in outlines if o.get("height") == "28.00")
    f_part = boxes[(pair.get("x"), pair.get("y"))]
    assert float(f_part.get("width")) == pytest.approx(float(pair.get("width")) / 4, abs=0.02)


def test_png_without_matplotlib_names_svg_as_the_alternative(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as info:
        main(["schedule", "--ranks", "2", "--microbatches", "4", "--out", str(tmp_path / "p.png")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and ".svg" in err


def test_python_dash_m_graphpipe_runs_the_cli() -> None:
    args = ["schedule", "--ranks", "2", "--microbatches", "4", "--format", "csv"]
    done = subprocess.run(
        [sys.executable, "-m", "graphpipe", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.replace("\r\n", "\n") == format_csv(dualpipev(2, 4)).replace("\r\n", "\n")


def test_a_grid_too_big_to_read_is_a_note_unless_full(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "_FULL_LIMIT", 10)
    schedule = dualpipev(2, 4)
    cells, steps = sum(map(len, schedule.values())), max(map(len, schedule.values()))
    code, out, _ = _run(capsys, "--ranks", "2", "--microbatches", "4")
    assert code == 0
    note = next(line for line in out.splitlines() if line.startswith("(the grid"))
    assert f"2 ranks x {steps} steps, {cells} cells" in note
    assert "more than 10; --full prints it" in note
    assert "Step 0" not in out and "makespan" in out and "peak activations" in out
    code, full, _ = _run(capsys, "--ranks", "2", "--microbatches", "4", "--full")
    assert code == 0 and "Step 0" in full and "(the grid" not in full


def test_a_picture_too_big_to_read_is_refused_unless_full(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cli, "_FULL_LIMIT", 10)
    picture = tmp_path / "p.svg"
    with pytest.raises(SystemExit) as info:
        main(["schedule", "--ranks", "2", "--microbatches", "4", "--out", str(picture)])
    assert info.value.code == 2
    _, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "--full draws it anyway" in err
    assert not picture.exists()
    code, _, err = _run(
        capsys, "--ranks", "2", "--microbatches", "4", "--out", str(picture), "--full"
    )
    assert code == 0 and picture.exists()


def test_help_says_what_full_does(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--full" in out and f"more than {cli._FULL_LIMIT} cells" in out
