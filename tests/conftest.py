"""Session-wide test setup.

Without CUDA the Triton kernels run under Triton's interpreter, which must be switched on
before ``graphpipe.kernels`` defines them; spawned ranks inherit it through the environment.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
