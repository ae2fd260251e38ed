"""graphpipe: DualPipeV pipeline parallelism for PyTorch, captured into CUDA graphs."""

from .errors import PipelineClosed, PipelineError
from .ir import Action, Op, load_csv
from .roles import mark_expert, mark_tied
from .runtime import DualPipeV, Pipeline, clip_grad_norm_
from .schedules import dualpipev
from .simulate import Costs
from .weightgrad import no_defer

__all__ = [
    "Action",
    "Costs",
    "DualPipeV",
    "Op",
    "Pipeline",
    "PipelineClosed",
    "PipelineError",
    "clip_grad_norm_",
    "dualpipev",
    "load_csv",
    "mark_expert",
    "mark_tied",
    "no_defer",
]
__version__ = "0.1.0"
