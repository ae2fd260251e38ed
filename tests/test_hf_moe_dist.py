"""Qwen3-MoE's experts over an expert-parallel group (``shard_hf_experts``): PP 2 x EP 2 on 4
gloo ranks (a ``("dp", "pp")`` mesh of 2 x 2, the experts sharded over each dp pair),
DualPipeV, float64, right padding, ``"sum"`` with the whole step's ``num_items_in_batch``,
two SGD steps, against HF's unsplit model on the whole batch; the checkpoint of the sharded
job exports to the unsplit model's weights. Also the shard alone against HF's experts module
on one rank, and the errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need transformers (pip install graphpipe[hf])"
)

from tests.spawn import run_ranks  # noqa: E402
from tests.test_hf_families import LENGTHS, batch, build, reference  # noqa: E402

DP, PP, M, STEPS, LR = 2, 2, 4, 2, 0.1


def _rank(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe
    from graphpipe.checkpoint import save_checkpoint
    from graphpipe.keymap import unsplit_keys, unsplit_name
    from graphpipe.models import (
        causal_lm_loss,
        causal_lm_num_items,
        expert_parallel_groups,
        shard_hf_experts,
        split_hf_causal_lm,
        unique_parameters,
    )

    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    dp, p, d = mesh.get_group("dp"), mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    experts = expert_parallel_groups(DP, dp)  # ep = dp: each dp pair shares the experts
    stages = split_hf_causal_lm(build("qwen3_moe"), 2 * PP)
    mine = {p: stages[p], 2 * PP - 1 - p: stages[2 * PP - 1 - p]}
    sharded = shard_hf_experts(mine.values(), experts.ep_group)
    pipe = graphpipe.DualPipeV(
        tuple(mine.values()),
        num_microbatches=M,
        loss_fn=causal_lm_loss,
        loss_reduction="sum",
        group=mesh.get_group("pp"),
        dp_group=dp,
        expert_groups=experts,
    )
    opt = torch.optim.SGD(unique_parameters(mine.values()), lr=LR)
    rows = len(LENGTHS) // DP
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        whole = batch(step)
        share = {k: v[d * rows : (d + 1) * rows] for k, v in whole.items()}
        loss = pipe.step(
            share["ids"] if pipe.is_input_rank else None,
            share["labels"] if pipe.is_loss_rank else None,
            attention_mask=share["mask"],
            num_items_in_batch=causal_lm_num_items(share["labels"], dp_group=dp),
        )
        losses.append(loss.clone())
        opt.step()
    save_checkpoint(root, STEPS, mine, opt)
    pipe.close()
    weights, shards = {}, {}
    for s in mine.values():
        for name, param in s.named_parameters():
            full = unsplit_name(name, unsplit_keys(s))
            weights[full] = param.detach().clone()
    for s in mine.values():
        for name, module in s.named_modules():
            if hasattr(module, "first_expert"):
                shards[unsplit_name(name, unsplit_keys(s))] = (
                    module.first_expert,
                    module.local_experts,
                )
    return {"losses": losses, "weights": weights, "shards": shards, "sharded": sharded}


@pytest.mark.distributed
def test_qwen3_moe_with_expert_parallelism_trains_as_the_unsplit_model(tmp_path: Path) -> None:
    from graphpipe.checkpoint import export_state_dict

    results = run_ranks(_rank, DP * PP, str(tmp_path), timeout=300.0)
    losses, ref = reference("qwen3_moe", steps=STEPS, lr=LR)
    seen = set()
    for rank, res in enumerate(results):
        assert res["sharded"] == 2, rank  # two MoE layers on each rank's two stages
        for step, (got, want) in enumerate(zip(res["losses"], losses)):
            torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0, msg=f"step {step}")
        for name, w in res["weights"].items():
            expected = ref[name]
            module = name.rsplit(".", 1)[0]
            if module in res["shards"]:  # this rank's experts only
                first, local = res["shards"][module]
                assert w.shape[0] == local
                expected = expected[first : first + local]
            # the gradients carry HF's float32 cross-entropy's rounding (see test_hf_families)
            rel = ((w - expected).norm() / max(expected.norm().item(), 1.0)).item()
            assert rel <= 1e-9, (rank, name, rel)
            seen.add(name)
    assert seen == set(ref), seen ^ set(ref)
    state = export_state_dict(tmp_path / f"step-{STEPS:08d}")
    assert sorted(state) == sorted(ref)
    for name, value in state.items():
        rel = ((value - ref[name]).norm() / max(ref[name].norm().item(), 1.0)).item()
        assert rel <= 1e-9, (name, rel)


def _one_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from graphpipe.models import HFExpertShard, shard_hf_experts
    from graphpipe.roles import is_expert

    model = build("qwen3_moe")
    block = model.model.layers[0].mlp
    x = torch.randn(6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _, weights, index = block.gate(x)
    shard = HFExpertShard(block.experts, dist.group.WORLD)
    got, want = shard(x, index, weights), block.experts(x, index, weights)
    out = {
        "error": ((got - want).abs().max() / want.abs().max()).item(),
        "marked": is_expert(shard.gate_up_proj) and is_expert(shard.down_proj),
    }
    try:
        shard_hf_experts([torch.nn.Linear(2, 2)], dist.group.WORLD)
    except ValueError as e:
        out["none"] = str(e)
    return out


@pytest.mark.distributed
def test_a_shard_over_one_rank_is_hfs_experts_module_and_errors_are_named() -> None:
    (res,) = run_ranks(_one_rank, 1)
    # One rank holds every expert: the same per-row products, through GEMMs over more rows
    # (every token's row, zero where it did not choose the expert): float64 rounding apart.
    assert res["error"] < 1e-14 and res["marked"]
    assert res["none"].startswith("shard_hf_experts: no decoder layer of these stages (Linear)")
