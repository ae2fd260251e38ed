"""graphpipe: DualPipeV pipeline parallelism for PyTorch, captured into CUDA graphs.

The public names are imported on first use (``graphpipe._lazy``): ``import graphpipe`` and
the command line's ``--help`` import no torch; ``graphpipe.Pipeline`` imports the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import install_moved_modules, lazy_attributes

if TYPE_CHECKING:
    from .errors import PipelineClosed, PipelineError
    from .roles import mark_expert, mark_tied
    from .runtime import DualPipeV, PerMicrobatch, Pipeline, clip_grad_norm_
    from .schedule.costs import Costs
    from .schedule.generators import dualpipev, zbv
    from .schedule.ir import Action, Op, dump_csv, load_csv
    from .schedule.planner import LayerCost, MemoryBudgetExceeded, StagePlan, plan_stages
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
    "dump_csv",
    "load_csv",
    "mark_expert",
    "mark_tied",
    "no_defer",
    "plan_stages",
    "zbv",
]
__version__ = "0.1.0"

install_moved_modules()

__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        "Action": ".schedule.ir",
        "Costs": ".schedule.costs",
        "DualPipeV": ".runtime",
        "LayerCost": ".schedule.planner",
        "MemoryBudgetExceeded": ".schedule.planner",
        "Op": ".schedule.ir",
        "PerMicrobatch": ".runtime",
        "Pipeline": ".runtime",
        "PipelineClosed": ".errors",
        "PipelineError": ".errors",
        "StagePlan": ".schedule.planner",
        "clip_grad_norm_": ".runtime",
        "dualpipev": ".schedule.generators",
        "dump_csv": ".schedule.ir",
        "load_csv": ".schedule.ir",
        "mark_expert": ".roles",
        "mark_tied": ".roles",
        "no_defer": ".weightgrad",
        "plan_stages": ".schedule.planner",
        "zbv": ".schedule.generators",
    },
)
