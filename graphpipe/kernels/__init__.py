# Fused Triton kernels for graphpipe models: RMSNorm (+ fused residual add), SwiGLU and
# cross-entropy, each with a plain-torch reference. Each module's header gives the op's
# memory-traffic floor, which tests/benchmarks/bench_kernels.py uses to report GB/s.
"""Fused kernels (``graphpipe.kernels``).

Triton runs for CUDA tensors and the torch reference for CPU tensors, unless the
``GRAPHPIPE_KERNELS`` environment variable says otherwise (``auto``, ``torch`` or
``triton``; ``triton`` on CPU needs ``TRITON_INTERPRET=1`` set before this import).
All ops are CUDA-graph capture safe: no host syncs, torch allocations only, launches on
the current stream, no autotuning.
"""

from .cross_entropy import cross_entropy
from .rms_norm import rms_norm, rms_norm_residual
from .swiglu import swiglu

__all__ = ["cross_entropy", "rms_norm", "rms_norm_residual", "swiglu"]
