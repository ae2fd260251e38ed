"""The names ``graphpipe bench``'s parser offers, without torch: the regimes and the synthetic
regime's default costs (``regimes`` and ``synthetic`` use them; ``--help`` needs them
before anything heavy is imported)."""

from __future__ import annotations

from graphpipe.schedule.costs import Costs

__all__ = ["REGIMES", "REGIME_CHOICES", "SYNTHETIC_COSTS"]

REGIMES = ("overhead", "compute", "realistic", "sweep")
REGIME_CHOICES = (*REGIMES, "both", "all")

SYNTHETIC_COSTS = Costs(F=10, B=20, I=10, W=10, FB=25)
"""Milliseconds: DualPipe's shape (B = 2F, I = W = F) with an overlapped pair 5/6 of F + B."""
