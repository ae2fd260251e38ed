"""Timing: timed steps, interleaved rounds, the loss check, statistics and one recorded step's
per-action timeline."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.nvtx import Ranges

from .modes import Mode

__all__ = [
    "RangeClock",
    "control_group",
    "interleaved",
    "loss_check",
    "max_over_ranks",
    "record_timeline",
    "spread",
    "sync",
    "timed_rounds",
    "timed_step",
    "wall_time",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def control_group(group: Any) -> Any:
    """A gloo group over ``group``'s ranks for the benchmark's barriers and gathers."""
    return group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo")


def wall_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of ``fn()`` (on CUDA, synchronized at both ends)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def timed_step(mode: Mode, x: Any, y: Any, ctrl: Any, device: torch.device) -> float:
    """One step of ``mode``: gradients reset untimed, then a barrier, then the timed step."""
    mode.zero_grad()
    sync(device)
    dist.barrier(group=ctrl)
    return wall_time(lambda: mode.run_step(x, y), device)


def interleaved(
    contenders: Mapping[str, Callable[[], float]],
    rounds: int,
    warmup: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """A/B/...: per round every contender once (each returns its own time), the order
    rotating by round; the first ``warmup`` rounds are not kept."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    total = warmup + rounds
    every = max(1, total // 4)
    for i in range(total):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            dt = contenders[name]()
            if i >= warmup:
                times[name].append(dt)
        if progress is not None and ((i + 1) % every == 0 or i + 1 == total):
            progress(f"round {i + 1}/{total} ({warmup} warmup)")
    return times


def timed_rounds(
    modes: Sequence[Mode],
    x: Any,
    y: Any,
    steps: int,
    warmup: int,
    ctrl: Any,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """``interleaved`` ``timed_step``s of every mode: this rank's step times."""
    contenders = {m.name: partial(timed_step, m, x, y, ctrl, device) for m in modes}
    return interleaved(contenders, steps, warmup, progress)


def spread(times: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and max."""
    ts = sorted(times)
    if len(ts) >= 2:
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
    else:
        q1 = q3 = ts[0]
    return {
        "median_s": statistics.median(ts),
        "q1_s": q1,
        "q3_s": q3,
        "min_s": ts[0],
        "max_s": ts[-1],
    }


def max_over_ranks(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per mode, per step: the slowest rank's time (the step ends when the last rank does)."""
    return {
        name: [max(ts) for ts in zip(*(r[name] for r in per_rank), strict=True)]
        for name in per_rank[0]
    }


def _max_rel_grad_diff(ref: Mode, mode: Mode) -> tuple[float, str]:
    """The largest gradient difference relative to the reference's largest entry, and where."""
    worst, where = 0.0, ""
    for ma, mb in zip(ref.modules, mode.modules, strict=True):
        for (name, a), (_, b) in zip(ma.named_parameters(), mb.named_parameters(), strict=True):
            if a.grad is None or b.grad is None:
                if (a.grad is None) != (b.grad is None):
                    worst, where = math.inf, f"{name} (gradient missing in one)"
                continue
            ga, gb = a.grad.detach(), b.grad.detach()
            scale = float(ga.abs().max()) or 1.0
            d = float((ga - gb).abs().max()) / scale
            if d > worst:
                worst, where = d, name
    return worst, where


def loss_check(
    modes: Sequence[Mode], x: Any, y: Any, rank: int, ctrl: Any, grads: bool
) -> dict[str, Any]:
    """One step per mode on the same weights; losses (and gradients) against graphpipe eager."""
    losses: dict[str, float] = {}
    for mode in modes:
        loss = mode.step(x, y)
        if rank == 0 and loss is not None:
            losses[mode.name] = float(loss.detach())
    ref = modes[0]
    grad_diff = {m.name: _max_rel_grad_diff(ref, m) for m in modes[1:]} if grads else {}
    gathered: list[Any] = [None] * dist.get_world_size(ctrl)
    dist.all_gather_object(gathered, grad_diff, group=ctrl)
    out: dict[str, Any] = {"reference": ref.name, "reference_loss": losses.get(ref.name)}
    for mode in modes[1:]:
        entry: dict[str, Any] = {"loss": losses.get(mode.name)}
        if mode.name in losses and ref.name in losses:
            entry["abs_diff"] = abs(losses[mode.name] - losses[ref.name])
        if grads:
            per_rank = [g[mode.name] for g in gathered]
            worst = max(per_rank, key=lambda t: t[0])
            entry["max_rel_grad_diff"] = worst[0]
            entry["worst_param"] = f"rank {per_rank.index(worst)} {worst[1]}" if worst[0] else ""
        out[mode.name] = entry
    return out


class RangeClock(Ranges):
    """Stands in for the executor's range emitter (``DualPipeV.ranges``) for one step and
    records every range (``step``, ``3F5``, ``(0F5;7B2)OVERLAP_F_B``) with its wall times."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        super().__init__(use_nvtx=False)
        self.records: list[tuple[str, float, float]] = []

    def push(self, name: str) -> None:
        self._stack.append((name, time.perf_counter()))

    def pop(self) -> None:
        name, start = self._stack.pop()
        self.records.append((name, start, time.perf_counter()))


def record_timeline(
    mode: Mode, x: Any, y: Any, rank: int, device: torch.device, ctrl: Any
) -> list[dict[str, Any]]:
    """One untimed step of a graphpipe mode with per-action wall times, in seconds from a
    common barrier."""
    pipe = mode.pipe
    clock = RangeClock()
    saved = pipe.ranges
    mode.zero_grad()
    sync(device)
    dist.barrier(group=ctrl)
    t0 = time.perf_counter()
    pipe.ranges = clock
    try:
        mode.run_step(x, y)
    finally:
        pipe.ranges = saved
    return [
        {"rank": rank, "label": name, "start": s - t0, "end": e - t0}
        for name, s, e in clock.records
    ]
