"""FSDP2-sharded stages (``fully_shard``) under every schedule on a ("dp", "pp") mesh of 4
gloo ranks (PP 2 x FSDP 2), against one process training the whole model on the whole batch.

One spawn runs every case (4-rank spawns are the expensive part of the suite).
"""

from __future__ import annotations

import pytest
import torch

from tests.pipeline_models import batch, build_stages, mse
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

PP, DP, STEPS, LR = 2, 2, 3, 0.1
# float64: the sharded pipeline and the reference run the same ops on the same rows, but per
# micro-batch (other GEMM shapes and summation orders) and with the replicas' gradients
# reduce-scattered (another order of the sum): equal to rounding, not bitwise.
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
# bf16 parameters and activations (MixedPrecisionPolicy(param_dtype=bfloat16,
# reduce_dtype=float32)) against the float32 reference: bf16 keeps 8 bits of mantissa
# (relative error 2**-8 = 4e-3 per rounding), over three steps of a few layers.
MIXED_TOL = 3e-2


def _share(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of the whole batch's mse (4 equal micro-batches on each of 2
    replicas): summed with loss_reduction="sum", the whole batch's mse."""
    return mse(out, target) / (4 * DP)


def _mse32(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mse of the bf16 outputs in float32, as mixed-precision losses are computed (torch
    2.11's mse_loss of a bf16 and a float32 tensor fails in its backward)."""
    return mse(out.float(), target)


def _stages(schedule: str, dtype: torch.dtype) -> list:
    return build_stages(PP if schedule == "1f1b" else 2 * PP, dtype=dtype)


def _case(mesh, case: dict) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import graphpipe
    from graphpipe.nvtx import Ranges
    from graphpipe.runtime.parts.fsdp import ShardedStages

    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    schedule, dtype = case["schedule"], case.get("dtype", torch.float64)
    stages = _stages(schedule, dtype)
    mine = [stages[p]] if schedule == "1f1b" else [stages[p], stages[2 * PP - 1 - p]]
    mp_on = bool(case.get("mixed"))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mp_on
        else MixedPrecisionPolicy()
    )
    for s in mine:
        if case.get("blocks"):  # the blocks sharded too, then the stage root
            fully_shard(s.fc2, mesh=mesh["dp"], reshard_after_forward=case["raf"], mp_policy=mp)
        fully_shard(s, mesh=mesh["dp"], reshard_after_forward=case["raf"], mp_policy=mp)
    events: list[str] = []
    finish = ShardedStages.finish

    def logged(self, li):
        events.append(f"reduce-scatter stage {self.stage_ids[li]}")
        return finish(self, li)

    ShardedStages.finish = logged
    try:
        pipe = graphpipe.Pipeline(
            mine,
            schedule=schedule,
            num_microbatches=4,
            loss_fn=_share if case.get("reduction") == "sum" else _mse32 if mp_on else mse,
            group=mesh.get_group("pp"),
            dp_group=mesh.get_group("dp"),
            loss_reduction=case.get("reduction", "mean"),
            capture=case.get("capture", False),
            defer_weight_grads=case.get("defer", True),
        )
    finally:
        ShardedStages.finish = finish
    pipe.fsdp.stage_ids = pipe.stage_ids

    class Log(Ranges):  # every action's range, in order, beside the reduce-scatters
        def push(self, name: str) -> None:
            events.append(name)
            super().push(name)

    pipe.ranges = Log(use_nvtx=False)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(16, seed=10 + step, dtype=dtype)
        x, y = x[d * 8 : (d + 1) * 8], y[d * 8 : (d + 1) * 8]
        opt.zero_grad()
        events.append("=== step")
        loss = pipe.step(x if pipe.is_input_rank else None, y if pipe.is_loss_rank else None)
        losses.append(loss.item())
        opt.step()
    ids = pipe.stage_ids
    params = {
        (ids[li], name): q.full_tensor().detach().clone()
        for li, m in enumerate(mine)
        for name, q in m.named_parameters()
    }
    dp_reduced = sum(len(bs) for bs in pipe.data_parallel.buckets.values())
    events.append("=== forward")
    out = pipe.forward(batch(16, seed=99, dtype=dtype)[0] if pipe.is_input_rank else None)
    pipe.close()
    return {
        "losses": losses,
        "params": params,
        "dp_reduced": dp_reduced,
        "events": events,
        "deferrable": pipe.num_deferrable,
        "out": out,
        "last": pipe.is_loss_rank,
    }


def _refused(mesh, what: str) -> str:
    from torch.distributed.fsdp import fully_shard

    import graphpipe

    p = mesh.get_local_rank("pp")
    stages = _stages("dualpipev", torch.float64)
    mine = [stages[p], stages[2 * PP - 1 - p]]
    for s in mine:
        fully_shard(s, mesh=mesh["dp"], reshard_after_forward=what == "capture")
    kw = dict(group=mesh.get_group("pp"))
    if what == "capture":
        kw |= dict(dp_group=mesh.get_group("dp"), capture=True)
    if what == "action":  # per-action graphs: FSDP2's collectives would run between them
        kw |= dict(dp_group=mesh.get_group("dp"), capture="action")
    try:
        graphpipe.DualPipeV(mine, num_microbatches=4, loss_fn=mse, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


def _all(rank: int, world: int, cases: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    out = {name: _case(mesh, c) for name, c in cases.items()}
    out["no_dp"] = _refused(mesh, "no_dp")
    out["capture_reshard"] = _refused(mesh, "capture")
    out["capture_action"] = _refused(mesh, "action")
    return out


CASES = {
    "dualpipev-reshard": dict(schedule="dualpipev", raf=True),
    "dualpipev-keep-blocks": dict(schedule="dualpipev", raf=False, blocks=True),
    "zbv-reshard-blocks": dict(schedule="zbv", raf=True, blocks=True),
    "zbv-keep": dict(schedule="zbv", raf=False),
    "1f1b-reshard": dict(schedule="1f1b", raf=True),
    "1f1b-keep-blocks": dict(schedule="1f1b", raf=False, blocks=True),
    "dualpipev-sum": dict(schedule="dualpipev", raf=True, reduction="sum"),
    "dualpipev-capture": dict(schedule="dualpipev", raf=False, capture=True),
    "dualpipev-mixed": dict(schedule="dualpipev", raf=True, mixed=True, dtype=torch.float32),
    "zbv-mixed": dict(schedule="zbv", raf=False, mixed=True, dtype=torch.float32),
    "zbv-mixed-undeferred": dict(
        schedule="zbv", raf=False, mixed=True, dtype=torch.float32, defer=False
    ),
}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all, PP * DP, CASES, timeout=300)


def _reference(case: dict) -> tuple[list[float], dict, torch.Tensor]:
    """One process, every stage, the whole batch, the same SGD steps."""
    dtype = case.get("dtype", torch.float64)
    stages = _stages(case["schedule"], dtype)
    opt = torch.optim.SGD([q for s in stages for q in s.parameters()], lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(16, seed=10 + step, dtype=dtype)
        h = x
        for s in stages:
            h = s(h)
        loss = mse(h, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        h = batch(16, seed=99, dtype=dtype)[0]
        for s in stages:
            h = s(h)
    params = {(i, n): q.detach() for i, s in enumerate(stages) for n, q in s.named_parameters()}
    return losses, params, h


@pytest.mark.parametrize("name", sorted(CASES))
def test_fsdp2_stages_train_as_the_whole_model(results, name: str) -> None:
    case = CASES[name]
    losses, params, out = _reference(case)
    tol = MIXED_TOL if case.get("mixed") else TOL[case.get("dtype", torch.float64)]
    for rank, res in enumerate(results):
        r = res[name]
        assert r["losses"] == pytest.approx(losses, rel=tol), rank
        for key, value in r["params"].items():
            torch.testing.assert_close(value, params[key], rtol=tol, atol=tol, msg=f"{key}")
        # FSDP reduces every parameter: graphpipe's own dp averaging has nothing left
        assert r["dp_reduced"] == 0
        if r["last"]:  # the loss rank of each replica: the whole model's outputs
            # (bf16 outputs under the mixed-precision policy: compared in float32)
            torch.testing.assert_close(r["out"].to(out.dtype), out, rtol=tol, atol=tol)
        else:
            assert r["out"] is None
        # both Linears of every stage defer, also one sharded on its own (an FSDPLinear)
        want = 2 if case.get("defer", True) else 0
        assert all(n == want for n in r["deferrable"]), r["deferrable"]


def test_deferred_weight_gradients_under_bf16_parameters_equal_undeferred_bit_for_bit(results):
    """After each W the deferred (bf16) weight gradients go into FSDP2's float32
    accumulator at once, as autograd's do after each backward: the same sums."""
    for rank, res in enumerate(results):
        deferred, whole = res["zbv-mixed"], res["zbv-mixed-undeferred"]
        assert deferred["losses"] == whole["losses"], rank
        for key, value in deferred["params"].items():
            assert torch.equal(value, whole["params"][key]), (rank, key)


def test_each_stage_is_reduce_scattered_as_soon_as_its_gradients_are_final(results) -> None:
    """Under DualPipeV rank 0 holds stages 0 and 3: each is reduce-scattered once per step,
    right after its own last gradient action, and the first of them is posted while the
    step still has actions to run."""
    from graphpipe.schedule.ir import Action, Op

    events = results[0]["dualpipev-reshard"]["events"]
    start = len(events) - 1 - events[::-1].index("=== step")  # the last training step
    step = events[start + 1 : events.index("=== forward")]
    actions = []
    for i, name in enumerate(step):
        try:
            actions.append((i, Action.parse(name)))
        except ValueError:
            continue
    posted = {name: step.index(name) for name in step if name.startswith("reduce-scatter")}
    assert sorted(posted) == ["reduce-scatter stage 0", "reduce-scatter stage 3"]
    assert [step.count(name) for name in posted] == [1, 1]
    for stage in (0, 3):
        at = posted[f"reduce-scatter stage {stage}"]
        grads = [
            i
            for i, a in actions
            for part in a.parts()
            if part.stage == stage and part.op in (Op.B, Op.I, Op.W)
        ]
        assert max(grads) < at, f"stage {stage}: a gradient action after its reduce-scatter"
        assert at == max(grads) + 1  # nothing of the step between the last one and it
    first = min(posted.values())
    assert any(i > first for i, _ in actions), "the first reduce-scatter waited for the end"


def test_fsdp2_stages_need_their_dp_group_and_capture_needs_them_unsharded(results) -> None:
    for res in results:
        assert "pass dp_group=mesh.get_group('dp')" in res["no_dp"]
        assert "fully_shard(..., reshard_after_forward=False)" in res["capture_reshard"]
        assert "capture='action' with FSDP2 modules" in res["capture_action"]
        assert "use capture='step'" in res["capture_action"]
