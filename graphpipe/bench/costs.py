"""The simulator comparison: measured F/B/I/W stage costs and P2P exchange times become
``simulate.Costs``; the prediction is set against the measured step and its bubble."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .measure import wall_time
from .regimes import Workload

__all__ = [
    "action_times",
    "in_step_slowdown",
    "mean_costs",
    "measured_bubble",
    "p2p_cost",
    "simulation",
    "stage_costs",
]


class _StageTimer:
    """Times one stage's F, B, I and W alone, with graphpipe's deferrable Linears."""

    def __init__(self, mod: nn.Module, x_in: Any, key: int, loss: Callable | None) -> None:
        from graphpipe.weightgrad import WeightGradStore, make_deferrable

        self.mod, self.x_in, self.key, self.loss = mod, x_in, key, loss
        self.store = WeightGradStore()
        make_deferrable(mod, self.store)
        self.out: Any = None
        self.grad: Any = None

    def forward(self, split: bool = False) -> None:
        """As the executor runs it: ``split`` for a micro-batch whose backward is I + W."""
        self.store.split = split
        x = self.x_in
        x = x.detach().requires_grad_() if x.is_floating_point() else x
        out = self.mod(x)
        if self.loss is not None:
            out = self.loss(out)
        self.out = out
        self.grad = torch.ones_like(out) if self.loss is not None else torch.randn_like(out)

    def backward(self) -> None:
        self.store.accumulating = True  # as the executor's B: large Linears fuse into .grad
        try:
            torch.autograd.backward(self.out, self.grad)
        finally:
            self.store.accumulating = False

    def backward_input(self) -> None:
        with self.store.deferring(self.key):
            torch.autograd.backward(self.out, self.grad)

    def weight(self) -> None:
        self.store.run(self.key)


def stage_costs(
    w: Workload, rank: int, world: int, device: torch.device, reps: int
) -> dict[str, float]:
    """Median F, B, I, W (seconds) of this rank's two stages, each alone, summed over both."""
    stages, inputs, labels = w.stage_inputs(2 * world, device)
    loss_fn = w.loss_fn()
    last = 2 * world - 1
    totals = dict.fromkeys("FBIW", 0.0)
    for s in (rank, last - rank):
        loss = (lambda out: loss_fn(out, labels)) if s == last else None
        timer = _StageTimer(copy.deepcopy(stages[s]), inputs[s], s, loss)
        times: dict[str, list[float]] = {k: [] for k in "FBIW"}
        for _ in range(reps):
            times["F"].append(wall_time(timer.forward, device))
            times["B"].append(wall_time(timer.backward, device))
            timer.forward(split=True)
            times["I"].append(wall_time(timer.backward_input, device))
            times["W"].append(wall_time(timer.weight, device))
        for key, ts in times.items():
            totals[key] += statistics.median(ts)
    return totals


def p2p_cost(
    w: Workload, rank: int, world: int, device: torch.device, group: Any, reps: int
) -> dict[str, float]:
    """One batched two-way exchange of one activation between ranks 0 and 1, ``reps`` times:
    median and mean seconds, and the fraction slower than 1 ms (transport stalls)."""
    none = {"median_s": 0.0, "mean_s": 0.0, "over_1ms": 0.0}
    if world < 2 or rank >= 2:
        return none
    _, inputs, _ = w.stage_inputs(2 * world, device)
    buf = inputs[1].detach().clone()
    out = torch.empty_like(buf)
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, buf, peer, group), dist.P2POp(dist.irecv, out, peer, group)]

    def exchange() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    times = [wall_time(exchange, device) for _ in range(reps + 2)]
    times = times[2:]
    return {
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "over_1ms": sum(t > 1e-3 for t in times) / len(times),
    }


def simulation(
    w: Workload,
    world: int,
    per_rank_costs: list[dict[str, float]],
    p2p: dict[str, float],
    host_per_action: float | None,
    slowdown: float | None = None,
) -> tuple[dict[str, Any], Any]:
    """Costs (mean over stages) -> simulated makespan and bubble, in variants: compute only,
    plus the median or the mean P2P exchange per batch, plus the host overhead per action,
    and (``slowdown``: ``in_step_slowdown``'s worst rank) the mean P2P with every cost
    multiplied by how much slower the actions ran inside the recorded step than alone.
    Also returns the ``SimResult`` of the mean-P2P variant (for the plot)."""
    from graphpipe.schedule.generators import SCHEDULES
    from graphpipe.schedule.lower import lower
    from graphpipe.schedule.simulate import Costs, simulate

    mean = mean_costs(per_rank_costs, world)
    schedule, placement = SCHEDULES["dualpipev"](world, w.microbatches)
    variants: dict[str, Costs] = {
        "compute_only": Costs(**mean),
        "with_p2p_median": Costs(**mean, p2p=p2p["median_s"]),
        "with_p2p_mean": Costs(**mean, p2p=p2p["mean_s"]),
    }
    if host_per_action is not None:
        h = max(host_per_action, 0.0)
        variants["with_p2p_mean_and_host_overhead"] = Costs(
            **{k: v + h for k, v in mean.items()}, p2p=p2p["mean_s"]
        )
    if slowdown is not None:
        variants["with_p2p_mean_and_in_step_costs"] = Costs(
            **{k: v * slowdown for k, v in mean.items()}, p2p=p2p["mean_s"]
        )
    out: dict[str, Any] = {"costs_s": mean, "p2p": p2p, "predictions": {}}
    picture = None
    for name, costs in variants.items():
        res = simulate(lower(schedule, placement, durations=costs.of), placement, costs)
        out["predictions"][name] = {
            "makespan_s": res.makespan,
            "bubble_fraction": res.bubble_fraction,
            "per_rank_bubble": [r.bubble_fraction for r in res.ranks],
        }
        if name == "with_p2p_mean":
            picture = res
    return out, picture


def action_times(
    records: list[dict[str, Any]], world: int, cost: Callable[[Any], float] | None = None
) -> tuple[list[float], list[float]]:
    """Per rank: the time its compute actions took in a recorded step (the ranges named
    after an ``Action``: not ``step``, not the waits), and what ``cost(action)`` gives the
    same actions (zeros without ``cost``)."""
    from graphpipe.schedule.ir import Action

    taken = [0.0] * world
    predicted = [0.0] * world
    for r in records:
        if r["label"] == "step":
            continue
        try:
            a = Action.parse(r["label"])
        except ValueError:
            continue
        taken[r["rank"]] += r["end"] - r["start"]
        if cost is not None:
            predicted[r["rank"]] += cost(a)
    return taken, predicted


def measured_bubble(records: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Busy time per rank (its actions) over the recorded step's makespan."""
    steps = [r for r in records if r["label"] == "step"]
    makespan = max(r["end"] for r in steps) if steps else 0.0
    busy, _ = action_times(records, world)
    per_rank = [1 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return {
        "makespan_s": makespan,
        "bubble_fraction": sum(per_rank) / world,
        "per_rank_bubble": per_rank,
    }


def in_step_slowdown(
    records: list[dict[str, Any]], world: int, per_rank_costs: list[dict[str, float]]
) -> list[float]:
    """Per rank: the time its compute actions (F, B, I, W, overlapped pairs as F + B) took in
    the recorded step over what the measured costs (the mean per stage, as the simulation
    uses) give the same actions. Above 1: the actions run slower inside the step than
    alone (the other rank's compute and gloo's threads on the same cores, caches); the
    rest of the gap to the simulation is waiting. 0 for a rank with no compute recorded."""
    from graphpipe.schedule.simulate import Costs

    costs = Costs(**mean_costs(per_rank_costs, world))
    taken, predicted = action_times(records, world, costs.of)
    return [t / p if p > 0 else 0.0 for t, p in zip(taken, predicted, strict=True)]


def mean_costs(per_rank_costs: list[dict[str, float]], world: int) -> dict[str, float]:
    """The mean F, B, I, W per stage (each rank's figures are its two stages' sums)."""
    return {k: sum(c[k] for c in per_rank_costs) / (2 * world) for k in "FBIW"}
