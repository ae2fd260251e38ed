"""``graphpipe plan``: a tiny HF config and the built-in model planned in this process (text
and JSON), and its errors. Structure only: no assertion on a measured time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphpipe.cli import main
from graphpipe.cli.plan import parse_bytes

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
    assert out.startswith(
        f"LlamaForCausalLM from {hf_dir} (sdpa attention): 6 layers; micro-batch 1 x 8 tokens"
    )
    assert "dualpipev: 2 ranks, 4 stages, 8 micro-batches" in out
    planned = next(line for line in out.splitlines() if line.startswith("planned "))
    counts = [int(c) for c in planned.split()[1].split(",")]
    assert len(counts) == 4 and sum(counts) == 6 and min(counts[1:3]) >= 1
    assert "even    1,2,2,1" in out
    # graphpipe train cannot train an HF model: the call that splits it
    assert f"use it: split_hf_causal_lm(model, 4, layers_per_stage={counts})" in out
    assert "--layers-per-stage" not in out


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
        # issue 40, p11 and p10: values that are not finite
        (["--p2p", "inf"], "argument --p2p: must be a finite number of seconds >= 0, got 'inf'"),
        (["--p2p", "nan"], "argument --p2p: must be a finite number of seconds >= 0, got 'nan'"),
        (["--p2p", "-1"], "argument --p2p: must be a finite number of seconds >= 0, got '-1'"),
        (["--memory-budget", "1e400"], "'1e400' is too large to be a number of bytes"),
        (["--tie-margin", "1"], "argument --tie-margin: must be a fraction in [0, 1), got '1'"),
        (["--tie-margin", "nan"], "must be a fraction in [0, 1), got 'nan'"),
        (["--attn", "eager"], "--attn eager is for an --hf model"),
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


def _write_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path


def test_a_config_transformers_refuses_is_one_line_naming_it_with_status_2(
    tmp_path, capsys
) -> None:
    pytest.importorskip("transformers")
    bad = _write_config(
        tmp_path / "odd",
        model_type="llama",
        vocab_size=64,
        hidden_size=18,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    code, out, err = _run(["--hf", str(bad), *TINY], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("graphpipe plan: error: ")
    assert f"--hf {bad / 'config.json'}: transformers refuses the config" in err
    assert "The hidden size (18) is not a multiple of the number of attention heads (4)" in err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    code, _, err = _run(["--hf", str(tmp_path / "junk"), *TINY], capsys)
    assert code == 2 and "not a readable JSON config" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("this transformers has no Gemma 2")
    path = tmp_path_factory.mktemp("gemma2")
    transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=32,
        sliding_window=8,
    ).save_pretrained(path)
    return path


def test_gemma2_is_planned_with_the_attention_its_family_has(gemma2_dir, capsys) -> None:
    # issue 38: --hf forced sdpa, which transformers' Gemma 2 refuses with advice to pass a
    # from_pretrained argument
    code, out, err = _run(["--hf", str(gemma2_dir), *TINY], capsys)
    assert code == 0, err
    assert out.startswith(f"Gemma2ForCausalLM from {gemma2_dir} (eager attention): 4 layers")
    code, _, err = _run(["--hf", str(gemma2_dir), "--attn", "sdpa", *TINY], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "Gemma2ForCausalLM has no sdpa attention in transformers" in err
    assert "pass --attn eager (or auto)" in err


def test_attn_overrides_the_choice(hf_dir, capsys) -> None:
    code, out, err = _run(["--hf", str(hf_dir), "--attn", "eager", *TINY], capsys)
    assert code == 0, err
    assert out.startswith(f"LlamaForCausalLM from {hf_dir} (eager attention)")


def test_help_and_docs_name_the_families_the_splitter_is_tested_on(capsys) -> None:
    pytest.importorskip("transformers")
    from graphpipe.cli.plan import HF_FAMILIES
    from graphpipe.models.hf import SUPPORTED_MODEL_TYPES

    assert HF_FAMILIES == SUPPORTED_MODEL_TYPES
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert f"The model_types split_hf_causal_lm is tested on: {', '.join(HF_FAMILIES)}" in text
    docs = (Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text()
    docs = " ".join(docs.split())
    assert ", ".join(f"`{f}`" for f in HF_FAMILIES) in docs


def test_the_tie_margin_default_is_the_library_s() -> None:
    pytest.importorskip("torch")
    from graphpipe.models.planning import TIE_MARGIN

    assert f"default {TIE_MARGIN}, graphpipe.models.planning.TIE_MARGIN" in " ".join(
        _help_text().split()
    )


def _help_text() -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(["plan", "--help"])
    return buf.getvalue()


BUILTIN = ["--hidden", "16", "--heads", "2", "--no-kernels", "--batch-size", "8", "--seq-len", "8"]


def test_the_built_in_model_defaults_to_two_layers_per_stage(capsys) -> None:
    # issue 38: 4 ranks got the 6 layers graphpipe train defaults to for 8 stages: one split
    code, out, err = _run(["--ranks", "4", *BUILTIN, "--reps", "1"], capsys)
    assert code == 0, err
    assert "16 layers;" in out.splitlines()[0]
    assert "(1 splits simulated)" not in out
    planned = next(line for line in out.splitlines() if line.startswith("planned "))
    counts = planned.split()[1]
    assert (
        "use it: graphpipe train --ranks 4 --hidden 16 --heads 2 --no-kernels --batch-size 8 "
        f"--seq-len 8 --microbatches 8 --layers-per-stage {counts}  (build_stages(config, 8, "
    ) in out


def test_schedule_auto_says_what_it_chose_among_and_why(capsys) -> None:
    argv = [*BUILTIN, "--layers", "4", "--reps", "1", "--schedule", "auto"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
    assert "the fastest, by more than the 5% tie margin" in chosen or (
        "within the 5% tie margin of the fastest, the least memory on the even split" in chosen
    )
    assert "dualpipev, 8 micro-batches" in out and "zbv, 8 micro-batches" in out
    code, out, err = _run([*argv, "--format", "json", "--tie-margin", "0.5"], capsys)
    data = json.loads(out)
    assert data["tie_margin"] == 0.5 and len(data["candidates"]) == 2
    assert data["choice"].startswith(("the fastest", "of the 2 within the 50% tie margin"))


def test_a_long_search_reports_its_progress_and_bound_on_stderr(capsys) -> None:
    from graphpipe.cli.plan import _Progress
    from graphpipe.schedule.planner import PlanProgress

    progress = _Progress()

    def at(elapsed: float) -> PlanProgress:
        return PlanProgress("dualpipev", 128, "searching", 1000, elapsed, 0.8123, 0.0, 0.79)

    progress(at(0.5))
    assert capsys.readouterr().err == ""
    progress(at(3.5))
    progress(at(4.0))  # not again until another 3 s have passed
    err = capsys.readouterr().err
    assert err == (
        "graphpipe plan: dualpipev, 128 micro-batches: 1,000 splits simulated in 4 s "
        "(searching); best step 812.3 ms; no split can beat 790 ms (at most 2.8% left to "
        "gain)\n"
    )
