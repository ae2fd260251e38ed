"""Shared setup for the ``graphpipe.kernels`` tests.

Without CUDA, the Triton path runs under the Triton interpreter, which must be switched
on *before* ``graphpipe.kernels`` defines its kernels: hence the ``setdefault`` below, at
import time of this conftest (pytest imports it before the test modules of this folder).
If something earlier in the session already imported ``graphpipe.kernels`` without it,
the ``triton_path`` fixture skips the Triton tests with a message saying so.
``triton_loop_path`` is ``triton_path`` for the ops whose kernels loop over a run-time bound
(RMSNorm, cross-entropy): on CPU it also skips where Triton's interpreter cannot run such a
loop (Triton < 3.7 with numpy >= 2.4; ``graphpipe.kernels._dispatch.interpreter_problem``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphpipe.kernels._dispatch import interpreter_problem, interpreter_ready

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else CPU (where the Triton path runs interpreted)."""
    return DEVICE


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the Triton backend for the test, or skip if it cannot run here."""
    if DEVICE.type != "cuda" and not interpreter_ready():
        pytest.skip(
            "graphpipe.kernels was imported before TRITON_INTERPRET=1 was set, so its Triton "
            "kernels cannot run on CPU in this session; run tests/kernels on its own or set "
            "TRITON_INTERPRET=1 in the environment"
        )
    monkeypatch.setenv("GRAPHPIPE_KERNELS", "triton")


@pytest.fixture
def triton_loop_path(triton_path: None) -> None:
    """``triton_path`` for kernels that loop over a run-time bound; on CPU, skipped where
    the interpreter cannot run that loop (the reason names the versions)."""
    if DEVICE.type != "cuda" and (why := interpreter_problem()) is not None:
        pytest.skip(why)
