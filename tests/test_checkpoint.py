"""graphpipe.checkpoint: save and resume a pipeline's training state with DCP.

One process (a one-rank pipeline, both stages local) for the API and its errors; two
spawned gloo ranks for the keying of the ranks' different stages in one checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import graphpipe
from graphpipe.checkpoint import (
    MARKER,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from graphpipe.data import ByteBatches
from graphpipe.models import LlamaConfig, LlamaLoss, build_stages, unique_parameters
from graphpipe.weightgrad import DeferrableLinear
from tests.spawn import run_ranks

CFG = LlamaConfig(hidden=16, n_layers=2, n_heads=2, max_seq_len=8, use_kernels=False)
DATA = torch.arange(4000) % 251


def _pipeline(
    world: int = 1, rank: int = 0
) -> tuple[dict, graphpipe.DualPipeV, torch.optim.Optimizer]:
    stages = build_stages(CFG, 2 * world, seed=0)
    mine = {rank: stages[rank], 2 * world - 1 - rank: stages[2 * world - 1 - rank]}
    pipe = graphpipe.DualPipeV(
        tuple(mine.values()), num_microbatches=2 * world, loss_fn=LlamaLoss(False)
    )
    opt = torch.optim.AdamW(unique_parameters(mine.values()), lr=1e-2)
    return mine, pipe, opt


def _train(pipe, opt, batches, steps: int, rank: int = 0) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(batches) if rank == 0 else (None, None)
        opt.zero_grad()
        losses.append(float(pipe.step(x, y)))
        opt.step()
    return losses


def test_the_linear_swap_keeps_every_state_dict_key() -> None:
    stages = build_stages(CFG, 2, seed=0)
    before = [list(s.state_dict()) for s in stages]
    graphpipe.DualPipeV(stages, num_microbatches=2, loss_fn=LlamaLoss(False))
    assert type(stages[0].layers[0].attn.qkv) is DeferrableLinear  # the swap happened
    assert [list(s.state_dict()) for s in stages] == before


def test_resuming_reproduces_the_uninterrupted_losses_bit_for_bit(tmp_path: Path) -> None:
    stages, pipe, opt = _pipeline()
    reference = _train(pipe, opt, iter(ByteBatches(DATA, 4, 8)), 6)

    stages, pipe, opt = _pipeline()
    batches = iter(ByteBatches(DATA, 4, 8))
    first = _train(pipe, opt, batches, 3)
    path = save_checkpoint(tmp_path, 3, stages, opt, extra={"data": batches})
    assert path == checkpoint_path(tmp_path, 3) == tmp_path / "step-00000003"

    stages2, pipe2, opt2 = _pipeline()  # a fresh process would build these
    batches2 = iter(ByteBatches(DATA, 4, 8))
    step = load_checkpoint(latest_checkpoint(tmp_path), stages2, opt2, extra={"data": batches2})
    assert step == 3 and batches2.position == 3
    assert first + _train(pipe2, opt2, batches2, 3) == reference


def test_the_random_generators_are_restored(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    save_checkpoint(tmp_path, 1, stages, opt)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    load_checkpoint(checkpoint_path(tmp_path, 1), stages, opt)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_a_tied_weight_is_loaded_into_the_one_shared_parameter(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    save_checkpoint(tmp_path, 1, stages, opt)
    fresh, _, opt2 = _pipeline()
    with torch.no_grad():
        fresh[0].embed.weight.zero_()
    load_checkpoint(checkpoint_path(tmp_path, 1), fresh, opt2)
    assert fresh[1].head.weight is fresh[0].embed.weight
    assert torch.equal(fresh[0].embed.weight, stages[0].embed.weight)  # exact: the saved values


def test_a_directory_without_the_marker_is_incomplete_and_ignored(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    save_checkpoint(tmp_path, 2, stages, opt)
    newer = save_checkpoint(tmp_path, 5, stages, opt)
    (newer / MARKER).unlink()  # as if a rank died before rank 0 marked it complete
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match=r"step-00000005.*not a complete"):
        load_checkpoint(newer, stages, opt)
    assert latest_checkpoint(tmp_path / "missing") is None
    # Saving the same step again replaces the incomplete directory.
    save_checkpoint(tmp_path, 5, stages, opt)
    assert latest_checkpoint(tmp_path) == newer
    assert json.loads((newer / MARKER).read_text())["step"] == 5


def test_keep_prunes_older_checkpoints(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, stages, opt)
    (tmp_path / "step-00000002" / MARKER).unlink()
    (tmp_path / "unrelated").mkdir()
    save_checkpoint(tmp_path, 4, stages, opt, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000003",
        "step-00000004",
        "unrelated",
    ]


def test_loading_into_other_stages_names_both(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    save_checkpoint(tmp_path, 1, stages, opt)
    moved = {0: stages[0], 2: stages[1]}
    with pytest.raises(
        ValueError, match=r"holds stages \[0, 1\] for rank 0, this rank has stages \[0, 2\]"
    ):
        load_checkpoint(checkpoint_path(tmp_path, 1), moved, opt)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stages": {}}, "stages must map global stage indices"),
        ({"stages": {-1: torch.nn.Linear(1, 1)}}, "stage indices must be ints >= 0, got -1"),
        ({"stages": {0: "layer"}}, "stage 0 must be an nn.Module, got str"),
        ({"extra": {"data": 3}}, r"extra\['data'\] must be an object with state_dict"),
        ({"keep": 0}, "keep must be None or an int >= 1, got keep=0"),
        ({"step": -1}, "step must be an int >= 0, got step=-1"),
    ],
)
def test_bad_arguments_name_the_value(tmp_path: Path, kwargs: dict, match: str) -> None:
    args = {"root": tmp_path, "step": 1, "stages": {0: torch.nn.Linear(2, 2)}, **kwargs}
    with pytest.raises(ValueError, match=match):
        save_checkpoint(**args)


# ------------------------------------------------------------------ two gloo ranks


def _two_rank_resume(rank: int, world: int, root: str) -> dict:
    stages, pipe, opt = _pipeline(world, rank)
    batches = iter(ByteBatches(DATA, 4, 8)) if rank == 0 else None
    extra = {"data": batches} if rank == 0 else None
    first = _train(pipe, opt, batches, 2, rank)
    save_checkpoint(root, 2, stages, opt, extra=extra, keep=1)
    later = _train(pipe, opt, batches, 2, rank)
    pipe.close()

    stages2, pipe2, opt2 = _pipeline(world, rank)
    batches2 = iter(ByteBatches(DATA, 4, 8)) if rank == 0 else None
    extra2 = {"data": batches2} if rank == 0 else None
    step = load_checkpoint(latest_checkpoint(root), stages2, opt2, extra=extra2)
    resumed = _train(pipe2, opt2, batches2, 2, rank)
    pipe2.close()
    return {"step": step, "first": first, "later": later, "resumed": resumed}


@pytest.mark.distributed
def test_two_ranks_resume_their_own_stages_bit_for_bit(tmp_path: Path) -> None:
    results = run_ranks(_two_rank_resume, 2, str(tmp_path))
    for r in results:
        assert r["step"] == 2
        assert r["resumed"] == r["later"]
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(checkpoint_path(tmp_path, 2))).read_metadata()
    stages_saved = {k.split(".")[1] for k in keys.state_dict_metadata if k.startswith("model.")}
    assert stages_saved == {"stage0", "stage1", "stage2", "stage3"}
    info = json.loads((checkpoint_path(tmp_path, 2) / MARKER).read_text())
    assert info["world_size"] == 2 and info["stages"] == [[0, 3], [1, 2]]


def test_checkpoint_info_reads_the_marker_with_the_savers_meta(tmp_path: Path) -> None:
    from graphpipe.checkpoint import checkpoint_info

    stages, _, opt = _pipeline()
    path = save_checkpoint(tmp_path, 7, stages, opt, meta={"hidden": 16, "data": None})
    assert checkpoint_info(path) == {
        "step": 7,
        "world_size": 1,
        "stages": [[0, 1]],
        "meta": {"hidden": 16, "data": None},
    }
    with pytest.raises(ValueError, match="meta must be JSON-serializable"):
        save_checkpoint(tmp_path, 8, stages, opt, meta={"x": object()})
    with pytest.raises(FileNotFoundError, match="step-00000008"):
        checkpoint_info(checkpoint_path(tmp_path, 8))


def _expert_shards_case(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from graphpipe.models import build_stages as build

    cfg = LlamaConfig(
        hidden=16, n_layers=2, n_heads=2, max_seq_len=8, use_kernels=False, num_experts=4
    )
    # Two replicas of a one-rank pipeline, the experts sharded over both (ep = 2).
    stages = dict(enumerate(build(cfg, 2, seed=0, ep_group=dist.group.WORLD)))
    moe = stages[0].layers[0].mlp
    with torch.no_grad():
        for p in stages[0].parameters():
            p.add_(rank)  # the shards differ, and so do the replicated weights
    opt = torch.optim.AdamW(unique_parameters(stages.values()), lr=1e-2)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.full_like(p, 1.0 + rank)
    opt.step()
    saved = moe.w_up.detach().clone()
    saved_moment = opt.state[moe.w_up]["exp_avg"].clone()
    path = save_checkpoint(root, 1, stages, opt)

    fresh = dict(enumerate(build(cfg, 2, seed=0, ep_group=dist.group.WORLD)))
    opt2 = torch.optim.AdamW(unique_parameters(fresh.values()), lr=1e-2)
    load_checkpoint(path, fresh, opt2)
    w_up = fresh[0].layers[0].mlp.w_up
    return {
        "experts": torch.equal(w_up, saved),
        "moment": torch.equal(opt2.state[w_up]["exp_avg"], saved_moment),
    }


@pytest.mark.distributed
def test_expert_parallel_shards_are_each_saved_and_restored(tmp_path: Path) -> None:
    results = run_ranks(_expert_shards_case, 2, str(tmp_path))
    assert results == [{"experts": True, "moment": True}] * 2
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(checkpoint_path(tmp_path, 1))).read_metadata()
    names = set(keys.state_dict_metadata)
    assert "model.stage0.layers.0.mlp.w_up[experts 0-1 of 4]" in names
    assert "model.stage0.layers.0.mlp.w_up[experts 2-3 of 4]" in names
    assert "optim.state.stage0.layers.0.mlp.w_up[experts 2-3 of 4].exp_avg" in names
