"""The planned split against the even split and one process, measured, beside the prediction.

A Llama model of vocabulary 16384, hidden 256, 12 layers, 4 heads (float32): the built-in
model (plain torch ops; ``--model builtin``, the default) or transformers'
``LlamaForCausalLM`` of that shape (``--model hf``: its own modules, sdpa attention,
``split_hf_causal_lm`` and ``causal_lm_loss``); a batch of 16 x 64 random tokens in 8
micro-batches, DualPipeV on 2 gloo ranks:

1. in this process, ``plan_llama_split`` (or ``plan_hf_split``) measures every piece with
   one rank's threads and plans the split (the prediction for the planned and the even
   split);
2. on 2 spawned ranks, rounds of: a step of the even split, a step of the planned split,
   and two steps of the unsplit model on the whole batch on rank 0 alone (rank 1 waits),
   one with every core's thread ("one process") and one with a rank's threads ("one
   process, one rank's cores"), in turn, after one warm-up round; each step timed between
   barriers;
3. one more step of each split with every action's wall times: per rank, the actions'
   time against the same actions' costs alone (from the plan) and the time outside
   actions (``recorded_step``), which says where the step lost time against the
   prediction.

It prints one JSON object: per variant the median and the fastest step, the predictions,
and the ratios the issue asks about (planned / even, measured / predicted, pipeline / one
process with every core and with one rank's cores). What it measures depends on the
machine: run it on a quiet one.

    python profiles/plan_check.py [--model builtin|hf] [--rounds 5] [--reps 5] [--json FILE]
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


def _hf_model(opts: dict) -> Any:
    """transformers' LlamaForCausalLM of the built-in model's shape (the same MLP width)."""
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    ours = _config(opts)
    torch.manual_seed(0)
    cfg = HFConfig(
        vocab_size=ours.vocab_size,
        hidden_size=ours.hidden,
        intermediate_size=ours.ffn_dim,
        num_hidden_layers=ours.n_layers,
        num_attention_heads=ours.n_heads,
        num_key_value_heads=ours.n_heads,
        max_position_embeddings=ours.max_seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


def _model(opts: dict, world: int) -> tuple[Any, Any, Any]:
    """(the unsplit model as a callable of tokens, a function of the counts to its
    ``2 * world`` stages, the loss) for ``opts["model"]``."""
    if opts["model"] == "hf":
        from graphpipe.models import causal_lm_loss, split_hf_causal_lm

        model = _hf_model(opts)

        def stages_of(counts: list[int]) -> list[Any]:
            return split_hf_causal_lm(model, 2 * world, layers_per_stage=counts)

        model.whole = lambda tokens: model(tokens).logits
        return model, stages_of, causal_lm_loss
    from graphpipe.models import LlamaLoss, build_model, build_stages

    cfg = _config(opts)
    whole = build_model(cfg)
    whole.whole = whole
    return (
        whole,
        lambda counts: build_stages(cfg, 2 * world, layers_per_stage=counts),
        (LlamaLoss(use_kernels=False)),
    )


def _rank(rank: int, world: int, device: Any, opts: dict, splits: dict, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from graphpipe.runtime.pipeline import DualPipeV

    tokens = _batch(opts)
    whole, stages_of, loss_fn = _model(opts, world)
    steps: dict[str, Any] = {}
    modules: dict[str, list[Any]] = {}
    pipes = []
    for name, counts in splits.items():
        stages = stages_of(counts)
        mine = (stages[rank], stages[2 * world - 1 - rank])
        pipe = DualPipeV(mine, num_microbatches=opts["microbatches"], loss_fn=loss_fn)
        pipes.append(pipe)
        steps[name] = lambda pipe=pipe: pipe.step(
            tokens if rank == 0 else None, tokens if rank == 0 else None
        )
        modules[name] = list(mine)

    def single(threads: int) -> None:
        if rank == 0:  # rank 1 waits at the barrier
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                loss_fn(whole.whole(tokens), tokens).backward()
            finally:
                torch.set_num_threads(before)

    steps["one process"] = lambda: single(os.cpu_count() or 1)
    steps["one process, one rank's cores"] = lambda: single(torch.get_num_threads())
    modules["one process"] = modules["one process, one rank's cores"] = [whole]
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
    timelines = {}
    for name, pipe in zip(splits, pipes, strict=True):
        timelines[name] = _recorded_step(pipe, steps[name], modules[name])
    for pipe in pipes:
        pipe.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, timelines)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "timelines": gathered}, f)


def _recorded_step(pipe: Any, step: Any, modules: list[Any]) -> list[tuple[str, float, float]]:
    """One more step with every action's wall times (``bench``'s stand-in for the range
    emitter), in seconds from the barrier before it."""
    import torch.distributed as dist

    from graphpipe.bench.measure import RangeClock

    clock, saved = RangeClock(), pipe.ranges
    for m in modules:
        m.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    pipe.ranges = clock
    try:
        step()
    finally:
        pipe.ranges = saved
    return [(name, s - t0, e - t0) for name, s, e in clock.records]


def _in_step(plan_costs: Any, world: int, timelines: list[dict], m: int) -> dict:
    """Where the recorded step of one split went, per rank: its actions' time against the
    same actions' costs alone (the plan's per-stage costs; an overlapped pair as F + B),
    and the time it spent outside actions (waiting for a transfer, host work)."""
    from graphpipe.bench.costs import action_times

    records = [
        {"rank": r, "label": label, "start": start, "end": end}
        for r, timeline in enumerate(timelines)
        for label, start, end in timeline
    ]
    steps = [0.0] * world
    for rec in records:
        if rec["label"] == "step":
            steps[rec["rank"]] = rec["end"] - rec["start"]
    actions, alone = action_times(
        records, world, lambda a: sum(plan_costs[p.stage].of(p) for p in a.parts())
    )
    out: dict[str, list[float]] = {
        "step_s": steps,
        "actions_s": actions,
        "alone_s": alone,
        "outside_s": [st - ac for st, ac in zip(steps, actions, strict=True)],
    }
    out["actions_over_alone"] = slow = [
        a / b if b else 0.0 for a, b in zip(out["actions_s"], out["alone_s"])
    ]
    out["predicted_s"] = _simulated(plan_costs, world, [1.0] * world, m)
    out["predicted_with_in_step_costs_s"] = _simulated(plan_costs, world, slow, m)
    return out


def _simulated(plan_costs: Any, world: int, factors: list[float], m: int) -> float:
    """The simulated DualPipeV step of these per-stage costs, each rank's multiplied by its
    factor (all 1: the plan's own prediction)."""
    from dataclasses import replace

    from graphpipe.schedule.planner import predict_step

    scaled = [
        replace(c, F=c.F * f, B=c.B * f, I=c.I * f, W=c.W * f)
        for c, f in zip(plan_costs, _v_factors(factors, world), strict=True)
    ]
    return predict_step(scaled, num_microbatches=m)


def _v_factors(per_rank: list[float], world: int) -> list[float]:
    """Per stage, the factor of the rank DualPipeV places it on (stage s and 2N-1-s on s)."""
    return [per_rank[min(s, 2 * world - 1 - s)] for s in range(2 * world)]


def _rank_threads() -> int:
    from graphpipe.models.planning import rank_threads

    return rank_threads(4, "dualpipev")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        choices=("builtin", "hf"),
        default="builtin",
        help="the built-in Llama (default) or transformers' LlamaForCausalLM of that shape",
    )
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

    from graphpipe.cmdline.launch import launch
    from graphpipe.models import plan_hf_split, plan_llama_split

    if args.model == "hf":
        plan = plan_hf_split(
            _hf_model(opts),
            4,
            input_ids=_batch(opts),
            num_microbatches=args.microbatches,
            reps=args.reps,
        )
    else:
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
            got = json.load(f)
    times = got["times"]
    costs = {"even": plan.even_stage_costs, "planned": plan.stage_costs}
    in_step = {
        name: _in_step(costs[name], 2, [t[name] for t in got["timelines"]], args.microbatches)
        for name in splits
    }
    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "model": {k: opts[k] for k in ("model", "vocab", "hidden", "layers", "heads")},
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
        "pipeline_over_one_process_one_rank_cores": (
            med["planned"] / med["one process, one rank's cores"]
        ),
        "recorded_step": in_step,
        "threads": {"rank": _rank_threads(), "one process": os.cpu_count() or 1},
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
