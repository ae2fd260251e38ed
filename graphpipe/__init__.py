"""graphpipe: DualPipeV pipeline parallelism for PyTorch, captured into CUDA graphs.

The public names are imported on first use (``graphpipe._lazy``): ``import graphpipe`` and
the command line's ``--help`` import no torch; ``graphpipe.Pipeline`` imports the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes

if TYPE_CHECKING:
    from .errors import PipelineClosed, PipelineError
    from .ir import Action, Op, load_csv
    from .planner import LayerCost, MemoryBudgetExceeded, StagePlan, plan_stages
    from .roles import mark_expert, mark_tied
    from .runtime import DualPipeV, PerMicrobatch, Pipeline, clip_grad_norm_
    from .schedules import dualpipev
    from .simulate import Costs
    from .weightgrad import no_defer

__all__ = [
    "Action",
    "Costs",
    "DualPipeV",
    "LayerCost",
    "MemoryBudgetExceeded",
    "Op",
    "PerMicrobatch",
    "Pipeline",
    "PipelineClosed",
    "PipelineError",
    "StagePlan",
    "clip_grad_norm_",
    "dualpipev",
    "load_csv",
    "mark_expert",
    "mark_tied",
    "no_defer",
    "plan_stages",
]
__version__ = "0.1.0"

__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        "Action": ".ir",
        "Costs": ".simulate",
        "DualPipeV": ".runtime",
        "LayerCost": ".planner",
        "MemoryBudgetExceeded": ".planner",
        "Op": ".ir",
        "PerMicrobatch": ".runtime",
        "Pipeline": ".runtime",
        "PipelineClosed": ".errors",
        "PipelineError": ".errors",
        "StagePlan": ".planner",
        "clip_grad_norm_": ".runtime",
        "dualpipev": ".schedules",
        "load_csv": ".ir",
        "mark_expert": ".roles",
        "mark_tied": ".roles",
        "no_defer": ".weightgrad",
        "plan_stages": ".planner",
    },
)
