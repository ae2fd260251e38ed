"""graphpipe: DualPipeV pipeline parallelism for PyTorch, captured into CUDA graphs."""

from .errors import PipelineError
from .ir import Action, Op, load_csv
from .runtime import DualPipeV, Pipeline
from .schedules import dualpipev
from .simulate import Costs

__all__ = [
    "Action",
    "Costs",
    "DualPipeV",
    "Op",
    "Pipeline",
    "PipelineError",
    "dualpipev",
    "load_csv",
]
__version__ = "0.1.0"
