"""Static plan and static replay on CPU: bitwise equal to eager, clear errors, reuse."""

from __future__ import annotations

import pytest
import torch

from tests.pipeline_models import batch, build_stages, local_stages, mse, params, twin_step
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

RECEIVED = ("recv_activation", "recv_grad", "recv_packet")


def _twin_pipelines(rank: int, world: int, m: int, **kw):
    import graphpipe

    tuple_io = kw.get("tuple_io", False)
    eager_stages = local_stages(build_stages(2 * world, tuple_io=tuple_io), rank, world)
    cap_stages = local_stages(build_stages(2 * world, tuple_io=tuple_io), rank, world)
    receives = kw.get("receives")
    eager = graphpipe.DualPipeV(eager_stages, num_microbatches=m, loss_fn=mse, receives=receives)
    captured = graphpipe.DualPipeV(
        cap_stages,
        num_microbatches=m,
        loss_fn=mse,
        capture=True,
        recapture=kw.get("recapture", False),
        receives=receives,
    )
    return eager, eager_stages, captured, cap_stages


def _bitwise_case(
    rank: int, world: int, m: int, rows: int, steps: int, tuple_io: bool, receives: str | None
) -> dict:
    import graphpipe.meta as meta

    eager, es, captured, cs = _twin_pipelines(rank, world, m, tuple_io=tuple_io, receives=receives)
    opt_e = torch.optim.SGD(params(es), lr=0.1)
    opt_c = torch.optim.SGD(params(cs), lr=0.1)
    mismatches: list[str] = []
    allocs_after_plan = 0
    real_empty = meta.TensorMeta.empty

    def counting_empty(self):
        nonlocal allocs_after_plan
        allocs_after_plan += 1
        return real_empty(self)

    for step in range(steps):
        x, y = batch(rows, seed=100 + step)
        xs, ys = (x, y) if rank == 0 else (None, None)
        # bitwise: the static replay runs the eager program's kernels in the same order
        if step == 3:  # an eager forward() between captured steps leaves the capture intact
            fe, fc = eager.forward(xs), captured.forward(xs)
            if rank == 0 and not torch.equal(fe, fc):
                mismatches.append("forward() outputs differ")
        opt_e.zero_grad(set_to_none=False)
        opt_c.zero_grad(set_to_none=False)
        le = eager.step(xs, ys)
        if step >= 1:
            meta.TensorMeta.empty = counting_empty
        try:
            lc = captured.step(xs, ys)
        finally:
            meta.TensorMeta.empty = real_empty
        if not torch.equal(le, lc):
            mismatches.append(f"step {step}: loss {le.item()!r} != {lc.item()!r}")
        for i, (pe, pc) in enumerate(zip(params(es), params(cs))):
            if not torch.equal(pe.grad, pc.grad):
                mismatches.append(f"step {step}: grad of param {i} differs")
        opt_e.step()
        opt_c.step()
    plan = captured.plan
    packets = [t for t in [*captured.program.sends, *captured.program.recvs] if t.packable()]
    return {
        "packets": len(packets),
        "packets_on_plan": all(
            p.static is not None and p.static.data_ptr() in plan.data_ptrs() for p in packets
        ),
        "mismatches": mismatches,
        "allocs_after_plan": allocs_after_plan,
        "planned": sum(plan.nbytes().values()),
        "naive": sum(plan.naive_nbytes().values()),
        "p2p_planned": sum(plan.nbytes()[k] for k in RECEIVED),
        "p2p_naive": sum(plan.naive_nbytes()[k] for k in RECEIVED),
        "record": len(captured.record.activations),
    }


@pytest.mark.parametrize(
    "world,m,rows,tuple_io,receives",
    [
        (1, 3, 6, False, None),
        (2, 5, 10, False, "timed"),
        (2, 4, 8, True, None),
        (4, 8, 8, False, "timed"),
        (4, 8, 8, False, None),
    ],
)
def test_static_replay_is_bitwise_equal_to_eager_over_steps(world, m, rows, tuple_io, receives):
    results = run_ranks(_bitwise_case, world, m, rows, 5, tuple_io, receives)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches']}"
        assert res["allocs_after_plan"] == 0, f"rank {rank} allocated plan-managed buffers"
        assert res["record"] == 2 * m  # every forward of both local stages was recorded
        # messages packed per peer (gloo) travel through plan buffers too
        assert res["packets_on_plan"]
        assert (res["packets"] > 0) == (world > 1)
        if world > 1 and receives == "timed":
            # Receive buffers are reused across micro-batches whose lifetimes do not overlap.
            assert 0 < res["p2p_planned"] < res["p2p_naive"], res
            assert res["planned"] < res["naive"]
        elif world > 1:
            # gloo's default posts every receive at the start: each buffer lives all step.
            assert 0 < res["p2p_planned"] == res["p2p_naive"], res
            assert res["planned"] <= res["naive"]


def _shape_case(rank: int, world: int) -> dict:
    eager, es, captured, cs = _twin_pipelines(rank, world, 4)
    x, y = batch(8)
    xs, ys = (x, y) if rank == 0 else (None, None)
    for _ in range(2):
        eager.step(xs, ys)
        captured.step(xs, ys)
    bx, by = batch(12)
    err = None
    try:
        captured.step(bx if rank == 0 else None, by if rank == 0 else None)
    except ValueError as e:
        err = str(e)
    # the pipeline keeps working with the original shape, still bitwise equal
    return {"err": err, "problems": twin_step(eager, es, captured, cs, xs, ys)}


def test_a_batch_of_another_shape_raises_on_every_rank_and_the_pipeline_keeps_working():
    for rank, res in enumerate(run_ranks(_shape_case, 2)):
        assert res["err"] is not None, f"rank {rank} did not raise"
        assert "inputs[0] has shape [12, 8] float64" in res["err"]
        assert "captured with inputs[0] of shape [8, 8] float64" in res["err"]
        assert res["problems"] == [], f"rank {rank}: replay after the error differs from eager"


def _recapture_case(rank: int, world: int) -> dict:
    eager, es, captured, cs = _twin_pipelines(rank, world, 4, recapture=True)
    problems = []
    for rows in (8, 8, 12, 12, 12, 8, 12):
        x, y = batch(rows, seed=rows)
        xs, ys = (x, y) if rank == 0 else (None, None)
        problems += [f"{rows} rows: {p}" for p in twin_step(eager, es, captured, cs, xs, ys)]
    return {"problems": problems, "captures": len(captured._capture.captures)}


def test_recapture_keeps_one_plan_per_signature():
    for rank, res in enumerate(run_ranks(_recapture_case, 2)):
        assert res["problems"] == [], f"rank {rank}"
        assert res["captures"] == 2


def test_plan_reuses_buffers_whose_lifetimes_do_not_overlap():
    from graphpipe.meta import TensorMeta
    from graphpipe.runtime.capture import build_plan
    from graphpipe.schedule.ir import Action, Op

    meta = (TensorMeta((4, 8), torch.float32, torch.device("cpu")),)
    f = lambda s, m: Action(s, Op.F, m)
    b = lambda s, m: Action(s, Op.B, m)
    program = [
        ([("recv_activation", 1, 0)], f(1, 0)),
        ([], b(1, 0)),
        ([("recv_activation", 1, 1)], f(1, 1)),  # mb 0 is dead: reuse
        ([("recv_activation", 1, 2)], f(1, 2)),  # mb 1 is live: new buffer
        ([], b(1, 1)),
        ([], b(1, 2)),
    ]
    metas = {k: meta for keys, _ in program for k in keys}
    plan = build_plan(program, metas)
    bufs = plan.buffers
    assert bufs[("recv_activation", 1, 0)][0] is bufs[("recv_activation", 1, 1)][0]
    assert bufs[("recv_activation", 1, 2)][0] is not bufs[("recv_activation", 1, 1)][0]
    assert plan.nbytes()["recv_activation"] == 2 * 4 * 8 * 4
    assert plan.naive_nbytes()["recv_activation"] == 3 * 4 * 8 * 4
    assert plan.saving() == 4 * 8 * 4
    assert "saving: 128 bytes" in plan.report()


def test_plan_keeps_buffers_alive_until_the_deferred_W():
    from graphpipe.meta import TensorMeta
    from graphpipe.runtime.capture import build_plan
    from graphpipe.schedule.ir import Action, Op

    meta = (TensorMeta((2,), torch.float64, torch.device("cpu")),)
    program = [
        ([("recv_grad", 0, 0)], Action(0, Op.I, 0)),
        ([("recv_grad", 0, 1)], Action(0, Op.I, 1)),  # W of mb 0 still reads mb 0's grad
        ([], Action(0, Op.W, 0)),
        ([], Action(0, Op.W, 1)),
    ]
    metas = {k: meta for keys, _ in program for k in keys}
    plan = build_plan(program, metas)
    assert plan.lifetimes[("recv_grad", 0, 0)] == (0, 2)
    assert plan.buffers[("recv_grad", 0, 0)][0] is not plan.buffers[("recv_grad", 0, 1)][0]


def _optimizer_case(rank: int, world: int, mode: str) -> list[str]:
    import graphpipe

    es = local_stages(build_stages(2 * world), rank, world)
    cs = local_stages(build_stages(2 * world), rank, world)
    # SGD with momentum and weight decay: its step stays on tensors (torch's Adam reads its
    # step count on the host unless capturable=True, which torch supports on CUDA only).
    opt_e = torch.optim.SGD(params(es), lr=1e-2, momentum=0.9, weight_decay=0.1)
    opt_c = torch.optim.SGD(params(cs), lr=1e-2, momentum=0.9, weight_decay=0.1)
    eager = graphpipe.DualPipeV(es, num_microbatches=4, loss_fn=mse)
    captured = graphpipe.DualPipeV(
        cs, num_microbatches=4, loss_fn=mse, capture=mode, capture_optimizer=opt_c
    )
    problems = []
    for step in range(5):
        x, y = batch(8, seed=step)
        xs, ys = (x, y) if rank == 0 else (None, None)
        opt_e.zero_grad(set_to_none=False)
        le = eager.step(xs, ys)
        opt_e.step()
        lc = captured.step(xs, ys)  # zeroes grads and steps opt_c itself
        # bitwise: the replay runs the eager program's kernels in the same order
        if not torch.equal(le, lc):
            problems.append(f"step {step}: loss differs")
        for i, (a, b) in enumerate(zip(params(es), params(cs))):
            if not torch.equal(a, b):
                problems.append(f"step {step}: parameter {i} differs after the optimizer step")
    captured.close()
    return problems


@pytest.mark.parametrize("mode", ["step", "action"])
def test_capture_optimizer_runs_zero_grad_and_the_optimizer_step_inside_the_step(mode):
    for rank, problems in enumerate(run_ranks(_optimizer_case, 2, mode)):
        assert problems == [], f"rank {rank}"


def test_an_optimizer_that_reads_its_step_on_the_host_is_refused_on_cpu():
    import graphpipe

    stages = local_stages(build_stages(2), 0, 1)
    opt = torch.optim.Adam(params(stages), lr=0.1)
    with pytest.raises(ValueError, match=r"Adam reads its step count on the host .*SGD"):
        graphpipe.DualPipeV(
            stages, num_microbatches=2, loss_fn=mse, capture=True, capture_optimizer=opt
        )


def test_capture_optimizer_without_capture_is_refused():
    import graphpipe

    stages = local_stages(build_stages(2), 0, 1)
    opt = torch.optim.SGD(params(stages), lr=0.1)
    with pytest.raises(ValueError, match="capture_optimizer needs capture"):
        graphpipe.DualPipeV(stages, num_microbatches=2, loss_fn=mse, capture_optimizer=opt)
