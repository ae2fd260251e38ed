"""Names of a package imported on first use (PEP 562), so that importing the package is cheap.

``import graphpipe`` (and the command line, whose parsers import ``graphpipe.train``,
``graphpipe.bench`` and ``graphpipe.profile``) imports no torch: a package lists what it
exports and from which submodule, and ``lazy_attributes`` gives it the module ``__getattr__``
that imports a name's submodule the first time the name is read (and a ``__dir__`` that
lists it). The package also imports the same names under ``typing.TYPE_CHECKING``, for type
checkers and linters.

A lazy name must not be the name of a submodule of the package: importing that submodule (by
any route: a lazy name it defines, ``from .sub import ...`` in a sibling) binds the module
to the name in the package's namespace, and the module's ``__getattr__`` is then never asked.
``lazy_attributes`` refuses such a name when the package is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import pkgutil
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install_moved_modules", "lazy_attributes"]


def lazy_attributes(
    package: str, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package``: ``where`` maps each lazy name
    to the module (relative to ``package``, like ``".runtime"``) that defines it. A name read
    once is kept in the package's namespace; any other name is an ``AttributeError`` naming
    it. ``__dir__`` lists the lazy names with the ones already there.

    ``ValueError`` naming the name when a lazy name is also a submodule of ``package`` (see
    the module docstring)."""
    path = getattr(sys.modules[package], "__path__", ())
    shadowed = sorted(set(where) & {m.name for m in pkgutil.iter_modules(path)})
    if shadowed:
        name = shadowed[0]
        raise ValueError(
            f"{package}: the lazy name {name!r} is also the submodule {package}.{name}, which "
            f"replaces it in {package}'s namespace once imported; rename the submodule"
        )

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__


# --------------------------------------------------------------------------------------------
# Modules that moved: their old dotted names still import, as the same module objects

MOVED: dict[str, str] = {
    **{
        f"graphpipe.{m}": f"graphpipe.schedule.{m}"
        for m in (
            "ir packed timing lower validate simulate costs footprint render planner splits"
        ).split()
    },
    "graphpipe.schedules": "graphpipe.schedule.generators",
    "graphpipe.cli_options": "graphpipe.cmdline.options",
    "graphpipe.plan_command": "graphpipe.cli.plan",
    "graphpipe.export": "graphpipe.cli.export",
    "graphpipe.launch": "graphpipe.cmdline.launch",
    "graphpipe.outputs": "graphpipe.cmdline.outputs",
    "graphpipe.checkpoint_files": "graphpipe.checkpoint.files",
    "graphpipe.runtime.capture.plan": "graphpipe.runtime.capture.buffers",
    **{
        f"graphpipe.runtime.{m}": f"graphpipe.runtime.{folder}.{m}"
        for folder, names in (
            ("core", "stage comm program step loss tensors batch structured context messages"),
            ("parts", "accumulation data_parallel fsdp tied clipping"),
            ("coordination", "faults status store lifetime config groups checks"),
        )
        for m in names.split()
    },
}
"""``{old dotted name: new dotted name}`` of every module that moved into a layer's folder.
``import graphpipe.ir`` (or ``graphpipe.runtime.comm``) gives the module of its new place,
the same object, so code, pickles and ``mock.patch`` targets written against the old names
keep working."""


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the module of its new name, untouched."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # importlib set the old name's spec on the module: give it back its own
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of ``MOVED`` (after every other finder: a real module wins)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install_moved_modules() -> None:
    """Put the finder of ``MOVED``'s old names on ``sys.meta_path``, once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
