"""Every output path of every subcommand is checked before any work: one line naming the
flag, the path and why, exit status 2, nothing written (``graphpipe.cmdline.outputs``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphpipe.cli import main
from graphpipe.cmdline.outputs import check_output_dir, check_output_file

MISSING = "/nonexistent/dir"


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse-level errors (schedule's parser.error)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# {d}: an existing directory, {f}: an existing file (both in tmp_path).
CASES = [
    (
        ["schedule", "--ranks", "2", "--microbatches", "4", "--out", f"{MISSING}/s.svg"],
        f"--out {MISSING}/s.svg: directory {MISSING} does not exist (create it first)",
    ),
    (
        ["schedule", "--ranks", "2", "--microbatches", "4", "--out", "{d}"],
        "--out {d}: is a directory; give a file name",
    ),
    (
        ["train", "--metrics", f"{MISSING}/m.jsonl"],
        f"--metrics {MISSING}/m.jsonl: directory {MISSING} does not exist",
    ),
    (["train", "--metrics", "{d}"], "--metrics {d}: is a directory"),
    (["train", "--checkpoint-dir", "{f}"], "--checkpoint-dir {f}: exists and is not a directory"),
    (
        ["train", "--checkpoint-dir", f"{MISSING}/ckpt"],
        f"--checkpoint-dir {MISSING}/ckpt: directory {MISSING} does not exist",
    ),
    (["train", "--checkpoint-dir", "/proc"], "--checkpoint-dir /proc: cannot write in it"),
    (
        ["bench", "--json", f"{MISSING}/b.json"],
        f"--json {MISSING}/b.json: directory {MISSING} does not exist",
    ),
    (["bench", "--plot", "{d}/x/t.svg"], "--plot {d}/x/t.svg: directory {d}/x does not exist"),
    (["profile", "--out", "/proc/nope/prof"], "--out /proc/nope/prof: directory /proc/nope"),
    (["profile", "--out", "{f}"], "--out {f}: exists and is not a directory"),
    (["profile", "--out", "/proc"], "--out /proc: cannot write in it"),
    (["export", "{d}", "/proc/x.pt"], "OUT.pt /proc/x.pt: cannot write in directory /proc"),
    (["export", "{d}", f"{MISSING}/m.pt"], f"OUT.pt {MISSING}/m.pt: directory {MISSING} does not"),
    (["export", "{d}", "{d}"], "OUT.pt {d}: is a directory; give a file name"),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_an_output_path_that_cannot_be_written_is_one_line_with_status_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    where = {"d": tmp_path / "d", "f": tmp_path / "f"}
    argv, message = [a.format(**where) for a in argv], message.format(**where)
    before = sorted(tmp_path.rglob("*"))
    code, out, err = _error(argv, capsys)
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1 and f"graphpipe {argv[0]}: error: " in err, err
    assert message in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing created, not even a probe


def test_a_writable_file_or_directory_passes_and_the_probe_is_removed(tmp_path: Path) -> None:
    assert check_output_file("--json", tmp_path / "b.json") is None
    (tmp_path / "b.json").write_text("{}")
    assert check_output_file("--json", tmp_path / "b.json") is None  # overwritten later
    assert check_output_dir("--out", tmp_path / "new") is None  # created by the command
    assert check_output_dir("--out", tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]


def test_a_parent_that_is_a_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert check_output_file("--json", tmp_path / "f" / "b.json") == (
        f"--json {tmp_path / 'f' / 'b.json'}: {tmp_path / 'f'} is not a directory"
    )
