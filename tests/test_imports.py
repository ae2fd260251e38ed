"""The import graph of the package, built from the source with ``ast``: no cycles, no part
that imports the package facade, the schedule half's passes one way, a runtime that imports
nothing from the models, reads no private attribute of another part and writes none of
another part's fields.

What counts as an import of module ``m``: every ``import a.b`` and ``from a.b import c``
anywhere in ``m`` (at the top, inside functions, under ``try``), relative ones resolved
against ``m``'s package. ``from a import b`` is an edge to the module ``a.b`` when that is a
module of the package, else to ``a``; ``import a.b.c`` is an edge to the deepest module named
(``a.b.c``). Python runs the ``__init__`` of each package on the way (``a``, ``a.b``) first,
so those are edges too, except the packages that hold ``m`` itself (they are being imported
already: counting them would put every module in a cycle with its package). Imports under
``if TYPE_CHECKING:`` count too: a module that names another's types depends on it, and that
dependency counts (a runtime part that named the ``Pipeline`` for its type would be in a
circle with it). Imports of modules outside the package are left out, and so
are ``importlib.import_module`` calls (the CLI's lazy subcommands): the graph holds what the
source says statically.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"graphpipe": ROOT / "graphpipe"}
"""Where each package's source lives."""

FACADE = "graphpipe"
FACADE_USERS = frozenset({"graphpipe.cli", "graphpipe.__main__"})
"""The only modules that may import the package facade ``graphpipe/__init__.py``: the command
line entry (``graphpipe --version`` reads ``__version__``)."""

SCHEDULE_LAYERS = tuple(
    f"graphpipe.schedule.{m}"
    for m in (
        "ir packed costs generators timing lower validate simulate render footprint splits planner"
    ).split()
)
"""The modules of the schedule half, bottom to top (the table of ``graphpipe/schedule``'s
docstring): each may import only those before it."""

FOLDER_LAYERS = (
    ("graphpipe.schedule",),
    ("graphpipe.runtime.coordination",),
    ("graphpipe.runtime.core",),
    ("graphpipe.runtime.parts", "graphpipe.runtime.capture"),
    ("graphpipe.runtime",),
)
"""The layers of the runtime's folders, bottom to top (docs/runtime.md): a module of one layer
imports nothing of a layer above it, nor of another folder of its own layer (the parts and
capture do not know each other). ``graphpipe.runtime`` is the facade's folder: the modules
directly in it (``pipeline``) and what no folder below claims."""


# --------------------------------------------------------------------------------------------
# The graph builder


def module_files(packages: Mapping[str, Path]) -> dict[str, Path]:
    """``{module name: source file}`` of every ``.py`` file under each package's folder; a
    folder that is itself the root of another package listed is left to that one."""
    roots = {folder.resolve() for folder in packages.values()}
    out: dict[str, Path] = {}
    for name, folder in packages.items():
        folder = folder.resolve()
        for path in sorted(folder.rglob("*.py")):
            if next(p for p in path.parents if p in roots) != folder:
                continue  # in the folder of another package listed, nearer to the file
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def _deepest(name: str, files: Mapping[str, Path]) -> str | None:
    """The deepest module of the package that the dotted ``name`` names, or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if (candidate := ".".join(parts[:i])) in files:
            return candidate
    return None


def _targets(
    tree: ast.Module, module: str, is_package: bool, files: Mapping[str, Path]
) -> Iterator[str | None]:
    """The package's modules that the statements of ``tree`` import (see the module doc)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _deepest(alias.name, files)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in files else _deepest(base, files)


def _packages_of(module: str) -> set[str]:
    """``a.b.c`` -> ``{a, a.b}``: the packages whose ``__init__`` runs before ``a.b.c``."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(packages: Mapping[str, Path]) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` from the source (see the module doc)."""
    files = module_files(packages)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        found = set(_targets(tree, module, is_package, files)) - {None}
        running = _packages_of(module) | ({module} if is_package else set())
        for target in list(found):
            found |= {p for p in _packages_of(target) if p in files} - running
        graph[module] = found - {module}
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[tuple[str, ...]]:
    """Every elementary cycle of ``graph``, each in import order (``(a, b, c)``: a imports b,
    b imports c, c imports a) and starting at its smallest module; sorted.

    Only strongly connected components of more than one module are searched, so a graph
    without cycles costs one pass of Tarjan's algorithm.
    """
    cycles: list[tuple[str, ...]] = []
    for component in _components(graph):
        if len(component) < 2:
            continue
        for start in sorted(component):
            # paths from ``start`` through larger modules of the component back to ``start``
            stack = [(start, [start])]
            while stack:
                node, path = stack.pop()
                for nxt in sorted(graph.get(node, ())):
                    if nxt == start:
                        cycles.append(tuple(path))
                    elif nxt in component and nxt > start and nxt not in path:
                        stack.append((nxt, [*path, nxt]))
    return sorted(cycles)


def _components(graph: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _arrows(cycle: tuple[str, ...]) -> str:
    return " -> ".join([*cycle, cycle[0]])


# --------------------------------------------------------------------------------------------
# The package


GRAPH = import_graph(PACKAGES)


def test_the_graph_covers_the_package_and_the_kernels() -> None:
    assert "graphpipe.schedule.ir" in GRAPH and "graphpipe.runtime.pipeline" in GRAPH
    assert "graphpipe.kernels.rms_norm" in GRAPH
    assert "graphpipe.kernels._dispatch" in GRAPH["graphpipe.kernels.rms_norm"]
    assert "graphpipe.schedule.ir" in GRAPH["graphpipe.schedule.lower"]


def test_the_import_graph_has_no_cycles() -> None:
    cycles = sorted(find_cycles(GRAPH))
    assert not cycles, "\n".join(f"import cycle: {_arrows(c)}" for c in cycles)


def test_the_runtime_imports_nothing_from_the_models() -> None:
    """What the runtime must know about a parameter comes from the markers of
    ``graphpipe.roles``, which the models call: the runtime knows no model."""
    found = sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if m.startswith("graphpipe.runtime")
        for t in targets
        if t == "graphpipe.models" or t.startswith("graphpipe.models.")
    )
    assert not found, found


def test_the_runtime_checks_schedules_without_the_execution_model() -> None:
    """The runtime takes ``resolve_schedule`` from ``graphpipe.schedule.validate``; the simulator
    (``graphpipe.schedule.simulate``) is for the tools above it."""
    found = sorted(
        m
        for m, targets in GRAPH.items()
        if m.startswith("graphpipe.runtime") and "graphpipe.schedule.simulate" in targets
    )
    assert not found, found


# torch's own internals the runtime reads, each because torch has no public call for it.
TORCH_PRIVATES = {
    "_foreach_mul_": "torch._foreach_mul_ (clipping: one scale over many gradients)",
    "_foreach_norm": "torch._foreach_norm (clipping: the norms of many gradients)",
    "_fsdp_param_group": "FSDP2's state (runtime/parts/fsdp.py: reduce-scatter now, torch 2.11)",
    "_state_ctx": "FSDP2's state (runtime/parts/fsdp.py), as torch.distributed.pipelining reads it",
    "_root_post_backward_final_callback": "FSDP2's state (runtime/parts/fsdp.py), as pipelining",
    "_get_default_store": "the job's c10d store (runtime/coordination/groups.py)",
    "_per_optimizer_states": "GradScaler's found-inf tensors (Pipeline.unscale_)",
    "_execution_engine": "autograd's engine without Python-side checks (runtime/core/stage.py)",
    # The CPU graph (runtime/capture/cpu_graph.py) records and replays below torch's Python
    # API, at the dispatcher, as torch's own dispatch modes do:
    "_C": "torch._C._AutoDispatchBelowADInplaceOrView: a replay runs below autograd",
    "_AutoDispatchBelowADInplaceOrView": "the replay's dispatch keys (cpu_graph.py)",
    "_op": "an OpOverload's C++ callable: what a replay node calls (cpu_graph.py)",
    "_schema": "an operation's schema: its out= form, what it writes (cpu_graph.py)",
    "_overloadname": "an operation's overload name (cpu_graph.py)",
    "_cdata": "a storage's identity: which works a later operation must wait for",
    "_storage_Use_Count": "who holds a storage: the CPU graph reuses only its own",
    "_local_scalar_dense": "the aten operation of .item(): a host sync (cpu_graph.py)",
    "_c10d_functional": "the functional collectives' namespace (cpu_graph.py)",
    "_ops": "torch._ops.HigherOrderOperator: flex_attention's dense kernel is recorded",
    "_set_default_backend": "a ProcessGroup over a gloo backend (runtime/coordination/groups.py)",
    "_register_backend": "a ProcessGroup over a gloo backend (runtime/coordination/groups.py)",
}


def test_no_runtime_part_reads_another_objects_private_attributes() -> None:
    """``x._name`` in graphpipe/runtime/ only on ``self`` (or ``cls``), and on torch's own
    objects where torch has no public call (``TORCH_PRIVATES``, each with its reason)."""
    found = []
    for path in sorted((PACKAGES["graphpipe"] / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                continue
            if node.attr not in TORCH_PRIVATES:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def part_fields(tree: ast.Module) -> set[str]:
    """The fields of a module's classes: what their methods assign on ``self``, their
    class-level annotations and ``__slots__``, and their property setters."""
    out: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            for target in _assigned(node):
                if isinstance(target.value, ast.Name) and target.value.id == "self":
                    out.add(target.attr)
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                if isinstance(node.value, (ast.Tuple, ast.List)):
                    out |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
            elif isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Attribute) and d.attr == "setter" for d in node.decorator_list
            ):
                out.add(node.name)
    return out


def _assigned(node: ast.AST) -> Iterator[ast.Attribute]:
    """The attributes an assignment statement writes (``a.b = ``, ``a.b += ``, unpacking)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return
    for target in targets:
        for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
            if isinstance(t, ast.Attribute):
                yield t


def foreign_field_writes(sources: Mapping[str, str]) -> list[str]:
    """Writes in one part (a module of ``sources``: ``{name: source}``) of a field of a class
    of another part. A write on ``self.<part>.x`` is always the other part's; on a bare
    name (``t.x``) it is one when ``x`` is a field of another part and of none of this
    module's classes (a part's own records, such as its transfers or buckets, are its own)."""
    trees = {name: ast.parse(text, name) for name, text in sources.items()}
    fields = {name: part_fields(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            for target in _assigned(node):
                base = target.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                owners = sorted(o for o, f in fields.items() if o != name and target.attr in f)
                on_a_part = isinstance(base, ast.Attribute) and (
                    isinstance(base.value, ast.Name) and base.value.id == "self"
                )
                if owners and (on_a_part or target.attr not in fields[name]):
                    found.append(
                        f"{name}:{target.lineno}: {ast.unparse(target)} (a field of "
                        f"{', '.join(owners)})"
                    )
    return found


def test_no_runtime_part_writes_another_parts_fields() -> None:
    """A part changes another part's state only through that part's calls (``begin(...,
    infer=)``, ``use_metas``, ``doing``, ``set_ranges``, ...), never by assigning its fields:
    each part owns its state, and a run's mode is a value passed in."""
    folder = PACKAGES["graphpipe"] / "runtime"
    sources = {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*.py"))}
    assert not foreign_field_writes(sources), foreign_field_writes(sources)


def test_foreign_field_writes_are_found_and_own_records_are_not() -> None:
    sources = {
        "engine.py": "class Engine:\n    def __init__(self):\n        self.metas = {}\n"
        "        self.record = False\n"
        "class Transfer:\n    __slots__ = ('works',)\n",
        "capture.py": "class Driver:\n    def __init__(self, engine):\n"
        "        self.engine = engine\n        self.works = []\n"
        "    def go(self, engine, t):\n"
        "        engine.record = True\n"  # another part's field on a bare name
        "        self.engine.metas = {}\n"  # on self.<part>
        "        t.works = []\n"  # a field of this module's too: its own record
        "        self.works = [1]\n",
    }
    assert foreign_field_writes(sources) == [
        "capture.py:6: engine.record (a field of engine.py)",
        "capture.py:7: self.engine.metas (a field of engine.py)",
    ]


def test_no_part_imports_the_package_facade() -> None:
    users = sorted(m for m, targets in GRAPH.items() if FACADE in targets)
    assert set(users) <= FACADE_USERS, (
        f"{sorted(set(users) - FACADE_USERS)} import the facade {FACADE!r} "
        "(graphpipe/__init__.py): import the names from the modules that define them"
    )


def test_the_schedule_half_imports_only_downwards() -> None:
    upward = [
        f"{low} imports {high}"
        for i, low in enumerate(SCHEDULE_LAYERS)
        for high in SCHEDULE_LAYERS[i + 1 :]
        if high in GRAPH[low]
    ]
    assert not upward, f"layers {' -> '.join(SCHEDULE_LAYERS)}: " + "; ".join(upward)


# --------------------------------------------------------------------------------------------
# The builder itself, on a small package of its own


def _package(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_builder_resolves_every_kind_of_import(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path / "pkg",
        {
            "__init__.py": "from .a import thing\n",
            "a.py": "import os\nfrom pkg import b\n",
            "b.py": "def f():\n    from .sub.c import x\n",
            "sub/__init__.py": "from . import c\nfrom .. import d\n",
            "sub/c.py": "import pkg.sub\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ..d import D\n",
            "d.py": "from pkg.sub import nothing_here\nimport pkg.ext.k\n",
            "other/__init__.py": "",
            "other/e.py": "from ..sub.c import x\nfrom . import f\nimport pkg.other.f\n",
            "other/f.py": "",
        },
    )
    # a package whose folder sits inside another's but installs under its own name
    ext = _package(pkg / "vendored", {"__init__.py": "", "k.py": "from . import j\n", "j.py": ""})
    graph = import_graph({"pkg": pkg, "pkg.ext": ext})
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},  # from pkg import b: the submodule, not the facade
        "pkg.b": {"pkg.sub.c", "pkg.sub"},  # inside a function
        "pkg.sub": {"pkg.sub.c", "pkg.d"},  # relative, one and two levels
        "pkg.sub.c": {"pkg.sub", "pkg.d"},  # TYPE_CHECKING counts
        # a name of a package; a package from elsewhere, whose __init__ runs first
        "pkg.d": {"pkg.sub", "pkg.ext.k", "pkg.ext"},
        "pkg.other": set(),
        # pkg.sub's __init__ runs before pkg.sub.c; pkg and pkg.other hold e: no edges
        "pkg.other.e": {"pkg.sub.c", "pkg.sub", "pkg.other.f"},
        "pkg.other.f": set(),
        "pkg.ext": set(),
        "pkg.ext.k": {"pkg.ext.j"},
        "pkg.ext.j": set(),
    }


def test_builder_finds_and_names_a_planted_cycle(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "top.py": "from pkg import middle\n",
            "middle.py": "from pkg.bottom import f\n",
            "bottom.py": "def f():\n    import pkg.top\n",
            "leaf.py": "from . import bottom\n",
        },
    )
    cycles = find_cycles(import_graph({"pkg": pkg}))
    assert cycles == [("pkg.bottom", "pkg.top", "pkg.middle")]
    assert _arrows(cycles[0]) == "pkg.bottom -> pkg.top -> pkg.middle -> pkg.bottom"


def test_find_cycles_lists_each_cycle_of_one_component_once() -> None:
    graph = {"p": {"a", "b"}, "a": {"p"}, "b": {"p", "a"}, "x": {"x2"}, "x2": set()}
    assert find_cycles(graph) == [("a", "p"), ("a", "p", "b"), ("b", "p")]


def _folder_of(module: str) -> tuple[int, str] | None:
    """The deepest folder of ``FOLDER_LAYERS`` that holds ``module``, with its layer's index."""
    found = [
        (i, folder)
        for i, folders in enumerate(FOLDER_LAYERS)
        for folder in folders
        if module == folder or module.startswith(folder + ".")
    ]
    return max(found, key=lambda f: len(f[1])) if found else None


def test_the_runtimes_folders_import_only_downwards() -> None:
    found = []
    for module, targets in GRAPH.items():
        low = _folder_of(module)
        if low is None:
            continue
        for target in targets:
            high = _folder_of(target)
            if high is None:
                continue
            if high[0] > low[0] or (high[0] == low[0] and high[1] != low[1]):
                found.append(f"{module} imports {target}")
    assert not found, sorted(found)


def test_the_schedule_half_imports_no_torch_and_nothing_above_it() -> None:
    found = []
    for module, path in module_files(PACKAGES).items():
        if not module.startswith("graphpipe.schedule"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [f"{module} imports {n}" for n in names if n.split(".")[0] == "torch"]
        found += [
            f"{module} imports {t}"
            for t in GRAPH[module]
            if not t.startswith("graphpipe.schedule") and t != "graphpipe"
        ]
    assert not found, sorted(found)


def test_the_top_level_holds_few_modules() -> None:
    """The layers live in folders: the top of ``graphpipe/`` keeps the package's front and
    the small modules every layer shares."""
    top = sorted(p.stem for p in PACKAGES["graphpipe"].glob("*.py"))
    assert len(top) <= 12, top


def test_every_moved_module_imports_by_its_old_name_as_the_same_module() -> None:
    import importlib

    from graphpipe._lazy import MOVED

    files = module_files(PACKAGES)
    for old, new in MOVED.items():
        assert new in files, f"{old} -> {new}: no such module"
        assert old not in files, f"{old} is a module again: drop it from MOVED"
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(new).__spec__.name == new
