"""The wall times the docs quote for their commands (``profiles/docs_figures.py``): each is on
its page with its command and a date beside it; the slow test re-measures them and reports
their drift (it asserts no time: a shared machine's figures are its load's as much as the
code's)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location(
        "docs_figures", ROOT / "profiles" / "docs_figures.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_figures"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


figures = _script()


def _paragraphs(page: str) -> list[str]:
    """The page's paragraphs (a table is one), whitespace normalized."""
    text = (ROOT / page).read_text()
    return [figures.normalized(p) for p in re.split(r"\n\s*\n", text) if p.strip()]


@pytest.mark.parametrize("figure", figures.FIGURES, ids=lambda f: f.name)
def test_a_figure_is_on_its_page_with_its_command_and_date(figure) -> None:
    assert figures.documented(figure) is not None, (
        f"{figure.page} no longer states {figure.name} as {figure.pattern!r}: update it and "
        "profiles/docs_figures.py together"
    )
    paragraphs = _paragraphs(figure.page)
    at = next(i for i, p in enumerate(paragraphs) if re.search(figure.pattern, p))
    # with the paragraphs around it: a table's lead-in, the code block a sentence introduces
    context = " ".join(paragraphs[max(0, at - 1) : at + 2])
    assert figures.normalized(figure.command) in context, (
        f"{figure.page}: {figure.name} does not carry its command {figure.command!r}"
    )
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", context), f"{figure.page}: {figure.name} has no date"


def test_durations_parse_as_the_docs_write_them() -> None:
    assert figures.parse_duration("8 s") == (8, 8)
    assert figures.parse_duration("1 min 26 s") == (86, 86)
    assert figures.parse_duration("5.6-6.7 s") == (5.6, 6.7)
    assert figures.parse_duration("3.0 - 3.2") == (3.0, 3.2)
    assert figures.ratio(7.0, (5.6, 6.7)) == pytest.approx(7.0 / 6.7)
    assert figures.ratio(6.0, (5.6, 6.7)) == 1.0


@pytest.mark.slow
@pytest.mark.distributed
def test_the_figures_are_re_measured_and_their_drift_reported(tmp_path, capsys) -> None:
    out = tmp_path / "figures.json"
    assert figures.main(["--repeats", "1", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["figures"]
    assert [r["name"] for r in rows] == [f.name for f in figures.FIGURES if not f.long]
    for r in rows:
        assert "error" not in r, r
        assert r["documented_s"] is not None and r["median_s"] > 0, r
    print(capsys.readouterr().out)  # the report, for the log
