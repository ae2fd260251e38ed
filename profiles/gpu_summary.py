"""The JSON summary of ``profiles/gpu_check.sh``: one record per check, merged into one file.

The runner (``profiles/gpu_check.py``) runs each check as one command within its budget and
then calls ``record_check``, which reads what the check left in ``WORK`` under its name
(``NAME.log``, the figures the command wrote to ``NAME.figures.json``, pytest's ``NAME.xml``
JUnit report) and writes ``WORK/NAME.json``: name, status (``passed`` / ``failed`` /
``skipped``), seconds, budget, its figures. ``skipped_check`` records a check that was not
started (``skipped_for_time`` when its budget did not fit), ``install`` installs the project
(itself a check: ``python3 profiles/gpu_summary.py install ...``), and ``merge`` makes the one
summary:

    {"status": ..., "passed": n, "failed": n, "skipped": n, "seconds": s, "budget_s": s,
     "host": {...}, "checks": [...]}

Only the standard library is imported, except in ``host_info`` (torch, triton when present).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

STATUSES = ("passed", "failed", "skipped")
TIMEOUT_RCS = (124, 137)  # timeout(1): the limit was reached (137: killed after the grace)
LOG_TAIL_LINES = 40


def parse_junit(path: str | Path) -> dict[str, Any]:
    """Counts and per-test outcomes from a pytest JUnit XML report.

    Returns ``{"tests", "passed", "failed", "skipped", "outcomes": {test: outcome},
    "messages": {test: first line of the failure or skip message}}``; errors count as failed.
    """
    root = ET.parse(path).getroot()
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message") or (child.text or "")
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message") or ""
        outcomes[test] = outcome
        if message and message.strip():
            messages[test] = message.strip().splitlines()[0][:300]
    counts = {s: sum(o == s for o in outcomes.values()) for s in STATUSES}
    return {"tests": len(outcomes), **counts, "outcomes": outcomes, "messages": messages}


def status_of(rc: int, figures: dict[str, Any] | None, junit: dict[str, Any] | None) -> str:
    """A check's status from its exit code, its figures and its JUnit report.

    Failed: it timed out, exited non-zero, or pytest reported a failure. Skipped: it exited 0
    but said it could not run (``{"skipped": reason}`` in its figures, or every test it
    collected was skipped). Passed otherwise.
    """
    if rc != 0 or (junit is not None and junit["failed"] > 0):
        return "failed"
    if figures is not None and isinstance(figures.get("skipped"), str):
        return "skipped"
    if junit is not None and (junit["tests"] == 0 or junit["skipped"] == junit["tests"]):
        return "skipped"
    return "passed"


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return {"unreadable_figures": f"{path.name}: {exc}"}


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def check_record(
    name: str,
    rc: int,
    seconds: float,
    budget_s: float | None,
    figures: dict[str, Any] | None = None,
    junit: dict[str, Any] | None = None,
    log_tail: str = "",
) -> dict[str, Any]:
    """One check's entry in the summary (``budget_s``: its budget, which was also its time
    limit). The log tail is kept only for a failed check."""
    status = status_of(rc, figures, junit)
    record: dict[str, Any] = {
        "name": name,
        "status": status,
        "seconds": round(seconds, 1),
        "budget_s": budget_s,
        "skipped_for_time": False,
        "rc": rc,
        "timed_out": rc in TIMEOUT_RCS,
        "figures": dict(figures or {}),
    }
    if junit is not None:
        record["figures"]["tests"] = {
            k: junit[k] for k in ("tests", "passed", "failed", "skipped", "outcomes", "messages")
        }
    if status == "skipped" and figures and isinstance(figures.get("skipped"), str):
        record["reason"] = figures["skipped"]
    elif status == "skipped" and junit is not None:
        reasons = sorted(set(junit["messages"].values()))
        record["reason"] = "; ".join(reasons) if reasons else "no tests collected"
    if status == "failed":
        record["log_tail"] = log_tail
    return record


def record_check(
    work: Path, name: str, rc: int, started: float, budget_s: float | None
) -> dict[str, Any]:
    """Build the entry of check ``name`` from what it left in ``work``; write NAME.json."""
    junit_path = work / f"{name}.xml"
    junit = parse_junit(junit_path) if junit_path.exists() else None
    rec = check_record(
        name,
        rc,
        time.time() - started,
        budget_s,
        figures=_read_json(work / f"{name}.figures.json"),
        junit=junit,
        log_tail=_tail(work / f"{name}.log"),
    )
    return _write(work, rec)


def skipped_check(
    work: Path, name: str, reason: str, budget_s: float | None = None, for_time: bool = False
) -> dict[str, Any]:
    """The entry of a check that was not started (``for_time``: its budget did not fit)."""
    rec = {
        "name": name,
        "status": "skipped",
        "seconds": 0.0,
        "budget_s": budget_s,
        "skipped_for_time": for_time,
        "reason": reason,
        "figures": {},
    }
    return _write(work, rec)


def _write(work: Path, rec: dict[str, Any]) -> dict[str, Any]:
    rec["ended"] = time.time()  # the summary lists the checks in the order they ended
    (work / f"{rec['name']}.json").write_text(json.dumps(rec, indent=1, default=str))
    return rec


def merge(
    records: list[dict[str, Any]],
    host: dict[str, Any],
    budget_s: float | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """The summary: overall status (failed if any check failed, else passed if any passed,
    else skipped), counts, the run's seconds and budget, the host and the checks in the order
    they ran."""
    checks = sorted(records, key=lambda r: r.get("ended", 0.0))
    counts = {s: sum(r["status"] == s for r in checks) for s in STATUSES}
    if counts["failed"]:
        status = "failed"
    elif counts["passed"]:
        status = "passed"
    else:
        status = "skipped"
    run = {"seconds": None if seconds is None else round(seconds, 1), "budget_s": budget_s}
    return {"status": status, **counts, **run, "host": host, "checks": checks}


def load_records(work: Path) -> list[dict[str, Any]]:
    return [
        json.loads(p.read_text())
        for p in sorted(work.glob("*.json"))
        if not p.name.endswith(".figures.json")
    ]


def host_info() -> dict[str, Any]:
    """Python, torch, triton, CUDA and the GPUs (``nvidia-smi -L``), each where available."""
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name()
            info["capability"] = list(torch.cuda.get_device_capability())
    except Exception as exc:  # reported, not raised: the summary must still be written
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:
        info["triton_error"] = f"{type(exc).__name__}: {exc}"
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"not run: {exc}"
    info["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return info


def install(repo: Path, figures_path: Path, pip_timeout: float) -> int:
    """Install the project without a registry; fall back to the repository on ``PYTHONPATH``.

    ``pip install --no-deps --no-build-isolation --no-index -e .`` uses the setuptools already
    installed and fetches nothing. ``graphpipe.kernels`` lives in ``graphpipe/kernels``, so
    if the install fails the checks still import it with the repository root on
    ``PYTHONPATH`` (gpu_check.py sets it). Returns 0 when ``graphpipe.kernels`` imports.
    """
    figures: dict[str, Any] = {}
    try:
        import setuptools

        figures["setuptools"] = setuptools.__version__
    except ImportError:
        figures["setuptools"] = None
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "-e", str(repo)]
    try:
        pip = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=pip_timeout)
        figures["pip_rc"] = pip.returncode
        print(pip.stdout[-3000:], pip.stderr[-3000:], sep="\n")
    except subprocess.TimeoutExpired:
        figures["pip_rc"] = "timeout"

    def kernels_import() -> str | None:
        probe = "import graphpipe.kernels as k; print(k.__file__)"
        res = subprocess.run(
            [sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True, timeout=120
        )
        print(res.stdout, res.stderr, sep="\n")
        return res.stdout.strip().splitlines()[-1] if res.returncode == 0 else None

    found = kernels_import() if figures["pip_rc"] == 0 else None
    figures["method"] = "pip editable install"
    if found is None:
        figures["method"] = "fallback: the repository on PYTHONPATH"
        found = kernels_import()
    figures["graphpipe_kernels"] = found
    figures_path.write_text(json.dumps(figures, indent=1))
    return 0 if found else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help="install the project (a check of its own)")
    inst.add_argument("--repo", required=True, type=Path)
    inst.add_argument("--figures", required=True, type=Path)
    inst.add_argument("--pip-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    return install(args.repo, args.figures, args.pip_timeout)


if __name__ == "__main__":
    raise SystemExit(main())
