"""``graphpipe train`` end to end: spawned gloo ranks, the metrics file, argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


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


@pytest.mark.parametrize(
    "args,message",
    [
        (["--microbatches", "3"], "--microbatches must be >= 2 * --ranks = 4, got 3"),
        (["--batch-size", "10"], "--batch-size 10 does not split into 8 equal micro-batches"),
        (["--data", "/no/such/file"], "--data /no/such/file: no such file"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--dp", "0"], "--dp must be >= 1, got 0"),
        (
            ["--dp", "3"],
            "--batch-size 16 does not split into 8 equal micro-batches on each of --dp 3 replicas",
        ),
    ],
)
def test_bad_train_arguments_exit_2_with_one_line(args, message):
    proc = _train(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"graphpipe train: error: {message}"


def _losses(tmp_path, *args: str) -> tuple[list[float], str]:
    """The per-step losses of ``graphpipe train *args`` (from its metrics file) and its
    stderr."""
    metrics = tmp_path / ("-".join(args).replace("/", "_") + ".jsonl")
    proc = _train(*args, "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], proc.stderr


def test_a_captured_run_reproduces_the_eager_losses_bit_for_bit(tmp_path):
    small = ["--steps", "4", "--hidden", "16", "--layers", "2", "--heads", "2", "--seq-len", "16"]
    losses = {mode: _losses(tmp_path, *small, "--capture", mode)[0] for mode in ("none", "step")}
    assert len(losses["step"]) == 4
    assert losses["step"] == losses["none"]


def test_data_parallel_replicas_reproduce_the_single_pipeline_losses(tmp_path):
    """--dp 2 splits each batch across two replicas (world 2 x 1 rank): the same global
    batches, so the same losses as one pipeline on the whole batch."""
    small = ["--ranks", "1", "--steps", "3", "--hidden", "16", "--layers", "1", "--heads", "1"]
    small += ["--seq-len", "16", "--batch-size", "8"]
    (one, _), (two, log) = (_losses(tmp_path, *small, "--dp", dp) for dp in ("1", "2"))
    assert "1 ranks x 2 stages x 2 replicas" in log
    assert len(two) == 3
    assert two == pytest.approx(one, rel=1e-5)
