"""``graphpipe export DIR OUT.pt``: the unsplit model's ``state_dict`` from a checkpoint.

``DIR`` is a checkpoint (a directory with ``graphpipe.json`` or DCP's ``.metadata``) or a
checkpoint root, meaning its newest checkpoint whose files verify (each newer one skipped is
named, with why). ``OUT.pt`` gets ``graphpipe.checkpoint.export_state_dict`` of it through
``torch.save`` (to a temporary name, then a rename), so that
``model.load_state_dict(torch.load("OUT.pt"), strict=True)`` loads it into the unsplit model.

``OUT.pt`` is checked first, before ``DIR`` is looked at or anything is read
(``graphpipe.cmdline.outputs.check_output_file``, the rule of every command's outputs: its directory
must exist and be writable, an existing file is overwritten, a directory is refused).
Argument errors (``OUT.pt`` that cannot be written, no ``DIR``) exit with status 2 before any
work; a checkpoint that does not verify or export exits with status 1; one line each.

With ``--hf-config CONFIG`` (``OUT`` then a new directory) it writes a Hugging Face model
directory instead, for ``from_pretrained``: ``graphpipe.models.hf_export``.

Only the parser is built on import: the command imports torch when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from graphpipe.cmdline.outputs import check_output_file

__all__ = ["add_parser", "run"]

_PROG = "graphpipe export"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``graphpipe export`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "export",
        help="write the unsplit model from a checkpoint: a state_dict, or with --hf-config a "
        "Hugging Face model directory",
        description=(
            "Read a graphpipe checkpoint in this process (no process group), verify its "
            "files, and write the unsplit model's state_dict with torch.save: each stage's "
            "keys renamed by its key map, tied weights once, expert shards joined, no "
            "optimizer state. load_state_dict(torch.load(OUT.pt), strict=True) loads it."
        ),
    )
    p.add_argument(
        "dir",
        metavar="DIR",
        help="a checkpoint (DIR/step-NNNNNNNN), or a checkpoint directory: its newest "
        "checkpoint that verifies",
    )
    p.add_argument(
        "out", metavar="OUT.pt", help="the file to write (with --hf-config: the model directory)"
    )
    p.add_argument(
        "--hf-config",
        metavar="CONFIG",
        default=None,
        help="write a Hugging Face model directory instead (config.json and safetensors, "
        "for from_pretrained) of the model of CONFIG, a directory holding config.json or "
        "the file; OUT must not exist",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float64", "bfloat16", "float16"),
        default=None,
        help="with --hf-config: write the weights in this dtype (default: the checkpoint's)",
    )
    p.set_defaults(func=run, parser=p)
    return p


def _check(args: argparse.Namespace) -> str | None:
    """The output first (nothing is read before it is known to be writable), then ``DIR``."""
    problem = check_output_file("OUT.pt", args.out)
    if problem is not None:
        return problem
    if not os.path.isdir(args.dir):
        return f"{args.dir}: no such directory"
    return None


def _fail(message: str, status: int) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return status


def run(args: argparse.Namespace) -> int:
    """``graphpipe export``: check the arguments, find the checkpoint, export, write."""
    if args.hf_config is not None:
        from ..models.hf_export import run_cli

        return run_cli(args)
    if args.dtype is not None:
        return _fail("--dtype needs --hf-config", 2)
    problem = _check(args)
    if problem is not None:
        return _fail(problem, 2)
    import torch

    from ..checkpoint import export_state_dict
    from ..checkpoint.files import resolve_checkpoint

    path, skipped, missing = resolve_checkpoint(args.dir)
    for p, why in skipped:
        print(f"{_PROG}: skipped {p}: {why}", file=sys.stderr)
    if path is None:
        return _fail(missing, 1)
    try:
        state = export_state_dict(path)
    except (OSError, ValueError) as e:
        return _fail(str(e), 1)
    tmp = f"{args.out}.tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, args.out)
    except OSError as e:
        return _fail(f"cannot write {args.out} ({e.strerror or e})", 1)
    count = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    print(
        f"{_PROG}: wrote {args.out}: {len(state)} tensors, {count:,} parameters, from {path}",
        file=sys.stderr,
    )
    return 0
