# Backend choice for the fused kernels: Triton or the plain-torch reference.
#
# Rules (read at every call, so tests can monkeypatch the environment):
#
#   GRAPHPIPE_KERNELS unset / "auto"  Triton for CUDA tensors, torch reference otherwise.
#   GRAPHPIPE_KERNELS=torch           always the torch reference.
#   GRAPHPIPE_KERNELS=triton          always Triton. On CPU tensors this needs the Triton
#                                     interpreter: TRITON_INTERPRET=1 set before
#                                     graphpipe.kernels is imported, else RuntimeError.
#   anything else                     ValueError naming the value.
#
# Forced Triton on CPU also raises (RuntimeError naming the versions) for a kernel that loops
# over a run-time bound when Triton's interpreter cannot run such a loop: see
# interpreter_problem().
#
# The choice itself never syncs with the device: it looks at tensor metadata only.
"""Backend dispatch for ``graphpipe.kernels``."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

ENV_VAR = "GRAPHPIPE_KERNELS"
_MODES = ("auto", "torch", "triton")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with torch on linux
    HAS_TRITON = False

    def _missing_jit(fn: Any = None, **_kwargs: Any) -> Any:
        if fn is None:
            return _missing_jit
        return fn

    triton = SimpleNamespace(jit=_missing_jit, next_power_of_2=None)  # type: ignore[assignment]
    tl = SimpleNamespace(constexpr=int)  # type: ignore[assignment]

# Whether TRITON_INTERPRET was on when this package was imported, i.e. when the
# @triton.jit kernels in the sibling modules were defined. Triton decides
# interpreted-vs-compiled at definition time, so setting the variable later has
# no effect on these kernels.
KERNELS_INTERPRETED: bool = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"

_warned_no_triton = False


def kernel_mode() -> str:
    """Return the requested backend mode: ``"auto"``, ``"torch"`` or ``"triton"``.

    Raises:
        ValueError: if ``GRAPHPIPE_KERNELS`` holds anything else.
    """
    raw = os.environ.get(ENV_VAR, "auto")
    mode = raw.strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not a valid backend; expected one of {', '.join(_MODES)}"
        )
    return mode


def interpreter_ready() -> bool:
    """True when the Triton kernels were defined under the interpreter (run on CPU)."""
    return KERNELS_INTERPRETED


def _major_minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"cannot read a major.minor version from {version!r}")
    return int(found[1]), int(found[2])


def interpreter_problem(
    triton_version: str | None = None, numpy_version: str | None = None
) -> str | None:
    """Why Triton's interpreter cannot run a kernel that loops over a run-time bound here, or
    None when it can (the installed versions unless given).

    A kernel's ``for start in range(0, n_cols, BLOCK)`` (``n_cols`` an argument) calls
    ``__index__`` on the interpreter's scalar, which Triton before 3.7 implements as
    ``int(data)`` on a one-element 1-d array; numpy 2.4 turned that conversion (deprecated
    since 1.25) into ``TypeError: only 0-dimensional arrays can be converted to Python
    scalars``. Triton 3.7 squeezes the array first. The RMSNorm and cross-entropy kernels loop
    so; SwiGLU does not. Only the interpreter (CPU) is affected, never the compiled kernels.
    """
    if triton_version is None:
        if not HAS_TRITON:  # pragma: no cover - depends on the install
            return None
        triton_version = triton.__version__
    if numpy_version is None:
        try:
            import numpy
        except ImportError:  # the interpreter needs numpy; its absence is Triton's error
            return None
        numpy_version = numpy.__version__
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        return (
            f"Triton {triton_version}'s interpreter cannot run a loop over a run-time bound "
            f"with numpy {numpy_version} (its tensor __index__ converts a 1-element array "
            "with int(), which numpy >= 2.4 refuses): use numpy < 2.4 or Triton >= 3.7 "
            "for the interpreted kernels, or GRAPHPIPE_KERNELS=torch"
        )
    return None


def use_triton(x: torch.Tensor, runtime_loops: bool = False) -> bool:
    """Decide whether the op on tensor ``x`` runs the Triton kernels; ``runtime_loops``: the
    op's kernels loop over a run-time bound (see ``interpreter_problem``).

    Raises:
        ValueError: bad ``GRAPHPIPE_KERNELS`` value.
        RuntimeError: Triton was forced but cannot run on ``x``'s device.
    """
    global _warned_no_triton
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        if not x.is_cuda:
            return False
        if not HAS_TRITON:  # pragma: no cover - depends on the install
            if not _warned_no_triton:
                warnings.warn(
                    "graphpipe.kernels: triton is not installed; using the torch reference",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _warned_no_triton = True
            return False
        return True
    # mode == "triton": never fall back silently.
    if not HAS_TRITON:  # pragma: no cover - depends on the install
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed")
    if x.is_cuda:
        return True
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            f"{ENV_VAR}=triton on a {x.device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 in the environment before importing graphpipe.kernels"
        )
    if not KERNELS_INTERPRETED:
        raise RuntimeError(
            f"{ENV_VAR}=triton on a {x.device.type} tensor: TRITON_INTERPRET=1 was set after "
            "graphpipe.kernels was imported, so its kernels were defined for the GPU; set "
            "TRITON_INTERPRET=1 before the import"
        )
    if runtime_loops and (why := interpreter_problem()) is not None:
        raise RuntimeError(f"{ENV_VAR}=triton on a {x.device.type} tensor: {why}")
    return True


def device_guard(x: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Make ``x``'s CUDA device current for a launch (Triton launches on the current one)."""
    if x.is_cuda:
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class LaunchConfig:
    """How a row-wise kernel covers rows of ``n_cols`` columns.

    Each op chooses it with a pure function of the shape (``rms_norm_config``,
    ``swiglu_config``, ``cross_entropy_config``) that its launchers call, so tests and the
    sm_90 compile check see exactly the launchers' choice.
    """

    block: int
    """Columns one program holds at once (a power of two)."""
    num_warps: int
    """Warps per program."""
    n_chunks: int
    """``block``-wide pieces per row: ``cdiv(n_cols, block)`` (1: the whole row at once)."""

    def __post_init__(self) -> None:
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two, got {self.block}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two up to 32, got {self.num_warps}")
        if self.n_chunks < 1:
            raise ValueError(f"n_chunks must be >= 1, got {self.n_chunks}")


_SM_COUNT: dict[int, int] = {}


def num_persistent_programs(device: torch.device, n_rows: int) -> int:
    """How many programs a row-looping (persistent) kernel launches on ``device``.

    Host metadata only (cached device properties), so it is safe under CUDA graph capture.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SM_COUNT:
            _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
        target = 2 * _SM_COUNT[index]
    else:  # the interpreter: a few programs still exercise the partial-sum reduction
        target = 4
    return max(1, min(n_rows, target))


__all__ = [
    "ENV_VAR",
    "HAS_TRITON",
    "KERNELS_INTERPRETED",
    "LaunchConfig",
    "device_guard",
    "interpreter_problem",
    "interpreter_ready",
    "kernel_mode",
    "num_persistent_programs",
    "tl",
    "triton",
    "use_triton",
]
