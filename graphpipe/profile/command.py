"""``graphpipe profile``: run the built-in model under torch.profiler on every rank (or read
an nsys export) and write ``report.json``, ``timeline.svg`` and the table.

The model, data and pipeline options are ``graphpipe train``'s (``train.options.add_model_options``)
and every rank is set up as ``train`` sets it up (``train.loop.build_rank``); only the public
pipeline API is used (``DualPipeV(...)``, ``.step()``, ``.close()``): the runtime emits its
ranges by itself whenever a torch profiler records.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["add_parser", "run"]

PROG = "graphpipe profile"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from graphpipe.schedule.footprint import add_memory_limit_argument
    from graphpipe.train.options import add_model_options

    p = sub.add_parser(
        "profile",
        help="profile training steps: per-rank bubble, communication wait, vs the simulator",
        description=(
            "Run --warmup steps, then --steps training steps of the built-in model under "
            "torch.profiler on every rank (CPU activity; CUDA too with --device cuda), set up "
            "as graphpipe train sets it up (the same model, data and pipeline options), and "
            "write DIR/trace_rank{r}.json (Chrome traces, one per rank: --ranks x --dp), "
            "DIR/report.json (per rank of replica 0: step, busy, idle, bubble fraction, "
            "communication wait, seconds per action; the simulator's prediction from the "
            "measured action costs), DIR/timeline.svg (measured above simulated on one time "
            "axis) and print the table; the last line names every file written. With "
            "--from-nsys, compute the same from the NVTX ranges of an Nsight Systems SQLite "
            "export instead of running (the model options are then unused; ranks and "
            "micro-batches come from the ranges)."
        ),
    )
    add_model_options(p)
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="profiled steps (default 3); with --from-nsys: analyse the last STEPS steps of "
        "every rank",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="steps run before profiling (default 2: the first step exchanges shapes and "
        "records, with --capture the second one captures)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="where the files go (created if missing; its parent must exist)",
    )
    p.add_argument(
        "--clock",
        choices=("host", "gpu"),
        default=None,
        help="host: the ranges as the host pushed and popped them; gpu: projected onto the GPU "
        "work launched inside them (what an asynchronous CUDA step or a graph replay needs); "
        "default: gpu with --device cuda or an export holding a CUDA trace, else host",
    )
    p.add_argument(
        "--from-nsys",
        metavar="FILE.sqlite",
        default=None,
        help="analyse this `nsys export --type sqlite` file (NVTX domain 'graphpipe') instead "
        "of running",
    )
    add_memory_limit_argument(p)
    p.set_defaults(func=run)
    return p


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from graphpipe.cmdline.launch import joined_torchrun, launch
    from graphpipe.cmdline.options import first_below
    from graphpipe.cmdline.outputs import check_output_dir
    from graphpipe.train.checks import check_model, torchrun_world

    problem = first_below(args, 1, "steps")
    if problem is not None:
        return _fail(problem)
    out = Path(args.out)
    problem = check_output_dir("--out", out)
    if problem is not None:
        return _fail(problem)
    if args.from_nsys is not None:
        return _from_nsys(args, out)
    problem = torchrun_world(args) or check_model(args)
    problem = problem or first_below(args, 0, "warmup")
    if problem is None and args.clock == "gpu" and args.device != "cuda":
        problem = "--clock gpu needs --device cuda (a CPU run has no GPU clock)"
    if problem is None:
        problem = _check_memory(args)
    if problem is not None:
        return _fail(problem)
    clock = args.clock or ("gpu" if args.device == "cuda" else "host")
    out.mkdir(exist_ok=True)  # its parent was checked
    opts = {k: v for k, v in vars(args).items() if k != "func"}
    opts["out"] = str(out)
    world = args.ranks * args.dp
    launch(_profile_rank, world, args.device, opts)
    if joined_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    from .analysis import analyse
    from .chrome import load_chrome_traces

    traces = [_trace_path(out, r) for r in range(world)]
    notes = []
    if args.dp > 1:
        replica0 = "rank 0" if args.ranks == 1 else f"ranks 0-{args.ranks - 1}"
        notes.append(
            f"--dp {args.dp}: the figures are replica 0's (global {replica0}); every rank's "
            "trace is written"
        )
    try:
        ranges = load_chrome_traces(dict(enumerate(traces[: args.ranks])), clock)
        analysis = analyse(
            ranges,
            steps=args.steps,
            microbatches=args.microbatches,
            source={
                "kind": "torch.profiler",
                "files": [p.name for p in traces],
                "clock": clock,
                "device": args.device,
                "capture": args.capture,
                "warmup_steps": args.warmup,
                "dp": args.dp,
            },
            notes=notes,
        )
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if args.device == "cuda" and clock == "host":
        analysis.report["notes"].append(
            "host clock on CUDA: the ranges time what the host did (launches, and waits where "
            "it blocked), not when the GPU ran the work; --clock gpu projects them onto it"
        )
    return _write(analysis, out, traces)


def _check_memory(args: argparse.Namespace) -> str | None:
    """Refuse a size whose schedules would not fit (``graphpipe.schedule.footprint``): every local
    rank's pipeline holds every rank's actions, and rank 0 simulates the schedule once more."""
    from graphpipe.schedule import footprint

    n, m = args.ranks, args.microbatches
    local = int(os.environ.get("LOCAL_WORLD_SIZE", n * args.dp))
    need = (local + 1) * footprint.runtime_bytes("dualpipev", n, m)
    what = f"--ranks {n} --microbatches {m}" + (f" --dp {args.dp}" if args.dp > 1 else "")
    return footprint.check_memory(what, need, footprint.memory_limit(args.memory_limit))


def _trace_path(out: Path, rank: int) -> Path:
    return out / f"trace_rank{rank}.json"


def _write(analysis: Any, out: Path, traces: list[Path]) -> int:
    """Write the report and the timeline, print the table; the last line names every file
    this run wrote (``traces``: the ranks' traces, already written)."""
    from .report import format_table, write_outputs

    report_path, svg_path = write_outputs(analysis, out)
    print(format_table(analysis.report))
    files = [*traces, report_path, svg_path]
    names = ", ".join(Path(f).name for f in files[:-1]) + f" and {Path(files[-1]).name}"
    print(f"{PROG}: wrote {names} in {out}", file=sys.stderr)
    return 0


def _from_nsys(args: argparse.Namespace, out: Path) -> int:
    from graphpipe.schedule.generators import SCHEDULES

    from .analysis import analyse
    from .nsys import assign_ranks, has_cuda_trace, load_nsys
    from .ranges import Kind

    path = Path(args.from_nsys)
    try:
        clock = args.clock or ("gpu" if has_cuda_trace(path) else "host")
        by_process = load_nsys(path, clock)
        processes = {
            pid: rs for pid, rs in by_process.items() if any(r.kind is Kind.STEP for r in rs)
        }
        if not processes:
            raise ValueError(f"{path}: no 'step' range in the graphpipe NVTX domain")
        placement = SCHEDULES["dualpipev"].placement(len(processes))
        by_rank, notes = assign_ranks(processes, placement.stage_to_rank)
        analysis = analyse(
            by_rank,
            steps=args.steps,
            microbatches=args.microbatches,
            source={"kind": "nsys", "file": str(path), "clock": clock},
            notes=notes,
        )
    except ValueError as e:
        return _fail(str(e))
    out.mkdir(exist_ok=True)  # its parent was checked
    return _write(analysis, out, [])


def _profile_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from graphpipe.train.loop import build_rank

    from .quiet import kineto_info_dropped

    run = build_rank(rank, world, device, opts, prog=PROG)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        for _ in range(opts["warmup"]):
            float(run.step(*run.next_batch()))
        prof = profile(activities=activities)
        with kineto_info_dropped():  # kineto logs "profiler_start" to fd 2
            prof.start()
        try:
            for _ in range(opts["steps"]):
                loss = run.step(*run.next_batch())
                if cuda:
                    torch.cuda.synchronize()  # as graphpipe train does after every step
                value = float(loss)
        finally:
            with kineto_info_dropped():
                prof.stop()
        prof.export_chrome_trace(str(_trace_path(Path(opts["out"]), rank)))
    finally:
        run.close()
    if rank == 0:
        print(
            f"{PROG}: {opts['steps']} profiled step(s) after {opts['warmup']} warmup, "
            f"last loss {value:.3f}",
            file=sys.stderr,
            flush=True,
        )
    dist.barrier()  # every rank's trace is written before rank 0 reads them
