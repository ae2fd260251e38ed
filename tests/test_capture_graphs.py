"""The capture driver through the CPU graph: what a GPU runs, run on gloo ranks.

A captured pipeline (1 and 2 ranks, ``capture="step"`` and ``"action"``, ``recapture``) gives
eager's losses and gradients bitwise (the replay runs the eager step's kernels in the same
order) while its stages' Python does not run again, and each way a graph could silently
differ from eager is exact or refused by name: a non-contiguous stage output sent from
per-action graphs, per-signature sends under ``recapture``, an optimizer whose Python
hyper-parameters change after capture, parameters that get no gradient, a host sync inside
a stage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.pipeline_models import batch, build_stages, local_stages, mse, params, twin_step
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


class Counted(nn.Module):
    """A stage that counts the calls of its Python ``forward``; ``transposed``: it passes
    its output on transposed, a non-contiguous view (what ``take_activation`` makes
    contiguous before a send), and its successor transposes it back."""

    def __init__(self, inner: nn.Module, first: bool, last: bool, transposed: bool) -> None:
        super().__init__()
        self.inner, self.first, self.last, self.transposed = inner, first, last, transposed
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.transposed and not self.first:
            x = x.t()
        y = self.inner(x)
        return y.t() if self.transposed and not self.last else y


def _twins(rank: int, world: int, mode: str, transposed: bool = False, **kw):
    import graphpipe

    def stages():
        n = 2 * world
        built = [Counted(s, i == 0, i == n - 1, transposed) for i, s in enumerate(build_stages(n))]
        return local_stages(built, rank, world)

    es, cs = stages(), stages()
    eager = graphpipe.DualPipeV(es, num_microbatches=4, loss_fn=mse)
    captured = graphpipe.DualPipeV(cs, num_microbatches=4, loss_fn=mse, capture=mode, **kw)
    return eager, es, captured, cs


def _equal_case(rank: int, world: int, mode: str, transposed: bool, shapes: list[int]) -> dict:
    eager, es, captured, cs = _twins(rank, world, mode, transposed=transposed, recapture=True)
    problems: list[str] = []
    calls_after_capture: dict[int, int] = {}
    for step, rows in enumerate(shapes):
        x, y = batch(rows, seed=50 + step)
        xs, ys = (x, y) if rank == 0 else (None, None)
        problems += [
            f"step {step} ({rows} rows): {d}" for d in twin_step(eager, es, captured, cs, xs, ys)
        ]
        calls = sum(s.calls for s in cs)
        if rows in calls_after_capture and calls != calls_after_capture[rows]:
            problems.append(f"step {step}: the stages' forward ran again ({calls} calls)")
        # a signature's second step captures it: from then on no Python forward
        if shapes[:step].count(rows) == 1:
            calls_after_capture = {r: calls for r in calls_after_capture} | {rows: calls}
        with torch.no_grad():
            for s in (*es, *cs):
                for p in s.parameters():
                    p.mul_(0.99)
    captured.close()
    return {"problems": problems}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["step", "action"])
def test_a_captured_pipeline_equals_eager_and_runs_no_stage_python_after_capture(world, mode):
    shapes = [8, 8, 8, 8]
    for rank, res in enumerate(run_ranks(_equal_case, world, mode, False, shapes)):
        assert res["problems"] == [], f"rank {rank}"


@pytest.mark.parametrize("mode", ["step", "action"])
def test_recapture_with_alternating_shapes_sends_each_signatures_own_tensors(mode):
    """Finding 1: per-action graphs send tensors prepared per capture; a replay of an older
    signature sends its own (not the newest capture's, of another size)."""
    shapes = [8, 8, 12, 12, 8, 12, 8, 12]
    for rank, res in enumerate(run_ranks(_equal_case, 2, mode, False, shapes)):
        assert res["problems"] == [], f"rank {rank}"


@pytest.mark.parametrize("mode", ["step", "action"])
def test_a_non_contiguous_stage_output_is_sent_fresh_at_every_replay(mode):
    """Finding 3: the contiguous copy a send needs is made inside the graphs, not once at
    capture."""
    for rank, res in enumerate(run_ranks(_equal_case, 2, mode, True, [8, 8, 8, 8])):
        assert res["problems"] == [], f"rank {rank}"


# ------------------------------------------------------------ the optimizer inside the step


def _last_step_error(pipe: Any, xs: Any, ys: Any) -> str:
    """One more step, then close: what it raised (``Type: message``), or ``no error``."""
    try:
        pipe.step(xs, ys)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        pipe.close()
    return "no error"


def _lr_case(rank: int, world: int, mode: str) -> str:
    import graphpipe

    stages = local_stages(build_stages(2 * world), rank, world)
    opt = torch.optim.SGD(params(stages), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    pipe = graphpipe.DualPipeV(
        stages, num_microbatches=4, loss_fn=mse, capture=mode, capture_optimizer=opt
    )
    x, y = batch(8)
    xs, ys = (x, y) if rank == 0 else (None, None)
    pipe.step(xs, ys)  # warmup
    pipe.step(xs, ys)  # capture, lr 0.1 baked in
    sched.step()  # lr 0.05
    return _last_step_error(pipe, xs, ys)


@pytest.mark.parametrize("mode", ["step", "action"])
def test_a_learning_rate_schedule_after_capture_is_refused_naming_lr(mode):
    """Finding 5: the optimizer's Python floats are constants of the graph."""
    for rank, msg in enumerate(run_ranks(_lr_case, 2, mode)):
        assert "param_groups[0]['lr'] changed from 0.1 to 0.05" in msg, f"rank {rank}: {msg}"
        assert "tensor lr" in msg


class WithUnused(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.unused = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _unused_case(rank: int, world: int, mode: str, inside: bool) -> list[str]:
    import graphpipe

    def build():
        return local_stages([WithUnused(s) for s in build_stages(2 * world)], rank, world)

    es, cs = build(), build()
    opt_e = torch.optim.SGD(params(es), lr=0.1, weight_decay=0.5)
    opt_c = torch.optim.SGD(params(cs), lr=0.1, weight_decay=0.5)
    eager = graphpipe.DualPipeV(es, num_microbatches=4, loss_fn=mse)
    captured = graphpipe.DualPipeV(
        cs,
        num_microbatches=4,
        loss_fn=mse,
        capture=mode,
        capture_optimizer=opt_c if inside else None,
    )
    problems = []
    for step in range(4):
        x, y = batch(8, seed=step)
        xs, ys = (x, y) if rank == 0 else (None, None)
        opt_e.zero_grad()  # set_to_none: the unused parameters keep no .grad
        eager.step(xs, ys)
        opt_e.step()
        if not inside:
            opt_c.zero_grad(set_to_none=False)
        captured.step(xs, ys)
        if not inside:
            opt_c.step()
        for i, (a, b) in enumerate(zip(params(es), params(cs), strict=True)):
            if not torch.equal(a, b):
                problems.append(f"step {step}: parameter {i} {tuple(a.shape)} differs")
        for s in cs:
            if s.unused.grad is not None:
                problems.append(f"step {step}: the unused parameter got a .grad")
    captured.close()
    return problems


@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("mode", ["step", "action"])
def test_a_parameter_without_gradients_ends_as_eager_leaves_it(mode, inside):
    """Finding 6: the capture gives a static .grad only to the parameters the warmup step
    gave one; weight decay leaves the others alone, as in eager."""
    for rank, problems in enumerate(run_ranks(_unused_case, 2, mode, inside)):
        assert problems == [], f"rank {rank}"


def _zero_grad_case(rank: int, world: int, mode: str) -> dict:
    eager, es, captured, cs = _twins(rank, world, mode)
    opt_e = torch.optim.SGD(params(es), lr=0.1)
    opt_c = torch.optim.SGD(params(cs), lr=0.1)
    problems = []
    for step in range(4):
        x, y = batch(8, seed=step)
        xs, ys = (x, y) if rank == 0 else (None, None)
        opt_e.zero_grad()  # set_to_none=True, torch's default
        opt_c.zero_grad()
        le, lc = eager.step(xs, ys), captured.step(xs, ys)
        if not torch.equal(le, lc):
            problems.append(f"step {step}: loss differs")
        for i, (a, b) in enumerate(zip(params(es), params(cs), strict=True)):
            if not torch.equal(a.grad, b.grad):
                problems.append(f"step {step}: grad {i} differs")
        opt_e.step()
        opt_c.step()
    cs[0].inner.fc1.weight.grad = torch.zeros_like(cs[0].inner.fc1.weight)  # replaced
    try:
        captured.step(xs, ys)
        replaced = "no error"
    except RuntimeError as e:
        replaced = str(e)
    captured.close()
    return {"problems": problems, "replaced": replaced}


@pytest.mark.parametrize("mode", ["step", "action"])
def test_zero_grad_to_none_between_replays_is_exact_and_a_replaced_grad_is_refused(mode):
    for rank, res in enumerate(run_ranks(_zero_grad_case, 2, mode)):
        assert res["problems"] == [], f"rank {rank}"
        assert "was replaced by another tensor after capture" in res["replaced"], rank


# ------------------------------------------------------------------------- host syncs


class Syncing(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if y.mean() > 100:  # a host read: the value decides the Python path
            y = y * 0
        return y


def _sync_case(rank: int, world: int, mode: str) -> str:
    import graphpipe

    built = build_stages(2 * world)
    built[2 * world - 1] = Syncing(built[2 * world - 1])  # the last stage, on rank 0
    pipe = graphpipe.DualPipeV(
        local_stages(built, rank, world), num_microbatches=4, loss_fn=mse, capture=mode
    )
    x, y = batch(8)
    xs, ys = (x, y) if rank == 0 else (None, None)
    pipe.step(xs, ys)  # eager: fine
    return _last_step_error(pipe, xs, ys)


@pytest.mark.parametrize("mode", ["step", "action"])
def test_a_host_sync_inside_a_stage_is_refused_at_capture_naming_the_action(mode):
    stage = 3  # the last stage of 2 ranks, on rank 0
    msgs = run_ranks(_sync_case, 2, mode)
    assert msgs[0].startswith("CaptureError"), msgs[0]
    assert "aten._local_scalar_dense" in msgs[0] and f"action {stage}F" in msgs[0]
    assert "`if y.mean() > 100:" in msgs[0]
    assert msgs[1].startswith("PipelineError") and "rank 0" in msgs[1], msgs[1]


# ------------------------------------------------- what CUDA alone runs: refused or chosen


def test_capture_refuses_what_a_cuda_graph_or_nccl_cannot_hold(monkeypatch):
    from graphpipe.runtime.coordination.checks import check_capture

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA over a gloo pipeline group"):
        check_capture("step", cuda, False, 2, "start", [])
    check_capture("step", cuda, False, 1, "start", [])  # one rank: no P2P to hold
    for receives in ("start", "plain"):
        with pytest.raises(ValueError, match=f"receives={receives!r}.*receives='timed'"):
            check_capture("action", cuda, True, 2, receives, [])
    check_capture("action", cuda, True, 2, "timed", [])
    check_capture("step", cuda, True, 2, "start", [])
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "0")
    with pytest.raises(ValueError, match="NCCL_GRAPH_MIXING_SUPPORT=0"):
        check_capture("step", cuda, True, 2, "timed", [])
    check_capture("step", cpu, False, 2, "start", [])  # gloo on CPU: the CPU graph


def test_a_compiled_stage_under_cpu_capture_warns_naming_it():
    from graphpipe.runtime.coordination.checks import check_capture

    stage = nn.Sequential(torch.compile(nn.Linear(2, 2)))
    with pytest.warns(UserWarning, match=r"torch.compile'd modules \(Linear\)"):
        check_capture("step", torch.device("cpu"), False, 1, "start", [stage])


def test_cuda_graphs_capture_in_thread_local_mode_without_a_device_synchronize(monkeypatch):
    """Finding 4 and 7: per-action captures must not synchronize the device while P2P is
    in flight between them, and NCCL's watchdog threads must not invalidate a capture."""
    import contextlib

    from graphpipe.runtime.capture import graphs

    log: list = []

    class FakeGraph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            log.append(("begin", pool, capture_error_mode))

        def capture_end(self):
            log.append("end")

        def replay(self):
            log.append("replay")

    monkeypatch.setattr(graphs.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(graphs.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graphs.torch.cuda, "synchronize", lambda *a: log.append("synchronize"))
    g = graphs.CudaGraph(pool="pool", stream="stream")
    assert g.capture(lambda: log.append("fn") or 7) == 7
    assert log == [("begin", "pool", "thread_local"), "fn", "end", "replay"]
    assert graphs.CAPTURE_ERROR_MODE == "thread_local"


def test_nccl_p2p_and_its_warm_up_go_through_one_path(monkeypatch):
    """Finding 7: a lone send and a batch use different NCCL communicators (pytorch#160342);
    every transfer, one tensor included, and the warm-up go through batch_isend_irecv."""
    from types import SimpleNamespace

    from graphpipe.runtime.core import comm

    batches: list = []
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: batches.append(ops) or [])
    monkeypatch.setattr(comm.dist, "P2POp", lambda fn, x, peer, group, tag: (fn, peer, group))
    groups = SimpleNamespace(
        nccl=True, p2p={(0, 1): ("g01", 1), (1, 0): ("g10", 1)}, global_ranks=[10, 11]
    )
    engine = SimpleNamespace(groups=groups, rank=0, device=torch.device("cpu"))
    t = SimpleNamespace(edge=(0, 1), peer_global=11, peer_rank=1, name="0SEND_F0")
    comm.CommEngine._issue(engine, t, [torch.zeros(2)], True)
    assert batches == [[(comm.dist.isend, 11, "g01")]]
    batches.clear()
    comm.CommEngine.warm(engine)
    assert batches == [[(comm.dist.isend, 11, "g01")], [(comm.dist.irecv, 11, "g10")]]


# ------------------------------------------------------------------ tensor parallelism


def _tp_case(rank: int, world: int, mode: str) -> list[str]:
    """A one-rank pipeline of tensor-parallel stages (tp 2): DTensor operations recorded at
    their level, the rowwise layer's AsyncCollectiveTensor waited for in the graph."""
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe
    from tests.test_tensor_parallel import _parallel, _stages

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "tp"))
    pipes, stage_sets = [], []
    for capture in (False, mode):
        mine = _stages()[:2]
        _parallel(mine, mesh["tp"])
        pipes.append(
            graphpipe.DualPipeV(
                mine, num_microbatches=4, loss_fn=mse, group=mesh.get_group("pp"), capture=capture
            )
        )
        stage_sets.append(mine)
    problems = []
    for step in range(4):
        x, y = batch(8, seed=step)
        for mine in stage_sets:
            for s in mine:
                s.zero_grad(set_to_none=False)
        le, lc = (p.step(x, y) for p in pipes)
        if not torch.equal(le, lc):
            problems.append(f"step {step}: loss {lc.item()} != {le.item()}")
        for a, b in zip(*(params(m) for m in stage_sets), strict=True):
            if a.grad is not None and not torch.equal(a.grad.to_local(), b.grad.to_local()):
                problems.append(f"step {step}: a gradient differs")
    for p in pipes:
        p.close()
    return problems


@pytest.mark.parametrize("mode", ["step", "action"])
def test_tensor_parallel_stages_replay_equal_to_eager(mode):
    for rank, problems in enumerate(run_ranks(_tp_case, 2, mode)):
        assert problems == [], f"rank {rank}"


# --------------------------------------------------------------------- failures in replay


def _dead_peer_in_replay(rank: int, world: int, mode: str) -> str:
    import os
    import time

    import graphpipe

    pipe = graphpipe.DualPipeV(
        local_stages(build_stages(2 * world), rank, world),
        num_microbatches=4,
        loss_fn=mse,
        capture=mode,
        timeout=300.0,
    )
    x, y = batch(8)
    xs, ys = (x, y) if rank == 0 else (None, None)
    pipe.step(xs, ys)
    pipe.step(xs, ys)  # captured
    if rank == 1:  # the process ends in the middle of its replay, after the agreement
        cap = next(iter(pipe._capture.captures.values()))
        g = max((g for g in cap.graphs.graphs if g is not None), key=len)
        g.calls[len(g.calls) // 2] = lambda: os._exit(3)
    start = time.monotonic()
    try:
        pipe.step(xs, ys)
        return "no error"
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.0f} s: {e}"


@pytest.mark.parametrize("mode", ["step", "action"])
def test_a_peer_lost_during_a_replay_is_named_within_seconds(mode):
    results = run_ranks(_dead_peer_in_replay, 2, mode, timeout=120, may_die=(1,))
    assert results[1] is None
    msg = results[0]
    assert msg.startswith("PipelineError"), msg
    assert "gone or stuck" in msg and "batch agreement" not in msg, msg
