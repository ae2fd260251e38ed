"""The batch: the ranks' agreement on it, and its split into micro-batches.

Inputs live on the rank that runs stage 0 (the *input rank*), labels on the rank that runs
the last stage (the *loss rank*); both are rank 0 for V schedules (DualPipeV, ZB-V). Before
every step those ranks check their part, and all ranks agree, in one all-reduce over the gloo
control group, on the batch *signature* (every tensor's shape and dtype), on the dtype of the
loss, on whether any rank rejected the batch, and on which call (``step`` or ``forward``, and
its number) every rank is in. A bad batch so raises on every rank, and no rank waits for a
peer that gave up or called something else. May touch: the control group; nothing else.

Signature layout: ``(train, len(inputs), (dtype code, ndim, *shape) per input tensor,
len(labels), (...) per label tensor)``; labels only when training.
"""

from __future__ import annotations

from typing import Any

import torch

from graphpipe.errors import PipelineError
from graphpipe.meta import DTYPE_CODE, DTYPES

from .faults import CommFailure
from .tensors import as_tuple

__all__ = ["BatchAgreement"]

_PART = 64  # int64 words per part of the agreement buffer


def _part(name: str, value: Any, m: int) -> list[int]:
    """``[count, (dtype code, ndim, *shape) ...]`` of one part; raises naming the problem."""
    if value is None:
        raise ValueError(f"{name} must not be None on this rank: it holds the batch's {name}")
    ts = as_tuple(value, name)
    out = [len(ts)]
    for i, t in enumerate(ts):
        if t.dim() == 0:
            raise ValueError(f"{name}[{i}] is 0-dim: the batch is split on dim 0")
        if t.shape[0] == 0:
            raise ValueError(f"{name}[{i}] of shape {list(t.shape)} holds no rows")
        if t.shape[0] % m:
            raise ValueError(
                f"{name}[{i}] of shape {list(t.shape)} does not split on dim 0 into "
                f"num_microbatches={m} equal micro-batches"
            )
        if t.dtype not in DTYPE_CODE:
            raise ValueError(f"{name}[{i}] has unsupported dtype {t.dtype}")
        out += [DTYPE_CODE[t.dtype], t.dim(), *t.shape]
    if len(out) >= _PART:
        raise ValueError(f"{name} has too many tensors or dims ({len(out)} ints)")
    return out


class BatchAgreement:
    """Agrees on each call's batch across the pipeline ranks (see the module doc).

    groups: the pipeline's groups (the control group is looked up at each call).
    rank / num_ranks: this rank and the pipeline size.
    input_rank / loss_rank: who holds the inputs and the labels.
    input_dtype: the floating dtype stage 0 computes in (its first floating parameter's), or
        None; floating inputs of another dtype are refused unless autocast is on.
    """

    def __init__(
        self,
        groups: Any,
        rank: int,
        num_ranks: int,
        input_rank: int,
        loss_rank: int,
        num_microbatches: int,
        input_dtype: torch.dtype | None,
    ) -> None:
        self.groups, self.rank, self.num_ranks = groups, rank, num_ranks
        self.input_rank, self.loss_rank = input_rank, loss_rank
        self.m = num_microbatches
        self.input_dtype = input_dtype
        self._flags = 2 * _PART + 1

    def _check_dtype(self, inputs: Any, device_type: str) -> None:
        if self.input_dtype is None or torch.is_autocast_enabled(device_type):
            return
        for i, t in enumerate(as_tuple(inputs, "inputs")):
            if t.is_floating_point() and t.dtype != self.input_dtype:
                raise ValueError(
                    f"inputs[{i}] has dtype {t.dtype}, but stage 0's parameters are "
                    f"{self.input_dtype}: cast the batch (or run under torch.autocast)"
                )

    def agree(
        self,
        inputs: Any,
        labels: Any,
        train: bool,
        loss_dtype: torch.dtype,
        call: int,
        device_type: str = "cpu",
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """The agreed signature and loss dtype of call number ``call`` (``step`` when
        ``train``, else ``forward``); raises on every rank if a rank rejects the batch or the
        ranks are not in the same call."""
        n, f = self.num_ranks, self._flags
        # Filled as a Python list (a torch op per word would cost more than the step's
        # bookkeeping); a tensor only for the all-reduce.
        vals = [0] * (f + 3 * n)
        err: Exception | None = None
        try:
            if self.rank == self.input_rank:
                sig = _part("inputs", inputs, self.m)
                self._check_dtype(inputs, device_type)
                vals[0] = len(sig)
                vals[1 : 1 + len(sig)] = sig
            if train and self.rank == self.loss_rank:
                sig = _part("labels", labels, self.m)
                vals[_PART] = len(sig)
                vals[_PART + 1 : _PART + 1 + len(sig)] = sig
                vals[2 * _PART] = DTYPE_CODE[loss_dtype] + 1
        except (ValueError, TypeError) as e:
            err = e
            vals[f + self.rank] = 1
        vals[f + n + self.rank] = 1 if train else 2
        vals[f + 2 * n + self.rank] = call
        if n > 1:
            control = self.groups.control
            buf = torch.tensor(vals, dtype=torch.int64)
            try:
                if control is None:
                    raise RuntimeError("the pipeline's process groups were dropped")
                control.allreduce([buf]).wait()
            except RuntimeError as e:
                raise CommFailure(None, "batch agreement", e.with_traceback(None)) from None
            vals = buf.tolist()
        kinds, calls = vals[f + n : f + 2 * n], vals[f + 2 * n : f + 3 * n]
        if len(set(kinds)) > 1 or len(set(calls)) > 1:
            what = {1: "step()", 2: "forward()"}
            who = ", ".join(
                f"rank {r}: {what[k]} #{c}"
                for r, (k, c) in enumerate(zip(kinds, calls, strict=True))
            )
            raise PipelineError(
                f"the pipeline ranks are not in the same call ({who}): every rank must call "
                "step() and forward() together"
            )
        if err is not None:
            raise err
        rejected = [r for r in range(n) if vals[f + r]]
        if rejected:
            raise PipelineError(
                f"rank {rejected[0]} rejected this batch (see the error on rank {rejected[0]}); "
                "no rank ran the step"
            )
        n_in = vals[0]
        sig = [int(train), *vals[1 : 1 + n_in]]
        if train:
            n_lab = vals[_PART]
            sig += vals[_PART + 1 : _PART + 1 + n_lab]
            loss_dtype = DTYPES[vals[2 * _PART] - 1]
        return tuple(sig), loss_dtype
