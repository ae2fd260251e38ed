"""The graphs of a captured step, one interface for both devices.

A capture is a list of entries ``(name, eager part, part to capture)``. ``CapturedGraphs.
capture`` runs the step once through them: per entry its eager part, then its other part
captured into a graph of its own and run. ``replay`` runs the step again: per entry its eager
part, then its graph. The graph is the device's:

* CUDA: ``CudaGraph`` (``torch.cuda.CUDAGraph``), all of a step's graphs in one memory pool,
  captured on the pipeline's capture stream in ``"thread_local"`` error mode (NCCL's
  watchdog threads keep querying events while a rank captures; Megatron captures so too).
  The capture begins without the device-wide synchronize of ``torch.cuda.graph``: in
  ``capture="action"`` a rank's eager P2P is in flight between its graphs, and a synchronize
  there would wait for a peer that is itself waiting to capture.
* CPU: ``CpuGraph`` (``cpu_graph.py``), the same semantics on the host, so the CPU suite runs
  the capture driver a GPU runs.

Granularities (``CaptureDriver.entries``): ``step``, one graph holding the whole static step,
its P2P included; ``action``, one graph per compute action, replayed inside the range named
after it, its P2P posted and waited eagerly before it (a graph must join every stream it
forks, so a transfer in flight across actions cannot live inside per-action graphs).

The CUDA side is UNTESTED ON GPU until a GPU run proves it: ``tests/gpu`` exercises it and
skips without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from graphpipe.nvtx import Ranges

from .cpu_graph import CpuGraph

__all__ = ["CAPTURE_ERROR_MODE", "CapturedGraphs", "CudaGraph", "StepGraph", "new_graphs"]

Entry = tuple[str, Callable[[], Any] | None, Callable[[], Any] | None]

CAPTURE_ERROR_MODE = "thread_local"
"""``torch.cuda.CUDAGraph.capture_begin``'s error mode: only this thread's unsafe CUDA calls
invalidate the capture (NCCL's watchdog threads query events meanwhile)."""


class StepGraph(Protocol):
    """A graph of one device: ``capture(fn)`` runs ``fn`` once, recording it; ``replay()``
    runs it again; ``reset()`` frees it."""

    def capture(self, fn: Callable[[], Any]) -> Any: ...

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` in ``pool`` on ``stream``; ``capture`` records ``fn``
    (which does not run during a CUDA capture), then replays it once, so that after
    ``capture`` the work has run, as on the CPU graph."""

    def __init__(self, pool: Any, stream: Any) -> None:
        self.pool, self.stream = pool, stream
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        g = self.graph
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE)
            try:
                out = fn()
            finally:
                g.capture_end()
        g.replay()
        return out

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()


def new_graphs(
    device: torch.device, stream: Any = None, label: Callable[[], str] | None = None
) -> Callable[[], StepGraph]:
    """A maker of the device's graphs for one capture (on CUDA sharing one memory pool, on
    ``stream``; on CPU naming ``label()`` in errors)."""
    if device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
        stream = stream if stream is not None else torch.cuda.Stream(device)
        return lambda: CudaGraph(pool, stream)
    if device.type == "cpu":
        return lambda: CpuGraph(label)
    raise ValueError(f"capture runs on CUDA or CPU devices, not {device.type!r}")


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
    def capture(
        entries: Sequence[Entry], make: Callable[[], StepGraph], ranges: Ranges | None = None
    ) -> CapturedGraphs:
        """Run the step once through ``entries``: each entry's eager part, then its other part
        captured into its own graph (``make()``) and run; with several entries each capture
        inside the range named after its entry (on ``ranges``). A failure resets what was
        made."""
        out = CapturedGraphs()
        named = ranges is not None and len(entries) > 1
        try:
            for name, eager, fn in entries:
                if eager is not None:
                    eager()
                g = None
                if fn is not None:
                    g = make()
                    if named:
                        ranges.push(name)
                        try:
                            g.capture(fn)
                        finally:
                            ranges.pop()
                    else:
                        g.capture(fn)
                out.graphs.append(g)
                out.names.append(name)
                out.eager.append(eager)
        except BaseException:
            out.reset()
            raise
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
