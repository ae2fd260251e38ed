"""The eager DualPipeV runtime on spawned gloo ranks against a single-process reference."""

from __future__ import annotations

import pytest
import torch

from tests.pipeline_models import batch, build_stages, local_stages, mse, reference
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

# Float64, the pipeline against a single-process reference: the micro-batch losses are averaged
# and the weight gradients accumulated in another order (deferred GEMMs, addmm_ into .grad),
# with other GEMM shapes, so MKL may run other kernels on another CPU: equal up to rounding.
# RTOL is about 9000x float64's unit roundoff (1.1e-16); gradients also get 1e-14 absolute
# for elements that cancel to about 0.
RTOL = 1e-12


def _pipeline_case(rank: int, world: int, case: dict) -> dict:
    import graphpipe

    stages = build_stages(2 * world, tuple_io=case["tuple_io"], tied=case["tied"])
    mine = local_stages(stages, rank, world)
    pipe = graphpipe.DualPipeV(
        mine,
        num_microbatches=case["m"],
        loss_fn=mse,
        per_edge_groups=case.get("per_edge", False),
        receives=case.get("receives"),
    )
    # The NCCL way of the first step (handshake over the control group through host memory,
    # then one warm-up exchange per channel), exercised here over gloo.
    pipe.engine.staged = case.get("staged", False)
    x, y = batch(case["rows"])
    losses = []
    for _ in range(case.get("steps", 1)):
        for m in mine:
            m.zero_grad(set_to_none=True)
        loss = pipe.step(x if rank == 0 else None, y if rank == 0 else None)
        losses.append(loss)
    ids = pipe.stage_ids
    grads = {
        (ids[li], name): p.grad.clone()
        for li, m in enumerate(mine)
        for name, p in m.named_parameters(remove_duplicate=False)
    }
    out = pipe.forward(x if rank == 0 else None)
    packed = sum(t.packable() for t in [*pipe.program.sends, *pipe.program.recvs])
    recv_steps = sorted({pipe.program.posted_at[id(t)] for t in pipe.program.recvs})
    return {
        "losses": losses,
        "grads": grads,
        "out": out,
        "packed": packed,
        "receives": pipe.receives,
        "recv_steps": recv_steps,
    }


def _run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_pipeline_case(rank, world, c) for c in cases]


def _check(world: int, case: dict, per_rank: list[dict]) -> None:
    stages = build_stages(2 * world, tuple_io=case["tuple_io"], tied=case["tied"])
    x, y = batch(case["rows"])
    ref_loss, ref_grads, ref_out = reference(stages, x, y)
    for rank, res in enumerate(per_rank):
        for loss in res["losses"]:
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        for key, g in res["grads"].items():
            torch.testing.assert_close(g, ref_grads[key], rtol=RTOL, atol=1e-14, msg=str(key))
        if rank == 0:
            torch.testing.assert_close(res["out"], ref_out, rtol=RTOL, atol=1e-14)
        else:
            assert res["out"] is None
    # every parameter of every stage was checked on some rank
    checked = {k for res in per_rank for k in res["grads"]}
    assert checked == set(ref_grads)
    # gloo's default posts every receive at the start of the step; "timed" spreads them out
    want = case.get("receives") or "start"
    assert all(res["receives"] == want for res in per_rank)
    if world > 1:
        steps = [res["recv_steps"] for res in per_rank]
        assert all(s == [0] for s in steps) if want == "start" else any(len(s) > 1 for s in steps)
    if world > 1 and case.get("steps", 1) > 1:
        # later steps sent several messages per peer as one packet (gloo), and still match
        assert all(res["packed"] > 0 for res in per_rank)


CASES = {
    1: [
        dict(m=2, rows=4, tuple_io=False, tied=False),
        dict(m=3, rows=6, tuple_io=True, tied=True),
    ],
    2: [
        dict(m=4, rows=8, tuple_io=False, tied=False),
        dict(m=5, rows=10, tuple_io=False, tied=True, steps=3),
        dict(m=7, rows=7, tuple_io=True, tied=False, receives="timed"),
        dict(m=6, rows=6, tuple_io=True, tied=True, receives="plain", steps=2),
        dict(m=4, rows=8, tuple_io=True, tied=True, per_edge=True, steps=2),
        dict(m=5, rows=10, tuple_io=True, tied=False, staged=True, steps=2),
    ],
    4: [
        dict(m=8, rows=16, tuple_io=False, tied=True, steps=2),
        dict(m=9, rows=9, tuple_io=True, tied=False, per_edge=True, staged=True),
        dict(m=8, rows=8, tuple_io=False, tied=False, receives="timed", steps=2),
    ],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_loss_grads_and_outputs_match_single_process_reference(world: int) -> None:
    results = run_ranks(_run_cases, world, CASES[world])
    for i, case in enumerate(CASES[world]):
        _check(world, case, [results[r][i] for r in range(world)])


def _mismatch_case(rank: int, world: int) -> str:
    import graphpipe

    mine = local_stages(build_stages(2 * world), rank, world)
    pipe = graphpipe.DualPipeV(mine, num_microbatches=4, loss_fn=mse)
    x, y = batch(8)
    pipe.step(x if rank == 0 else None, y if rank == 0 else None)
    if rank == 0:
        full = mine[0].forward
        mine[0].forward = lambda h: full(h)[:, :5]  # stage 0 now sends a narrower activation
    try:
        pipe.step(x if rank == 0 else None, y if rank == 0 else None)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_edge_whose_shape_changes_is_a_value_error_naming_edge_tensor_and_shapes():
    results = run_ranks(_mismatch_case, 2, pg_timeout=3)
    assert results[0] == (
        "ValueError: activation on edge stage 0 -> stage 1, tensor 0: shape [2, 5] float64, "
        "but the first step exchanged [2, 8] float64"
    )
    # the peer waiting for that message raises at once, naming the rank, action and error
    assert results[1].startswith("PipelineError: the step failed on rank 0 at post 0SEND_F0")
    assert "ValueError: activation on edge stage 0 -> stage 1, tensor 0" in results[1]
    assert "(this rank: rank 1 at " in results[1] and "zero the gradients" in results[1]
