"""CUDA graph capture of the DualPipeV step (skipped without CUDA).

One GPU: the one-rank pipeline (both stages local, no P2P) at both granularities, bitwise
equal to eager over steps. Two GPUs: P2P capture over NCCL (skipped with fewer).
"""

from __future__ import annotations

import pytest
import torch

from tests.pipeline_models import batch, build_stages, local_stages, mse, params, twin_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _one_rank_case(granularity: str, dtype: torch.dtype, steps: int = 5) -> list[str]:
    import graphpipe

    dev = torch.device("cuda")
    es = [s.to(dev) for s in local_stages(build_stages(2, 64, dtype=dtype), 0, 1)]
    cs = [s.to(dev) for s in local_stages(build_stages(2, 64, dtype=dtype), 0, 1)]
    eager = graphpipe.DualPipeV(es, num_microbatches=4, loss_fn=mse)
    captured = graphpipe.DualPipeV(cs, num_microbatches=4, loss_fn=mse, capture=granularity)
    opt_e = torch.optim.SGD(params(es), lr=0.05)
    opt_c = torch.optim.SGD(params(cs), lr=0.05)
    problems = []
    for step in range(steps):
        x, y = batch(32, 64, seed=step, dtype=dtype)
        problems += [
            f"step {step}: {p}" for p in twin_step(eager, es, captured, cs, x.to(dev), y.to(dev))
        ]
        opt_e.step()
        opt_c.step()
    captured.close()
    return problems


@pytest.mark.parametrize("granularity", ["step", "action"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_rank_capture_replays_bitwise_equal_to_eager(granularity, dtype):
    assert _one_rank_case(granularity, dtype) == []


def test_replay_refuses_grads_set_to_none():
    import graphpipe

    dev = torch.device("cuda")
    cs = [s.to(dev) for s in local_stages(build_stages(2, 16, dtype=torch.float32), 0, 1)]
    pipe = graphpipe.DualPipeV(cs, num_microbatches=2, loss_fn=mse, capture=True)
    x, y = (t.to(dev) for t in batch(4, 16, dtype=torch.float32))
    pipe.step(x, y)
    pipe.step(x, y)
    for s in cs:
        s.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        pipe.step(x, y)
    pipe.close()


def _two_rank_case(rank: int, world: int, granularity: str) -> list[str]:
    import os

    import torch.distributed as dist

    import graphpipe

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.destroy_process_group()  # tests.spawn made a gloo world; this one needs NCCL
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    es = [s.to(dev) for s in local_stages(build_stages(4, 64), rank, world)]
    cs = [s.to(dev) for s in local_stages(build_stages(4, 64), rank, world)]
    eager = graphpipe.DualPipeV(es, num_microbatches=4, loss_fn=mse)
    captured = graphpipe.DualPipeV(
        cs, num_microbatches=4, loss_fn=mse, capture=granularity, per_edge_groups=True
    )
    problems = []
    for step in range(4):
        x, y = (t.to(dev) if rank == 0 else None for t in batch(16, 64, seed=step))
        problems += [
            f"rank {rank} step {step}: {p}" for p in twin_step(eager, es, captured, cs, x, y)
        ]
    captured.close()
    return problems


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="P2P capture needs two GPUs")
@pytest.mark.parametrize("granularity", ["step", "action"])
def test_two_rank_p2p_capture_replays_bitwise_equal_to_eager(granularity):
    from tests.spawn import run_ranks

    for problems in run_ranks(_two_rank_case, 2, granularity):
        assert problems == []


@pytest.mark.parametrize("granularity", ["step", "action"])
def test_capture_optimizer_runs_capturable_adam_inside_the_graph(granularity):
    import graphpipe

    dev = torch.device("cuda")
    es = [s.to(dev) for s in local_stages(build_stages(2, 32, dtype=torch.float32), 0, 1)]
    cs = [s.to(dev) for s in local_stages(build_stages(2, 32, dtype=torch.float32), 0, 1)]
    opt_e = torch.optim.Adam(params(es), lr=1e-3, capturable=True)
    opt_c = torch.optim.Adam(params(cs), lr=1e-3, capturable=True)
    eager = graphpipe.DualPipeV(es, num_microbatches=2, loss_fn=mse)
    captured = graphpipe.DualPipeV(
        cs, num_microbatches=2, loss_fn=mse, capture=granularity, capture_optimizer=opt_c
    )
    for step in range(4):
        x, y = (t.to(dev) for t in batch(8, 32, seed=step, dtype=torch.float32))
        opt_e.zero_grad(set_to_none=False)
        le = eager.step(x, y)
        opt_e.step()
        lc = captured.step(x, y).clone()
        torch.cuda.synchronize()
        assert torch.equal(le, lc), f"step {step}"
        for a, b in zip(params(es), params(cs)):
            assert torch.equal(a, b), f"step {step}"
    captured.close()
