"""Resuming ``graphpipe train`` from its ``--checkpoint-dir``: which checkpoint, and loading it.

Owns: the settings a resumed run must share with its checkpoint (``model_settings``, saved
as the checkpoint's ``meta``), ``find_resume`` (before any rank starts: the newest checkpoint that
verifies, checked against this run's world and settings) and ``load_resumed`` (on every
rank: that checkpoint into the rank's stages, optimizer and data position). A checkpoint
whose files do not verify is skipped for the newest one that does. Reads and writes
checkpoints only through ``graphpipe.checkpoint``, imported when a checkpoint is there.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["find_resume", "load_resumed", "model_settings"]

# The settings a resumed run must share with the checkpoint (they decide the numerics).
_RESUME_MUST_MATCH = (
    "batch_size",
    "seq_len",
    "hidden",
    "layers",
    "layers_per_stage",
    "heads",
    "microbatches",
    "seed",
    "data",
    "dtype",
    "no_kernels",
    "dp",
    "experts",
    "top_k",
    "capacity_factor",
    "ep",
)


def model_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of ``_RESUME_MUST_MATCH`` (``--data`` as an absolute path)."""
    data = os.path.abspath(args.data) if args.data is not None else None
    settings = {k: getattr(args, k, 1) for k in _RESUME_MUST_MATCH}
    return {**settings, "data": data}


def find_resume(args: argparse.Namespace) -> str | None:
    """The checkpoint to resume from, or the problem with ``--checkpoint-dir`` (one line).

    With ``--resume``: the newest checkpoint there that verifies
    (``graphpipe.checkpoint.find_resumable``), which must fit this run; a line per newer
    checkpoint it skipped goes to stderr, and a directory holding complete checkpoints of
    which none verifies exits with status 1 (``SystemExit``). With none at all the run starts
    from step 0 (so that a job restarted by torchrun can always pass --resume).

    Sets ``args.resume_from`` (a path, or left None: start from scratch),
    ``args.resume_step`` and ``args.resume_skipped`` (path -> why, for each checkpoint
    skipped). A directory holding checkpoints without ``--resume`` is a problem.
    """
    from graphpipe.checkpoint import checkpoint_info, find_resumable, latest_checkpoint

    root = args.checkpoint_dir
    if not args.resume:
        latest = latest_checkpoint(root)
        if latest is None:
            return None
        return (
            f"--checkpoint-dir {root} already holds checkpoints (newest: "
            f"{latest.name}); pass --resume to continue from it, or choose another directory"
        )
    latest, skipped = find_resumable(root)
    args.resume_skipped = {str(path): why for path, why in skipped}  # named again if removed
    say = os.environ.get("LOCAL_RANK", "0") == "0"  # once per machine under torchrun
    for path, why in skipped:
        if say:
            print(f"graphpipe train: --resume: skipped {path}: {why}", file=sys.stderr)
    if latest is None:
        if latest_checkpoint(root) is None:
            return None  # nothing saved yet (at most a save cut short): a fresh start
        if say:
            print(
                f"graphpipe train: error: --resume: no checkpoint in {root} verifies; "
                "move them away to start from step 0",
                file=sys.stderr,
            )
        raise SystemExit(1)
    info = checkpoint_info(latest)
    world = args.ranks * args.dp
    if info["world_size"] != world:
        return (
            f"--resume: {latest} was saved by {info['world_size']} ranks, "
            f"this run has --ranks {args.ranks}" + (f" x --dp {args.dp}" if args.dp > 1 else "")
        )
    saved, mine = info["meta"] or {}, model_settings(args)
    for key in _RESUME_MUST_MATCH:
        if key in saved and saved[key] != mine[key]:
            flag = "--" + key.replace("_", "-")
            return (
                f"--resume: {latest} was trained with {flag} {saved[key]}, "
                f"this run has {flag} {mine[key]}"
            )
    args.resume_from = str(latest)
    args.resume_step = info["step"]
    return None


def load_resumed(run: Any, opts: dict, rank: int, extra: dict) -> int:
    """Load ``opts["resume_from"]`` (if any) into this rank's ``RankRun``; its step (0: none).

    ``extra``: the other state saved with it (the data loader's position on a replica's first
    rank). The learning rate is this run's ``--lr``, not the checkpoint's.
    """
    if opts["resume_from"] is None:
        return 0
    from graphpipe.checkpoint import load_checkpoint

    start = load_checkpoint(opts["resume_from"], run.stages, run.opt, extra=extra)
    for group in run.opt.param_groups:
        group["lr"] = opts["lr"]
    if rank == 0:
        print(
            f"graphpipe train: resumed from {opts['resume_from']} (step {start})",
            file=sys.stderr,
            flush=True,
        )
    return start
