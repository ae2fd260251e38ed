"""A checkpoint of Hugging Face stages back to a model directory that ``from_pretrained``
reads (``export_hf_model``, ``graphpipe export CKPT OUT_DIR --hf-config CONFIG``): a 2-rank
DualPipeV job's checkpoint (Qwen2 and Gemma 3, tied embeddings) exported by the command line
in the test process gives the pipeline's logits bit for bit; in one process the dtype, tied
weights written once, every tested family's weights back through ``from_pretrained``, and the
errors, output and config checked before the checkpoint is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need transformers (pip install graphpipe[hf])"
)

import graphpipe  # noqa: E402
from graphpipe.checkpoint import save_checkpoint  # noqa: E402
from graphpipe.cli import main  # noqa: E402
from graphpipe.models import (  # noqa: E402
    causal_lm_loss,
    export_hf_model,
    split_hf_causal_lm,
    unique_parameters,
)
from tests.spawn import run_ranks  # noqa: E402
from tests.test_hf import batch, config, hf_step  # noqa: E402
from tests.test_hf_families import family_config  # noqa: E402

# Right padding in every micro-batch of 2 rows (so that HF's sdpa gets a mask, as the stages
# pass one, and runs the same kernel), at least 5 real tokens for Gemma 3's window of 4.
LENGTHS = (8, 5, 7, 6, 8, 6, 5, 7)


def build(cfg, seed: int = 0) -> torch.nn.Module:
    """The model of ``cfg`` in float64 as ``from_pretrained(..., dtype=torch.float64)`` makes
    it: ``.double()`` would also cast the rotary embedding's ``inv_freq`` buffers, which HF
    computes in float32 (not saved: from_pretrained computes them again), and Gemma 3's
    rotary embedding uses them as they are."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)


def _train_save_forward(rank: int, world: int, root: str, cfg) -> dict:
    stages = split_hf_causal_lm(build(cfg), 2 * world)
    mine = {i: stages[i] for i in (rank, 2 * world - 1 - rank)}
    pipe = graphpipe.DualPipeV(
        tuple(mine.values()), num_microbatches=4, loss_fn=causal_lm_loss, loss_reduction="sum"
    )
    opt = torch.optim.AdamW(unique_parameters(mine.values()), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        d = batch(LENGTHS, seed=10 + step)
        hf_step(pipe, d)
        opt.step()
    save_checkpoint(root, 2, mine, opt)
    d = batch(LENGTHS, seed=20)
    logits = pipe.forward(d["ids"] if rank == 0 else None, attention_mask=d["mask"])
    pipe.close()
    return {"logits": logits, "batch": d}


def _check_from_pretrained(out: Path, result: dict, cfg) -> torch.nn.Module:
    """``from_pretrained(out)`` with no arguments: the training dtype, and the pipeline's
    logits bit for bit (the 4 micro-batches one by one, as the pipeline ran them)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float64
    assert type(model).__name__ == type(build(cfg)).__name__
    model.eval()
    d = result["batch"]
    with torch.no_grad():
        chunks = zip(d["ids"].chunk(4), d["mask"].chunk(4))
        logits = torch.cat([model(i, attention_mask=m).logits for i, m in chunks])
    assert torch.equal(logits, result["logits"])
    return model


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["qwen2", "gemma3_text"])
def test_a_two_rank_checkpoint_exports_to_a_model_directory_with_the_pipelines_logits(
    tmp_path: Path, capsys, kind
) -> None:
    # Both with tied embeddings; Gemma 3 with its sliding windows, rope base per attention
    # kind, scaled embedding and soft-capped logits.
    cfg = config(kind, attn="sdpa", tied=True) if kind == "qwen2" else family_config(kind)
    assert cfg.tie_word_embeddings
    results = run_ranks(_train_save_forward, 2, str(tmp_path / "ckpt"), cfg)
    assert results[1]["logits"] is None
    cfg.save_pretrained(tmp_path / "cfg")  # the config the job started from
    out = tmp_path / "trained"
    argv = ["export", str(tmp_path / "ckpt"), str(out), "--hf-config", str(tmp_path / "cfg")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"graphpipe export: wrote {out} ("), err  # one line, no progress bars
    assert err.count("\n") == 1 and err.endswith(f"from {tmp_path / 'ckpt' / 'step-00000002'}\n")
    model = _check_from_pretrained(out, results[0], cfg)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # once
    assert json.loads((out / "config.json").read_text())["dtype"] == "float64"


# ------------------------------------------------------------------ one process


def _one_process_checkpoint(root: Path, cfg, *, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    model = build(cfg, seed)
    stages = split_hf_causal_lm(model, 2)
    return save_checkpoint(root, 1, dict(enumerate(stages))), model


def test_dtype_casts_every_weight_and_from_pretrained_loads_it(tmp_path: Path) -> None:
    cfg = config("llama", attn="sdpa", tied=False)
    path, model = _one_process_checkpoint(tmp_path / "ckpt", cfg)
    out = export_hf_model(path, tmp_path / "bf16", cfg, dtype="bfloat16")
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == torch.bfloat16
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value.to(torch.bfloat16)), key
    assert not list(tmp_path.glob(".bf16.tmp-*"))  # the temporary directory is gone


def test_the_output_and_the_config_are_checked_before_the_checkpoint(tmp_path, capsys) -> None:
    cfg = config("qwen2", tied=True)
    cfg.save_pretrained(tmp_path / "cfg")
    broken = tmp_path / "ckpt" / "step-00000001"
    broken.mkdir(parents=True)  # no checkpoint: reading it would fail another way
    (tmp_path / "exists").mkdir()
    cases = [
        (tmp_path / "exists", tmp_path / "cfg", "OUT_DIR {o}: exists; give a directory that"),
        (tmp_path / "no" / "out", tmp_path / "cfg", "OUT_DIR {o}: directory {p} does not exist"),
        (tmp_path / "out", tmp_path / "none", "--hf-config: the HF config: {c}: no such file"),
        (tmp_path / "out", tmp_path, "--hf-config: the HF config: {c} holds no config.json"),
    ]
    for out, cfg_path, message in cases:
        argv = ["export", str(broken), str(out), "--hf-config", str(cfg_path)]
        assert main(argv) == 2, out
        expected = message.format(o=out, p=out.parent, c=cfg_path)
        assert capsys.readouterr().err.startswith(f"graphpipe export: error: {expected}")
    with pytest.raises(ValueError, match=r"out_dir .*exists; give a directory"):
        export_hf_model(broken, tmp_path / "exists", cfg)
    assert main(["export", str(broken), str(tmp_path / "m.pt"), "--dtype", "bfloat16"]) == 2
    assert capsys.readouterr().err == "graphpipe export: error: --dtype needs --hf-config\n"


def test_a_checkpoint_that_does_not_fit_the_config_is_refused_naming_it(tmp_path: Path) -> None:
    path, _ = _one_process_checkpoint(tmp_path / "a", config("llama", tied=False))
    with pytest.raises(ValueError, match=r"the config ties lm_head\.weight .* not trained tied"):
        export_hf_model(path, tmp_path / "tied", config("llama", tied=True))
    bigger = config("llama", tied=False, num_hidden_layers=5)
    with pytest.raises(
        ValueError,
        match=r"does not fit the config.s LlamaForCausalLM: the model has 9 keys the checkpoint "
        r"lacks "
        r"\(model\.layers\.4\.self_attn\.q_proj\.weight, .* and 5 more\)$",
    ):
        export_hf_model(path, tmp_path / "big", bigger)
    assert not (tmp_path / "tied").exists() and not (tmp_path / "big").exists()
    model = build(config("llama", tied=False))
    model.model.norm.float()  # one module in float32, the others in float64
    mixed = save_checkpoint(tmp_path / "m", 1, dict(enumerate(split_hf_causal_lm(model, 2))))
    with pytest.raises(ValueError, match=r"several dtypes \(float32, float64\).*pass dtype="):
        export_hf_model(mixed, tmp_path / "mixed", model.config)
    export_hf_model(mixed, tmp_path / "mixed", model.config, dtype=torch.float64)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mixed")
    assert back.model.norm.weight.dtype == torch.float64


@pytest.mark.parametrize(
    "kind", ["gemma2", "gemma3_text", "phi3", "olmo2", "granite", "qwen3_moe", "gpt2"]
)
def test_every_family_exports_to_from_pretrained_with_its_weights(tmp_path: Path, kind) -> None:
    cfg = family_config(kind)
    model = build(cfg)
    stages = split_hf_causal_lm(model, 3)
    path = save_checkpoint(tmp_path / "ckpt", 1, dict(enumerate(stages)))
    out = export_hf_model(path, tmp_path / kind, cfg)
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is type(model) and back.dtype == torch.float64
    assert list(back.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize(
    ("dtype", "named"),
    [
        (torch.int8, "torch.int8"),
        (torch.complex64, "torch.complex64"),
        (torch.bool, "torch.bool"),
        ("int8", "'int8'"),
        ("complex64", "'complex64'"),
        ("Tensor", "'Tensor'"),
    ],
)
def test_a_dtype_that_is_not_floating_is_refused_naming_it(
    tmp_path: Path, capsys, dtype, named
) -> None:
    # Refused before the checkpoint is read (there is none here): no load_state_dict lines,
    # no bare StopIteration, the output directory not created.
    cfg = config("llama", tied=False)
    broken = tmp_path / "ckpt" / "step-00000001"
    broken.mkdir(parents=True)
    with pytest.raises(ValueError) as info:
        export_hf_model(broken, tmp_path / "out", cfg, dtype=dtype)
    assert str(info.value) == (
        f"export_hf_model: dtype must be a floating torch dtype (float32, bfloat16, ...), got "
        f"{named}"
    )
    assert capsys.readouterr() == ("", "")
    assert not (tmp_path / "out").exists()
