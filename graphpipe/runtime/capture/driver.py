"""The capture driver: warmup record -> static plan -> graphs -> replay, on CUDA and CPU alike.

Three visible phases per batch signature (shapes and dtypes of the batch):

1. warmup: an eager step that records the metadata of every tensor it touches
   (``meta.StepRecord``) and of every message (the engine's channel metadata);
2. plan: ``buffers.build_plan`` allocates every buffer the step's P2P and batch need once, with
   lifetimes from the compiled program (a receive lives from the step that posts it to the
   last action that reads it; a gloo send packet until the end of the step, since the send
   completes in the background); the transfers and the runner's micro-batch views are bound
   to it;
3. capture and replay: the static step (same program, plan buffers only) is captured into
   the device's graphs (``graphs.py``: CUDA graphs, or the CPU graph with the same
   semantics), once, and every later step of the signature replays them. With NCCL over
   several ranks the capture comes one step later: the first step's handshake travels over
   the gloo control group, so one eager static step carries every rank pair's real
   transfers first (no communicator sees its first real-size group inside a capture).

What a graph bakes in is checked before every replay (``_check_baked``): the parameters'
storage and static ``.grad`` tensors, and with ``capture_optimizer`` the optimizer's Python
hyper-parameters (a learning-rate schedule that changes a float ``lr`` is refused by name).

Owns: the captures (plans, bindings, graphs) and the capture stream. May touch, through their
calls: the engine's transfers (``bind``: the plan's buffers and the prepared sends), the
runner's micro-batch inputs and labels (and its recorder, during the warmup), the engine's
channel metadata (``use_metas``, per capture) and send mode (``begin(..., sends=)``), the step
loop's signature and ranges (``set_signature``, ``set_ranges``). It gets these parts from the
facade; it never sees the ``Pipeline``. The graphs are released by ``close()``, or by a
finalizer when the pipeline is dropped without it (NCCL >= 2.26 waits in
``destroy_process_group`` for graphs that still reference a communicator).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from graphpipe.meta import StepRecord, TensorMeta

from ..core.batch import BatchSignature
from ..core.comm import SendTransfer
from ..core.context import RankContext
from ..core.program import Program
from ..core.step import StepLoop
from ..core.structured import (
    ConstantChanged,
    PerMicrobatch,
    check_capturable,
    check_captured,
    structures,
)
from ..core.tensors import as_tuple
from .buffers import BufferPlan, build_plan
from .cpu_graph import CaptureError

if TYPE_CHECKING:
    from ..core.comm import CommEngine
    from ..core.loss import LossReducer
    from ..core.stage import StageRunner

__all__ = ["Capture", "CaptureDriver"]

_RECV_KIND = {True: "recv_activation", False: "recv_grad"}


class Capture:
    """One captured signature: its plan, recorded metadata, buffer bindings and graphs;
    ``batch``: the runner's micro-batches (views of the plan's static batch buffers).

    grad_params: the parameters the warmup step gave a gradient (the capture gives each a
    static ``.grad`` if it has none, so the graph accumulates into it; the others stay as
    eager leaves them). static: what the graph bakes in about the parameters, checked before
    each replay: ``(parameter, its data pointer, its .grad)``; a ``.grad`` set to None since
    (``zero_grad()``) gets its static tensor back, zeroed, which is what accumulating into
    None gives. hyper: the optimizer's Python
    hyper-parameters at capture, ``(group index, key, value)``. sent: the prepared tensors of
    each send transfer (``capture="action"``).
    """

    __slots__ = (
        "batch",
        "bindings",
        "grad_params",
        "graphs",
        "hyper",
        "keywords",
        "metas",
        "plan",
        "record",
        "sent",
        "sig",
        "static",
        "unwrap",
        "warm_steps",
    )

    def __init__(self, sig, plan, record, metas, bindings, batch) -> None:
        self.sig, self.plan, self.record, self.metas = sig, plan, record, metas
        self.bindings, self.batch = bindings, batch
        self.graphs: Any = None
        self.warm_steps = 0  # eager static steps still to run before the capture
        self.keywords: Mapping[str, Any] = {}  # the PerMicrobatch structures captured
        self.grad_params: list[torch.Tensor] = []
        self.static: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        self.hyper: list[tuple[int, str, Any]] = []
        self.sent: dict[SendTransfer, tuple[torch.Tensor, ...] | None] = {}
        self.unwrap = False  # each micro-batch's labels as one tensor (labels were a tensor)


def _static_keyword(value: Any, bufs: tuple[torch.Tensor, ...]) -> Any:
    """A keyword over its static buffers: one tensor, a tuple, or a PerMicrobatch's
    structure over its stacked tensors' buffers."""
    if isinstance(value, PerMicrobatch):
        return value.over(bufs)
    return bufs[0] if isinstance(value, torch.Tensor) else bufs


def _release(captures: dict, device_type: str) -> None:
    """Destroy the graphs of ``captures`` (after the device is idle)."""
    if device_type == "cuda" and any(c.graphs is not None for c in captures.values()):
        torch.cuda.synchronize()
    for cap in captures.values():
        if cap.graphs is not None:
            cap.graphs.reset()
            cap.graphs = None
    captures.clear()


def _hyperparameters(opt: torch.optim.Optimizer | None) -> list[tuple[int, str, Any]]:
    """The optimizer's Python hyper-parameters (numbers, bools, tuples of them) per group: what
    a captured ``step()`` bakes in (a tensor one is read at replay and is left out)."""
    if opt is None:
        return []
    out = []
    for i, group in enumerate(opt.param_groups):
        for key, value in group.items():
            if key == "params" or isinstance(value, torch.Tensor):
                continue
            if isinstance(value, (int, float, bool, tuple)) or value is None:
                out.append((i, key, value))
    return out


class _NamedRanges:
    """The step's ranges during a capture, keeping the names open: the label the CPU graph
    names in its errors (the action, or the transfer being waited for)."""

    def __init__(self, ranges: Any) -> None:
        self.ranges, self.names = ranges, []

    def push(self, name: str) -> None:
        self.ranges.push(name)
        self.names.append(name)

    def pop(self) -> None:
        self.ranges.pop()
        self.names.pop()

    @property
    def depth(self) -> int:
        return self.ranges.depth

    def unwind(self, depth: int) -> None:
        while self.names and self.ranges.depth > depth:
            self.pop()
        self.ranges.unwind(depth)

    def label(self) -> str:
        inner = [n for n in self.names if n != "step"]
        if not inner:
            return "the step" if self.names else ""
        return inner[-1] if inner[-1].startswith("wait") else f"action {inner[-1]}"


class CaptureDriver:
    """Captures and replays the training step, one ``Capture`` per batch signature.

    ctx: the rank. loop: the step loop (the warmup is its eager step, the replay its static
    step). program: the training program. runner / engine / loss: the parts whose buffers a
    capture binds. mode: ``"step"`` or ``"action"`` (CUDA graphs per step or per action).
    recapture: a new signature captures anew instead of raising.
    """

    def __init__(
        self,
        ctx: RankContext,
        loop: StepLoop,
        program: Program,
        runner: StageRunner,
        engine: CommEngine,
        loss: LossReducer,
        mode: str,
        recapture: bool,
    ) -> None:
        self.ctx, self.loop, self.program = ctx, loop, program
        self.runner, self.engine, self.loss = runner, engine, loss
        self.mode, self.recapture = mode, recapture
        self.captures: dict[BatchSignature, Capture] = {}
        self.active: Capture | None = None
        self.stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        self._finalizer = weakref.finalize(self, _release, self.captures, ctx.device.type)

    # ------------------------------------------------------------ the step
    def step(
        self, sig: BatchSignature, inputs: Any, labels: Any, kwargs: Mapping[str, Any]
    ) -> torch.Tensor:
        ctx = self.ctx
        cap = self.captures.get(sig)
        if cap is None:
            if self.captures and not self.recapture:
                raise ValueError(next(iter(self.captures)).mismatch(sig))
            check_capturable(kwargs)  # PerMicrobatch values: what has no static buffer
            return self._warmup(sig, inputs, labels, kwargs)
        try:
            check_captured(cap.keywords, kwargs)
        except ConstantChanged:
            if not self.recapture:
                raise
            self._discard(sig)  # recapture=True: the new constants get a capture of their own
            return self._warmup(sig, inputs, labels, kwargs)
        self.activate(cap)
        if ctx.is_input_rank:
            for dst, src in zip(cap.plan.inputs, as_tuple(inputs), strict=True):
                dst.copy_(src, non_blocking=True)
        if ctx.is_loss_rank:
            for dst, src in zip(cap.plan.labels, as_tuple(labels), strict=True):
                dst.copy_(src, non_blocking=True)
        for name, bufs in cap.plan.kwargs.items():
            for dst, src in zip(bufs, as_tuple(kwargs[name]), strict=True):
                dst.copy_(src, non_blocking=True)
        if cap.graphs is None:
            if cap.warm_steps:
                # NCCL over several ranks: the warmup step's handshake went over the control
                # group and engine.warm() sent one element per rank pair, so no communicator
                # has carried a real-size group yet. One full static step with the real
                # transfers, eager, on the capture stream (torch's whole-network recipe),
                # before any of them sees its first group inside a capture.
                cap.warm_steps -= 1
                with self._on_capture_stream():
                    self.loop.static(self.program)
                return self.loss.out
            if cap.keywords:  # the constants of this call's values, not the warmup's objects
                self._bind_keywords(cap, kwargs)
            self._capture_graphs(cap)  # runs the step once
            return self.loss.out
        self._check_baked(cap)
        self._replay(cap)
        return self.loss.out

    def _warmup(
        self, sig: BatchSignature, inputs: Any, labels: Any, kwargs: Mapping[str, Any]
    ) -> torch.Tensor:
        """An eager step on fresh buffers that records the metadata of what it touches; on
        CUDA on the capture stream (torch's whole-network capture recipe)."""
        loop = self.loop
        with self.runner.recording() as record:
            loop.zero_grads()
            with self._on_capture_stream():
                loss = loop.train(self.program, sig, inputs, labels, kwargs, None).clone()
                if loop.optimizer is not None:
                    loop.optimizer.step()
        cap = self.captures[sig] = self._make(sig, record, inputs, labels, kwargs)
        cap.keywords = structures(kwargs)  # check_captured compares later steps' with them
        cap.grad_params = [p for p in self.ctx.parameters() if p.grad is not None]
        # Staged P2P (NCCL, several ranks): the capture waits for one eager static step with
        # the real transfers (see ``step``).
        cap.warm_steps = 1 if self.engine.staged else 0
        return loss

    def _on_capture_stream(self) -> Any:
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.ctx.device))
        return _JoinedStream(self.stream, self.ctx.device)

    # ---------------------------------------------------------------- plan
    def _make(
        self,
        sig: BatchSignature,
        record: StepRecord,
        inputs: Any,
        labels: Any,
        kwargs: Mapping[str, Any],
    ) -> Capture:
        ctx, program, engine = self.ctx, self.program, self.engine
        keys_at: list[list[tuple[str, int, int]]] = [[] for _ in program.steps]
        metas: dict[tuple[str, int, int], tuple[TensorMeta, ...]] = {}
        readers: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        until_end: list[tuple[str, int, int]] = []
        owners: list[tuple[Any, list[tuple[str, int, int]], bool]] = []  # transfer, keys, flat
        for t in [*program.sends, *program.recvs]:
            first = t.msgs[0].action
            packed = t.packable()
            if isinstance(t, SendTransfer) and not packed:
                continue  # it sends the stage's own tensors
            k = program.posted_at[id(t)]
            if packed:
                send = isinstance(t, SendTransfer)
                key = ("send_packet" if send else "recv_packet", first.stage, first.microbatch)
                ms = [m for msg in t.metas() for m in msg]
                numel = sum(math.prod(m.shape) for m in ms)
                metas[key] = (TensorMeta((numel,), ms[0].dtype, ctx.device),)
                if send:
                    until_end.append(key)
                    readers[key] = []
                else:
                    readers[key] = [(m.action.stage, m.mb) for m in t.msgs]
                keys = [key]
            else:
                keys = []
                for m in t.msgs:
                    key = (_RECV_KIND[m.forward], m.action.stage, m.mb)
                    metas[key] = engine.metas[m.channel]
                    keys.append(key)
            keys_at[k] += keys
            owners.append((t, keys, packed))
        plan_program = [(keys_at[k], s.compute) for k, s in enumerate(program.steps)]
        dev = ctx.device
        ins = tuple(TensorMeta.of(t).on(dev) for t in as_tuple(inputs)) if ctx.is_input_rank else ()
        labs = tuple(TensorMeta.of(t).on(dev) for t in as_tuple(labels)) if ctx.is_loss_rank else ()
        kws = {
            name: tuple(TensorMeta.of(t).on(dev) for t in as_tuple(kwargs[name]))
            for name in self.runner.routes.used
        }
        plan = build_plan(plan_program, metas, ins, labs, readers, until_end, kws)
        bindings = [
            (t, plan.buffers[keys[0]][0] if flat else tuple(plan.buffers[k] for k in keys))
            for t, keys, flat in owners
        ]
        static_kw = {
            name: _static_keyword(kwargs[name], bufs) for name, bufs in plan.kwargs.items()
        }
        unwrap = isinstance(labels, torch.Tensor)
        self.loop.batch(sig, plan.inputs, plan.labels, static_kw, unwrap=unwrap)
        runner = self.runner
        batch = (runner.mb_inputs, runner.mb_labels, runner.mb_kwargs, runner.routes)
        cap = Capture(sig, plan, record, dict(engine.metas), bindings, batch)
        cap.unwrap = unwrap
        return cap

    def _bind_keywords(self, cap: Capture, kwargs: Mapping[str, Any]) -> None:
        """The runner's micro-batch keywords rebuilt over the plan's buffers from this
        call's values: a capture bakes in the constants of the values it is given (an object
        of the warmup's changed in place since would otherwise be baked)."""
        plan = cap.plan
        static_kw = {
            name: _static_keyword(kwargs[name], bufs) for name, bufs in plan.kwargs.items()
        }
        self.loop.batch(cap.sig, plan.inputs, plan.labels, static_kw, unwrap=cap.unwrap)
        runner = self.runner
        cap.batch = (runner.mb_inputs, runner.mb_labels, runner.mb_kwargs, runner.routes)

    def activate(self, cap: Capture | None) -> None:
        """Point the program at ``cap``'s plan buffers (None: eager allocation)."""
        if cap is self.active:
            return
        if self.active is not None:
            for t in [*self.program.sends, *self.program.recvs]:
                t.bind(None)
        if cap is not None:
            bound = dict(cap.bindings)
            for t in self.program.recvs:
                if t in bound:
                    t.bind(bound[t])
            for t in self.program.sends:
                t.bind(bound.get(t), cap.sent.get(t))
            self.engine.use_metas(dict(cap.metas))
            self.loop.set_signature(cap.sig)
            self.runner.begin(*cap.batch)
        self.active = cap

    # -------------------------------------------------------------- graphs
    def entries(self) -> list[tuple[str, Any, Any]]:
        """``(name, eager part, part to capture)`` per graph (``graphs.py``): the whole static
        step, or (mode ``action``) one graph per compute action, its P2P run eagerly before
        it and the tensors its sends take made ready in a graph of their own before that."""
        loop = self.loop
        if self.mode == "step":
            return [("step", None, functools.partial(loop.static, self.program))]
        engine = self.engine
        entries: list[tuple[str, Any, Any]] = []
        if loop.optimizer is not None:
            entries.append(("zero_grad", None, loop.zero_grads))
        for posts, waits, fn, args, name in self.program.instrs:
            sends = [
                c.__self__ for c in posts if isinstance(getattr(c, "__self__", None), SendTransfer)
            ]
            if sends:
                prepare = functools.partial(
                    _call_all, [functools.partial(engine.prepare_send, t) for t in sends]
                )
                entries.append((f"prepare {name or 'sends'}", None, prepare))
            eager = functools.partial(_call_all, posts + waits) if posts or waits else None
            entries.append((name or "p2p", eager, functools.partial(fn, *args) if fn else None))
        entries.append(("wait sends", engine.finish, None))
        entries.append(("loss", None, self.loss.reduce))
        if loop.optimizer is not None:
            entries.append(("optimizer", None, loop.optimizer.step))
        return entries

    def _capture_graphs(self, cap: Capture) -> None:
        """Capture ``cap``'s static step into the device's graphs, running it once."""
        from .graphs import CapturedGraphs, new_graphs

        ctx, loop, engine = self.ctx, self.loop, self.engine
        for p in cap.grad_params:  # the graph accumulates into static .grad tensors
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.loss.prepare_seed(None)
        cuda = ctx.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        self._barrier()  # every rank enters capture together
        ranges = loop.ranges
        named = _NamedRanges(ranges)
        loop.set_ranges(named)
        engine.set_ranges(named)
        engine.begin(False, sends="prepared" if self.mode == "action" else None)
        try:
            with _autocast_without_cache(ctx.device.type):
                make = new_graphs(ctx.device, self.stream, named.label)
                cap.graphs = CapturedGraphs.capture(self.entries(), make, named)
        except CaptureError as e:  # every rank's error names where the step needs the host
            loop.faults.doing(next((x for s in e.syncs for x in s.labels if x), "capture"))
            raise
        finally:
            engine.begin(False)
            loop.set_ranges(ranges)
            engine.set_ranges(ranges)
        cap.sent = {t: t.recorded for t in self.program.sends} if self.mode == "action" else {}
        cap.static = [(p, p.data_ptr(), p.grad) for p in ctx.parameters()]
        cap.hyper = _hyperparameters(loop.optimizer)
        if cuda:
            torch.cuda.synchronize()
        self._barrier()

    def _barrier(self) -> None:
        if self.ctx.num_ranks > 1:
            dist.barrier(group=self.ctx.group)

    def _replay(self, cap: Capture) -> None:
        engine = self.engine
        engine.begin(False, sends="prepared" if self.mode == "action" else None)
        try:
            cap.graphs.replay(self.loop.ranges)
        except BaseException as e:  # named in every rank's error: what the replay was doing
            self.loop.faults.doing(getattr(e, "graphpipe_where", "the captured step"))
            raise
        finally:
            engine.begin(False)

    def _check_baked(self, cap: Capture) -> None:
        """What the graphs bake in, unchanged since the capture (else ``RuntimeError`` naming
        it, before anything of the step runs)."""
        for p, ptr, g in cap.static:
            grad = p.grad
            if grad is None and g is not None:  # zero_grad(set_to_none=True): zero it instead
                g.zero_()
                p.grad = g
            elif grad is not g:
                raise RuntimeError(
                    f"a {tuple(p.shape)} parameter's .grad was replaced by another tensor after "
                    "capture: the captured step accumulates into the .grad tensor it was "
                    "captured with; zero gradients with optimizer.zero_grad() and copy values "
                    "into .grad in place instead of assigning it"
                )
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"a {tuple(p.shape)} parameter's storage changed after capture (.data "
                    "assigned, or the module moved): the captured step reads and writes the "
                    "old one; copy new values in place (p.data.copy_(...)) instead"
                )
        if cap.hyper:
            groups = self.loop.optimizer.param_groups
            for i, key, value in cap.hyper:
                now = groups[i].get(key) if i < len(groups) else None
                if type(now) is not type(value) or now != value:
                    raise RuntimeError(
                        f"capture_optimizer: param_groups[{i}][{key!r}] changed from {value!r} "
                        f"to {now!r} after capture, but the captured optimizer step baked "
                        f"{value!r} in (a Python number is a constant of the graph, as in a "
                        "CUDA graph): a learning-rate schedule needs a tensor lr that the "
                        "step reads (CUDA: torch.optim.Adam(..., lr=torch.tensor(lr), "
                        "capturable=True)), or step the optimizer outside the pipeline "
                        "(capture_optimizer=None)"
                    )

    def close(self) -> None:
        """Synchronize, destroy every graph and plan (before the process group goes)."""
        self.activate(None)
        _release(self.captures, self.ctx.device.type)

    def _discard(self, sig: BatchSignature) -> None:
        """Forget the capture of ``sig`` (its graphs destroyed)."""
        cap = self.captures.pop(sig)
        if cap is self.active:
            self.activate(None)
        if cap.graphs is not None:
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize()
            cap.graphs.reset()
            cap.graphs = None

    def drop_graphs(self) -> None:
        """After a failed call: destroy the graphs (they hold the process groups and works
        the failure lets go of) but keep the plans; the next step of a signature captures
        again, over the groups of that call."""
        self.activate(None)
        graphs = [c for c in self.captures.values() if c.graphs is not None]
        if graphs and self.ctx.device.type == "cuda":
            torch.cuda.synchronize()
        for cap in graphs:
            cap.graphs.reset()
            cap.graphs = None

    # --------------------------------------------------------------- views
    def memory_report(self) -> str:
        plan, record = self.plan, self.record
        if plan is None or record is None:
            raise RuntimeError("no plan yet: the memory report needs capture and one step")
        stored = record.nbytes()
        return (
            plan.report()
            + f"\nstored stage activations (recorded): {stored['activations']:,} bytes"
            + f"\nstage input gradients (recorded): {stored['grads']:,} bytes"
        )

    @property
    def plan(self) -> BufferPlan | None:
        cap = self.active or next(iter(self.captures.values()), None)
        return cap.plan if cap is not None else None

    @property
    def record(self) -> StepRecord | None:
        cap = self.active or next(iter(self.captures.values()), None)
        return cap.record if cap is not None else None


def _call_all(fns: Sequence[Any]) -> None:
    for fn in fns:
        fn()


def _autocast_without_cache(device_type: str) -> Any:
    """Re-enter the ambient autocast with its weight cache off: a cached cast made during
    capture would point at memory the graph does not own on replay."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


class _JoinedStream:
    """``with torch.cuda.stream(s)``, and the current stream waits for ``s`` on exit."""

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.stream, self.device = stream, device
        self.ctx = torch.cuda.stream(stream)

    def __enter__(self) -> None:
        self.prev = torch.cuda.current_stream(self.device)
        self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.ctx.__exit__(*exc)
        self.prev.wait_stream(self.stream)
