"""A CPU graph with CUDA-graph semantics: record a step's operations once, replay them.

``CpuGraph.capture(fn)`` runs ``fn`` once under a ``TorchDispatchMode`` that records every
operation that reaches torch's dispatcher below autograd: the step's aten operations, those
the autograd engine runs for its backward, and the c10d operations (P2P and collectives,
graphpipe's and torch's own: DDP-style all-reduces, FSDP2, functional collectives).
``replay()`` re-executes the recorded operations on the same tensors, in order, without the
step's Python, its module hooks or autograd. What it models of ``torch.cuda.CUDAGraph``:

* **Memory belongs to the graph.** Every tensor an operation made during capture is kept by
  the graph; a replay writes new values into the same storage (``out=`` variants, else the
  functional result copied in), so tensors the step returned or left behind (``.grad``, a
  loss buffer) hold the replayed step's values, and a replay allocates nothing new beyond
  what operations without an ``out=`` form need transiently. As a CUDA graph's pool does,
  the tensors the step let go of share memory where their lives do not overlap
  (``_Recorder._pool``).
* **Views are free.** An operation whose outputs alias its inputs (``view``, ``t``,
  ``slice``, ``detach``, ...) is not replayed: its output already aliases the right storage.
* **Python scalars are baked in**, as kernel arguments are on CUDA.
* **No host syncs.** A value read on the host during capture (``.item()``, ``float(t)``,
  ``bool(t)``, ``.tolist()``, ``.numpy()``) or an operation whose output shape depends on
  the data (``nonzero``, ``masked_select``, ``unique``, ...) is an error naming the operation,
  the label (the schedule action) and the line of user code; every such place of the step
  is listed at the end of the capture (``CaptureError``), not only the first.
* **Random operations draw fresh numbers on each replay** from their generator (the default
  one unless given), in the order the step drew them: a replay draws what an eager step
  would.
* **Communication completes where the step needs it.** A c10d operation is issued at its
  place in the order; its work is waited for right before the first later operation that
  touches its tensors (byte ranges of the same storage), and every work left at the end of
  the replay. A functional collective's result is copied into the captured tensor where the
  step waited for it (``wait_tensor``).
* **A failure during capture leaves nothing half-made**: the graph stays empty, the
  recorder and its patches are gone, and the error propagates.

Tensor subclasses (``DTensor``) are recorded at their own level: the replay runs their
dispatch (and the collectives inside it) again. Code compiled with ``torch.compile`` runs as
its Python while capturing (what it records is the uncompiled operations), and a
higher-order operator (``flex_attention``) through its dense implementation.
``UntypedStorage.resize_`` (FSDP2's way of freeing and re-allocating unsharded parameters)
is recorded and replayed in order.

NVIDIA Warp's CPU graphs are the prior art of recording an API stream and replaying it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import linecache
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CaptureError", "CpuGraph", "HostSync"]

_aten = torch.ops.aten

# Operations that read a value on the host, or whose output shape depends on the data (the
# host must learn it before it can allocate): a CUDA graph cannot hold them.
_HOST_SYNC: dict[Any, str] = {
    _aten._local_scalar_dense.default: "a value read on the host (.item(), float(t), "
    "int(t), bool(t), `if t:`, print(t))",
    _aten.equal.default: "torch.equal (a bool on the host)",
    _aten.is_nonzero.default: "bool(t) (a value read on the host)",
    _aten.nonzero.default: "nonzero (an output shape that depends on the data)",
    _aten.masked_select.default: "masked_select (an output shape that depends on the data)",
    _aten.repeat_interleave.Tensor: "repeat_interleave without output_size (an output shape "
    "that depends on the data)",
}
for _name in ("_unique", "_unique2", "unique_dim", "unique_consecutive"):
    for _ov in getattr(_aten, _name).overloads():
        _HOST_SYNC[getattr(getattr(_aten, _name), _ov)] = (
            f"{_name} (an output shape that depends on the data)"
        )

# Allocations whose contents are undefined: a replay need not run them (their storage is the
# graph's already).
_UNDEFINED = {
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
}

# Tensor methods that read a tensor's values on the host without torch's dispatcher.
_HOST_READS = ("tolist", "numpy", "__array__")

_TORCH = os.path.dirname(torch.__file__)
_STDLIB = os.path.dirname(contextlib.__file__)
_RUNTIME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # graphpipe/runtime
# Frames that only carry a call to the dispatcher: never the place to name.
_PLUMBING = tuple(
    os.path.join(_TORCH, *f)
    for f in (
        ("_tensor.py",),
        ("_ops.py",),
        ("overrides.py",),
        ("_tensor_str.py",),
        ("utils", "_python_dispatch.py"),
        ("utils", "_contextlib.py"),
    )
)


class HostSync:
    """One place of a captured step that needs the host: the operation, why, the line of
    code, and the labels (schedule actions) it was reached in."""

    __slots__ = ("labels", "op", "what", "where")

    def __init__(self, op: str, what: str, where: str) -> None:
        self.op, self.what, self.where = op, what, where
        self.labels: list[str] = []

    def __str__(self) -> str:
        labels = [x for x in self.labels if x]
        at = ""
        if labels:
            more = (
                f" (and {len(labels) - 1} more: {', '.join(labels[1:4])}" if len(labels) > 1 else ""
            )
            if more:
                more += ", ...)" if len(labels) > 4 else ")"
            at = f" in {labels[0]}{more}"
        return f"{self.op}: {self.what}{at}, at {self.where}"


class CaptureError(RuntimeError):
    """The captured step holds operations a graph cannot replay (``syncs``: each place)."""

    def __init__(self, syncs: Sequence[HostSync]) -> None:
        self.syncs = list(syncs)
        lines = "\n".join(f"  - {s}" for s in self.syncs)
        super().__init__(
            f"the step cannot be captured: {len(self.syncs)} place(s) need the host inside "
            f"it\n{lines}\nA graph replays without running the step's Python, so a value "
            "read on the host would be baked in and a data-dependent shape cannot be "
            "allocated: keep such logic on tensors (torch.where, masks, fixed sizes), move "
            "it out of the step, or run this pipeline eagerly (capture=False)."
        )


def _describe(frame: traceback.FrameSummary) -> str:
    line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f"{frame.filename}:{frame.lineno} in {frame.name}: `{line}`"


def _user_frame() -> str:
    """Where a host sync happened: the innermost frame that is not the dispatcher's plumbing
    or graphpipe's runtime, and, when that is inside torch or the standard library, the
    innermost frame of the caller's own code too."""
    stack = [f for f in traceback.extract_stack() if not f.filename.startswith(_RUNTIME)]
    inner = next((f for f in reversed(stack) if not f.filename.startswith(_PLUMBING)), None)
    if inner is None:
        return "(no frame outside torch)"
    if not inner.filename.startswith((_TORCH, _STDLIB)):
        return _describe(inner)
    user = next((f for f in reversed(stack) if not f.filename.startswith((_TORCH, _STDLIB))), None)
    return _describe(inner) + (f", called from {_describe(user)}" if user is not None else "")


# --------------------------------------------------------------------------------------------
# Where a tensor's bytes are


def _base(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s data: ``t`` itself, an ``AsyncCollectiveTensor``'s
    ``elem``, a ``DTensor``'s local tensor; None where it cannot be told."""
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return t
    for attr in ("elem", "_local_tensor"):
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor):
            return _base(inner)
    return None


def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(storage id, first byte, end byte)`` of the bytes ``t`` can touch."""
    b = _base(t)
    if b is None:
        return None
    try:
        sid = b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None
    size = b.element_size()
    start = b.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(b.shape, b.stride(), strict=True))
    if b.numel() == 0:
        extent = 0
    return sid, start, start + extent * size


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _overlaps(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


# --------------------------------------------------------------------------------------------
# out= variants


# Operations whose ``out=`` form runs the same kernel as the functional one (torch's
# structured kernels) and writes ``out`` without resizing it when its shape is the result's:
# a replay writes their results in place. Every other operation runs functionally and its
# result is copied into the graph's tensor (an ``out=`` form may differ: ``mse_loss.out``
# resizes ``out`` to the unreduced shape first). tests/test_cpu_graph.py checks each entry
# bitwise against the functional form, storage kept.
_OUT_SAFE = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::add.Tensor",
        "aten::sub.Tensor",
        "aten::mul.Tensor",
        "aten::div.Tensor",
        "aten::neg",
        "aten::exp",
        "aten::log",
        "aten::rsqrt",
        "aten::sqrt",
        "aten::tanh",
        "aten::tanh_backward",
        "aten::sigmoid",
        "aten::sigmoid_backward",
        "aten::silu",
        "aten::silu_backward",
        "aten::gelu",
        "aten::gelu_backward",
        "aten::threshold_backward",
        "aten::pow.Tensor_Scalar",
        "aten::sum.dim_IntList",
        "aten::mean.dim",
        "aten::cat",
        "aten::where.self",
        "aten::addcmul",
        "aten::addcdiv",
        "aten::maximum",
        "aten::minimum",
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::_log_softmax",
        "aten::_log_softmax_backward_data",
        "aten::nll_loss_forward",
        "aten::nll_loss_backward",
    }
)

# The same operations through torch's Python API, whose argument parsing costs less than an
# ``OpOverload``'s boxed call (the replay's cost per operation): each takes the recorded
# arguments as they are (positional, then the schema's keyword-only ones by name) and
# resolves to the same overload. tests/test_cpu_graph.py checks each against the operation.
_FAST: dict[str, Callable[..., Any]] = {
    "aten.mm.out": torch.mm,
    "aten.addmm.out": torch.addmm,
    "aten.bmm.out": torch.bmm,
    "aten.add.out": torch.add,
    "aten.sub.out": torch.sub,
    "aten.mul.out": torch.mul,
    "aten.div.out": torch.div,
    "aten.neg.out": torch.neg,
    "aten.exp.out": torch.exp,
    "aten.rsqrt.out": torch.rsqrt,
    "aten.tanh.out": torch.tanh,
    "aten.sum.IntList_out": torch.sum,
    "aten.mean.out": torch.mean,
    "aten.cat.out": torch.cat,
    "aten.add_.Tensor": torch.Tensor.add_,
    "aten.mul_.Tensor": torch.Tensor.mul_,
    "aten.addmm_.default": torch.Tensor.addmm_,
    "aten.copy_.default": torch.Tensor.copy_,
    "aten.zero_.default": torch.Tensor.zero_,
    "aten.fill_.Scalar": torch.Tensor.fill_,
}

_OUT_CACHE: dict[Any, tuple[Any, tuple[str, ...]] | None] = {}


def _op_name(func: Any) -> str:
    name = func._schema.name
    return (
        name
        if not func._overloadname or func._overloadname == "default"
        else (f"{name}.{func._overloadname}")
    )


def _out_variant(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    """``(overload, out argument names)`` of the ``out=`` form of ``func`` when it is one
    of ``_OUT_SAFE``, else None."""
    if func in _OUT_CACHE:
        return _OUT_CACHE[func]
    found = None
    if _op_name(func) in _OUT_SAFE:
        schema = func._schema
        want = [(a.name, str(a.type)) for a in schema.arguments]
        n_out = len(schema.returns)
        packet = func.overloadpacket
        for name in packet.overloads():
            ov = getattr(packet, name)
            args = ov._schema.arguments
            outs = [a.name for a in args if a.is_out]
            if len(outs) != n_out or not outs:
                continue
            if [(a.name, str(a.type)) for a in args if not a.is_out] == want:
                found = (ov, tuple(outs))
                break
    _OUT_CACHE[func] = found
    return found


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes (its schema's ``(a!)`` ones)."""
    out: list[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        out += _tensors(value)
    return out


def _is_inplace(func: Any) -> bool:
    """The operation writes one of its arguments (``add_``, ``copy_``, an ``out=`` call)."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


# --------------------------------------------------------------------------------------------
# Replay nodes


def _transport_error(e: RuntimeError) -> RuntimeError:
    """A c10d transport error as ``torch.distributed.DistError``: what graphpipe's failure
    handling (``faults.as_comm_failure``) knows as a collective's failure, raised here from
    the graph rather than from torch's c10d Python."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is None or isinstance(e, dist_error):
        return e
    return dist_error(str(e))


class _Issue:
    """A c10d operation: issue it, keep its work for the waits."""

    __slots__ = ("op", "work")

    def __init__(self, op: Any) -> None:
        self.op, self.work = op, None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        try:
            out = self.op(*args, **kwargs)
        except RuntimeError as e:
            raise _transport_error(e) from None
        self.work = out[-1] if isinstance(out, tuple) else out

    def take(self) -> Any:
        """The work issued last (None once taken, or after a failed replay)."""
        work, self.work = self.work, None
        return work


class _WaitIssued:
    __slots__ = ("issue",)

    def __init__(self, issue: _Issue) -> None:
        self.issue = issue

    def __call__(self) -> None:
        work = self.issue.take()
        if work is not None:
            try:
                work.wait()
            except RuntimeError as e:
                raise _transport_error(e) from None


class _Pending:
    """A functional collective: issue it, keep its fresh result until the step waits."""

    __slots__ = ("fresh", "op")

    def __init__(self, op: Any) -> None:
        self.op, self.fresh = op, None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.fresh = self.op(*args, **kwargs)

    def take(self) -> Any:
        """The result issued last (None once taken, or after a failed replay)."""
        fresh, self.fresh = self.fresh, None
        return fresh


class _Land:
    """The step's ``wait_tensor`` of a functional collective: wait, copy into the graph's
    tensor."""

    __slots__ = ("into", "pending", "wait")

    def __init__(self, pending: _Pending, into: torch.Tensor | None) -> None:
        self.pending, self.into = pending, into
        self.wait = torch.ops._c10d_functional.wait_tensor.default._op

    def __call__(self) -> None:
        fresh = self.pending.take()
        if fresh is not None:
            fresh = self.wait(fresh)
            if self.into is not None:
                self.into.copy_(fresh)


def _copy_into(op: Any, outs: tuple[torch.Tensor | None, ...]) -> Callable[..., None]:
    """Run the functional ``op``, copy its tensor results into ``outs``."""

    def run(*args: Any, **kwargs: Any) -> None:
        res = op(*args, **kwargs)
        res = res if isinstance(res, (tuple, list)) else (res,)
        for dst, src in zip(outs, res, strict=False):
            if dst is not None and isinstance(src, torch.Tensor):
                dst.copy_(src)

    return run


class _Call:
    """A recorded call of a plain Python function (``UntypedStorage.resize_``)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        self.fn(*args)


# --------------------------------------------------------------------------------------------
# The graph


Node = tuple[Callable[..., Any], tuple, dict]

_LIVE: weakref.WeakSet = weakref.WeakSet()
_exit_registered = False


def _reset_at_exit(graph: CpuGraph) -> None:
    """At exit, before graphpipe's hooks release the pipelines' process groups
    (``coordination/lifetime.py``), every graph lets go of the groups and works it holds, so that
    the last references go there and not while the interpreter finalizes. Registered at
    the first capture, after the pipelines' hook: ``atexit`` runs it first."""
    global _exit_registered
    _LIVE.add(graph)
    if not _exit_registered:
        atexit.register(_reset_all)
        _exit_registered = True


def _reset_all() -> None:
    for graph in list(_LIVE):
        graph.reset()


class CpuGraph:
    """A recorded step (see the module doc).

    label: called at each recorded operation; what the step is doing (a schedule action),
        named in errors. ``nodes``: the replay program, ``(callable, args, kwargs)`` each;
        ``names`` / ``labels``: each node's operation and label; ``stats``: what capture
        recorded (operations, views left out, c10d operations, waits, results copied).
    """

    def __init__(self, label: Callable[[], str] | None = None) -> None:
        self.label = label or (lambda: "")
        self.nodes: list[Node] = []
        self.labels: list[str] = []
        self.names: list[str] = []  # each node's operation, for a reader of the graph
        self.calls: list[Callable[[], Any]] = []  # the nodes, bound: what a replay calls
        self.stats: dict[str, int] = {}
        self.captured = False

    # ------------------------------------------------------------------ capture
    def capture(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once, recording; returns what it returns. Raises ``CaptureError``
        (after ``fn`` finished) listing every place that needs the host; any error leaves
        the graph empty."""
        if self.captured:
            raise RuntimeError("this CpuGraph holds a capture already; reset() it first")
        rec = _Recorder(self.label)
        try:
            with _eager(), _host_reads_refused(rec), rec:
                out = fn()
            if rec.syncs:
                raise CaptureError(list(rec.syncs.values()))
            self.nodes, self.labels, self.names, self.stats = rec.finish()
            self.calls = [functools.partial(fn, *args, **kwargs) for fn, args, kwargs in self.nodes]
        except BaseException:
            rec.drop()
            raise
        self.captured = True
        _reset_at_exit(self)
        return out

    # ------------------------------------------------------------------- replay
    def replay(self) -> None:
        """Re-execute the recorded operations; a failure names the label it happened in."""
        if not self.captured:
            raise RuntimeError("replay() of a CpuGraph that holds no capture")
        calls = self.calls
        call = None
        try:
            with torch._C._AutoDispatchBelowADInplaceOrView():
                for call in calls:  # the loop is the replay's cost per operation: bare
                    call()
        except BaseException as e:
            i = next((k for k, c in enumerate(calls) if c is call), 0)
            self._drain(i)
            label = self.labels[i] if i < len(self.labels) else ""
            e.graphpipe_where = label or "the captured step"  # what the step was doing
            e.add_note(f"graphpipe: raised replaying a CPU graph, in {e.graphpipe_where}")
            raise

    def _drain(self, upto: int) -> None:
        """After a failed replay: let go of every work issued so far."""
        for fn, _, _ in self.nodes[: upto + 1]:
            if isinstance(fn, (_Issue, _Pending)):
                fn.take()

    def reset(self) -> None:
        """Drop the recorded operations and the memory they hold."""
        self.nodes, self.labels, self.names, self.stats = [], [], [], {}
        self.calls = []
        self.captured = False

    def __len__(self) -> int:
        return len(self.nodes)


class _Recorder(TorchDispatchMode):
    """Records (and runs) every operation of a capture."""

    # Higher-order operators (flex_attention) come here too: their dense implementation
    # runs with the recorder on, so that the operations they are made of are recorded.
    supports_higher_order_operators = True

    def __init__(self, label: Callable[[], str]) -> None:
        super().__init__()
        self.label = label
        self.thread = threading.get_ident()  # the capturing thread
        self.quiet = False  # inside a c10d work's wait
        self.nodes: list[Node] = []
        self.labels: list[str] = []
        self.names: list[str] = []
        self.syncs: dict[tuple[str, str], HostSync] = {}
        self.touched: list[set[int]] = []  # per node, the storages it reads or writes
        self.aliases: dict[int, list[torch.Tensor]] = {}  # storage -> the replay's aliases
        self.pinned: set[int] = set()  # storages the graph must leave where they are
        self.issued: dict[_Issue, set[int]] = {}  # a c10d operation's storages
        self.born: dict[int, int] = {}  # storage -> the node it gets its values from
        # Works in flight: (span, issue, writes) per tensor a c10d operation touches.
        self.inflight: list[tuple[tuple[int, int, int], _Issue, bool]] = []
        self.pending: dict[int, _Pending] = {}  # id(functional result) -> its issue
        self.keep: list[Any] = []  # what the graph holds alive
        self.stats = {"ops": 0, "views": 0, "undefined": 0, "c10d": 0, "waits": 0, "copies": 0}
        self._detached: dict[int, torch.Tensor] = {}

    def _alias(self, x: Any) -> Any:
        """What a replay holds for ``x``: a detached alias of a plain tensor (its storage,
        not its autograd graph), a subclass tensor itself."""
        if isinstance(x, torch.Tensor):
            got = self._detached.get(id(x))
            if got is None:
                plain = _base(x) is x
                got = x.detach() if plain else x
                self._detached[id(x)] = got
                self.keep.append(x)  # ids stay unique while the capture runs
                span = _span(x)
                if span is not None:
                    if plain:
                        self.aliases.setdefault(span[0], []).append(got)
                    else:  # a subclass holds it: its storage is not the graph's to move
                        self.pinned.add(span[0])
            return got
        if isinstance(x, (list, tuple)):
            return type(x)(self._alias(y) for y in x)
        return x

    def note_sync(self, op: str, what: str) -> None:
        where = _user_frame()
        sync = self.syncs.get((op, where))
        if sync is None:
            sync = self.syncs[(op, where)] = HostSync(op, what, where)
        label = self.label()
        if label not in sync.labels:
            sync.labels.append(label)

    def _add(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        name: str,
        touched: set[int] | None = None,
    ) -> None:
        """Append a node; ``touched``: the storages it reads or writes (default: those of
        its tensor arguments), which bound the lifetimes ``_pool`` reuses memory by."""
        self.nodes.append((fn, args, kwargs))
        self.labels.append(self.label())
        self.names.append(name)
        if touched is None:
            touched = {s[0] for s in map(_span, _tensors((args, kwargs))) if s is not None}
        self.touched.append(touched)

    def _waits_for(self, reads: list, writes: list) -> None:
        """Wait nodes, before the next node, for the works in flight whose tensors it
        touches: one that writes what the node reads or writes, one that reads what the node
        writes (two reads of one tensor may overlap)."""
        if not self.inflight or not (reads or writes):
            return
        done: list[_Issue] = []
        for span, issue, wrote in self.inflight:
            if issue in done:
                continue
            if any(_overlaps(span, s) for s in writes) or (
                wrote and any(_overlaps(span, s) for s in reads)
            ):
                done.append(issue)
        for issue in done:
            self._add(_WaitIssued(issue), (), {}, "wait", self.issued[issue])
            self.stats["waits"] += 1
        self.inflight = [x for x in self.inflight if x[1] not in done]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if self.quiet or threading.get_ident() != self.thread:
            # Inside a c10d work's wait, or on a c10d backend's worker thread that runs an
            # operation with the caller's thread-local state (gloo's reduce-scatter copies
            # its result out there): the internals of a c10d operation, which its replay
            # runs again.
            return func(*args, **kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        what = _HOST_SYNC.get(func)
        if what is not None:
            self.note_sync(str(func), what)
            return func(*args, **kwargs)
        ns = func.namespace
        if ns == "profiler":  # record_function's ranges: annotations, not work (as on CUDA)
            return func(*args, **kwargs)
        args, kwargs = self._landed(args, kwargs)
        out = func(*args, **kwargs)
        self.stats["ops"] += 1
        ins = _tensors((args, kwargs))
        in_spans = [s for s in map(_span, ins) if s is not None]
        if ns == "c10d":
            sends = func._schema.name == "c10d::send"
            self._waits_for(in_spans, [] if sends else in_spans)
            issue = _Issue(func._op)
            self.issued[issue] = {s[0] for s in in_spans}
            self._add(issue, self._alias(args), self._alias(kwargs), str(func))
            self.inflight += [(s, issue, not sends) for s in in_spans]
            self.stats["c10d"] += 1
            return out
        if ns == "_c10d_functional":
            return self._functional_collective(func, args, kwargs, out, in_spans)
        if func in _UNDEFINED:
            self.stats["undefined"] += 1
            self.keep.append(out)
            self._born(out, len(self.nodes))  # written by a later node, if ever
            return out
        outs = _tensors(out)
        out_spans = [_span(t) for t in outs]
        inplace = _is_inplace(func)
        aliased = [s is not None and any(s[0] == i[0] for i in in_spans) for s in out_spans]
        if ns == "aten" and not inplace and outs and all(aliased):
            # aten's schemas mark what an operation writes: every output aliasing an input
            # is a view (``view``, ``t``, ``detach``, ``_unsafe_view``), nothing to replay
            self.stats["views"] += 1
            self.keep.append(out)
            return out
        if ns == "aten":
            written = [_span(t) for t in _written(func, args, kwargs)]
        else:  # another library's schema may not mark what it writes: any argument
            written, inplace = in_spans, inplace or all(aliased)
        self._waits_for(in_spans, [s for s in written + out_spans if s is not None])
        if ns != "aten" and any(aliased) and not all(aliased):
            # some results alias an argument (written through it), others are new: run it
            # and copy the new ones into the graph's tensors
            flat = out if isinstance(out, (tuple, list)) else (out,)
            fresh = iter(not a for a in aliased)
            targets = tuple(
                self._alias(t) if isinstance(t, torch.Tensor) and next(fresh) else None
                for t in flat
            )
            self._add_copy(func, targets, args, kwargs)
            return out
        if inplace or not outs:
            self._add(func._op, self._alias(args), self._alias(kwargs), str(func))
            return out
        flat = out if isinstance(out, (tuple, list)) else (out,)
        variant = _out_variant(func)
        plain = all(_base(t) is t for t in ins + outs)
        if (
            variant is not None
            and plain
            and all(isinstance(t, torch.Tensor) for t in flat)
            and len(flat) == len(variant[1])
        ):
            ov, names = variant
            kw = dict(self._alias(kwargs))
            kw.update({n: self._alias(t) for n, t in zip(names, flat, strict=True)})
            self._add(ov._op, self._alias(args), kw, str(ov))
            self._born(flat, len(self.nodes) - 1)
            return out
        targets = tuple(self._alias(t) if isinstance(t, torch.Tensor) else None for t in flat)
        self._add_copy(func, targets, args, kwargs)
        return out

    def _add_copy(self, func: Any, targets: tuple, args: tuple, kwargs: dict) -> None:
        """Record ``func`` run on the graph's tensors, its results copied into ``targets``
        (the graph's tensors of its results; None: a result not kept)."""
        a, kw = self._alias(args), self._alias(kwargs)
        touched = {s[0] for s in map(_span, _tensors((a, kw, targets))) if s is not None}
        self._add(_copy_into(func._op, targets), a, kw, str(func), touched)
        self._born(targets, len(self.nodes) - 1)
        self.stats["copies"] += 1

    def _born(self, tensors: Any, node: int) -> None:
        """The storages of ``tensors`` get their values from node ``node`` on (made by it,
        or allocated undefined before it): no value they held before matters, so their
        memory may come from the pool (``_pool``) if no earlier node touched them. A storage
        the step read before a recorded operation wrote it (a constant made from Python
        data, ``torch.tensor``) is never one of them."""
        for t in _tensors(tensors):
            span = _span(t)
            if span is not None:
                self.born.setdefault(span[0], node)

    def _higher_order(self, func: Any, args: tuple, kwargs: dict) -> Any:
        dense = func.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
        if dense is None:
            raise RuntimeError(
                f"the CPU graph cannot record the higher-order operator {func.name()}: it has "
                "no dense implementation to record the operations of"
            )
        with self:
            return dense(*args, **kwargs)

    def _landed(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments with each ``AsyncCollectiveTensor`` waited for (a recorded wait)."""
        fc = sys.modules.get("torch.distributed._functional_collectives")
        if fc is None:
            return args, kwargs
        act = fc.AsyncCollectiveTensor
        flat = tree_flatten((args, kwargs))[0]
        if not any(isinstance(x, act) for x in flat):
            return args, kwargs

        def land(x: Any) -> Any:
            if isinstance(x, act):
                wait = torch.ops._c10d_functional.wait_tensor.default
                return self.__torch_dispatch__(wait, (), (x.elem,), {})
            if isinstance(x, (list, tuple)):
                return type(x)(land(y) for y in x)
            return x

        return tuple(land(a) for a in args), {k: land(v) for k, v in kwargs.items()}

    def _functional_collective(self, func, args, kwargs, out, in_spans) -> Any:
        self._waits_for(in_spans, in_spans if _is_inplace(func) else [])
        self.stats["c10d"] += 1
        if func is torch.ops._c10d_functional.wait_tensor.default:
            pending = self.pending.pop(id(args[0]), None)
            if pending is not None:
                into = self._alias(args[0])
                span = _span(into)
                self._add(_Land(pending, into), (), {}, str(func), {span[0]} if span else set())
                self.stats["waits"] += 1
            else:  # an in-place collective's result: the wait itself
                self._add(func._op, self._alias(args), self._alias(kwargs), str(func))
            return out
        if _is_inplace(func) or not isinstance(out, torch.Tensor):
            self._add(func._op, self._alias(args), self._alias(kwargs), str(func))
            return out
        pending = _Pending(func._op)
        self.pending[id(out)] = pending
        self.keep.append(out)
        self._add(pending, self._alias(args), self._alias(kwargs), str(func))
        return out

    def record_call(self, fn: Callable[..., Any], *args: Any) -> None:
        """A plain call the replay repeats at this point (``UntypedStorage.resize_``: that
        storage is not the graph's to move)."""
        self.pinned |= {a._cdata for a in args if isinstance(a, torch.UntypedStorage)}
        self._add(_Call(fn), args, {}, getattr(fn, "__name__", "call"), set())

    def finish(self) -> tuple[list[Node], list[str], list[str], dict[str, int]]:
        """The replay program: the nodes (an operation with a fast path through torch's
        Python API takes it), then a wait for every work still in flight."""
        self.nodes = [
            (_FAST.get(name, fn), args, kwargs)
            for (fn, args, kwargs), name in zip(self.nodes, self.names, strict=True)
        ]
        for issue in dict.fromkeys(x[1] for x in self.inflight):
            self._add(_WaitIssued(issue), (), {}, "wait", self.issued[issue])
            self.stats["waits"] += 1
        self.inflight = []
        for pending in self.pending.values():  # results the step never waited for
            self._add(_Land(pending, None), (), {}, "wait_tensor", set())
        self.pending = {}
        self.keep.clear()  # the nodes hold detached aliases; the originals may go
        self._detached.clear()
        self._pool()
        return self.nodes, self.labels, self.names, self.stats

    def _pool(self) -> None:
        """Memory reuse, as a CUDA graph's pool: a storage that only the replay's aliases
        hold (the step made it and let go of it) passes its memory on to such a storage
        whose nodes all come after its last node. Greedy interval colouring, in order of the
        storages' first nodes, best fit by size."""
        gc.collect()  # what the step let go of inside reference cycles goes now
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, sids in enumerate(self.touched):
            for sid in sids:
                first.setdefault(sid, i)
                last[sid] = i
        pools: list[list[Any]] = []  # [busy until node, bytes, storage]
        kept = moved = 0
        for sid in sorted(first, key=first.__getitem__):
            aliases = self.aliases.get(sid)
            if not aliases or sid in self.pinned or first[sid] < self.born.get(sid, float("inf")):
                continue
            storage = aliases[0].untyped_storage()
            # only the aliases (and ``storage`` itself) hold it: nothing outside can read it
            if torch._C._storage_Use_Count(storage._cdata) != len(aliases) + 1:
                continue
            nbytes = storage.nbytes()
            free = [p for p in pools if p[0] < first[sid] and p[1] >= nbytes]
            if not free:
                pools.append([last[sid], nbytes, storage])
                kept += nbytes
                continue
            pool = min(free, key=lambda p: p[1])
            for a in aliases:
                a.set_(pool[2], a.storage_offset(), a.shape, a.stride())
            pool[0] = last[sid]
            moved += nbytes
        self.stats["pooled_bytes"] = kept  # the step's own memory the graph keeps
        self.stats["reused_bytes"] = moved  # what it would have kept without reuse, beyond

    def drop(self) -> None:
        self.nodes, self.labels, self.names, self.keep, self.inflight = [], [], [], [], []
        self.pending, self._detached, self.syncs = {}, {}, {}


@contextlib.contextmanager
def _host_reads_refused(rec: _Recorder) -> Iterator[None]:
    """While capturing: host reads that bypass the dispatcher (``.tolist()``, ``.numpy()``)
    are noted, ``UntypedStorage.resize_`` is recorded, and what a c10d work's ``wait()``
    runs is not (the replay's own wait runs it)."""
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    resize = torch.UntypedStorage.resize_
    work_cls = _work_class()
    wait = work_cls.wait if work_cls is not None else None

    def refusing(name: str) -> Callable[..., Any]:
        real = saved[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rec.note_sync(f"Tensor.{name}", "a tensor's values read on the host")
            return real(self, *args, **kwargs)

        return read

    def recorded_resize(self: torch.UntypedStorage, size: int) -> Any:
        out = resize(self, size)
        rec.record_call(resize, self, size)
        return out

    def quiet_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        before, rec.quiet = rec.quiet, True
        try:
            return wait(self, *args, **kwargs)
        finally:
            rec.quiet = before

    try:
        for name in _HOST_READS:
            setattr(torch.Tensor, name, refusing(name))
        torch.UntypedStorage.resize_ = recorded_resize
        if work_cls is not None:
            work_cls.wait = quiet_wait
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.UntypedStorage.resize_ = resize
        if work_cls is not None:
            work_cls.wait = wait


def _eager() -> Any:
    """While capturing, code compiled with ``torch.compile`` runs as its Python
    (``torch.compiler.set_stance("force_eager")``): compiled code would run outside the
    dispatcher the recorder sits on, and dynamo refuses to trace under a dispatch mode."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _work_class() -> Any:
    """torch's c10d ``Work`` class, where torch has distributed support."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return getattr(c10d, "Work", None) if c10d is not None else None
