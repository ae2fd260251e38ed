"""``graphpipe bench``: graphpipe eager vs replay vs torch's ScheduleDualPipeV (and DualPipe).

One run, one process group, the same stages (built from one seed) and the same batch for every
mode. Methods, so that a reader can judge the figures:

* **Step time**: the modes are interleaved round by round (round ``i`` starts at mode
  ``i mod K``), each step starts after a barrier on every rank, and a step's time is the
  largest of the ranks' wall times (on CUDA after ``torch.cuda.synchronize``). Gradients are
  reset outside the timed region (``set_to_none``; in place for replay, whose captured step
  accumulates into the static ``.grad`` tensors); no optimizer runs. Every rank runs the same
  steps: ``--warmup`` untimed rounds, then ``--steps`` timed ones. The table shows the median,
  the inter-quartile range and min-max; ``vs eager`` is the ratio of medians, ``paired`` the
  median over rounds of (this mode's step / graphpipe eager's step in the same round), which
  cancels most of the drift of a shared machine.
* **Loss check**: before timing, one step of every mode on the same weights and batch; the
  losses (and, for the MLP, every gradient) are compared with graphpipe eager's.
* **Peak memory**: one extra untimed step per mode, gradients zeroed in place first (so the
  figure is what the step allocates: activations, P2P buffers, temporaries). CUDA:
  ``max_memory_allocated`` after ``reset_peak_memory_stats`` (absolute and above the start).
  CPU (torch has no CPU allocator statistics): the torch profiler's allocation events
  (``profile_memory=True``) summed in time order, peak above the step's start: exact tensor
  bytes. The JSON also has the step's RSS peak (``VmHWM`` reset through
  ``/proc/self/clear_refs``), absolute and above its start; that one depends on what the C
  allocator kept from earlier work, so it does not compare modes run one after another. Per
  rank; the table shows the largest rank. Parameter + gradient bytes and the process's peak
  RSS (``getrusage``, whole run) are in the JSON.
* **Host overhead per action**: trivial stages (one ``Linear(1, 1)``, one row per
  micro-batch). (a) the full world: step time / compute cells per rank (includes P2P);
  (b) a one-rank pipeline on rank 0 (a process group of rank 0 alone, both stages local, no
  P2P): ``(step - bare) / cells``, where *bare* runs the same stage calls and autograd
  backwards per micro-batch in a plain loop, with plain ``nn.Linear`` and with graphpipe's
  ``DeferrableLinear``; the difference between the two bares is the cost of the I/W split.
* **Bubble vs simulator**: each rank times its two stages alone (median of repeats): F (the
  last stage includes the loss), B, I (backward with the Linear weight GEMMs deferred) and W.
  The means over all stages, plus the median or the mean of 100 two-way P2P exchanges between
  ranks 0 and 1 (``Costs.p2p``, per communication batch), become ``simulate.Costs``;
  ``simulate(lower(dualpipev), placement, costs)`` predicts the makespan and the bubble,
  compared with the measured median step and with the bubble of one recorded step (per-action
  start/end taken by standing in for the executor's range emitter, ``DualPipeV.ranges``).
  Each rank's actions in that recorded step are set against the same actions' costs alone
  (``in_step_slowdown``: above 1 where the ranks' compute and gloo's threads share cores),
  and one more prediction multiplies every cost by the worst rank's factor.
  ``--plot`` draws that recorded timeline above the simulated one (SVG).

Timings on a shared machine are noisy: read medians and spreads, repeat runs.

Modules: ``regimes`` (stage models, ``Workload``, the regimes' ``workloads``), ``modes``
(the contenders), ``measure`` (timed steps, interleaving, the loss check, the recorded
timeline), ``memory``, ``host`` (host overhead per action), ``costs`` (stage and P2P costs,
the simulator comparison), ``rank`` (the rank program), ``report`` (tables and the plot),
``world`` (``BenchWorld``, a pre-spawned world for pytest-benchmark), ``options`` (the regime
names and default costs the parser offers); here: the command line, which imports torch only
when it runs (the parts above are imported on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphpipe._lazy import lazy_attributes
from graphpipe.cmdline.options import (
    add_device_option,
    costs_arg,
    cuda_problem,
    non_negative_int,
    positive_int,
)
from graphpipe.cmdline.outputs import check_output_file
from graphpipe.schedule.footprint import add_memory_limit_argument
from graphpipe.schedule.ir import SCHEDULE_KINDS

from .options import REGIME_CHOICES, SYNTHETIC_COSTS

if TYPE_CHECKING:
    from .measure import timed_step
    from .modes import MODE_DUALPIPE, MODE_EAGER, MODE_REPLAY, MODE_TORCH, MODES, Mode, build_modes
    from .regimes import MLPStage, TinyStage, Workload, host_workload, workloads
    from .report import format_report
    from .world import BenchWorld

__all__ = [
    "MODES",
    "MODE_DUALPIPE",
    "MODE_EAGER",
    "MODE_REPLAY",
    "MODE_TORCH",
    "BenchWorld",
    "MLPStage",
    "Mode",
    "TinyStage",
    "Workload",
    "add_parser",
    "build_modes",
    "format_report",
    "host_workload",
    "main",
    "run",
    "timed_step",
    "workloads",
]

# The benchmark's parts import torch: on first use, so that the parser (``--help``) does not.
__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        **dict.fromkeys(
            ("MODES", "MODE_DUALPIPE", "MODE_EAGER", "MODE_REPLAY", "MODE_TORCH", "Mode"),
            ".modes",
        ),
        "build_modes": ".modes",
        **dict.fromkeys(
            ("MLPStage", "TinyStage", "Workload", "host_workload", "workloads"), ".regimes"
        ),
        "BenchWorld": ".world",
        "format_report": ".report",
        "timed_step": ".measure",
    },
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``graphpipe bench`` on the subparsers ``sub``; ``func`` is ``run``."""
    p = sub.add_parser(
        "bench",
        help="step time, tokens/s and memory: graphpipe eager/replay vs torch's DualPipeV",
        description=(
            "Benchmark graphpipe's DualPipeV (eager and replay) against "
            "torch.distributed.pipelining.ScheduleDualPipeV (and DeepSeek's DualPipe where "
            "installed) on the same stages, batch and process group, A/B interleaved. Also "
            "measures the executor's host overhead per action and compares the measured "
            "step with the simulator's prediction from measured F/B/I/W costs. Without "
            "torchrun it spawns --ranks local processes (gloo on CPU, NCCL with --device "
            "cuda, one GPU per rank)."
        ),
    )
    p.add_argument("--ranks", type=positive_int, default=2, help="pipeline ranks (default 2)")
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        metavar="M",
        help="micro-batches per step for every regime (default: overhead 16N, others 4N)",
    )
    p.add_argument(
        "--hidden",
        type=positive_int,
        default=None,
        metavar="H",
        help="model width for every regime (default: overhead 32, compute 1024, realistic 128)",
    )
    p.add_argument(
        "--mb-rows",
        type=positive_int,
        default=None,
        metavar="R",
        help="rows per micro-batch for every regime (default: overhead 2, compute 32)",
    )
    add_device_option(p, note="without CUDA the benchmark is skipped with a note, status 0")
    p.add_argument(
        "--steps", type=positive_int, default=20, help="timed steps per mode (default 20)"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed rounds first (default 3)"
    )
    p.add_argument(
        "--regime",
        choices=(*REGIME_CHOICES, "synthetic", "moe"),
        default="both",
        help="overhead: small hidden, many tiny micro-batches; compute: wide MLP; realistic: "
        "the built-in Llama; sweep: micro-batch sizes on CUDA; both: overhead + compute "
        "(+ sweep on CUDA); all: overhead, compute, realistic (+ sweep on CUDA), every regime "
        "but synthetic and moe; synthetic: stages that sleep "
        "--costs, against the dataflow ideal of --schedule; moe: an MoE stage's overlapped "
        "F&B pair against F then B, experts over --ranks (default both)",
    )
    p.add_argument(
        "--schedule",
        choices=(*sorted(SCHEDULE_KINDS), "all"),
        default="all",
        help="with --regime synthetic: the schedule(s) to run (default all)",
    )
    p.add_argument(
        "--costs",
        type=costs_arg,
        default=SYNTHETIC_COSTS,
        metavar="F=..,B=..",
        help="with --regime synthetic: how long each action sleeps, in milliseconds: F, B, I, "
        "W and FB (an overlapped F&B pair, default F+B) (default "
        f"{SYNTHETIC_COSTS})",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write the results as JSON (its directory must exist)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw the measured per-rank timeline of one step next to the simulated one (.svg; "
        "its directory must exist)",
    )
    add_memory_limit_argument(p)
    p.set_defaults(func=run)
    return p


def _check(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, as one line (None when fine)."""
    m = args.microbatches
    if m is not None and m < 2 * args.ranks:
        return f"--microbatches must be >= 2 * --ranks = {2 * args.ranks}, got {m}"
    if args.plot and Path(args.plot).suffix.lower() != ".svg":
        return f"--plot writes SVG; use a .svg path, not {args.plot!r}"
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = check_output_file(flag, path) if path else None
        if problem is not None:
            return problem
    return _check_memory(args)


_PIPELINES_PER_RANK = 4
"""Schedules one benchmark rank holds at once: graphpipe eager and replay, torch's
``ScheduleDualPipeV`` (of the same size), and the simulator's prediction."""


def _check_memory(args: argparse.Namespace) -> str | None:
    """Refuse a size whose schedules would not fit (``graphpipe.schedule.footprint``): every local
    rank holds ``_PIPELINES_PER_RANK`` schedules of every rank's actions."""
    from graphpipe.schedule import footprint

    n = args.ranks
    m = args.microbatches or 16 * n  # the largest regime default (overhead's)
    kinds = ["dualpipev"]
    if args.regime == "synthetic":  # one schedule at a time, and its dataflow ideal
        kinds = sorted(SCHEDULE_KINDS) if args.schedule == "all" else [args.schedule]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    need = local * _PIPELINES_PER_RANK * max(footprint.runtime_bytes(k, n, m) for k in kinds)
    what = f"--ranks {n} --microbatches {m}"
    return footprint.check_memory(what, need, footprint.memory_limit(args.memory_limit))


def run(args: argparse.Namespace) -> int:
    """``graphpipe bench``: check the arguments (a bad one: one line, exit status 2), spawn
    (or join torchrun's) ranks, print the table, write JSON.

    ``--device cuda`` without CUDA skips the whole benchmark with a note (and a JSON holding
    only ``skipped``) and returns 0: the GPU figures exist only where a GPU does.
    """
    from graphpipe.cmdline.launch import joined_torchrun, launch

    if joined_torchrun():
        args.ranks = int(os.environ["WORLD_SIZE"])  # torchrun's world decides
    problem = _check(args)
    if problem is not None:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine under torchrun
            print(f"graphpipe bench: error: {problem}", file=sys.stderr)
        return 2
    from .rank import bench_rank, say

    if cuda_problem(args.device) is not None:
        why = "--device cuda was asked for, but CUDA is not available"
        say(f"skipped: {why}")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": why}, indent=2))
        return 0
    opts = {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
    opts["command_line"] = " ".join(sys.argv)
    if args.regime == "synthetic":
        opts["schedules"] = sorted(SCHEDULE_KINDS) if args.schedule == "all" else [args.schedule]
        from .synthetic import synthetic_main

        launch(synthetic_main, args.ranks, args.device, opts)
        return 0
    if args.regime == "moe":
        from .moe import moe_main

        launch(moe_main, args.ranks, args.device, opts)
        return 0
    launch(bench_rank, args.ranks, args.device, opts)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m graphpipe.bench ARGS``: the same as ``graphpipe bench ARGS``."""
    parser = argparse.ArgumentParser(prog="graphpipe")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
