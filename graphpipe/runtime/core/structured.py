"""Keyword values given per micro-batch, of any structure: ``graphpipe.PerMicrobatch``.

``pipe.step(x, y, block_mask=PerMicrobatch([mask_0, ..., mask_{M-1}]))``: one value per
micro-batch (a FlexAttention ``BlockMask``, a dataclass of tensors, a dict, a tuple, ...),
passed unchanged to every stage (and ``loss_fn``) that takes the keyword, for its
micro-batch. The rest of the runtime sees a ``PerMicrobatch`` as what it also is: a tuple of
tensors, each tensor found inside the values stacked over the micro-batches (dim 0 is M), so
the batch agreement compares their shapes and dtypes across ranks, and capture gives them
static buffers like any keyword tensor. What is not a tensor is the value's *structure*:

- the containers walked: tensors, tuples / lists (named tuples too), dicts, objects
  (dataclasses, a ``BlockMask``) whose attributes hold tensors: such an object is rebuilt as
  a shallow copy (``copy.copy``) whose tensor-holding attributes are set anew; and functions
  whose closure holds tensors (a ``mask_mod`` reading document ids), rebuilt as new
  functions of the same code over new cells;
- everything else is a constant (an int, a string, a function), described by its ``repr``
  (plain values) or its type and qualified name (functions, other objects).

The micro-batches must have one structure (same types, constants and tensor shapes: a
``ValueError`` names the micro-batch and the place that differs). The ranks agree on the
structure's description (``structure_digest``, folded into the keyword digest of the batch
agreement). A description names a constant that is not a plain value by its type or function
only, the same text in every process; what a captured step bakes in is its *value*, so under
capture the constants are also compared by value (``_snapshot``, local to the process):

- functions by their code, globals, defaults and closure cells, recursively; ``partial``
  objects and bound methods by their parts; objects by their type and attributes,
  recursively (``_DEPTH`` levels, ``_NODES`` parts per value; beyond, by ``==``); containers
  item by item; plain values by type and ``==`` (floats by ``repr``: ``nan``, ``-0.0``),
  where an ``==`` that raises or returns no bool counts as a difference unless the objects
  are the same; modules, classes, enums and tensors by identity.
- Before a warmup (``check_capturable``): the micro-batches of the step must hold equal
  constants (the capture rebuilds every micro-batch's value on micro-batch 0's), else a
  ``ValueError`` names the keyword, the micro-batch and the place. Eager steps take each
  micro-batch's own value and are not checked.
- Before every later step of a capture (``check_captured``): a structure other than the
  captured one is a ``ValueError``; constants that differ between the micro-batches are
  refused as before a warmup; constants other than the captured ones raise
  ``ConstantChanged`` naming the keyword and the place (``recapture=True``: the driver
  captures the step anew). Tensors the walk does not reach (a ``functools.partial``'s
  arguments, a function's defaults, a callable object's attributes) are refused before a
  warmup and before a recapture.

Globals a function reads are not compared (its ``__globals__`` is, by identity).

Owns: nothing (values and pure functions). May touch: nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import hashlib
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "ConstantChanged",
    "PerMicrobatch",
    "check_capturable",
    "check_captured",
    "check_count",
    "structure_digest",
    "structures",
]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _holds_tensors(v: Any, depth: int = 0) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if depth > 8:
        return False
    if isinstance(v, (tuple, list)):
        return any(_holds_tensors(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return any(_holds_tensors(x, depth + 1) for x in v.values())
    if isinstance(v, types.FunctionType):
        return any(_holds_tensors(c, depth + 1) for c in _cells(v))
    attrs = _attributes(v)
    return attrs is not None and any(_holds_tensors(x, depth + 1) for x in attrs.values())


_EMPTY = object()  # an empty closure cell


def _cells(fn: types.FunctionType) -> list[Any]:
    """The contents of a function's closure cells (``_EMPTY`` for an empty one)."""
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:
            out.append(_EMPTY)
    return out


def _attributes(v: Any) -> dict[str, Any] | None:
    """The attributes of an object that may hold tensors (None: not such an object)."""
    if isinstance(v, (_PLAIN, type)) or (callable(v) and not dataclasses.is_dataclass(v)):
        return None
    if isinstance(v, torch.nn.Module):
        return None  # a module is a constant: its parameters are not micro-batch data
    if isinstance(v, types.ModuleType):
        return None  # a Python module is a constant (its namespace is no value's data)
    d = getattr(v, "__dict__", None)
    if d is not None:
        return dict(d)
    slots = [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ())]
    if slots:
        return {s: getattr(v, s) for s in slots if hasattr(v, s)}
    return None


def _constant(v: Any) -> str:
    """A description of a constant, the same in every process."""
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return repr(v)
    name = getattr(v, "__qualname__", None)
    if callable(v) and name is not None:
        return f"<{type(v).__name__} {getattr(v, '__module__', '?')}.{name}>"
    return f"<{type(v).__module__}.{type(v).__qualname__}>"


def _flatten(v: Any, leaves: list[torch.Tensor], where: str) -> Any:
    """``v``'s structure (a nested tuple, described by ``_describe``), its tensors appended
    to ``leaves``."""
    if isinstance(v, torch.Tensor):
        leaves.append(v)
        return ("tensor", str(v.dtype).removeprefix("torch."), tuple(v.shape))
    if isinstance(v, (tuple, list)):
        return (
            "seq",
            type(v),
            tuple(_flatten(x, leaves, f"{where}[{i}]") for i, x in enumerate(v)),
        )
    if isinstance(v, dict):
        return (
            "dict",
            type(v),
            tuple(v),
            tuple(_flatten(x, leaves, f"{where}[{k!r}]") for k, x in v.items()),
        )
    if isinstance(v, types.FunctionType) and _holds_tensors(v):
        # A function closing over tensors (a mask_mod reading document ids): its tensor
        # cells are part of the value, rebuilt as a new function over other tensors.
        cells = _cells(v)
        idx = tuple(i for i, c in enumerate(cells) if _holds_tensors(c))
        consts = tuple((str(i), _constant(c)) for i, c in enumerate(cells) if i not in idx)
        kids = tuple(_flatten(cells[i], leaves, f"{where}.<closure {i}>") for i in idx)
        return ("function", f"{v.__module__}.{v.__qualname__}", idx, consts, kids)
    attrs = _attributes(v)
    if attrs is not None and any(_holds_tensors(x) for x in attrs.values()):
        names = tuple(k for k, x in attrs.items() if _holds_tensors(x))
        consts = tuple((k, _constant(x)) for k, x in attrs.items() if k not in names)
        kids = tuple(_flatten(attrs[k], leaves, f"{where}.{k}") for k in names)
        return ("object", type(v), names, consts, kids)
    return ("const", _constant(v))


def _describe(spec: Any) -> str:
    """The structure as text (types by qualified name), the same in every process."""
    kind = spec[0]
    if kind == "tensor":
        return f"tensor{list(spec[2])} {spec[1]}"
    if kind == "const":
        return spec[1]
    if kind == "function":
        cells = [f"{i}={_describe(s)}" for i, s in zip(spec[2], spec[4], strict=True)]
        cells += [f"{i}={c}" for i, c in spec[3]]
        return f"<function {spec[1]}>(closure: " + ", ".join(cells) + ")"
    t = spec[1]
    tname = f"{t.__module__}.{t.__qualname__}"
    if kind == "seq":
        return f"{tname}(" + ", ".join(_describe(s) for s in spec[2]) + ")"
    if kind == "dict":
        parts = (f"{k!r}: {_describe(s)}" for k, s in zip(spec[2], spec[3], strict=True))
        return f"{tname}{{" + ", ".join(parts) + "}"
    attrs = [f"{k}={_describe(s)}" for k, s in zip(spec[2], spec[4], strict=True)]
    attrs += [f"{k}={c}" for k, c in spec[3]]
    return f"{tname}(" + ", ".join(attrs) + ")"


def _rebuild(template: Any, spec: Any, leaves: Iterator[torch.Tensor]) -> Any:
    """A value of ``template``'s structure whose tensors are the next ``leaves``."""
    kind = spec[0]
    if kind == "tensor":
        return next(leaves)
    if kind == "const":
        return template
    if kind == "seq":
        items = [_rebuild(x, s, leaves) for x, s in zip(template, spec[2], strict=True)]
        t = spec[1]
        if t in (tuple, list):
            return t(items)
        return t(*items) if hasattr(t, "_fields") else t(items)  # a named tuple: by position
    if kind == "dict":
        out = copy.copy(template)
        for k, s in zip(spec[2], spec[3], strict=True):
            out[k] = _rebuild(template[k], s, leaves)
        return out
    if kind == "function":
        cells = list(template.__closure__)
        contents = _cells(template)
        for i, s in zip(spec[2], spec[4], strict=True):
            cells[i] = types.CellType(_rebuild(contents[i], s, leaves))
        fn = types.FunctionType(
            template.__code__,
            template.__globals__,
            template.__name__,
            template.__defaults__,
            tuple(cells),
        )
        fn.__kwdefaults__ = template.__kwdefaults__
        fn.__qualname__ = template.__qualname__
        fn.__dict__.update(template.__dict__)
        return fn
    out = copy.copy(template)
    for k, s in zip(spec[2], spec[4], strict=True):
        object.__setattr__(out, k, _rebuild(getattr(template, k), s, leaves))
    return out


def _first_difference(a: Any, b: Any, where: str) -> str:
    """Where two structures first differ, in words."""
    if a[0] != b[0] or (a[0] in ("tensor", "const") and a != b):
        return f"{where} is {_describe(b)}, not {_describe(a)}"
    if a[0] == "function" and a[1] != b[1]:
        return f"{where} is the function {b[1]}, not {a[1]}"
    if a[0] in ("seq", "dict", "object") and a[1] is not b[1]:
        return f"{where} is a {b[1].__qualname__}, not a {a[1].__qualname__}"
    if a[0] == "seq":
        if len(a[2]) != len(b[2]):
            return f"{where} has {len(b[2])} items, not {len(a[2])}"
        pairs = [(f"{where}[{i}]", x, y) for i, (x, y) in enumerate(zip(a[2], b[2]))]
    elif a[0] == "dict":
        if a[2] != b[2]:
            return f"{where} has keys {list(b[2])}, not {list(a[2])}"
        pairs = [(f"{where}[{k!r}]", x, y) for k, x, y in zip(a[2], a[3], b[3])]
    else:
        if a[2] != b[2] or a[3] != b[3]:
            return f"{where} is {_describe(b)}, not {_describe(a)}"
        dot = ".<closure " if a[0] == "function" else "."
        end = ">" if a[0] == "function" else ""
        pairs = [(f"{where}{dot}{k}{end}", x, y) for k, x, y in zip(a[2], a[4], b[4])]
    for w, x, y in pairs:
        if x != y:
            return _first_difference(x, y, w)
    return f"{where} differs"  # pragma: no cover - called only on structures that differ


class PerMicrobatch(tuple):
    """A keyword value given per micro-batch: ``PerMicrobatch([v_0, ..., v_{M-1}])``.

    Each ``v_i`` goes, unchanged, to every stage (and ``loss_fn``) that takes the keyword,
    when it runs micro-batch ``i``; the values may be of any structure (see the module doc)
    but all of one. As a tuple it holds the tensors found inside, each stacked over the
    micro-batches (``[M, *shape]``): what the batch agreement and capture see.

    ``ValueError`` (naming the micro-batch and the place) when the values differ in
    structure, a constant or a tensor's shape or dtype; ``TypeError`` when they hold no
    tensor (pass a plain argument to the stage instead) or are not a non-empty sequence.
    """

    values: tuple[Any, ...]
    """The values given, one per micro-batch (empty over a capture's static buffers)."""
    spec: Any
    description: str
    template: Any
    """A value of the structure (micro-batch 0's): constants come from it when rebuilding."""

    def __new__(cls, values: Sequence[Any]) -> PerMicrobatch:
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise TypeError(
                "PerMicrobatch takes a non-empty list of values, one per micro-batch, got "
                f"{type(values).__name__}"
            )
        values = tuple(values)
        per_mb: list[list[torch.Tensor]] = []
        spec = None
        for i, v in enumerate(values):
            leaves: list[torch.Tensor] = []
            s = _flatten(v, leaves, f"micro-batch {i}'s value")
            if spec is None:
                spec = s
                if not leaves:
                    raise TypeError(
                        f"PerMicrobatch values hold no tensor (micro-batch 0: {_describe(s)}): "
                        "pass such a value to the stage some other way"
                    )
            elif s != spec:
                raise ValueError(
                    "PerMicrobatch values must share one structure: "
                    + _first_difference(spec, s, f"micro-batch {i}'s value")
                    + " (as in micro-batch 0)"
                )
            per_mb.append(leaves)
        devices = {t.device for ts in per_mb for t in ts}
        if len(devices) > 1:
            raise ValueError(f"PerMicrobatch values hold tensors on several devices: {devices}")
        stacked = [torch.stack([ts[j].detach() for ts in per_mb]) for j in range(len(per_mb[0]))]
        return _per_microbatch(stacked, values, spec, values[0])

    def over(self, tensors: Sequence[torch.Tensor]) -> PerMicrobatch:
        """This structure over other stacked ``tensors`` (a capture's static buffers): its
        values are rebuilt on views of them."""
        return _per_microbatch(tensors, (), self.spec, self.template)

    def microbatches(self, m: int, device: torch.device) -> list[Any]:
        """The ``m`` values, one per micro-batch: the given ones when their tensors are on
        ``device``, else rebuilt on (views of) the stacked tensors, moved there."""
        if self[0].shape[0] != m:
            raise ValueError(
                f"PerMicrobatch holds {self[0].shape[0]} values for num_microbatches={m}"
            )
        if self.values and all(t.device == device for t in self):
            return list(self.values)
        tensors = [t.to(device, non_blocking=True) for t in self]
        return [_rebuild(self.template, self.spec, iter([t[i] for t in tensors])) for i in range(m)]

    def __reduce__(self) -> Any:  # pickled as its values (the tuple is derived from them)
        return (PerMicrobatch, (list(self.values),))


def structure_digest(kwargs: Mapping[str, Any]) -> str:
    """The structures of the ``PerMicrobatch`` keywords of a call, as text ("" when none);
    every rank must give the same."""
    parts = [
        f"{name}: {v.description}"
        for name, v in sorted(kwargs.items())
        if isinstance(v, PerMicrobatch)
    ]
    if not parts:
        return ""
    return hashlib.blake2b("; ".join(parts).encode(), digest_size=7).hexdigest()


def _per_microbatch(
    tensors: Sequence[torch.Tensor], values: tuple, spec: Any, template: Any
) -> PerMicrobatch:
    """A ``PerMicrobatch`` over the stacked ``tensors``, of a known structure."""
    self = tuple.__new__(PerMicrobatch, tensors)
    self.values, self.spec, self.template = values, spec, template
    self.description = _describe(spec)
    return self


class _Captured:
    """What a capture recorded of one ``PerMicrobatch`` keyword: its structure and a
    snapshot of its constants (micro-batch 0's value, the template the capture rebuilds
    every micro-batch's value on)."""

    __slots__ = ("snapshot", "spec")

    def __init__(self, spec: Any, snapshot: Any) -> None:
        self.spec, self.snapshot = spec, snapshot


def structures(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The structures and constants of a call's ``PerMicrobatch`` keywords, by name (what
    ``check_captured`` compares later steps' with). The constants are the snapshot taken
    by the check before this call's step (``check_capturable`` or ``check_captured``), so
    what the step itself caches on them does not count."""
    out = {}
    for name, v in kwargs.items():
        if isinstance(v, PerMicrobatch):
            snaps = v.__dict__.get("_snapshots") or (_snapshots(v) if v.values else [None])
            out[name] = _Captured(v.spec, snaps[0])
    return out


def check_count(name: str, value: Any, m: int) -> None:
    """A ``PerMicrobatch`` keyword must hold one value per micro-batch."""
    if isinstance(value, PerMicrobatch) and value[0].shape[0] != m:
        raise ValueError(
            f"keyword {name!r} is a PerMicrobatch of {value[0].shape[0]} values, but the "
            f"pipeline has num_microbatches={m}"
        )


class ConstantChanged(ValueError):
    """A replay's ``PerMicrobatch`` keyword holds other constants than the captured step's
    (with ``recapture=True`` the driver captures the step anew instead of raising)."""


def check_captured(captured: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """A later step of a capture: its ``PerMicrobatch`` keywords must have the captured
    structures (``captured``: ``structures`` of the captured step) and constants.

    ``ValueError`` for another structure, or for constants that differ between the
    micro-batches of this step; ``ConstantChanged`` for constants other than the captured
    ones (compared by value, see the module doc), naming the keyword and the place."""
    for name, v in given.items():
        old = captured.get(name)
        if not isinstance(v, PerMicrobatch) or old is None:
            continue
        if _skeleton(v.spec) != _skeleton(old.spec):
            raise ValueError(
                f"keyword {name!r}: the step was captured with values of another structure: "
                + _first_difference(old.spec, v.spec, "the value")
                + "; a captured step replays the captured structure (build the pipeline "
                "again, or run it without capture)"
            )
        if not v.values:
            continue  # a structure over static buffers: no constants of its own
        snaps = _snapshots(v)
        _refuse_differing_microbatches(name, snaps)
        found = None
        if old.snapshot is not None:  # None: recorded over static buffers, no constants
            found = _difference(old.snapshot, snaps[0], "the value")
        if found is None and v.spec != old.spec:  # equal by value but described otherwise
            where, _, what = _first_difference(old.spec, v.spec, "the value").partition(" is ")
            found = (where, what)
        if found is None:
            continue
        # A recapture warms up on these values: refuse first what it could not capture.
        _refuse_unreached(name, v)
        where, what = found
        raise ConstantChanged(
            f"keyword {name!r}: {where} changed since the step was captured: it is "
            f"{what}. The captured step baked the captured constant in and a replay would "
            "use it: pass what changes as a tensor inside the value (it gets a static "
            "buffer), build the pipeline with recapture=True (a step with other constants "
            "is captured anew), or run it without capture"
        )


def check_capturable(kwargs: Mapping[str, Any]) -> None:
    """Before a warmup, refuse ``PerMicrobatch`` values that capture cannot serve: tensors
    that the walk of the structure does not reach (in a ``functools.partial``'s arguments,
    a function's defaults, a callable object's attributes) could not get static buffers,
    and a replay would read the captured ones; constants that differ between the
    micro-batches would be replayed as micro-batch 0's for all."""
    for name, v in kwargs.items():
        if not isinstance(v, PerMicrobatch) or not v.values:
            continue
        _refuse_unreached(name, v)
        _refuse_differing_microbatches(name, _snapshots(v))


def _refuse_unreached(name: str, v: PerMicrobatch) -> None:
    for where in _unreached(v.values[0], "the value"):
        raise ValueError(
            f"keyword {name!r}: {where} holds tensors that capture cannot give static "
            "buffers (a replay would read the captured ones): pass them inside the "
            "value (a closure, an attribute, a container), or run without capture"
        )


def _refuse_differing_microbatches(name: str, snaps: Sequence[Any]) -> None:
    for i, snap in enumerate(snaps[1:], start=1):
        found = _difference(snaps[0], snap, f"micro-batch {i}'s value")
        if found is not None:
            where, what = found
            raise ValueError(
                f"keyword {name!r}: {where} differs from micro-batch 0's: it is {what}. "
                "A captured step rebuilds every micro-batch's value on micro-batch 0's "
                "constants and would replay them for all: give the micro-batches equal "
                "constants, pass what differs as a tensor inside the value (it gets a "
                "static buffer), or run without capture (an eager step passes each "
                "micro-batch its own value)"
            )


# ------------------------------------------------------------ constants by value
_DEPTH = 12  # levels of a constant compared part by part; deeper ones by ==
_NODES = 4096  # parts of one value compared part by part; the rest by ==
_BY_IDENTITY = (torch.Tensor, torch.nn.Module, types.ModuleType, type, enum.Enum)
_TENSOR = ("tensor", None)  # a tensor of the structure: its static buffer serves it


def _snapshots(v: PerMicrobatch) -> list[Any]:
    """The snapshots of ``v``'s values, one per micro-batch (kept on ``v`` for
    ``structures``: the warmup records the ones taken before its step)."""
    snaps = [_guided(x, v.spec, [_NODES]) for x in v.values]
    v.__dict__["_snapshots"] = snaps
    return snaps


def _skeleton(spec: Any) -> Any:
    """``spec`` without its constants: what a recapture cannot change."""
    kind = spec[0]
    if kind == "tensor":
        return spec
    if kind == "const":
        return ("const",)
    if kind == "seq":
        return ("seq", spec[1], tuple(_skeleton(s) for s in spec[2]))
    if kind == "dict":
        return ("dict", spec[1], spec[2], tuple(_skeleton(s) for s in spec[3]))
    consts = tuple(k for k, _ in spec[3])
    kids = tuple(_skeleton(s) for s in spec[4])
    if kind == "function":  # which function it is: its code, a constant
        return ("function", spec[2], consts, kids)
    return ("object", spec[1], spec[2], consts, kids)


def _guided(v: Any, spec: Any, budget: list[int]) -> Any:
    """The snapshot of a value of structure ``spec``: its tensors left out (static buffers
    serve them), its constants by ``_snapshot``."""
    kind = spec[0]
    if kind == "tensor":
        return _TENSOR
    if kind == "const":
        return _snapshot(v, 0, budget)
    if kind == "seq":
        items = tuple(_guided(x, s, budget) for x, s in zip(v, spec[2], strict=True))
        return ("seq", v, type(v), items)
    if kind == "dict":
        items = tuple(_guided(v[k], s, budget) for k, s in zip(spec[2], spec[3], strict=True))
        return ("dict", v, type(v), spec[2], items)
    if kind == "function":
        tensors = dict(zip(spec[2], spec[4], strict=True))
        cells = tuple(
            _guided(c, tensors[i], budget) if i in tensors else _snapshot(c, 1, budget)
            for i, c in enumerate(_cells(v))
        )
        return _function(v, cells, 0, budget)
    attrs = _attributes(v) or {}
    names = (*spec[2], *(k for k, _ in spec[3]))
    kids = dict(zip(spec[2], spec[4], strict=True))
    items = tuple(
        _guided(attrs[k], kids[k], budget) if k in kids else _snapshot(attrs[k], 1, budget)
        for k in names
    )
    return ("object", v, type(v), names, items)


def _function(fn: types.FunctionType, cells: tuple, depth: int, budget: list[int]) -> Any:
    return (
        "function",
        fn,
        fn.__code__,
        fn.__globals__,
        _snapshot(fn.__defaults__, depth + 1, budget),
        _snapshot(fn.__kwdefaults__, depth + 1, budget),
        cells,
    )


def _snapshot(v: Any, depth: int, budget: list[int]) -> Any:
    """What a captured step bakes in of the constant ``v``, as nested tuples that hold the
    parts compared by ``==`` or identity (``_difference`` compares two)."""
    budget[0] -= 1
    if isinstance(v, _PLAIN) or depth > _DEPTH or budget[0] < 0:
        return ("value", v)
    if isinstance(v, _BY_IDENTITY):
        return ("identity", v)
    if isinstance(v, (tuple, list)):
        return ("seq", v, type(v), tuple(_snapshot(x, depth + 1, budget) for x in v))
    if isinstance(v, dict):
        items = tuple(_snapshot(x, depth + 1, budget) for x in v.values())
        return ("dict", v, type(v), tuple(v), items)
    if isinstance(v, (set, frozenset)):
        return ("set", v, type(v), frozenset(v))
    if isinstance(v, types.FunctionType):
        cells = tuple(_snapshot(c, depth + 1, budget) for c in _cells(v))
        return _function(v, cells, depth, budget)
    if isinstance(v, functools.partial):
        parts = (v.func, v.args, v.keywords)
        return ("partial", v, *(_snapshot(x, depth + 1, budget) for x in parts))
    if isinstance(v, types.MethodType):
        parts = (v.__func__, v.__self__)
        return ("method", v, *(_snapshot(x, depth + 1, budget) for x in parts))
    state = _state(v)
    if state is None:
        return ("value", v)
    items = tuple(_snapshot(x, depth + 1, budget) for x in state.values())
    return ("object", v, type(v), tuple(state), items)


def _state(v: Any) -> dict[str, Any] | None:
    """An object's attributes (its ``__dict__`` and slots), None when it has none."""
    try:
        d = object.__getattribute__(v, "__dict__")
    except AttributeError:
        d = None
    out = dict(d) if isinstance(d, dict) else {}
    for c in type(v).__mro__:
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__") or name in out:
                continue
            try:
                out[name] = object.__getattribute__(v, name)
            except AttributeError:
                continue  # an unset slot
    return out if out or isinstance(d, dict) else None


_PARTS = {
    "function": (".__defaults__", ".__kwdefaults__"),
    "partial": (".func", ".args", ".keywords"),
    "method": (".__func__", ".__self__"),
}


def _difference(a: Any, b: Any, where: str) -> tuple[str, str] | None:
    """Where the snapshots ``a`` (the reference) and ``b`` first differ, and how in words
    (``(place, "X, not Y")``); None when they are equal."""
    found = _differs(a, b)
    if found is None:
        return None
    path, what = found
    return where + "".join(reversed(path)), what


def _differs(a: Any, b: Any) -> tuple[list[str], str] | None:
    """``_difference``'s walk: the place as its parts, innermost first (formatted only
    for a difference: the walk runs before every replay)."""
    kind = a[0]
    if b[0] != kind or (kind in ("seq", "dict", "set", "object") and a[2] is not b[2]):
        return [], f"{_shown(b)}, not {_shown(a)}"  # another kind or type
    if kind == "tensor":
        return None
    if kind == "value":
        if _same(a[1], b[1]):
            return None
        if type(a[1]) is type(b[1]) and not isinstance(a[1], _PLAIN):
            return [], f"another {_shown(b)}, not == to the captured one"
        return [], f"{_shown(b)}, not {_shown(a)}"
    if kind == "identity":
        if a[1] is b[1]:
            return None
        return [], f"another {_shown(b)} (compared by identity), not the captured one"
    if kind == "set":
        return None if _same(a[3], b[3]) else ([], f"{_shown(b)}, not {_shown(a)}")
    if kind == "function":
        if a[2] != b[2] or a[3] is not b[3]:
            if a[1].__qualname__ != b[1].__qualname__:
                return [], f"the function {_shown(b)}, not {_shown(a)}"
            return [], f"{_shown(b)} with other code (or globals) than the captured one"
        if len(a[6]) != len(b[6]):  # pragma: no cover - equal code has equal cells
            return [], f"{_shown(b)} with other closure cells"
        groups = [
            ("{}", _PARTS[kind], a[4:6], b[4:6]),
            (".<closure {}>", range(len(a[6])), a[6], b[6]),
        ]
    elif kind in _PARTS:
        groups = [("{}", _PARTS[kind], a[2:], b[2:])]
    elif kind == "seq":
        if len(a[3]) != len(b[3]):
            return [], f"{_shown(b)}, not {_shown(a)}"
        groups = [("[{}]", range(len(a[3])), a[3], b[3])]
    else:  # a dict or an object: keys (attribute names), then values
        if not _same(a[3], b[3]):
            what = "keys" if kind == "dict" else "attributes"
            return [], f"{_shown(b)} with {what} {list(b[3])}, not {list(a[3])}"
        groups = [("[{!r}]" if kind == "dict" else ".{}", a[3], a[4], b[4])]
    for fmt, keys, xs, ys in groups:
        for k, x, y in zip(keys, xs, ys):
            if x is y:  # a shared node (_TENSOR)
                continue
            found = _differs(x, y)
            if found is not None:
                found[0].append(fmt.format(k))
                return found
    return None


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for constants: of one type, floats by ``repr`` (``nan``, ``-0.0``); an
    ``==`` that raises or gives no bool (an array) counts as a difference."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, complex)):
        return repr(a) == repr(b)
    try:
        r = a == b
        if not isinstance(r, bool):
            if getattr(r, "shape", None) != ():  # a numpy bool is a bool, an array is not
                return False
            r = bool(r)
    except Exception:  # an == that cannot compare these: not known to be equal
        return False
    return r


def _shown(node: Any) -> str:
    """A snapshot in an error message, as it was when taken (a captured list may have
    changed in place since): plain values by ``repr``, plain sequences rebuilt from their
    items, the rest by type (and length)."""
    kind, v = node[0], node[1]
    if kind == "value":
        return _show(v)
    if kind == "seq":
        items = node[3]
        if len(items) <= 8 and all(n[0] == "value" and isinstance(n[1], _PLAIN) for n in items):
            plain = [n[1] for n in items]
            return _show(tuple(plain) if node[2] is tuple else plain)
        return f"a {node[2].__qualname__} of {len(items)} items"
    if kind == "set":
        items, name = node[3], node[2].__qualname__
        if len(items) <= 8 and all(isinstance(x, _PLAIN) for x in items):
            return f"a {name} {{" + ", ".join(_show(x) for x in sorted(items, key=repr)) + "}"
        return f"a {name} of {len(items)} items"
    return _constant(v)


def _show(v: Any) -> str:
    """A constant in an error message: plain values by ``repr`` (shortened)."""
    if isinstance(v, _PLAIN) or (
        isinstance(v, (tuple, list)) and len(v) <= 8 and all(isinstance(x, _PLAIN) for x in v)
    ):
        text = repr(v)
        return text if len(text) <= 80 else text[:77] + "..."
    return _constant(v)


def _unreached(v: Any, where: str, depth: int = 0) -> Iterator[str]:
    """Where ``v`` holds tensors that ``_flatten`` does not reach."""
    if depth > 8 or isinstance(v, (torch.Tensor, *_PLAIN)):
        return
    if isinstance(v, (tuple, list)):
        for i, x in enumerate(v):
            yield from _unreached(x, f"{where}[{i}]", depth + 1)
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _unreached(x, f"{where}[{k!r}]", depth + 1)
    elif isinstance(v, functools.partial):
        if _holds_tensors((v.args, v.keywords)):
            yield f"{where} (a functools.partial of {_constant(v.func)})"
        yield from _unreached(v.func, where, depth + 1)
    elif isinstance(v, types.FunctionType):
        if _holds_tensors((v.__defaults__ or (), v.__kwdefaults__ or {})):
            yield f"{where} (the defaults of {v.__qualname__!r})"
        for i, c in enumerate(_cells(v)):
            if c is not _EMPTY:
                yield from _unreached(c, f"{where}.<closure {i}>", depth + 1)
    elif callable(v) and not isinstance(v, type) and not dataclasses.is_dataclass(v):
        attrs = getattr(v, "__dict__", {})
        if not isinstance(v, torch.nn.Module) and _holds_tensors(dict(attrs)):
            yield f"{where} (a callable {type(v).__qualname__})"
    else:
        attrs = _attributes(v)
        for k, x in (attrs or {}).items():
            yield from _unreached(x, f"{where}.{k}", depth + 1)
