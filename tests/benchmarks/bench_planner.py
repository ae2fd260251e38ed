"""pytest-benchmark: how long ``graphpipe.plan_stages`` takes on 80 layers over 16 stages.

Not part of the default test run (``--ignore=tests/benchmarks``); run it with

    python -m pytest tests/benchmarks/bench_planner.py -p no:cacheprovider --benchmark-only \\
        --benchmark-columns=median,min,max,rounds

One process: DualPipeV on 8 ranks, 32 micro-batches, 80 layers of random costs (F, I, W
each uniform in 1..2, seeded), an embedding worth about one layer and a head worth four;
docs/planning.md quotes the figures.
"""

from __future__ import annotations

import random

from graphpipe.schedule.planner import LayerCost, plan_stages


def _layers(n: int) -> list[LayerCost]:
    rnd = random.Random(0)
    return [LayerCost(rnd.uniform(1, 2), rnd.uniform(1, 2), rnd.uniform(1, 2)) for _ in range(n)]


def test_plan_80_layers_over_16_stages(benchmark) -> None:
    layers = _layers(80)

    def run():
        return plan_stages(
            layers,
            16,
            num_microbatches=32,
            first_costs=LayerCost(1, 1, 1),
            last_costs=LayerCost(6, 6, 6),
        )

    plan = benchmark.pedantic(run, rounds=3, iterations=1)
    assert plan.predicted_step_s < plan.even_predicted_step_s
    print(f"\n{plan.simulations} splits simulated; planned / even {1 / plan.speedup:.3f}")
