"""Capture: the static step, its plan and its CUDA graphs.

* ``driver``: ``CaptureDriver``, one ``Capture`` per batch signature: the warmup step that
  records the metadata of every tensor the step touches, the plan made from it, the bindings
  of the plan's buffers into the transfers and the runner, and the replay (the static step on
  CPU, CUDA graphs on GPU). A pipeline built without ``capture`` has no driver: its steps run
  the step loop directly.
* ``plan``: ``StaticPlan`` / ``build_plan``, every buffer the step needs allocated once, with
  the lifetimes that let buffers share memory.
* ``graphs``: ``CapturedGraphs``, the CUDA graphs of a step (one, or one per action) and
  their replay.

The tensor metadata they record (``graphpipe.meta``: ``TensorMeta``, ``StepRecord``) stays
outside: the P2P handshake and ``graphpipe.weightgrad`` use it too, below the runtime.
"""

from .driver import Capture, CaptureDriver
from .graphs import CapturedGraphs
from .plan import StaticPlan, build_plan

__all__ = ["Capture", "CaptureDriver", "CapturedGraphs", "StaticPlan", "build_plan"]
