"""The loss: per-micro-batch losses, the backward seed, and the mean loss on every rank.

The loss rank's stage runner writes each micro-batch's loss into ``loss_parts``; at the end of
the step they are stacked into the static ``losses`` buffer, averaged into the static ``out``
(averaged again over the data-parallel replicas' loss ranks) and broadcast from the loss rank,
on the device under CUDA (so it runs inside captured graphs) and over the control group on
CPU. The backward seed of every micro-batch is ``1 / M`` (scaled by a ``GradScaler`` when one
is given), so the gradients are those of the mean loss.

Owns: the loss buffers (``losses``, ``seed``, ``out``). May touch: the stage runner's loss
fields, the data-parallel part's loss average, the control group through ``Faults``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LossReducer"]


class LossReducer:
    """The loss buffers of one pipeline (allocated for a dtype once the ranks agree on it)."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.dtype: torch.dtype | None = None
        self.out: torch.Tensor | None = None

    def ensure(self, dtype: torch.dtype) -> None:
        """Buffers of ``dtype`` (kept while it stays; a change after capture is an error)."""
        if self.dtype == dtype:
            return
        pipe = self.pipe
        if pipe._capture.captures:
            raise ValueError(f"the loss dtype changed to {dtype} after capture")
        self.dtype = dtype
        m, dev, runner = pipe.num_microbatches, pipe.device, pipe.runner
        runner.losses = torch.zeros(m, dtype=dtype, device=dev)
        runner.seed = torch.zeros((), dtype=dtype, device=dev)
        self.out = torch.zeros((), dtype=dtype, device=dev)

    def prepare_seed(self, scaler: Any) -> None:
        """The backward seed ``1 / M`` (scaled by ``scaler``) on the loss rank."""
        pipe = self.pipe
        runner = pipe.runner
        if pipe.is_loss_rank:
            runner.seed.fill_(1.0 / pipe.num_microbatches)
            runner.backward_seed = scaler.scale(runner.seed) if scaler is not None else runner.seed
        elif scaler is not None:
            scaler.scale(torch.zeros((), device=pipe.device))  # initializes its scale here too

    def reduce(self) -> torch.Tensor:
        """The mean loss into the static ``out``, broadcast from the loss rank."""
        pipe, out = self.pipe, self.out
        if pipe.is_loss_rank:
            runner = pipe.runner
            torch.stack(runner.loss_parts, out=runner.losses)
            runner.loss_parts = [None] * pipe.num_microbatches
            torch.mean(runner.losses, dim=0, out=out)
            if pipe.data_parallel is not None:  # the mean over the replicas' loss ranks
                pipe.data_parallel.average_loss(out)
        if pipe.num_ranks == 1:
            return out
        if pipe.device.type == "cuda":  # on device: it runs inside captured graphs
            dist.broadcast(out, src=pipe._global[pipe.loss_rank], group=pipe.group)
            return out
        pipe._faults.control("loss", lambda g: g.broadcast(out, pipe.loss_rank))
        return out
