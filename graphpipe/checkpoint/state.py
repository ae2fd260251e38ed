"""Save, verify, resume and export with ``torch.distributed.checkpoint``: the functions that
need torch (``graphpipe.checkpoint`` is the package's front; ``files`` is the layer below,
without torch)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from graphpipe.checkpoint.files import (
    DCP_METADATA as _DCP_METADATA,
)
from graphpipe.checkpoint.files import (
    FORMAT as _FORMAT,
)
from graphpipe.checkpoint.files import (
    MARKER,
    CheckpointError,
    checkpoint_info,
    checkpoint_path,
    find_resumable,
    latest_checkpoint,
    verify_checkpoint,
)
from graphpipe.checkpoint.files import (
    STEP_NAME as _NAME,
)
from graphpipe.checkpoint.files import (
    complete_dirs as _complete,
)
from graphpipe.checkpoint.files import (
    file_record as _record,
)
from graphpipe.checkpoint.files import (
    marker_of as _marker,
)
from graphpipe.checkpoint.files import (
    read_marker as _read_marker,
)
from graphpipe.checkpoint.files import (
    step_dirs as _steps,
)
from graphpipe.checkpoint.files import (
    verify_files as _verify,
)
from graphpipe.keymap import set_unsplit_keys, unsplit_keys, unsplit_name

__all__ = [
    "MARKER",
    "CheckpointError",
    "checkpoint_info",
    "checkpoint_path",
    "export_state_dict",
    "find_resumable",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "set_unsplit_keys",
    "unsplit_keys",
    "verify_checkpoint",
]

_STAGE_KEY = re.compile(r"stage(\d+)\.(.+)")
_SHARD = re.compile(r"(.+)\[experts (\d+)-(\d+) of (\d+)\]")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer that remembers which files this rank wrote (``written``)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in future.wait()})
        return future


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size ((0, 1) without a process group)."""
    if _distributed():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _check_stages(stages: Mapping[int, nn.Module]) -> nn.ModuleDict:
    if not isinstance(stages, Mapping) or not stages:
        raise ValueError(
            f"stages must map global stage indices to this rank's modules, got {stages!r}"
        )
    for index, module in stages.items():
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"stage indices must be ints >= 0, got {index!r}")
        if not isinstance(module, nn.Module):
            raise ValueError(f"stage {index} must be an nn.Module, got {type(module).__name__}")
    # A ModuleDict only refers to the stages: their parameters, keys and classes stay as they
    # are, and every key gets the prefix stage{i}.
    return nn.ModuleDict({f"stage{i}": stages[i] for i in sorted(stages)})


def _optimizers(optimizer: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


def _expert_shards(model: nn.ModuleDict) -> dict[str, str]:
    """``{name: name with its shard}`` for every expert-parallel sharded parameter.

    A module with ``ep_size > 1`` (``graphpipe.models.MoEMLP``) holds experts
    ``first_expert .. first_expert + local_experts - 1`` of ``num_experts``; the replicas of
    its expert-parallel group hold the others under the same names. DCP would take those for
    copies of one tensor and keep one, so their keys name the experts they hold:
    ``stage0.layers.1.mlp.w_up[experts 2-3 of 4]``.
    """
    out: dict[str, str] = {}
    for prefix, module in model.named_modules():
        if getattr(module, "ep_size", 1) <= 1:
            continue
        first, local = module.first_expert, module.local_experts
        tag = f"[experts {first}-{first + local - 1} of {module.num_experts}]"
        for name, param in module.named_parameters(recurse=False):
            if getattr(param, "_graphpipe_expert", False):
                fqn = f"{prefix}.{name}" if prefix else name
                out[fqn] = fqn + tag
    return out


def _rename(d: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """``d`` with every key ``fqn`` or ``section.fqn.leaf`` (flattened optimizer state) whose
    ``fqn`` is in ``names`` renamed to ``names[fqn]``."""
    if not names:
        return d
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key in names:
            key = names[key]
        else:
            section, _, rest = key.partition(".")
            fqn, dot, leaf = rest.rpartition(".")
            if fqn in names:
                key = f"{section}.{names[fqn]}{dot}{leaf}"
        out[key] = value
    return out


def _state(
    model: nn.ModuleDict,
    optimizers: tuple[torch.optim.Optimizer, ...],
    rank: int,
    step: int,
    extra: Mapping[str, Any] | None,
    shards: Mapping[str, str],
) -> dict[str, Any]:
    if optimizers:
        msd, osd = get_state_dict(model, optimizers, options=_OPTIONS)
    else:
        msd, osd = get_model_state_dict(model, options=_OPTIONS), {}
    msd, osd = _rename(msd, shards), _rename(osd, shards)
    mine: dict[str, Any] = {"rng": _rng_bytes()}
    for name, obj in (extra or {}).items():
        if name == "rng" or not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ValueError(
                f"extra[{name!r}] must be an object with state_dict() and load_state_dict() "
                f"and not be named 'rng', got {type(obj).__name__}"
            )
        mine[name] = obj.state_dict()  # DCP expands Stateful objects at the top level only
    return {"model": msd, "optim": osd, "step": step, f"rank{rank}": mine}


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    stages: Mapping[int, nn.Module],
    optimizer: Optimizers = None,
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int | None = None,
    meta: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    resumed_from: str | os.PathLike | None = None,
) -> Path:
    """Save this rank's share of the training state in ``ROOT/step-{step:08d}`` (all ranks call).

    stages: this rank's stages by global stage index.
    optimizer: one optimizer or several over those stages' parameters (or None).
    extra: this rank's other state, objects with ``state_dict()``/``load_state_dict()`` (e.g.
        ``{"data": batch_iterator}``).
    keep: after saving, keep the newest ``keep`` checkpoints up to this step whose files
        verify, this one included, and delete the others older than this step: the older
        ones that verify, the ones that do not (they are not counted) and the incomplete
        ones. The ranks verify the older checkpoints newest first, each its own files as
        ``load_checkpoint`` does, until ``keep - 1`` verify (in steady state: the
        ``keep - 1`` that remain from earlier saves, read back once more); None keeps all.
    resumed_from: the checkpoint this run resumed from, which ``keep`` never deletes (the
        last state known to load stays until the run ends, whatever it saves after it).
    meta: JSON-serializable facts for the marker (rank 0's are kept), read back by
        ``checkpoint_info``: e.g. the settings a resumed run must share.
    group: the process group of the pipeline's ranks (default: the world).

    Returns the checkpoint's path once it is complete on every rank: every file written and
    its size and CRC-32 in the marker.
    """
    path = checkpoint_path(root, step)
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1, got keep={keep!r}")
    if resumed_from is not None and not isinstance(resumed_from, (str, os.PathLike)):
        raise ValueError(f"resumed_from must be a path or None, got {resumed_from!r}")
    model = _check_stages(stages)
    try:
        json.dumps(dict(meta or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serializable: {e}") from None
    rank, world = _world(group)
    distributed = _distributed()
    shards = _expert_shards(model)
    state = _state(model, _optimizers(optimizer), rank, step, extra, shards)
    if rank == 0 and path.exists():  # an incomplete (or old) checkpoint of this step
        shutil.rmtree(path)
    if distributed:
        dist.barrier(group=group)
    writer = _RecordingWriter(path)
    with _single_process_quiet():
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=not distributed)
    # What the marker needs from this rank; the files are complete once dcp.save returns.
    files = {name: _record(path / name, rank) for name in writer.written}
    if rank == 0:
        files[_DCP_METADATA] = _record(path / _DCP_METADATA, rank)
    mine = {
        "stages": sorted(stages),
        "files": files,
        "keys": {str(i): unsplit_keys(stages[i]) for i in sorted(stages)},
        "tied": _tied_names(model, shards),
    }
    facts = [mine]
    if distributed:
        facts = [None] * world
        dist.all_gather_object(facts, mine, group=group)
    if rank == 0:
        tied = sorted({tuple(names) for f in facts for names in f["tied"]})
        info = {
            "format": _FORMAT,
            "step": step,
            "world_size": world,
            "stages": [f["stages"] for f in facts],
            "meta": dict(meta or {}),
            "files": {name: rec for f in facts for name, rec in sorted(f["files"].items())},
            "keys": {i: m for f in facts for i, m in f["keys"].items()},
            "tied": [list(names) for names in tied],
        }
        tmp = path / (MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / MARKER)
    if keep is not None:
        _retain(Path(root), path, keep, rank, world, group, resumed_from)
    if distributed:
        dist.barrier(group=group)
    return path


def _tied_names(model: nn.ModuleDict, shards: Mapping[str, str]) -> list[list[str]]:
    """The state-dict names (as saved, ``stage{i}.{key}``) that are one tensor on this rank,
    in groups of two or more."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(shards.get(name, name))
    return [names for names in groups.values() if len(names) > 1]


def _share_problem(path: Path, rank: int, world: int) -> str | None:
    """This rank's share of verifying the checkpoint ``path`` (its own files, as a load
    checks them; all of them on rank 0 for a checkpoint of another world size): why it
    fails, or None."""
    info = _read_marker(path)
    if info is None:
        return f"incomplete (no readable {MARKER})"
    try:
        if info.get("world_size") == world:
            _verify(path, info, rank)
        elif rank == 0:
            _verify(path, info)
    except CheckpointError as e:
        return e.reason
    return None


def _retain(
    root: Path,
    path: Path,
    keep: int,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
    resumed_from: str | os.PathLike | None,
) -> None:
    """``save_checkpoint``'s ``keep`` after ``path`` is complete (every rank calls)."""
    step = int(_NAME.fullmatch(path.name).group(1))  # type: ignore[union-attr]
    # Only checkpoints up to this step count: a newer one left by a run that was resumed
    # from an older checkpoint (it did not verify) is overwritten when the run gets there.
    older = [str(p) for s, p in reversed(_complete(root)) if s < step]  # newest first
    if _distributed():  # rank 0's listing, so that every rank verifies the same ones
        views: list[Any] = [None] * world
        dist.all_gather_object(views, older, group=group)
        older = views[0]
    kept = [path]
    for candidate in map(Path, older):
        if len(kept) >= keep:
            break
        mine = _share_problem(candidate, rank, world)
        problems: list[Any] = [mine]
        if _distributed():
            problems = [None] * world
            dist.all_gather_object(problems, mine, group=group)
        if all(p is None for p in problems):
            kept.append(candidate)
    if rank != 0:
        return
    protected = Path(resumed_from).resolve() if resumed_from is not None else None
    doomed = [p for p in map(Path, older) if p not in kept and p.resolve() != protected]
    doomed += [c for s, c in _steps(root) if s < step and _read_marker(c) is None]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(
    path: str | os.PathLike,
    stages: Mapping[int, nn.Module],
    optimizer: Optimizers = None,
    *,
    extra: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    verify: bool = True,
) -> int:
    """Load the state ``save_checkpoint`` wrote at ``path`` into this rank's objects; every rank
    calls it with the arguments it saved with. Returns the checkpoint's step.

    The stages' parameters and buffers, the optimizer state (a fresh optimizer is fine), the
    random number generators and every ``extra`` object are restored. Nothing is loaded
    until every rank has checked, and the ranks agree: all raise the same error, the first
    rank's, when one finds a fault:

    - ``FileNotFoundError`` for an incomplete or missing checkpoint;
    - ``CheckpointError`` (with ``verify``, the default) for a damaged, truncated or missing
      file (each rank checks ``.metadata`` and the files it wrote) or a checkpoint saved
      without checksums;
    - ``ValueError`` when the ranks or stages differ from the saved ones, or a tensor's
      shape differs from the checkpoint's (naming the key and both shapes) or the checkpoint
      lacks one of the tensors (naming it).
    """
    path = Path(path)
    model = _check_stages(stages)
    rank, world = _world(group)
    optimizers = _optimizers(optimizer)
    shards = _expert_shards(model)
    state = _state(model, optimizers, rank, -1, extra, shards)
    problem: Exception | None = None
    try:
        _check_loadable(path, stages, state, rank, world, verify)
    except (OSError, ValueError) as e:
        problem = e
    problems = [problem]
    if _distributed():
        problems = [None] * world
        dist.all_gather_object(problems, problem, group=group)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise first
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path, process_group=group, no_dist=not _distributed())
    back = {v: k for k, v in shards.items()}
    state["model"], state["optim"] = _rename(state["model"], back), _rename(state["optim"], back)
    if optimizers:
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_OPTIONS,
        )
    else:
        set_model_state_dict(model, state["model"], options=_OPTIONS)
    mine = state[f"rank{rank}"]
    _restore_rng(mine["rng"])
    for name, obj in (extra or {}).items():
        obj.load_state_dict(mine[name])
    return int(state["step"])


def _check_loadable(
    path: Path,
    stages: Mapping[int, nn.Module],
    state: Mapping[str, Any],
    rank: int,
    world: int,
    verify: bool,
) -> None:
    """This rank's checks before a load: the marker's ranks and stages, the files (with
    ``verify``), every tensor's presence and shape in ``.metadata``."""
    info = _marker(path)
    if info["world_size"] != world:
        raise ValueError(
            f"checkpoint {path} was saved by {info['world_size']} ranks, this run has {world}"
        )
    saved_stages = info["stages"][rank]
    if saved_stages != sorted(stages):
        raise ValueError(
            f"checkpoint {path} holds stages {saved_stages} for rank {rank}, "
            f"this rank has stages {sorted(stages)}"
        )
    if verify:
        _verify(path, info, rank)
    _check_shapes(path, _read_dcp_metadata(path), state)


def _read_dcp_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling a damaged file raises anything
        raise CheckpointError(
            path, f"file {_DCP_METADATA} cannot be read ({type(e).__name__}: {e})", _DCP_METADATA
        ) from None


def _check_shapes(path: Path, metadata: Metadata, state: Mapping[str, Any]) -> None:
    saved = metadata.state_dict_metadata
    for section in ("model", "optim"):
        for key, value in state[section].items():
            if not isinstance(value, torch.Tensor):
                continue
            name = f"{section}.{key}"
            entry = saved.get(name)
            if entry is None:
                raise ValueError(
                    f"checkpoint {path} holds no {name}, which this rank's stages "
                    "or optimizer have (saved from another model or optimizer?)"
                )
            if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != value.shape:
                raise ValueError(
                    f"checkpoint {path}: {name} has shape {list(entry.size)} there "
                    f"and {list(value.shape)} in this rank's stages (another model size?)"
                )


def export_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unsplit model's ``state_dict`` from the checkpoint at ``path``, read in this process
    (no process group needed), on the CPU; ``model.load_state_dict(sd, strict=True)`` loads
    it into the unsplit model.

    Every file is verified first (``verify_checkpoint``). Each stage key is renamed by its
    stage's key map (``set_unsplit_keys``; a stage without one keeps its keys). A tensor
    tied on its rank (the built-in model's embedding and head) is one tensor under each of
    its names; two stages whose keys map to the same name must hold equal tensors, which
    are exported once. Expert-parallel shards (``...[experts 0-1 of 4]``) are concatenated
    into all of the experts. No optimizer state, no RNG, no step.

    Raises ``FileNotFoundError`` (not a complete checkpoint), ``CheckpointError`` (a file does
    not verify; a checkpoint saved without key maps) and ``ValueError`` naming the key when
    two different tensors map to one name or the expert shards do not cover every expert.
    """
    path = Path(path)
    info = _marker(path)
    _verify(path, info)
    keymaps: dict[str, Any] = info["keys"]
    saved = _read_dcp_metadata(path).state_dict_metadata
    names = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    first = {name: group[0] for group in info["tied"] for name in group}  # read once
    wanted: dict[str, Any] = {}
    for name in names:
        entry = saved["model." + name]
        if first.get(name, name) != name:
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"export: model.{name} of checkpoint {path} is not a tensor")
        wanted[name] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    with _single_process_quiet():
        dcp.load({"model": wanted}, checkpoint_id=path, no_dist=True)
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    parts: dict[str, list[tuple[int, int, int, torch.Tensor, str]]] = {}
    for name in names:
        tensor = wanted[first.get(name, name)]
        m = _STAGE_KEY.fullmatch(name)
        if m is None:
            raise ValueError(f"export: model.{name} of checkpoint {path} is not a stage's key")
        key = m.group(2)
        shard = _SHARD.fullmatch(key)
        if shard is not None:
            key = shard.group(1)
        full = unsplit_name(key, keymaps.get(m.group(1)))
        if shard is not None:
            lo, hi, of = (int(g) for g in shard.group(2, 3, 4))
            parts.setdefault(full, []).append((lo, hi, of, tensor, name))
            continue
        if full in out:
            _check_same(full, source[full], out[full], name, tensor)
            continue
        out[full], source[full] = tensor, name
    for full, shards in parts.items():
        out[full] = _join_experts(full, shards)
    return out


def _check_same(key: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Two checkpoint tensors mapped to one unsplit ``key``: they must be one and the same."""
    if a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
        return
    raise ValueError(
        f"export: {name_a} and {name_b} both map to the unsplit key {key!r} but hold "
        f"different tensors ({list(a.shape)} {a.dtype}, {list(b.shape)} {b.dtype}); check the "
        "stages' set_unsplit_keys maps"
    )


def _join_experts(key: str, shards: list[tuple[int, int, int, torch.Tensor, str]]) -> torch.Tensor:
    """The experts' shards of one parameter, ``(first, last, of, tensor, name)``, in order."""
    held: dict[tuple[int, int, int], tuple[torch.Tensor, str]] = {}
    for lo, hi, of, tensor, name in shards:
        if (lo, hi, of) in held:  # the same experts in two stages (tied): must be equal
            _check_same(key, held[lo, hi, of][1], held[lo, hi, of][0], name, tensor)
            continue
        held[lo, hi, of] = (tensor, name)
    spans = sorted(held)
    whole = (
        len({of for _, _, of in spans}) == 1
        and spans[0][0] == 0
        and all(a[1] + 1 == b[0] for a, b in itertools.pairwise(spans))
        and spans[-1][1] + 1 == spans[0][2]
    )
    if not whole:
        listed = ", ".join(f"{lo}-{hi} of {of}" for lo, hi, of in spans)
        raise ValueError(
            f"export: the expert shards of {key!r} do not cover every expert once "
            f"(the checkpoint holds experts {listed})"
        )
    return torch.cat([held[span][0] for span in spans])


def _rng_bytes() -> bytes:
    states = {
        "torch": torch.get_rng_state(),
        # Only once CUDA is in use: asking earlier would create a CUDA context on GPU 0 in
        # every rank of a CPU run.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    return pickle.dumps(states)


def _restore_rng(blob: bytes) -> None:
    states = pickle.loads(blob)
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
