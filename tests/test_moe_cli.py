"""``graphpipe train --experts``: spawned gloo ranks, ``dropped_tokens`` in every metrics row,
the captured run equal to the eager one, and the MoE argument errors (in-process)."""

from __future__ import annotations

import json

import pytest

from tests.test_train_cli import _main_error, _train

pytestmark = pytest.mark.distributed

SMALL = ("--hidden", "32", "--layers", "2", "--heads", "2", "--seq-len", "32")
MOE = ("--experts", "4", "--top-k", "2", "--capacity-factor", "1.0")


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_train_dp2_ep2_experts_on_4_ranks_reports_drops_and_the_loss_falls(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = _train(
        "--dp", "2", "--ep", "2", "--steps", "10", *SMALL, *MOE, "--metrics", str(metrics)
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 ranks x 2 stages x 2 replicas" in proc.stderr
    rows = _rows(metrics)
    assert [r["step"] for r in rows] == list(range(1, 11))
    for r in rows:
        assert set(r) == {"step", "loss", "step_time_s", "tokens_per_s", "dropped_tokens"}
        # 16 sequences x 32 tokens x 2 choices x 2 MoE blocks: 2048 assignments per step
        assert isinstance(r["dropped_tokens"], int) and 0 <= r["dropped_tokens"] < 2048
    assert any(r["dropped_tokens"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_train_with_experts_captured_reproduces_the_eager_run(tmp_path) -> None:
    """On one rank (the CLI's capture path; captured MoE pipelines over several ranks are
    checked against eager in test_moe_dist): losses and drop counts equal, step by step."""
    runs = []
    for capture in ("none", "step"):
        metrics = tmp_path / f"{capture}.jsonl"
        args = ("--ranks", "1", "--steps", "3", *SMALL, *MOE, "--capture", capture)
        proc = _train(*args, "--metrics", str(metrics))
        assert proc.returncode == 0, proc.stderr
        runs.append([(r["loss"], r["dropped_tokens"]) for r in _rows(metrics)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--experts", "4", "--top-k", "5"), "--top-k must be between 1 and --experts 4, got 5"),
        (("--experts", "4", "--ep", "3"), "--ep must be >= 1 and divide --experts 4, got 3"),
        (("--experts", "4", "--ep", "2"), "--ep 2 must divide --dp 1"),
        (
            ("--experts", "4", "--ep", "2", "--dp", "3", "--batch-size", "48"),
            "--ep 2 must divide --dp 3",
        ),
        (("--experts", "4", "--capacity-factor", "0"), "--capacity-factor must be > 0, got 0.0"),
        (("--experts", "-1"), "--experts must be >= 0, got -1"),
    ],
)
def test_train_rejects_bad_moe_options_naming_the_value(args, message, capsys) -> None:
    code, err = _main_error(["--steps", "1", *args], capsys)
    assert code == 2
    assert message in err


@pytest.mark.slow  # an end-to-end run of the command line: the slow lane (docs/development.md)
def test_bench_moe_regime_writes_the_pair_against_f_then_b(tmp_path) -> None:
    import subprocess
    import sys

    out = tmp_path / "moe.json"
    args = ["--regime", "moe", "--steps", "2", "--warmup", "0", "--hidden", "64"]
    proc = subprocess.run(
        [sys.executable, "-m", "graphpipe", "bench", *args, "--mb-rows", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())["moe"]
    assert row["bitwise_equal"] is True
    assert (row["ranks"], row["ep"], row["moe_layers"], row["tokens_per_microbatch"]) == (
        2,
        2,
        2,
        128,
    )
    for key in ("pair_s", "f_then_b_s", "f_s", "b_s", "pair_exposed_wait_s"):
        assert len(row[key]["all"]) == 2 and row[key]["median"] >= 0
    assert row["pair_over_f_then_b"] > 0
    assert "pair / (F then B)" in proc.stdout
