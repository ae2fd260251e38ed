"""The model back in one piece: stages' key maps (``graphpipe.keymap``), ``export_state_dict``
and ``graphpipe export``.

One process for the key maps, the built-in model's export, tied weights and the errors; two
spawned gloo ranks train, save and run ``pipe.forward``, and the test process exports the
checkpoint and compares the unsplit model's logits with the pipeline's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from graphpipe.checkpoint import (
    MARKER,
    CheckpointError,
    export_state_dict,
    save_checkpoint,
    set_unsplit_keys,
    unsplit_keys,
)
from graphpipe.cli import main
from graphpipe.data import ByteBatches
from graphpipe.keymap import unsplit_name
from graphpipe.models import build_model, build_stages, unique_parameters
from tests.spawn import run_ranks
from tests.test_checkpoint import CFG, DATA, _flip, _pipeline, _train


def test_a_key_is_renamed_by_its_longest_prefix_of_whole_names() -> None:
    prefixes = {"layers.1": "layers.5", "layers.1.mlp": "ffn.1", "": "model"}
    assert unsplit_name("layers.1.attn.qkv.weight", prefixes) == "layers.5.attn.qkv.weight"
    assert unsplit_name("layers.1.mlp.up.weight", prefixes) == "ffn.1.up.weight"
    assert unsplit_name("layers.10.mlp.up.weight", prefixes) == "model.layers.10.mlp.up.weight"
    assert unsplit_name("layers.1", prefixes) == "layers.5"
    assert unsplit_name("model.norm.weight", {"model": ""}) == "norm.weight"
    assert unsplit_name("norm.weight", None) == "norm.weight"


def test_set_unsplit_keys_names_the_entry_that_cannot_apply() -> None:
    stage = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    with pytest.raises(ValueError, match=r"the stage prefix '2' matches no key of the stage"):
        set_unsplit_keys(stage, {"2": "x"})
    with pytest.raises(ValueError, match=r"dotted names without empty parts.*got 'a\.\.b'"):
        set_unsplit_keys(stage, {"0": "a..b"})
    with pytest.raises(
        ValueError,
        match=r"'0.weight' and '1.weight' both map to the unsplit key 'w.weight' but are "
        "different tensors",
    ):
        set_unsplit_keys(stage, {"0": "w", "1": "w"})
    assert unsplit_keys(stage) is None  # nothing declared by the failed calls
    stage[1].weight = stage[0].weight  # tied inside the stage: one name is fine
    assert unsplit_keys(set_unsplit_keys(stage, {"0": "w", "1": "w"})) == {"0": "w", "1": "w"}


def test_the_built_in_stages_export_into_the_unsplit_model(tmp_path: Path) -> None:
    stages = dict(enumerate(build_stages(CFG, 4, seed=3)))  # stage 0: the embedding alone
    opt = torch.optim.AdamW(unique_parameters(stages.values()), lr=1e-2)
    path = save_checkpoint(tmp_path, 1, stages, opt)
    info = json.loads((path / MARKER).read_text())
    maps = {"0": {}, "1": {"layers.0": "layers.0"}, "2": {"layers.0": "layers.1"}, "3": {}}
    assert info["keys"] == maps  # the blocks' global indices
    assert info["tied"] == [["stage0.embed.weight", "stage3.head.weight"]]
    state = export_state_dict(path)
    model = build_model(CFG, seed=0)
    model.load_state_dict(state, strict=True)
    expected = build_model(CFG, seed=3).state_dict()
    assert list(model.state_dict()) == list(expected)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    # The tied embedding and head: one tensor under both names, saved once.
    assert state["embed.weight"] is state["head.weight"]
    torch.save(state, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt")
    assert loaded["embed.weight"].data_ptr() == loaded["head.weight"].data_ptr()
    assert not any("optim" in k or "exp_avg" in k for k in state)


def _two_stages(same: bool) -> dict[int, nn.Module]:
    torch.manual_seed(0)
    first, last = nn.Sequential(nn.Linear(3, 3, bias=False)), nn.Sequential(nn.LayerNorm(3))
    last.append(nn.Linear(3, 3, bias=False))
    if same:
        with torch.no_grad():
            last[1].weight.copy_(first[0].weight)
    set_unsplit_keys(first, {"0": "shared"})
    set_unsplit_keys(last, {"0": "norm", "1": "shared"})
    return {0: first, 1: last}


def test_two_stages_holding_one_tied_weight_export_it_once(tmp_path: Path) -> None:
    stages = _two_stages(same=True)  # a tie kept equal across stages (not one Parameter)
    state = export_state_dict(save_checkpoint(tmp_path, 1, stages))
    assert sorted(state) == ["norm.bias", "norm.weight", "shared.weight"]
    assert torch.equal(state["shared.weight"], stages[0][0].weight)


def test_two_different_tensors_mapped_to_one_key_are_an_error(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, _two_stages(same=False))
    with pytest.raises(
        ValueError,
        match=r"^export: stage0\.0\.weight and stage1\.1\.weight both map to the unsplit key "
        r"'shared\.weight' but hold different tensors",
    ):
        export_state_dict(path)


def test_expert_shards_that_miss_experts_are_an_error() -> None:
    from graphpipe.checkpoint.state import _join_experts

    with pytest.raises(
        ValueError,
        match=r"the expert shards of 'w' do not cover every expert once \(the checkpoint holds "
        r"experts 0-1 of 4, 3-3 of 4\)",
    ):
        _join_experts("w", [(0, 1, 4, torch.zeros(2), "a"), (3, 3, 4, torch.zeros(1), "b")])


def test_export_verifies_the_checkpoint_first(tmp_path: Path) -> None:
    stages, _, opt = _pipeline()
    path = save_checkpoint(tmp_path, 1, stages, opt)
    _flip(path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"file __0_0\.distcp is corrupt"):
        export_state_dict(path)


def test_graphpipe_export_writes_the_newest_checkpoint_that_verifies(tmp_path, capsys) -> None:
    stages, _, opt = _pipeline()
    root, out = tmp_path / "ckpt", tmp_path / "model.pt"
    older = save_checkpoint(root, 1, stages, opt)
    newer = save_checkpoint(root, 2, stages, opt)
    (newer / ".metadata").unlink()
    assert main(["export", str(root), str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"graphpipe export: skipped {newer}: file .metadata is missing"
    count = len(build_model(CFG).state_dict())
    assert err[1].startswith(f"graphpipe export: wrote {out}: {count} tensors, ")
    assert err[1].endswith(f"from {older}")
    build_model(CFG).load_state_dict(torch.load(out), strict=True)
    assert main(["export", str(newer), str(out)]) == 1  # a checkpoint named: no fallback
    assert capsys.readouterr().err == (
        f"graphpipe export: error: checkpoint {newer}: file .metadata is missing\n"
    )


@pytest.mark.parametrize(
    "argv,status,message",
    [
        (["{tmp}/none", "{tmp}/m.pt"], 2, "{tmp}/none: no such directory"),
        (
            ["{tmp}", "{tmp}/no/m.pt"],
            2,
            "OUT.pt {tmp}/no/m.pt: directory {tmp}/no does not exist (create it first)",
        ),
        (["{tmp}", "{tmp}"], 2, "OUT.pt {tmp}: is a directory; give a file name"),
        (["{tmp}", "{tmp}/m.pt"], 1, "{tmp}: no checkpoint is there (no step-N directory)"),
    ],
)
def test_graphpipe_export_errors_are_one_line(tmp_path, capsys, argv, status, message) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["export", *argv]) == status
    assert capsys.readouterr().err == f"graphpipe export: error: {message.format(tmp=tmp_path)}\n"


def test_graphpipe_export_checks_its_output_before_reading_the_checkpoint(
    tmp_path, capsys, monkeypatch
) -> None:
    import graphpipe.checkpoint

    stages, _, opt = _pipeline()
    path = save_checkpoint(tmp_path, 1, stages, opt)

    def read(*args: object) -> None:
        raise AssertionError("the checkpoint was read before the output was checked")

    for name in ("export_state_dict", "find_resumable", "verify_checkpoint"):
        monkeypatch.setattr(graphpipe.checkpoint, name, read)
    for target in (path, tmp_path):  # a checkpoint, and a root holding one
        assert main(["export", str(target), "/proc/x.pt"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("graphpipe export: error: OUT.pt /proc/x.pt: cannot write in "), err
        assert err.count("\n") == 1
    assert not Path("/proc/x.pt").exists()


# ------------------------------------------------------------------ two gloo ranks


def _train_save_forward(rank: int, world: int, root: str) -> dict:
    stages, pipe, opt = _pipeline(world, rank)
    batches = iter(ByteBatches(DATA, 4, 8)) if rank == 0 else None
    _train(pipe, opt, batches, 2, rank)
    save_checkpoint(root, 2, stages, opt)
    x = next(batches)[0] if rank == 0 else None
    logits = pipe.forward(x)  # on rank 0, which runs the last stage
    pipe.close()
    params = {f"{i}.{k}": v for i, s in stages.items() for k, v in s.state_dict().items()}
    return {"x": x, "logits": logits, "params": params, "m": pipe.num_microbatches}


@pytest.mark.distributed
def test_the_export_of_a_trained_pipeline_gives_its_logits_bit_for_bit(tmp_path: Path) -> None:
    results = run_ranks(_train_save_forward, 2, str(tmp_path))
    state = export_state_dict(tmp_path / "step-00000002")
    model = build_model(CFG, seed=1)
    model.load_state_dict(state, strict=True)
    # Every parameter equals the pipeline's after its 2 steps (stage i's keys, renamed).
    stages = build_stages(CFG, 4)
    for r in results:
        for name, value in r["params"].items():
            index, key = name.split(".", 1)
            full = unsplit_name(key, unsplit_keys(stages[int(index)]))
            assert torch.equal(state[full], value), name
    # The pipeline ran the micro-batches one by one through the same kernels: so does this.
    x, expected = results[0]["x"], results[0]["logits"]
    with torch.no_grad():
        logits = torch.cat([model(part) for part in x.chunk(results[0]["m"])])
    assert torch.equal(logits, expected)
