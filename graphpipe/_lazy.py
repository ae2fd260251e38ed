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
import pkgutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


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
