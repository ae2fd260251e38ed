"""The rank program of ``graphpipe bench``: measure every regime, gather to rank 0, report."""

from __future__ import annotations

import json
import resource
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .costs import in_step_slowdown, measured_bubble, p2p_cost, simulation, stage_costs
from .host import host_overhead
from .measure import (
    control_group,
    loss_check,
    max_over_ranks,
    record_timeline,
    spread,
    timed_rounds,
)
from .memory import peak_memory
from .modes import MODE_EAGER, build_modes
from .regimes import Workload, workloads
from .report import format_report, write_plot

__all__ = ["bench_rank", "say"]


def say(text: str) -> None:
    print(f"graphpipe bench: {text}", file=sys.stderr, flush=True)


def _speaker(rank: int) -> Callable[[str], None]:
    """``say`` on rank 0, silence elsewhere."""
    return say if rank == 0 else (lambda _text: None)


def _run_workload(
    w: Workload,
    rank: int,
    world: int,
    device: torch.device,
    group: Any,
    ctrl: Any,
    opts: dict,
    host_per_action: float | None,
) -> tuple[dict[str, Any], Any]:
    """Every measurement of one regime; on rank 0 its JSON and the simulated ``SimResult``
    to plot (elsewhere ``({}, None)``)."""
    speak = _speaker(rank)
    speak(f"regime {w.name}: {w.describe(world)}")
    threads = torch.get_num_threads()
    if w.threads is not None:
        torch.set_num_threads(w.threads)
    try:
        return _measure(w, rank, world, device, group, ctrl, opts, host_per_action, speak)
    finally:
        torch.set_num_threads(threads)


def _measure(
    w: Workload,
    rank: int,
    world: int,
    device: torch.device,
    group: Any,
    ctrl: Any,
    opts: dict,
    host_per_action: float | None,
    speak: Callable[[str], None],
) -> tuple[dict[str, Any], Any]:
    modes, skipped = build_modes(w, rank, world, device, group)
    for name, why in skipped.items():
        speak(f"  {name}: skipped ({why})")
    x, y = w.batch(device)
    xs, ys = (x, y) if rank == 0 else (None, None)
    check = loss_check(modes, xs, ys, rank, ctrl, grads=w.model == "mlp")
    speak(f"  timing {', '.join(m.name for m in modes)} interleaved")
    times = timed_rounds(
        modes, xs, ys, opts["steps"], opts["warmup"], ctrl, device, lambda t: speak(f"    {t}")
    )
    speak("  peak memory, per-action timeline, stage costs")
    memory = {m.name: peak_memory(m, xs, ys, device, ctrl) for m in modes}
    timeline = record_timeline(modes[0], xs, ys, rank, device, ctrl)
    costs = stage_costs(w, rank, world, device, reps=max(3, min(opts["steps"], 10)))
    dist.barrier(group=ctrl)
    p2p = p2p_cost(w, rank, world, device, group, 100)
    mine = {
        "times": times,
        "memory": memory,
        "timeline": timeline,
        "costs": costs,
        "p2p": p2p,
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=ctrl)
    for m in modes:
        m.close()
    if rank != 0:
        return {}, None
    step_times = max_over_ranks([g["times"] for g in gathered])
    eager = step_times[MODE_EAGER]
    eager_median = statistics.median(eager)
    result_modes: dict[str, Any] = {}
    for name, ts in step_times.items():
        stats = spread(ts)
        result_modes[name] = {
            "step_times_s": ts,
            **stats,
            "tokens_per_s": w.tokens_per_step / stats["median_s"],
            "ratio_to_eager": stats["median_s"] / eager_median,
            "paired_ratio_to_eager": statistics.median(
                t / e for t, e in zip(ts, eager, strict=True)
            ),
            "peak_memory_per_rank": [g["memory"][name] for g in gathered],
        }
        speak(
            f"  {name}: median {stats['median_s'] * 1e3:.2f} ms "
            f"({stats['median_s'] / eager_median:.2f}x eager)"
        )
    records = [r for g in gathered for r in g["timeline"]]
    costs = [g["costs"] for g in gathered]
    slowdown = in_step_slowdown(records, world, costs)
    sim, picture = simulation(
        w, world, costs, gathered[0]["p2p"], host_per_action, max(slowdown) or None
    )
    sim["measured"] = {
        "median_step_s": eager_median,
        "recorded_step": measured_bubble(records, world),
        "in_step_over_alone_per_rank": slowdown,
    }
    result = {
        "workload": asdict(w),
        "tokens_per_step": w.tokens_per_step,
        "description": w.describe(world),
        "modes": result_modes,
        "skipped": skipped,
        "check": check,
        "simulation": sim,
        "timeline": records,
        "maxrss_kib_per_rank": [g["maxrss_kib"] for g in gathered],
    }
    return result, picture


def bench_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    """One rank of ``graphpipe bench`` (run by ``graphpipe.cmdline.launch.launch``, which also frees
    the pipelines before the process group): measure, gather to rank 0, report there."""
    group = dist.group.WORLD
    ctrl = control_group(group)
    torch.manual_seed(0)
    speak = _speaker(rank)
    found, skipped = workloads(
        opts["regime"],
        world,
        device.type,
        hidden=opts.get("hidden"),
        microbatches=opts.get("microbatches"),
        mb_rows=opts.get("mb_rows"),
    )
    for name, why in skipped.items():
        speak(f"regime {name}: skipped ({why})")
    speak(f"host overhead per action: trivial stages, {world} ranks and a one-rank pipeline")
    host = host_overhead(rank, world, device, group, ctrl, opts["steps"], opts["warmup"], 4 * world)
    # the world's step times were measured per rank: gather and take the slowest rank
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, host["world"]["step_times_s"], group=ctrl)
    host_per_action = host["one_rank"]["graphpipe_overhead_per_action_s"] if rank == 0 else None
    regimes, pictures = {}, {}
    for w in found:
        regimes[w.name], pictures[w.name] = _run_workload(
            w, rank, world, device, group, ctrl, opts, host_per_action
        )
    if rank != 0:
        return
    cells = host["world"]["compute_cells_per_rank"]
    world_times = max_over_ranks(per_rank)
    host["world"]["step_times_s"] = world_times
    host["world"]["per_action_s"] = {
        name: statistics.median(ts) / cells for name, ts in world_times.items()
    }
    result = {
        "config": {
            "ranks": world,
            "device": device.type,
            "backend": dist.get_backend(group),
            "steps": opts["steps"],
            "warmup": opts["warmup"],
            "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__,
            "command": opts.get("command_line"),
        },
        "skipped_regimes": skipped,
        "host_overhead": host,
        "regimes": regimes,
    }
    if opts.get("plot"):
        say(f"wrote {write_plot(opts['plot'], result, pictures, world)}")
    print(format_report(result), flush=True)
    if opts.get("json"):
        Path(opts["json"]).write_text(json.dumps(result, indent=2))
        say(f"wrote {opts['json']}")
