"""``profiles/gpu_check.sh`` and its JSON summary, on CPU.

The summary writer (``profiles/gpu_summary.py``) is tested on made-up check outputs, the
runner's budgeting (``profiles/gpu_check.py``: order, skip-for-time, the time limit, the
seconds in the JSON) with stand-in checks, and the script itself is run end to end with two
of its checks selected: without CUDA both skip, and the summary must say so and the script
exit 0. No GPU result is claimed here.
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


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "profiles" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_summary = _load("gpu_summary")
gpu_check = _load("gpu_check")

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
    late = gpu_summary.skipped_check(work, "bandwidth", "10 s left of 420 s", 60, for_time=True)

    assert failed["status"] == "failed" and failed["seconds"] >= 2.0 and failed["budget_s"] == 60
    assert failed["figures"]["t::x"] == {"max_abs_diff": 1e-7}
    assert failed["figures"]["tests"]["failed"] == 2
    assert failed["log_tail"].splitlines()[-1] == "line 99"
    assert len(failed["log_tail"].splitlines()) == gpu_summary.LOG_TAIL_LINES
    assert skipped["status"] == "skipped" and skipped["reason"] == "CUDA is not available"
    assert "log_tail" not in skipped
    assert late["status"] == "skipped" and late["skipped_for_time"] and late["budget_s"] == 60
    assert not skipped["skipped_for_time"] and not failed["skipped_for_time"]

    summary = gpu_summary.merge(gpu_summary.load_records(work), {"python": "3.x"}, 420, 12.34)
    assert [c["name"] for c in summary["checks"]] == ["capture", "sweep", "bandwidth"]
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (0, 1, 2)
    assert summary["status"] == "failed"
    assert (summary["seconds"], summary["budget_s"]) == (12.3, 420)
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


def _stand_in(name: str, budget_s: int, code: str, junit: bool = False):
    if junit:  # a pytest stand-in: one passing test file, run with --junitxml appended
        return gpu_check.Check(
            name,
            budget_s,
            "stand-in",
            (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", code),
            junit=True,
        )
    return gpu_check.Check(name, budget_s, "stand-in", (sys.executable, "-c", code))


def test_runner_orders_checks_skips_for_time_and_records_durations(tmp_path):
    """Stand-in checks within a 40 s budget: each runs in plan order; one that overruns is
    killed at its budget (failed, timed out); one whose budget exceeds what is left is never
    started (no marker file) and is skipped for time; a later, smaller one still runs."""
    work, marker = tmp_path / "work", tmp_path / "started"
    work.mkdir()
    test_file = tmp_path / "test_stand_in.py"
    test_file.write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    figures = "import json, os; json.dump({'x': 1}, open(os.environ['GPU_CHECK_FIGURES'], 'w'))"
    checks = [
        _stand_in("first", 20, figures),
        _stand_in("overrun", 2, "import time; time.sleep(60)"),
        _stand_in("too_big", 1000, f"open({str(marker)!r}, 'w')"),
        _stand_in("junit", 20, str(test_file), junit=True),
        _stand_in("not_selected", 5, f"open({str(marker)!r}, 'w')"),
    ]
    summary = gpu_check.run_checks(
        checks,
        work,
        40,
        dict(os.environ),
        only=["first", "overrun", "too_big", "junit"],
        host=lambda: {"stand": "in"},
    )
    by_name = {c["name"]: c for c in summary["checks"]}
    assert [c["name"] for c in summary["checks"]] == ["first", "overrun", "too_big", "junit"]
    assert not marker.exists()  # neither the skipped nor the unselected check started
    first, overrun, big, junit = (by_name[n] for n in ("first", "overrun", "too_big", "junit"))
    assert (first["status"], first["figures"], first["budget_s"]) == ("passed", {"x": 1}, 20)
    assert overrun["status"] == "failed" and overrun["timed_out"] and overrun["rc"] == 124
    assert overrun["seconds"] >= 2  # it ran up to its budget, not the 60 s it asked for
    assert big["status"] == "skipped" and big["skipped_for_time"] and big["seconds"] == 0.0
    assert big["reason"].startswith("skipped for time: its budget is 1000 s and ")
    assert junit["status"] == "passed" and junit["figures"]["tests"]["passed"] == 1
    assert all(isinstance(c["seconds"], float) and c["seconds"] >= 0 for c in by_name.values())
    assert summary["budget_s"] == 40 and summary["seconds"] >= overrun["seconds"]
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (2, 1, 1)
    assert summary["host"] == {"stand": "in"}
    with pytest.raises(ValueError, match="no_such_check"):
        gpu_check.run_checks(checks, work, 40, {}, only=["no_such_check"])


def test_the_plan_is_in_order_of_value_and_the_first_checks_always_fit():
    names = [c.name for c in gpu_check.CHECKS]
    assert names == [
        "install",
        "capture_llama",
        "kernels_in_graph",
        "nccl_capture",
        "action_ranges",
        "replay_sweep",
        "kernel_bandwidth",
        "moe_capture",
        "kernel_tests",
    ]
    assert all(c.estimate and 0 < c.budget_s <= 300 for c in gpu_check.CHECKS)
    # the install and the three captures (model, kernels, NCCL) start whatever happens before
    first = sum(c.budget_s for c in gpu_check.CHECKS[:4])
    assert first <= gpu_check.DEFAULT_BUDGET_S, first
    # and the run, the summary included, stays within 8 minutes
    assert gpu_check.DEFAULT_BUDGET_S + 60 <= 8 * 60
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        gpu_check.Check("x", 0, "none", ("true",))


def test_script_parses_as_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # the whole GPU-check script, on CPU: the slow lane
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
