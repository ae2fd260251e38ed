"""CUDA graph capture and replay of a static step (the thin GPU-only layer).

The static step (plan buffers only, no host sync) is captured with ``torch.cuda.graph`` at
one of two granularities: ``step`` (one graph per rank per step) or ``action`` (one graph per
schedule action and its P2P batch, sharing one memory pool, replayed in capture order, each
inside its NVTX range). NCCL rules: communicators are warmed up by the eager warmup step,
all ranks enter capture together (barrier), and graphs must be destroyed before the process
group (``DualPipeV.close()``).

UNTESTED ON GPU until a GPU run proves it: the tests in ``tests/gpu`` exercise this layer and
skip without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .nvtx import Ranges

__all__ = ["CapturedGraphs"]


class CapturedGraphs:
    """Graphs of one static step, replayed in the order they were captured."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.names: list[str] = []

    @staticmethod
    def capture(entries: Sequence[tuple[str, Callable[[], None]]]) -> CapturedGraphs:
        """Capture each ``(name, fn)`` into its own graph, all sharing one memory pool."""
        out = CapturedGraphs()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for name, fn in entries:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                fn()
            out.graphs.append(g)
            out.names.append(name)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def replay(self, ranges: Ranges) -> None:
        """Replay every graph in capture order: inside ``step``, and with more than one graph
        each inside the range named after its action, so Nsight shows the schedule."""
        depth = ranges.depth
        ranges.push("step")
        try:
            if len(self.graphs) == 1:
                self.graphs[0].replay()
                return
            for name, g in zip(self.names, self.graphs):
                ranges.push(name)
                g.replay()
                ranges.pop()
        finally:
            ranges.unwind(depth)

    def reset(self) -> None:
        for g in self.graphs:
            g.reset()
        self.graphs.clear()
        self.names.clear()
