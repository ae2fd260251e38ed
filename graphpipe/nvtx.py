"""Ranges named after schedule actions, for Nsight Systems and the torch profiler.

Each action runs inside a range named by its string (``3F5``, ``0W2``, ...), each step inside
one range (``step``). Ranges go to NVTX when CUDA is present, and to
``torch.profiler.record_function`` whenever a torch profiler is recording, so a CPU profiler
trace shows the same names.

NVTX backend, chosen once per ``Ranges``: the ``nvtx`` package (optional extra
``graphpipe[nvtx]``; ranges in the domain ``graphpipe``) when it imports, else
``torch.cuda.nvtx`` (ranges in NVTX's default domain; every CUDA build of torch has it, so a
machine without the package still gets named ranges). With no profiler attached the cost is
one C call per range (``_profiler_enabled()``) plus the NVTX push/pop, a no-op without a tool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["NVTX_BACKENDS", "Ranges"]

_profiler_enabled = torch._C._autograd._profiler_enabled
_rf_enter = torch.ops.profiler._record_function_enter_new
_rf_exit = torch.ops.profiler._record_function_exit._RecordFunction

NVTX_BACKENDS = ("nvtx", "torch.cuda.nvtx", "off")
"""Values of ``Ranges.backend``: the ``nvtx`` package, torch's own NVTX bindings, none."""

_Push = Callable[[str], object]
_Pop = Callable[[], object]


def _load_nvtx():
    """The ``nvtx`` package, or None when it is not installed (it is an optional extra)."""
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx


def _torch_nvtx_calls() -> tuple[_Push, _Pop]:
    """``torch.cuda.nvtx``'s push and pop; raises when CUDA (hence torch's NVTX) is absent."""
    if torch.cuda.is_available():
        # Looked up now, not at import, so that a test can stand recorders in for them.
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    raise RuntimeError(
        "NVTX ranges were asked for (use_nvtx=True) but neither the nvtx package "
        "(pip install 'graphpipe[nvtx]') nor CUDA (torch.cuda.is_available() is False, so "
        "torch.cuda.nvtx cannot run) is present; pass use_nvtx=False"
    )


class Ranges:
    """A push/pop range stack emitting to NVTX and/or the torch profiler.

    use_nvtx: emit NVTX ranges; default: when CUDA is available. ``backend`` says which NVTX
    implementation was chosen (one of ``NVTX_BACKENDS``).
    """

    # The nvtx package's domain is called directly rather than through a wrapper closure
    # taking the name: a range wraps every action and transfer wait, and a closure would add
    # a Python call to each push and pop (docs/benchmarks.md has its cost).
    __slots__ = ("_domain", "_pop", "_push", "_stack", "backend")

    def __init__(self, use_nvtx: bool | None = None) -> None:
        if use_nvtx is None:
            use_nvtx = torch.cuda.is_available()
        self._domain = None  # the nvtx package's domain
        self._push: _Push | None = None  # else torch.cuda.nvtx's calls
        self._pop: _Pop | None = None
        self.backend = "off"
        if use_nvtx:
            mod = _load_nvtx()
            if mod is not None:
                self._domain = mod.get_domain("graphpipe")
                self.backend = "nvtx"
            else:
                self._push, self._pop = _torch_nvtx_calls()
                self.backend = "torch.cuda.nvtx"
        self._stack: list = []

    def push(self, name: str) -> None:
        if self._domain is not None:
            self._domain.push_range(message=name)
        elif self._push is not None:
            self._push(name)
        self._stack.append(_rf_enter(name, None) if _profiler_enabled() else None)

    def pop(self) -> None:
        handle = self._stack.pop()
        if handle is not None:
            _rf_exit(handle)
        if self._domain is not None:
            self._domain.pop_range()
        elif self._pop is not None:
            self._pop()

    @property
    def depth(self) -> int:
        """Ranges open now."""
        return len(self._stack)

    def unwind(self, depth: int) -> None:
        """Close ranges until ``depth`` are open (after an exception inside a range)."""
        while len(self._stack) > depth:
            self.pop()
