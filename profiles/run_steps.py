"""Run one contender of ``graphpipe bench`` for many steps: a target for profilers.

    python profiles/run_steps.py --mode eager --regime overhead --steps 300
    py-spy record --subprocesses --rate 2000 -o /tmp/eager.svg -- \\
        python profiles/run_steps.py --mode eager --steps 300
    python profiles/run_steps.py --mode eager --steps 20 --torch-profile /tmp/prof

``--mode``: eager, replay or torch (graphpipe eager, graphpipe replay, torch's
ScheduleDualPipeV). ``--regime``: a ``graphpipe bench`` regime (overhead, compute, realistic)
or ``host`` (Linear(1, 1) stages, one row per micro-batch). ``--torch-profile DIR`` records the
last 5 steps with ``torch.profiler`` and writes one Chrome trace per rank
(``DIR/rank{r}.json``, open in https://ui.perfetto.dev) plus, on stdout, the time per range
name summed over the steps (the executor's ``step``/``3F5``/... ranges and torch's
``PP:...`` ones) and the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.bench import (
    MODE_EAGER,
    MODE_REPLAY,
    MODE_TORCH,
    Workload,
    build_modes,
    host_workload,
    timed_step,
    workloads,
)
from graphpipe.bench.modes import torch_schedule_unavailable
from graphpipe.cmdline.launch import launch

_MODES = {"eager": MODE_EAGER, "replay": MODE_REPLAY, "torch": MODE_TORCH}


def _workload(regime: str, world: int, opts: dict) -> Workload:
    if regime == "host":
        return host_workload(opts["microbatches"] or 4 * world)
    sizes = {k: opts[k] for k in ("hidden", "microbatches", "mb_rows")}
    found, _ = workloads(regime, world, "cpu", **sizes)
    return found[0]


def _rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    w = _workload(opts["regime"], world, opts)
    name = _MODES[opts["mode"]]
    built, skipped = build_modes(w, rank, world, device, dist.group.WORLD, only=(name,))
    if name in skipped:
        raise SystemExit(f"run_steps.py: {name} skipped: {skipped[name]}")
    (mode,) = built
    x, y = w.batch(device)
    batch = (x, y) if rank == 0 else (None, None)
    times = []
    prof = None
    for i in range(opts["steps"]):
        if opts["torch_profile"] and i == opts["steps"] - 5:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.start()
        times.append(timed_step(mode, *batch, dist.group.WORLD, device))
    if prof is not None:
        prof.stop()
        _report(prof, rank, Path(opts["torch_profile"]))
    mode.close()
    if rank == 0:
        tail = times[len(times) // 5 :]
        print(
            f"{name} [{w.name}] {w.describe(world)}: median step "
            f"{statistics.median(tail) * 1e3:.3f} ms over {len(tail)} steps "
            f"(min {min(tail) * 1e3:.3f}, max {max(tail) * 1e3:.3f})",
            flush=True,
        )


def _report(prof: Any, rank: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"rank{rank}.json"))
    if rank != 0:
        return
    ranges: dict[str, float] = {}
    for e in prof.events():
        if e.name == "step" or e.name.startswith(("PP:", "(")) or e.name[:1].isdigit():
            key = e.name if e.name == "step" else e.name.lstrip("0123456789")[:1] or e.name
            ranges[key] = ranges.get(key, 0.0) + e.cpu_time_total
    print("rank 0, last 5 steps: time per range kind (us):", flush=True)
    for k, v in sorted(ranges.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {k:<40} {v:>12.0f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=sorted(_MODES), default="eager")
    p.add_argument(
        "--regime", choices=("overhead", "compute", "realistic", "host"), default="overhead"
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--mb-rows", type=int, default=None)
    p.add_argument("--torch-profile", default=None, metavar="DIR")
    args = p.parse_args(argv)
    if args.mode == "torch" and (why := torch_schedule_unavailable("gloo")) is not None:
        p.error(why)  # the ranks run on gloo
    launch(_rank, args.ranks, "cpu", vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
