"""Pipeline x data parallel on a ("dp", "pp") DeviceMesh of 4 gloo ranks (PP 2 x DP 2), with
tied weights, activation checkpointing, clipping inside the step, capture, and DDP / FSDP1
stages refused (FSDP2 stages: tests/test_fsdp.py); against a single-process reference of the
whole batch (both replicas').

One spawn runs every case (4-rank spawns are the expensive part of the suite).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.pipeline_models import (
    Checkpointed,
    batch,
    build_stages,
    mse,
    params,
    reference,
    unique_params,
)
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

PP, DP = 2, 2
# Float64, the pipeline against a single-process reference: the micro-batch losses are averaged
# and the weight gradients accumulated in another order (deferred GEMMs, addmm_ into .grad),
# with other GEMM shapes, so MKL may run other kernels on another CPU: equal up to rounding.
# RTOL is about 9000x float64's unit roundoff (1.1e-16); gradients also get 1e-14 absolute
# for elements that cancel to about 0.
RTOL = 1e-12


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))


def _replica_batch(d: int, rows: int, seed: int = 1):
    """Replica ``d``'s share of the global batch of ``rows`` rows (and the global batch)."""
    x, y = batch(rows, seed=seed)
    share = rows // DP
    return x[d * share : (d + 1) * share], y[d * share : (d + 1) * share], x, y


def _mine(stages: list, p: int, schedule: str) -> tuple:
    if schedule == "1f1b":
        return (stages[p],)
    return stages[p], stages[2 * PP - 1 - p]


def _grads(pipe, mine) -> dict:
    ids = pipe.stage_ids
    return {  # a Checkpointed stage's names without the "inner." of the wrapper
        (ids[li], name.removeprefix("inner.")): p.grad.clone()
        for li, m in enumerate(mine)
        for name, p in m.named_parameters(remove_duplicate=False)
    }


def _eager_case(mesh, case: dict) -> dict:
    """Steps of one pipeline; the grads of the first step, every step's loss."""
    import graphpipe

    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    num = PP if case["schedule"] == "1f1b" else 2 * PP
    stages = build_stages(num, tied=case["tied"], seed=case.get("seed", 0) + d * 7)
    if case.get("checkpoint"):
        stages = [Checkpointed(s) for s in stages]
    mine = _mine(stages, p, case["schedule"])
    pipe = graphpipe.Pipeline(
        mine,
        schedule=case["schedule"],
        num_microbatches=case["m"],
        loss_fn=mse,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        per_edge_groups=case.get("per_edge", False),
        clip_grad_norm=case.get("clip"),
        clip_norm_type=case.get("norm_type", 2.0),
    )
    x, y, _, _ = _replica_batch(d, case["rows"])
    loss = pipe.step(x if pipe.is_input_rank else None, y if pipe.is_loss_rank else None)
    reduced = [q for bs in pipe.data_parallel.buckets.values() for b in bs for q in b.params]
    return {
        "loss": loss,
        "grads": _grads(pipe, mine),
        "norm": pipe.grad_norm,
        "reduced": len(reduced),
        "params": len(pipe.parameters()),
    }


def _twin_case(mesh, case: dict) -> dict:
    """An eager and a captured pipeline (the latter with the optimizer and the clipping
    inside its step), SGD in between, over several steps: what differs bitwise."""
    import graphpipe

    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    pipes, sets, opts = [], [], []
    for captured in (False, True):
        stages = build_stages(2 * PP, tied=True)
        if case.get("checkpoint"):
            stages = [Checkpointed(s) for s in stages]
        mine = _mine(stages, p, "dualpipev")
        opt = torch.optim.SGD(unique_params(mine), lr=0.05)
        pipes.append(
            graphpipe.DualPipeV(
                mine,
                num_microbatches=4,
                loss_fn=mse,
                group=mesh.get_group("pp"),
                dp_group=mesh.get_group("dp"),
                capture=captured,
                capture_optimizer=opt if captured else None,
                clip_grad_norm=case.get("clip"),
            )
        )
        sets.append(mine)
        opts.append(opt)
    problems = []
    # bitwise: the static replay runs the eager program's kernels in the same order
    for step in range(4):
        x, y, _, _ = _replica_batch(d, 8, seed=20 + step)
        xs, ys = (x, y) if p == 0 else (None, None)
        opts[0].zero_grad(set_to_none=False)
        le = pipes[0].step(xs, ys)
        ne = pipes[0].grad_norm.clone() if case.get("clip") else None
        lc = pipes[1].step(xs, ys)  # zeroes, clips and steps its optimizer itself
        if not torch.equal(le, lc):
            problems.append(f"step {step}: loss {le.item()!r} != {lc.item()!r}")
        if ne is not None and not torch.equal(ne, pipes[1].grad_norm):
            problems.append(f"step {step}: grad norm differs")
        for i, (a, b) in enumerate(zip(params(sets[0]), params(sets[1]))):
            if not torch.equal(a.grad, b.grad):
                problems.append(f"step {step}: grad of parameter {i} differs")
        opts[0].step()
        for i, (a, b) in enumerate(zip(params(sets[0]), params(sets[1]))):
            if not torch.equal(a, b):
                problems.append(f"step {step}: parameter {i} differs after the update")
    return {"problems": problems, "captured_steps": len(pipes[1]._capture.captures)}


def _wrapped_case(mesh, kind: str) -> str:
    """The error for a DDP-wrapped or FSDP1-wrapped stage (None: no error)."""
    import graphpipe

    p = mesh.get_local_rank("pp")
    stages = build_stages(2 * PP)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        stages[p] = DistributedDataParallel(stages[p], process_group=mesh.get_group("dp"))
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        last = stages[2 * PP - 1 - p]
        last.fc1 = FullyShardedDataParallel(
            last.fc1, process_group=mesh.get_group("dp"), device_id=torch.device("cpu")
        )
    try:
        graphpipe.DualPipeV(
            _mine(stages, p, "dualpipev"),
            num_microbatches=4,
            loss_fn=mse,
            group=mesh.get_group("pp"),
            dp_group=mesh.get_group("dp"),
        )
    except ValueError as e:
        return str(e)
    return "no error"


def _all_cases(rank: int, world: int, cases: dict) -> dict:
    mesh = _mesh()
    out = {name: _eager_case(mesh, c) for name, c in cases["eager"].items()}
    out.update({name: _twin_case(mesh, c) for name, c in cases["twin"].items()})
    out.update({name: _wrapped_case(mesh, name) for name in cases["wrapped"]})
    return out


EAGER = {
    # tied weights (stage 0 and stage 3 on pipeline rank 0), one P2P group per edge, which
    # every world rank creates for both pipelines (groups.py)
    "tied": dict(schedule="dualpipev", m=4, rows=16, tied=True, per_edge=True),
    # no split backward: each stage's reduction starts after its last B
    "1f1b": dict(schedule="1f1b", m=2, rows=8, tied=False),
    # activation checkpointing in every stage, and clipping (the norm is below the total)
    "checkpoint_clip": dict(
        schedule="dualpipev", m=4, rows=16, tied=True, checkpoint=True, clip=0.5
    ),
    # the max norm: the largest |g| of the whole model is on one pipeline rank, so the ranks'
    # partial norms must be combined by a max over the pipeline group (a sum would count
    # both ranks' largest entries)
    "clip_inf": dict(schedule="dualpipev", m=4, rows=16, tied=True, clip=0.05, norm_type=math.inf),
}
TWIN = {
    "captured": dict(),
    "captured_checkpoint_clip": dict(checkpoint=True, clip=0.5),
}
CASES = {"eager": EAGER, "twin": TWIN, "wrapped": ["ddp", "fsdp"]}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all_cases, PP * DP, CASES, timeout=300)


def _reference(case: dict) -> tuple:
    """Loss, grads by (stage, name) and the norm (clipped when the case clips) of one
    process running every stage of the first replica's model on the global batch."""
    num = PP if case["schedule"] == "1f1b" else 2 * PP
    stages = build_stages(num, tied=case["tied"])
    _, _, x, y = _replica_batch(0, case["rows"])
    loss, grads, _ = reference(stages, x, y)
    norm = None
    if case.get("clip") is not None:
        norm = torch.nn.utils.clip_grad_norm_(
            unique_params(stages), case["clip"], case.get("norm_type", 2.0)
        )
        grads = {
            (i, name): p.grad.clone()
            for i, s in enumerate(stages)
            for name, p in s.named_parameters(remove_duplicate=False)
        }
    return loss, grads, norm


@pytest.mark.parametrize("name", sorted(EAGER))
def test_pp2_dp2_loss_and_grads_match_the_whole_batch_reference(results, name) -> None:
    case = EAGER[name]
    ref_loss, ref_grads, ref_norm = _reference(case)
    if ref_norm is not None:
        assert ref_norm > case["clip"], "the case must clip"
    for rank, res in enumerate(results):
        got = res[name]
        torch.testing.assert_close(got["loss"], ref_loss, rtol=RTOL, atol=0)
        for key, g in got["grads"].items():
            torch.testing.assert_close(g, ref_grads[key], rtol=1e-10, atol=1e-14, msg=str(key))
        # every parameter is reduced, and only once (a tied weight too)
        assert got["reduced"] == got["params"], f"rank {rank}"
        if ref_norm is None:
            assert got["norm"] is None
        else:
            torch.testing.assert_close(got["norm"], ref_norm, rtol=RTOL, atol=0)
    # both replicas of each pipeline rank checked all of its stages; together every stage
    for d in range(DP):
        checked = {k for r in range(PP) for k in results[d * PP + r][name]["grads"]}
        assert checked == set(ref_grads)


@pytest.mark.parametrize("name", sorted(TWIN))
def test_pp2_dp2_static_replay_is_bitwise_equal_to_eager(results, name) -> None:
    for rank, res in enumerate(results):
        assert res[name]["problems"] == [], f"rank {rank}"
        assert res[name]["captured_steps"] == 1


def test_ddp_wrapped_stage_is_refused_with_what_to_pass_instead(results) -> None:
    for res in results:
        assert "is wrapped in DistributedDataParallel" in res["ddp"]
        assert "dp_group=ddp.process_group" in res["ddp"]


def test_fsdp1_wrapped_stage_is_refused_with_what_to_do_instead(results) -> None:
    for rank, res in enumerate(results):
        stage = 2 * PP - 1 - rank % PP
        want = f"stage {stage} (submodule 'fc1') is wrapped in FullyShardedDataParallel"
        assert want in res["fsdp"]
        assert "fully_shard (FSDP2) instead" in res["fsdp"]
        assert "dp_group=mesh.get_group('dp')" in res["fsdp"]
