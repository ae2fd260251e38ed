"""``graphpipe train`` end to end: spawned gloo ranks, the metrics file, argument errors,
checkpoint and resume (also after a rank is killed under torchrun), Ctrl-C, the progress bar.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphpipe.cli import main
from graphpipe.cmdline.launch import RunStopped
from graphpipe.train import Progress, default_layers, default_microbatches

pytestmark = pytest.mark.distributed

# A model small enough for a few seconds per run on two busy cores.
TINY = ["--hidden", "16", "--layers", "2", "--heads", "2", "--seq-len", "16", "--no-kernels"]


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphpipe", "train", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_train_writes_one_metrics_line_per_step_and_the_loss_falls(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _train(
        "--steps",
        "12",
        "--hidden",
        "32",
        "--layers",
        "2",
        "--heads",
        "2",
        "--seq-len",
        "32",
        "--metrics",
        str(metrics),
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 13))
    for r in lines:
        assert set(r) == {"step", "loss", "step_time_s", "tokens_per_s"}
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
    assert "step 12/12" in proc.stderr and "tok/s" in proc.stderr


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_train_reads_a_data_file_and_runs_on_one_rank(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    metrics = tmp_path / "m.jsonl"
    proc = _train(
        "--ranks",
        "1",
        "--steps",
        "3",
        "--hidden",
        "16",
        "--layers",
        "1",
        "--heads",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--data",
        str(data),
        "--metrics",
        str(metrics),
    )
    assert proc.returncode == 0, proc.stderr
    assert len(metrics.read_text().splitlines()) == 3
    assert str(data) in proc.stderr


def _losses(tmp_path, *args: str) -> tuple[list[float], str]:
    """The per-step losses of ``graphpipe train *args`` (from its metrics file) and its
    stderr."""
    metrics = tmp_path / ("-".join(args).replace("/", "_") + ".jsonl")
    proc = _train(*args, "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], proc.stderr


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_data_parallel_replicas_reproduce_the_single_pipeline_losses(tmp_path):
    """--dp 2 splits each batch across two replicas (world 2 x 1 rank): the same global
    batches, so the same losses as one pipeline on the whole batch."""
    small = ["--ranks", "1", "--steps", "3", "--hidden", "16", "--layers", "1", "--heads", "1"]
    small += ["--seq-len", "16", "--batch-size", "8"]
    (one, _), (two, log) = (_losses(tmp_path, *small, "--dp", dp) for dp in ("1", "2"))
    assert "1 ranks x 2 stages x 2 replicas" in log
    assert len(two) == 3
    assert two == pytest.approx(one, rel=1e-5)


# ------------------------------------------------------------------ argument errors, in-process


def _main_error(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    try:
        code = main(["train", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ranks", "0"], "--ranks must be >= 1, got 0"),
        (["--ranks", "4", "--layers", "4"], "--layers 4 is too few for --ranks 4"),
        (["--hidden", "30", "--heads", "4"], "--hidden 30 is not a multiple of --heads 4"),
        (["--hidden", "12", "--heads", "4"], "--hidden 12 / --heads 4 = 3 must be even"),
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
        (["--lr", "nan"], "--lr must be a positive number, got nan"),
        (["--metrics", "/no/such/dir/m.jsonl"], "directory /no/such/dir does not exist"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--checkpoint-dir", "/dev/null"], "--checkpoint-dir /dev/null: exists and is not a"),
        (["--microbatches", "0"], "--microbatches must be >= 1, got 0"),
        (["--microbatches", "3"], "--microbatches must be >= 2 * --ranks = 4, got 3"),
        (
            ["--batch-size", "10", "--microbatches", "8"],
            "--batch-size 10 does not split into 8 equal micro-batches",
        ),
        (["--data", "/no/such/file"], "--data /no/such/file: no such file"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--dp", "0"], "--dp must be >= 1, got 0"),
        (
            ["--layers-per-stage", "1,2,1"],
            "--layers-per-stage=[1, 2, 1] has 3 entries, expected one per stage: 4",
        ),
        (
            ["--layers", "4", "--layers-per-stage", "1,2,2,1"],
            "--layers-per-stage=[1, 2, 2, 1] sums to 6, but the model has --layers 4",
        ),
        (["--layers-per-stage", "2,0,2,0"], "middle stage 1 holds no layer"),
        (
            ["--dp", "3"],
            "--batch-size 16 does not split evenly over --dp 3 replicas",
        ),
    ],
)
def test_argument_errors_are_one_line_with_status_2(args, message, capsys) -> None:
    code, err = _main_error(args, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("graphpipe train: error: ")
    assert message in err


def test_cuda_without_cuda_is_an_argument_error(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, err = _main_error(["--device", "cuda"], capsys)
    assert code == 2
    assert err == (
        f"graphpipe train: error: --device cuda: CUDA is not available to this torch "
        f"({torch.__version__})\n"
    )


def test_a_short_data_file_is_an_argument_error(tmp_path, capsys) -> None:
    short = tmp_path / "short.txt"
    short.write_text("abc")
    code, err = _main_error(["--data", str(short), "--seq-len", "8"], capsys)
    assert code == 2
    assert f"--data {short} holds 3 bytes, fewer than --seq-len + 1 = 9" in err


def test_a_bad_number_is_argparses_one_line_error(capsys) -> None:
    code, err = _main_error(["--ranks", "two"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "graphpipe train: error: argument --ranks: invalid int value: 'two'"
    )


def test_layers_per_stage_that_are_not_numbers_are_argparses_one_line_error(capsys) -> None:
    code, err = _main_error(["--layers-per-stage", "1,two,1,0"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "graphpipe train: error: argument --layers-per-stage: expected whole numbers "
        "separated by commas (like 2,4,4,2), got '1,two,1,0'"
    )


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_a_chosen_split_trains_and_is_named_in_the_run_line(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    args = [*TINY[:2], *TINY[4:], "--layers-per-stage", "0,3,1,0", "--steps", "2"]
    proc = _train(*args, "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert "2 ranks x 2 stages, 4 layers (0,3,1,0 per stage), 8 micro-batches" in proc.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_the_default_layers_fit_every_rank_count() -> None:
    for n in range(1, 17):
        assert default_layers(n) >= 2 * n - 2
    assert default_layers(2) == 4 and default_layers(4) == 6


def test_the_default_microbatches_split_the_batch() -> None:
    got = [default_microbatches(n, 16) for n in (1, 2, 3, 4, 5, 8, 9)]
    assert got == [4, 8, 8, 16, 16, 16, None]
    assert default_microbatches(3, 24) == 12


def test_a_batch_too_small_for_the_ranks_says_what_to_pass(capsys) -> None:
    code, err = _main_error(["--ranks", "9"], capsys)
    assert code == 2
    assert "--batch-size 16 does not split into 2 * --ranks = 18 or more equal micro-batches" in err


def _fake_checkpoint(root: Path, step: int, world: int, **meta) -> Path:
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    info = {"format": "graphpipe-checkpoint-2", "step": step, "world_size": world, "files": {}}
    info |= {"stages": [[r, 2 * world - 1 - r] for r in range(world)], "meta": meta}
    (path / "graphpipe.json").write_text(json.dumps(info))
    return path


def test_resume_checks_the_checkpoint_before_spawning(tmp_path, capsys) -> None:
    ckpt = _fake_checkpoint(tmp_path, 20, 2, hidden=64, batch_size=16)
    resume = ["--checkpoint-dir", str(tmp_path), "--resume"]
    code, err = _main_error(["--checkpoint-dir", str(tmp_path)], capsys)
    assert code == 2 and "already holds checkpoints (newest: step-00000020); pass --resume" in err
    code, err = _main_error(
        ["--checkpoint-dir", str(tmp_path), "--resume", "--hidden", "32"], capsys
    )
    assert code == 2
    assert f"--resume: {ckpt} was trained with --hidden 64, this run has --hidden 32" in err
    code, err = _main_error([*resume, "--ranks", "1"], capsys)
    assert code == 2 and "was saved by 2 ranks, this run has --ranks 1" in err
    code, err = _main_error(
        ["--checkpoint-dir", str(tmp_path), "--resume", "--steps", "20"], capsys
    )
    assert code == 0 and "is at step 20, --steps is 20: nothing to do" in err


def test_version_is_the_package_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "graphpipe", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert proc.stdout.split()[:2] == ["graphpipe", importlib.metadata.version("graphpipe")]


# ------------------------------------------------------------------ the progress bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_redraws_in_place_with_an_eta_and_ends_with_the_total() -> None:
    now = [0.0]
    term = _Terminal()
    bar = Progress(4, term, first=1, clock=lambda: now[0])
    texts = ["loss 5.123 | a long text", "x", "loss 4.0", "loss 3.9"]
    for step, text in enumerate(texts, start=1):
        now[0] += 2.0
        bar.update(step, text)
    draws = term.getvalue().split("\r")[1:]
    assert len(draws) == 4
    for draw in draws[:-1]:  # every redraw erases what a longer line left behind
        assert draw.endswith("\x1b[K")
    assert "ETA 6.0 s" in draws[0] and "ETA 2.0 s" in draws[2]
    assert draws[-1].endswith("| 8.0 s total\x1b[K\n")


def test_a_resumed_progress_bar_counts_its_eta_from_its_first_step() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = Progress(100, out, every=10, first=51, clock=lambda: now[0])
    now[0] = 1.0
    bar.update(51, "t")  # one step in 1 s, 49 to go
    assert out.getvalue() == "step  51/100 [############............] t | ETA 49.0 s\n"


# ------------------------------------------------------------------ checkpoint and resume


def _step_losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple[int, float]]:
    """The eager losses of 6 uninterrupted steps of the tiny model."""
    metrics = tmp_path_factory.mktemp("ref") / "m.jsonl"
    proc = _train(*TINY, "--steps", "6", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    return _step_losses(metrics)


@pytest.mark.slow  # three runs of the command line (a killed rank resumes in the default run)
@pytest.mark.parametrize("capture", ["none", "step"])
def test_a_resumed_run_reproduces_the_uninterrupted_losses(tmp_path, uninterrupted, capture):
    """Steps 1-4, then 5-6 resumed, equal the uninterrupted eager run bit for bit; with
    ``--capture step`` that also proves the captured run reproduces the eager one."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = [*TINY, "--capture", capture, "--checkpoint-dir", str(ckpt), "--metrics", str(metrics)]
    proc = _train(*common, "--steps", "4", "--checkpoint-every", "2")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004"]
    proc = _train(*common, "--steps", "6", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {ckpt / 'step-00000004'} (step 4)" in proc.stderr
    assert "step 6/6" in proc.stderr and "steps 5-6 in" in proc.stderr
    assert _step_losses(metrics) == uninterrupted  # global steps 1..6, bit for bit


def test_a_rank_killed_under_torchrun_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    env = {**os.environ, "GRAPHPIPE_TEST_EXIT": "1:5"}  # rank 1 dies before step 5, once
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["--max-restarts", "1", "-m", "graphpipe", "train", *TINY, "--steps", "6"]
        + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--resume"]
        + ["--metrics", str(metrics)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {ckpt / 'step-00000004'} (step 4)" in proc.stderr
    assert _step_losses(metrics) == uninterrupted
    assert _step_losses(metrics)[-1][1] == uninterrupted[-1][1]


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_the_default_model_trains_on_four_ranks(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = _train("--ranks", "4", "--steps", "1", "--seq-len", "8", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert "4 ranks x 2 stages, 6 layers, 16 micro-batches" in proc.stderr
    assert len(_step_losses(metrics)) == 1


# ------------------------------------------------------------------ non-finite losses

# AdamW's first steps move every weight by about --lr: with 1e30 the activations overflow
# within a few steps (the tiny model's loss is NaN from step 3 here), whatever the CPU.
_NONFINITE = re.compile(
    r"graphpipe train: the loss of step (\d+) is (nan|inf|-inf); stopping "
    r"\(--allow-nonfinite trains on\)"
)


def test_a_nonfinite_loss_stops_every_rank_at_its_step_with_one_line(tmp_path) -> None:
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc = _train(
        *TINY, "--steps", "8", "--lr", "1e30", "--metrics", str(metrics),
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    stops = [m for line in proc.stderr.splitlines() if (m := _NONFINITE.fullmatch(line))]
    assert len(stops) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "failed" not in proc.stderr
    step = int(stops[0][1])
    rows = _step_losses(metrics)
    assert [s for s, _ in rows] == list(range(1, step))  # no row for the non-finite step
    assert all(math.isfinite(loss) for _, loss in rows)
    newest = max(p.name for p in ckpt.iterdir())  # no checkpoint of the non-finite step
    assert newest == f"step-{step - 1:08d}"


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_allow_nonfinite_trains_on_and_counts_the_steps(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    small = ["--ranks", "1", "--batch-size", "4", "--layers", "1", "--steps", "5"]
    proc = _train(*TINY, *small, "--lr", "1e30", "--allow-nonfinite", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    rows = _step_losses(metrics)
    assert [s for s, _ in rows] == [1, 2, 3, 4, 5]
    bad = [s for s, loss in rows if not math.isfinite(loss)]
    assert bad, rows
    assert f"({len(bad)} non-finite step(s), the first at step {bad[0]})" in proc.stderr


def test_a_run_stopped_under_torchrun_is_one_line_on_rank_0_only(monkeypatch, capsys) -> None:
    import graphpipe.train.command

    def stop(args):
        raise RunStopped("the loss of step 7 is nan; stopping")

    monkeypatch.setattr(graphpipe.train.command, "run", stop)
    for rank, expected in (
        ("0", "graphpipe train: the loss of step 7 is nan; stopping\n"),
        ("1", ""),
    ):
        monkeypatch.setenv("RANK", rank)
        assert main(["train"]) == 1
        assert capsys.readouterr().err == expected


# ------------------------------------------------------------------ Ctrl-C


def _session_processes(sid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            found.append(int(pid))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_every_rank_with_one_line_and_status_130() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphpipe", "train", *TINY, "--steps", "100000"],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a job
    )
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("step "):
            break
    assert seen and seen[-1].startswith("step "), "".join(seen)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rest = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130
    assert rest.splitlines() == ["graphpipe train: interrupted"]
    assert "Traceback" not in "".join(seen) + rest
    deadline = time.monotonic() + 20
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes(proc.pid) == []


def test_a_failed_rank_is_reported_once_with_status_1() -> None:
    env = {**os.environ, "GRAPHPIPE_TEST_EXIT": "1:2"}  # rank 1 dies before step 2
    proc = subprocess.run(
        [sys.executable, "-m", "graphpipe", "train", *TINY, "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1
    # The rank that is seen to fail first: rank 1 itself, or rank 0 whose peer vanished.
    prefix = "graphpipe train: rank"
    reports = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(reports) == 1, proc.stderr
    assert reports[0] in (f"{prefix} 1 exited with status 1", f"{prefix} 0 failed:")
    assert proc.stderr.count("Traceback") <= 1  # the rank's own, never the launcher's
    assert "ProcessRaisedException" not in proc.stderr
