"""The built-in Llama through the pipeline, with the Triton kernels, on spawned gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

WORLD, M, ROWS, SEQ = 2, 4, 4, 8


def _config(use_kernels: bool):
    from graphpipe.models import LlamaConfig

    return LlamaConfig(hidden=16, n_layers=2, n_heads=2, max_seq_len=SEQ, use_kernels=use_kernels)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _pipeline_rank(rank: int, world: int, mode: str) -> dict:
    os.environ["GRAPHPIPE_KERNELS"] = mode  # read at every kernel call
    import graphpipe
    from graphpipe.models import LlamaLoss, build_stages

    cfg = _config(use_kernels=True)
    stages = build_stages(cfg, 2 * world, seed=0)
    mine = (stages[rank], stages[2 * world - 1 - rank])
    pipe = graphpipe.DualPipeV(mine, num_microbatches=M, loss_fn=LlamaLoss(True))
    x, y = _batch()
    loss = pipe.step(x if rank == 0 else None, y if rank == 0 else None)
    grads = {
        (idx, name): p.grad.clone()
        for idx, m in zip(pipe.stage_ids, mine)
        for name, p in m.named_parameters(remove_duplicate=False)
    }
    return {"loss": loss, "grads": grads}


@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_llama_pipeline_with_kernels_matches_the_torch_reference_model(mode: str) -> None:
    if mode == "triton" and not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET")):
        pytest.skip("the Triton path on CPU needs TRITON_INTERPRET=1")
    if mode == "triton" and not torch.cuda.is_available():
        from graphpipe.kernels._dispatch import interpreter_problem

        if (why := interpreter_problem()) is not None:  # RMSNorm and cross-entropy loop
            pytest.skip(why)
    from graphpipe.models import LlamaLoss, build_stages

    ref_stages = build_stages(_config(use_kernels=False), 2 * WORLD, seed=0)
    x, y = _batch()
    h = x
    for s in ref_stages:
        h = s(h)
    ref_loss = LlamaLoss(False)(h, y)
    ref_loss.backward()
    ref = {
        (i, name): p.grad
        for i, s in enumerate(ref_stages)
        for name, p in s.named_parameters(remove_duplicate=False)
    }
    results = run_ranks(_pipeline_rank, WORLD, mode)
    seen = set()
    for res in results:
        torch.testing.assert_close(res["loss"], ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for key, g in res["grads"].items():
            torch.testing.assert_close(g, ref[key], rtol=1e-4, atol=1e-6, msg=str(key))
            seen.add(key)
    assert seen == set(ref)
