"""Tensor plumbing every part of the runtime shares: a value as a tuple of tensors, a batch
split into micro-batches, a gradient that a collective needs.

Owns: nothing (pure functions). May touch: the tensors it is given, read-only (but
``grad_or_zeros``, which sets a missing ``.grad``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from graphpipe.meta import is_dtensor

__all__ = ["Tensors", "as_tuple", "grad_or_zeros", "local_shard", "plain", "split_microbatches"]

Tensors = tuple[torch.Tensor, ...]


def as_tuple(x: Any, what: Any = "value") -> Tensors:
    """``x`` as a tuple of tensors; ``TypeError`` naming ``what`` otherwise (a stage id: "the
    output of stage N")."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    if isinstance(what, int):
        what = f"the output of stage {what}"
    got = type(x).__name__
    if isinstance(x, (tuple, list)):
        got += "[" + ", ".join(type(t).__name__ for t in x) + "]"
    raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {got}")


def split_microbatches(part: Any, m: int, device: torch.device, unwrap: bool = False) -> list[Any]:
    """``part`` (a tensor or tuple) on ``device``, chunked on dim 0 into ``m`` micro-batches;
    ``unwrap``: a single tensor per micro-batch instead of a 1-tuple."""
    chunks = [t.to(device, non_blocking=True).chunk(m) for t in as_tuple(part)]
    mbs = [tuple(c[i] for c in chunks) for i in range(m)]
    return [mb[0] for mb in mbs] if unwrap else mbs


def grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, set to zeros when the step gave it none (a collective over gradients needs
    every member's)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor parallel parameter or gradient: it shares the
    DTensor's memory, so writing it writes the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def plain(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a plain tensor the transport can send: an ``AsyncCollectiveTensor`` (the
    output of a tensor-parallel ``RowwiseParallel`` layer, say, whose data is there only once
    its collective is waited for) is waited for; another tensor subclass (a ``DTensor``) is
    a ``TypeError`` naming ``what``."""
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return t
    fc = sys.modules.get("torch.distributed._functional_collectives")
    if fc is not None and isinstance(t, fc.AsyncCollectiveTensor):
        return t.wait()
    raise TypeError(
        f"{what} is a {cls.__name__}, which cannot cross a pipeline edge: return a plain "
        "tensor (a DTensor's to_local() or full_tensor(); for tensor-parallel layers, "
        "use_local_output=True)"
    )
