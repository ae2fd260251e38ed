"""Every Hugging Face family ``split_hf_causal_lm`` supports trains as the unsplit model: tiny
random configs (4 decoder layers, hidden 32) in float64, each with what makes its family
differ switched on where the config has it (Gemma's scaled embedding, soft-capping, pre/post
feed-forward norms, query/key norms, sliding windows and a rope base per attention kind;
Phi-3's fused projections; OLMo 2's norms after attention and MLP; Granite's four
multipliers; Qwen3-MoE's routed experts; GPT-2's learned positions, ``transformer.h`` and
tied head), 2 gloo ranks, DualPipeV (4 stages), right padding with unequal valid tokens per
micro-batch, ``loss_reduction="sum"`` with ``num_items_in_batch``, three SGD steps; against
HF's own ``model(..., labels=...)`` loss on the whole batch and its SGD steps. Also GPT-2
under 1F1B (its tied head on the other rank), Gemma 3's captured (static, replayed) step and
Granite under ZB-V.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need transformers (pip install graphpipe[hf])"
)

import graphpipe  # noqa: E402
from graphpipe.keymap import unsplit_keys, unsplit_name  # noqa: E402
from graphpipe.models import (  # noqa: E402
    causal_lm_loss,
    split_hf_causal_lm,
    unique_parameters,
)
from tests.spawn import run_ranks  # noqa: E402
from tests.test_hf import TINY, hf_step  # noqa: E402

VOCAB, SEQ = TINY["vocab_size"], 8
# Right padding, unequal valid tokens in each of the 4 micro-batches of 2 rows; at least 5
# real tokens per row, so that with a window of 4 every padded query still sees a real key
# (else HF's softmax is NaN for it too).
LENGTHS = (8, 5, 7, 6, 8, 8, 5, 6)
STEPS, LR = 3, 0.1
WINDOWS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def family_config(kind: str):
    """The tiny config of family ``kind``, with its own features switched on."""
    t = transformers
    if kind == "gemma2":
        return t.Gemma2Config(
            **TINY,
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=8,
            final_logit_softcapping=2.0,
            attn_logit_softcapping=5.0,
            attn_implementation="eager",
        )
    if kind == "gemma3_text":
        return t.Gemma3TextConfig(
            **TINY,
            head_dim=8,
            sliding_window=4,
            layer_types=WINDOWS,
            query_pre_attn_scalar=8,
            final_logit_softcapping=3.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
            attn_implementation="sdpa",
        )
    if kind == "phi3":
        return t.Phi3Config(**TINY, sliding_window=4, attn_implementation="sdpa")
    if kind == "olmo2":
        return t.Olmo2Config(**TINY, attn_implementation="eager")
    if kind == "granite":
        return t.GraniteConfig(
            **TINY,
            embedding_multiplier=2.0,
            logits_scaling=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            attn_implementation="sdpa",
        )
    if kind == "qwen3_moe":
        return t.Qwen3MoeConfig(
            **TINY,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            attn_implementation="eager",
            experts_implementation="eager",  # grouped_mm takes no float64
        )
    if kind == "gpt2":
        return t.GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=4,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="sdpa",
        )
    raise KeyError(kind)


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(family_config(kind)).double()


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), SEQ), generator=g)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return {"ids": ids, "mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train(rank: int, world: int, kind: str, schedule: str = "dualpipev", capture=False) -> dict:
    v = schedule in ("dualpipev", "zbv")  # two stages per rank, in a V
    n = 2 * world if v else world
    stages = split_hf_causal_lm(build(kind), n)
    mine = (stages[rank], stages[n - 1 - rank]) if v else (stages[rank],)
    pipe = graphpipe.Pipeline(
        mine,
        schedule=schedule,
        num_microbatches=4,
        loss_fn=causal_lm_loss,
        loss_reduction="sum",
        capture=capture,
    )
    opt = torch.optim.SGD(unique_parameters(mine), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        d = batch(step)
        losses.append(hf_step(pipe, d).clone())
        opt.step()
    pipe.close()
    weights = {
        unsplit_name(name, unsplit_keys(s)): p.detach().clone()
        for s in mine
        for name, p in s.named_parameters()
    }
    return {"losses": losses, "weights": weights}


def reference(
    kind: str, steps: int = STEPS, lr: float = LR
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """HF's loss of each step on the whole batch, and the weights after the SGD steps."""
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        d = batch(step)
        out = model(d["ids"], attention_mask=d["mask"], labels=d["labels"])
        out.loss.backward()
        losses.append(out.loss.detach())
        opt.step()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


FAMILIES = ["gemma2", "gemma3_text", "phi3", "olmo2", "granite", "qwen3_moe", "gpt2"]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", FAMILIES)
def test_a_family_trains_on_two_ranks_as_the_unsplit_model(kind: str) -> None:
    check_against_reference(kind, run_ranks(_train, 2, kind))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kind,schedule,capture",
    [
        ("gpt2", "1f1b", False),  # the tied wte / lm_head on two ranks, kept equal
        ("gemma3_text", "dualpipev", True),  # the static step replayed (CPU capture)
        ("granite", "zbv", False),
    ],
)
def test_other_schedules_and_the_captured_step(kind: str, schedule: str, capture: bool) -> None:
    check_against_reference(kind, run_ranks(_train, 2, kind, schedule, capture))


def check_against_reference(kind: str, results: list[dict]) -> None:
    losses, weights = reference(kind)
    for rank, res in enumerate(results):
        # The loss is HF's float32 cross-entropy summed per micro-batch, then over them:
        # equal to HF's whole-batch sum to float32 rounding.
        for step, (got, want) in enumerate(zip(res["losses"], losses)):
            torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0, msg=f"step {step}")
        for name, w in res["weights"].items():
            # float64 weights; the gradients carry the float32 loss's rounding (HF upcasts
            # the logits; about 1e-7 relative), scaled by the learning rate. Relative to the
            # weight's norm, or to 1 below it: Gemma's norms hold w in (1 + w), starting at
            # zero, where only that rounding of their few updates is left.
            ref = weights[name]
            rel = ((w - ref).norm() / max(ref.norm().item(), 1.0)).item()
            assert rel <= 1e-9, (kind, rank, name, rel)
    held = {name for res in results for name in res["weights"]}
    assert held == set(weights), held ^ set(weights)  # every weight (a tied one by both names)
