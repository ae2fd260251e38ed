"""Eager vs captured step time on one GPU (the one-rank pipeline), at both granularities.

Prints a table: micro-batch rows from launch-bound to compute-bound, median step time of
eager, capture="step" and capture="action", and the speedups. Needs CUDA.

    python profiles/gpu_replay_bench.py [--steps 30] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import graphpipe
from graphpipe.models import LlamaConfig, LlamaLoss, build_stages


def _time_steps(pipe, x, y, steps: int) -> float:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipe.step(x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # the first steps warm up and capture


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure", file=sys.stderr)
        return 0
    dev = torch.device("cuda")
    cfg = LlamaConfig(
        hidden=args.hidden,
        n_layers=args.layers,
        n_heads=max(1, args.hidden // 128),
        max_seq_len=args.seq_len,
    )
    rows = []
    for mb_rows in (1, 4, 16):
        batch = mb_rows * args.microbatches
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (batch, args.seq_len + 1), generator=g)
        x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
        result = {"rows": mb_rows}
        for mode in (False, "step", "action"):
            stages = build_stages(cfg, 2, seed=0, device=dev, dtype=torch.bfloat16)
            pipe = graphpipe.DualPipeV(
                stages, num_microbatches=args.microbatches, loss_fn=LlamaLoss(), capture=mode
            )
            result[mode or "eager"] = _time_steps(pipe, x, y, args.steps)
            pipe.close()
            name = mode or "eager"
            print(f"rows/mb {mb_rows:>3} {name:>6}: {result[name] * 1e3:.2f} ms", file=sys.stderr)
        rows.append(result)
    head = ("rows/mb", "eager ms", "step ms", "action ms", "x step", "x action")
    print("\n" + " ".join(f"{h:>10}" for h in head))
    for r in rows:
        ms = [r[k] * 1e3 for k in ("eager", "step", "action")]
        speedups = [r["eager"] / r["step"], r["eager"] / r["action"]]
        print(f"{r['rows']:>10} " + " ".join(f"{v:>10.2f}" for v in ms + speedups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
