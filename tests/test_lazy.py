"""Names imported on first use (``graphpipe._lazy``): a lazy name is never replaced by a
submodule of the same name, and ``lazy_attributes`` refuses a package that would let it be."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter (nothing of graphpipe imported yet)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


def test_reading_workload_first_leaves_the_function_workloads_callable() -> None:
    # What profiles/run_steps.py and tests/benchmarks/bench_pipeline.py import, in this order:
    # Workload's module was once graphpipe.bench.workloads, which replaced the function.
    done = _fresh(
        """
        import pkgutil, types
        from graphpipe.bench import Workload, workloads
        assert callable(workloads) and not isinstance(workloads, types.ModuleType), workloads
        import graphpipe.bench as bench
        for m in pkgutil.iter_modules(bench.__path__):  # every part imported: still the function
            __import__(f"graphpipe.bench.{m.name}")
        assert bench.workloads is workloads, bench.workloads
        found, _ = workloads("overhead", 2, "cpu", hidden=4, microbatches=4, mb_rows=1)
        assert isinstance(found[0], Workload)
        """
    )
    assert done.returncode == 0, done.stderr


def test_a_lazy_name_that_is_also_a_submodule_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "lazy_shadow_pkg"
    pkg.mkdir()
    (pkg / "tools.py").write_text("def tools():\n    return 1\n\n\ndef other():\n    return 2\n")
    (pkg / "__init__.py").write_text(
        "from graphpipe._lazy import lazy_attributes\n"
        "__getattr__, __dir__ = lazy_attributes(__name__, {'other': '.tools', 'tools': '.tools'})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        importlib.import_module("lazy_shadow_pkg")
    assert str(err.value) == (
        "lazy_shadow_pkg: the lazy name 'tools' is also the submodule lazy_shadow_pkg.tools, "
        "which replaces it in lazy_shadow_pkg's namespace once imported; rename the submodule"
    )
    monkeypatch.delitem(sys.modules, "lazy_shadow_pkg", raising=False)
