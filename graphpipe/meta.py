"""Tensor metadata: what the warmup step records about every tensor a step touches."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["StepRecord", "TensorMeta", "describe", "is_dtensor"]

# Stable codes for dtypes that cross P2P edges (header encoding). Append only.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
DTYPE_CODE: dict[torch.dtype, int] = {dt: i for i, dt in enumerate(DTYPES)}


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a module never imported cannot have made one, so this
    imports nothing)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, dtype, device and requires_grad of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def on(self, device: torch.device) -> TensorMeta:
        """The same metadata on ``device``, not requiring grad."""
        return TensorMeta(self.shape, self.dtype, device, False)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def empty(self) -> torch.Tensor:
        """A new uninitialized tensor with this metadata (requires_grad not set)."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


def describe(metas: Sequence[TensorMeta]) -> str:
    return "(" + ", ".join(str(m) for m in metas) + ")"


class StepRecord:
    """What the warmup step saw: metadata of every tensor the step touches.

    inputs / labels: the micro-batch tensors (rank 0).
    activations: ``(stage, mb) -> (input metas, output metas)`` of each forward.
    grads: ``(stage, mb) -> metas`` of the input gradients each backward produced.
    """

    __slots__ = ("activations", "grads", "inputs", "labels")

    def __init__(self) -> None:
        self.inputs: tuple[TensorMeta, ...] = ()
        self.labels: tuple[TensorMeta, ...] = ()
        self.activations: dict[tuple[int, int], tuple[tuple[TensorMeta, ...], ...]] = {}
        self.grads: dict[tuple[int, int], tuple[TensorMeta, ...]] = {}

    def forward(self, stage: int, mb: int, x: Sequence, y: Sequence) -> None:
        self.activations[(stage, mb)] = (
            tuple(TensorMeta.of(t) for t in x),
            tuple(TensorMeta.of(t) for t in y),
        )

    def backward(self, stage: int, mb: int, grads: Sequence) -> None:
        self.grads[(stage, mb)] = tuple(TensorMeta.of(t) for t in grads)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the stored stage activations (inputs + outputs) and input gradients."""
        act = sum(m.nbytes for io in self.activations.values() for ms in io for m in ms)
        return {"activations": act, "grads": sum(m.nbytes for g in self.grads.values() for m in g)}
