"""Failures with no exception to report, named anyway: a lost store, a rank stopped past the
timeout, ranks configured differently, calls that do not match, a rank that builds late.

Each case asserts the exact rank named and what the error came from: the protocol (a
notice, a closed connection, a configuration that differs), or, where a timeout is the
mechanism, that the rank waited for it. There is no upper bound on how long: a rank that
waits past its message hangs ``run_ranks``, which then fails with every rank's stack. The
pipeline timeouts are short (3 s) so that the cases that must wait for one stay cheap; see
``graphpipe.runtime.coordination.faults`` and ``runtime/coordination/config.py``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.pipeline_models import batch, build_stages, local_stages, mse
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

T = 3.0  # the pipeline timeout of the cases that wait for one (seconds): margin for a busy CI


def _pipe(rank: int, world: int, timeout: float = T, **kw):
    import graphpipe

    mine = local_stages(build_stages(2 * world), rank, world)
    kw.setdefault("schedule", "dualpipev")
    kw.setdefault("num_microbatches", 2 * world)
    return graphpipe.Pipeline(mine, loss_fn=mse, timeout=timeout, **kw)


def _step(pipe, rank: int, seed: int = 1):
    x, y = batch(4 * pipe.num_ranks, seed=seed)
    return pipe.step(x if rank == 0 else None, y if rank == 0 else None)


def _attempt(fn) -> tuple[str, float]:
    """``(error as "Type: message", seconds it took)``; ``"no error"`` when none."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


# ------------------------------------------------------------------ the store's host dies
def _store_host_killed_case(rank: int, world: int) -> dict:
    pipe = _pipe(rank, world, timeout=60.0)
    _step(pipe, rank)
    import torch.distributed as dist

    try:
        _store().set(f"ready/{rank}", "1")
        _store().wait([f"ready/{1 - rank}"])
    except dist.DistNetworkError:  # rank 1: rank 0 died (with the store) before answering
        pass
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the host of the job's TCPStore
    return {"errors": [_attempt(lambda: _step(pipe, rank))[0] for _ in range(3)]}


def test_a_lost_store_names_its_host_and_then_the_pipeline_is_closed() -> None:
    _, r1 = run_ranks(_store_host_killed_case, 2, timeout=180, pg_timeout=60, may_die=(0,))
    first, *later = r1["errors"]
    assert first.startswith(
        "PipelineError: the job's c10d store is unreachable: its host, "
        "global rank 0 (the TCPStore server at 127.0.0.1:"
    ), first
    assert "this rank (rank 1" in first and "every later call raises PipelineClosed" in first
    for error in later:
        assert error.startswith(
            "PipelineClosed: pipeline closed: the job's c10d store is "
            "unreachable: its host, global rank 0"
        ), error
    # at once: its traffic's connection closed, it did not time out (the timeout is 60 s)
    assert "Connection reset by peer" in first or "Connection closed" in first, first
    assert "timed out" not in first.lower(), first


# ------------------------------------------------ a rank stopped past the timeout comes back
def _stopped_case(rank: int, world: int) -> dict:
    pipe = _pipe(rank, world)
    store = _store()
    store.set(f"pid/{rank}", str(os.getpid()))
    out: dict = {}
    _step(pipe, rank)
    if rank == 1:  # stop in the forward of stage 1 (micro-batch 1) of the next step
        stage = pipe.modules[0]
        real, calls = stage.forward, {"n": 0}

        def forward(*args):
            calls["n"] += 1
            if calls["n"] == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(*args)

        stage.forward = forward
    out["step"], out["seconds"] = _attempt(lambda: _step(pipe, rank))
    if rank == 0:
        os.kill(int(store.get("pid/1")), signal.SIGCONT)
    out["next"], _ = _attempt(lambda: _step(pipe, rank))
    store.set(f"done/{rank}", "1")
    store.wait(["done/0", "done/1"])  # rank 0 hosts the store: it stays until rank 1 is done
    return out


def test_a_rank_stopped_past_the_timeout_is_named_and_told_when_it_comes_back() -> None:
    r0, r1 = run_ranks(_stopped_case, 2, timeout=180, pg_timeout=60)
    assert r0["step"].startswith("PipelineError: the step failed on rank 0 at wait "), r0
    assert f"rank 1 did not answer within the {T:g} s timeout and waits on no rank" in r0["step"]
    assert T <= r0["seconds"]  # it waited for the timeout
    assert r0["next"].startswith("PipelineClosed: pipeline closed: rank 1 was lost in step 2")
    # the stopped rank, continued: its peers gave up on it
    assert r1["step"].startswith(
        "PipelineClosed: pipeline closed: the other ranks gave up on this rank (rank 1) in "
        "step 2: rank 0 at wait "
    ), r1["step"]
    assert r1["next"] == r1["step"]


# ------------------------------------------------------------ ranks configured differently
def _mismatch_case(rank: int, world: int) -> dict:
    out = {}
    schedule = "dualpipev" if rank == 0 else "zbv"
    out["schedule"], _ = _attempt(lambda: _pipe(rank, world, schedule=schedule))
    m = 4 if rank == 0 else 8
    out["m"], _ = _attempt(lambda: _pipe(rank, world, num_microbatches=m))
    clip = 1.0 if rank == 1 else None
    out["clip"], _ = _attempt(lambda: _pipe(rank, world, clip_grad_norm=clip))
    reduction = "sum" if rank == 1 else "mean"
    out["reduction"], _ = _attempt(lambda: _pipe(rank, world, loss_reduction=reduction))
    out["loss"] = _step(_pipe(rank, world), rank)  # a pipeline that agrees still works
    return out


def test_ranks_configured_differently_fail_at_construction_naming_both_values() -> None:
    r0, r1 = run_ranks(_mismatch_case, 2, timeout=120, pg_timeout=60)
    prefix = "ValueError: the pipeline ranks are configured differently: "
    for res in (r0, r1):  # the same error on every rank
        assert res["schedule"] == (
            prefix + "rank 1 has schedule='zbv', rank 0 has schedule='dualpipev'"
        )
        assert res["m"] == prefix + "rank 1 has num_microbatches=8, rank 0 has num_microbatches=4"
        assert (
            res["clip"] == prefix + "rank 1 has clip_grad_norm=1.0, rank 0 has clip_grad_norm=None"
        )
        assert res["reduction"] == (
            prefix + "rank 1 has loss_reduction='sum', rank 0 has loss_reduction='mean'"
        )
    assert torch.equal(r0["loss"], r1["loss"])


def test_a_custom_schedule_that_differs_is_named_by_its_first_different_action() -> None:
    from graphpipe.runtime.coordination.config import PipelineConfig, _differences

    a = PipelineConfig({"schedule": "'custom'"}, {"0": ["0F0", "0F1"], "1": ["1F0"]})
    b = PipelineConfig({"schedule": "'custom'"}, {"0": ["0F1", "0F0"], "1": ["1F0"]})
    assert _differences([a, a, b]) == [
        "rank 2 has another compute schedule than rank 0: action 0 of pipeline rank 0 is 0F1 "
        "on rank 2, 0F0 on rank 0"
    ]
    assert a.digest() != b.digest()


# --------------------------------------------------------------- calls that do not match
def _one_sided_case(rank: int, world: int) -> dict:
    pipe = _pipe(rank, world)
    store = _store()
    out: dict = {"first": _step(pipe, rank)}
    if rank == 0:  # step 2 alone: rank 1 is idle, waiting in the store for rank 0's error
        out["alone"], out["seconds"] = _attempt(lambda: _step(pipe, rank))
        store.set("told", "1")
    else:
        store.wait(["told"])
        out["late"], out["seconds"] = _attempt(lambda: _step(pipe, rank))
    out["after"] = _step(pipe, rank, seed=3)  # the pipeline works again
    return out


def test_a_call_one_rank_never_entered_names_that_rank_idle() -> None:
    r0, r1 = run_ranks(_one_sided_case, 2, timeout=120, pg_timeout=60)
    assert r0["alone"].startswith(
        "PipelineError: the step failed on rank 0 at batch agreement: rank 1 has not entered "
        "step 2: it is idle"
    ), r0["alone"]
    assert T <= r0["seconds"]  # it waited for the timeout
    # rank 1, when it comes, is told why rank 0 gave up (the notice: no waiting)
    assert r1["late"].startswith(
        "PipelineError: the step failed on rank 0 at batch agreement: rank 1 has not entered "
        "step 2: it is idle"
    ), r1["late"]
    assert torch.equal(r0["after"], r1["after"])


def _opposite_orders_case(rank: int, world: int) -> dict:
    p, q = _pipe(rank, world), _pipe(rank, world)
    first, second = (p, q) if rank == 0 else (q, p)
    out: dict = {}
    out["first"], out["seconds"] = _attempt(lambda: _step(first, rank))
    out["second"], _ = _attempt(lambda: _step(second, rank))
    out["p"], out["q"] = _step(p, rank), _step(q, rank)  # in one order: both work again
    out["keys"] = (p.groups.key, q.groups.key)
    return out


def test_two_pipelines_called_in_opposite_orders_name_the_other_pipeline() -> None:
    from graphpipe.runtime.coordination.status import describe_pipeline

    r0, r1 = run_ranks(_opposite_orders_case, 2, timeout=120, pg_timeout=60)
    first, second = map(describe_pipeline, r0["keys"])
    assert first.startswith("the ") and first.endswith(" pipeline built on global ranks [0, 1]")
    assert r0["first"].startswith(
        "PipelineError: the step failed on rank 0 at batch agreement: rank 1 has not entered "
        f"step 1: it is in step 1 of another pipeline ({second}), at batch agreement"
    ), r0["first"]
    assert r1["first"].startswith(
        "PipelineError: the step failed on rank 1 at batch agreement: rank 0 has not entered "
        f"step 1: it is in step 1 of another pipeline ({first}), at batch agreement"
    ), r1["first"]
    for res in (r0, r1):
        assert T <= res["seconds"]  # it waited for the timeout
    # the second call of each rank learns the other rank's notice of it
    assert r0["second"].startswith("PipelineError: the step failed on rank 1 at batch agreement")
    assert r1["second"].startswith("PipelineError: the step failed on rank 0 at batch agreement")
    assert torch.equal(r0["p"], r1["p"]) and torch.equal(r0["q"], r1["q"])


# ------------------------------------------------------------------------- a late rank
def _late_case(rank: int, world: int) -> dict:
    store = _store()
    out: dict = {}
    if rank == 1:
        time.sleep(T + 2.0)
    out["error"], out["seconds"] = _attempt(lambda: _pipe(rank, world))
    store.set(f"built/{rank}", "1")
    store.wait(["built/0", "built/1"])
    out["loss"] = _step(_pipe(rank, world), rank)  # the next pipeline is built in step
    return out


def test_a_rank_that_builds_late_is_named_on_the_ranks_that_waited() -> None:
    r0, r1 = run_ranks(_late_case, 2, timeout=120, pg_timeout=60)
    assert r0["error"].startswith(
        f"PipelineError: rank 1 did not join the pipeline within {T:g} s: it is in no pipeline call"
    ), r0["error"]
    assert T <= r0["seconds"]  # it waited for the timeout
    assert r1["error"].startswith(
        f"PipelineError: rank 1 did not join the pipeline within {T:g} s (rank 0 gave up "
        "waiting for it); this rank (rank 1) came later"
    ), r1["error"]  # told at once: the mark rank 0 left, read when rank 1 joins
    assert torch.equal(r0["loss"], r1["loss"])


# --------------------------------------------------------- a replica that does not come
def _absent_replica_case(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    stages = build_stages(4)
    pipe = graphpipe.DualPipeV(
        (stages[p], stages[3 - p]),
        num_microbatches=4,
        loss_fn=mse,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        timeout=T,
    )
    store = _store()
    out: dict = {"replica": d}
    if d == 0:  # replica 1 never calls step: replica 0 waits in the replicas' agreement
        out["error"], _ = _attempt(lambda: _step(pipe, p))
        store.set(f"done/{rank}", "1")
    else:
        store.wait(["done/0", "done/1"])
    return out


def test_a_replica_that_never_enters_the_step_is_named_at_the_timeout() -> None:
    results = run_ranks(_absent_replica_case, 4, timeout=120, pg_timeout=60)
    for res in results[:2]:
        assert res["error"].startswith("PipelineError: the step failed on rank ")
        assert (
            "at data-parallel agreement: a data-parallel replica did not come to the replicas' "
            "agreement of step 1 within the 3 s timeout: it is not in the step"
        ) in res["error"], res["error"]
        assert "this rank had not started the call: its gradients are untouched" in res["error"]
