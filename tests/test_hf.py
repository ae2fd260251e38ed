"""Hugging Face causal LMs through ``split_hf_causal_lm`` and ``causal_lm_loss``, against the
unsplit HF model (tiny random configs built here, no download): DualPipeV and 1F1B on two
gloo ranks, right padding with unequal valid tokens per micro-batch, the token-weighted
``loss_reduction="sum"``, eager and captured steps, activation checkpointing per layer, tied
embeddings on one rank and across ranks; Mistral, Qwen2 and Qwen3 (sliding windows) in one
process; the export of a trained pipeline back into the HF model (``save_pretrained`` and
back); the errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need transformers (pip install graphpipe[hf])"
)

import graphpipe  # noqa: E402
from graphpipe.keymap import unsplit_keys, unsplit_name  # noqa: E402
from graphpipe.models import (  # noqa: E402
    causal_lm_loss,
    causal_lm_num_items,
    split_hf_causal_lm,
)
from tests.spawn import run_ranks  # noqa: E402

VOCAB, SEQ, BATCH = 64, 8, 8
# Right padding: rows of 8, 5, 7, 3, 8, 6, 2 and 4 real tokens, so that the micro-batches
# (2 or 4 of them) hold unequal numbers of valid label tokens.
LENGTHS = (8, 5, 7, 3, 8, 6, 2, 4)

# The pipeline runs each micro-batch's rows through GEMMs of other shapes than the unsplit
# model's whole-batch GEMMs (other blockings, other summation orders), so the float64 results
# agree to rounding, not bitwise; HF also computes its RMSNorm, the eager softmax and the loss
# in float32 whatever the model's dtype, where a float64 difference may, rarely, flip one
# float32 rounding (6e-8 relative). The loss is a float32 sum over tokens in another order
# (per micro-batch, then over micro-batches) than HF's one whole-batch sum.
GRAD_TOL = dict(rtol=1e-6, atol=1e-8)
LOSS_TOL = dict(rtol=2e-6, atol=1e-7)


def config(kind: str = "llama", *, attn: str = "eager", tied: bool = True, **extra):
    """A tiny random config: 4 decoder layers, hidden 16, vocabulary 64."""
    kw = (
        dict(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=tied,
            attn_implementation=attn,
        )
        | extra
    )
    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    return classes[kind](**kw)


def build(cfg, seed: int = 0) -> torch.nn.Module:
    """The HF model of ``cfg`` with weights drawn from ``seed`` (float64)."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).double()


def batch(lengths=LENGTHS, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids, the right-padded attention mask, and labels (-100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=g)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"ids": ids, "mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hf_reference(model, d: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF's own loss (the mean over the whole batch's valid tokens) and the gradients, by the
    HF model's state_dict names (a tied weight under both of its names)."""
    out = model(d["ids"], attention_mask=d["mask"], labels=d["labels"])
    out.loss.backward()
    params = model.state_dict(keep_vars=True)
    return out.loss.detach(), {k: p.grad.clone() for k, p in params.items() if p.grad is not None}


def stage_grads(stages) -> dict[str, torch.Tensor]:
    """Each stage parameter's gradient under its HF name (through the stage's key map)."""
    return {
        unsplit_name(n, unsplit_keys(s)): p.grad.clone()
        for s in stages
        for n, p in s.named_parameters()
    }


def hf_step(pipe, d: dict) -> torch.Tensor:
    """``pipe.step`` of batch ``d`` as HF counts it: the ids on the input rank, the labels on
    the loss rank, the mask on every rank, and HF's number of valid tokens."""
    return pipe.step(
        d["ids"] if pipe.is_input_rank else None,
        d["labels"] if pipe.is_loss_rank else None,
        attention_mask=d["mask"],
        num_items_in_batch=causal_lm_num_items(d["labels"]),
    )


def step_matches_hf(stages, cfg, d: dict) -> None:
    """One-rank DualPipeV of ``stages`` (summed loss, HF's token count) on batch ``d``: its
    loss and every gradient against HF's model of ``cfg`` on the whole batch."""
    pipe = graphpipe.DualPipeV(
        stages, num_microbatches=2, loss_fn=causal_lm_loss, loss_reduction="sum"
    )
    loss = hf_step(pipe, d)
    ref_loss, ref_grads = hf_reference(build(cfg), d)
    torch.testing.assert_close(loss.float(), ref_loss, **LOSS_TOL)
    grads = stage_grads(stages)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **GRAD_TOL, msg=name)


def _train(rank: int, world: int, case: dict) -> dict:
    cfg = config(attn=case["attn"], tied=case["tied"])
    n = 2 * world if case["schedule"] == "dualpipev" else world
    stages = split_hf_causal_lm(build(cfg), n, checkpoint_layers=case.get("ckpt", False))
    mine = (
        [stages[rank], stages[n - 1 - rank]] if case["schedule"] == "dualpipev" else [stages[rank]]
    )
    pipe = graphpipe.Pipeline(
        mine,
        schedule=case["schedule"],
        num_microbatches=case["m"],
        loss_fn=causal_lm_loss,
        loss_reduction="sum",
        capture=case.get("capture", False),
    )
    calls = []  # forward calls of this rank's first decoder layer: twice per micro-batch
    mine[0].layers[0].register_forward_pre_hook(lambda *_: calls.append(1))  # when recomputed
    d = batch()
    losses = []
    for _ in range(case.get("steps", 1)):
        for s in mine:
            s.zero_grad(set_to_none=False)
        loss = hf_step(pipe, d)
        losses.append(loss.clone())
    grads = stage_grads(mine)
    pipe.close()
    return {
        "losses": losses,
        "grads": grads,
        "deferrable": pipe.num_deferrable,
        "layer_calls": len(calls),
    }


CASES = [
    # 4 stages on 2 ranks; the tied embedding and head are one Parameter on rank 0
    dict(schedule="dualpipev", m=4, attn="eager", tied=True),
    dict(schedule="dualpipev", m=4, attn="sdpa", tied=False, capture=True, ckpt=True, steps=3),
    # 2 stages on 2 ranks; the tied weight has a copy on each rank
    dict(schedule="1f1b", m=2, attn="eager", tied=True, ckpt=True, capture=True, steps=3),
    dict(schedule="1f1b", m=4, attn="sdpa", tied=True),
]


@pytest.mark.distributed
def test_hf_llama_on_two_ranks_has_the_unsplit_models_loss_and_gradients() -> None:
    results = run_ranks(_run_all, 2, CASES)
    for i, case in enumerate(CASES):
        loss, grads = hf_reference(build(config(attn=case["attn"], tied=case["tied"])), batch())
        seen = set()
        for rank in range(2):
            res = results[rank][i]
            # every projection defers its weight gradient (q, k, v, o, gate, up, down; head)
            assert all(k >= 7 for k in res["deferrable"]), (case, res["deferrable"])
            # the layers' Python runs in the eager steps; with capture, in the warmup and the
            # capture only (later steps replay the graph)
            steps = min(case.get("steps", 1), 2) if case.get("capture") else case.get("steps", 1)
            runs = case["m"] * steps * (2 if case.get("ckpt") else 1)
            assert res["layer_calls"] == runs, case
            for got in res["losses"]:
                torch.testing.assert_close(got.float(), loss, **LOSS_TOL, msg=str(case))
            for name, g in res["grads"].items():
                torch.testing.assert_close(g, grads[name], **GRAD_TOL, msg=f"{case} {name}")
                seen.add(name)
        assert seen == set(grads), (case, set(grads) - seen)


def _run_all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_train(rank, world, c) for c in cases]


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("mistral", dict(sliding_window=4)),  # every layer sliding
        ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
        # Qwen3: RMSNorm on each head's queries and keys, head_dim apart from hidden / heads
        ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2, head_dim=8)),
    ],
)
def test_mistral_and_qwen_with_sliding_windows_train_in_one_process(kind, extra) -> None:
    # A padded query must see a real key within its window (else HF's eager softmax is NaN
    # in both): rows of at least 5 real tokens with a window of 4 and 8 positions.
    lengths = (8, 5, 7, 6)
    cfg = config(kind, tied=False, **extra)
    model = build(cfg)
    assert model.config.model_type == kind
    stages = split_hf_causal_lm(model, 2)
    if kind != "mistral":
        assert [s.layer_types for s in stages] == [
            ("full_attention", "full_attention"),
            ("sliding_attention", "sliding_attention"),
        ]
    step_matches_hf(stages, cfg, batch(lengths))


def test_loss_reduction_mean_averages_hfs_loss_of_each_micro_batch() -> None:
    cfg = config(attn="sdpa")
    stages = split_hf_causal_lm(build(cfg), 2)
    pipe = graphpipe.DualPipeV(stages, num_microbatches=2, loss_fn=causal_lm_loss)
    d = batch()
    loss = pipe.step(d["ids"], d["labels"], attention_mask=d["mask"])
    model = build(cfg)
    losses = [
        model(i, attention_mask=m, labels=y).loss / 2
        for i, m, y in zip(d["ids"].chunk(2), d["mask"].chunk(2), d["labels"].chunk(2))
    ]
    sum(losses).backward()
    ref = model.state_dict(keep_vars=True)
    # The same micro-batches through the same kernels, but the grads of the two summed in
    # another order (HF's autograd adds them, the pipeline accumulates micro-batch by
    # micro-batch): equal to float64 rounding.
    torch.testing.assert_close(loss.float(), sum(losses).detach(), **LOSS_TOL)
    for name, g in stage_grads(stages).items():
        torch.testing.assert_close(g, ref[name].grad, **GRAD_TOL, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_stages_build_hfs_masks_for_padding_and_packed_position_ids(attn) -> None:
    model = build(config(attn=attn))
    stages = split_hf_causal_lm(model, 3)  # layers 1, 2, 1
    assert [len(s.layers) for s in stages] == [1, 2, 1]
    # the model's own parameters, no copies (the tied head's weight is the embedding's)
    held = [p for s in stages for p in s.parameters()]
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}
    assert len(held) == len(list(model.parameters())) + 1
    d = batch()
    packed = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]).repeat(BATCH, 1)  # two sequences per row
    calls = [
        dict(attention_mask=d["mask"]),
        dict(),
        # HF looks for packed sequences only without a cache: the stages have none
        dict(position_ids=packed),
    ]
    with torch.no_grad():
        for kw in calls:
            h = d["ids"]
            for s in stages:
                h = s(h, **kw)
            # The same modules on the same rows, the same mask values: the same kernels.
            assert torch.equal(h, model(d["ids"], use_cache=False, **kw).logits), list(kw)


def test_causal_lm_loss_is_hfs_loss_mean_and_token_weighted() -> None:
    d = batch()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=g, dtype=torch.float64)
    hf = transformers.loss.loss_utils.ForCausalLMLoss
    assert torch.equal(causal_lm_loss(logits, d["labels"]), hf(logits, d["labels"], VOCAB))
    count = causal_lm_num_items(d["labels"])
    assert count.shape == (BATCH,) and int(count[0]) == sum(n - 1 for n in LENGTHS)
    n = count[0]
    assert torch.equal(
        causal_lm_loss(logits, d["labels"], num_items_in_batch=count),
        hf(logits, d["labels"], VOCAB, num_items_in_batch=n),
    )
    # summed over micro-batches, the token-weighted parts are the whole batch's mean
    parts = sum(
        causal_lm_loss(lg, lb, num_items_in_batch=c)
        for lg, lb, c in zip(logits.chunk(4), d["labels"].chunk(4), count.chunk(4))
    )
    torch.testing.assert_close(parts, hf(logits, d["labels"], VOCAB), rtol=1e-6, atol=0)


def _export(rank: int, world: int, root: str) -> dict:
    from graphpipe.checkpoint import save_checkpoint

    stages = split_hf_causal_lm(build(config(attn="sdpa")), 2 * world)
    ids = (rank, 2 * world - 1 - rank)
    mine = {i: stages[i] for i in ids}
    pipe = graphpipe.DualPipeV(
        tuple(mine.values()), num_microbatches=4, loss_fn=causal_lm_loss, loss_reduction="sum"
    )
    opt = torch.optim.AdamW(graphpipe.models.unique_parameters(mine.values()), lr=1e-2)
    d = batch()
    for step in range(2):
        opt.zero_grad()
        d = batch(seed=10 + step)
        hf_step(pipe, d)
        opt.step()
    save_checkpoint(root, 2, mine, opt)
    d = batch(seed=20)
    logits = pipe.forward(d["ids"] if rank == 0 else None, attention_mask=d["mask"])
    pipe.close()
    return {"logits": logits, "batch": d}


@pytest.mark.distributed
def test_a_trained_pipeline_exports_into_the_hf_model_and_save_pretrained(tmp_path: Path):
    from graphpipe.checkpoint import export_state_dict

    results = run_ranks(_export, 2, str(tmp_path / "ckpt"))
    state = export_state_dict(tmp_path / "ckpt" / "step-00000002")
    cfg = config(attn="sdpa")
    model = build(cfg, seed=7)  # other weights: every one must come from the checkpoint
    model.load_state_dict(state, strict=True)
    assert sorted(state) == sorted(model.state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    d, expected = results[0]["batch"], results[0]["logits"]
    assert results[1]["logits"] is None
    model.eval()
    with torch.no_grad():
        # The pipeline ran the 4 micro-batches one by one through these modules with the same
        # mask values (each micro-batch has padding, so HF's sdpa gets a mask too): so does
        # this, and the logits are the same bits.
        chunks = zip(d["ids"].chunk(4), d["mask"].chunk(4))
        logits = torch.cat([model(i, attention_mask=m).logits for i, m in chunks])
        assert torch.equal(logits, expected)
        model.save_pretrained(tmp_path / "hf")
        back = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", attn_implementation="sdpa", dtype=torch.float64
        )
        again = back(d["ids"], attention_mask=d["mask"]).logits
        assert torch.equal(again, model(d["ids"], attention_mask=d["mask"]).logits)


def test_splits_that_cannot_apply_are_refused_naming_why() -> None:
    model = build(config())
    with pytest.raises(ValueError, match=r"num_stages=5 is more than the model's 4 decoder layers"):
        split_hf_causal_lm(model, 5)
    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2
        )
    )
    with pytest.raises(
        ValueError,
        match=r"OPTForCausalLM does not have the layout of a LlamaForCausalLM: "
        r"model\.embed_tokens \(Embedding\): missing; .*\(its children: model, lm_head\)",
    ):
        split_hf_causal_lm(opt, 1)
    moe = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        output_router_logits=True,
    )
    with pytest.raises(ValueError, match=r"config\.output_router_logits=True: HF adds the router"):
        split_hf_causal_lm(transformers.AutoModelForCausalLM.from_config(moe), 2)
    gemma3 = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=8,
        use_bidirectional_attention=True,
    )
    with pytest.raises(ValueError, match=r"config\.use_bidirectional_attention=True"):
        split_hf_causal_lm(transformers.AutoModelForCausalLM.from_config(gemma3), 2)
    flex = build(config(attn="flex_attention"))
    with pytest.raises(ValueError, match=r"'eager' or 'sdpa', got 'flex_attention'"):
        split_hf_causal_lm(flex, 2)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    with pytest.raises(ValueError, match=r"HF gradient checkpointing is on \(layers \[0, 1, 2, 3"):
        split_hf_causal_lm(model, 2)


@pytest.mark.parametrize("counts", [[0, 4], [3, 1], [4, 0]])
def test_a_chosen_split_trains_as_the_unsplit_model(counts) -> None:
    cfg = config(tied=True)
    stages = split_hf_causal_lm(build(cfg), 2, layers_per_stage=counts)
    assert [len(s.layers) for s in stages] == counts
    assert [s.first_layer for s in stages] == [0, counts[0]]
    assert unsplit_keys(stages[0]).get("layers.0") == ("model.layers.0" if counts[0] else None)
    step_matches_hf(stages, cfg, batch())


def test_a_chosen_split_of_four_stages_gives_the_models_logits() -> None:
    model = build(config(attn="sdpa"))
    stages = split_hf_causal_lm(model, 4, layers_per_stage=[0, 2, 2, 0])
    assert [len(s.layers) for s in stages] == [0, 2, 2, 0]
    assert [s.is_first for s in stages] == [True, False, False, False]
    assert [s.is_last for s in stages] == [False, False, False, True]
    assert unsplit_keys(stages[2])["layers.1"] == "model.layers.3"
    d = batch()
    with torch.no_grad():
        h = d["ids"]
        for s in stages:
            h = s(h, attention_mask=d["mask"])
        assert torch.equal(h, model(d["ids"], attention_mask=d["mask"], use_cache=False).logits)


@pytest.mark.parametrize(
    "counts,message",
    [
        ([2, 2], r"layers_per_stage=\[2, 2\] has 2 entries for num_stages=3"),
        ([1, 1, 1], r"layers_per_stage=\[1, 1, 1\] sums to 3, but the model has 4 decoder"),
        ([2, 3, -1], r"layers_per_stage=\[2, 3, -1\] has negative counts \(stages \[2\]\)"),
        ([2, 0, 2], r"layers_per_stage=\[2, 0, 2\] leaves middle stages \[1\] without a decoder"),
        ([2, 1.0, 1], r"layers_per_stage=\[2, 1.0, 1\] must be a list of ints"),
        ((2, True, 1), r"layers_per_stage=\(2, True, 1\) must be a list of ints"),
        (4, r"layers_per_stage=4 must be a list of ints"),
    ],
)
def test_a_chosen_split_that_does_not_fit_is_refused_naming_it(counts, message) -> None:
    with pytest.raises(ValueError, match=message):
        split_hf_causal_lm(build(config()), 3, layers_per_stage=counts)


# ------------------------------------------------------------------ families outside the table

TINY = dict(  # every tiny config's shape (families outside the table; tests/test_hf_families.py)
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    pad_token_id=0,
)


@pytest.mark.parametrize(
    "name,extra",
    [
        ("GemmaConfig", dict(head_dim=8)),  # Gemma 1: the scaled embedding is its module's
        ("Starcoder2Config", dict(sliding_window=4)),  # LayerNorm with biases, every layer slides
        ("OlmoConfig", dict()),  # norms without parameters: no keys for them
        (
            "Qwen2MoeConfig",  # routed experts and a shared one; grouped_mm takes no float64
            dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                experts_implementation="eager",
            ),
        ),
    ],
)
def test_a_family_outside_the_table_is_checked_on_a_probe_and_trains_exactly(name, extra) -> None:
    cfg = getattr(transformers, name)(**TINY, **extra, attn_implementation="eager")
    assert cfg.model_type not in graphpipe.models.hf.SUPPORTED_MODEL_TYPES
    stages = split_hf_causal_lm(build(cfg), 2)
    step_matches_hf(stages, cfg, batch((8, 5, 7, 6)))


class _ScaledLlama(transformers.LlamaModel):
    """A top model that scales the embedding in its own forward: the stages would not."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        return super().forward(inputs_embeds=self.embed_tokens(input_ids) * 2.0, **kwargs)


def test_a_family_whose_forward_differs_is_refused_naming_what_differs() -> None:
    cohere = transformers.CohereConfig(**TINY, logit_scale=0.5)
    with pytest.raises(
        ValueError,
        match=r"CohereForCausalLM \(config\.model_type='cohere'\) is not one of the tested "
        r"families .* on a probe of 8 tokens: the logits are not the head's output",
    ):
        split_hf_causal_lm(transformers.AutoModelForCausalLM.from_config(cohere), 2)
    model = build(config())
    model.model = _ScaledLlama(model.config).double()
    model.config.model_type = "scaled_llama"
    with pytest.raises(ValueError, match=r"decoder layer 0's input is not the embedding's output"):
        split_hf_causal_lm(model, 2)
    model.config.model_type = "llama"  # a tested family: not probed (its forward is Llama's)
    assert len(split_hf_causal_lm(model, 2)) == 2
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cohere)
    with pytest.raises(ValueError, match=r"needs the weights: load them before splitting"):
        split_hf_causal_lm(meta, 2)
