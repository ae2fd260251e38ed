"""A graphpipe checkpoint of a Hugging Face causal LM back to a model directory that
``from_pretrained`` reads: ``export_hf_model`` and ``graphpipe export CKPT OUT_DIR
--hf-config CONFIG``.

``export_state_dict`` gives the unsplit model's ``state_dict`` under HF's own names (the
stages of ``split_hf_causal_lm`` declare them); this module builds the HF model of the given
config on the meta device (no weights allocated, no random init), assigns those tensors to it
(``load_state_dict(strict=True, assign=True)``: every key and shape must match), ties what the
config ties, and writes ``config.json`` and safetensors weights with the model's own
``save_pretrained`` (tied weights once, as HF writes them), into a temporary directory beside
``OUT_DIR`` that is renamed to it when complete. So
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` is the trained model, bitwise, in the
training dtype (the config records it; ``dtype=`` casts every floating tensor instead).

One process, offline: nothing is downloaded (the config is a local file or directory). Under
an initialized process group HF's ``save_pretrained`` writes nothing on any rank but global
rank 0, so a call on another rank is refused. ``OUT_DIR`` must not exist and its parent must
be writable; both are checked, and the config read, before the checkpoint is.

transformers and ``graphpipe.checkpoint`` are imported when a function here runs, not on
import.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from graphpipe.cmdline.outputs import check_output_dir

__all__ = ["check_export_dir", "export_hf_model", "load_hf_config", "run_cli"]

_PROG = "graphpipe export"


def check_export_dir(out_dir: str | os.PathLike, flag: str = "OUT_DIR") -> str | None:
    """Why ``out_dir`` cannot be the new model directory, as one line (None: it can): it
    must not exist, and its parent must be an existing, writable directory."""
    path = Path(out_dir)
    if path.exists() or path.is_symlink():
        return f"{flag} {path}: exists; give a directory that does not exist yet"
    return check_output_dir(flag, path)


def load_hf_config(config: Any) -> Any:
    """The transformers config of ``config``: a ``PretrainedConfig`` as it is, a directory
    holding ``config.json``, or a JSON file. ``ValueError`` naming the path otherwise."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"config must be a transformers PretrainedConfig or a path, got {type(config).__name__}"
        )
    path = Path(config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no config.json" if path.is_dir() else f"{path}: no such file"
        raise ValueError(f"the HF config: {where}")
    try:
        return transformers.AutoConfig.from_pretrained(str(file), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"the HF config {file} cannot be read ({type(e).__name__}: {e})") from None


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype=`` as a floating torch dtype (None: the checkpoint's own). A torch dtype and
    a name alike must be floating: an integer, bool or complex dtype is refused naming it
    here, before the checkpoint is read (cast, it would fail later inside torch's
    ``load_state_dict`` or ``save_pretrained`` with nothing that names it)."""
    if value is None:
        return None
    got = value if isinstance(value, torch.dtype) else getattr(torch, str(value), None)
    if not isinstance(got, torch.dtype) or not got.is_floating_point:
        raise ValueError(
            f"export_hf_model: dtype must be a floating torch dtype (float32, bfloat16, ...), "
            f"got {value!r}"
        )
    return got


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` with every floating tensor in ``dtype`` (tensors shared under several names
    stay shared); without ``dtype`` the state's one floating dtype, or ``ValueError``."""
    floating = sorted(
        {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    )
    if dtype is None:
        if len(floating) > 1:
            raise ValueError(
                "export_hf_model: the checkpoint holds tensors of several dtypes "
                f"({', '.join(floating)}): from_pretrained loads one; pass dtype= (--dtype) "
                "to write all in one"
            )
        return state
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for key, t in state.items():
        if t.is_floating_point():
            t = cast.setdefault(id(t), t.to(dtype))
        out[key] = t
    return out


def _names(keys: list[str], limit: int = 4) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _misfit(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str | None:
    """How the keys and shapes of ``state`` differ from the model's, in one line."""
    parts = []
    missing = [k for k in expected if k not in state]
    if missing:
        parts.append(f"the model has {len(missing)} keys the checkpoint lacks ({_names(missing)})")
    extra = [k for k in state if k not in expected]
    if extra:
        parts.append(f"the checkpoint has {len(extra)} keys the model lacks ({_names(extra)})")
    shapes = [
        f"{k} {list(state[k].shape)} (the model: {list(v.shape)})"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if shapes:
        parts.append(f"other shapes: {_names(shapes)}")
    return "; ".join(parts) or None


def export_hf_model(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: Any,
    *,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write the HF model directory ``out_dir`` (``config.json``, ``model.safetensors``,
    ``generation_config.json``) of the checkpoint at ``checkpoint``, a graphpipe checkpoint
    of stages from ``split_hf_causal_lm``; returns ``out_dir``.

    config: the model's transformers config (a ``PretrainedConfig``, a directory holding
        ``config.json``, or the file); the architecture it names must hold exactly the
        checkpoint's keys and shapes.
    dtype: write every floating tensor in this dtype (``torch.bfloat16`` or ``"bfloat16"``);
        by default the checkpoint's own (the training dtype), which must be one.

    Then ``AutoModelForCausalLM.from_pretrained(out_dir)`` gives the trained model bitwise.
    Raises ``ValueError`` before reading the checkpoint when ``out_dir`` exists or cannot be
    created, or the config cannot be read, or on a rank other than 0 of an initialized
    process group; then, naming what differs, when the checkpoint does not verify, its keys
    or shapes are not the config's model's, a weight the config ties (``tie_word_embeddings``)
    holds different values under its two names, or it holds several dtypes without ``dtype``.
    """
    import torch.distributed as dist

    from graphpipe.checkpoint import export_state_dict

    problem = check_export_dir(out_dir, "out_dir")
    if problem is not None:
        raise ValueError(f"export_hf_model: {problem}")
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        raise ValueError(
            f"export_hf_model: called on rank {dist.get_rank()} of a process group, where HF's "
            "save_pretrained writes nothing; call it on rank 0, or in one process"
        )
    cfg = load_hf_config(config)
    want = _dtype(dtype)
    state = _cast(export_state_dict(checkpoint), want)

    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    problem = _misfit(model.state_dict(), state)
    if problem is not None:
        raise ValueError(
            f"export_hf_model: the checkpoint {checkpoint} does not fit the config's "
            f"{type(model).__name__}: {problem}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    held = model.state_dict()
    for key, tensor in state.items():
        if not torch.equal(held[key], tensor):
            raise ValueError(
                f"export_hf_model: the config ties {key} to another weight "
                f"(tie_word_embeddings={getattr(cfg, 'tie_word_embeddings', None)}), but the "
                f"checkpoint holds other values under {key}: it was not trained tied"
            )
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out.absolute().parent, prefix=f".{out.name}.tmp-"))
    try:
        model.save_pretrained(tmp)
        missing = [f for f in ("config.json", "model.safetensors") if not (tmp / f).exists()]
        if missing and not list(tmp.glob("model-*.safetensors")):
            raise ValueError(f"export_hf_model: save_pretrained wrote no {', '.join(missing)}")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def run_cli(args: argparse.Namespace) -> int:
    """``graphpipe export CKPT OUT_DIR --hf-config CONFIG [--dtype D]``: the output and the
    config checked (status 2), then the checkpoint found and exported (status 1 on error)."""
    problem = check_export_dir(args.out, "OUT_DIR")
    if problem is None and not os.path.isdir(args.dir):
        problem = f"{args.dir}: no such directory"
    if problem is None:
        try:
            config = load_hf_config(args.hf_config)
        except ValueError as e:
            problem = f"--hf-config: {e}"
    if problem is not None:
        print(f"{_PROG}: error: {problem}", file=sys.stderr)
        return 2
    from graphpipe.checkpoint.files import resolve_checkpoint

    path, skipped, missing = resolve_checkpoint(args.dir)
    for p, why in skipped:
        print(f"{_PROG}: skipped {p}: {why}", file=sys.stderr)
    if path is None:
        print(f"{_PROG}: error: {missing}", file=sys.stderr)
        return 1
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the command's output is its one line
    try:
        out = export_hf_model(path, args.out, config, dtype=args.dtype)
    except (OSError, ValueError) as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"{_PROG}: wrote {out} ({type(config).__name__}), from {path}", file=sys.stderr)
    return 0
