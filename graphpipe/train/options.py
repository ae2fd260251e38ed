"""The options of ``graphpipe train``'s model, data and pipeline, shared with ``profile``.

Owns: ``add_model_options`` (the argparse options; those other commands have too, such as
``--device``, ``--hidden`` or ``--batch-size``, are ``graphpipe.cmdline.options``' builders) and
the defaults that depend on other options (``default_microbatches``, ``default_layers``).
Imports nothing heavy: the command line builds its parsers from here without importing torch.
"""

from __future__ import annotations

import argparse

from graphpipe.cmdline.options import (
    add_batch_options,
    add_builtin_model_options,
    add_device_option,
    add_dtype_option,
)

__all__ = ["add_model_options", "default_layers", "default_microbatches", "layer_counts"]


def default_microbatches(ranks: int, batch_size: int) -> int | None:
    """The default ``--microbatches``: 4N if it divides the batch, else the smallest divisor
    of the batch that is at least 2N (None if there is none)."""
    if batch_size % (4 * ranks) == 0:
        return 4 * ranks
    return next((m for m in range(2 * ranks, batch_size + 1) if batch_size % m == 0), None)


def default_layers(ranks: int) -> int:
    """The default ``--layers``: 4, or enough for every middle stage of 2N stages to get one."""
    return max(4, 2 * ranks - 2)


def layer_counts(text: str) -> list[int]:
    """``--layers-per-stage 2,4,4,2``: whole numbers separated by commas (the argparse type;
    ``checks`` holds them against the stages and ``--layers``)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas (like 2,4,4,2), got {text!r}"
        ) from None


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model, data and pipeline options that ``train`` shares with ``profile``."""
    p.add_argument(
        "--ranks",
        type=int,
        default=2,
        metavar="N",
        help="pipeline ranks (default 2); under torchrun: WORLD_SIZE / --dp",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="D",
        help="data-parallel replicas of the pipeline: world = N x D ranks, each replica takes "
        "1/D of every batch (default 1)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per step, at least 2N; they split each replica's share of "
        "--batch-size evenly (default 4N, or the smallest divisor of that share that is at "
        "least 2N: 8 for N=3)",
    )
    add_batch_options(p)
    add_builtin_model_options(p, layers_note=", or the sum of --layers-per-stage")
    p.add_argument(
        "--layers-per-stage",
        type=layer_counts,
        default=None,
        metavar="C0,C1,...",
        help="decoder layers of each of the 2N stages, in stage order (stage 0 holds the "
        "embedding, stage 2N-1 the head; under DualPipeV rank r holds stages r and 2N-1-r): "
        "every middle stage at least one, the first and last may hold none; `graphpipe plan` "
        "suggests one (default: as even as possible)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="AdamW learning rate (default 3e-3; also applied to a resumed optimizer)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and data order (default 0)")
    p.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="a text file to train on (default: the Python standard library's *.py files)",
    )
    add_device_option(p)
    add_dtype_option(p, meaning="bfloat16 runs the stages under torch.autocast")
    p.add_argument(
        "--capture",
        choices=("none", "step", "action"),
        default="none",
        help="capture the step after one eager warmup step and replay it: CUDA graphs on "
        "GPU, CPU graphs with the same semantics on CPU; one graph per step or per action "
        "(default none)",
    )
    _add_moe_options(p)


def _add_moe_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument(
        "--experts", type=int, default=0, help="experts per MoE block; 0: dense (default 0)"
    )
    g.add_argument("--top-k", type=int, default=1, help="experts per token (default 1)")
    g.add_argument(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="slots per expert = ceil(C * tokens * k / experts) (default 1.25)",
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks: each MoE block's experts are sharded over --ep "
        "replicas, so --ep must divide --dp (default 1)",
    )
