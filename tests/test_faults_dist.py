"""A fault on one rank reaches every rank, fast and by name; the next step works.

Every case runs with a pipeline timeout of 300 s and a gloo timeout of 300 s: a rank that
learned of a failure only through a timeout would hang the test past ``run_ranks``' limit,
so passing proves the failure travelled by the protocol (``graphpipe.runtime.coordination.faults``).

The cases of ``_case`` run with the garbage collector off and keep every error they catch: a
rank tells the ranks blocked on it by closing its connections, which must not wait for the
caller to let go of the error, nor for a collection of the cycles an error's traceback may
form (what made a peer wait for the timeout in CI).
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from tests.pipeline_models import batch, build_stages, local_stages, mse, params
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

LONG = 300.0  # seconds: no test may depend on reaching it


class Boom(Exception):
    """The planted failure."""


def _arm(pipe, mine, kind: str, stage: int, mb: int, state: dict) -> None:
    """Plant a failure of ``kind`` at ``(stage, mb)`` that fires while ``state['armed']``."""
    from graphpipe.weightgrad import WeightGradStore

    if kind == "F, a peer posts late":  # the culprit's upstream peer posts after the drop
        _on_forward(pipe, mine, stage - 1, mb + 1, state, lambda: _wait_for_failure(pipe))
        kind = "F"
    ids = pipe.stage_ids
    if kind == "W":  # this process's stores share the class: the patch checks which store
        if stage not in ids:
            return
        target, real = pipe.stores[ids.index(stage)], WeightGradStore.run

        def run(store, key):
            if state["armed"] and store is target and key == (stage, mb):
                raise Boom(f"planted in W of stage {stage} mb {mb}")
            return real(store, key)

        WeightGradStore.run = run
        return

    def planted():
        if kind == "F":
            raise Boom(f"planted in F of stage {stage} mb {mb}")
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "not-a-tensor":
            return ["not", "tensors"]
        if kind == "die":
            os._exit(3)
        return None

    _on_forward(pipe, mine, stage, mb, state, planted)


def _on_forward(pipe, mine, stage: int, mb: int, state: dict, planted) -> None:
    """While ``state['armed']``, this rank's stage ``stage`` (if it holds it) calls
    ``planted()`` in its forward of micro-batch ``mb``; what that returns, unless None, is
    the forward's output."""
    ids = pipe.stage_ids
    if stage not in ids:
        return
    module = mine[ids.index(stage)]
    real_forward, calls = module.forward, {"n": 0}

    def forward(*args):
        calls["n"] += 1
        if state["armed"] and calls["n"] == mb + 1:
            out = planted()
            if out is not None:
                return out
        return real_forward(*args)

    module.forward = forward
    state.setdefault("counters", []).append(calls)


def _wait_for_failure(pipe) -> None:
    """Return once a failure notice of the call is in the store, and the culprit had time to
    drop its groups: the send that follows is posted to a rank whose connections are
    closed."""
    faults = pipe._faults
    deadline = time.monotonic() + 120.0
    while faults.notices.peek(faults.call) is None:
        if time.monotonic() > deadline:  # a failure of the case, not a hang
            raise RuntimeError(f"no failure notice of call {faults.call} in 120 s")
        time.sleep(0.01)
    time.sleep(0.5)  # the culprit drops its groups right after publishing


def _case(rank: int, world: int, kind: str, stage: int, mb: int, fail_step: int) -> dict:
    gc.disable()
    try:
        return _case_without_gc(rank, world, kind, stage, mb, fail_step)
    finally:
        gc.enable()


def _case_without_gc(rank: int, world: int, kind: str, stage: int, mb: int, fail_step: int) -> dict:
    import graphpipe

    mine = local_stages(build_stages(2 * world), rank, world)
    fresh_stages = local_stages(build_stages(2 * world), rank, world)
    pipe = graphpipe.DualPipeV(mine, num_microbatches=2 * world, loss_fn=mse, timeout=LONG)
    state = {"armed": False}
    _arm(pipe, mine, kind, stage, mb, state)
    out: dict = {}
    kept = []  # every error caught, alive until the case ends
    for step in range(fail_step + 2):
        for c in state.get("counters", []):
            c["n"] = 0
        state["armed"] = step == fail_step
        for p in params(mine):
            p.grad = None
        x, y = batch(4 * world, seed=step)
        try:
            loss = pipe.step(x if rank == 0 else None, y if rank == 0 else None)
        except BaseException as e:  # KeyboardInterrupt too
            kept.append(e)
            out["error"] = f"{type(e).__name__}: {e}"
            out["notes"] = list(getattr(e, "__notes__", []))
            continue
        out.setdefault("losses", []).append(loss)
    # After the failure: the last step equals a fresh pipeline's on the same weights.
    fresh = graphpipe.DualPipeV(fresh_stages, num_microbatches=2 * world, loss_fn=mse, timeout=LONG)
    x, y = batch(4 * world, seed=fail_step + 1)
    ref = fresh.step(x if rank == 0 else None, y if rank == 0 else None)
    # bitwise: the same program on the same weights and batch
    out["after_equal"] = torch.equal(out["losses"][-1], ref) and all(
        torch.equal(a.grad, b.grad) for a, b in zip(params(mine), params(fresh_stages))
    )
    return out


def _owner(stage: int, world: int) -> int:
    return stage if stage < world else 2 * world - 1 - stage


@pytest.mark.parametrize(
    ("world", "kind", "stage", "mb", "fail_step", "action"),
    [
        (2, "F", 1, 2, 1, "1F2"),  # a middle stage, a later step
        (2, "F", 2, 0, 0, "2F0"),  # the very first step (the handshake)
        (2, "W", 0, 3, 1, "0W3"),  # the last action of rank 0, after all its P2P
        (2, "interrupt", 0, 1, 1, "0F1"),
        (4, "F", 5, 1, 1, "5F1"),
        (4, "not-a-tensor", 2, 0, 1, "2F0"),
        # rank 1 learns of it at a post, and rank 0 waits on rank 1 only
        (4, "F, a peer posts late", 2, 0, 1, "2F0"),
    ],
)
def test_a_failure_reaches_every_rank_by_name_and_the_next_step_works(
    world, kind, stage, mb, fail_step, action
) -> None:
    results = run_ranks(_case, world, kind, stage, mb, fail_step, timeout=240, pg_timeout=LONG)
    culprit = _owner(stage, world)
    original = {
        "F": "Boom: planted in F",
        "F, a peer posts late": "Boom: planted in F",
        "W": "Boom: planted in W",
        "interrupt": "KeyboardInterrupt",
        "not-a-tensor": "TypeError: the output of stage 2 must be a tensor or a tuple of tensors",
    }[kind]
    for rank, res in enumerate(results):
        assert res["after_equal"], f"rank {rank}: the step after the failure differs"
        if rank == culprit:
            assert res["error"].startswith(original), res["error"]
            assert any(f"raised on rank {rank} at action {action}" in n for n in res["notes"])
        else:
            assert res["error"].startswith(
                f"PipelineError: the step failed on rank {culprit} at {action}: "
            ), f"rank {rank}: {res['error']}"
            assert original.split(":")[0] in res["error"]
            assert "zero the gradients before the next step" in res["error"]
    if kind == "F, a peer posts late":  # the path under test: rank 1 found out at a post
        assert "(this rank: rank 1 at post 1SEND_F" in results[1]["error"], results[1]["error"]


def _loss_fn_case(rank: int, world: int) -> dict:
    import graphpipe

    mine = local_stages(build_stages(2 * world), rank, world)
    pipe = graphpipe.DualPipeV(
        mine, num_microbatches=2 * world, loss_fn=lambda out, y: "not a tensor", timeout=LONG
    )
    x, y = batch(4 * world)
    try:
        pipe.step(x if rank == 0 else None, y if rank == 0 else None)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def test_a_loss_fn_that_returns_no_tensor_fails_every_rank_by_name() -> None:
    r0, r1 = run_ranks(_loss_fn_case, 2, timeout=120, pg_timeout=LONG)
    assert r0["error"] == "ValueError: loss_fn must return a 0-dim tensor, got str"
    assert r1["error"].startswith("PipelineError: the step failed on rank 0 at 3F0: ValueError")


def _dead_peer_case(rank: int, world: int) -> dict:
    import graphpipe
    from graphpipe import PipelineClosed

    mine = local_stages(build_stages(2 * world), rank, world)
    pipe = graphpipe.DualPipeV(mine, num_microbatches=2 * world, loss_fn=mse, timeout=5)
    state = {"armed": False}
    _arm(pipe, mine, "die", 1, 1, state)  # rank 1 dies in 1F1 of the second step
    out = {}
    x, y = batch(4 * world)
    for step in range(4):
        state["armed"] = step == 1
        for c in state.get("counters", []):
            c["n"] = 0
        try:
            pipe.step(x if rank == 0 else None, y if rank == 0 else None)
        except Exception as e:
            out[step] = f"{type(e).__name__}: {e}"
            out[f"{step}_closed"] = isinstance(e, PipelineClosed)
    return out


def test_a_killed_peer_is_named_and_then_the_pipeline_is_closed() -> None:
    results = run_ranks(_dead_peer_case, 4, timeout=180, pg_timeout=LONG, may_die=(1,))
    assert results[1] is None  # it died
    for rank in (0, 2, 3):
        res = results[rank]
        assert 0 not in res  # the first step was fine
        assert res[1].startswith("PipelineError"), res[1]
        assert "rank 1" in res[1] and "gone or stuck" in res[1], res[1]
        # the next call cannot rebuild the groups without rank 1: closed, and stays closed
        assert res["2_closed"] and res["3_closed"], res
        assert "pipeline closed" in res[2] and res[3] == res[2]


def _bad_input_case(rank: int, world: int) -> dict:
    import graphpipe

    mine = local_stages(build_stages(2 * world), rank, world)
    pipe = graphpipe.DualPipeV(mine, num_microbatches=2 * world, loss_fn=mse, timeout=LONG)
    before = [p.detach().clone() for p in params(mine)]
    x, y = batch(4 * world)
    out: dict = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"

    mine0 = rank == 0
    attempt("no rows", lambda: pipe.step(x[:0] if mine0 else None, y[:0] if mine0 else None))
    attempt("dtype", lambda: pipe.step(x.float() if mine0 else None, y if mine0 else None))
    # forward() on rank 0 while rank 1 calls step(): both sides are told, nobody hangs
    attempt(
        "calls",
        lambda: pipe.forward(x) if mine0 else pipe.step(None, None),
    )
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, params(mine)))
    out["grads_none"] = all(p.grad is None for p in params(mine))
    out["loss"] = pipe.step(x if mine0 else None, y if mine0 else None)
    return out


def test_bad_input_raises_on_every_rank_and_loses_nothing() -> None:
    r0, r1 = run_ranks(_bad_input_case, 2, timeout=120, pg_timeout=LONG)
    assert r0["no rows"] == "ValueError: inputs[0] of shape [0, 8] holds no rows"
    assert r1["no rows"].startswith("PipelineError: rank 0 rejected this batch")
    assert r0["dtype"] == (
        "ValueError: inputs[0] has dtype torch.float32, but stage 0's parameters are "
        "torch.float64: cast the batch (or run under torch.autocast)"
    )
    assert r1["dtype"].startswith("PipelineError: rank 0 rejected this batch")
    for res in (r0, r1):
        assert res["calls"].startswith("PipelineError: the pipeline ranks are not in the same call")
        assert "rank 0: forward()" in res["calls"] and "rank 1: step()" in res["calls"]
        assert res["unchanged"] and res["grads_none"]
    torch.testing.assert_close(r0["loss"], r1["loss"], rtol=0, atol=0)  # one value, broadcast


def _parameterless_case(rank: int, world: int) -> dict:
    import graphpipe

    stages = build_stages(2 * world)
    stages[0], stages[-1] = torch.nn.Tanh(), torch.nn.Tanh()  # rank 0: no parameters at all
    mine = local_stages(stages, rank, world)
    pipe = graphpipe.DualPipeV(mine, num_microbatches=2 * world, loss_fn=mse, timeout=LONG)
    x, y = batch(4 * world)
    return {"loss": pipe.step(x if rank == 0 else None, y if rank == 0 else None)}


def test_ranks_agree_on_the_loss_dtype_whatever_their_parameters() -> None:
    r0, r1 = run_ranks(_parameterless_case, 2, timeout=120, pg_timeout=LONG)
    assert r0["loss"].dtype == r1["loss"].dtype == torch.float32  # rank 0's choice
    assert torch.equal(r0["loss"], r1["loss"]) and r0["loss"].item() > 1e-3  # broadcast


def _replica_case(rank: int, world: int, kind: str) -> dict:
    """PP 2 x DP 2: a failure on replica 0's pipeline rank 1 at step 1."""
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    mine = local_stages(build_stages(4), p, 2)
    pipe = graphpipe.DualPipeV(
        mine,
        num_microbatches=4,
        loss_fn=mse,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        timeout=LONG,
    )
    state = {"armed": False}
    if d == 0:
        _arm(pipe, mine, kind, 1, 2, state)
    out: dict = {"replica": d, "pp": p, "errors": []}
    for step in range(3):
        for c in state.get("counters", []):
            c["n"] = 0
        state["armed"] = step == 1
        x, y = batch(8, seed=step)
        try:
            pipe.step(x if p == 0 else None, y if p == 0 else None)
        except BaseException as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.parametrize("kind", ["F", "interrupt"])
def test_a_failure_on_one_replica_reaches_every_replica_by_name(kind) -> None:
    """Without the replicas' notices, replica 1 would wait in its gradient all-reduce until
    the gloo timeout (300 s), past ``run_ranks``' limit."""
    results = run_ranks(_replica_case, 4, kind, timeout=120, pg_timeout=LONG)
    original = "Boom: planted in F of stage 1 mb 2" if kind == "F" else "KeyboardInterrupt"
    for res in results:
        who = f"replica {res['replica']}, pipeline rank {res['pp']}"
        assert len(res["errors"]) == 2, f"{who}: {res['errors']}"
        first, then = res["errors"]
        if (res["replica"], res["pp"]) == (0, 1):
            assert first.startswith(original), f"{who}: {first}"
        elif res["replica"] == 0:
            assert first.startswith("PipelineError: the step failed on rank 1 at 1F2: "), first
        else:  # the other replica learns it by name, not by a timeout
            assert first.startswith("PipelineError: the step failed on replica 0: rank 1 at 1F2"), (
                f"{who}: {first}"
            )
        assert original.split(":")[0] in first
        assert then.startswith(
            "PipelineClosed: pipeline closed: a step failed (call 2) with data parallelism"
        ), f"{who}: {then}"
