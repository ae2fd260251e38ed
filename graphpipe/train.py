"""``graphpipe train``: train the built-in byte-level Llama with DualPipeV.

Every argument is checked before any rank starts (a bad one is a one-line error, exit status
2). Rank 0 shows a progress bar (loss, tokens/s, step time, ETA, total time at the end) and
writes ``--metrics`` as JSON lines: ``{"step", "loss", "step_time_s", "tokens_per_s"}`` with
the global step number, plus ``"dropped_tokens"`` with ``--experts`` (the (token, expert)
assignments past capacity in the step, over every MoE block of every rank; the loss then
includes the load-balancing term). ``--checkpoint-dir`` saves the training state with
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

__all__ = [
    "Progress",
    "RankRun",
    "add_model_options",
    "add_parser",
    "build_rank",
    "default_layers",
    "default_microbatches",
    "run",
]

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
    "dp",
    "experts",
    "top_k",
    "capacity_factor",
    "ep",
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
            "schedule. Without torchrun it spawns --ranks x --dp local processes (gloo on CPU, "
            "NCCL with --device cuda, one GPU per rank); under torchrun it joins torchrun's "
            "world (torchrun --nproc-per-node N -m graphpipe train ...). Data: the Python "
            "standard library's own source files, or --data FILE. Every argument is checked "
            "before any rank starts; Ctrl-C stops every rank (exit status 130)."
        ),
    )
    add_model_options(p)
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel replicas of the pipeline: world = ranks x dp, the batch is split "
        "across them (default 1)",
    )
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
        "tokens_per_s (a resumed run keeps the rows up to its checkpoint and appends)",
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


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model, data and pipeline options that ``train`` shares with ``profile``."""
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
        help="micro-batches per step, at least 2N; they split each replica's share of "
        "--batch-size evenly (default 4N, or the smallest divisor of that share that is at "
        "least 2N: 8 for N=3)",
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
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL, one GPU per rank (default cpu)",
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
    _add_moe_options(p)


def _add_moe_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument(
        "--experts", type=int, default=0, help="experts per MoE block; 0: dense (default 0)"
    )
    g.add_argument("--top-k", type=int, default=1, help="experts per token (default 1)")
    g.add_argument(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="slots per expert = ceil(C * tokens * k / experts) (default 1.25)",
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks: each MoE block's experts are sharded over --ep "
        "replicas, so --ep must divide --dp (default 1)",
    )


def _check_moe(args: argparse.Namespace) -> str | None:
    if args.experts < 0:
        return f"--experts must be >= 0, got {args.experts}"
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


def _moe_config(opts: dict) -> dict:
    """The ``LlamaConfig`` fields of the MoE options (none for a dense run)."""
    if not opts.get("experts"):
        return {}
    return {
        "num_experts": opts["experts"],
        "top_k": opts["top_k"],
        "capacity_factor": opts["capacity_factor"],
    }


def _check(args: argparse.Namespace) -> str | None:
    """The first problem with the model, data and device options, as a one-line message
    (None when fine); ``graphpipe profile`` uses it too.

    Fills in the defaults that depend on others (``microbatches``, ``layers``).
    """
    for name in ("ranks", "batch_size", "seq_len", "hidden", "heads"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in ("microbatches", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
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
    problem = _check_data(args) or _check_device(args) or _check_moe(args)
    if problem is not None:
        return problem
    args.microbatches, args.layers = m, layers
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
    if args.device != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"--device cuda: CUDA is not available to this torch ({torch.__version__})"
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


def _check_train(args: argparse.Namespace) -> str | None:
    """``_check`` plus what only ``graphpipe train`` has: steps, metrics, checkpoints.

    Also sets ``resume_from`` / ``resume_step`` (the checkpoint to continue from, or None / 0).
    """
    args.resume_from, args.resume_step = None, 0
    for name in ("steps", "keep_checkpoints"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        return f"--checkpoint-every must be >= 1, got {args.checkpoint_every}"
    problem = _check(args)
    if problem is not None:
        return problem
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
        return None
    if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        return f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory"
    return _check_checkpoints(args)


def _model_settings(args: argparse.Namespace) -> dict[str, Any]:
    data = os.path.abspath(args.data) if args.data is not None else None
    settings = {k: getattr(args, k, 1) for k in _RESUME_MUST_MATCH}
    return {**settings, "data": data}


def _check_checkpoints(args: argparse.Namespace) -> str | None:
    from .checkpoint import checkpoint_info, latest_checkpoint

    latest = latest_checkpoint(args.checkpoint_dir)
    if latest is None:
        return None
    if not args.resume:
        return (
            f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (newest: "
            f"{latest.name}); pass --resume to continue from it, or choose another directory"
        )
    info = checkpoint_info(latest)
    world = args.ranks * args.dp
    if info["world_size"] != world:
        return (
            f"--resume: {latest} was saved by {info['world_size']} ranks, "
            f"this run has --ranks {args.ranks}" + (f" x --dp {args.dp}" if args.dp > 1 else "")
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

    problem = None
    if joined_torchrun():  # torchrun's world decides: WORLD_SIZE = ranks x dp
        world = int(os.environ["WORLD_SIZE"])
        if args.dp < 1 or world % args.dp:
            problem = f"--dp {args.dp} does not divide WORLD_SIZE {world}"
        else:
            args.ranks = world // args.dp
    problem = problem or _check_train(args)
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
    launch(_train_rank, args.ranks * args.dp, args.device, opts)
    return 0


class RankRun:
    """One rank's training state (pipeline, AdamW, rank 0's batches) and its step, as
    ``graphpipe train`` runs it; ``graphpipe profile`` runs the same.

    ``stages``: this rank's stages by global stage index; ``loader``: the data iterator
    (``ByteBatchIterator``) on each replica's first pipeline rank, else None;
    ``share``: ``(d, D)``, this replica's index and the number of replicas (each takes the
    d-th ``1/D`` of every batch).
    """

    def __init__(
        self,
        pipe: Any,
        opt: torch.optim.Optimizer,
        loader: Any,
        opts: dict,
        device: torch.device,
        *,
        stages: dict[int, Any] | None = None,
        share: tuple[int, int] = (0, 1),
    ) -> None:
        self.pipe, self.opt, self.loader, self.device = pipe, opt, loader, device
        self.stages = stages or {}
        self.share = share
        self.capture = False if opts["capture"] == "none" else opts["capture"]
        self.autocast = opts["dtype"] == "bfloat16"

    def next_batch(self) -> tuple[Any, Any]:
        """The next ``(inputs, labels)`` on a replica's first rank, ``(None, None)`` elsewhere."""
        if self.loader is None:
            return None, None
        x, y = next(self.loader)
        d, dp = self.share
        if dp > 1:  # every replica draws the same global batches and takes its share
            rows = x.shape[0] // dp
            x, y = x[d * rows : (d + 1) * rows], y[d * rows : (d + 1) * rows]
        return x, y

    def step(self, x: Any, y: Any) -> torch.Tensor:
        """One training step: zero the gradients, ``pipe.step``, ``opt.step``; the loss."""
        # A captured step accumulates into static .grad tensors: zero them in place.
        self.opt.zero_grad(set_to_none=self.capture is False)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.pipe.step(x, y)
        self.opt.step()
        return loss

    def close(self) -> None:
        self.pipe.close()


def build_rank(
    rank: int, world: int, device: torch.device, opts: dict, prog: str = "graphpipe train"
) -> RankRun:
    """This rank's stages of the built-in model, its pipeline and optimizer, from the
    options of ``add_model_options``; rank 0 prints one line about the run as ``prog``.

    With ``opts["dp"] = D > 1`` the world is a ``("dp", "pp")`` mesh of D replicas of a
    ``world / D``-rank pipeline (global rank ``d * N + p``); each replica's first rank takes
    its ``1/D`` share of every batch."""
    from .data import ByteBatches, load_text_bytes
    from .models import LlamaConfig, LlamaLoss, build_stages, num_parameters, unique_parameters
    from .runtime.pipeline import DualPipeV

    opts = dict(opts)
    dp = opts.get("dp", 1)
    n, d, p = world // dp, rank // (world // dp), rank % (world // dp)
    groups = _mesh_groups(device, dp, n) if dp > 1 else {}
    ep_group = _expert_groups(opts, groups)
    if opts.get("microbatches") is None:
        opts["microbatches"] = default_microbatches(n, opts["batch_size"] // dp) or 4 * n
    if opts.get("layers") is None:
        opts["layers"] = default_layers(n)
    cfg = LlamaConfig(
        hidden=opts["hidden"],
        n_layers=opts["layers"],
        n_heads=opts["heads"],
        max_seq_len=opts["seq_len"],
        use_kernels=not opts["no_kernels"],
        **_moe_config(opts),
    )
    stages = build_stages(cfg, 2 * n, seed=opts["seed"], device=device, ep_group=ep_group)
    mine = {p: stages[p], 2 * n - 1 - p: stages[2 * n - 1 - p]}
    loss_fn = LlamaLoss(cfg.use_kernels)
    capture = False if opts["capture"] == "none" else opts["capture"]
    pipe = DualPipeV(
        tuple(mine.values()),
        num_microbatches=opts["microbatches"],
        loss_fn=loss_fn,
        capture=capture,
        **groups,
    )
    opt = torch.optim.AdamW(unique_parameters(mine.values()), lr=opts["lr"])
    loader = None
    if p == 0:
        data = load_text_bytes(opts["data"])
        loader = iter(ByteBatches(data, opts["batch_size"], opts["seq_len"], seed=opts["seed"]))
    if rank == 0:
        print(
            f"{prog}: {n} ranks x 2 stages"
            + (f" x {dp} replicas" if dp > 1 else "")
            + f", {opts['layers']} layers, {opts['microbatches']} micro-batches, "
            f"{num_parameters(stages):,} parameters, {len(data):,} bytes of "
            f"{opts['data'] or 'Python stdlib source'}, device {device.type}",
            file=sys.stderr,
            flush=True,
        )
    return RankRun(pipe, opt, loader, opts, device, stages=mine, share=(d, dp))


def _expert_groups(opts: dict, groups: dict) -> Any:
    """With experts and data parallelism: ``groups["expert_groups"]`` (``--ep`` carved out of
    the dp group, ``graphpipe.models.expert_parallel_groups``); returns the ep group."""
    if not opts.get("experts") or "dp_group" not in groups:
        return None
    from .models import expert_parallel_groups

    experts = expert_parallel_groups(opts.get("ep", 1), groups["dp_group"])
    groups["expert_groups"] = experts
    return experts.ep_group


def _mesh_groups(device: torch.device, dp: int, n: int) -> dict:
    """``group`` and ``dp_group`` of this rank in a ``("dp", "pp")`` mesh of ``dp`` x ``n``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dp, n), mesh_dim_names=("dp", "pp"))
    return {"group": mesh.get_group("pp"), "dp_group": mesh.get_group("dp")}


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


class _DroppedTokens:
    """The MoE blocks' dropped-token counters of this rank's stages: zeroed before each step
    (in place, so a captured step keeps counting into them), summed on the device over the
    step and over all ranks by one all-reduce, read on the host once per step."""

    def __init__(self, modules: Any, device: torch.device) -> None:
        self.modules, self.device, self.total = modules, device, 0

    def reset(self) -> None:
        from .models import reset_dropped_tokens

        reset_dropped_tokens(self.modules)

    def gather(self) -> None:
        import torch.distributed as dist

        from .models import dropped_tokens

        count = dropped_tokens(self.modules).to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
        self.total = int(count)


def _train_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    from .checkpoint import load_checkpoint, save_checkpoint

    run = build_rank(rank, world, device, opts)
    extra = {"data": run.loader} if run.loader is not None else {}
    start = 0
    if opts["resume_from"] is not None:
        start = load_checkpoint(opts["resume_from"], run.stages, run.opt, extra=extra)
        for group in run.opt.param_groups:
            group["lr"] = opts["lr"]
        if rank == 0:
            print(
                f"graphpipe train: resumed from {opts['resume_from']} (step {start})",
                file=sys.stderr,
                flush=True,
            )
    every = opts["checkpoint_every"]
    meta = _model_settings(argparse.Namespace(**opts))
    tokens = opts["batch_size"] * opts["seq_len"]
    progress = Progress(opts["steps"], first=start + 1) if rank == 0 else None
    out = _open_metrics(opts["metrics"], start) if rank == 0 and opts["metrics"] else None
    first = last = None
    drops = _DroppedTokens(run.pipe.modules, device) if opts.get("experts") else None
    try:
        for step in range(start + 1, opts["steps"] + 1):
            _exit_for_test(rank, step)
            x, y = run.next_batch()
            if drops is not None:
                drops.reset()
            t0 = time.perf_counter()
            loss = run.step(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            value = float(loss)
            first = value if first is None else first
            last = value
            if drops is not None and opts["metrics"]:
                drops.gather()  # every rank: one all-reduce, read once on rank 0
            if out is not None:
                rec = {"step": step, "loss": value, "step_time_s": dt, "tokens_per_s": tokens / dt}
                if drops is not None:
                    rec["dropped_tokens"] = drops.total
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if opts["checkpoint_dir"] and (step == opts["steps"] or (every and step % every == 0)):
                save_checkpoint(
                    opts["checkpoint_dir"],
                    step,
                    run.stages,
                    run.opt,
                    extra=extra,
                    keep=opts["keep_checkpoints"],
                    meta=meta,
                )
            if progress is not None:
                progress.update(
                    step, f"loss {value:.3f} | {tokens / dt:,.0f} tok/s | {dt * 1e3:.0f} ms/step"
                )
    finally:
        run.close()
        if out is not None:
            out.close()
    if progress is not None:
        print(
            f"graphpipe train: steps {start + 1}-{opts['steps']} in "
            f"{_duration(progress.elapsed())}, loss {first:.3f} -> {last:.3f}",
            file=sys.stderr,
            flush=True,
        )
