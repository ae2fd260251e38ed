"""``graphpipe plan``: a tiny HF config and the built-in model planned in this process (text
and JSON), and its errors. Structure only: no assertion on a measured time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphpipe.cli import main
from graphpipe.plan_command import parse_bytes

TINY = ["--batch-size", "8", "--seq-len", "8", "--reps", "1"]


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf")
    transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    ).save_pretrained(path)
    return path


def test_an_hf_config_is_planned_and_printed_beside_the_even_split(hf_dir, capsys) -> None:
    code, out, err = _run(["--hf", str(hf_dir), *TINY], capsys)
    assert code == 0, err
    assert out.startswith(f"LlamaForCausalLM from {hf_dir}: 6 layers; micro-batch 1 x 8 tokens")
    assert "dualpipev: 2 ranks, 4 stages, 8 micro-batches" in out
    planned = next(line for line in out.splitlines() if line.startswith("planned "))
    counts = [int(c) for c in planned.split()[1].split(",")]
    assert len(counts) == 4 and sum(counts) == 6 and min(counts[1:3]) >= 1
    assert "even    1,2,2,1" in out
    assert f"use it: --layers-per-stage {','.join(map(str, counts))}" in out


def test_the_config_file_itself_and_json_output(hf_dir, capsys) -> None:
    argv = ["--hf", str(hf_dir / "config.json"), *TINY, "--format", "json"]
    code, out, err = _run([*argv, "--microbatches", "4,8", "--schedule", "auto"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["layers"] == 6 and sum(data["layers_per_stage"]) == 6
    assert data["num_microbatches"] in (4, 8) and data["schedule"] in ("dualpipev", "zbv")
    assert data["predicted_step_s"] <= data["even_predicted_step_s"]


def test_the_built_in_model_is_planned(capsys) -> None:
    argv = ["--layers", "4", "--hidden", "16", "--heads", "2", "--no-kernels", *TINY]
    code, out, err = _run([*argv, "--format", "json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["model"].startswith("the built-in model")
    assert len(data["layers_per_stage"]) == 4 and sum(data["layers_per_stage"]) == 4


def test_a_budget_nothing_fits_names_the_shortfall_with_status_1(hf_dir, capsys) -> None:
    code, out, err = _run(["--hf", str(hf_dir), *TINY, "--memory-budget", "1KiB"], capsys)
    assert code == 1 and out == ""
    assert err.startswith("graphpipe plan: no split fits memory_budget=1024 bytes: the closest")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf", "/no/such/dir"], "--hf /no/such/dir: no such file"),
        (["--batch-size", "10", "--microbatches", "4"], "--batch-size 10 does not split into 4"),
        (["--memory-budget", "lots"], "expected bytes like 8GiB"),
        (["--ranks", "0"], "--ranks must be >= 1, got 0"),
        (["--microbatches", "2"], "num_microbatches must be >= 2 * num_ranks = 4"),
    ],
)
def test_argument_errors_are_one_line_with_status_2(argv, message, capsys) -> None:
    code, _, err = _run([*argv, "--no-kernels", *TINY[4:]], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("graphpipe plan: error: ")
    assert message in err


def test_parse_bytes_reads_units() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("100") == 100


def test_cuda_without_cuda_is_an_argument_error(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, _, err = _run(["--device", "cuda"], capsys)
    assert code == 2
    assert err == (
        f"graphpipe plan: error: --device cuda: CUDA is not available to this torch "
        f"({torch.__version__})\n"
    )
