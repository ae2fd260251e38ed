"""CUDA graph capture of the MoE pipeline (skipped without CUDA; never run yet: no GPU).

One GPU: the one-rank DualPipeV (both stages local, its overlapped pairs through the MoE
stage's hook, exchanges local) captured per step and per action, against eager over steps
with SGD in between. Two GPUs: experts over an NCCL ep group of 2 (a one-rank pipeline per
GPU), the all-to-alls on the communication stream inside the graph.

Losses and gradients are compared with a tight tolerance rather than bitwise: the attention
backward may accumulate with atomics on a GPU. The dropped-token counts must match exactly.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _config():
    from graphpipe.models import LlamaConfig

    return LlamaConfig(
        hidden=64,
        n_layers=2,
        n_heads=2,
        max_seq_len=32,
        num_experts=4,
        top_k=2,
        capacity_factor=1.0,
    )


def _twins(dev: torch.device, granularity: str, ep_group=None, group=None, steps: int = 4):
    import graphpipe
    from graphpipe.models import (
        LlamaLoss,
        build_stages,
        dropped_tokens,
        reset_dropped_tokens,
        unique_parameters,
    )

    sets, pipes, opts = [], [], []
    for capture in (False, granularity):
        stages = build_stages(_config(), 2, device=dev, ep_group=ep_group)
        opts.append(torch.optim.SGD(unique_parameters(stages), lr=0.05))
        pipes.append(
            graphpipe.DualPipeV(
                stages, num_microbatches=4, loss_fn=LlamaLoss(), group=group, capture=capture
            )
        )
        sets.append(stages)
    problems = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 256, (8, 33), generator=g).to(dev)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        out = []
        for stages, pipe, opt in zip(sets, pipes, opts):
            opt.zero_grad(set_to_none=False)
            reset_dropped_tokens(stages)
            loss = pipe.step(x, y).clone()
            torch.cuda.synchronize()
            out.append(
                (loss, dropped_tokens(stages), [p.grad.clone() for p in unique_parameters(stages)])
            )
            opt.step()
        (le, de, ge), (lc, dc, gc) = out
        if not torch.equal(de, dc):
            problems.append(f"step {step}: dropped {int(de)} != {int(dc)}")
        try:
            torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
            for a, b in zip(gc, ge):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        except AssertionError as e:
            problems.append(f"step {step}: {e}")
    pipes[1].close()
    return problems


@pytest.mark.parametrize("granularity", ["step", "action"])
def test_one_rank_moe_capture_replays_like_eager(granularity):
    assert _twins(torch.device("cuda"), granularity) == []


def _ep_case(rank: int, world: int, granularity: str) -> list[str]:
    import torch.distributed as dist

    from tests.spawn import nccl_world

    dev = nccl_world(rank, world)  # tests.spawn made a gloo world; this one needs NCCL
    alone = [dist.new_group([r]) for r in range(world)]  # a one-rank pipeline per GPU
    problems = _twins(dev, granularity, ep_group=dist.group.WORLD, group=alone[rank])
    return [f"rank {rank}: {p}" for p in problems]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallelism needs two GPUs")
@pytest.mark.parametrize("granularity", ["step", "action"])
def test_ep2_over_nccl_capture_replays_like_eager(granularity):
    from tests.spawn import run_ranks

    for problems in run_ranks(_ep_case, 2, granularity):
        assert problems == []
