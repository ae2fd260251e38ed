"""The input/weight split of backward: deferrable weight-gradient GEMMs.

Every plain ``nn.Linear`` inside a stage is switched (by class, in place: parameters,
state dict and ``isinstance`` are unchanged) to ``DeferrableLinear``. Its backward computes
the input gradient at once; the weight gradient ``grad_out^T @ x`` (and the bias sum) is
either computed at once (``B``: full backward) or, while its stage's ``WeightGradStore`` is
deferring on behalf of an ``I`` action, stashed under the key of the ``W`` action that will run
it. ``W`` then runs exactly those GEMMs and accumulates into ``.grad``. Both accumulate in the
GEMM itself (``.grad += g^T x`` as one ``addmm_``), not as a GEMM then an add; a full backward
of a small layer (under ``FUSED_ACCUMULATION_MIN_NUMEL`` weights) uses plain autograd instead.

Other parameters (norm weights, embeddings, custom layers) get their gradients during ``I``
like in a full backward: they are not deferred. They are small next to the Linear weights,
whose GEMMs are the work that zero-bubble schedules move into bubbles.

State is explicit: one store per stage, held by the executor; no class-level queues. The
store is plain object state, not thread-local, because CUDA autograd runs backward on a
worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FUSED_ACCUMULATION_MIN_NUMEL",
    "DeferrableLinear",
    "WeightGradStore",
    "make_deferrable",
    "no_defer",
]

_NO_DEFER = "_graphpipe_no_defer"

# From this many weight elements (512 x 512) a full backward (B) also goes through the custom
# Function, to accumulate its weight gradient into .grad in the GEMM (see
# _accumulate_weight_grad). Below, the Function's host cost (~15 us on a CPU) outweighs the
# pass over .grad it saves; above, the pass costs up to as much as the GEMM. Read when a
# pipeline is built (make_deferrable): set it before, e.g. to 0 for a captured step, whose
# replay has no host cost.
FUSED_ACCUMULATION_MIN_NUMEL = 1 << 18


class WeightGradStore:
    """Deferred weight-gradient work of one stage, keyed by the ``W`` action that runs it."""

    __slots__ = ("_key", "_pending", "accumulating", "split")

    def __init__(self) -> None:
        self._pending: dict[Hashable, list[tuple[Callable[..., None], tuple]]] = {}
        self._key: Hashable | None = None
        # Whether forwards run now may have their backward split into I + W. The executor
        # clears it for micro-batches whose backward is a full B, which then use plain
        # F.linear autograd (cheaper than the custom Function on the host). It sets it again
        # before each backward, to the value of that micro-batch's forward: an activation
        # checkpoint recomputes the forward during the backward, and the recompute must take
        # the same path (the two paths save different tensors: x and W, or x and W^T).
        self.split = True
        # Set by the executor around the backwards it runs (B): then a weight gradient that is
        # not deferred goes straight into .grad (fused, see _accumulate_weight_grad) instead
        # of back to autograd. Outside (a user's own backward or torch.autograd.grad on a stage)
        # autograd gets it as from any Linear.
        self.accumulating = False

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


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _accumulate_weight_grad(module: nn.Linear, x: torch.Tensor, g: torch.Tensor) -> None:
    """``weight.grad += g^T x`` (and ``bias.grad += sum(g)``).

    Into an existing ``.grad`` of the operands' dtype this is one GEMM with beta = 1
    (``addmm_``): no weight-sized temporary and no second pass over ``.grad``, which for a
    large Linear costs as much as the GEMM itself (Megatron's gradient-accumulation fusion).
    Otherwise (the first micro-batch, or autocast's low-precision operands into an fp32
    ``.grad``) the GEMM's result is cast and stored or added like autograd would.
    """
    g2 = g.reshape(-1, g.shape[-1])
    weight, bias = module.weight, module.bias
    if weight.requires_grad:
        x2 = x.reshape(-1, x.shape[-1])
        grad = weight.grad
        if grad is not None and grad.dtype == g2.dtype == x2.dtype:
            grad.addmm_(g2.t(), x2)
        else:
            _accumulate(weight, g2.t().mm(x2))
    if bias is not None and bias.requires_grad:
        _accumulate(bias, g2.sum(0))


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, store):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.module = module
        ctx.store = store
        ctx.with_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        store = ctx.store
        if not need_w or store.defer(_accumulate_weight_grad, ctx.module, x, g):
            return gx, None, None, None, None
        if store.accumulating:
            # The executor's full backward: into .grad now, fused, instead of handing the
            # weight gradient to autograd (which would add it into .grad in a second pass).
            with torch.no_grad():
                _accumulate_weight_grad(ctx.module, x, g)
            return gx, None, None, None, None
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


class DeferrableLinear(nn.Linear):
    """An ``nn.Linear`` whose weight-gradient GEMM can be deferred to a ``W`` action.

    Created only by ``make_deferrable`` (class switch of an existing ``nn.Linear``). Without
    a store it behaves exactly like ``nn.Linear``.
    """

    _wgrad_store: WeightGradStore | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.__dict__
        store = d.get("_wgrad_store")
        # A full backward (not split) of a small layer takes plain autograd: cheaper on the
        # host than the custom Function, and the second pass over a small .grad costs little.
        if store is None or not (store.split or d["_wgrad_fused"]) or not torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        weight, bias = self.weight, self.bias
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # Cast as autocast would, and save the cast copies: backward runs outside autocast.
            dt = torch.get_autocast_dtype(dev)
            x, weight = x.to(dt), weight.to(dt)
            bias = bias.to(dt) if bias is not None else None
            with torch.autocast(dev, enabled=False):
                return _LinearFn.apply(x, weight, bias, self, store)
        return _LinearFn.apply(x, weight, bias, self, store)


def no_defer(module: nn.Module) -> nn.Module:
    """Mark ``module`` (and everything inside it) to keep its ``nn.Linear`` layers as they are:
    a pipeline built afterwards does not switch them to ``DeferrableLinear``, so their weight
    gradients are computed during ``I`` like any other parameter's. Returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_defer takes an nn.Module, got {type(module).__name__}")
    object.__setattr__(module, _NO_DEFER, True)
    return module


def _unmarked_modules(module: nn.Module) -> Iterator[nn.Module]:
    """``module.modules()`` without the subtrees marked by ``no_defer`` (each module once)."""
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen or m.__dict__.get(_NO_DEFER, False):
            continue
        seen.add(id(m))
        yield m
        stack.extend(reversed(list(m.children())))


def make_deferrable(module: nn.Module, store: WeightGradStore) -> int:
    """Switch every plain ``nn.Linear`` in ``module`` to ``DeferrableLinear`` bound to ``store``,
    and hand ``store`` to every submodule with a ``bind_weight_grad_store(store)`` method.

    Subclasses of ``nn.Linear`` and modules marked by ``no_defer`` (with their contents) are
    left alone. A custom layer
    defers its weight-gradient work by binding the store and, in its backward, calling
    ``store.defer(fn, *args)`` (which stashes ``fn(*args)`` for the ``W`` action and returns
    True during an ``I``, and returns False otherwise: then it runs the work at once).
    Returns the number of layers now deferrable.
    """
    count = 0
    for m in _unmarked_modules(module):
        if type(m) is nn.Linear:
            m.__class__ = DeferrableLinear
        if type(m) is DeferrableLinear:
            m.__dict__["_wgrad_store"] = store
            m.__dict__["_wgrad_fused"] = m.weight.numel() >= FUSED_ACCUMULATION_MIN_NUMEL
            count += 1
        elif callable(bind := getattr(m, "bind_weight_grad_store", None)):
            bind(store)
            count += 1
    return count
