"""The input/weight split of backward: deferrable weight-gradient GEMMs.

Every ``nn.Linear`` inside a stage, and every subclass of it that keeps ``nn.Linear.forward``
(torchtitan's ``Linear``, FSDP2's ``FSDPLinear``), is switched (by class, in place:
parameters, state dict, attributes and ``isinstance`` are unchanged) to ``DeferrableLinear``,
or to a subclass of it and of the original class made once per class. Its backward computes
the input gradient at once; the weight gradient ``grad_out^T @ x`` (and the bias sum) is
either computed at once (``B``: full backward) or, while its stage's ``WeightGradStore`` is
deferring on behalf of an ``I`` action, stashed under the key of the ``W`` action that will run
it. ``W`` then runs exactly those GEMMs and accumulates into the ``.grad`` of the parameters
the forward read. Both accumulate in the GEMM itself (``.grad += g^T x`` as one ``addmm_``),
not as a GEMM then an add; a full backward of a small layer (under
``FUSED_ACCUMULATION_MIN_NUMEL`` weights) uses plain autograd instead.

Under ``torch.compile`` the Linear's forward and input-gradient GEMM are traced into the
graph like any Linear's, and its weight gradient is one opaque custom op
(``graphpipe::linear_weight_grad``) that asks the store at run time whether to stash the work
(``I``) or do it now (``B``): the split is decided per call, not frozen when the graph is traced.

Hugging Face's ``Conv1D`` (``transformers.pytorch_utils.Conv1D``: GPT-2's attention and MLP
projections, ``x @ W + b`` with ``W`` stored as [in, out]) is switched the same way, to a class
derived from ``DeferrableConv1D`` and it; its weight gradient is ``x^T @ grad_out``. A compiled
one (``torch.compile``) computes its weight gradient in ``I``.

Linear-like modules that cannot be switched (a subclass that overrides ``forward``, a module
holding a matrix weight that is not an ``nn.Linear``) are left alone with a warning naming
them, once per module; ``no_defer`` silences it. Other parameters (norm weights, embeddings,
custom layers) get their gradients during ``I`` like in a full backward: they are not
deferred. They are small next to the Linear weights, whose GEMMs are the work that zero-bubble
schedules move into bubbles.

State is explicit: one store per stage, held by the executor; no class-level queues. The
store is plain object state, not thread-local, because CUDA autograd runs backward on a
worker thread. A compiled graph can carry no Python object, so it names its store by a number
(a CPU tensor, a graph input rather than a constant: one graph serves every stage); the
module keeps a weak table from numbers to live stores.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from graphpipe.meta import is_dtensor

__all__ = [
    "FUSED_ACCUMULATION_MIN_NUMEL",
    "DeferrableConv1D",
    "DeferrableLinear",
    "WeightGradStore",
    "make_deferrable",
    "no_defer",
    "switch_linears",
]

_NO_DEFER = "_graphpipe_no_defer"

# From this many weight elements (512 x 512) a full backward (B) also goes through the custom
# Function, to accumulate its weight gradient into .grad in the GEMM (see
# _accumulate_weight_grad). Below, the Function's fixed host cost per call outweighs the
# pass over .grad it saves; above, the pass costs up to as much as the GEMM. Read when a
# pipeline is built (make_deferrable): set it before, e.g. to 0 for a captured step, whose
# replay has no host cost.
FUSED_ACCUMULATION_MIN_NUMEL = 1 << 18

_store_ids = itertools.count()
# Live stores by number, for the compiled op (see the module docstring).
_STORES: weakref.WeakValueDictionary[int, WeightGradStore] = weakref.WeakValueDictionary()


class WeightGradStore:
    """Deferred weight-gradient work of one stage, keyed by the ``W`` action that runs it."""

    __slots__ = ("__weakref__", "_key", "_pending", "_token", "accumulating", "split")

    def __init__(self) -> None:
        self._pending: dict[Hashable, list[tuple[Callable[..., None], tuple]]] = {}
        self._key: Hashable | None = None
        # Whether forwards run now may have their backward split into I + W. The executor
        # clears it for micro-batches whose backward is a full B, which then use plain
        # F.linear autograd (cheaper than the custom Function on the host). It sets it again
        # before each backward, to the value of that micro-batch's forward: an activation
        # checkpoint recomputes the forward during the backward, and the recompute must take
        # the same path (the two paths save different tensors: x and W, or x and W^T).
        # Compiled Linears do not read it (one graph for both; see DeferrableLinear).
        self.split = True
        # Set by the executor around the backwards it runs (B): then a weight gradient that is
        # not deferred goes straight into .grad (fused, see _accumulate_weight_grad) instead
        # of back to autograd. Outside (a user's own backward or torch.autograd.grad on a stage)
        # autograd gets it as from any Linear, except in a compiled stage (see DeferrableLinear).
        self.accumulating = False
        number = next(_store_ids)
        self._token = torch.tensor(number, device="cpu")  # how a compiled graph names it
        _STORES[number] = self

    def __reduce__(self) -> tuple[type[WeightGradStore], tuple[()]]:
        # A copy (deepcopy or pickle of a stage) gets a store of its own, empty: pending work
        # belongs to one step of one pipeline, and the number names one store.
        return WeightGradStore, ()

    @property
    def is_deferring(self) -> bool:
        """Whether weight-gradient work run now is stashed (inside ``deferring``)."""
        return self._key is not None

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Within this block, Linear weight gradients are stashed under ``key``."""
        if key in self._pending:
            raise RuntimeError(f"weight-gradient work for {key!r} is already pending")
        self._pending[key] = []
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def defer(self, fn: Callable[..., None], *args: Any) -> bool:
        """Inside an ``I`` action: stash ``fn(*args)`` (weight-gradient work that accumulates
        into ``.grad``) for its ``W`` and return True. Elsewhere return False: the caller runs
        the work now. The hook for custom layers (see ``make_deferrable``)."""
        if self._key is None:
            return False
        self._pending[self._key].append((fn, args))
        return True

    def run(self, key: Hashable) -> int:
        """Run (and drop) the weight-gradient GEMMs stashed under ``key``; returns their count."""
        try:
            work = self._pending.pop(key)
        except KeyError:
            raise RuntimeError(
                f"no deferred weight-gradient work for {key!r}; pending: {list(self._pending)}"
            ) from None
        # Outside autograd: the stashed input x may require grad (an activation inside the
        # stage), and grad_out^T @ x would then build a graph into .grad, keeping the
        # micro-batch's activations alive and leaving .grad with requires_grad=True.
        with torch.no_grad():
            for fn, args in work:
                fn(*args)
        return len(work)

    def pending(self) -> list[Hashable]:
        """Keys whose work has not run yet."""
        return list(self._pending)

    def clear(self) -> None:
        self._pending.clear()
        self._key = None


def _store_numbered(token: torch.Tensor) -> WeightGradStore:
    number = int(token)
    store = _STORES.get(number)
    if store is None:
        raise RuntimeError(
            f"a compiled Linear names WeightGradStore {number}, which no longer exists "
            "(its pipeline was dropped): build the pipeline again"
        )
    return store


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _accumulate_weight_grad(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, g: torch.Tensor
) -> None:
    """``weight.grad += g^T x`` (and ``bias.grad += sum(g)``).

    ``weight`` and ``bias`` are the parameter objects the Linear's forward read (under FSDP2
    the unsharded parameters, registered on the module between FSDP's hooks: their ``.grad``
    is what FSDP's post-backward reduce-scatters), not what the module holds when this runs.

    Into an existing ``.grad`` of the operands' dtype this is one GEMM with beta = 1
    (``addmm_``): no weight-sized temporary and no second pass over ``.grad``, which for a
    large Linear costs as much as the GEMM itself (Megatron's gradient-accumulation fusion).
    Otherwise (the first micro-batch, or autocast's low-precision operands into an fp32
    ``.grad``) the GEMM's result is cast and stored or added like autograd would.
    """
    g2 = g.reshape(-1, g.shape[-1])
    _accumulate_product(weight, bias, g2.t(), x.reshape(-1, x.shape[-1]), g2)


def _accumulate_product(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    g2: torch.Tensor,
) -> None:
    """``weight.grad += a @ b`` and ``bias.grad += sum(g2)``: in the GEMM (``addmm_``) when
    ``.grad`` exists in the operands' dtype, else computed, cast and stored or added."""
    if weight.requires_grad:
        grad = weight.grad
        if grad is not None and grad.dtype == a.dtype == b.dtype:
            grad.addmm_(a, b)
        else:
            _accumulate(weight, a.mm(b))
    if bias is not None and bias.requires_grad:
        _accumulate(bias, g2.sum(0))


def _weight_backward(
    ctx: Any, x: torch.Tensor, g: torch.Tensor, gx: torch.Tensor | None, in_out: bool
) -> tuple[torch.Tensor | None, ...]:
    """The backward of ``_LinearFn`` and ``_Conv1DFn`` after ``gx``: the weight gradient
    deferred to the store's ``W``, accumulated into ``.grad`` now (the executor's full
    backward), or handed to autograd. ``in_out``: the weight is ``[in, out]`` (``Conv1D``)."""
    need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    accumulate = _accumulate_conv1d_weight_grad if in_out else _accumulate_weight_grad
    store = ctx.store
    if not need_w or store.defer(accumulate, *ctx.params, x, g):
        return gx, None, None, None, None
    if store.accumulating:
        # The executor's full backward: into .grad now, fused, instead of handing the
        # weight gradient to autograd (which would add it into .grad in a second pass).
        with torch.no_grad():
            accumulate(*ctx.params, x, g)
        return gx, None, None, None, None
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    gw = None
    if ctx.needs_input_grad[1]:
        gw = x2.t().mm(g2) if in_out else g2.t().mm(x2)
    gb = g2.sum(0) if ctx.needs_input_grad[2] else None
    return gx, gw, gb, None, None


class _LinearFn(torch.autograd.Function):
    """The eager Linear: decides in its backward, from the store, whether to defer."""

    @staticmethod
    def forward(ctx, x, weight, bias, params, store):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.params = params  # (weight, bias) Parameters as the forward read them
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        return _weight_backward(ctx, x, g, gx, in_out=False)


def _linear_weight_grad(
    g: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    store: torch.Tensor,
) -> None:
    """The weight gradient of a compiled Linear, run as it is (opaque to the compiler): stashed
    for the ``W`` while the store defers, else accumulated into ``.grad`` now."""
    owner = _store_numbered(store)
    if owner.is_deferring:
        # Copies: the compiled graph reuses the memory of its intermediates (g, and x when it
        # is recomputed in the backward) once their last op in the graph has run, which is
        # this one; the stashed tensors must outlive the graph.
        owner.defer(_accumulate_weight_grad, weight, bias, x.clone(), g.clone())
        return
    with torch.no_grad():
        _accumulate_weight_grad(weight, bias, x, g)


# A plain library op, not torch.library.custom_op: custom_op's Python wrappers add host work
# to every call, which runs once per Linear and micro-batch (docs/benchmarks.md has its cost).
_LIB = torch.library.Library("graphpipe", "FRAGMENT")
_LIB.define(
    "linear_weight_grad(Tensor g, Tensor x, Tensor weight, Tensor? bias, Tensor store) -> ()"
)
_LIB.impl("linear_weight_grad", _linear_weight_grad, "CompositeExplicitAutograd")


@torch.library.register_fake("graphpipe::linear_weight_grad", lib=_LIB)
def _(g, x, weight, bias, store) -> None:
    return None


# It returns nothing and writes no tensor argument: without this mark the compiler drops it
# as dead code, and the W would find no work and the weights get no gradient.
torch.fx.node.has_side_effect(torch.ops.graphpipe.linear_weight_grad.default)


class _CompiledLinearFn(torch.autograd.Function):
    """The Linear of a compiled stage. Dynamo traces forward and backward into the graph;
    the weight gradient is the opaque op, so what it does is decided when it runs.

    ``w_param`` / ``b_param``: the parameters when ``weight`` / ``bias`` are autocast's copies
    of them, else None (dynamo does not trace a Function given one tensor twice)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, w_param, b_param):  # type: ignore[override]
        ctx.save_for_backward(x, weight, bias, store, w_param, b_param)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight, bias, store, w_param, b_param = ctx.saved_tensors
        if w_param is not None:
            weight_param, bias_param = w_param, b_param
        else:
            weight_param, bias_param = weight, bias
        torch.ops.graphpipe.linear_weight_grad(g, x, weight_param, bias_param, store)
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None, None


def _autocast_copies(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(x, weight, bias)`` cast as autocast casts a Linear's operands; None outside it."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return x.to(dt), weight.to(dt), bias.to(dt) if bias is not None else None


class DeferrableLinear(nn.Linear):
    """An ``nn.Linear`` whose weight-gradient GEMM can be deferred to a ``W`` action.

    Created only by ``make_deferrable`` (class switch of an existing ``nn.Linear``, or of a
    subclass that keeps ``nn.Linear.forward``: then the module's class is a subclass of both,
    made once per original class). Without a store it behaves exactly like ``nn.Linear``.

    Its weight gradient goes to the ``.grad`` of the parameter objects its forward read
    (``self.weight`` and ``self.bias`` at that time: under FSDP2 the unsharded parameters).
    Eager, a backward the executor does not run (``loss.backward()`` or
    ``torch.autograd.grad`` of your own) hands it to autograd as any Linear would. Compiled
    (``torch.compile``), the weight gradient is never handed to autograd: outside ``I`` it goes
    straight into ``.grad``, so ``backward()`` gives the usual gradients but
    ``torch.autograd.grad`` with respect to these weights does not see them (torch raises
    that they were not used in the graph).
    """

    _wgrad_store: WeightGradStore | None = None
    _wgrad_token: torch.Tensor | None = None
    _wgrad_fused = False
    _graphpipe_original: type[nn.Linear] = nn.Linear  # the class make_deferrable switched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._compiled_forward(x)
        d = self.__dict__
        store = d.get("_wgrad_store")
        # A full backward (not split) of a small layer takes plain autograd: cheaper on the
        # host than the custom Function, and the second pass over a small .grad costs little.
        if store is None or not (store.split or d["_wgrad_fused"]) or not torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        weight, bias = self.weight, self.bias
        params = (weight, bias)
        cast = _autocast_copies(x, weight, bias)
        if cast is None:
            return _LinearFn.apply(x, weight, bias, params, store)
        # Save the cast copies: backward runs outside autocast.
        with torch.autocast(x.device.type, enabled=False):
            return _LinearFn.apply(*cast, params, store)

    def _compiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        # One path whatever store.split says (reading it would trace a graph per value): the
        # op decides at run time, and a B's weight gradient then goes into .grad fused.
        token = self._wgrad_token
        weight, bias = self.weight, self.bias
        if token is None or not torch.is_grad_enabled() or is_dtensor(weight):
            # A DTensor weight (tensor parallel): the opaque op has no DTensor sharding rule,
            # so the Linear backward stays whole (the pipeline warns after its first step
            # that the stage's W actions had nothing to do).
            return F.linear(x, weight, bias)
        cast = _autocast_copies(x, weight, bias)
        if cast is None:
            return _CompiledLinearFn.apply(x, weight, bias, token, None, None)
        with torch.autocast(x.device.type, enabled=False):
            return _CompiledLinearFn.apply(*cast, token, weight, bias)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Pickle (and deepcopy) through the original class: a class made by make_deferrable
        # cannot be found by name; _deferrable_class makes it again where it is loaded.
        return _new_deferrable, (self._graphpipe_original,), self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        store = state.get("_wgrad_store")
        if store is not None:  # a copied store has a number of its own
            self.__dict__["_wgrad_token"] = store._token


_DEFERRABLE_CLASSES: dict[type[nn.Linear], type[DeferrableLinear]] = {nn.Linear: DeferrableLinear}


def _deferrable_class(cls: type[nn.Linear]) -> type[DeferrableLinear]:
    """The class a module of class ``cls`` (``nn.Linear`` or a subclass keeping its forward) is
    switched to: ``DeferrableLinear`` for ``nn.Linear``; else a subclass of ``DeferrableLinear``
    and ``cls`` (``DeferrableLinear.forward`` first in its MRO), made once per class."""
    return _mixed_class(DeferrableLinear, cls, _DEFERRABLE_CLASSES)


def _mixed_class(mixin: type, cls: type, made: dict) -> Any:
    """A subclass of ``mixin`` and ``cls`` (the mixin's ``forward`` first in its MRO), named
    and placed as ``cls``, made once per class and kept in ``made``."""
    if cls not in made:
        name = f"Deferrable{cls.__name__}"
        made[cls] = type(
            name,
            (mixin, cls),
            {
                "__module__": cls.__module__,
                "__qualname__": name,
                "__doc__": f"{cls.__qualname__} with deferrable weight gradients (graphpipe).",
                "_graphpipe_original": cls,
            },
        )
    return made[cls]


def _new_deferrable(cls: type[nn.Linear]) -> DeferrableLinear:
    made = _deferrable_class(cls)
    return nn.Module.__new__(made)


def _accumulate_conv1d_weight_grad(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, g: torch.Tensor
) -> None:
    """``weight.grad += x^T g`` (and ``bias.grad += sum(g)``) for a ``Conv1D`` weight
    ([in, out]); in the GEMM when ``.grad`` exists in the operands' dtype (as
    ``_accumulate_weight_grad``)."""
    g2 = g.reshape(-1, g.shape[-1])
    _accumulate_product(weight, bias, x.reshape(-1, x.shape[-1]).t(), g2, g2)


class _Conv1DFn(torch.autograd.Function):
    """``x @ weight + bias`` (``weight`` [in, out]): decides in its backward, from the store,
    whether to defer the weight gradient (as ``_LinearFn``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, params, store):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.params = params
        ctx.store = store
        x2 = x.reshape(-1, x.shape[-1])
        out = x2.mm(weight) if bias is None else torch.addmm(bias, x2, weight)
        return out.view(*x.shape[:-1], weight.shape[-1])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight.t()) if ctx.needs_input_grad[0] else None
        return _weight_backward(ctx, x, g, gx, in_out=True)


class DeferrableConv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (GPT-2's projections) with a weight gradient that can be
    deferred to a ``W`` action: mixed into a class made once per ``Conv1D`` class by
    ``make_deferrable`` (``isinstance``, attributes and state dict keys stay). Outside a
    split micro-batch, without a store, under ``torch.compile`` or with a DTensor weight it
    runs ``Conv1D.forward`` as it is."""

    _wgrad_store: WeightGradStore | None = None
    _graphpipe_original: type[nn.Module] = nn.Module  # the Conv1D class it was switched from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = self.__dict__.get("_wgrad_store")
        weight, bias = self.weight, self.bias
        if (
            store is None
            or not store.split
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or is_dtensor(weight)
        ):
            return super().forward(x)  # type: ignore[misc]
        params = (weight, bias)
        cast = _autocast_copies(x, weight, bias)
        if cast is None:
            return _Conv1DFn.apply(x, weight, bias, params, store)
        with torch.autocast(x.device.type, enabled=False):
            return _Conv1DFn.apply(*cast, params, store)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # As DeferrableLinear: through the original class, made again where it is loaded.
        return _new_deferrable_conv1d, (self._graphpipe_original,), self.__dict__.copy()


_CONV1D_CLASSES: dict[type[nn.Module], type[DeferrableConv1D]] = {}


def _is_conv1d(m: nn.Module) -> bool:
    """``m`` is exactly Hugging Face's ``Conv1D`` (not a subclass, which may compute
    something else), unwrapped (transformers is not imported to ask)."""
    cls = type(m)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__ == "transformers.pytorch_utils"
        and isinstance(getattr(m, "weight", None), nn.Parameter)
        and m.weight.dim() == 2
        and not parametrize.is_parametrized(m)
        and "forward" not in m.__dict__
    )


def _deferrable_conv1d_class(cls: type[nn.Module]) -> type[DeferrableConv1D]:
    return _mixed_class(DeferrableConv1D, cls, _CONV1D_CLASSES)


def _new_deferrable_conv1d(cls: type[nn.Module]) -> DeferrableConv1D:
    return nn.Module.__new__(_deferrable_conv1d_class(cls))


def no_defer(module: nn.Module) -> nn.Module:
    """Mark ``module`` (and everything inside it) to keep its ``nn.Linear`` layers as they are:
    a pipeline built afterwards does not switch them to ``DeferrableLinear`` (their weight
    gradients are computed during ``I`` like any other parameter's) and does not warn about
    Linear-like layers it cannot defer there. Returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_defer takes an nn.Module, got {type(module).__name__}")
    object.__setattr__(module, _NO_DEFER, True)
    return module


# Modules without deferral whose matrix weights are not GEMM work of a Linear's kind.
_NOT_LINEAR_LIKE = (nn.Embedding, nn.EmbeddingBag)
_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _switchable(m: nn.Module) -> bool:
    return (
        isinstance(m, nn.Linear)
        and type(m).forward is nn.Linear.forward
        and not parametrize.is_parametrized(m)
        # a forward set on the instance (a wrapper) calls the forward it wrapped: a class
        # switch now would not reach it (switch_linears before wrapping)
        and "forward" not in m.__dict__
    )


def switch_linears(module: nn.Module) -> int:
    """Switch the Linear layers in ``module`` to ``DeferrableLinear`` now, bound to no store
    (so they run exactly as ``nn.Linear`` until a pipeline binds its store with
    ``make_deferrable``). For code that wraps a layer's ``forward`` on the instance (as
    torchtitan's ``Module.parallelize`` does: the wrapper calls the bound forward it found),
    call this before the wrapping, so that the wrapper calls ``DeferrableLinear.forward``;
    ``graphpipe.integrations.torchtitan.pipelining_fn`` does. Modules marked ``no_defer`` are
    skipped. Returns the number of layers switched."""
    count = 0
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen or m.__dict__.get(_NO_DEFER, False):
            continue  # no_defer: the module and everything inside it
        seen.add(id(m))
        if not isinstance(m, DeferrableLinear) and _switchable(m):
            m.__class__ = _deferrable_class(type(m))
            count += 1
        stack.extend(m.children())
    return count


def _why_not_deferred(m: nn.Module) -> str | None:
    """Why ``m`` (not switched, no ``bind_weight_grad_store``) does Linear-like work that is
    not deferred; None when it does not."""
    cls = type(m).__qualname__
    if isinstance(m, nn.Linear):
        if parametrize.is_parametrized(m):
            return (
                "it is parametrized (torch.nn.utils.parametrize): its weight is computed in forward"
            )
        if "forward" in m.__dict__:
            return (
                "its forward is an instance attribute (a wrapper set on the module, as "
                "torchtitan's Module.parallelize sets), which calls the forward it wrapped, not "
                "the class's; call graphpipe.weightgrad.switch_linears(model) before the "
                "wrapping (graphpipe's torchtitan pipelining_fn does)"
            )
        return f"its class {cls} overrides nn.Linear.forward"
    if isinstance(m, nn.MultiheadAttention):
        return "it computes its projections inside F.multi_head_attention_forward"
    if isinstance(m, _NOT_LINEAR_LIKE):
        return None
    for name, p in m.named_parameters(recurse=False):
        if p.dim() >= 2 and p.is_floating_point():
            return f"it holds the matrix weight {name!r} {list(p.shape)} but is not an nn.Linear"
    return None


def _warn_not_deferred(where: str, path: str, m: nn.Module, why: str) -> None:
    if m in _warned:
        return
    _warned.add(m)
    cls = f"{type(m).__module__}.{type(m).__qualname__}"
    name = f"{where}.{path}" if path else where
    warnings.warn(
        f"graphpipe: {name} ({cls}) is not deferred: {why}, so its weight gradient is "
        "computed during I, not W. Give it a bind_weight_grad_store method to defer it, or "
        "mark it with graphpipe.no_defer(module) to silence this warning.",
        UserWarning,
        stacklevel=3,
    )


def make_deferrable(
    module: nn.Module, store: WeightGradStore, *, where: str | None = None, warn: bool = True
) -> int:
    """Switch the Linear layers in ``module`` to ``DeferrableLinear`` bound to ``store``, hand
    ``store`` to every submodule with a ``bind_weight_grad_store(store)`` method, and warn
    about the Linear-like layers it cannot defer.

    Switched: every ``nn.Linear``, and every subclass of it that does not override
    ``forward`` (torchtitan's ``Linear``; FSDP2's ``FSDPLinear``, which ``fully_shard`` makes
    for a sharded ``nn.Linear``): the module's class becomes ``DeferrableLinear`` or a subclass
    of both it and the original class, so ``isinstance``, attributes and state dict keys stay.
    A custom layer defers its weight-gradient work by binding the store and, in its backward,
    calling ``store.defer(fn, *args)`` (which stashes ``fn(*args)`` for the ``W`` action and
    returns True during an ``I``, and returns False otherwise: then it runs the work at once).

    Left alone with a ``UserWarning`` naming the module (``where`` and its path in
    ``module``, and its class), once per module: a subclass of ``nn.Linear`` that overrides
    ``forward`` or is parametrized, an ``nn.MultiheadAttention``, and any other module that
    holds a parameter of two or more dimensions (embeddings excepted). Modules marked by
    ``no_defer`` (with their contents) are skipped without a word.

    Switched too: Hugging Face's ``Conv1D`` (GPT-2), to ``DeferrableConv1D`` (see the module
    docstring).

    where: how the warning names ``module`` (default: its class name; the pipeline says which
        stage).
    warn: False leaves out the warnings, for a stage whose schedule never splits a backward
        into ``I`` and ``W`` (1F1B): there every weight gradient is computed in ``B`` anyway.

    Returns the number of layers now deferrable (switched Linears plus bound custom layers):
    the pipeline reports it per stage as ``pipe.num_deferrable``, a tuple in the order of its
    stages; 0 for a stage means its ``W`` actions have nothing to do.
    """
    while isinstance(getattr(module, "_orig_mod", None), nn.Module):
        module = module._orig_mod  # torch.compile(stage): name paths in the stage itself
    where = where if where is not None else type(module).__name__
    count = 0
    seen: set[int] = set()
    stack = [("", module)]  # module.named_modules(), each module once, under its first path
    while stack:
        path, m = stack.pop()
        if id(m) in seen or m.__dict__.get(_NO_DEFER, False):
            continue  # no_defer: the module and everything inside it
        seen.add(id(m))
        if not isinstance(m, DeferrableLinear) and _switchable(m):
            m.__class__ = _deferrable_class(type(m))
        elif not isinstance(m, DeferrableConv1D) and _is_conv1d(m):
            m.__class__ = _deferrable_conv1d_class(type(m))
        if isinstance(m, DeferrableLinear):
            m.__dict__["_wgrad_store"] = store
            m.__dict__["_wgrad_token"] = store._token
            m.__dict__["_wgrad_fused"] = m.weight.numel() >= FUSED_ACCUMULATION_MIN_NUMEL
            count += 1
        elif isinstance(m, DeferrableConv1D):
            m.__dict__["_wgrad_store"] = store
            count += 1
        elif callable(bind := getattr(m, "bind_weight_grad_store", None)):
            bind(store)
            count += 1
        elif (why := _why_not_deferred(m)) is not None:
            if warn:
                _warn_not_deferred(where, path, m, why)
            # What it holds is its own business (MultiheadAttention's out_proj is never
            # called; a parametrization's tensors are not layers).
            continue
        prefix = path + "." if path else ""
        stack.extend(reversed([(prefix + n, c) for n, c in m.named_children()]))
    return count
