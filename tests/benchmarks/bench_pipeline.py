"""pytest-benchmark: one pipeline step of graphpipe eager / replay / torch's ScheduleDualPipeV.

Not part of the default test run (``--ignore=tests/benchmarks``); run it with

    python -m pytest tests/benchmarks/bench_pipeline.py -p no:cacheprovider --benchmark-only \\
        --benchmark-group-by=group --benchmark-columns=median,iqr,min,max,rounds

How it measures, and why it is honest:

* One world of gloo processes per rank count (1: the host's work alone; 2: with P2P) is
  spawned (``graphpipe.bench.BenchWorld``)
  and driven over pipes. Each benchmark round sends "step MODE" to every rank, so every rank
  runs exactly the same steps; ranks meet at a barrier, time their own step and reply.
* ``benchmark.pedantic(rounds=R, warmup_rounds=W, iterations=1)`` fixes the step count. The
  time pytest-benchmark reports is the parent's wall time of a round: the slowest rank's step
  plus the pipe round trip and the barrier (tens of microseconds on one machine; it matters
  only in the overhead-bound group). The ranks' own figures (the slowest rank per round, the
  ground truth) are in ``extra_info``: ``rank_median_s``, ``rank_min_s``, ``rank_max_s``.
* pytest-benchmark runs one benchmark after another, so the modes are *not* interleaved here;
  on a shared machine prefer ``graphpipe bench`` (A/B interleaved per round) for comparisons,
  and use these for regression tracking (``--benchmark-autosave`` / ``--benchmark-compare``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest

from graphpipe.bench import (
    MODE_EAGER,
    MODE_REPLAY,
    MODE_TORCH,
    BenchWorld,
    Workload,
    host_workload,
    workloads,
)

RANK_COUNTS = (1, 2)  # one rank: host work alone; two: with gloo P2P between the ranks
# regime -> (rounds, warmup rounds); the workloads are graphpipe bench's for the rank count
ROUNDS: dict[str, tuple[int, int]] = {"overhead": (30, 3), "compute": (10, 2), "host": (50, 5)}
MODES = (MODE_EAGER, MODE_REPLAY, MODE_TORCH)


def workload_of(regime: str, ranks: int) -> Workload:
    if regime == "host":
        return host_workload(4 * ranks)
    return workloads(regime, ranks, "cpu")[0][0]


@pytest.fixture(scope="module", params=RANK_COUNTS, ids=[f"{n}rank" for n in RANK_COUNTS])
def world(request) -> Iterator[BenchWorld]:
    with BenchWorld(request.param) as w:
        yield w


@pytest.fixture(scope="module")
def prepared(world: BenchWorld) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Modes are built lazily, one regime at a time (building drops the previous regime's)."""
    return {}


def _modes_for(world: BenchWorld, prepared: dict, regime: str) -> tuple[list[str], dict]:
    if regime not in prepared:
        prepared.clear()
        prepared[regime] = world.setup(workload_of(regime, world.ranks))
    return prepared[regime]


@pytest.mark.parametrize("mode", MODES, ids=["eager", "replay", "torch"])
@pytest.mark.parametrize("regime", list(ROUNDS))
def test_pipeline_step(benchmark, world: BenchWorld, prepared: dict, regime: str, mode: str):
    names, skipped = _modes_for(world, prepared, regime)
    if mode not in names:
        pytest.skip(f"{mode}: {skipped.get(mode, 'not available')}")
    workload, (rounds, warmup) = workload_of(regime, world.ranks), ROUNDS[regime]
    ranks = world.ranks
    rank_times: list[float] = []

    def one_step() -> None:
        rank_times.append(world.step(mode))

    benchmark.group = f"{regime}: {workload.describe(ranks)}"
    benchmark.pedantic(one_step, rounds=rounds, warmup_rounds=warmup, iterations=1)
    measured = rank_times[warmup:]
    assert len(measured) == rounds
    benchmark.extra_info.update(
        {
            "rank_median_s": statistics.median(measured),
            "rank_min_s": min(measured),
            "rank_max_s": max(measured),
            "tokens_per_s": workload.tokens_per_step / statistics.median(measured),
            "ranks": ranks,
        }
    )
