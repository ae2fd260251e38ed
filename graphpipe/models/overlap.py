"""Chunked forward and backward of one micro-batch, and the interleaving of two.

An MoE stage's work for one micro-batch is a sequence of *chunks*: compute chunks
(attention, router and dispatch layout; the experts; combine and what follows) separated by
communication chunks (the all-to-all that dispatches tokens to their experts' ranks, and the
one that brings the results back). To hide one micro-batch's all-to-all under the other's
compute, both the forward and the backward must stop at each communication point, and the
backward must be split like the forward, so that ``overlapped_forward_backward`` can
interleave the F of one micro-batch with the B of another.

The split is made with plain autograd, on chunk boundaries:

* **Forward.** ``Tape.cut`` closes a compute chunk: each tensor leaving it is detached into a
  fresh leaf (no copy) that the next chunks use; the chunk keeps the attached originals.
  ``Tape.exchange`` posts an all-to-all of a leaf (``Exchange``) and, once waited, hands the
  received tensor on as a new leaf. The stage's outputs leave through ``TapeEnd``, an
  autograd function whose only input is an empty anchor leaf.
* **Backward.** ``Tape.backward_steps`` walks the chunks in reverse: a compute chunk runs
  ``torch.autograd.backward`` from its attached outputs with the gradients its leaves
  collected; a communication chunk posts the all-to-all of its received leaf's gradient
  (an all-to-all with equal splits is its own adjoint) and yields it. When the runtime calls
  ``torch.autograd.backward`` on a stage's outputs (a plain ``B`` or ``I``), ``TapeEnd``'s
  backward runs those steps itself, waiting each exchange at once; inside an overlapped
  pair the hook drives them instead (``drive_backward``).
* **Interleaving.** Forward and backward are generators that yield each posted exchange.
  ``run_pair`` alternates the two: it resumes one until it posts an exchange, then the other
  while that exchange is in flight, and waits for an exchange only when its generator is
  next resumed. ``drain`` runs one generator alone (each exchange waited right away).

The numerics do not depend on the interleaving: each micro-batch runs the same chunks with
the same gradients in the same order, whether alone or paired, so a pair gives bitwise the
results of its F then its B.

**Event log.** When a stage's ``events`` is a list, each chunk appends a ``MoEEvent`` ``(role,
layer, what)`` as it completes: role ``"F"`` or ``"B"``, ``layer`` the global index of the
MoE block (``-1``: the stage's tail with no MoE block after its last exchange), ``what`` such
as ``"attn done"``, ``"dispatch issued"``, ``"dispatch waited"``, ``"experts-bwd done"``,
``"combine-bwd issued"``. A pair brackets its events with ``("pair", -1, "begin")`` and
``("pair", -1, "end")``. With a local exchange (no expert parallelism) nothing is sent, but
the issue and wait points are logged at the same places.

**CUDA** (not yet run on a GPU): an exchange runs its all-to-all on a
communication stream that first waits for the current stream; the current stream waits for
the exchange's event when it is waited, so the host never blocks and the fork/join is
capturable in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "Exchange",
    "MoEEvent",
    "Tape",
    "TapeEnd",
    "drain",
    "drive_backward",
    "overlapped_pair",
    "run_pair",
]

Steps = Generator["Exchange", None, Any]


class MoEEvent(NamedTuple):
    """One point of a chunked forward or backward (see the module docstring)."""

    role: str
    """``"F"`` (forward), ``"B"`` (backward) or ``"pair"`` (an overlapped pair's bracket)."""
    layer: int
    """Global index of the MoE block the chunk belongs to (-1: none)."""
    what: str
    """``"<chunk> done"``, ``"<exchange> issued"`` or ``"<exchange> waited"``."""


def _log(events: list | None, role: str, layer: int, what: str) -> None:
    if events is not None:
        events.append(MoEEvent(role, layer, what))


_comm_streams: dict[torch.device, Any] = {}


def _comm_stream(device: torch.device) -> Any:
    """One communication stream per CUDA device (created on first use)."""
    stream = _comm_streams.get(device)
    if stream is None:
        stream = _comm_streams[device] = torch.cuda.Stream(device)
    return stream


class Exchange:
    """An all-to-all with equal splits on dim 0, posted now and waited later.

    ``group`` None (or of one rank): local, the result is ``x`` itself and nothing is sent.
    CPU: ``all_to_all_single(async_op=True)`` (gloo). CUDA: a synchronous all-to-all
    enqueued on the communication stream, joined through an event (untested on a GPU).
    """

    __slots__ = ("_done", "_event", "_out", "_work", "events", "group", "layer", "name", "role")

    def __init__(
        self,
        x: torch.Tensor,
        group: Any,
        name: str,
        role: str,
        layer: int,
        events: list | None,
    ) -> None:
        self.name, self.role, self.layer, self.events = name, role, layer, events
        self.group = group
        self._work: Any = None
        self._event: Any = None
        self._done = False
        if group is None or dist.get_world_size(group) == 1:
            self._out = x
        else:
            x = x.contiguous()
            self._out = torch.empty_like(x)
            if x.is_cuda:
                cur = torch.cuda.current_stream(x.device)
                comm = _comm_stream(x.device)
                comm.wait_stream(cur)
                with torch.cuda.stream(comm):
                    dist.all_to_all_single(self._out, x, group=group)
                    self._event = torch.cuda.Event()
                    self._event.record(comm)
                x.record_stream(comm)
                self._out.record_stream(cur)
            else:
                self._work = dist.all_to_all_single(self._out, x, group=group, async_op=True)
        _log(events, role, layer, f"{name} issued")

    def wait(self) -> torch.Tensor:
        """Wait for the exchange (on CUDA: make the current stream wait); the result. Only
        the first call waits (and is logged)."""
        if self._done:
            return self._out
        self._done = True
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._event)
            self._event = None
        _log(self.events, self.role, self.layer, f"{self.name} waited")
        return self._out


class _Compute:
    """A closed compute chunk: its attached outputs and the leaves that stand for them."""

    __slots__ = ("layer", "leaves", "name", "srcs")

    def __init__(self, name: str, layer: int, srcs: list, leaves: list) -> None:
        self.name, self.layer, self.srcs, self.leaves = name, layer, srcs, leaves


class _Comm:
    """An exchange chunk: the leaf it sent and the leaf it received."""

    __slots__ = ("group", "layer", "name", "received", "sent")

    def __init__(self, name: str, layer: int, sent: Any, received: Any, group: Any) -> None:
        self.name, self.layer, self.sent, self.received = name, layer, sent, received
        self.group = group


class Tape:
    """The chunks of one micro-batch's forward through one stage (see the module docstring).

    owner: the stage (its ``events`` list, and the flag ``TapeEnd`` reads).
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.chunks: list[_Compute | _Comm] = []
        self.final: list[torch.Tensor] = []

    @property
    def events(self) -> list | None:
        return getattr(self.owner, "events", None)

    def cut(self, name: str, layer: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Close the current compute chunk: each tensor that requires grad comes back as a
        fresh leaf on the same storage; others come back as they are."""
        srcs, leaves, out = [], [], []
        for t in tensors:
            if t.requires_grad:
                leaf = t.detach().requires_grad_()
                srcs.append(t)
                leaves.append(leaf)
                out.append(leaf)
            else:
                out.append(t)
        self.chunks.append(_Compute(name, layer, srcs, leaves))
        _log(self.events, "F", layer, f"{name} done")
        return tuple(out)

    def exchange(self, name: str, layer: int, leaf: torch.Tensor, group: Any) -> Exchange:
        """Post the all-to-all of ``leaf`` (a tensor ``cut`` returned) over ``group``."""
        return Exchange(leaf, group, name, "F", layer, self.events)

    def received(self, sent: torch.Tensor, ex: Exchange) -> torch.Tensor:
        """The waited result of ``ex`` (the exchange of ``sent``) as a leaf for the next
        chunk."""
        out = ex.wait()
        if out is not sent:  # local: the next chunk reads the sent leaf itself
            out.requires_grad_(sent.requires_grad)
        if sent.requires_grad:
            self.chunks.append(_Comm(ex.name, ex.layer, sent, out, ex.group))
        return out

    def end(self, name: str, layer: int, outputs: Sequence[torch.Tensor]) -> tuple:
        """Close the last chunk and return the stage's outputs through ``TapeEnd``."""
        leaves = self.cut(name, layer, *outputs)
        self.final = list(leaves)
        anchor = torch.empty(0, device=outputs[0].device, requires_grad=True)
        return TapeEnd.apply(self, anchor, *leaves)

    def backward_steps(self) -> Steps:
        """The backward, chunk by chunk in reverse; yields each posted exchange. The leaves
        of the last chunk must hold their gradients (``TapeEnd``'s backward sets them)."""
        events = self.events
        chunks, self.chunks, self.final = self.chunks, [], []
        while chunks:
            chunk = chunks.pop()
            if isinstance(chunk, _Compute):
                pairs = [(s, leaf.grad) for s, leaf in zip(chunk.srcs, chunk.leaves)]
                pairs = [(s, g) for s, g in pairs if g is not None]
                if pairs:
                    torch.autograd.backward([s for s, _ in pairs], [g for _, g in pairs])
                _log(events, "B", chunk.layer, f"{chunk.name}-bwd done")
            elif chunk.received is chunk.sent:  # local: the gradient is already in place
                ex = Exchange(chunk.sent.grad, None, f"{chunk.name}-bwd", "B", chunk.layer, events)
                yield ex
                ex.wait()
            else:
                g = chunk.received.grad
                if g is None:
                    g = torch.zeros_like(chunk.received)
                ex = Exchange(g, chunk.group, f"{chunk.name}-bwd", "B", chunk.layer, events)
                yield ex
                got = ex.wait()
                if chunk.sent.grad is None:
                    chunk.sent.grad = got
                else:
                    chunk.sent.grad.add_(got)


class TapeEnd(torch.autograd.Function):
    """The stage's outputs, attached to the tape: their backward runs the tape's chunks.

    ``forward(tape, anchor, *leaves)`` returns the last chunk's leaves (aliases);
    ``anchor`` is an empty leaf that makes the outputs require grad without tying them to
    any chunk's graph. ``backward`` stores the incoming gradients on those leaves, then runs
    ``tape.backward_steps`` to the end, unless the owner stage is driving its backward
    itself (``owner._driving``): then it records the tape in ``owner._reached``.
    """

    @staticmethod
    def forward(ctx, tape: Tape, anchor: torch.Tensor, *leaves: torch.Tensor):  # type: ignore[override]
        ctx.tape = tape
        outs = tuple(t.detach() for t in leaves)
        ctx.mark_non_differentiable(*[o for o, t in zip(outs, leaves) if not t.requires_grad])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        tape: Tape = ctx.tape
        ctx.tape = None
        for leaf, g in zip(tape.final, grads):
            if g is not None and leaf.requires_grad:
                leaf.grad = g
        owner = tape.owner
        if getattr(owner, "_driving", False):
            owner._reached = tape
        else:
            drain(tape.backward_steps())
        return (None, None) + (None,) * len(grads)


def drain(steps: Steps) -> Any:
    """Run a chunked forward or backward alone (each exchange is waited as soon as it is
    posted: the generator waits for it when resumed); returns the generator's value."""
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


def drive_backward(
    stage: Any, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> Steps:
    """The chunked backward of the micro-batch whose ``outputs`` are given: first the
    autograd work from ``outputs`` back to the stage's ``TapeEnd`` (for the last stage, the
    loss), then the tape's chunks as a generator."""
    stage._driving, stage._reached = True, None
    try:
        torch.autograd.backward(list(outputs), list(grads))
    finally:
        stage._driving = False
    tape, stage._reached = stage._reached, None
    if tape is None:
        raise RuntimeError(
            f"the backward of {type(stage).__name__} did not reach its chunked forward: were "
            "its outputs made with grad disabled or without the tape (chunked=False)?"
        )
    return tape.backward_steps()


def run_pair(forward: Steps, backward: Steps, events: list | None = None) -> Any:
    """Interleave a chunked forward and a chunked backward; returns the forward's value.

    Starts with the forward; each side runs until it posts an exchange, then the other side
    runs while that exchange is in flight; a side waits for its exchange when it is resumed
    (the generators wait, right after the yield). When one side finishes, the other runs
    alone to its end.
    """
    _log(events, "pair", -1, "begin")
    sides: dict[str, Steps] = {"F": forward, "B": backward}
    result: Any = None
    while sides:
        for role in ("F", "B"):
            steps = sides.get(role)
            if steps is None:
                continue
            try:
                next(steps)
            except StopIteration as stop:
                del sides[role]
                if role == "F":
                    result = stop.value
    _log(events, "pair", -1, "end")
    return result


def overlapped_pair(
    fmod: Any,
    forward: Callable[..., Steps],
    inputs: Sequence[Any],
    bmod: Any,
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
) -> Any:
    """An ``overlapped_forward_backward`` built from a stage's chunked forward: the backward
    of ``bmod``'s micro-batch interleaved with ``forward(*inputs)`` of ``fmod``'s; returns
    the forward's outputs. The pair's events go to ``fmod.events``."""
    events = getattr(fmod, "events", None)
    backward = drive_backward(bmod, outputs, grads)
    return run_pair(forward(*inputs), backward, events)
