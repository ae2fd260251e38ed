"""``graphpipe train``: train the built-in byte-level Llama with DualPipeV.

Every argument is checked before any rank starts (a bad one is a one-line error, exit status
2). Rank 0 shows a progress bar (loss, tokens/s, step time, ETA, total time at the end) and
writes ``--metrics`` as JSON lines: ``{"step", "loss", "step_time_s", "tokens_per_s"}`` with
the global step number. ``--checkpoint-dir`` saves the training state with
``graphpipe.checkpoint``; ``--resume`` continues from the newest complete checkpoint there, bit
for bit as if the run had not stopped.

Test hook (not a user option): ``GRAPHPIPE_TEST_EXIT=RANK:STEP`` makes rank RANK exit with
status 1 (``os._exit``, no cleanup, like a killed process) when it is about to run step STEP,
on the first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` unset or 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

__all__ = ["Progress", "add_parser", "default_layers", "default_microbatches", "run"]

# The settings a resumed run must share with the checkpoint (they decide the numerics).
_RESUME_MUST_MATCH = (
    "batch_size",
    "seq_len",
    "hidden",
    "layers",
    "heads",
    "microbatches",
    "seed",
    "data",
    "dtype",
    "no_kernels",
)


def _duration(seconds: float) -> str:
    """``8.2 s``, ``3m05s``, ``1h02m``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Rank 0's progress: one redrawn line on a terminal, plain lines elsewhere.

    Each line shows the step, a bar, the caller's text and the ETA (the mean step time of
    this run so far times the steps left); the last one shows the total time instead. On a
    terminal the line is redrawn in place (``\\r``, the line, then erase-to-end-of-line, cut
    to the terminal's width so it never wraps); elsewhere a line is written for the first
    step, every ``every`` steps and the last step. ``first``: the first step this run takes
    (a resumed run starts after its checkpoint's step).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO = sys.stderr,
        every: int = 10,
        *,
        first: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.stream, self.every, self.first = total, stream, every, first
        self.tty = stream.isatty()
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        """Seconds since this progress was created."""
        return self.clock() - self.start

    def update(self, step: int, text: str) -> None:
        width = 24
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        elapsed = self.elapsed()
        if step >= self.total:
            tail = f"{_duration(elapsed)} total"
        else:
            per_step = elapsed / (step - self.first + 1)
            tail = f"ETA {_duration(per_step * (self.total - step))}"
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {text} | {tail}"
        if self.tty:
            columns = shutil.get_terminal_size().columns
            self.stream.write("\r" + line[: max(1, columns - 1)] + "\x1b[K")
            if step >= self.total:
                self.stream.write("\n")
        elif step == self.first or step % self.every == 0 or step >= self.total:
            self.stream.write(line + "\n")
        self.stream.flush()


def default_microbatches(ranks: int, batch_size: int) -> int | None:
    """The default ``--microbatches``: 4N if it divides the batch, else the smallest divisor
    of the batch that is at least 2N (None if there is none)."""
    if batch_size % (4 * ranks) == 0:
        return 4 * ranks
    return next((m for m in range(2 * ranks, batch_size + 1) if batch_size % m == 0), None)


def default_layers(ranks: int) -> int:
    """The default ``--layers``: 4, or enough for every middle stage of 2N stages to get one."""
    return max(4, 2 * ranks - 2)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train the built-in byte-level Llama with DualPipeV",
        description=(
            "Train graphpipe's built-in Llama-style byte-level model with the DualPipeV "
            "schedule. Without torchrun it spawns --ranks local processes (gloo on CPU, NCCL "
            "with --device cuda, one GPU per rank); under torchrun it joins torchrun's world "
            "(torchrun --nproc-per-node N -m graphpipe train ...). Data: the Python standard "
            "library's own source files, or --data FILE. Every argument is checked before any "
            "rank starts; Ctrl-C stops every rank (exit status 130)."
        ),
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=2,
        metavar="N",
        help="pipeline ranks to spawn (default 2; under torchrun its WORLD_SIZE decides)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per step, at least 2N; they split --batch-size evenly (default "
        "4N, or the smallest divisor of --batch-size that is at least 2N: 8 for N=3)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="sequences per step, a multiple of --microbatches (default 16)",
    )
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers, at least 2N-2 so that every middle stage gets one "
        "(default max(4, 2N-2): 4 for N <= 3)",
    )
    p.add_argument(
        "--heads",
        type=int,
        default=4,
        help="attention heads; --hidden / --heads must be even (default 4)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=100,
        help="train until this global step (default 100)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="AdamW learning rate (default 3e-3; also applied to a resumed optimizer)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and data order (default 0)")
    p.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="a text file to train on (default: the Python standard library's *.py files)",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="FILE",
        help="write one JSON line per step here: step (global), loss, step_time_s, "
        "tokens_per_s (a resumed run keeps the rows up to its checkpoint and appends)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo) or cuda (NCCL, one GPU per rank) (default cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16 runs the stages under torch.autocast (default float32)",
    )
    p.add_argument(
        "--capture",
        choices=("none", "step", "action"),
        default="none",
        help="capture the step after one eager warmup step: CUDA graphs per step or per "
        "action on GPU, the static replay on CPU (default none)",
    )
    p.add_argument(
        "--no-kernels", action="store_true", help="plain torch ops instead of graphpipe.kernels"
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save the training state (weights, optimizer, step, RNG and data position) "
        "here with torch.distributed.checkpoint, as DIR/step-NNNNNNNN, after the last step "
        "and every --checkpoint-every steps",
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
        help="keep the newest K checkpoints in --checkpoint-dir (default 2)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint-dir (start from "
        "scratch if there is none); the model settings must be the checkpoint's",
    )
    p.set_defaults(func=run)
    return p


def _check(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, as a one-line message (None when fine).

    Fills in the defaults that depend on others (``microbatches``, ``layers``) and
    ``resume_from`` (the checkpoint to continue from, or None).
    """
    for name in ("ranks", "batch_size", "seq_len", "hidden", "heads", "steps", "keep_checkpoints"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in ("microbatches", "layers", "checkpoint_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    n = args.ranks
    m = args.microbatches
    if m is None:
        m = default_microbatches(n, args.batch_size)
    if m is None:
        return (
            f"--batch-size {args.batch_size} does not split into 2 * --ranks = {2 * n} or more "
            f"equal micro-batches; pass a --batch-size that is a multiple of {2 * n}"
        )
    if m < 2 * n:
        return f"--microbatches must be >= 2 * --ranks = {2 * n}, got {m}"
    if args.batch_size % m:
        return f"--batch-size {args.batch_size} does not split into {m} equal micro-batches"
    layers = args.layers if args.layers is not None else default_layers(n)
    if layers < 2 * n - 2:
        return (
            f"--layers {layers} is too few for --ranks {n}: every middle stage of the {2 * n} "
            f"stages needs a layer, so --layers must be >= {2 * n - 2}"
        )
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not a multiple of --heads {args.heads}"
    if (args.hidden // args.heads) % 2:
        return (
            f"--hidden {args.hidden} / --heads {args.heads} = {args.hidden // args.heads} must "
            "be even (rotary embeddings rotate pairs)"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr must be a positive number, got {args.lr}"
    problem = _check_files(args) or _check_device(args)
    if problem is not None:
        return problem
    args.microbatches, args.layers = m, layers
    return _check_checkpoints(args)


def _check_files(args: argparse.Namespace) -> str | None:
    if args.data is not None:
        if not os.path.isfile(args.data):
            return f"--data {args.data}: no such file"
        size = os.path.getsize(args.data)
        if size < args.seq_len + 1:
            return (
                f"--data {args.data} holds {size} bytes, fewer than --seq-len + 1 = "
                f"{args.seq_len + 1}"
            )
    if args.metrics is not None:
        parent = os.path.dirname(os.path.abspath(args.metrics))
        if os.path.isdir(args.metrics):
            return f"--metrics {args.metrics} is a directory; give a file name"
        if not os.path.isdir(parent):
            return f"--metrics {args.metrics}: directory {parent} does not exist"
    if args.checkpoint_dir is None:
        if args.checkpoint_every is not None:
            return "--checkpoint-every needs --checkpoint-dir"
        if args.resume:
            return "--resume needs --checkpoint-dir"
    elif os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        return f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory"
    return None


def _check_device(args: argparse.Namespace) -> str | None:
    if args.device != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"--device cuda: CUDA is not available to this torch ({torch.__version__})"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks))
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


def _model_settings(args: argparse.Namespace) -> dict[str, Any]:
    data = os.path.abspath(args.data) if args.data is not None else None
    return {**{k: getattr(args, k) for k in _RESUME_MUST_MATCH}, "data": data}


def _check_checkpoints(args: argparse.Namespace) -> str | None:
    from .checkpoint import checkpoint_info, latest_checkpoint

    args.resume_from, args.resume_step = None, 0
    if args.checkpoint_dir is None:
        return None
    latest = latest_checkpoint(args.checkpoint_dir)
    if latest is None:
        return None
    if not args.resume:
        return (
            f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (newest: "
            f"{latest.name}); pass --resume to continue from it, or choose another directory"
        )
    info = checkpoint_info(latest)
    if info["world_size"] != args.ranks:
        return (
            f"--resume: {latest} was saved by {info['world_size']} ranks, "
            f"this run has --ranks {args.ranks}"
        )
    saved, mine = info["meta"] or {}, _model_settings(args)
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


def run(args: argparse.Namespace) -> int:
    """``graphpipe train``: check the arguments, then spawn (or join torchrun's) ranks."""
    from .launch import joined_torchrun, launch

    if joined_torchrun():
        args.ranks = int(os.environ["WORLD_SIZE"])  # torchrun's world decides
    problem = _check(args)
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
    opts = {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
    launch(_train_rank, args.ranks, args.device, opts)
    return 0


def _exit_for_test(rank: int, step: int) -> None:
    """The ``GRAPHPIPE_TEST_EXIT=RANK:STEP`` hook (see the module docstring)."""
    spec = os.environ.get("GRAPHPIPE_TEST_EXIT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    want_rank, want_step = (int(x) for x in spec.split(":"))
    if (rank, step) == (want_rank, want_step):
        sys.stderr.flush()
        os._exit(1)


def _open_metrics(path: str, resumed_step: int) -> TextIO:
    """The metrics file, for appending: a resumed run keeps the rows up to its checkpoint."""
    if resumed_step == 0 or not os.path.exists(path):
        return open(path, "w")
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= resumed_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return open(path, "a")


def _train_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    from . import DualPipeV
    from .checkpoint import load_checkpoint, save_checkpoint
    from .data import ByteBatches, load_text_bytes
    from .models import LlamaConfig, LlamaLoss, build_stages, num_parameters, unique_parameters

    cfg = LlamaConfig(
        hidden=opts["hidden"],
        n_layers=opts["layers"],
        n_heads=opts["heads"],
        max_seq_len=opts["seq_len"],
        use_kernels=not opts["no_kernels"],
    )
    stages = build_stages(cfg, 2 * world, seed=opts["seed"], device=device)
    mine = {rank: stages[rank], 2 * world - 1 - rank: stages[2 * world - 1 - rank]}
    loss_fn = LlamaLoss(cfg.use_kernels)
    capture = False if opts["capture"] == "none" else opts["capture"]
    pipe = DualPipeV(
        tuple(mine.values()),
        num_microbatches=opts["microbatches"],
        loss_fn=loss_fn,
        capture=capture,
    )
    opt = torch.optim.AdamW(unique_parameters(mine.values()), lr=opts["lr"])
    batches = None
    extra: dict[str, Any] = {}
    if rank == 0:
        data = load_text_bytes(opts["data"])
        batches = iter(ByteBatches(data, opts["batch_size"], opts["seq_len"], seed=opts["seed"]))
        extra["data"] = batches
        print(
            f"graphpipe train: {world} ranks x 2 stages, {opts['layers']} layers, "
            f"{opts['microbatches']} micro-batches, {num_parameters(stages):,} parameters, "
            f"{len(data):,} bytes of {opts['data'] or 'Python stdlib source'}, "
            f"device {device.type}",
            file=sys.stderr,
            flush=True,
        )
    start = 0
    if opts["resume_from"] is not None:
        start = load_checkpoint(opts["resume_from"], mine, opt, extra=extra)
        for group in opt.param_groups:
            group["lr"] = opts["lr"]
        if rank == 0:
            print(
                f"graphpipe train: resumed from {opts['resume_from']} (step {start})",
                file=sys.stderr,
                flush=True,
            )
    every = opts["checkpoint_every"]
    meta = _model_settings(argparse.Namespace(**opts))

    def save(step: int) -> None:
        save_checkpoint(
            opts["checkpoint_dir"],
            step,
            mine,
            opt,
            extra=extra,
            keep=opts["keep_checkpoints"],
            meta=meta,
        )

    autocast = opts["dtype"] == "bfloat16"
    tokens = opts["batch_size"] * opts["seq_len"]
    progress = Progress(opts["steps"], first=start + 1) if rank == 0 else None
    out = _open_metrics(opts["metrics"], start) if rank == 0 and opts["metrics"] else None
    first = last = None
    try:
        for step in range(start + 1, opts["steps"] + 1):
            _exit_for_test(rank, step)
            x, y = next(batches) if batches is not None else (None, None)
            t0 = time.perf_counter()
            # A captured step accumulates into static .grad tensors: zero them in place.
            opt.zero_grad(set_to_none=capture is False)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = pipe.step(x, y)
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            value = float(loss)
            first = value if first is None else first
            last = value
            if out is not None:
                rec = {"step": step, "loss": value, "step_time_s": dt, "tokens_per_s": tokens / dt}
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if opts["checkpoint_dir"] and (step == opts["steps"] or (every and step % every == 0)):
                save(step)
            if progress is not None:
                progress.update(
                    step, f"loss {value:.3f} | {tokens / dt:,.0f} tok/s | {dt * 1e3:.0f} ms/step"
                )
    finally:
        pipe.close()
        if out is not None:
            out.close()
    if progress is not None:
        print(
            f"graphpipe train: steps {start + 1}-{opts['steps']} in "
            f"{_duration(progress.elapsed())}, loss {first:.3f} -> {last:.3f}",
            file=sys.stderr,
            flush=True,
        )
