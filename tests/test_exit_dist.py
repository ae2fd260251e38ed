"""Processes that end with pipelines alive (eager and captured, never closed) exit with 0.

A short run of ``profiles/exit_soak.py`` (the soak runs it 100 times: the abort it guards
against, ``terminate called without an active exception``, came in about 2 of 75 runs; see
``graphpipe/runtime/lifetime.py``): two runs of two fresh gloo ranks, one that simply returns
and one that destroys the process group first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

_spec = importlib.util.spec_from_file_location(
    "exit_soak", Path(__file__).resolve().parents[1] / "profiles" / "exit_soak.py"
)
exit_soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exit_soak)


def test_processes_that_exit_with_live_pipelines_exit_with_status_zero() -> None:
    assert exit_soak.soak(runs=2, world=2, parallel=2, destroy="half") == []
