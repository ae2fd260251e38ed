"""The runtime: one pipeline rank's training step, split into parts, in four folders.

==================  ==========================================================================
folder / module     owns
==================  ==========================================================================
pipeline            the public facade (``Pipeline``, ``DualPipeV``): builds the parts, hands
                    each the collaborators it uses, and runs a call (agreement, step, failure)
options             the pipeline's choices and process groups, as checked records
build               the pipeline's construction, one function per step, each returning what
                    it builds
capture/            a captured pipeline's driver (warmup record -> static plan -> one graph
                    per step or per action -> replay), its plan, the CUDA graph and the CPU
                    graph behind one interface
parts/              what a composition adds inside a step: ``accumulation`` (``no_sync``),
                    ``data_parallel``, ``fsdp``, ``tied`` (weights tied across ranks),
                    ``clipping`` (the global norm)
core/               the step itself: ``stage`` (F / I / B / W / overlap handlers), ``comm``
                    (asynchronous transfers), ``program`` (posts, waits and handlers per
                    lowered step), ``step`` (the loop), ``loss``, ``messages`` (headers and
                    checks), ``batch`` (agreement on each batch), ``structured``
                    (``PerMicrobatch``), ``tensors``, ``context`` (who this rank is)
coordination/       between the ranks, outside the data path: ``checks`` (arguments),
                    ``config`` (every rank joins, configured alike), ``groups``, ``store``,
                    ``status`` (what a blocked process is doing), ``faults`` (every rank
                    raises, naming the failing rank and action), ``lifetime`` (pipelines
                    alive at exit)
==================  ==========================================================================

Each folder imports only the folders below it in this table; ``parts`` and ``capture`` do not
import each other (``tests/test_imports.py`` holds it).
"""

from .core.structured import PerMicrobatch
from .pipeline import DualPipeV, Pipeline, clip_grad_norm_

__all__ = ["DualPipeV", "PerMicrobatch", "Pipeline", "clip_grad_norm_"]
