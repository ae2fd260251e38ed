"""``Pipeline.no_sync()``'s contract (one process, and the ranks' agreement on 2 gloo ranks);
the accumulated gradients themselves are checked against one process in
tests/test_differential.py, test_moe_dist.py and test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

import graphpipe
from graphpipe.runtime.accumulation import GradSync, divide_existing
from tests.pipeline_models import batch, build_stages, mse
from tests.spawn import run_ranks


def test_no_sync_is_refused_with_capture_and_when_nested():
    stages = build_stages(2)
    pipe = graphpipe.DualPipeV(stages, num_microbatches=2, loss_fn=mse, capture="step")
    with pytest.raises(ValueError, match=r"no_sync\(\) with capture='step'"):
        with pipe.no_sync():
            pass
    pipe = graphpipe.DualPipeV(build_stages(2), num_microbatches=2, loss_fn=mse)
    with pipe.no_sync():
        with pytest.raises(RuntimeError, match="already active"):
            with pipe.no_sync():
                pass
    assert pipe.grad_sync.sync  # restored on the way out


def test_a_one_rank_pipeline_accumulates_the_same_inside_no_sync():
    x, y = batch(8)
    results = []
    for inside in (False, True):
        stages = build_stages(2)
        pipe = graphpipe.DualPipeV(stages, num_microbatches=2, loss_fn=mse)
        for c in range(3):
            if inside and c < 2:
                with pipe.no_sync():
                    pipe.step(x, y * (c + 1))
            else:
                pipe.step(x, y * (c + 1))
        results.append([q.grad.clone() for q in pipe.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)  # the same kernels in the same order: bitwise


def test_grad_sync_divides_only_outside_an_open_window():
    calls = []
    sync = GradSync()
    sync.hooks.append(lambda: calls.append("divide"))
    sync.begin()
    sync.end()
    sync.sync = False
    sync.begin()  # opens the window: divides
    sync.end()
    sync.begin()  # inside the open window: nothing
    sync.end()
    sync.sync = True
    sync.begin()  # the reducing call of the window: nothing
    sync.end()
    sync.begin()  # a fresh call: divides
    assert calls == ["divide", "divide", "divide"]
    sync.window = True
    sync.reset()
    assert not sync.window


def test_divide_existing_skips_missing_gradients():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.full((2,), 6.0)
    divide_existing([(a, 3.0), (b, 2.0)])
    assert a.grad.tolist() == [2.0, 2.0] and b.grad is None


def _disagree(rank: int, world: int) -> str:
    stages = build_stages(2 * world)
    pipe = graphpipe.DualPipeV(
        (stages[rank], stages[2 * world - 1 - rank]), num_microbatches=4, loss_fn=mse
    )
    x, y = batch(8)
    args = (x, y) if rank == 0 else (None, None)
    try:
        if rank == 1:
            with pipe.no_sync():
                pipe.step(*args)
        else:
            pipe.step(*args)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_ranks_inside_and_outside_no_sync_are_named_on_every_rank():
    for text in run_ranks(_disagree, 2):
        assert text.startswith(
            "rank(s) [1] called step() inside no_sync() and rank(s) [0] outside it"
        )
