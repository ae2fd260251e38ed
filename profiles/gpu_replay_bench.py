"""Eager vs captured step time on one GPU (the one-rank pipeline), at both granularities.

Sweeps the built-in Llama (bf16, Triton kernels) from launch-bound to compute-bound: each
point is a model width and a number of sequences per micro-batch. At every point the three
modes (eager, ``capture="step"``, ``capture="action"``) run interleaved step by step, each on
its own copy of the model (same seed); the median step time of each (after the warmup and
capture steps) and the speedups over eager are printed as a table and, with ``--json``,
written as figures. Needs CUDA; without it, says so (and writes ``{"skipped": reason}``).

    python profiles/gpu_replay_bench.py [--steps 20] [--points 256x1,1024x1,1024x4,1024x16]
        [--json FILE]

The goal in the README (replay >= 2x eager when kernel launches dominate) is read off the
first point's ``x step`` column. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

import graphpipe
from graphpipe.models import LlamaConfig, LlamaLoss, build_stages

MODES: tuple[Any, ...] = (False, "step", "action")
WARMUP = 3  # steps left out of the median: eager warmup, capture, first replay


def _name(mode: Any) -> str:
    return mode or "eager"


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"256x1,1024x16"`` -> ``[(256, 1), (1024, 16)]`` (hidden x sequences/micro-batch)."""
    points = []
    for item in text.split(","):
        hidden, _, rows = item.strip().partition("x")
        try:
            points.append((int(hidden), int(rows)))
        except ValueError:
            raise ValueError(f"bad point {item!r}: expected HIDDENxROWS, e.g. 1024x4") from None
    return points


def run_point(hidden: int, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median step times (s) of the three modes at one point, interleaved step by step."""
    dev = torch.device("cuda")
    cfg = LlamaConfig(
        hidden=hidden,
        n_layers=args.layers,
        n_heads=max(1, hidden // 128),
        max_seq_len=args.seq_len,
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (rows * args.microbatches, args.seq_len + 1), generator=g)
    x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
    pipes = {
        _name(mode): graphpipe.DualPipeV(
            build_stages(cfg, 2, seed=0, device=dev, dtype=torch.bfloat16),
            num_microbatches=args.microbatches,
            loss_fn=LlamaLoss(),
            capture=mode,
        )
        for mode in MODES
    }
    times: dict[str, list[float]] = {name: [] for name in pipes}
    losses: dict[str, float] = {}
    try:
        for _ in range(args.steps):
            for name, pipe in pipes.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = pipe.step(x, y)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
                losses[name] = float(loss)
    finally:
        for pipe in pipes.values():
            pipe.close()
    point: dict[str, Any] = {
        "hidden": hidden,
        "rows_per_microbatch": rows,
        "tokens_per_step": rows * args.microbatches * args.seq_len,
        "last_loss": losses,
    }
    for name, ts in times.items():
        point[f"{name}_ms"] = statistics.median(ts[WARMUP:]) * 1e3
    point["x_step"] = point["eager_ms"] / point["step_ms"]
    point["x_action"] = point["eager_ms"] / point["action_ms"]
    return point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per mode (3 are warmup)")
    ap.add_argument("--points", default="256x1,1024x1,1024x4,1024x16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must be more than the {WARMUP} warmup steps, got {args.steps}")
    points = parse_points(args.points)
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": "CUDA is not available"}, f)
        return 0
    results = []
    for hidden, rows in points:
        results.append(run_point(hidden, rows, args))
        r = results[-1]
        print(
            f"hidden {hidden:>5} rows/mb {rows:>3}: eager {r['eager_ms']:.2f} ms, "
            f"step {r['step_ms']:.2f} ms, action {r['action_ms']:.2f} ms",
            file=sys.stderr,
        )
    head = ("hidden", "rows/mb", "eager ms", "step ms", "action ms", "x step", "x action")
    print("\n" + " ".join(f"{h:>10}" for h in head))
    for r in results:
        cells = [r["eager_ms"], r["step_ms"], r["action_ms"], r["x_step"], r["x_action"]]
        print(
            f"{r['hidden']:>10} {r['rows_per_microbatch']:>10} "
            + " ".join(f"{v:>10.2f}" for v in cells)
        )
    if args.json:
        figures = {
            "device": torch.cuda.get_device_name(),
            "dtype": "bfloat16",
            "layers": args.layers,
            "seq_len": args.seq_len,
            "microbatches": args.microbatches,
            "steps": args.steps,
            "warmup_steps": WARMUP,
            "points": results,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
