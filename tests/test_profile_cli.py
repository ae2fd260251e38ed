"""``graphpipe profile``: end to end on spawned gloo ranks, ``--from-nsys``, bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from graphpipe.cli import main
from graphpipe.profile.quiet import kineto_info_dropped
from graphpipe.schedule.generators import dualpipev
from graphpipe.schedule.simulate import Costs
from tests.profile_traces import nsys_export, simulated_spans

SVG = "{http://www.w3.org/2000/svg}"
TINY = ["--hidden", "16", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "8"]


def _check_report(report: dict, n: int, m: int) -> None:
    """The invariants every report of a DualPipeV run with visible actions keeps."""
    assert report["ranks"] == n and report["microbatches"] == m
    schedule = dualpipev(n, m)
    for r in report["per_rank"]:
        assert r["visible"] == "actions"
        assert r["busy_s"] + r["idle_s"] == pytest.approx(r["step_s"], rel=1e-12)
        assert 0 < r["busy_s"] <= r["step_s"]
        assert 0 <= r["bubble_fraction"] < 1
        assert 0 <= r["comm_wait_s"] <= r["step_s"]
        assert set(r["actions"]) == {str(a) for a in schedule[r["rank"]]}
        assert all(sec > 0 for sec in r["actions"].values())
    waits = any(r["comm_wait_s"] > 0 for r in report["per_rank"])
    assert report["comm_wait_ranges_found"] or not waits
    if not report["comm_wait_ranges_found"]:
        assert any("no 'wait ...' ranges found" in note for note in report["notes"])
    sim = report["simulated"]
    assert sim["available"] and sim["makespan_s"] > 0
    assert [s["rank"] for s in sim["per_rank"]] == list(range(n))
    assert set(sim["stage_costs_s"]) == {str(s) for s in range(2 * n)}


def _check_svg(path: Path, n: int) -> None:
    root = ET.fromstring(path.read_text())
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert any(t.startswith("measured") for t in texts)
    assert any(t.startswith("simulated") for t in texts)
    for r in range(n):
        assert texts.count(f"rank {r}") == 2  # a row in each section
    assert texts.count("time (ms)") == 1  # one time axis


@pytest.mark.distributed
def test_profile_two_ranks_writes_traces_report_timeline_and_table(tmp_path: Path) -> None:
    out = tmp_path / "prof"
    proc = subprocess.run(
        [sys.executable, "-m", "graphpipe", "profile", "--ranks", "2", "--steps", "2"]
        + ["--warmup", "1", *TINY, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("trace_rank0.json", "trace_rank1.json", "report.json", "timeline.svg"):
        assert (out / name).is_file(), name
    trace = json.loads((out / "trace_rank1.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step"} | {str(a) for a in dualpipev(2, 8)[1]} <= names  # the runtime's ranges
    report = json.loads((out / "report.json").read_text())
    _check_report(report, 2, 8)
    assert report["steps_analysed"] == 2
    assert report["source"]["kind"] == "torch.profiler" and report["source"]["clock"] == "host"
    _check_svg(out / "timeline.svg", 2)
    lines = proc.stdout.splitlines()
    assert lines[1].split()[:5] == ["rank", "step", "busy", "idle", "bubble"]
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"]
    assert proc.stderr.splitlines()[-1] == (
        f"graphpipe profile: wrote trace_rank0.json, trace_rank1.json, report.json and "
        f"timeline.svg in {out}"
    )
    assert "profiler_start" not in proc.stdout + proc.stderr  # kineto's log lines
    assert "USDT:" not in proc.stdout + proc.stderr


@pytest.mark.distributed
@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_profile_with_data_parallel_replicas_traces_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "prof"
    proc = subprocess.run(
        [sys.executable, "-m", "graphpipe", "profile", "--ranks", "1", "--dp", "2"]
        + ["--steps", "1", "--warmup", "1", *TINY, "--layers", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 ranks x 2 stages x 2 replicas" in proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["ranks"] == 1 and report["source"]["dp"] == 2
    assert report["source"]["files"] == ["trace_rank0.json", "trace_rank1.json"]
    assert any(note.startswith("--dp 2: the figures are replica 0's") for note in report["notes"])
    assert proc.stderr.splitlines()[-1].startswith(
        "graphpipe profile: wrote trace_rank0.json, trace_rank1.json, report.json and"
    )


def test_from_nsys_writes_the_same_outputs(tmp_path: Path, capsys) -> None:
    spans, _ = simulated_spans(2, 4, Costs(F=1, B=2, I=1, W=1))
    for rank in spans:  # three steps; the analysis takes the last two
        spans[rank] += [
            (name, s + k * 100, e + k * 100) for k in (1, 2) for name, s, e in spans[rank]
        ]
    db = nsys_export(tmp_path / "run.sqlite", spans, pids={0: 31, 1: 30})
    code = main(["profile", "--from-nsys", str(db), "--steps", "2", "--out", str(tmp_path / "o")])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    _check_report(report, 2, 4)
    assert report["steps_analysed"] == 2
    assert report["source"] == {"kind": "nsys", "file": str(db), "clock": "host"}
    assert report["simulated"]["measured_step_over_simulated"] == pytest.approx(1.0)
    _check_svg(tmp_path / "o" / "timeline.svg", 2)
    assert out.splitlines()[1].split()[0] == "rank"
    assert not (tmp_path / "o" / "trace_rank0.json").exists()  # nothing ran
    assert err.splitlines()[-1] == (
        f"graphpipe profile: wrote report.json and timeline.svg in {tmp_path / 'o'}"
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--microbatches", "3"], "--microbatches must be >= 2 * --ranks = 4, got 3"),
        (["--clock", "gpu"], "--clock gpu needs --device cuda (a CPU run has no GPU clock)"),
        (["--from-nsys", "/no/such.sqlite"], "nsys export /no/such.sqlite: no such file"),
    ],
)
def test_bad_profile_arguments_exit_2_with_one_line(args, message, tmp_path, capsys) -> None:
    code = main(["profile", *args, "--out", str(tmp_path / "o")])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"graphpipe profile: error: {message}"
    assert not (tmp_path / "o").exists()


def test_out_must_be_a_directory(tmp_path: Path, capsys) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["profile", "--out", str(f)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"graphpipe profile: error: --out {f}: exists and is not a directory"
    )


def test_out_is_required(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["profile"])
    assert e.value.code == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err


def test_kineto_info_lines_are_dropped_from_fd_2_and_the_rest_kept(capfd) -> None:
    info = "USDT:2026-12-01 08:48:02 22867:22867 SyncActivityProfilerHandler.cpp:52] start\n"
    stage = "STAGE:2024-01-02 03:04:05 1:2 ActivityProfilerController.cpp:312] Completed\n"
    warning = "WARNING:2026-12-01 08:48:02 1:1 CuptiActivityProfiler.cpp:9] no CUPTI\n"
    with kineto_info_dropped():
        os.write(2, (info + "a line of our own\n" + stage + warning).encode())
    assert capfd.readouterr().err == "a line of our own\n" + warning
