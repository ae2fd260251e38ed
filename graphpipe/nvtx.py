"""Ranges named after schedule actions, for Nsight Systems and the torch profiler.

Each action runs inside a range named by its string (``3F5``, ``0W2``, ...), each step inside
one range (``step``). Ranges go to NVTX (the ``nvtx`` package) when CUDA is present, and to
``torch.profiler.record_function`` whenever a torch profiler is recording, so a CPU profiler
trace shows the same names. With no profiler attached the cost is one C call per range
(``_profiler_enabled()``) plus, on CUDA, an NVTX push/pop that is a no-op without a tool.
"""

from __future__ import annotations

import torch

__all__ = ["Ranges"]

_profiler_enabled = torch._C._autograd._profiler_enabled
_rf_enter = torch.ops.profiler._record_function_enter_new
_rf_exit = torch.ops.profiler._record_function_exit._RecordFunction


def _load_nvtx():
    try:
        import nvtx
    except ImportError:  # pragma: no cover - nvtx is a dependency
        return None
    return nvtx


class Ranges:
    """A push/pop range stack emitting to NVTX and/or the torch profiler.

    use_nvtx: emit NVTX ranges; default: when CUDA is available.
    """

    __slots__ = ("_domain", "_stack")

    def __init__(self, use_nvtx: bool | None = None) -> None:
        if use_nvtx is None:
            use_nvtx = torch.cuda.is_available()
        self._domain = None
        if use_nvtx:
            mod = _load_nvtx()
            if mod is None:
                raise RuntimeError("NVTX ranges were asked for but the nvtx package is missing")
            self._domain = mod.get_domain("graphpipe")
        self._stack: list = []

    def push(self, name: str) -> None:
        if self._domain is not None:
            self._domain.push_range(message=name)
        self._stack.append(_rf_enter(name, None) if _profiler_enabled() else None)

    def pop(self) -> None:
        handle = self._stack.pop()
        if handle is not None:
            _rf_exit(handle)
        if self._domain is not None:
            self._domain.pop_range()

    @property
    def depth(self) -> int:
        """Ranges open now."""
        return len(self._stack)

    def unwind(self, depth: int) -> None:
        """Close ranges until ``depth`` are open (after an exception inside a range)."""
        while len(self._stack) > depth:
            self.pop()
