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
agreement). Under capture: a step whose structure differs from the captured one is refused
naming the keyword (``check_captured``), and so are tensors the walk does not reach (a
``functools.partial``'s arguments, a function's defaults, a callable object's attributes:
``check_capturable``).

Owns: nothing (values and pure functions). May touch: nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
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


def structures(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The structures of a call's ``PerMicrobatch`` keywords, by name (what
    ``check_captured`` compares)."""
    return {name: v.spec for name, v in kwargs.items() if isinstance(v, PerMicrobatch)}


def check_count(name: str, value: Any, m: int) -> None:
    """A ``PerMicrobatch`` keyword must hold one value per micro-batch."""
    if isinstance(value, PerMicrobatch) and value[0].shape[0] != m:
        raise ValueError(
            f"keyword {name!r} is a PerMicrobatch of {value[0].shape[0]} values, but the "
            f"pipeline has num_microbatches={m}"
        )


def check_captured(captured: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """A replay's ``PerMicrobatch`` keywords must have the captured structures
    (``captured``: ``structures`` of the captured step)."""
    for name, v in given.items():
        old = captured.get(name)
        if isinstance(v, PerMicrobatch) and old is not None:
            if v.spec != old:
                raise ValueError(
                    f"keyword {name!r}: the step was captured with values of another structure: "
                    + _first_difference(old, v.spec, "the value")
                    + "; a captured step replays the captured constants (build the pipeline "
                    "again, or run it without capture)"
                )


def check_capturable(kwargs: Mapping[str, Any]) -> None:
    """Refuse ``PerMicrobatch`` values that capture cannot serve: tensors that the walk of
    the structure does not reach (in a ``functools.partial``'s arguments, a function's
    defaults, a callable object's attributes) could not get static buffers, and a replay
    would read the captured ones."""
    for name, v in kwargs.items():
        if not isinstance(v, PerMicrobatch) or not v.values:
            continue
        for where in _unreached(v.values[0], "the value"):
            raise ValueError(
                f"keyword {name!r}: {where} holds tensors that capture cannot give static "
                "buffers (a replay would read the captured ones): pass them inside the "
                "value (a closure, an attribute, a container), or run without capture"
            )


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
