"""graphpipe: DualPipeV pipeline parallelism for PyTorch, captured into CUDA graphs."""

from .executor import DualPipeV
from .ir import Action, Op
from .schedules import dualpipev

__all__ = ["Action", "DualPipeV", "Op", "dualpipev"]
__version__ = "0.1.0"
