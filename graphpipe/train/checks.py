"""The checks of ``graphpipe train``'s (and ``profile``'s) arguments, before any rank starts.

Owns: every check that turns a bad combination of options into a one-line message (the
command prints it and exits with status 2), and filling in the defaults that depend on other
options. Imports torch only for ``--device cuda`` (whether CUDA is there); finding the
checkpoint to resume from is ``resume``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

from graphpipe.cmdline.options import cuda_problem, first_below
from graphpipe.cmdline.outputs import check_output_dir, check_output_file
from graphpipe.schedule.splits import check_layers_per_stage, layers_per_stage

from .options import default_layers, default_microbatches
from .resume import find_resume

__all__ = ["check_model", "check_train", "torchrun_world"]


def _check_moe(args: argparse.Namespace) -> str | None:
    problem = first_below(args, 0, "experts")
    if problem is not None:
        return problem
    if args.top_k < 1 or (args.experts and args.top_k > args.experts):
        return f"--top-k must be between 1 and --experts {args.experts}, got {args.top_k}"
    if not args.capacity_factor > 0:
        return f"--capacity-factor must be > 0, got {args.capacity_factor}"
    if args.ep < 1 or (args.experts and args.experts % args.ep):
        return f"--ep must be >= 1 and divide --experts {args.experts}, got {args.ep}"
    dp = getattr(args, "dp", 1)
    if dp % args.ep:  # the ep groups are carved out of the data-parallel group
        return f"--ep {args.ep} must divide --dp {dp} (experts are sharded across replicas)"
    return None


def torchrun_world(args: argparse.Namespace) -> str | None:
    """Under torchrun, its world decides: sets ``args.ranks`` to ``WORLD_SIZE / --dp``, or
    returns the problem when ``--dp`` does not divide it. Elsewhere a no-op."""
    from graphpipe.cmdline.launch import joined_torchrun

    if not joined_torchrun():
        return None
    world = int(os.environ["WORLD_SIZE"])
    if args.dp < 1 or world % args.dp:
        return f"--dp {args.dp} does not divide WORLD_SIZE {world}"
    args.ranks = world // args.dp
    return None


def check_model(args: argparse.Namespace) -> str | None:
    """The first problem with the model, data and device options, as a one-line message
    (None when fine); ``graphpipe profile`` uses it too.

    Fills in the defaults that depend on others (``microbatches``, ``layers`` (the sum of
    ``--layers-per-stage`` when only that is given), ``layers_per_stage`` (the even split when
    not given)).
    """
    names = ("ranks", "batch_size", "seq_len", "hidden", "heads", "microbatches", "layers")
    problem = first_below(args, 1, *names)
    if problem is not None:
        return problem
    dp = getattr(args, "dp", 1)
    if dp < 1:
        return f"--dp must be >= 1, got {dp}"
    n = args.ranks
    per = f" on each of --dp {dp} replicas" if dp > 1 else ""
    if args.batch_size % dp:
        return f"--batch-size {args.batch_size} does not split evenly over --dp {dp} replicas"
    m = args.microbatches
    if m is None:
        m = default_microbatches(n, args.batch_size // dp)
    if m is None:
        return (
            f"--batch-size {args.batch_size} does not split into 2 * --ranks = {2 * n} or more "
            f"equal micro-batches{per}; pass a --batch-size that is a multiple of {2 * n * dp}"
        )
    if m < 2 * n:
        return f"--microbatches must be >= 2 * --ranks = {2 * n}, got {m}"
    if args.batch_size % (dp * m):
        return f"--batch-size {args.batch_size} does not split into {m} equal micro-batches{per}"
    chosen = getattr(args, "layers_per_stage", None)
    if chosen is not None and args.layers is None:
        args.layers = sum(chosen)
    layers = args.layers if args.layers is not None else default_layers(n)
    if layers < 2 * n - 2:
        return (
            f"--layers {layers} is too few for --ranks {n}: every middle stage of the {2 * n} "
            f"stages needs a layer, so --layers must be >= {2 * n - 2}"
        )
    try:
        counts = layers_per_stage(layers, 2 * n)
        if chosen is not None:
            counts = check_layers_per_stage(chosen, layers, 2 * n, name="--layers-per-stage")
    except ValueError as e:
        return str(e).replace(f"{layers} layers", f"--layers {layers}")
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not a multiple of --heads {args.heads}"
    if (args.hidden // args.heads) % 2:
        return (
            f"--hidden {args.hidden} / --heads {args.heads} = {args.hidden // args.heads} must "
            "be even (rotary embeddings rotate pairs)"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr must be a positive number, got {args.lr}"
    problem = _check_data(args) or _check_device(args) or _check_moe(args)
    if problem is not None:
        return problem
    args.microbatches, args.layers, args.layers_per_stage = m, layers, counts
    return None


def _check_data(args: argparse.Namespace) -> str | None:
    if args.data is None:
        return None
    if not os.path.isfile(args.data):
        return f"--data {args.data}: no such file"
    size = os.path.getsize(args.data)
    if size < args.seq_len + 1:
        return (
            f"--data {args.data} holds {size} bytes, fewer than --seq-len + 1 = {args.seq_len + 1}"
        )
    return None


def _check_device(args: argparse.Namespace) -> str | None:
    problem = cuda_problem(args.device)
    if args.device != "cuda" or problem is not None:
        return problem
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks * getattr(args, "dp", 1)))
    if local > torch.cuda.device_count():
        return (
            f"--device cuda needs one GPU per rank: {local} ranks on this machine, "
            f"{torch.cuda.device_count()} GPUs visible"
        )
    if not args.no_kernels and importlib.util.find_spec("triton") is None:
        return (
            "--device cuda runs the Triton kernels, but triton is not installed (pass --no-kernels)"
        )
    return None


def check_train(args: argparse.Namespace) -> str | None:
    """``check_model`` plus what only ``graphpipe train`` has: steps, metrics, checkpoints.

    Also sets ``resume_from`` / ``resume_step`` (the checkpoint to continue from, or None / 0)
    and ``resume_skipped`` (the newer checkpoints ``--resume`` skipped, path -> why).
    """
    args.resume_from, args.resume_step, args.resume_skipped = None, 0, {}
    problem = first_below(args, 1, "steps", "keep_checkpoints", "checkpoint_every")
    if problem is not None:
        return problem
    # The outputs first: nothing (--data, a checkpoint to resume from) is read before them.
    if args.metrics is not None:
        problem = check_output_file("--metrics", args.metrics)
        if problem is not None:
            return problem
    if args.checkpoint_dir is not None:
        problem = check_output_dir("--checkpoint-dir", args.checkpoint_dir)
        if problem is not None:
            return problem
    problem = check_model(args)
    if problem is not None:
        return problem
    if args.checkpoint_dir is None:
        if args.checkpoint_every is not None:
            return "--checkpoint-every needs --checkpoint-dir"
        if args.resume:
            return "--resume needs --checkpoint-dir"
        return None
    return find_resume(args)
