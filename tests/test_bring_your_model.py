"""The examples of docs/bring-your-model.md run as they stand.

A ```python block right after a ``<!-- example -->`` line is an example; the examples of one
``## `` section run in order in one namespace, in a temporary directory. An example that
uses transformers is skipped without it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "bring-your-model.md"
_EXAMPLE = re.compile(r"^<!-- example -->\n```python\n(.*?)^```$", re.M | re.S)


def _sections() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    for part in re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        blocks = _EXAMPLE.findall(body)
        if blocks:
            sections[title.strip()] = blocks
    return sections


SECTIONS = _sections()


def test_the_page_has_its_examples() -> None:
    assert {"Hugging Face causal LMs", "torchtitan-style stages with keyword tensors"} <= set(
        SECTIONS
    ), sorted(SECTIONS)


@pytest.mark.parametrize("title", sorted(SECTIONS))
def test_the_examples_of_a_section_run(title: str, tmp_path: Path, monkeypatch) -> None:
    blocks = SECTIONS[title]
    if any("transformers" in b for b in blocks):
        pytest.importorskip("transformers", reason="this section's examples use transformers")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__example__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{PAGE.name}: {title}, example {i + 1}", "exec"), namespace)
