"""The runtime: one pipeline rank's training step, split into parts.

==============  ==============================================================================
module          owns
==============  ==============================================================================
pipeline        the public facade (``Pipeline``, ``DualPipeV``): builds the parts, hands each
                the collaborators it uses, and runs a call (agreement, step, failure)
checks          the constructor's argument checks and what it infers from the stages
context         who this rank is (group, rank, device, stages): what every part reads
step            the step loop: runs a compiled program, for the eager and the captured step
loss            the loss buffers, the backward seed, the mean loss broadcast to every rank
program         the compiled per-rank program: posts, waits and handlers per lowered step
comm            the communication engine: asynchronous transfers, packets, handshake
messages        the first step's headers and the later steps' message checks
faults          failure notices: every rank raises, naming the failing rank and action, or
                the rank to blame when none raised (lost, idle, in another call)
store           the job's c10d store: who hosts it, every access wrapped (``StoreLost``)
status          what a blocked process is doing, published only while it blocks
config          the construction-time agreement: every rank joins, configured alike
groups          process groups: one per directed rank pair on NCCL, the gloo control group
lifetime        live pipelines at exit: closed, their gloo groups released, no abort
stage           the stage runner: F / I / B / W / overlap handlers, per-micro-batch state
batch           agreement on each batch across ranks
structured      keyword values given per micro-batch, of any structure (``PerMicrobatch``)
tensors         a value as a tuple of tensors, a batch split into micro-batches
capture/        a captured pipeline's driver (warmup record -> static plan -> static step /
                CUDA graphs -> replay), its plan and its graphs
data_parallel   gradient and loss averaging over the data-parallel replicas, in the step
fsdp            FSDP2-sharded stages: all-gathers early, one reduce-scatter per stage and step
tied            weights tied across pipeline ranks: equal copies, gradients summed in the step
clipping        gradient clipping by the global norm across pipeline ranks, in the step
==============  ==============================================================================
"""

from .pipeline import DualPipeV, Pipeline, clip_grad_norm_
from .structured import PerMicrobatch

__all__ = ["DualPipeV", "PerMicrobatch", "Pipeline", "clip_grad_norm_"]
