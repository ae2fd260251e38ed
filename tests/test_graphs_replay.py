"""The replay side of the CUDA-graph layer, with stand-in graphs (runs without CUDA)."""

from __future__ import annotations

import torch

from graphpipe.graphs import CapturedGraphs
from graphpipe.nvtx import Ranges


class FakeGraph:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def replay(self) -> None:
        self.log.append(self.name)

    def reset(self) -> None:
        self.log.append(f"reset {self.name}")


def _graphs(names: list[str], log: list) -> CapturedGraphs:
    out = CapturedGraphs()
    out.graphs = [FakeGraph(log, n) for n in names]
    out.names = list(names)
    return out


def test_action_graphs_replay_in_capture_order_each_in_its_named_range():
    log: list[str] = []
    names = ["0F0", "(1F1;0B0)OVERLAP_F_B", "0W2", "loss"]
    graphs = _graphs(names, log)
    ranges = Ranges(use_nvtx=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        graphs.replay(ranges)
    assert log == names
    seen = [e.name for e in prof.events() if e.name in {"step", *names}]
    assert seen[0] == "step" and seen[1:] == names
    assert ranges.depth == 0


def test_a_failing_replay_closes_its_ranges_and_reset_drops_every_graph():
    log: list[str] = []
    graphs = _graphs(["a", "b"], log)

    def boom() -> None:
        raise RuntimeError("replay failed")

    graphs.graphs[1].replay = boom
    ranges = Ranges(use_nvtx=False)
    try:
        graphs.replay(ranges)
    except RuntimeError:
        pass
    assert ranges.depth == 0
    graphs.reset()
    assert log == ["a", "reset a", "reset b"]
    assert graphs.graphs == [] and graphs.names == []
