"""``graphpipe train --resume`` over damaged checkpoints: it falls back to the newest one that
verifies, naming each one it skipped and why, and resumes bit for bit from it; with
checkpoints of which none verifies it is a one-line error, exit status 1.

One real two-rank run makes the checkpoints of steps 2 and 4 (and the reference losses);
each test damages a copy.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graphpipe.checkpoint import verify_checkpoint
from graphpipe.cli import main
from tests.test_checkpoint import DAMAGE

pytestmark = pytest.mark.distributed

TINY = ["--hidden", "16", "--layers", "2", "--heads", "2", "--seq-len", "16", "--no-kernels"]


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphpipe", "train", *TINY, *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[tuple[int, float]]]:
    """Checkpoints of steps 2 and 4 of a two-rank run, and its losses of steps 1-4 (saving
    does not change them: ``tests/test_train_cli.py`` compares resumed runs with runs that
    never saved)."""
    root = tmp_path_factory.mktemp("saved")
    metrics = root / "m.jsonl"
    proc = _train(
        *("--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(root / "c")),
        *("--metrics", str(metrics)),
    )
    assert proc.returncode == 0, proc.stderr
    return root / "c", _losses(metrics)


def _copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "c"))


def _main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    try:
        code = main(["train", *TINY, *argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_skips_a_damaged_checkpoint_and_names_it(saved, tmp_path, capsys, kind) -> None:
    name, damage, says = DAMAGE[kind]
    root = _copy(saved[0], tmp_path)
    damage(root / "step-00000004" / name.replace("__0_", "__1_"))  # rank 1's file
    code, err = _main(["--steps", "2", "--checkpoint-dir", str(root), "--resume"], capsys)
    skipped = [line for line in err.splitlines() if "skipped" in line]
    assert len(skipped) == 1, err
    prefix = f"graphpipe train: --resume: skipped {root / 'step-00000004'}: "
    assert skipped[0].startswith(prefix)
    assert re.match(says.replace("__0_", "__1_"), skipped[0][len(prefix) :]), skipped[0]
    assert code == 0 and "is at step 2, --steps is 2: nothing to do" in err


def test_resume_falls_back_and_reproduces_the_uninterrupted_losses(saved, tmp_path) -> None:
    root, reference = _copy(saved[0], tmp_path), saved[1]
    DAMAGE["bytes flipped"][1](root / "step-00000004" / "__0_0.distcp")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in reference))
    proc = _train(
        "--steps", "4", "--checkpoint-dir", str(root), "--resume", "--metrics", str(metrics)
    )
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {root / 'step-00000004'}: file __0_0.distcp is corrupt" in proc.stderr
    assert f"resumed from {root / 'step-00000002'} (step 2)" in proc.stderr
    assert _losses(metrics) == reference  # steps 3 and 4 again, bit for bit
    verify_checkpoint(root / "step-00000004")  # saved again, whole


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_a_fallbacks_retention_keeps_the_checkpoint_it_resumed_from(saved, tmp_path) -> None:
    # Step 4's entry for rank 1's file removed and the file changed: --resume skips it for
    # step 2; saving step 5 with --keep-checkpoints 2 does not count step 4 (and deletes it),
    # so steps 2 and 5 stay, both usable.
    root = _copy(saved[0], tmp_path)
    DAMAGE["entry removed"][1](root / "step-00000004" / "__1_0.distcp")
    proc = _train("--steps", "5", "--checkpoint-dir", str(root), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert (
        f"skipped {root / 'step-00000004'}: file __1_0.distcp is not listed in graphpipe.json"
        in proc.stderr
    )
    assert f"resumed from {root / 'step-00000002'} (step 2)" in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000005"]
    for name in ("step-00000002", "step-00000005"):
        verify_checkpoint(root / name)


def test_resume_with_no_checkpoint_that_verifies_is_an_error(saved, tmp_path, capsys) -> None:
    root = _copy(saved[0], tmp_path)
    for step in ("step-00000002", "step-00000004"):
        (root / step / ".metadata").unlink()
    code, err = _main(["--steps", "6", "--checkpoint-dir", str(root), "--resume"], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all("file .metadata is missing" in x for x in lines[:2])
    assert lines[2] == (
        f"graphpipe train: error: --resume: no checkpoint in {root} verifies; move them away "
        "to start from step 0"
    )


def test_a_checkpoint_dir_that_cannot_be_written_is_an_argument_error(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("")
    code, err = _main(["--checkpoint-dir", str(tmp_path / "file" / "c")], capsys)
    assert code == 2
    assert err == (  # graphpipe.cmdline.outputs' check, before any work (tests/test_cli_outputs.py)
        f"graphpipe train: error: --checkpoint-dir {tmp_path / 'file' / 'c'}: "
        f"{tmp_path / 'file'} is not a directory\n"
    )


def _said(stderr: str) -> list[str]:
    """The lines about saved and removed checkpoints."""
    return [
        x
        for x in stderr.splitlines()
        if x.startswith(("graphpipe train: saved", "graphpipe train: removed"))
    ]


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_a_save_and_the_skipped_checkpoint_its_retention_removes_are_named(saved, tmp_path) -> None:
    # As above: step 4 skipped at --resume, then removed by step 5's retention.
    root = _copy(saved[0], tmp_path)
    DAMAGE["entry removed"][1](root / "step-00000004" / "__1_0.distcp")
    proc = _train("--steps", "5", "--checkpoint-dir", str(root), "--resume")
    assert proc.returncode == 0, proc.stderr
    why = "file __1_0.distcp is not listed in graphpipe.json"
    said = _said(proc.stderr)
    assert said[0] == f"graphpipe train: saved {root / 'step-00000005'}", proc.stderr
    assert len(said) == 2 and said[1].startswith(
        f"graphpipe train: removed {root / 'step-00000004'}, which --resume skipped: {why}"
    ), proc.stderr


def test_saves_name_what_they_replace_and_what_retention_removes(saved, tmp_path) -> None:
    root = _copy(saved[0], tmp_path)
    DAMAGE["entry removed"][1](root / "step-00000004" / "__1_0.distcp")
    argv = ["--steps", "5", "--checkpoint-every", "1", "--checkpoint-dir", str(root), "--resume"]
    proc = _train(*argv)
    assert proc.returncode == 0, proc.stderr
    said = _said(proc.stderr)
    assert len(said) == 4, proc.stderr
    assert said[0] == f"graphpipe train: saved {root / 'step-00000003'}"
    assert said[1].startswith(
        f"graphpipe train: saved {root / 'step-00000004'}, replacing the one --resume skipped: "
        "file __1_0.distcp is not listed in graphpipe.json"
    ), said[1]
    assert said[2:] == [  # step 2 stays: the run resumed from it
        f"graphpipe train: saved {root / 'step-00000005'}",
        f"graphpipe train: removed {root / 'step-00000003'}: older than the newest 2 that "
        "verify (--keep-checkpoints 2)",
    ]
    assert sorted(p.name for p in root.iterdir()) == [
        "step-00000002",
        "step-00000004",
        "step-00000005",
    ]
