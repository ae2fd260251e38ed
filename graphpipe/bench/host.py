"""Host overhead per action: trivial stages, so that a step is the scheduler's own work (and,
across ranks, the P2P)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .measure import interleaved, timed_rounds, wall_time
from .modes import MODE_EAGER, MODE_REPLAY, MODE_TORCH, build_modes
from .regimes import host_workload

__all__ = ["host_overhead"]

_BARE = "bare loop, nn.Linear"
_BARE_DEFERRABLE = "bare loop, DeferrableLinear"


def _bare_loop(
    stages: tuple[nn.Module, ...], loss_fn: Callable, xs: list, ys: list
) -> Callable[[], None]:
    """The stage calls of a one-rank pipeline step without a scheduler: per micro-batch the
    two forwards (stage 1 on a detached leaf), the loss, and two autograd backwards."""
    s0, s1 = stages
    inv_m = 1.0 / len(xs)

    def run() -> None:
        for m in stages:
            m.zero_grad(set_to_none=True)
        for x, y in zip(xs, ys, strict=True):
            h = s0(x)
            h_leaf = h.detach().requires_grad_()
            loss = loss_fn(s1(h_leaf), y) * inv_m
            loss.backward()
            torch.autograd.backward(h, h_leaf.grad)

    return run


def _one_rank(device: torch.device, group: Any, steps: int, warmup: int, m: int) -> dict:
    """A one-rank pipeline (both stages local, no P2P) on ``group`` (this rank alone):
    graphpipe eager and torch's schedule against plain loops of the same stage calls."""
    from graphpipe.schedule.generators import dualpipev
    from graphpipe.weightgrad import WeightGradStore, make_deferrable

    w = host_workload(m, "host-1rank")
    loss_fn = w.loss_fn()
    x, y = w.batch(device)
    xs, ys = list(x.chunk(w.microbatches)), list(y.chunk(w.microbatches))
    modes, skipped = build_modes(w, 0, 1, device, group, only=(MODE_EAGER, MODE_TORCH))
    deferrable = w.local_stages(0, 1, device)
    for stage in deferrable:
        make_deferrable(stage, WeightGradStore())
    runs: dict[str, Callable[[], Any]] = {
        **{mode.name: partial(mode.step, x, y) for mode in modes},
        _BARE: _bare_loop(w.local_stages(0, 1, device), loss_fn, xs, ys),
        _BARE_DEFERRABLE: _bare_loop(deferrable, loss_fn, xs, ys),
    }
    reps = max(10 * steps, 50)  # trivial stages make each rep short: many of them stay cheap
    times = interleaved({k: partial(wall_time, fn, device) for k, fn in runs.items()}, reps, warmup)
    for mode in modes:
        mode.close()
    cells = len(dualpipev(1, w.microbatches)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    bare, bare_def = med[_BARE], med[_BARE_DEFERRABLE]
    return {
        "workload": asdict(w),
        "compute_cells": cells,
        "step_times_s": times,
        "median_s": med,
        "executor_overhead_per_action_s": (med[MODE_EAGER] - bare_def) / cells,
        "graphpipe_overhead_per_action_s": (med[MODE_EAGER] - bare) / cells,
        "wsplit_linear_overhead_per_action_s": (bare_def - bare) / cells,
        # None where torch's schedule could not run here (``skipped`` says why)
        "torch_overhead_per_action_s": (
            (med[MODE_TORCH] - bare) / cells if MODE_TORCH in med else None
        ),
        "skipped": skipped,
    }


def host_overhead(
    rank: int,
    world: int,
    device: torch.device,
    group: Any,
    ctrl: Any,
    steps: int,
    warmup: int,
    microbatches: int,
) -> dict[str, Any]:
    """Per-action host overhead with trivial stages: (a) the whole world, everything but
    compute, P2P included (this rank's step times); (b) on rank 0, a one-rank pipeline."""
    from graphpipe.schedule.generators import dualpipev

    w = host_workload(microbatches)
    modes, _ = build_modes(
        w, rank, world, device, group, only=(MODE_EAGER, MODE_REPLAY, MODE_TORCH)
    )
    x, y = w.batch(device)
    xs, ys = (x, y) if rank == 0 else (None, None)
    times = timed_rounds(modes, xs, ys, steps, warmup, ctrl, device)
    for m in modes:
        m.close()
    out: dict[str, Any] = {
        "world": {
            "workload": asdict(w),
            "compute_cells_per_rank": max(
                len(a) for a in dualpipev(world, w.microbatches).values()
            ),
            "step_times_s": times,
        }
    }
    solo = dist.new_group([dist.get_global_rank(group, 0)])
    if rank == 0:
        out["one_rank"] = _one_rank(device, solo, steps, warmup, microbatches)
    dist.barrier(group=ctrl)
    return out
