"""graphpipe.checkpoint: save, verify and resume a pipeline's training state with DCP.

One process (a one-rank pipeline, both stages local) for the API, its errors and every kind
of damaged checkpoint; two spawned gloo ranks for the keying of the ranks' different stages
in one checkpoint and for the ranks' agreement on a damaged file.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import graphpipe
from graphpipe.checkpoint import (
    MARKER,
    CheckpointError,
    checkpoint_path,
    find_resumable,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
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


def test_keep_counts_only_the_checkpoints_up_to_the_saved_step(tmp_path: Path) -> None:
    # A run resumed from step 2 (step 5 did not verify) saves step 3: step 5 stays until the
    # run overwrites it, and does not push out the checkpoints the run could resume from.
    stages, _, opt = _pipeline()
    for step in (1, 2, 5):
        save_checkpoint(tmp_path, step, stages, opt)
    save_checkpoint(tmp_path, 3, stages, opt, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002",
        "step-00000003",
        "step-00000005",
    ]


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


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keep_counts_only_the_checkpoints_that_verify_and_deletes_the_others(
    tmp_path: Path,
) -> None:
    # A run resumed from step 2 past a damaged step 4 saves step 5: step 4 does not count
    # (before, it was kept and step 2 deleted, leaving one usable checkpoint).
    stages, _, opt = _pipeline()
    for step in (1, 2, 4):
        save_checkpoint(tmp_path, step, stages, opt)
    _flip(tmp_path / "step-00000004" / "__0_0.distcp")
    (tmp_path / "step-00000004" / "stray").write_text("x")  # an unlisted file, not counted
    save_checkpoint(tmp_path, 5, stages, opt, keep=2)
    assert _names(tmp_path) == ["step-00000002", "step-00000005"]
    for name in _names(tmp_path):
        verify_checkpoint(tmp_path / name)


def test_keep_never_deletes_the_checkpoint_resumed_from(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    for step in (2, 4):
        save_checkpoint(tmp_path, step, stages, opt)
    _unlist(tmp_path / "step-00000004" / "__0_0.distcp")
    resumed = find_resumable(tmp_path)[0]
    assert resumed == tmp_path / "step-00000002"
    for step in (5, 6):
        save_checkpoint(tmp_path, step, stages, opt, keep=1, resumed_from=resumed)
        assert _names(tmp_path) == ["step-00000002", f"step-{step:08d}"]
    save_checkpoint(tmp_path, 7, stages, opt, keep=1)  # another run, resumed from step 6
    assert _names(tmp_path) == ["step-00000007"]


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
        ({"resumed_from": 3}, "resumed_from must be a path or None, got 3"),
        ({"step": -1}, "step must be an int >= 0, got step=-1"),
    ],
)
def test_bad_arguments_name_the_value(tmp_path: Path, kwargs: dict, match: str) -> None:
    args = {"root": tmp_path, "step": 1, "stages": {0: torch.nn.Linear(2, 2)}, **kwargs}
    with pytest.raises(ValueError, match=match):
        save_checkpoint(**args)


# ------------------------------------------------------------------ verification


def _flip(file: Path) -> None:
    """64 garbage bytes in the middle of ``file`` (its size unchanged)."""
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(255 - b for b in data[mid : mid + 64])
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


def _unlist(file: Path) -> None:
    """``file``'s entry removed from the marker, and 64 of its bytes changed: DCP would load
    the changed values through ``.metadata`` without a word."""
    marker = file.parent / MARKER
    info = json.loads(marker.read_text())
    del info["files"][file.name]
    marker.write_text(json.dumps(info))
    _flip(file)


DAMAGE = {  # kind: (file, how, what the error says about it)
    "bytes flipped": ("__0_0.distcp", _flip, r"file __0_0\.distcp is corrupt \(CRC-32 "),
    "truncated": ("__0_0.distcp", _truncate, r"file __0_0\.distcp is truncated \(\d+ bytes, "),
    "file deleted": ("__0_0.distcp", Path.unlink, r"file __0_0\.distcp is missing"),
    "metadata deleted": (".metadata", Path.unlink, r"file \.metadata is missing"),
    "entry removed": (
        "__0_0.distcp",
        _unlist,
        r"file __0_0\.distcp is not listed in graphpipe\.json \(a save lists every file",
    ),
}


def test_the_marker_records_every_files_size_and_crc32(tmp_path: Path) -> None:
    import zlib

    stages, _, opt = _pipeline()
    path = save_checkpoint(tmp_path, 1, stages, opt)
    files = json.loads((path / MARKER).read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MARKER)
    assert sorted(files) == on_disk == [".metadata", "__0_0.distcp"]
    for name, rec in files.items():
        data = (path / name).read_bytes()
        assert rec == {"rank": 0, "size": len(data), "crc32": zlib.crc32(data)}
    verify_checkpoint(path)  # raises if not


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_is_a_one_line_error_and_nothing_is_loaded(
    tmp_path: Path, kind: str
) -> None:
    name, damage, says = DAMAGE[kind]
    stages, _, opt = _pipeline()
    older = save_checkpoint(tmp_path, 2, stages, opt)
    newer = save_checkpoint(tmp_path, 4, stages, opt)
    damage(newer / name)
    fresh, _, opt2 = _pipeline()
    with torch.no_grad():
        fresh[0].embed.weight.zero_()
    first_line = rf"^checkpoint {re.escape(str(newer))}: {says}"
    with pytest.raises(CheckpointError, match=first_line) as caught:
        load_checkpoint(newer, fresh, opt2)
    assert "\n" not in str(caught.value) and caught.value.file == name
    assert caught.value.path == newer
    assert not fresh[0].embed.weight.any()  # verified before anything was loaded
    with pytest.raises(CheckpointError, match=first_line):
        verify_checkpoint(newer)
    found, skipped = find_resumable(tmp_path)
    assert found == older
    assert [p for p, _ in skipped] == [newer] and re.match(says, skipped[0][1])
    assert load_checkpoint(found, fresh, opt2) == 2


def test_find_resumable_skips_an_incomplete_save_and_finds_none_in_an_empty_root(
    tmp_path: Path,
) -> None:
    stages, _, opt = _pipeline()
    older = save_checkpoint(tmp_path, 1, stages, opt)
    newer = save_checkpoint(tmp_path, 3, stages, opt)
    (newer / MARKER).unlink()  # a rank died before rank 0 marked it complete
    assert find_resumable(tmp_path) == (older, [(newer, f"incomplete (no readable {MARKER})")])
    assert find_resumable(tmp_path / "missing") == (None, [])


def test_a_checkpoint_without_checksums_loads_only_unverified(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    path = save_checkpoint(tmp_path, 1, stages, opt)
    info = json.loads((path / MARKER).read_text())
    old = {k: info[k] for k in ("step", "world_size", "stages", "meta")}
    (path / MARKER).write_text(json.dumps({"format": "graphpipe-checkpoint-1", **old}))
    with pytest.raises(CheckpointError, match=r"records no checksums .*verify=False"):
        load_checkpoint(path, stages, opt)
    assert find_resumable(tmp_path)[0] is None
    assert load_checkpoint(path, stages, opt, verify=False) == 1


def test_loading_into_stages_of_another_width_names_the_key_and_both_shapes(
    tmp_path: Path,
) -> None:
    stages, _, opt = _pipeline()
    path = save_checkpoint(tmp_path, 1, stages, opt)
    wide = build_stages(dataclasses.replace(CFG, hidden=32), 2, seed=0)
    mine = {0: wide[0], 1: wide[1]}
    with pytest.raises(ValueError) as caught:
        load_checkpoint(path, mine, torch.optim.AdamW(unique_parameters(wide)))
    assert str(caught.value).splitlines()[0] == (
        f"checkpoint {path}: model.stage0.embed.weight has shape [256, 16] there and "
        "[256, 32] in this rank's stages (another model size?)"
    )
    with pytest.raises(ValueError, match=r"holds no model\.stage1\.extra\.weight, "):
        stages[1].extra = torch.nn.Linear(2, 2, bias=False)
        load_checkpoint(path, stages, opt)


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
    writers = {name: rec["rank"] for name, rec in info["files"].items()}
    assert writers == {".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1}


def _one_ranks_file_damaged(rank: int, world: int, root: str, damage: str) -> dict:
    import torch.distributed as dist

    stages = build_stages(CFG, 2 * world, seed=0)
    mine = {rank: stages[rank], 2 * world - 1 - rank: stages[2 * world - 1 - rank]}
    opt = torch.optim.AdamW(unique_parameters(mine.values()), lr=1e-2)
    older = save_checkpoint(root, 1, mine, opt)
    path = save_checkpoint(root, 2, mine, opt)
    if rank == 0:  # rank 1's file: rank 0 finds its own files intact
        DAMAGE[damage][1](path / "__1_0.distcp")
    dist.barrier()
    try:
        load_checkpoint(path, mine, opt)
        loaded = "loaded"
    except CheckpointError as e:
        loaded = f"{type(e).__name__}: {e}"
    # The retention: every rank verifies its files of step 2, which does not count.
    save_checkpoint(root, 3, mine, opt, keep=2)
    left = sorted(p.name for p in Path(root).iterdir())
    return {"loaded": loaded, "left": left, "older": str(older)}


@pytest.mark.distributed
@pytest.mark.parametrize("damage", ["bytes flipped", "entry removed"])
def test_every_rank_raises_the_same_error_for_one_ranks_damaged_file(
    tmp_path: Path, damage: str
) -> None:
    results = run_ranks(_one_ranks_file_damaged, 2, str(tmp_path), damage, timeout=60)
    path = checkpoint_path(tmp_path, 2)
    says = DAMAGE[damage][2].replace("__0_", "__1_")
    assert results[0]["loaded"] == results[1]["loaded"]
    assert re.match(
        rf"CheckpointError: checkpoint {re.escape(str(path))}: {says}", results[0]["loaded"]
    )
    assert results[0]["left"] == results[1]["left"] == ["step-00000001", "step-00000003"]


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
        "w_up": saved,
    }


@pytest.mark.distributed
def test_expert_parallel_shards_are_each_saved_and_restored(tmp_path: Path) -> None:
    results = run_ranks(_expert_shards_case, 2, str(tmp_path))
    assert [(r["experts"], r["moment"]) for r in results] == [(True, True)] * 2
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(checkpoint_path(tmp_path, 1))).read_metadata()
    names = set(keys.state_dict_metadata)
    assert "model.stage0.layers.0.mlp.w_up[experts 0-1 of 4]" in names
    assert "model.stage0.layers.0.mlp.w_up[experts 2-3 of 4]" in names
    assert "optim.state.stage0.layers.0.mlp.w_up[experts 2-3 of 4].exp_avg" in names
    # The export joins the shards: all four experts, loadable into the unsplit model.
    from graphpipe.checkpoint import export_state_dict
    from graphpipe.models import build_model

    state = export_state_dict(checkpoint_path(tmp_path, 1))
    assert torch.equal(state["layers.0.mlp.w_up"], torch.cat([r["w_up"] for r in results]))
    cfg = LlamaConfig(
        hidden=16, n_layers=2, n_heads=2, max_seq_len=8, use_kernels=False, num_experts=4
    )
    build_model(cfg).load_state_dict(state, strict=True)
