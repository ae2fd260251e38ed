"""``Pipeline.no_sync()``'s contract (one process, and the ranks' agreement on 2 gloo ranks);
the accumulated gradients themselves are checked against one process in
tests/test_differential.py, test_moe_dist.py and test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

import graphpipe
from graphpipe.runtime.parts.accumulation import GradSync, divide_existing, in_window
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


def _halved(p: torch.nn.Parameter) -> GradSync:
    """A pipeline's sync over ``p`` whose one reduction doubles a gradient equal on every
    rank (alpha 2): its hook halves what is there, outside a window."""
    sync = GradSync([p])
    sync.add(lambda: divide_existing([(p, 2.0)]))
    return sync


def test_grad_sync_divides_only_outside_an_open_window():
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.full((1,), 8.0)
    sync = _halved(p)
    seen = []
    for inside in (False, True, True, False, False):
        sync.sync = not inside
        sync.begin()
        seen.append(p.grad.item())
        sync.end()
    # a fresh call divides; the window's first call divides, its later ones and its reducing
    # call do not; the call after the window divides again
    assert seen == [4.0, 2.0, 2.0, 2.0, 1.0]
    assert not sync.window
    sync.sync = False
    sync.end()
    assert sync.window and in_window(p)
    sync.reset()  # a failed step closes the window
    assert not sync.window and not in_window(p)


def test_the_window_is_the_parameters_whichever_pipeline_opened_it():
    # Two pipelines over one parameter (issue 40, a07): a no_sync step of A, then steps of B.
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.full((1,), 8.0), torch.full((1,), 8.0)
    a, b = _halved(p), _halved(p)
    a.add(lambda: divide_existing([(q, 2.0)]))  # A also reduces q, which B does not hold
    a.params.append(q)
    a.sync = False
    a.begin()  # A opens the window: divides both
    a.end()
    assert (p.grad.item(), q.grad.item()) == (4.0, 4.0)
    assert a.window and b.window
    b.begin()  # B's reducing step: p is in A's window, nothing to divide
    assert p.grad.item() == 4.0
    b.end()  # closes p's window, not q's (B does not reduce q)
    assert not in_window(p) and in_window(q)
    a.sync = True
    a.begin()  # A's reducing step: p was reduced by B (divided), q is still in the window
    assert (p.grad.item(), q.grad.item()) == (2.0, 4.0)
    a.end()
    assert not a.window and not b.window


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


def _replicas_disagree(rank: int, world: int, case: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    stages = build_stages(4)
    mine = (stages[p], stages[3 - p])
    pipe = graphpipe.DualPipeV(
        mine,
        num_microbatches=4,
        loss_fn=mse,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        timeout=60.0,  # a rank that waits it out fails run_ranks' limit instead
    )
    out: dict = {"replica": d}
    x, y = batch(8, seed=d)
    args = (x, y) if p == 0 else (None, None)
    try:
        if case == "no_sync" and d == 1:
            with pipe.no_sync():
                pipe.step(*args)
        elif case == "bad batch" and d == 1:
            pipe.step(*((x[:7], y[:7]) if p == 0 else args))  # 7 rows: not 4 micro-batches
        else:
            pipe.step(*args)
        out["error"] = "no error"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    for s in mine:
        s.zero_grad()
    out["loss"] = pipe.step(*args)  # the rule kept: the pipeline works on
    out["grads"] = [q.grad.clone() for q in pipe.parameters()]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["no_sync", "bad batch"])
def test_replicas_that_disagree_are_named_on_every_rank_and_the_next_step_runs(case):
    # Issue 40 (a04): with replica 1 inside no_sync, global rank 2 aborted in gloo
    # ("Received data size doesn't match expected size"), the others said "lost a peer".
    # Every rank now refuses the step by name before any reduction, and the next step runs.
    results = run_ranks(_replicas_disagree, 4, case, timeout=120)
    for r, res in enumerate(results):
        if case == "no_sync":
            want = (
                "PipelineError: the data-parallel replicas disagree on no_sync(): replica(s) "
                "[1] called step() inside no_sync() and replica(s) [0] outside it; every "
                "replica must skip (or run) the gradient reductions together (no rank ran the "
                "step)"
            )
        elif r == 2:  # replica 1's input rank: its own error
            want = "ValueError: inputs[0] of shape [7, 8] does not split on dim 0 into"
        elif r == 3:
            want = "PipelineError: rank 0 rejected this batch (ValueError: inputs[0] of shape"
        else:  # replica 0 learns it at once, instead of waiting in its reductions
            want = (
                "PipelineError: data-parallel replica(s) [1] refused this step (their ranks "
                "raise why); no rank ran the step"
            )
        assert res["error"].startswith(want), f"global rank {r}: {res['error']}"
    losses = [res["loss"] for res in results]
    assert all(torch.equal(loss, losses[0]) for loss in losses)
    for a, b in zip(results[0]["grads"], results[2]["grads"], strict=True):
        assert torch.equal(a, b)  # replicas 0 and 1 of pipeline rank 0 hold the same mean
