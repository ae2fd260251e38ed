"""Expert parallelism on 4 spawned gloo ranks, float64, against one process.

* EP 2 inside DP 4 (no pipeline): each rank runs the whole MoE model on its share of the
  batch, experts sharded over its ep group of 2;
* PP 2 x DP 2 with EP 2 (the ep group is the dp group): DualPipeV on each replica with
  ``dp_group`` and ``expert_groups``, its overlapped pairs exchanging tokens with the other
  replica; the event log shows each all-to-all in flight while the other micro-batch
  computes; clipping by the global norm counts every expert once; the static replay is
  bitwise equal to eager.

Without a pipeline the ranks average the gradients after the step themselves, as the
contract in ``graphpipe.models.moe.expert_parallel_groups`` says (non-expert: mean over dp;
expert: sum over the expert-data-parallel group, divided by the dp size); the pipeline does
the same inside its step. The reference runs every micro-batch of every replica alone
through the unsharded model (the capacity and the load-balancing loss are per micro-batch
and rank) and averages the losses: with enough capacity nothing is dropped; with less, the
same capacity drops the same tokens.
One spawn runs every case (4-rank spawns are the expensive part of the suite).
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_ranks
from tests.test_moe import _check_interleaving

pytestmark = pytest.mark.distributed

WORLD, PP, DP, EP, M, ROWS, SEQ = 4, 2, 2, 2, 4, 2, 8
FACTORS = (2.0, 0.5)  # 2.0 = E / k: no drops; 0.5: drops


def _config(factor: float, layers: int = 2):
    from graphpipe.models import LlamaConfig

    return LlamaConfig(
        hidden=16,
        n_layers=layers,
        n_heads=2,
        max_seq_len=SEQ,
        use_kernels=False,
        num_experts=4,
        top_k=2,
        capacity_factor=factor,
    )


def _batch(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (rows, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _named_grads(stage_ids, modules) -> dict:
    from graphpipe.models import MoEMLP

    out = {}
    for s, mod in zip(stage_ids, modules):
        firsts = {
            f"{path}.{w}": m.first_expert
            for path, m in mod.named_modules()
            if isinstance(m, MoEMLP)
            for w in ("w_gate", "w_up", "w_down")
        }
        for name, p in mod.named_parameters(remove_duplicate=False):
            out[(s, name)] = (p.grad.clone(), firsts.get(name))
    return out


def _average_like_data_parallel(params, dp_group, edp_group) -> None:
    """The contract: non-expert gradients averaged over dp; expert gradients summed over the
    expert-data-parallel group and divided by the dp size."""
    import torch.distributed as dist

    from graphpipe.models import is_expert_parameter

    d = dist.get_world_size(dp_group)
    for p in params:
        group = edp_group if is_expert_parameter(p) else dp_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
        p.grad.div_(d)


def _ep_in_dp_case(rank: int, factor: float) -> dict:
    """No pipeline: the whole model per rank, EP 2 inside DP 4 (the world)."""
    import torch.distributed as dist

    from graphpipe.models import (
        LlamaLoss,
        build_model,
        dropped_tokens,
        expert_parallel_groups,
        unique_parameters,
    )

    ep, edp = expert_parallel_groups(EP)
    model = build_model(_config(factor), dtype=torch.float64, ep_group=ep)
    x, y = _batch(WORLD * ROWS)
    share = slice(rank * ROWS, (rank + 1) * ROWS)
    loss = LlamaLoss(False)(model(x[share]), y[share])
    loss.backward()
    _average_like_data_parallel(unique_parameters(model), dist.group.WORLD, edp)
    dist.all_reduce(loss)
    drops = dropped_tokens(model)
    dist.all_reduce(drops)
    return {
        "loss": loss / WORLD,
        "grads": _named_grads([0], [model]),
        "dropped": drops,
        "groups": (dist.get_process_group_ranks(ep), dist.get_process_group_ranks(edp)),
    }


CLIP = 0.05  # below the gradient norm of every case: the clipping scales


def _pipeline(mesh, factor: float, experts, capture: bool = False, clip: float | None = None):
    import graphpipe
    from graphpipe.models import LlamaLoss, build_stages

    p = mesh.get_local_rank("pp")
    stages = build_stages(
        _config(factor, 2 * PP), 2 * PP, dtype=torch.float64, ep_group=experts.ep_group
    )
    mine = (stages[p], stages[2 * PP - 1 - p])
    pipe = graphpipe.DualPipeV(
        mine,
        num_microbatches=M,
        loss_fn=LlamaLoss(False),
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        expert_groups=experts,
        capture=capture,
        clip_grad_norm=clip,
    )
    return pipe, mine


def _replica_batch(d: int, seed: int = 0):
    x, y = _batch(DP * M * ROWS, seed)
    share = slice(d * M * ROWS, (d + 1) * M * ROWS)
    return x[share], y[share]


def _pp_dp_ep_case(mesh, factor: float, clip: float | None) -> dict:
    """The pipeline averages over dp (experts over the expert-dp group) inside its step."""
    import torch.distributed as dist

    from graphpipe.models import dropped_tokens, expert_parallel_groups

    dp = mesh.get_group("dp")
    experts = expert_parallel_groups(EP, dp)
    pipe, mine = _pipeline(mesh, factor, experts, clip=clip)
    log: list = []
    for s in mine:
        s.events = log
    x, y = _replica_batch(mesh.get_local_rank("dp"))
    first = pipe.is_input_rank
    loss = pipe.step(x if first else None, y if first else None)
    drops = dropped_tokens(mine)
    dist.all_reduce(drops)
    pipe.close()
    return {
        "loss": loss,
        "grads": _named_grads(pipe.stage_ids, mine),
        "dropped": drops,
        "norm": pipe.grad_norm,
        "checked": _check_interleaving(log),
        "same_group": dist.get_process_group_ranks(experts.ep_group)
        == dist.get_process_group_ranks(dp),
    }


def _accumulated_case(mesh) -> dict:
    """Two calls without zeroing (the expert gradients are summed over the expert-dp group of
    one rank and divided by the dp size: an earlier call's must not be halved)."""
    import torch.distributed as dist

    from graphpipe.models import dropped_tokens, expert_parallel_groups

    dp = mesh.get_group("dp")
    experts = expert_parallel_groups(EP, dp)
    pipe, mine = _pipeline(mesh, 0.5, experts)
    first = pipe.is_input_rank
    for seed in (0, 1):
        x, y = _replica_batch(mesh.get_local_rank("dp"), seed)
        loss = pipe.step(x if first else None, y if first else None)
    drops = dropped_tokens(mine)  # over both calls
    dist.all_reduce(drops)
    pipe.close()
    return {"loss": loss, "grads": _named_grads(pipe.stage_ids, mine), "dropped": drops}


def _twin_case(mesh, factor: float) -> list[str]:
    """Eager and captured (static replay) pipelines, SGD in between: what differs bitwise."""
    from graphpipe.models import (
        dropped_tokens,
        expert_parallel_groups,
        reset_dropped_tokens,
        unique_parameters,
    )

    experts = expert_parallel_groups(EP, mesh.get_group("dp"))
    runs = []
    for capture in (False, True):
        pipe, mine = _pipeline(mesh, factor, experts, capture, clip=CLIP)
        params = unique_parameters(mine)
        opt = torch.optim.SGD(params, lr=0.1)
        record = []
        for step in range(3):
            x, y = _replica_batch(mesh.get_local_rank("dp"), seed=10 + step)
            first = pipe.is_input_rank
            opt.zero_grad(set_to_none=False)
            reset_dropped_tokens(mine)
            loss = pipe.step(x if first else None, y if first else None).clone()
            record.append((loss, dropped_tokens(mine), [p.grad.clone() for p in params]))
            opt.step()
        pipe.close()
        runs.append(record)
    problems = []
    # bitwise: the static replay runs the eager program's kernels in the same order
    for step, ((le, de, ge), (lc, dc, gc)) in enumerate(zip(*runs)):
        if not torch.equal(le, lc):
            problems.append(f"step {step}: loss {le.item()!r} != {lc.item()!r}")
        if not torch.equal(de, dc):
            problems.append(f"step {step}: dropped {int(de)} != {int(dc)}")
        problems += [
            f"step {step}: grad {i} differs"
            for i, (a, b) in enumerate(zip(ge, gc))
            if not torch.equal(a, b)
        ]
    return problems


def _refused(mesh) -> str:
    """Sharded experts with dp_group but no expert_groups: ValueError (not silent averaging)."""
    import graphpipe
    from graphpipe.models import LlamaLoss, build_stages, expert_parallel_groups

    experts = expert_parallel_groups(EP, mesh.get_group("dp"))
    stages = build_stages(_config(0.5, 2 * PP), 2 * PP, ep_group=experts.ep_group)
    p = mesh.get_local_rank("pp")
    try:
        graphpipe.DualPipeV(
            (stages[p], stages[2 * PP - 1 - p]),
            num_microbatches=M,
            loss_fn=LlamaLoss(False),
            group=mesh.get_group("pp"),
            dp_group=mesh.get_group("dp"),
        )
    except ValueError as e:
        return str(e)
    return "no error"


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    out: dict = {"ep_in_dp": {}, "pp_dp_ep": {}}
    for factor in FACTORS:
        out["ep_in_dp"][factor] = _ep_in_dp_case(rank, factor)
        out["pp_dp_ep"][factor] = _pp_dp_ep_case(mesh, factor, None)
    out["clipped"] = _pp_dp_ep_case(mesh, 0.5, CLIP)
    out["accumulated"] = _accumulated_case(mesh)
    out["twin"] = _twin_case(mesh, 0.5)
    out["refused"] = _refused(mesh)
    return out


def _reference(factor: float, pieces: list[tuple[torch.Tensor, torch.Tensor]], num_stages: int):
    """One process, all experts: each piece alone, the mean of their losses (one MoE block
    per stage when there are several stages)."""
    from graphpipe.models import LlamaLoss, build_stages, dropped_tokens

    layers = num_stages if num_stages > 1 else 2
    stages = build_stages(_config(factor, layers), num_stages, dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for x, y in pieces:
        h = x
        for s in stages:
            h = s(*h) if isinstance(h, tuple) else s(h)
        loss = LlamaLoss(False)(h, y) / len(pieces)
        loss.backward()
        total += loss.detach()
    grads = {
        (i, n): p.grad
        for i, s in enumerate(stages)
        for n, p in s.named_parameters(remove_duplicate=False)
    }
    return total, grads, dropped_tokens(stages)


def _compare(result: dict, ref_loss, ref_grads, ref_dropped, ep: int) -> set:
    # float64 over ranks against one process: the losses averaged and the gradients reduced
    # over other groupings (all-to-alls, DP all-reduces, micro-batches) are equal up to
    # rounding: the loss to 1e-12 relative, each gradient to 1e-10 relative and 1e-14
    # absolute (elements that cancel to about 0). The dropped-token counts are integers.
    torch.testing.assert_close(result["loss"], ref_loss, rtol=1e-12, atol=0)
    assert torch.equal(result["dropped"], ref_dropped)
    for key, (g, first) in result["grads"].items():
        want = ref_grads[key]
        if first is not None:  # this rank's experts of the reference's E
            assert g.shape[0] * ep == want.shape[0], key
            want = want[first : first + g.shape[0]]
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-14, msg=str(key))
    return set(result["grads"])


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_rank, WORLD, timeout=600, pg_timeout=300)


@pytest.mark.parametrize("factor", FACTORS)
def test_ep2_inside_dp4_equals_one_process(results, factor: float) -> None:
    x, y = _batch(WORLD * ROWS)
    pieces = [(x[r * ROWS : (r + 1) * ROWS], y[r * ROWS : (r + 1) * ROWS]) for r in range(WORLD)]
    ref = _reference(factor, pieces, 1)
    assert (factor == 2.0) == (int(ref[2]) == 0)
    for r, res in enumerate(results):
        case = res["ep_in_dp"][factor]
        assert _compare(case, *ref, ep=EP) == set(ref[1])
        assert case["groups"] == ([r // 2 * 2, r // 2 * 2 + 1], [r % 2, r % 2 + 2])


@pytest.mark.parametrize("factor", FACTORS)
def test_pp2_dp2_ep2_dualpipev_equals_one_process(results, factor: float) -> None:
    pieces = []
    for d in range(DP):
        x, y = _replica_batch(d)
        pieces += list(zip(x.chunk(M), y.chunk(M)))
    ref = _reference(factor, pieces, 2 * PP)
    assert (factor == 2.0) == (int(ref[2]) == 0)
    seen: set = set()
    for res in results:
        case = res["pp_dp_ep"][factor]
        seen |= _compare(case, *ref, ep=EP)
        assert case["same_group"]
        assert case["checked"] >= 4  # exchanges in flight while the other micro-batch computed
    assert seen == set(ref[1])


def test_pp2_dp2_ep2_accumulates_two_calls_as_their_sum(results) -> None:
    refs = []
    for seed in (0, 1):
        pieces = []
        for d in range(DP):
            x, y = _replica_batch(d, seed)
            pieces += list(zip(x.chunk(M), y.chunk(M)))
        refs.append(_reference(0.5, pieces, 2 * PP))
    summed = {key: refs[0][1][key] + refs[1][1][key] for key in refs[0][1]}
    seen: set = set()
    for res in results:
        drops = refs[0][2] + refs[1][2]  # counted over both calls
        seen |= _compare(res["accumulated"], refs[1][0], summed, drops, ep=EP)
    assert seen == set(summed)


def test_pp2_dp2_ep2_clipping_counts_every_expert_once(results) -> None:
    pieces = []
    for d in range(DP):
        x, y = _replica_batch(d)
        pieces += list(zip(x.chunk(M), y.chunk(M)))
    loss, grads, dropped = _reference(0.5, pieces, 2 * PP)
    unique = {id(g): g for g in grads.values()}.values()  # the tied embedding/head once
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unique]))
    scale = min(1.0, CLIP / (float(norm) + 1e-6))
    assert scale < 0.5  # the clipping is active
    clipped = {k: g * scale for k, g in grads.items()}
    for res in results:
        case = res["clipped"]
        # float64 norm over another grouping of the same squares: rounding, 1e-12 relative
        torch.testing.assert_close(case["norm"], norm, rtol=1e-12, atol=0)
        _compare(case, loss, clipped, dropped, ep=EP)


def test_pp2_dp2_ep2_static_replay_is_bitwise_equal_to_eager(results) -> None:
    assert [res["twin"] for res in results] == [[]] * WORLD


def test_sharded_experts_without_expert_groups_are_refused(results) -> None:
    for res in results:
        assert "sharded over an ep group of 2 ranks: pass expert_groups=" in res["refused"]
