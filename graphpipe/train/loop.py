"""One rank of ``graphpipe train``: its pipeline, optimizer and batches, and its training loop.

Owns: ``RankRun`` (one rank's training state and step, which ``graphpipe profile`` runs too),
``build_rank`` (the built-in model's stages of this rank, the ``DualPipeV`` pipeline on a
``("dp", "pp")`` mesh, AdamW, the data) and ``train_rank`` (the loop that ``launch`` runs on
every rank: resume, steps, metrics, checkpoints, progress, the stop at a non-finite loss).
Uses only the public pipeline API.

Test hook (not a user option): ``GRAPHPIPE_TEST_EXIT=RANK:STEP`` makes rank RANK exit with
status 1 (``os._exit``, no cleanup, like a killed process) when it is about to run step STEP,
on the first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` unset or 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import torch

from graphpipe.cmdline.launch import RunStopped

from .options import default_layers, default_microbatches
from .progress import (
    DroppedTokens,
    Progress,
    checkpoint_dirs,
    duration,
    open_metrics,
    save_lines,
)
from .resume import load_resumed, model_settings

__all__ = ["RankRun", "build_rank", "train_rank"]


def _moe_config(opts: dict) -> dict:
    """The ``LlamaConfig`` fields of the MoE options (none for a dense run)."""
    if not opts.get("experts"):
        return {}
    return {
        "num_experts": opts["experts"],
        "top_k": opts["top_k"],
        "capacity_factor": opts["capacity_factor"],
    }


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
    from graphpipe.data import ByteBatches, load_text_bytes
    from graphpipe.models import (
        LlamaConfig,
        LlamaLoss,
        build_stages,
        num_parameters,
        unique_parameters,
    )
    from graphpipe.runtime.pipeline import DualPipeV

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
    stages = build_stages(
        cfg,
        2 * n,
        seed=opts["seed"],
        device=device,
        ep_group=ep_group,
        layers_per_stage=opts.get("layers_per_stage"),
    )
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
            + f", {opts['layers']} layers{_split_note(opts)}, {opts['microbatches']} "
            "micro-batches, "
            f"{num_parameters(stages):,} parameters, {len(data):,} bytes of "
            f"{opts['data'] or 'Python stdlib source'}, device {device.type}",
            file=sys.stderr,
            flush=True,
        )
    return RankRun(pipe, opt, loader, opts, device, stages=mine, share=(d, dp))


def _split_note(opts: dict) -> str:
    """`` (2,4,4,2 per stage)`` for a chosen split that is not the even one, else nothing."""
    from graphpipe.schedule.splits import layers_per_stage

    counts = opts.get("layers_per_stage")
    if counts is None or list(counts) == layers_per_stage(opts["layers"], len(counts)):
        return ""
    return f" ({','.join(map(str, counts))} per stage)"


def _expert_groups(opts: dict, groups: dict) -> Any:
    """With experts and data parallelism: ``groups["expert_groups"]`` (``--ep`` carved out of
    the dp group, ``graphpipe.models.expert_parallel_groups``); returns the ep group."""
    if not opts.get("experts") or "dp_group" not in groups:
        return None
    from graphpipe.models import expert_parallel_groups

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


class _NonFinite:
    """The non-finite losses of a run. The pipeline returns the same loss on every rank (the
    mean over micro-batches and replicas), so every rank sees the same steps here and stops
    at the same one: before that step's metrics row and checkpoint."""

    def __init__(self, allow: bool) -> None:
        self.allow, self.count, self.first = allow, 0, None

    def seen(self, step: int, value: float, progress: Progress | None) -> None:
        """Step ``step``'s loss is ``value`` (NaN or infinite): stop the run, or count it."""
        self.count += 1
        self.first = step if self.first is None else self.first
        if self.allow:
            return
        if progress is not None:
            progress.end_line()
        raise RunStopped(
            f"the loss of step {step} is {value}; stopping (--allow-nonfinite trains on)"
        )

    def __str__(self) -> str:
        """For the summary line: how many steps were not finite, if any."""
        if not self.count:
            return ""
        return f" ({self.count} non-finite step(s), the first at step {self.first})"


def train_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    """``graphpipe train`` on one rank (what ``launch`` runs): resume if asked, then train to
    ``--steps``, saving checkpoints; rank 0 writes the metrics and shows the progress."""
    from graphpipe.checkpoint import save_checkpoint

    run = build_rank(rank, world, device, opts)
    extra = {"data": run.loader} if run.loader is not None else {}
    start = load_resumed(run, opts, rank, extra)
    every = opts["checkpoint_every"]
    meta = model_settings(argparse.Namespace(**opts))
    tokens = opts["batch_size"] * opts["seq_len"]
    progress = Progress(opts["steps"], first=start + 1) if rank == 0 else None
    out = open_metrics(opts["metrics"], start) if rank == 0 and opts["metrics"] else None
    first = last = None
    nonfinite = _NonFinite(opts.get("allow_nonfinite", False))
    drops = DroppedTokens(run.pipe.modules, device) if opts.get("experts") else None
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
            value = float(loss)  # the step's one host read of the loss, on every rank
            if not math.isfinite(value):
                nonfinite.seen(step, value, progress)
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
                root = opts["checkpoint_dir"]
                before = checkpoint_dirs(root) if progress is not None else {}
                path = save_checkpoint(
                    root,
                    step,
                    run.stages,
                    run.opt,
                    extra=extra,
                    keep=opts["keep_checkpoints"],
                    meta=meta,
                    resumed_from=opts["resume_from"],
                )
                if progress is not None:  # every rank has finished the save and its removals
                    skipped = opts.get("resume_skipped") or {}
                    after = checkpoint_dirs(root)
                    for line in save_lines(path, before, after, skipped, opts["keep_checkpoints"]):
                        progress.note(line)
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
            f"{duration(progress.elapsed())}, loss {first:.3f} -> {last:.3f}{nonfinite}",
            file=sys.stderr,
            flush=True,
        )
