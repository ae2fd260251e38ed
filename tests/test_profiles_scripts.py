"""The scripts in profiles/ as a user runs them: their defaults work, their argument errors answer
before torch is imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _argument_error(script: str, *argv: str) -> tuple[int, bool, str]:
    """Run ``profiles/SCRIPT ARGV`` to its argument error: (exit status, whether torch had been
    imported by then, stderr)."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{script!r}, *{list(argv)!r}]\n"
        "try:\n"
        f"    runpy.run_path('profiles/{script}', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print(e.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    status, torch_imported = done.stdout.split()
    return int(status), torch_imported == "True", done.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--steps", "1"), "--steps must be >= 2 (the fit needs two steps), got 1"),
        (("--steps", "10", "--skip", "9"), "--skip must be in [0, --steps - 1) = [0, 9), got 9"),
    ],
)
def test_soak_argument_errors_answer_without_torch(argv: tuple[str, ...], message: str) -> None:
    status, torch_imported, err = _argument_error("soak.py", *argv)
    assert status == 2 and message in err, err
    assert not torch_imported


@pytest.mark.distributed
def test_soak_takes_any_step_count_with_its_default_skip() -> None:
    # --skip defaulted to 200, which refused --steps 200 and fewer
    done = subprocess.run(
        [sys.executable, "profiles/soak.py", "--steps", "200", "--part", "idle"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "200 steps (fit over steps 41..200)" in done.stdout, done.stdout
