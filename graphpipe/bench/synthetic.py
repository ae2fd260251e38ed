"""``graphpipe bench --regime synthetic``: measure the schedule, not the machine.

Stages whose actions take fixed times: a forward sleeps ``F``, a full backward ``B``, an
input-gradient backward ``I`` and defers a weight-gradient closure that sleeps ``W`` (through
the stage's ``WeightGradStore``, like a real weight-gradient GEMM), an overlapped F&B pair
``FB`` (the stage's ``overlapped_forward_backward`` hook), all in milliseconds. Sleeps need no
cores, so the ranks may outnumber the cores; what remains is the runtime itself: its host
work, its P2P latency, and whether it lets each action start as soon as its data is there.

The ideal is the dataflow makespan of the same schedule with the same costs
(``graphpipe.schedule.simulate.dataflow``, no P2P latency); a runtime that hides its communication
and adds little host work per action comes within a few percent of it. The machine's own
P2P latency (half the median round trip of a one-float message between ranks 0 and 1, gloo
on CPU) is measured first, and a second ideal adds it to every message
(``ideal_with_p2p_step_s``): what is left above that one is the runtime's host work.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.schedule.simulate import Costs, dataflow

from .options import SYNTHETIC_COSTS

__all__ = ["SYNTHETIC_COSTS", "SleepStage", "synthetic_main", "synthetic_rank", "synthetic_row"]


_SPIN_S = 0.0003  # the last 0.3 ms of a sleep is a busy wait (see _sleep)


def _sleep(ms: float) -> None:
    """Sleep ``ms`` milliseconds, precisely: ``time.sleep`` wakes late, the more so the busier
    the machine (docs/benchmarks.md), and the overshoot would be charged to the runtime; the
    last ``_SPIN_S`` is spent spinning on the clock instead."""
    deadline = time.perf_counter() + ms / 1e3
    if ms / 1e3 > _SPIN_S:
        time.sleep(ms / 1e3 - _SPIN_S)
    while time.perf_counter() < deadline:
        pass


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, stage):  # type: ignore[override]
        ctx.stage = stage
        if not stage.in_pair:
            _sleep(stage.ms.F)
        return x + weight

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        stage: SleepStage = ctx.stage
        if stage.store is not None and stage.store.defer(stage.deferred_weight_grad, g):
            _sleep(stage.ms.I)
            return g, None, None
        _sleep(stage.ms.overlap if stage.in_pair else stage.ms.B)
        return g, g.sum().reshape(1), None


class SleepStage(nn.Module):
    """A stage whose F, B, I, W and F&B pair take ``ms`` (a ``Costs`` in milliseconds)."""

    def __init__(self, ms: Costs) -> None:
        super().__init__()
        self.ms = ms
        self.weight = nn.Parameter(torch.zeros(1))
        self.store: Any = None
        self.in_pair = False

    def bind_weight_grad_store(self, store: Any) -> None:
        """graphpipe's extension point for layers with deferrable weight gradients."""
        self.store = store

    def deferred_weight_grad(self, g: torch.Tensor) -> None:
        """The W of one I: sleeps W and accumulates the weight's gradient."""
        _sleep(self.ms.W)
        grad = g.sum().reshape(1)
        self.weight.grad = grad if self.weight.grad is None else self.weight.grad + grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepFn.apply(x, self.weight, self)

    @staticmethod
    def overlapped_forward_backward(fmod, inputs, bmod, outputs, grads):
        """The pair takes ``FB``: its forward does not sleep, its backward sleeps FB."""
        fmod.in_pair = bmod.in_pair = True
        try:
            y = fmod(*inputs)
            torch.autograd.backward(list(outputs), list(grads))
        finally:
            fmod.in_pair = bmod.in_pair = False
        return y


class PlainSleepStage(SleepStage):
    """A ``SleepStage`` without the overlap hook: a pair runs F then B (FB = F + B)."""

    overlapped_forward_backward = None  # type: ignore[assignment]


def synthetic_row(
    schedule: str,
    ranks: int,
    microbatches: int,
    ms: Costs,
    step_times_s: list[float],
    p2p_s: float = 0.0,
) -> dict[str, Any]:
    """One result row: the measured median step against the dataflow ideal (and the ideal
    with ``p2p_s`` seconds of latency per message)."""
    from graphpipe.schedule.generators import SCHEDULES

    built, placement = SCHEDULES[schedule](ranks, microbatches)
    ideal = dataflow(built, placement, Costs(**{**_asdict(ms), "p2p": 0.0}))
    with_p2p = dataflow(built, placement, Costs(**{**_asdict(ms), "p2p": p2p_s * 1e3}))
    measured = statistics.median(step_times_s)
    ideal_s = ideal.makespan / 1e3
    with_p2p_s = with_p2p.makespan / 1e3
    return {
        "schedule": schedule,
        "ranks": ranks,
        "microbatches": microbatches,
        "costs_ms": _asdict(ms),
        "measured_step_s": measured,
        "ideal_step_s": ideal_s,
        "measured_over_ideal": measured / ideal_s,
        "p2p_latency_s": p2p_s,
        "ideal_with_p2p_step_s": with_p2p_s,
        "measured_over_ideal_with_p2p": measured / with_p2p_s,
        "ideal_max_idle_s": max(r.idle for r in ideal.ranks) / 1e3,
        "measured_max_idle_s": measured - min(r.busy for r in ideal.ranks) / 1e3,
        "step_times_s": step_times_s,
    }


def _asdict(c: Costs) -> dict[str, Any]:
    return {"F": c.F, "B": c.B, "I": c.I, "W": c.W, "FB": c.FB, "p2p": c.p2p}


def p2p_latency(rank: int, world: int, reps: int = 50) -> float:
    """Half the median round trip of a one-float message between ranks 0 and 1, seconds, on
    every rank (0 on one rank)."""
    if world < 2:
        return 0.0
    buf = torch.zeros(1)
    halves = []
    for i in range(reps + 5):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(buf, 1)
            dist.recv(buf, 1)
            if i >= 5:
                halves.append((time.perf_counter() - t0) / 2)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    latency = torch.tensor(statistics.median(halves) if rank == 0 else 0.0, dtype=torch.float64)
    dist.broadcast(latency, 0)
    return latency.item()


def synthetic_rank(rank: int, world: int, device: torch.device, opts: dict) -> list[dict]:
    """Run every requested schedule on this rank; rank 0 returns the rows."""
    from graphpipe.runtime.pipeline import Pipeline
    from graphpipe.schedule.generators import SCHEDULES

    ms: Costs = opts["costs"]
    rows = []
    group = dist.group.WORLD if world > 1 else None
    latency = p2p_latency(rank, world)
    for name in opts["schedules"]:
        kind = SCHEDULES[name]
        m = opts.get("microbatches") or 4 * world
        cls = SleepStage if ms.FB is not None else PlainSleepStage
        stages = [cls(ms) for _ in kind.placement(world).stages_of(rank)]
        pipe = Pipeline(
            stages, schedule=name, num_microbatches=m, loss_fn=_loss, group=group, costs=ms
        )
        x = torch.zeros(m, 1)
        times = []
        for i in range(opts["warmup"] + opts["steps"]):
            for s in stages:
                s.weight.grad = None
            if group is not None:
                dist.barrier(group=group)
            t0 = time.perf_counter()
            pipe.step(x if pipe.is_input_rank else None, x if pipe.is_loss_rank else None)
            elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            if group is not None:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if i >= opts["warmup"]:
                times.append(elapsed.item())
        pipe.close()
        rows.append(synthetic_row(name, world, m, ms, times, latency))
    return rows if rank == 0 else []


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).sum()


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as a table, milliseconds."""
    lines = [
        f"{'schedule':<10} {'ranks':>5} {'M':>3} {'measured':>10} {'ideal':>10} {'ratio':>6} "
        f"{'max idle':>9} {'ideal idle':>10} {'ideal+p2p':>10} {'ratio':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['schedule']:<10} {r['ranks']:>5} {r['microbatches']:>3} "
            f"{r['measured_step_s'] * 1e3:>10.1f} {r['ideal_step_s'] * 1e3:>10.1f} "
            f"{r['measured_over_ideal']:>6.3f} {r['measured_max_idle_s'] * 1e3:>9.1f} "
            f"{r['ideal_max_idle_s'] * 1e3:>10.1f} {r['ideal_with_p2p_step_s'] * 1e3:>10.1f} "
            f"{r['measured_over_ideal_with_p2p']:>6.3f}"
        )
    return "\n".join(lines)


def synthetic_main(rank: int, world: int, device: torch.device, opts: dict) -> None:
    """``graphpipe bench --regime synthetic`` on one rank: rank 0 prints and writes JSON."""
    import json
    import sys
    from pathlib import Path

    rows = synthetic_rank(rank, world, device, opts)
    if rank != 0:
        return
    ms: Costs = opts["costs"]
    print(
        f"synthetic stages (milliseconds: {ms}), {world} ranks, median of {opts['steps']} "
        "steps (the slowest rank's wall time per step); measured P2P latency "
        f"{rows[0]['p2p_latency_s'] * 1e3:.3f} ms per message (ideal+p2p adds it to each)",
        file=sys.stderr,
    )
    print(format_rows(rows), flush=True)
    if opts.get("json"):
        result = {
            "config": {
                "ranks": world,
                "costs_ms": _asdict(ms),
                "steps": opts["steps"],
                "warmup": opts["warmup"],
                "command": opts.get("command_line"),
            },
            "synthetic": rows,
        }
        Path(opts["json"]).write_text(json.dumps(result, indent=2))
        print(f"graphpipe bench: wrote {opts['json']}", file=sys.stderr)
