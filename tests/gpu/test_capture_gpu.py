"""CUDA graph capture of the DualPipeV step (skipped without CUDA).

One GPU: the one-rank pipeline (both stages local, no P2P) at both granularities against an
eager twin over steps with optimizer updates in between: the residual-MLP stages bitwise
equal, the built-in Llama with the Triton kernels in fp32 and bf16 bitwise equal where the
step is deterministic, else within a stated tolerance (the largest differences are recorded
in the check's figures either way). Two GPUs: P2P capture over NCCL (skipped with fewer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.pipeline_models import (
    batch,
    build_stages,
    local_stages,
    mse,
    params,
    twin_diffs,
    twin_step,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


# A model for the one-rank runs: (eager stages, captured stages, loss_fn, batch(step) -> (x, y)),
# the two stage pairs built identically on the GPU.
_Twin = tuple[list[torch.nn.Module], list[torch.nn.Module], Callable, Callable[[int], Any]]


def _mlp_twin(dtype: torch.dtype) -> _Twin:
    dev = torch.device("cuda")

    def stages() -> list[torch.nn.Module]:
        return [s.to(dev) for s in local_stages(build_stages(2, 64, dtype=dtype), 0, 1)]

    def data(step: int):
        return tuple(t.to(dev) for t in batch(32, 64, seed=step, dtype=dtype))

    return stages(), stages(), mse, data


def _llama_twin(dtype: torch.dtype) -> _Twin:
    """The built-in Llama cut in two stages, norms / SwiGLU / loss through the Triton kernels
    (the default on CUDA tensors), 8 sequences of 64 tokens per step."""
    from graphpipe.models import LlamaConfig, LlamaLoss
    from graphpipe.models import build_stages as build_llama

    dev = torch.device("cuda")
    cfg = LlamaConfig(hidden=256, n_layers=2, n_heads=4, max_seq_len=64)

    def data(step: int):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab_size, (8, 65), generator=g).to(dev)
        return tokens[:, :-1], tokens[:, 1:]

    def stages() -> list[torch.nn.Module]:
        return list(build_llama(cfg, 2, seed=0, dtype=dtype, device=dev))

    return stages(), stages(), LlamaLoss(), data


def _one_rank_diffs(twin: _Twin, granularity: str, steps: int = 5) -> list[dict[str, float]]:
    """Per step, the largest differences between the eager and the captured pipeline (0.0:
    bitwise equal); SGD steps both in between."""
    import graphpipe

    es, cs, loss_fn, data = twin
    eager = graphpipe.DualPipeV(es, num_microbatches=4, loss_fn=loss_fn)
    captured = graphpipe.DualPipeV(cs, num_microbatches=4, loss_fn=loss_fn, capture=granularity)
    opt_e = torch.optim.SGD(params(es), lr=0.05)
    opt_c = torch.optim.SGD(params(cs), lr=0.05)
    out = []
    try:
        for step in range(steps):
            x, y = data(step)
            out.append(twin_diffs(eager, es, captured, cs, x, y))
            opt_e.step()
            opt_c.step()
    finally:
        captured.close()
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["autograd-B", "fused-B"])
@pytest.mark.parametrize("granularity", ["step", "action"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_rank_capture_replays_bitwise_equal_to_eager(granularity, dtype, fused, monkeypatch):
    if fused:  # every Linear's B accumulates its weight gradient inside the GEMM (cuBLAS)
        monkeypatch.setattr("graphpipe.weightgrad.FUSED_ACCUMULATION_MIN_NUMEL", 0)
    per_step = _one_rank_diffs(_mlp_twin(dtype), granularity)
    problems = [f"step {i}: {k} {d!r}" for i, s in enumerate(per_step) for k, d in s.items() if d]
    assert problems == []


# Eager and replay run the same kernels on the same data, so they agree bitwise unless a
# kernel's reduction order varies from run to run (atomics; e.g. some SDPA backward kernels).
# Then gradients may differ by rounding: relative to the largest eager gradient, a few fp32
# ulps, or about one bf16 ulp (2**-8 = 3.9e-3) propagated through two blocks.
LLAMA_REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("granularity", ["step", "action"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_with_triton_kernels_captured_matches_eager(granularity, dtype, gpu_figures):
    from graphpipe.kernels._dispatch import use_triton

    assert use_triton(torch.empty(1, device="cuda")), "GRAPHPIPE_KERNELS forces the torch path"
    twin = _llama_twin(dtype)
    per_step = _one_rank_diffs(twin, granularity)
    # The largest eager gradient of the last step (zeroed in place each step, kept after it).
    scale = max(float(p.grad.abs().max()) for p in params(twin[0]))
    # NaN counts as the worst difference of all.
    worst = {k: max(s[k] if s[k] == s[k] else float("inf") for s in per_step) for k in per_step[0]}
    name, largest = max(worst.items(), key=lambda kv: kv[1])
    gpu_figures.update(
        bitwise=largest == 0.0,
        steps=len(per_step),
        max_abs_diff=largest,
        max_abs_diff_of=name,
        loss_max_abs_diff=worst["loss"],
        rel_tol=LLAMA_REL_TOL[dtype],
        grad_scale=scale,
    )
    print(f"llama {dtype} capture={granularity}: max abs diff {largest!r} ({name})")
    assert largest <= LLAMA_REL_TOL[dtype] * scale, (name, largest)


def test_grads_set_to_none_get_their_static_tensor_back_and_a_replaced_grad_raises():
    import graphpipe

    dev = torch.device("cuda")
    es, cs = (
        [s.to(dev) for s in local_stages(build_stages(2, 16, dtype=torch.float32), 0, 1)]
        for _ in range(2)
    )
    eager = graphpipe.DualPipeV(es, num_microbatches=2, loss_fn=mse)
    pipe = graphpipe.DualPipeV(cs, num_microbatches=2, loss_fn=mse, capture=True)
    for step in range(4):
        x, y = (t.to(dev) for t in batch(4, 16, seed=step, dtype=torch.float32))
        for s in (*es, *cs):
            s.zero_grad(set_to_none=True)
        eager.step(x, y)
        pipe.step(x, y)
        torch.cuda.synchronize()
        for a, b in zip(params(es), params(cs)):
            assert torch.equal(a.grad, b.grad), f"step {step}"
    cs[0].fc1.weight.grad = torch.zeros_like(cs[0].fc1.weight)
    with pytest.raises(RuntimeError, match="replaced by another tensor"):
        pipe.step(x, y)
    pipe.close()


@pytest.mark.parametrize("granularity", ["step", "action"])
def test_the_cpu_graph_and_the_cuda_graph_replay_the_same_step(granularity):
    """The CPU graph models a CUDA graph: the same one-rank step (fp64 residual-MLP stages,
    SGD between steps) captured on CPU and on CUDA gives the same losses and gradients over
    replays, to rounding (CPU and GPU GEMMs sum in other orders)."""
    import graphpipe

    runs = {}
    for dev in (torch.device("cpu"), torch.device("cuda")):
        stages = [s.to(dev) for s in local_stages(build_stages(2, 32), 0, 1)]
        pipe = graphpipe.DualPipeV(stages, num_microbatches=4, loss_fn=mse, capture=granularity)
        opt = torch.optim.SGD(params(stages), lr=0.05)
        out = []
        for step in range(5):
            x, y = (t.to(dev) for t in batch(16, 32, seed=step))
            opt.zero_grad(set_to_none=False)
            loss = pipe.step(x, y).clone()
            out.append((loss.cpu(), [p.grad.cpu().clone() for p in params(stages)]))
            opt.step()
        pipe.close()
        runs[dev.type] = out
    for step, ((lc, gc), (lg, gg)) in enumerate(zip(runs["cpu"], runs["cuda"], strict=True)):
        torch.testing.assert_close(lg, lc, rtol=1e-12, atol=0, msg=f"step {step} loss")
        for a, b in zip(gc, gg, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13, msg=f"step {step} grad")


def test_a_learning_rate_schedule_on_a_tensor_lr_is_exact_inside_the_graph():
    """The learning rate as a tensor the captured Adam reads: a scheduler's in-place updates
    reach every replay (a float lr would be refused by name, tests/test_capture_graphs.py)."""
    import graphpipe

    dev = torch.device("cuda")
    es, cs = (
        [s.to(dev) for s in local_stages(build_stages(2, 32, dtype=torch.float32), 0, 1)]
        for _ in range(2)
    )
    opt_e, opt_c = (
        torch.optim.Adam(params(s), lr=torch.tensor(1e-2, device=dev), capturable=True)
        for s in (es, cs)
    )
    sched_e, sched_c = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt_e, opt_c))
    eager = graphpipe.DualPipeV(es, num_microbatches=2, loss_fn=mse)
    captured = graphpipe.DualPipeV(
        cs, num_microbatches=2, loss_fn=mse, capture=True, capture_optimizer=opt_c
    )
    for step in range(5):
        x, y = (t.to(dev) for t in batch(8, 32, seed=step, dtype=torch.float32))
        opt_e.zero_grad(set_to_none=False)
        eager.step(x, y)
        opt_e.step()
        captured.step(x, y)
        sched_e.step()
        sched_c.step()
        torch.cuda.synchronize()
        for a, b in zip(params(es), params(cs)):
            assert torch.equal(a, b), f"step {step}"
    captured.close()


def _two_rank_case(rank: int, world: int, granularity: str) -> list[str]:
    import graphpipe
    from tests.spawn import nccl_world

    dev = nccl_world(rank, world)  # tests.spawn made a gloo world; this one needs NCCL
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
        # bitwise: the graph replays the eager program's kernels in the same order (cuBLAS
        # deterministic under CUBLAS_WORKSPACE_CONFIG, which the GPU check sets)
        assert torch.equal(le, lc), f"step {step}"
        for a, b in zip(params(es), params(cs)):
            assert torch.equal(a, b), f"step {step}"
    captured.close()
