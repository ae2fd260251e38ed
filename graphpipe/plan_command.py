"""``graphpipe plan``: measure a model's layers here and print the planned split beside the
even one.

The model is a Hugging Face config (``--hf DIR`` with a ``config.json``, or the JSON file
itself; the model is built from it with random weights, offline: transformers must be
installed) or the built-in model (``--hidden``, ``--layers``, ``--heads`` as ``graphpipe
train`` takes them). A batch of ``--batch-size`` x ``--seq-len`` random tokens is split into
``--microbatches``; ``graphpipe.models.plan_hf_split`` / ``plan_llama_split`` measure every
piece on one micro-batch and ``graphpipe.plan_stages`` chooses the split.

Argument errors (a missing config, a batch that does not split, a bad budget) exit with
status 2 before any work; a budget that nothing fits exits with status 1 naming the
shortfall; one line each. Only the parser is built on import: the command imports torch when
it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from graphpipe.cli_options import (
    add_batch_options,
    add_builtin_model_options,
    add_device_option,
    add_dtype_option,
    cuda_problem,
    first_below,
)
from graphpipe.ir import SCHEDULE_KINDS

__all__ = ["add_parser", "parse_bytes", "run"]

_PROG = "graphpipe plan"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": 2**30, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MB"``, ``"1e9"``: a number of bytes > 0 (the argparse type)."""
    found = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = found[2].lower() if found else ""
    if not found or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected bytes like 8GiB, 512MiB, 2GB or 1000000000, got {text!r}"
        )
    try:
        value = float(found[1]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{found[1]!r} is not a number") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return round(value)


def _counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas (like 8,16), got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every count must be >= 1, got {text!r}")
    return values


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``graphpipe plan`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "plan",
        help="measure a model's layers and print the planned stage split beside the even one",
        description=(
            "Measure every decoder layer, the embedding and the head with the loss of a "
            "Hugging Face causal LM (--hf: built from its config with random weights, "
            "offline) or of the built-in model, on one micro-batch in this process, then "
            "choose how many layers each stage holds by the schedule's simulated step "
            "(graphpipe.plan_stages). Prints the plan beside the even split: the predicted "
            "step, each stage's F/B/I/W and each rank's predicted peak memory. The result is "
            "what --layers-per-stage (graphpipe train) and layers_per_stage= take."
        ),
    )
    p.add_argument(
        "--hf",
        metavar="CONFIG",
        default=None,
        help="a Hugging Face model: a directory holding config.json, or the JSON file "
        "(LlamaForCausalLM, Mistral, Qwen2, Qwen3; default: the built-in model)",
    )
    p.add_argument("--ranks", type=int, default=2, metavar="N", help="pipeline ranks (default 2)")
    p.add_argument(
        "--schedule",
        choices=[*sorted(SCHEDULE_KINDS), "auto"],
        default="dualpipev",
        help="the schedule to plan for; auto: the faster of dualpipev and zbv that fits "
        "--memory-budget (default dualpipev)",
    )
    p.add_argument(
        "--microbatches",
        type=_counts,
        default=None,
        metavar="M[,M2,...]",
        help="micro-batches per step, or candidates to choose from (each measured on its own "
        "micro-batch; default as graphpipe train: 4N, or the smallest divisor of "
        "--batch-size that is at least 2N)",
    )
    add_batch_options(p)
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="the most each rank may hold (8GiB, 512MiB, bytes): the plan fits it, or the "
        "command names the shortfall and exits with status 1",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=3,
        help="timed rounds per piece after one warm-up; the fastest counts (default 3)",
    )
    p.add_argument(
        "--p2p",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="latency of each cross-rank transfer in the prediction (default 0)",
    )
    add_dtype_option(p, meaning="the model's dtype")
    add_device_option(
        p,
        meaning="where the pieces are measured: cpu (with the threads each of the --ranks CPU "
        "ranks gets) or cuda (the current GPU)",
    )
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    g = p.add_argument_group("the built-in model (without --hf)")
    add_builtin_model_options(g)
    p.set_defaults(func=run, parser=p)
    return p


def _check(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments (one line), or None; fills in the defaults."""
    from graphpipe.train.options import default_layers, default_microbatches

    problem = first_below(args, 1, "ranks", "batch_size", "seq_len", "reps", "hidden", "heads")
    if problem is not None:
        return problem
    problem = cuda_problem(args.device)
    if problem is not None:
        return problem
    if not args.p2p >= 0:
        return f"--p2p must be >= 0, got {args.p2p}"
    if args.microbatches is None:
        m = default_microbatches(args.ranks, args.batch_size)
        if m is None:
            return (
                f"--batch-size {args.batch_size} does not split into 2 * --ranks = "
                f"{2 * args.ranks} or more equal micro-batches; pass --microbatches"
            )
        args.microbatches = [m]
    for m in args.microbatches:
        if args.batch_size % m:
            return f"--batch-size {args.batch_size} does not split into {m} equal micro-batches"
    if args.hf is not None:
        path = args.hf
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            return f"--hf {args.hf}: no such file (expected a directory with config.json, or it)"
        args.hf_config = path
    else:
        if args.layers is None:
            args.layers = default_layers(args.ranks)
        problem = first_below(args, 1, "layers")
        if problem is not None:
            return problem
        if args.hidden % args.heads or (args.hidden // args.heads) % 2:
            return (
                f"--hidden {args.hidden} must split into --heads {args.heads} heads of an even size"
            )
    return None


def _hf_model(path: str, dtype: Any) -> Any:
    """The HF causal LM of the config at ``path``, random weights (transformers' init)."""
    try:
        import transformers
    except ImportError as e:
        raise SystemExit(f"{_PROG}: error: --hf needs transformers ({e})") from None
    with open(path) as f:
        data = json.load(f)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"--hf {path}: the config has no model_type")
    config = transformers.AutoConfig.for_model(model_type, **data)
    if getattr(config, "_attn_implementation", None) not in ("eager", "sdpa"):
        config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def run(args: argparse.Namespace) -> int:
    """``graphpipe plan``: check the arguments, measure, plan, print."""
    problem = _check(args)
    if problem is not None:
        args.parser.error(problem)
    import torch

    from graphpipe.models import LlamaConfig, plan_hf_split, plan_llama_split
    from graphpipe.planner import MemoryBudgetExceeded
    from graphpipe.schedules import SCHEDULES

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    per_rank = 2 if args.schedule == "auto" else SCHEDULES[args.schedule].stages_per_rank
    stages = args.ranks * per_rank
    gen = torch.Generator().manual_seed(0)
    common = dict(
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        memory_budget=args.memory_budget,
        reps=args.reps,
        p2p=args.p2p,
    )
    try:
        if args.hf is not None:
            model = _hf_model(args.hf_config, dtype).to(args.device)
            vocab = model.config.vocab_size
            ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen)
            ids = ids.to(args.device)
            plan = plan_hf_split(model, stages, input_ids=ids, **common)
            what = f"{type(model).__name__} from {args.hf}"
            layers = model.config.num_hidden_layers
        else:
            cfg = LlamaConfig(
                hidden=args.hidden,
                n_layers=args.layers,
                n_heads=args.heads,
                max_seq_len=args.seq_len,
                use_kernels=not args.no_kernels,
            )
            tokens = torch.randint(
                0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen
            )
            plan = plan_llama_split(
                cfg, stages, tokens=tokens, dtype=dtype, device=args.device, **common
            )
            what = f"the built-in model (hidden {args.hidden}, {args.heads} heads)"
            layers = args.layers
    except MemoryBudgetExceeded as e:
        print(f"{_PROG}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        args.parser.error(str(e))
    rows = args.batch_size // plan.num_microbatches
    if args.format == "json":
        print(json.dumps({"model": what, "layers": layers, **plan.as_dict()}, indent=2))
        return 0
    print(
        f"{what}: {layers} layers; micro-batch {rows} x {args.seq_len} tokens, {args.dtype}; "
        f"costs measured here ({args.device}), {args.reps} rounds per piece"
    )
    print(plan.format())
    flag = ",".join(map(str, plan.layers_per_stage))
    print(f"use it: --layers-per-stage {flag}  (layers_per_stage={list(plan.layers_per_stage)})")
    return 0
