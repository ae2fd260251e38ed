"""``graphpipe plan``: measure a model's layers here and print the planned split beside the
even one.

The model is a Hugging Face config (``--hf DIR`` with a ``config.json``, or the JSON file
itself; the model is built from it with random weights, offline: transformers must be
installed; ``--attn`` the attention implementation, by default the one the config names,
else sdpa where the family has it, else eager) or the built-in model (``--hidden``,
``--layers``, ``--heads`` as ``graphpipe train`` takes them; ``--layers`` defaults to two
per stage, so that there are splits to choose among). A batch of ``--batch-size`` x
``--seq-len`` random tokens is split into ``--microbatches``;
``graphpipe.models.plan_hf_split`` / ``plan_llama_split`` measure every piece on one
micro-batch and ``graphpipe.plan_stages`` chooses the split. With several candidates
(``--schedule auto``, several ``--microbatches``) the plan says which it was chosen among
and why (``--tie-margin``).

Argument errors (a missing config, one transformers refuses, a batch that does not split, a
bad budget, a number that is not finite) exit with status 2 before any work; a budget that
nothing fits exits with status 1 naming the shortfall; one line each. A search that takes
more than a few seconds reports on stderr how far it is and the step no split can beat. Only
the parser is built on import: the command imports torch when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Any

from graphpipe.cmdline.options import (
    add_batch_options,
    add_builtin_model_options,
    add_device_option,
    add_dtype_option,
    cuda_problem,
    first_below,
)
from graphpipe.schedule.ir import SCHEDULE_KINDS

__all__ = ["HF_FAMILIES", "add_parser", "parse_bytes", "run"]

_PROG = "graphpipe plan"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": 2**30, "tb": 10**12, "tib": 2**40}

HF_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "gpt2",
)
"""``graphpipe.models.hf.SUPPORTED_MODEL_TYPES``, written out for the help text (importing it
imports torch; ``tests/test_plan_cli.py`` holds the two equal)."""

_PROGRESS_AFTER_S = 3.0
"""A search still running after this long reports on stderr, and again as often."""


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MB"``, ``"1e9"``: a whole number of bytes >= 1 (the argparse type)."""
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
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is too large to be a number of bytes")
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return math.floor(value)


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0 (the argparse type of ``--p2p``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """A fraction in [0, 1) (the argparse type of ``--tie-margin``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.05, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}")
    return value


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
            "step, each stage's F/B/I/W and each rank's predicted peak memory, then how to "
            "use it: split_hf_causal_lm(..., layers_per_stage=[...]) for an HF model, "
            "graphpipe train --layers-per-stage (DualPipeV) or build_stages(..., "
            "layers_per_stage=[...]) for the built-in one."
        ),
    )
    p.add_argument(
        "--hf",
        metavar="CONFIG",
        default=None,
        help="a Hugging Face causal LM: a directory holding config.json, or the JSON file. "
        f"The model_types split_hf_causal_lm is tested on: {', '.join(HF_FAMILIES)}; "
        "another of the Llama or GPT-2 module layout is checked against the model on a "
        "probe when it is split (default: the built-in model)",
    )
    p.add_argument(
        "--attn",
        choices=("auto", "eager", "sdpa"),
        default="auto",
        help="the attention implementation of an --hf model; auto: the config's "
        "attn_implementation if it is eager or sdpa, else sdpa where the family has it "
        "(not Gemma 2, for one), else eager (default auto)",
    )
    p.add_argument("--ranks", type=int, default=2, metavar="N", help="pipeline ranks (default 2)")
    p.add_argument(
        "--schedule",
        choices=[*sorted(SCHEDULE_KINDS), "auto"],
        default="dualpipev",
        help="the schedule to plan for; auto: dualpipev or zbv, whichever fits "
        "--memory-budget and is faster, by the rule of --tie-margin (default dualpipev)",
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
    p.add_argument(
        "--tie-margin",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="with candidates to choose from (--schedule auto, several --microbatches): "
        "plans within this fraction of the fastest predicted step are tied, and the one "
        "that holds least on the even split wins, so that runs whose measured costs differ "
        "a little choose alike (default 0.05, graphpipe.models.planning.TIE_MARGIN)",
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
        help="timed rounds per piece after one warm-up; the median counts (default 3)",
    )
    p.add_argument(
        "--p2p",
        type=_seconds,
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
    add_builtin_model_options(
        g,
        layers_default="2 per stage, so that the planner has splits to choose among: 8 for "
        "--ranks 2 under dualpipev",
    )
    p.set_defaults(func=run, parser=p)
    return p


def _stages(args: argparse.Namespace) -> int:
    from graphpipe.schedule.generators import SCHEDULES

    per_rank = 2 if args.schedule == "auto" else SCHEDULES[args.schedule].stages_per_rank
    return args.ranks * per_rank


def _check(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments (one line), or None; fills in the defaults."""
    from graphpipe.train.options import default_microbatches

    problem = first_below(args, 1, "ranks", "batch_size", "seq_len", "reps", "hidden", "heads")
    if problem is not None:
        return problem
    problem = cuda_problem(args.device)
    if problem is not None:
        return problem
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
        if args.attn != "auto":
            return f"--attn {args.attn} is for an --hf model (the built-in model has its own)"
        if args.layers is None:
            args.layers = 2 * _stages(args)
        problem = first_below(args, 1, "layers")
        if problem is not None:
            return problem
        if args.hidden % args.heads or (args.hidden // args.heads) % 2:
            return (
                f"--hidden {args.hidden} must split into --heads {args.heads} heads of an even size"
            )
    return None


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (transformers' validation errors span several)."""
    return " ".join(str(error).split()) or type(error).__name__


def _hf_model(path: str, dtype: Any, attn: str) -> tuple[Any, str]:
    """The HF causal LM of the config at ``path`` (random weights, transformers' init) and
    its attention implementation (``attn``, or for ``"auto"`` see ``--attn``). A config
    transformers refuses is a ``ValueError`` naming the file and the problem."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError as e:
        raise SystemExit(f"{_PROG}: error: --hf needs transformers ({e})") from None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--hf {path}: not a readable JSON config: {_one_line(e)}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"--hf {path}: the config has no model_type")
    model_type = data.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as e:  # transformers' and huggingface_hub's validation errors alike
        raise ValueError(
            f"--hf {path}: transformers refuses the config ({type(e).__name__}): {_one_line(e)}"
        ) from None
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        raise ValueError(
            f"--hf {path}: model_type {model_type!r} has no causal LM class in transformers"
        )
    if attn == "auto":
        asked = getattr(config, "_attn_implementation", None)
        attn = asked if asked in ("eager", "sdpa") else None
        attn = attn or ("sdpa" if getattr(cls, "_supports_sdpa", False) else "eager")
    if attn == "sdpa" and not getattr(cls, "_supports_sdpa", False):
        raise ValueError(
            f"--hf {path}: {cls.__name__} has no sdpa attention in transformers "
            f"{transformers.__version__}: pass --attn eager (or auto)"
        )
    config._attn_implementation = attn
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # the family refuses the attention, or the config's sizes
        raise ValueError(
            f"--hf {path}: transformers cannot build {cls.__name__} with --attn {attn} "
            f"({type(e).__name__}): {_one_line(e)}"
        ) from None
    return model.to(dtype), attn


class _Progress:
    """A search that runs long reports on stderr: how far, its best step, the bound."""

    def __init__(self) -> None:
        self.next = _PROGRESS_AFTER_S
        self.started: dict[tuple[str, int], float] = {}

    def __call__(self, p: Any) -> None:
        key = (p.schedule, p.num_microbatches)
        if key not in self.started:
            self.started[key] = time.perf_counter()
            self.next = _PROGRESS_AFTER_S
        if p.elapsed_s < self.next:
            return
        self.next = p.elapsed_s + _PROGRESS_AFTER_S
        gain = p.best_step_s / p.bound_s - 1 if p.bound_s > 0 else math.inf
        over = (
            f", {p.best_over_budget_bytes / 2**20:.1f} MiB over the budget"
            if p.best_over_budget_bytes
            else ""
        )
        print(
            f"{_PROG}: {p.schedule}, {p.num_microbatches} micro-batches: "
            f"{p.simulations:,} splits simulated in {p.elapsed_s:.0f} s ({p.phase}); best "
            f"step {p.best_step_s * 1e3:.4g} ms{over}; no split can beat "
            f"{p.bound_s * 1e3:.4g} ms (at most {gain:.1%} left to gain)",
            file=sys.stderr,
            flush=True,
        )


def _use_it(args: argparse.Namespace, plan: Any, stages: int) -> str:
    """How to use the plan: the call (an HF model), or the command (the built-in model)."""
    counts = list(plan.layers_per_stage)
    if args.hf is not None:
        return f"use it: split_hf_causal_lm(model, {stages}, layers_per_stage={counts})"
    call = f"build_stages(config, {stages}, layers_per_stage={counts})"
    if plan.schedule != "dualpipev":
        return f"use it: {call}  (graphpipe train runs dualpipev)"
    flags = [
        f"--ranks {args.ranks}",
        f"--hidden {args.hidden}",
        f"--heads {args.heads}",
        f"--batch-size {args.batch_size}",
        f"--seq-len {args.seq_len}",
        f"--microbatches {plan.num_microbatches}",
        f"--layers-per-stage {','.join(map(str, counts))}",
    ]
    if args.no_kernels:
        flags.insert(3, "--no-kernels")
    return f"use it: graphpipe train {' '.join(flags)}  ({call})"


def run(args: argparse.Namespace) -> int:
    """``graphpipe plan``: check the arguments, measure, plan, print."""
    problem = _check(args)
    if problem is not None:
        args.parser.error(problem)
    import torch

    from graphpipe.models import LlamaConfig, plan_hf_split, plan_llama_split
    from graphpipe.schedule.planner import MemoryBudgetExceeded

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    stages = _stages(args)
    gen = torch.Generator().manual_seed(0)
    common: dict[str, Any] = dict(
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        memory_budget=args.memory_budget,
        reps=args.reps,
        p2p=args.p2p,
        progress=_Progress(),
    )
    if args.tie_margin is not None:
        common["tie_margin"] = args.tie_margin
    try:
        if args.hf is not None:
            model, attn = _hf_model(args.hf_config, dtype, args.attn)
            model = model.to(args.device)
            vocab = model.config.vocab_size
            ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen)
            ids = ids.to(args.device)
            plan = plan_hf_split(model, stages, input_ids=ids, **common)
            what = f"{type(model).__name__} from {args.hf} ({attn} attention)"
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
        data = {"model": what, "layers": layers, **plan.as_dict(), "choice": plan.choice()}
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"{what}: {layers} layers; micro-batch {rows} x {args.seq_len} tokens, {args.dtype}; "
        f"costs measured here ({args.device}), {args.reps} rounds per piece"
    )
    print(plan.format())
    print(_use_it(args, plan, stages))
    return 0
