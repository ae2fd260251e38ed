"""The planned split against the even split and one process, measured, beside the prediction.

The built-in model at the shape of issue 32's HF model (vocabulary 16384, hidden 256, 12
layers, 4 heads; float32, plain torch ops), a batch of 16 x 64 random tokens in 8
micro-batches, DualPipeV on 2 gloo ranks:

1. in this process, ``graphpipe.models.plan_llama_split`` measures every piece and plans
   the split (the prediction for the planned and the even split);
2. on 2 spawned ranks, rounds of: a step of the even split, a step of the planned split,
   and one step of the unsplit model on the whole batch on rank 0 alone with every core's
   thread (rank 1 waits), in turn, after one warm-up round; each step timed between
   barriers.

It prints one JSON object: per variant the median and the fastest step, the predictions,
and the ratios the issue asks about (planned / even, measured / predicted, pipeline / one
process). What it measures depends on the machine: run it on a quiet one.

    python profiles/plan_check.py [--rounds 5] [--reps 5] [--vocab 16384] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _config(opts: dict) -> Any:
    from graphpipe.models import LlamaConfig

    return LlamaConfig(
        vocab_size=opts["vocab"],
        hidden=opts["hidden"],
        n_layers=opts["layers"],
        n_heads=opts["heads"],
        max_seq_len=opts["seq_len"],
        use_kernels=False,
    )


def _batch(opts: dict) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, opts["vocab"], (opts["batch"], opts["seq_len"]), generator=gen)


def _rank(rank: int, world: int, device: Any, opts: dict, splits: dict, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from graphpipe.models import LlamaLoss, build_model, build_stages
    from graphpipe.runtime.pipeline import DualPipeV

    cfg = _config(opts)
    tokens = _batch(opts)
    loss_fn = LlamaLoss(use_kernels=False)
    steps: dict[str, Any] = {}
    modules: dict[str, list[Any]] = {}
    pipes = []
    for name, counts in splits.items():
        stages = build_stages(cfg, 2 * world, layers_per_stage=counts)
        mine = (stages[rank], stages[2 * world - 1 - rank])
        pipe = DualPipeV(mine, num_microbatches=opts["microbatches"], loss_fn=loss_fn)
        pipes.append(pipe)
        steps[name] = lambda pipe=pipe: pipe.step(
            tokens if rank == 0 else None, tokens if rank == 0 else None
        )
        modules[name] = list(mine)
    whole = build_model(cfg)

    def single() -> None:
        if rank == 0:  # one process alone has every core (the ranks have cores / 2 each)
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or 1)
            try:
                loss_fn(whole(tokens), tokens).backward()
            finally:
                torch.set_num_threads(threads)

    steps["one process"], modules["one process"] = single, [whole]
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(opts["rounds"] + 1):
        for name, step in steps.items():
            for m in modules[name]:
                m.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if round_:
                times[name].append(time.perf_counter() - t0)
    for pipe in pipes:
        pipe.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--reps", type=int, default=5, help="planner rounds per piece (default 5)")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result here")
    args = p.parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k != "json"}

    import tempfile

    from graphpipe.launch import launch
    from graphpipe.models import plan_llama_split

    plan = plan_llama_split(
        _config(opts),
        4,
        tokens=_batch(opts),
        num_microbatches=args.microbatches,
        reps=args.reps,
    )
    splits = {"even": list(plan.even_layers_per_stage), "planned": list(plan.layers_per_stage)}
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        launch(_rank, 2, "cpu", opts, splits, tmp.name)
        with open(tmp.name) as f:
            times = json.load(f)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "model": {k: opts[k] for k in ("vocab", "hidden", "layers", "heads")},
        "batch": [args.batch, args.seq_len],
        "microbatches": args.microbatches,
        "splits": splits,
        "predicted_s": {"even": plan.even_predicted_step_s, "planned": plan.predicted_step_s},
        "measured_median_s": med,
        "measured_min_s": {name: min(ts) for name, ts in times.items()},
        "planned_over_even": med["planned"] / med["even"],
        "measured_over_predicted": {
            "even": med["even"] / plan.even_predicted_step_s,
            "planned": med["planned"] / plan.predicted_step_s,
        },
        "pipeline_over_one_process": med["planned"] / med["one process"],
        "rounds": args.rounds,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
