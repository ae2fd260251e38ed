"""Processes that end with pipelines alive (eager and captured, never closed) exit with 0.

A short run of ``profiles/exit_soak.py`` (the abort it guards against, ``terminate called
without an active exception``, is rare: see ``runtime/coordination/lifetime.py``): two runs of
two fresh gloo ranks, one that simply returns and one that destroys the process group first.
What makes it fail every time, not by chance: each rank reports how many of its pipelines'
gloo groups are still held after graphpipe's exit hooks, and a run with any fails (a
pipeline that went with its function's frame left its groups to the interpreter's
finalization before ``release_groups_at_exit``: 6 on each rank).
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


@pytest.mark.slow  # fresh processes run to their exit, twice: the slow lane
def test_processes_that_exit_with_live_pipelines_exit_with_status_zero() -> None:
    assert exit_soak.soak(runs=2, world=2, parallel=2, destroy="half") == []
