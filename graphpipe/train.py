"""``graphpipe train``: train the built-in byte-level Llama with DualPipeV.

Rank 0 shows a progress bar (loss, tokens/s, step time) and writes ``--metrics`` as JSON
lines: ``{"step", "loss", "step_time_s", "tokens_per_s"}``, plus ``"dropped_tokens"`` with
``--experts`` (the (token, expert) assignments past capacity in the step, over every MoE
block of every rank; the loss then includes the load-balancing term).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

import torch

__all__ = ["RankRun", "add_model_options", "add_parser", "build_rank", "run"]


class Progress:
    """A one-line progress bar on a terminal; plain lines every ``every`` steps elsewhere."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, every: int = 10) -> None:
        self.total, self.stream, self.every = total, stream, every
        self.tty = stream.isatty()

    def update(self, step: int, text: str) -> None:
        width = 24
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {text}"
        if self.tty:
            self.stream.write("\r" + line)
            if step == self.total:
                self.stream.write("\n")
        elif step == 1 or step % self.every == 0 or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train the built-in byte-level Llama with DualPipeV",
        description=(
            "Train graphpipe's built-in Llama-style byte-level model with the DualPipeV "
            "schedule. Without torchrun it spawns --ranks local processes (gloo on CPU, NCCL "
            "with --device cuda, one GPU per rank); under torchrun it joins torchrun's world. "
            "Data: the Python standard library's own source files, or --data FILE."
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
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--metrics", default=None, help="write per-step metrics here (JSON lines)")
    p.set_defaults(func=run)
    return p


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model, data and pipeline options that ``train`` shares with ``profile``."""
    p.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="pipeline ranks to spawn (default 2; ignored under torchrun)",
    )
    p.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches per step (default 4N)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="weights and data order (default 0)")
    p.add_argument("--data", default=None, help="a text file to train on (default: stdlib)")
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
        help="bfloat16 runs the stages under torch.autocast",
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
    """The first problem with the arguments, as a one-line message (None when fine)."""
    for name in ("ranks", "batch_size", "seq_len", "hidden", "layers", "heads", "steps"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    dp = getattr(args, "dp", 1)
    if dp < 1:
        return f"--dp must be >= 1, got {dp}"
    m = args.microbatches if args.microbatches is not None else 4 * args.ranks
    if m < 2 * args.ranks:
        return f"--microbatches must be >= 2 * --ranks = {2 * args.ranks}, got {m}"
    if args.batch_size % (dp * m):
        per = f" on each of --dp {dp} replicas" if dp > 1 else ""
        return f"--batch-size {args.batch_size} does not split into {m} equal micro-batches{per}"
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not a multiple of --heads {args.heads}"
    if args.data is not None and not os.path.isfile(args.data):
        return f"--data {args.data}: no such file"
    problem = _check_moe(args)
    if problem is not None:
        return problem
    args.microbatches = m
    return None


def run(args: argparse.Namespace) -> int:
    from .launch import joined_torchrun, launch

    if joined_torchrun():  # torchrun's world decides: WORLD_SIZE = ranks x dp
        world = int(os.environ["WORLD_SIZE"])
        if world % args.dp:
            print(
                f"graphpipe train: error: --dp {args.dp} does not divide WORLD_SIZE {world}",
                file=sys.stderr,
            )
            return 2
        args.ranks = world // args.dp
    problem = _check(args)
    if problem is not None:
        print(f"graphpipe train: error: {problem}", file=sys.stderr)
        return 2
    launch(_train_rank, args.ranks * args.dp, args.device, vars(args).copy())
    return 0


class RankRun:
    """One rank's training state (pipeline, AdamW, rank 0's batches) and its step, as
    ``graphpipe train`` runs it; ``graphpipe profile`` runs the same."""

    def __init__(
        self, pipe: Any, opt: torch.optim.Optimizer, batches: Any, opts: dict, device: torch.device
    ) -> None:
        self.pipe, self.opt, self.batches, self.device = pipe, opt, batches, device
        self.capture = False if opts["capture"] == "none" else opts["capture"]
        self.autocast = opts["dtype"] == "bfloat16"

    def next_batch(self) -> tuple[Any, Any]:
        """The next ``(inputs, labels)`` on rank 0, ``(None, None)`` elsewhere."""
        return next(self.batches) if self.batches is not None else (None, None)

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
    from . import DualPipeV
    from .data import ByteBatches, load_text_bytes
    from .models import LlamaConfig, LlamaLoss, build_stages, num_parameters, unique_parameters

    opts = dict(opts)
    dp = opts.get("dp", 1)
    n, d, p = world // dp, rank // (world // dp), rank % (world // dp)
    groups = _mesh_groups(device, dp, n) if dp > 1 else {}
    ep_group = _expert_groups(opts, groups)
    if opts.get("microbatches") is None:
        opts["microbatches"] = 4 * n
    cfg = LlamaConfig(
        hidden=opts["hidden"],
        n_layers=opts["layers"],
        n_heads=opts["heads"],
        max_seq_len=opts["seq_len"],
        use_kernels=not opts["no_kernels"],
        **_moe_config(opts),
    )
    stages = build_stages(cfg, 2 * n, seed=opts["seed"], device=device, ep_group=ep_group)
    mine = (stages[p], stages[2 * n - 1 - p])
    loss_fn = LlamaLoss(cfg.use_kernels)
    capture = False if opts["capture"] == "none" else opts["capture"]
    pipe = DualPipeV(
        mine, num_microbatches=opts["microbatches"], loss_fn=loss_fn, capture=capture, **groups
    )
    params = unique_parameters(mine)
    opt = torch.optim.AdamW(params, lr=opts["lr"])
    batches = None
    if p == 0:
        data = load_text_bytes(opts["data"])
        batches = iter(ByteBatches(data, opts["batch_size"], opts["seq_len"], seed=opts["seed"]))
        if dp > 1:  # every replica draws the same global batches and takes its share
            share = opts["batch_size"] // dp
            batches = (
                (x[d * share : (d + 1) * share], y[d * share : (d + 1) * share]) for x, y in batches
            )
    if rank == 0:
        print(
            f"{prog}: {n} ranks x 2 stages"
            + (f" x {dp} replicas" if dp > 1 else "")
            + f", {opts['microbatches']} micro-batches, "
            f"{num_parameters(stages):,} parameters, {len(data):,} bytes of "
            f"{opts['data'] or 'Python stdlib source'}, device {device.type}",
            file=sys.stderr,
            flush=True,
        )
    return RankRun(pipe, opt, batches, opts, device)


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
    run = build_rank(rank, world, device, opts)
    tokens = opts["batch_size"] * opts["seq_len"]
    progress = Progress(opts["steps"]) if rank == 0 else None
    out = open(opts["metrics"], "w") if rank == 0 and opts["metrics"] else None
    first = last = None
    drops = _DroppedTokens(run.pipe.modules, device) if opts.get("experts") else None
    try:
        for step in range(1, opts["steps"] + 1):
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
            if progress is not None:
                progress.update(
                    step, f"loss {value:.3f} | {tokens / dt:,.0f} tok/s | {dt * 1e3:.0f} ms/step"
                )
            if drops is not None and opts["metrics"]:
                drops.gather()  # every rank: one all-reduce, read once on rank 0
            if out is not None:
                rec = {"step": step, "loss": value, "step_time_s": dt, "tokens_per_s": tokens / dt}
                if drops is not None:
                    rec["dropped_tokens"] = drops.total
                out.write(json.dumps(rec) + "\n")
                out.flush()
    finally:
        run.close()
        if out is not None:
            out.close()
    if rank == 0:
        print(f"graphpipe train: loss {first:.3f} -> {last:.3f}", file=sys.stderr, flush=True)
