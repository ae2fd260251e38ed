"""The options that several ``graphpipe`` commands share, and the checks of their values.

One builder per option (or per group of options that go together), taking only what truly
differs between the commands: what a choice means there, a note, a default's explanation.
The names, choices, types and defaults are written here once, so that ``--device``,
``--hidden`` or ``--batch-size`` read and behave the same in every command that has them.

Owns: the argparse types ``positive_int``, ``non_negative_int`` and ``costs_arg`` (errors at
parse time: ``graphpipe CMD: error: argument --X: ...``); ``add_device_option`` and
``cuda_problem`` (``--device cuda`` on a torch without CUDA); ``add_batch_options``
(``--batch-size``, ``--seq-len``); ``add_builtin_model_options`` (the built-in Llama's
``--hidden``, ``--layers``, ``--heads``, ``--no-kernels``); ``add_dtype_option``; and
``first_below``, the ``--X must be >= K, got V`` check of values checked after parsing.
Options of one command stay with it; ``--memory-limit`` is ``graphpipe.schedule.footprint``'s.

Imports nothing heavy: every parser is built from here without torch (``graphpipe CMD
--help`` answers without it); ``cuda_problem`` imports torch only for ``--device cuda``.
"""

from __future__ import annotations

import argparse
from typing import Any

from graphpipe.schedule.costs import Costs

__all__ = [
    "DEVICES",
    "DTYPES",
    "RANK_DEVICES",
    "add_batch_options",
    "add_builtin_model_options",
    "add_device_option",
    "add_dtype_option",
    "costs_arg",
    "cuda_problem",
    "first_below",
    "non_negative_int",
    "positive_int",
]

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
RANK_DEVICES = "cpu: gloo ranks; cuda: NCCL, one GPU per rank"
"""What ``--device`` means to a command that spawns ranks (``train``, ``profile``, ``bench``)."""


# --------------------------------------------------------------------------------------------
# argparse types


def positive_int(text: str) -> int:
    """A whole number >= 1 (the argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (the argparse type)."""
    try:
        value = int(text)
    except ValueError:
        return positive_int(text)  # its "expected a whole number" error
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def costs_arg(text: str) -> Costs:
    """``F=1,B=2,...``: ``Costs.parse`` as the argparse type."""
    try:
        return Costs.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --------------------------------------------------------------------------------------------
# Option builders (``p``: a parser or an argument group)


def add_device_option(p: Any, *, meaning: str = RANK_DEVICES, note: str | None = None) -> None:
    """``--device cpu|cuda`` (default cpu): ``meaning``, what each choice means to the
    command; ``note``, what else it does (in parentheses)."""
    extra = f" ({note})" if note else ""
    p.add_argument(
        "--device", choices=DEVICES, default="cpu", help=f"{meaning}{extra} (default cpu)"
    )


def add_dtype_option(p: Any, *, meaning: str) -> None:
    """``--dtype float32|bfloat16`` (default float32): ``meaning``, what the choice changes."""
    p.add_argument(
        "--dtype", choices=DTYPES, default="float32", help=f"{meaning} (default float32)"
    )


def add_batch_options(p: Any) -> None:
    """``--batch-size`` (default 16) and ``--seq-len`` (default 64): one step's tokens."""
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="sequences per step, a multiple of --microbatches (default 16)",
    )
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")


def add_builtin_model_options(
    p: Any, *, layers_note: str = "", layers_default: str = "max(4, 2N-2): 4 for N <= 3"
) -> None:
    """The built-in Llama's shape: ``--hidden`` (default 64), ``--layers`` (default None:
    ``train.options.default_layers``, which ``layers_default`` describes; a command that
    fills in another says so there), ``--heads`` (default 4) and ``--no-kernels``;
    ``layers_note``, what else ``--layers`` defaults to (in its default's parentheses)."""
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers, at least one per middle stage "
        f"(default {layers_default}{layers_note})",
    )
    p.add_argument(
        "--heads",
        type=int,
        default=4,
        help="attention heads; --hidden / --heads must be even (default 4)",
    )
    p.add_argument(
        "--no-kernels", action="store_true", help="plain torch ops instead of graphpipe.kernels"
    )


# --------------------------------------------------------------------------------------------
# Checks after parsing (each returns the one-line problem, or None)


def first_below(args: argparse.Namespace, minimum: int, *names: str) -> str | None:
    """The first of the options ``names`` (their ``args`` attributes, in order) whose value
    is below ``minimum``, as ``--NAME must be >= MINIMUM, got VALUE``; None (an option left
    to a default that depends on others) passes."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            return f"--{name.replace('_', '-')} must be >= {minimum}, got {value}"
    return None


def cuda_problem(device: str) -> str | None:
    """``--device cuda`` on a torch without CUDA, as one line (None for cpu, or with CUDA);
    imports torch only for cuda."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return f"--device cuda: CUDA is not available to this torch ({torch.__version__})"
    return None
