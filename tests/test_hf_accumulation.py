"""The issue's report as a test: Qwen2 with ``tie_word_embeddings=True`` under 1F1B on 2 gloo
ranks (the embedding and the head are copies on two ranks), two ``step`` calls without
zeroing: the gradients are the sum of HF's two backward passes (before: the tied weight's was
``2 * gA + gB``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")

from tests.spawn import run_ranks
from tests.test_hf import (
    GRAD_TOL,
    LOSS_TOL,
    batch,
    build,
    config,
    hf_reference,
    hf_step,
    stage_grads,
)

pytestmark = pytest.mark.distributed


def _two_calls(rank: int, world: int) -> dict:
    import graphpipe
    from graphpipe.models import causal_lm_loss, split_hf_causal_lm

    stages = split_hf_causal_lm(build(config("qwen2", tied=True)), world)
    mine = [stages[rank]]
    pipe = graphpipe.Pipeline(
        mine, schedule="1f1b", num_microbatches=4, loss_fn=causal_lm_loss, loss_reduction="sum"
    )
    losses = []
    for seed in (1, 2):
        d = batch(seed=seed)
        losses.append(hf_step(pipe, d).clone())
    grads = stage_grads(mine)
    pipe.close()
    return {"losses": losses, "grads": grads}


def test_tied_qwen2_under_1f1b_accumulates_two_calls_as_hf_does():
    results = run_ranks(_two_calls, 2)
    model = build(config("qwen2", tied=True))
    losses = [hf_reference(model, batch(seed=seed))[0] for seed in (1, 2)]  # accumulates
    params = model.state_dict(keep_vars=True)
    want = {k: p.grad for k, p in params.items() if p.grad is not None}
    assert "lm_head.weight" in want and "model.embed_tokens.weight" in want
    for res in results:
        for got, loss in zip(res["losses"], losses, strict=True):
            torch.testing.assert_close(got, loss.to(got.dtype), **LOSS_TOL)
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, want[name], **GRAD_TOL, msg=name)
