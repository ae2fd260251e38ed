"""Capture: the static step, its plan and its graphs.

* ``driver``: ``CaptureDriver``, one ``Capture`` per batch signature: the warmup step that
  records the metadata of every tensor the step touches, the plan made from it, the bindings
  of the plan's buffers into the transfers and the runner, and the replay of the step's graphs
  (CUDA graphs on GPU, CPU graphs on CPU). A pipeline built without ``capture`` has no driver:
  its steps run the step loop directly.
* ``buffers``: ``BufferPlan`` / ``build_plan``, every buffer the step needs allocated once,
  with the lifetimes that let buffers share memory (the buffer plan; the stage split of
  ``graphpipe.plan_stages`` is another plan).
* ``graphs``: ``CapturedGraphs``, the graphs of a step (one, or one per action) and their
  replay, one interface over the device's graphs.
* ``cpu_graph``: ``CpuGraph``, a CUDA graph's semantics on the host: the step's operations
  recorded once and re-executed.

The tensor metadata they record (``graphpipe.meta``: ``TensorMeta``, ``StepRecord``) stays
outside: the P2P handshake and ``graphpipe.weightgrad`` use it too, below the runtime.
"""

from .buffers import BufferPlan, build_plan
from .driver import Capture, CaptureDriver
from .graphs import CapturedGraphs

StaticPlan = BufferPlan
"""``BufferPlan``'s former name."""

__all__ = ["BufferPlan", "Capture", "CaptureDriver", "CapturedGraphs", "StaticPlan", "build_plan"]
