"""The runtime: one pipeline rank's training step, split into parts.

==============  ==============================================================================
module          owns
==============  ==============================================================================
pipeline        the public facade (``Pipeline``, ``DualPipeV``): the step loop, inference
checks          the constructor's argument checks and what it infers from the stages
loss            the loss buffers, the backward seed, the mean loss broadcast to every rank
program         the compiled per-rank program: posts, waits and handlers per lowered step
comm            the communication engine: asynchronous transfers, packets, handshake
messages        the first step's headers and the later steps' message checks
faults          failure notices: every rank raises, naming the failing rank and action
groups          process groups: one per directed rank pair on NCCL, the gloo control group
stage           the stage runner: F / I / B / W / overlap handlers, per-micro-batch state
batch           agreement on each batch across ranks, micro-batch splitting
capture         warmup record -> static plan -> static step / CUDA graphs -> replay
data_parallel   gradient and loss averaging over the data-parallel replicas, in the step
clipping        gradient clipping by the global norm across pipeline ranks, in the step
==============  ==============================================================================
"""

from .clipping import clip_grad_norm_
from .pipeline import DualPipeV, Pipeline

__all__ = ["DualPipeV", "Pipeline", "clip_grad_norm_"]
