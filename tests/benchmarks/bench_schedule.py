"""What one action costs in ``graphpipe schedule``'s path, at two sizes: a linear pass keeps it.

Not part of the default test run (``--ignore=tests/benchmarks``); run it with

    python -m pytest tests/benchmarks/bench_schedule.py -p no:cacheprovider -s

One process: ``simulate.figures`` (generate, validate, lower, simulate) of DualPipeV on N
ranks and 2N micro-batches; 256 ranks have 16 times the actions of 64, so a quadratic pass
would make each action 16 times dearer. Prints CPU microseconds per action, the best of three.
"""

from __future__ import annotations

import time

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.simulate import figures


def _seconds_per_action(n: int, repeats: int = 3) -> float:
    kind = SCHEDULES["dualpipev"]
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        cells = kind.cells(n, 2 * n)
        figures(cells, kind.placement(n), 2 * n)
        best = min(best, time.process_time() - start)
    return best / (len(cells) + int((cells.second >= 0).sum()))


def test_cost_per_action_at_64_and_256_ranks() -> None:
    small, large = _seconds_per_action(64), _seconds_per_action(256)
    print(
        f"\nDualPipeV figures: {small * 1e6:.2f} us per action at N=64, "
        f"{large * 1e6:.2f} at N=256 (ratio {large / small:.2f})"
    )
