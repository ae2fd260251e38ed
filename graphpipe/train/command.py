"""The ``graphpipe train`` command: its parser and ``run`` (check every argument, then start
the ranks).

Owns: the options only ``train`` has (steps, metrics, checkpoints; the model's are
``options``) and the order of things: the checks of ``checks`` on the launching process
(a bad argument is one line, exit status 2, before any rank starts), then ``launch`` of
``loop.train_rank`` on every rank. Imports no torch at module level: ``graphpipe train
--help`` and argument errors answer without it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .checks import check_train, torchrun_world
from .options import add_model_options

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train the built-in byte-level Llama with DualPipeV",
        description=(
            "Train graphpipe's built-in Llama-style byte-level model with the DualPipeV "
            "schedule. Without torchrun it spawns --ranks x --dp local processes (gloo on CPU, "
            "NCCL with --device cuda, one GPU per rank); under torchrun it joins torchrun's "
            "world (torchrun --nproc-per-node N -m graphpipe train ...). Data: the Python "
            "standard library's own source files, or --data FILE. Every argument is checked "
            "before any rank starts; a non-finite loss stops the run (exit status 1, unless "
            "--allow-nonfinite); Ctrl-C stops every rank (exit status 130)."
        ),
    )
    add_model_options(p)
    p.add_argument(
        "--steps",
        type=int,
        default=100,
        help="train until this global step (default 100)",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="FILE",
        help="write one JSON line per step here: step (global), loss, step_time_s, "
        "tokens_per_s (a resumed run keeps the rows up to its checkpoint and appends); its "
        "directory must exist",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save the training state (weights, optimizer, step, RNG and data position) "
        "here with torch.distributed.checkpoint, as DIR/step-NNNNNNNN, after the last step "
        "and every --checkpoint-every steps (DIR is created; its parent must exist; checked "
        "for writing before training starts)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="K",
        help="also save every K steps (needs --checkpoint-dir)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=2,
        metavar="K",
        help="keep the newest K checkpoints in --checkpoint-dir whose files verify, and the "
        "one the run resumed from (default 2)",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="train on when a step's loss is NaN or infinite (default: stop at the first one, "
        "before its metrics row and checkpoint, exit status 1)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir whose files verify, "
        "naming each newer one skipped and why (start from scratch if it holds none; exit "
        "status 1 if it holds checkpoints but none verifies); the model settings must be "
        "the checkpoint's",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``graphpipe train``: check the arguments, then spawn (or join torchrun's) ranks."""
    from graphpipe.cmdline.launch import launch

    problem = torchrun_world(args) or check_train(args)
    if problem is not None:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine under torchrun
            print(f"graphpipe train: error: {problem}", file=sys.stderr)
        return 2
    if args.resume_from is not None and args.resume_step >= args.steps:
        print(
            f"graphpipe train: {args.resume_from} is at step {args.resume_step}, "
            f"--steps is {args.steps}: nothing to do",
            file=sys.stderr,
        )
        return 0
    from .loop import train_rank  # torch: only once the arguments are known to be good

    opts = {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
    launch(train_rank, args.ranks * args.dp, args.device, opts)
    return 0
