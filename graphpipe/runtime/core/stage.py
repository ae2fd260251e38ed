"""The stage runner: F / I / B / W / overlap handlers and the per-micro-batch state.

Owns this rank's stage modules, their weight-gradient stores, and, per local stage and
micro-batch, the stage input (an autograd leaf), the output (with its graph), the output
gradient and the input gradient waiting to be sent. The communication engine reads and
writes that state only through ``take_*`` / ``store_*``; the handlers never touch P2P.

May touch: the modules (forward, backward, ``.grad``), the ``WeightGradStore``s, the micro-
batch tables, the loss buffers. Must not: talk to other ranks, allocate plan buffers.

Local edges (the V-turn on rank N-1, or any two consecutive stages on one rank) pass their
tensors directly: the forward of stage s+1 reads the output of stage s, and the backward of
stage s reads the input gradient of stage s+1.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from graphpipe.meta import StepRecord
from graphpipe.weightgrad import DeferrableLinear, WeightGradStore, make_deferrable

from .tensors import Tensors, as_tuple, plain

__all__ = ["NO_KEYWORDS", "OVERLAP_HOOK", "Routes", "StageRunner"]

OVERLAP_HOOK = "overlapped_forward_backward"


try:
    _run_backward = torch.autograd.Variable._execution_engine.run_backward
except AttributeError:  # pragma: no cover - every torch this project supports has it
    _run_backward = None


def _backward(tensors: list, grads: list) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its Python-side argument checks:
    their shapes are the recorded ones, and the checks' host work would be paid again on every
    B and I (docs/benchmarks.md has its cost)."""
    if _run_backward is None:
        torch.autograd.backward(tensors, grads)
        return
    # (tensors, grads, retain_graph, create_graph, inputs, allow_unreachable, accumulate)
    _run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)


def _differentiable(t: torch.Tensor) -> bool:
    """Whether a tensor crossing an edge carries a gradient back: floating or complex ones do;
    integer and bool ones (masks, ids, counts) travel forward only."""
    return t.is_floating_point() or t.is_complex()


def _leaves(ts: Tensors) -> Tensors:
    """Stage inputs as fresh autograd leaves (no copy) so that backward yields their grads."""
    return tuple(t.detach().requires_grad_() if _differentiable(t) else t for t in ts)


class Routes(NamedTuple):
    """Where one call's keyword tensors go on this rank (``StageRunner.keyword_routes``).

    mask: bit ``i`` set when this rank takes the ``i``-th (sorted) name.
    stages: per local stage, the names its ``forward`` takes. loss: the names ``loss_fn``
    takes (loss rank only). used: every name this rank takes, sorted.
    """

    mask: int
    stages: tuple[tuple[str, ...], ...]
    loss: tuple[str, ...]
    used: tuple[str, ...]


NO_KEYWORDS = Routes(0, (), (), ())


def _forward_of(fn: Any) -> Callable[..., Any]:
    """The function whose parameters say which keywords a stage (or ``loss_fn``) takes: a
    module's ``forward`` (its ``__call__`` takes ``**kwargs``), a module compiled with
    ``torch.compile(module)`` forwarding every keyword to the module it wraps (``_orig_mod``,
    torch's attribute for it); any other callable itself."""
    if isinstance(fn, nn.Module):
        return getattr(fn, "_orig_mod", fn).forward
    return fn


def _taken(fn: Callable[..., Any], names: tuple[str, ...]) -> tuple[str, ...]:
    """The ``names`` that ``fn`` takes as keyword arguments (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: takes none
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return names
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(k for k in names if k in named)


class StageRunner:
    """Runs this rank's stages. ``li`` is a local stage index (position in ``stage_ids``).

    modules / stage_ids: this rank's stages, in ascending stage order.
    last_stage: the stage whose output goes to ``loss_fn``.
    num_microbatches: M; tables are indexed by micro-batch.
    split_flags: ``split_flags[li][mb]`` is True when that micro-batch's backward is an ``I``
        (its forward then takes the deferrable Linear path; the stage's ``WeightGradStore``
        gets the flag as its ``split``).
    defer: switch the stages' ``nn.Linear`` layers to ``DeferrableLinear`` (False: every
        weight gradient is computed during ``I``; ``W`` actions then have nothing to do).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        last_stage: int,
        num_microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        device: torch.device,
        split_flags: list[list[bool]],
        defer: bool = True,
    ) -> None:
        self.modules = tuple(modules)
        self.stage_ids = tuple(stage_ids)
        self.local = {s: li for li, s in enumerate(self.stage_ids)}
        self.last_stage = last_stage
        self.loss_fn = loss_fn
        self.device = device
        self.split_flags = split_flags
        # The local stage feeding stage li (None: the batch or another rank), and the one
        # that consumes stage li's input gradient.
        self.prev_local = [self.local.get(s - 1) for s in self.stage_ids]
        self.stores = tuple(WeightGradStore() for _ in self.modules)
        # A layer that cannot defer is named only where the schedule splits a backward of
        # its stage into I and W (elsewhere every weight gradient is computed in B anyway).
        self.num_deferrable = tuple(
            make_deferrable(m, st, where=f"stage {sid}", warn=any(flags)) if defer else 0
            for m, st, sid, flags in zip(
                self.modules, self.stores, self.stage_ids, split_flags, strict=True
            )
        )
        m, k = num_microbatches, len(self.modules)
        # The deferred GEMMs the W actions found, per stage (idle_weight_stages).
        self.w_work = [0] * k
        self.inputs: list[list[Any]] = [[None] * m for _ in range(k)]  # leaves
        self.outputs: list[list[Any]] = [[None] * m for _ in range(k)]  # with autograd graph
        self.grad_out: list[list[Any]] = [[None] * m for _ in range(k)]
        self.grad_in: list[list[Any]] = [[None] * m for _ in range(k)]  # to send
        self.mb_inputs: list[Tensors] = []
        self.mb_labels: list[Any] = []
        # Keyword tensors: per micro-batch {name: tensor(s)}, and which names go where.
        self.mb_kwargs: list[dict[str, Any]] = []
        self.routes = NO_KEYWORDS
        self._routes: dict[tuple[str, ...], Routes] = {(): NO_KEYWORDS}
        self.loss_parts: list[Any] = [None] * m  # each micro-batch's loss, this step
        self.backward_seed: torch.Tensor | None = None  # the loss part's (set_backward_seed)
        self.infer = False
        self.infer_outputs: list[Any] = [None] * m
        self.recorder: StepRecord | None = None
        # CUDA: an overlapped pair without a hook runs its F on this stream (see overlap).
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------ messages
    def take_activation(self, li: int, mb: int) -> Tensors:
        """The output of stage ``li`` to send (in inference it is dropped here)."""
        out = self.outputs[li][mb]
        if self.infer:
            self.outputs[li][mb] = None
        what = f"the output of stage {self.stage_ids[li]}"
        return tuple(plain(t.detach(), what).contiguous() for t in out)

    def take_grad(self, li: int, mb: int) -> Tensors:
        """The input gradient of stage ``li`` to send (dropped here)."""
        g = self.grad_in[li][mb]
        self.grad_in[li][mb] = None
        what = f"the input gradient of stage {self.stage_ids[li]}"
        return tuple(plain(t, what) for t in g)

    def store_activation(self, li: int, mb: int, bufs: Tensors) -> None:
        self.inputs[li][mb] = bufs

    def store_grad(self, li: int, mb: int, bufs: Tensors) -> None:
        self.grad_out[li][mb] = bufs

    # ------------------------------------------------------------ handlers
    def _forward_inputs(self, li: int, mb: int) -> Tensors:
        prev = self.prev_local[li]
        if self.stage_ids[li] == 0:
            x = self.mb_inputs[mb]
        elif prev is not None:  # a local edge (the V-turn): the output of stage s-1
            x = self.outputs[prev][mb]
            if self.infer:
                self.outputs[prev][mb] = None
                x = tuple(t.detach() for t in x)
            else:
                x = _leaves(x)
        else:
            x = self.inputs[li][mb]
            if x is None:
                raise RuntimeError(
                    f"stage {self.stage_ids[li]} has no input for micro-batch {mb}: "
                    "its receive was never posted (a schedule without its RECV_F?)"
                )
            if not self.infer:
                x = _leaves(x)
        self.inputs[li][mb] = x
        return x

    def _finish_forward(self, li: int, mb: int, y: Any) -> None:
        s = self.stage_ids[li]
        y = as_tuple(y, s)
        if self.recorder is not None:
            self.recorder.forward(s, mb, self.inputs[li][mb], y)
        if s == self.last_stage:
            if self.infer:
                self.inputs[li][mb] = None
                self.infer_outputs[mb] = y[0] if len(y) == 1 else y
                return
            out, lab = y[0] if len(y) == 1 else y, self.mb_labels[mb]
            names = self.routes.loss
            if names:
                kw = self.mb_kwargs[mb]
                loss = self.loss_fn(out, lab, **{k: kw[k] for k in names})
            else:
                loss = self.loss_fn(out, lab)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                got = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn must return a 0-dim tensor, got {got}")
            self.loss_parts[mb] = loss.detach()  # stacked into ``losses`` at the end
            y = (loss,)
        elif self.infer:
            self.inputs[li][mb] = None
        self.outputs[li][mb] = y

    def _kwargs(self, li: int, mb: int) -> dict[str, Any]:
        names = self.routes.stages[li] if self.routes.stages else ()
        if not names:
            return {}
        kw = self.mb_kwargs[mb]
        return {k: kw[k] for k in names}

    def _call(self, li: int, mb: int, x: Tensors) -> Any:
        if not self.routes.used:
            return self.modules[li](*x)
        return self.modules[li](*x, **self._kwargs(li, mb))

    def forward(self, li: int, mb: int) -> None:
        x = self._forward_inputs(li, mb)
        self.stores[li].split = self.split_flags[li][mb]
        self._finish_forward(li, mb, self._call(li, mb, x))

    def _backward_operands(self, li: int, mb: int) -> tuple[list, list]:
        outs = self.outputs[li][mb]
        if self.stage_ids[li] == self.last_stage:
            return list(outs), [self.backward_seed]
        grads = self.grad_out[li][mb]
        if grads is None:
            nxt = self.local.get(self.stage_ids[li] + 1)
            raise RuntimeError(
                f"stage {self.stage_ids[li]} has no output gradient for micro-batch {mb}"
                + (" (the local next stage has not run its backward)" if nxt is not None else "")
            )
        # One gradient came back per differentiable output (the next stage's float inputs),
        # none for integer or bool ones (masks, ids); a float output that needs no gradient
        # (computed without autograd) lets its gradient go.
        tensors, gs = [], []
        it = iter(grads)
        for t in outs:
            if _differentiable(t):
                g = next(it, None)
                if g is None:
                    break
                if t.requires_grad:
                    tensors.append(t)
                    gs.append(g)
        else:
            if next(it, None) is None:
                return tensors, gs
        kinds = [str(t.dtype).removeprefix("torch.") for t in outs]
        raise RuntimeError(
            f"stage {self.stage_ids[li]} got {len(grads)} output gradients for micro-batch "
            f"{mb}, but its outputs {kinds} have {sum(map(_differentiable, outs))} "
            "floating-point tensors"
        )

    def _finish_backward(self, li: int, mb: int) -> None:
        """Drop the micro-batch's state and route its input gradients (send or local)."""
        s = self.stage_ids[li]
        x = self.inputs[li][mb]
        self.inputs[li][mb] = self.outputs[li][mb] = self.grad_out[li][mb] = None
        if s == 0:
            return
        gin = tuple(
            (t.grad if t.grad is not None else torch.zeros_like(t)) for t in x if t.requires_grad
        )
        if self.recorder is not None:
            self.recorder.backward(s, mb, gin)
        prev = self.prev_local[li]
        if prev is not None:  # a local edge: the grads go to stage s-1 directly
            self.grad_out[prev][mb] = gin
        else:
            self.grad_in[li][mb] = gin

    def backward_full(self, li: int, mb: int) -> None:
        tensors, grads = self._backward_operands(li, mb)
        store = self.stores[li]
        store.split = self.split_flags[li][mb]  # an activation checkpoint recomputes F
        if tensors:
            store.accumulating = True  # large Linears accumulate their weight grads fused
            try:
                _backward(tensors, grads)
            finally:
                store.accumulating = False
        self._finish_backward(li, mb)

    def backward_input(self, li: int, mb: int) -> None:
        tensors, grads = self._backward_operands(li, mb)
        self.stores[li].split = self.split_flags[li][mb]  # an activation checkpoint recomputes F
        with self.stores[li].deferring((self.stage_ids[li], mb)):
            if tensors:
                _backward(tensors, grads)
        self._finish_backward(li, mb)

    def weight(self, li: int, mb: int) -> None:
        self.w_work[li] += self.stores[li].run((self.stage_ids[li], mb))

    def idle_weight_stages(self) -> list[int]:
        """The stages with deferrable layers holding trainable weights whose W actions (one
        per split backward: ``split_flags``) have run and found no deferred work at all: every
        weight gradient was computed in I."""
        idle = []
        for li, module in enumerate(self.modules):
            if not self.num_deferrable[li] or not any(self.split_flags[li]) or self.w_work[li]:
                continue
            linears = [m for m in module.modules() if isinstance(m, DeferrableLinear)]
            if linears and not any(m.weight.requires_grad for m in linears):
                continue  # frozen Linears: nothing to defer
            idle.append(self.stage_ids[li])
        return idle

    def overlap(self, fli: int, fmb: int, bli: int, bmb: int, full: bool) -> None:
        """An F&B pair (``full``: the backward is a B, else an I).

        With the stage's ``overlapped_forward_backward`` hook: the hook runs both (see
        ``Pipeline``). Without: on CUDA the F runs on a side stream while the B runs on the
        current one (forked and joined with events; captured as one region of the graph), so
        that their kernels overlap; elsewhere F then B (their communication overlaps the
        compute through the asynchronous P2P).
        """
        fmod, bmod = self.modules[fli], self.modules[bli]
        hook = getattr(type(fmod), OVERLAP_HOOK, None)
        if hook is not None and type(fmod) is type(bmod):
            x = self._forward_inputs(fli, fmb)
            # The B's stage first: with one stage on both sides the F's value must win.
            self.stores[bli].split = self.split_flags[bli][bmb]
            self.stores[fli].split = self.split_flags[fli][fmb]
            tensors, grads = self._backward_operands(bli, bmb)
            kw = self._kwargs(fli, fmb)  # the F's keyword tensors
            if full:
                self.stores[bli].accumulating = True
                try:
                    y = hook(fmod, x, bmod, tuple(tensors), tuple(grads), **kw)
                finally:
                    self.stores[bli].accumulating = False
            else:
                with self.stores[bli].deferring((self.stage_ids[bli], bmb)):
                    y = hook(fmod, x, bmod, tuple(tensors), tuple(grads), **kw)
            self._finish_forward(fli, fmb, y)
            self._finish_backward(bli, bmb)
            return
        backward = self.backward_full if full else self.backward_input
        side = self.side_stream
        if side is None:
            self.forward(fli, fmb)
            backward(bli, bmb)
            return
        main = torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.forward(fli, fmb)
        # The F's tensors are read on the main stream later (sends, the next stage): keep the
        # caching allocator from reusing them before the main stream is done with them.
        for t in self.outputs[fli][fmb] or ():
            t.record_stream(main)
        for t in self.inputs[fli][fmb] or ():
            t.record_stream(side)
        backward(bli, bmb)
        main.wait_stream(side)

    # --------------------------------------------------------------- steps
    @contextlib.contextmanager
    def recording(self) -> Iterator[StepRecord]:
        """Record the metadata of every stage input, output and gradient while inside."""
        self.recorder = record = StepRecord()
        try:
            yield record
        finally:
            self.recorder = None

    def begin(
        self,
        mb_inputs: list,
        mb_labels: list,
        mb_kwargs: list | None = None,
        routes: Routes | None = None,
        infer: bool = False,
    ) -> None:
        """The call's micro-batches: inputs (input rank), labels (loss rank), and the keyword
        tensors this rank uses (``routes.used``), each a list over micro-batches; ``infer``:
        the call is a forward-only run (outputs kept for ``take_infer_outputs``, sent
        activations dropped), else a training step."""
        self.mb_inputs, self.mb_labels = mb_inputs, mb_labels
        self.mb_kwargs = mb_kwargs or []
        self.routes = routes or NO_KEYWORDS
        self.infer = infer

    def set_backward_seed(self, seed: torch.Tensor | None) -> None:
        """The gradient the last stage's backward starts from (the loss part's ``1 / M``,
        scaled)."""
        self.backward_seed = seed

    def take_loss_parts(self) -> list[Any]:
        """This step's loss of each micro-batch (the loss rank's), handed over once."""
        parts, self.loss_parts = self.loss_parts, [None] * len(self.loss_parts)
        return parts

    def take_infer_outputs(self) -> list[Any]:
        """A forward-only run's outputs of each micro-batch (the loss rank's), handed over
        once."""
        outs, self.infer_outputs = self.infer_outputs, [None] * len(self.infer_outputs)
        return outs

    def keyword_routes(self, names: tuple[str, ...]) -> Routes:
        """Where the keyword tensors ``names`` (sorted) go on this rank: to each stage whose
        ``forward`` takes that keyword (or ``**kwargs``), and to ``loss_fn`` on the loss
        rank; computed once per set of names."""
        routes = self._routes.get(names)
        if routes is None:
            stages = tuple(_taken(_forward_of(m), names) for m in self.modules)
            loss = _taken(_forward_of(self.loss_fn), names) if self.last_stage in self.local else ()
            used = {*loss, *(k for ks in stages for k in ks)}
            mask = sum(1 << i for i, k in enumerate(names) if k in used)
            routes = Routes(mask, stages, loss, tuple(k for k in names if k in used))
            self._routes[names] = routes
        return routes

    def drop_state(self) -> None:
        """After a failed step: forget its micro-batches and deferred work."""
        for table in (self.inputs, self.outputs, self.grad_out, self.grad_in):
            for row in table:
                row[:] = [None] * len(row)
        for store in self.stores:
            store.clear()
        self.infer_outputs = [None] * len(self.infer_outputs)
        self.loss_parts = [None] * len(self.loss_parts)

    def pending_weight_work(self) -> list[tuple[int, Any]]:
        """``(stage, key)`` of deferred work left over (the schedule lacks W actions)."""
        return [(self.stage_ids[li], k) for li, st in enumerate(self.stores) for k in st.pending()]
