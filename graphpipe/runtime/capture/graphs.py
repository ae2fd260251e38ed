"""CUDA graph capture and replay of a static step (the thin GPU-only layer).

A capture is a list of entries ``(name, eager part, part to capture)``: each captured part
becomes one graph (all sharing one memory pool, captured on the pipeline's capture stream),
each eager part runs before it, at capture and at every replay. Granularities
(``Pipeline._capture_entries``): ``step``, one graph holding the whole static step, its
asynchronous P2P included (communication streams forked and joined inside the graph); and
``action``, one graph per compute action replayed inside the range named after it, with the
action's P2P posted and waited eagerly before it (a graph must join every stream it forks, so
a transfer in flight across actions cannot live inside per-action graphs). NCCL rules:
communicators are warmed up by the eager warmup step, all ranks enter capture together
(barrier), graphs are destroyed before the process group (``Pipeline.close()``).

UNTESTED ON GPU until a GPU run proves it: the tests in ``tests/gpu`` exercise this layer and
skip without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphpipe.nvtx import Ranges

__all__ = ["CapturedGraphs"]

Entry = tuple[str, Callable[[], Any] | None, Callable[[], Any] | None]


class CapturedGraphs:
    """Graphs of one static step, replayed in the order they were captured.

    names / graphs / eager: per entry, its name, its graph (None: nothing captured) and its
    eager part (None: nothing to run before the graph).
    """

    def __init__(self) -> None:
        self.graphs: list[Any] = []
        self.names: list[str] = []
        self.eager: list[Callable[[], Any] | None] = []

    @staticmethod
    def capture(entries: Sequence[Entry], stream: Any = None) -> CapturedGraphs:
        """Run each entry's eager part, then capture its other part into its own graph, on
        ``stream`` (default: a new side stream), all graphs sharing one memory pool."""
        out = CapturedGraphs()
        pool = torch.cuda.graph_pool_handle()
        stream = stream if stream is not None else torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for name, eager, fn in entries:
            if eager is not None:
                eager()
            g = None
            if fn is not None:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    fn()
            out.graphs.append(g)
            out.names.append(name)
            out.eager.append(eager)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def replay(self, ranges: Ranges) -> None:
        """Replay every entry in capture order inside ``step``: its eager part, then its graph;
        with more than one graph, each inside the range named after its entry, so Nsight shows
        the schedule."""
        depth = ranges.depth
        ranges.push("step")
        try:
            named = len(self.graphs) > 1
            for name, eager, g in zip(
                self.names, self.eager or [None] * len(self.graphs), self.graphs, strict=True
            ):
                if eager is not None:
                    eager()
                if g is None:
                    continue
                if named:
                    ranges.push(name)
                    g.replay()
                    ranges.pop()
                else:
                    g.replay()
        finally:
            ranges.unwind(depth)

    def reset(self) -> None:
        for g in self.graphs:
            if g is not None:
                g.reset()
        self.graphs.clear()
        self.names.clear()
        self.eager.clear()
