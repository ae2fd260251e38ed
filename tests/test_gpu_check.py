"""``profiles/gpu_check.sh`` and its JSON summary, on CPU.

The summary writer (``profiles/gpu_summary.py``) is tested on made-up check outputs, and the
script itself is run end to end with two of its checks selected: without CUDA both skip, and
the summary must say so and the script exit 0. No GPU result is claimed here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "profiles" / "gpu_check.sh"

_spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "profiles" / "gpu_summary.py")
assert _spec is not None and _spec.loader is not None
gpu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_summary)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.gpu.test_a" name="test_ok" time="1.0"/>
<testcase classname="tests.gpu.test_a" name="test_skip" time="0.0">
  <skipped type="pytest.skip" message="needs CUDA">skip</skipped></testcase>
<testcase classname="tests.gpu.test_a" name="test_bad" time="0.5">
  <failure message="AssertionError: 3 != 4&#10;more">trace</failure></testcase>
<testcase classname="tests.gpu.test_b" name="test_err" time="0.1">
  <error message="fixture failed">trace</error></testcase>
</testsuite></testsuites>
"""


def _junit(tmp_path: Path, body: str = JUNIT) -> Path:
    path = tmp_path / "check.xml"
    path.write_text(body)
    return path


def test_junit_report_counts_outcomes_and_keeps_first_message_lines(tmp_path):
    junit = gpu_summary.parse_junit(_junit(tmp_path))
    assert (junit["tests"], junit["passed"], junit["failed"], junit["skipped"]) == (4, 1, 2, 1)
    assert junit["outcomes"]["tests.gpu.test_a::test_skip"] == "skipped"
    assert junit["outcomes"]["tests.gpu.test_b::test_err"] == "failed"
    assert junit["messages"]["tests.gpu.test_a::test_bad"] == "AssertionError: 3 != 4"


@pytest.mark.parametrize(
    ("rc", "figures", "junit", "status"),
    [
        (0, {"max_abs_diff": 0.0}, None, "passed"),
        (0, {"skipped": "CUDA is not available"}, None, "skipped"),
        (1, {"skipped": "CUDA is not available"}, None, "failed"),
        (124, None, None, "failed"),
        (0, None, {"tests": 2, "passed": 0, "failed": 0, "skipped": 2}, "skipped"),
        (0, None, {"tests": 2, "passed": 1, "failed": 0, "skipped": 1}, "passed"),
        (0, None, {"tests": 2, "passed": 1, "failed": 1, "skipped": 0}, "failed"),
        (5, None, {"tests": 0, "passed": 0, "failed": 0, "skipped": 0}, "failed"),
    ],
)
def test_status_rules(rc, figures, junit, status):
    assert gpu_summary.status_of(rc, figures, junit) == status


def test_records_and_merge_order_counts_and_overall_status(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # a pytest check with a failure, its figures file and its log
    shutil.copy(_junit(tmp_path), work / "capture.xml")
    (work / "capture.figures.json").write_text(json.dumps({"t::x": {"max_abs_diff": 1e-7}}))
    (work / "capture.log").write_text("\n".join(f"line {i}" for i in range(100)))
    failed = gpu_summary.record_check(work, "capture", 1, time.time() - 2.0, 60)
    # a script check that reports it could not run, then one that never started
    (work / "sweep.figures.json").write_text(json.dumps({"skipped": "CUDA is not available"}))
    skipped = gpu_summary.record_check(work, "sweep", 0, time.time(), 90)
    late = gpu_summary.skipped_check(work, "bandwidth", "only 10 s left of the 420 s budget")

    assert failed["status"] == "failed" and failed["seconds"] >= 2.0 and failed["limit_s"] == 60
    assert failed["figures"]["t::x"] == {"max_abs_diff": 1e-7}
    assert failed["figures"]["tests"]["failed"] == 2
    assert failed["log_tail"].splitlines()[-1] == "line 99"
    assert len(failed["log_tail"].splitlines()) == gpu_summary.LOG_TAIL_LINES
    assert skipped["status"] == "skipped" and skipped["reason"] == "CUDA is not available"
    assert "log_tail" not in skipped
    assert late["status"] == "skipped" and "budget" in late["reason"]

    summary = gpu_summary.merge(gpu_summary.load_records(work), {"python": "3.x"})
    assert [c["name"] for c in summary["checks"]] == ["capture", "sweep", "bandwidth"]
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (0, 1, 2)
    assert summary["status"] == "failed"
    assert summary["host"] == {"python": "3.x"}
    json.dumps(summary)  # serialisable as written


def test_overall_status_is_skipped_only_when_nothing_ran():
    def rec(name, status, ended):
        return {"name": name, "status": status, "ended": ended}

    assert gpu_summary.merge([rec("a", "skipped", 1), rec("b", "skipped", 2)], {})["status"] == (
        "skipped"
    )
    assert gpu_summary.merge([rec("a", "passed", 1), rec("b", "skipped", 2)], {})["status"] == (
        "passed"
    )


def test_unreadable_figures_are_reported_not_raised(tmp_path):
    (tmp_path / "x.figures.json").write_text("{not json")
    rec = gpu_summary.record_check(tmp_path, "x", 0, time.time(), None)
    assert "unreadable_figures" in rec["figures"]


def test_script_parses_as_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_script_runs_its_checks_without_cuda_and_writes_one_summary(tmp_path):
    """Two checks (a pytest one and a script one) through the real script: both skip without
    CUDA, the summary says so, and the script exits 0. This interpreter's python3 runs it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA these checks would run for real: see profiles/gpu_check.sh")
    bindir = Path(sys.executable).parent
    if not (bindir / "python3").exists():
        pytest.skip(f"no python3 next to {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_FIGURES")}
    env.update(
        PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        GPU_CHECK_ONLY="nccl_capture,replay_sweep",
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [c["name"] for c in summary["checks"]] == ["nccl_capture", "replay_sweep"]
    assert [c["status"] for c in summary["checks"]] == ["skipped", "skipped"]
    assert "needs CUDA" in summary["checks"][0]["reason"]
    assert summary["checks"][1]["reason"] == "CUDA is not available"
    assert summary["status"] == "skipped"
    assert summary["host"]["cuda_available"] is False
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    assert "overall: skipped" in proc.stdout
