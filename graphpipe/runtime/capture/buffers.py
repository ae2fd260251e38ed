"""The static buffer plan: every buffer a captured step touches, allocated once.

Built from the warmup step's metadata and the lowered program. Each receive buffer lives
from the schedule step that posts its receive until the last action that can still read it:
the ``B`` of its (stage, micro-batch), or the ``W`` when the backward was split into ``I`` +
``W`` (the deferred weight-gradient GEMMs read the stage input and the output gradient). A
send buffer (a gloo packet) lives until the end of the step: sends complete in the
background and are waited for there. Buffers
with the same metadata whose lifetimes do not overlap share one allocation (greedy interval
coloring, which is optimal for interval graphs per metadata class).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from graphpipe.meta import TensorMeta
from graphpipe.schedule.ir import Action, Op

__all__ = ["BufferKey", "BufferPlan", "build_plan"]

BufferKey = tuple[str, int, int]
"""``(kind, stage, microbatch)``; kind is ``"recv_activation"``, ``"recv_grad"``, or, for
several messages that travel as one flat buffer (gloo packets), ``"recv_packet"`` /
``"send_packet"`` keyed by the packet's first message."""

KINDS = (
    "inputs",
    "labels",
    "kwargs",
    "recv_activation",
    "recv_grad",
    "recv_packet",
    "send_packet",
)


@dataclass
class _Slot:
    meta: tuple[TensorMeta, ...]
    tensors: tuple[torch.Tensor, ...]
    free_after: int  # last program index that may read it


@dataclass
class BufferPlan:
    """Buffers of one metadata signature.

    buffers: receive buffers by ``(kind, stage, microbatch)``; shared allocations appear
        under several keys.
    inputs / labels: the whole-batch static buffers of the input and the loss rank (empty
        elsewhere). kwargs: the whole-batch keyword tensors this rank uses, by name.
    lifetimes: ``(first, last)`` program index of each receive buffer.
    """

    buffers: dict[BufferKey, tuple[torch.Tensor, ...]]
    lifetimes: dict[BufferKey, tuple[int, int]]
    inputs: tuple[torch.Tensor, ...] = ()
    labels: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    allocations: int = 0
    _bytes: dict[str, int] = field(default_factory=dict)
    _naive: dict[str, int] = field(default_factory=dict)

    def nbytes(self) -> dict[str, int]:
        """Bytes allocated per kind (inputs, labels, recv_activation, recv_grad)."""
        return {k: self._bytes.get(k, 0) for k in KINDS}

    def naive_nbytes(self) -> dict[str, int]:
        """Bytes per kind with one buffer per micro-batch (no reuse)."""
        return {k: self._naive.get(k, 0) for k in KINDS}

    def saving(self) -> int:
        """Bytes saved against one buffer per micro-batch."""
        return sum(self.naive_nbytes().values()) - sum(self.nbytes().values())

    def data_ptrs(self) -> set[int]:
        ptrs = {t.data_ptr() for ts in self.buffers.values() for t in ts}
        ptrs |= {t.data_ptr() for ts in self.kwargs.values() for t in ts}
        return ptrs | {t.data_ptr() for t in self.inputs + self.labels}

    def report(self) -> str:
        rows = [f"{'kind':<16} {'planned':>12} {'per-microbatch':>15}"]
        naive = self.naive_nbytes()
        for k, v in self.nbytes().items():
            rows.append(f"{k:<16} {v:>12,} {naive[k]:>15,}")
        rows.append(f"saving: {self.saving():,} bytes in {self.allocations} allocations")
        return "\n".join(rows)


def _end_of_life(program: Sequence[Action | None]) -> dict[tuple[int, int], int]:
    """(stage, mb) -> index of the last action that reads its boundary tensors."""
    end: dict[tuple[int, int], int] = {}
    for i, a in enumerate(program):
        if a is None:
            continue
        for part in a.parts():
            if part.op in (Op.B, Op.I, Op.W):
                end[(part.stage, part.microbatch)] = i
    return end


def _nbytes(metas: Sequence[TensorMeta]) -> int:
    return sum(m.nbytes for m in metas)


def build_plan(
    program: Sequence[tuple[Sequence[BufferKey], Action | None]],
    metas: dict[BufferKey, tuple[TensorMeta, ...]],
    inputs: Sequence[TensorMeta] = (),
    labels: Sequence[TensorMeta] = (),
    readers: dict[BufferKey, Sequence[tuple[int, int]]] | None = None,
    until_end: Sequence[BufferKey] = (),
    kwargs: Mapping[str, Sequence[TensorMeta]] | None = None,
) -> BufferPlan:
    """Allocate the buffers of one step.

    program: per schedule step, the buffer keys it posts and its compute action.
    metas: the metadata of each buffer key (from the warmup step).
    inputs / labels: metadata of the whole-batch tensors (rank 0 only).
    readers: the ``(stage, microbatch)`` whose last action ends each key's life (default:
        the key's own; an empty list: the buffer dies with its step).
    until_end: keys that live until the end of the step whatever reads them: send buffers,
        since a send completes in the background and is waited for at the end of the step.
    kwargs: metadata of the whole-batch keyword tensors, by name.
    """
    end = _end_of_life([a for _, a in program])
    readers = readers or {}
    ends = set(until_end)
    lifetimes: dict[BufferKey, tuple[int, int]] = {}
    for i, (keys, _) in enumerate(program):
        for key in keys:
            if key in lifetimes:
                raise ValueError(f"buffer {key} is posted twice in one step")
            last = i
            for who in readers.get(key, [(key[1], key[2])]):
                if (done := end.get(who)) is None or done < i:
                    raise ValueError(f"buffer {key} received at step {i} is never consumed")
                last = max(last, done)
            lifetimes[key] = (i, len(program) if key in ends else last)
    free: dict[tuple[TensorMeta, ...], list[_Slot]] = {}
    buffers: dict[BufferKey, tuple[torch.Tensor, ...]] = {}
    plan_bytes: dict[str, int] = {}
    naive: dict[str, int] = {}
    allocations = 0
    for key in sorted(lifetimes, key=lambda k: lifetimes[k]):
        first, last = lifetimes[key]
        meta = metas[key]
        naive[key[0]] = naive.get(key[0], 0) + _nbytes(meta)
        slots = free.setdefault(meta, [])
        slot = next((s for s in slots if s.free_after < first), None)
        if slot is None:
            slot = _Slot(meta, tuple(m.empty() for m in meta), last)
            slots.append(slot)
            allocations += len(meta)
            plan_bytes[key[0]] = plan_bytes.get(key[0], 0) + _nbytes(meta)
        slot.free_after = last
        buffers[key] = slot.tensors
    static_inputs = tuple(m.empty() for m in inputs)
    static_labels = tuple(m.empty() for m in labels)
    kwargs = kwargs or {}
    static_kwargs = {name: tuple(m.empty() for m in ms) for name, ms in kwargs.items()}
    kw_metas = [m for ms in kwargs.values() for m in ms]
    for kind, ms in (("inputs", inputs), ("labels", labels), ("kwargs", kw_metas)):
        plan_bytes[kind] = naive[kind] = _nbytes(ms)
    return BufferPlan(
        buffers,
        lifetimes,
        static_inputs,
        static_labels,
        static_kwargs,
        allocations + len(static_inputs) + len(static_labels) + len(kw_metas),
        plan_bytes,
        naive,
    )
