"""The options that several ``graphpipe`` commands share, and the checks of their values.

Owns: the argparse types ``positive_int``, ``non_negative_int`` and ``costs_arg`` (errors at
parse time: ``graphpipe CMD: error: argument --X: ...``).

Imports nothing heavy: every parser is built from here without torch (``graphpipe CMD
--help`` answers without it).
"""

from __future__ import annotations

import argparse

from graphpipe.costs import Costs

__all__ = ["costs_arg", "non_negative_int", "positive_int"]


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
