"""The public API is small, importable, documented in the guide, and versioned."""

from __future__ import annotations

from pathlib import Path

import graphpipe

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def test_every_public_name_is_importable_and_in_the_guides_api_section() -> None:
    text = GUIDE.read_text()
    api = text[text.index("## The public API") : text.index("## Migrating")]
    for name in graphpipe.__all__:
        assert getattr(graphpipe, name) is not None
        assert f"`{name}" in api, f"{name} is public but not in docs/guide.md's API section"


def test_pipeline_errors_are_runtime_errors_and_closed_is_one_of_them() -> None:
    assert issubclass(graphpipe.PipelineError, RuntimeError)
    assert issubclass(graphpipe.PipelineClosed, graphpipe.PipelineError)


def test_the_planner_is_public_and_imports_no_torch() -> None:
    import subprocess
    import sys

    for name in ("plan_stages", "LayerCost", "StagePlan", "MemoryBudgetExceeded"):
        assert name in graphpipe.__all__
    code = (
        "import sys, graphpipe; graphpipe.plan_stages; graphpipe.LayerCost; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
