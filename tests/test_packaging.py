"""The package list a wheel gets: every folder of ``graphpipe/`` with Python in it.

A built wheel holds only the packages that pyproject.toml's ``packages.find`` finds; a folder
without ``__init__.py`` (or left out by the pattern) would install without its modules and
fail at import for anyone not using an editable install. ``.ci/wheel_check.sh`` builds the
wheel and imports every module from a fresh venv; this checks the same list without a build.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from setuptools import find_packages

tomllib = pytest.importorskip("tomllib", reason="the standard library has tomllib from 3.11")

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_folder_is_a_package_the_wheel_holds() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(str(ROOT), include=find["include"]))
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "graphpipe").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    lost = folders - found
    assert lost == set(), f"folders with modules that no wheel would hold: {lost}"
    assert "graphpipe.runtime.capture" in found and "graphpipe.kernels" in found
