"""The command line answers ``--help``, ``--version`` and argument errors without importing
torch, numpy or triton (those take seconds to import on a busy machine).

Each call runs ``graphpipe.cli.main`` in a fresh interpreter that then reports which of
them ``sys.modules`` holds. No timing assertions: what is imported decides the time.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graphpipe
from graphpipe.cli import _SUBCOMMANDS

# Runs main(ARGV) and writes its exit status, its stdout and stderr, and the heavy modules it
# loaded, as JSON, to REPORT:  python -c _WRAPPER ARGV-as-JSON REPORT
_WRAPPER = """
import contextlib, io, json, sys
argv, report = json.loads(sys.argv[1]), sys.argv[2]
err, out = io.StringIO(), io.StringIO()
from graphpipe.cli import main
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "triton"))
with open(report, "w") as f:
    json.dump({"code": code, "err": err.getvalue(), "out": out.getvalue(), "heavy": heavy}, f)
"""


def _run(argv: list[str], tmp_path: Path) -> dict:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, json.dumps(argv), str(report)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(report.read_text())


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"]] + [[name, "--help"] for name in _SUBCOMMANDS],
    ids=" ".join,
)
def test_help_and_version_import_no_torch(argv: list[str], tmp_path: Path) -> None:
    got = _run(argv, tmp_path)
    assert got["code"] == 0, got["err"]
    assert got["heavy"] == []
    if argv == ["--version"]:  # torch's version read without importing it
        # torch/version.py's __version__, which carries the build's local label (2.11.0+cu130)
        # where pip's metadata may not (2.11.0): the same release either way
        torch = re.escape(importlib.metadata.version("torch").split("+")[0])
        want = rf"graphpipe {re.escape(graphpipe.__version__)} \(torch {torch}(\+[\w.]+)?\)\n"
        assert re.fullmatch(want, got["out"]), got["out"]
    else:
        assert got["out"].startswith("usage: graphpipe")


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no command
        ["nope"],
        ["schedule", "--ranks", "0", "--microbatches", "4"],
        ["train", "--ranks", "two"],
        ["train", "--ranks", "4", "--layers", "4"],  # a check after parsing
        ["train", "--metrics", "/no/such/dir/m.jsonl"],
        ["bench", "--steps", "0"],
        ["bench", "--microbatches", "3"],
        ["profile"],  # --out is required
        ["profile", "--out", "/tmp/x", "--steps", "0"],
        ["bench", "--json", "/nonexistent/dir/b.json"],  # an output path (cmdline.outputs)
        ["profile", "--out", "/proc/nope/prof"],
        ["train", "--checkpoint-dir", "/proc"],
        ["export", "/tmp", "/proc/x.pt"],
        # sizes whose estimated memory is above the machine's (graphpipe.schedule.footprint)
        ["schedule", "--ranks", "2", "--microbatches", "1000000000"],
        ["schedule", "--ranks", "100000", "--microbatches", "200000"],
        ["bench", "--ranks", "2", "--microbatches", "1000000000"],
        [
            "profile",
            "--out",
            "/tmp/x",
            "--microbatches",
            "1000000000",
            "--batch-size",
            "2000000000",
        ],
        ["plan", "--memory-budget", "lots"],
        ["plan", "--hf", "/no/such/config"],  # a check after parsing
        ["plan", "--batch-size", "10", "--microbatches", "4"],
    ],
    ids=lambda argv: " ".join(argv) or "(no command)",
)
def test_an_argument_error_is_one_line_with_status_2_and_no_torch(
    argv: list[str], tmp_path: Path
) -> None:
    got = _run(argv, tmp_path)
    assert got["code"] == 2
    lines = got["err"].splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], got["err"]
    assert got["heavy"] == []
