"""GPU test setup: the ``gpu_figures`` fixture.

A GPU test records what it measured (differences against the reference, counts of graph
launches, ...) in ``gpu_figures``, a dict. When ``GPU_CHECK_FIGURES`` names a file (as
``profiles/gpu_check.sh`` does), every test's figures are written there at the end of the
session as ``{test id: figures}``, and the check's summary carries them. The figures are also
printed, so ``pytest -rP`` shows them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

FIGURES_ENV = "GPU_CHECK_FIGURES"


@pytest.fixture(scope="session")
def _session_figures() -> Iterator[dict[str, dict[str, Any]]]:
    collected: dict[str, dict[str, Any]] = {}
    yield collected
    path = os.environ.get(FIGURES_ENV)
    if path and collected:
        with open(path, "w") as f:
            json.dump(collected, f, indent=1, sort_keys=True, default=str)


@pytest.fixture
def gpu_figures(
    request: pytest.FixtureRequest, _session_figures: dict[str, dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """A dict for this test's figures (kept even when the test fails after filling it)."""
    figures: dict[str, Any] = {}
    yield figures
    if figures:
        _session_figures[request.node.nodeid] = figures
        print(f"figures of {request.node.nodeid}: {json.dumps(figures, default=str)}")
