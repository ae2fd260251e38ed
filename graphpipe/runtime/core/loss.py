"""The loss: per-micro-batch losses, the backward seed, and the mean loss on every rank.

The loss rank's stage runner writes each micro-batch's loss into ``loss_parts``; at the end of
the step they are stacked into the static ``losses`` buffer, averaged into the static ``out``
(averaged again over the data-parallel replicas' loss ranks) and broadcast from the loss rank,
on the device under CUDA (so it runs inside captured graphs) and over the control group on
CPU. The backward seed of every micro-batch is ``1 / M`` (scaled by a ``GradScaler`` when one
is given), so the gradients are those of the mean loss; with ``loss_reduction="sum"`` the
micro-batch losses are summed (seed 1; over the replicas too), for a ``loss_fn`` that
already divides by the global number of tokens.

Owns: the loss buffers (``losses``, ``seed``, ``out``). May touch: the stage runner through
its calls (``set_backward_seed``, ``take_loss_parts``), the loss average it is given (the
data-parallel part's), the control group through ``Faults``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .context import RankContext

if TYPE_CHECKING:
    from ..coordination.faults import Faults
    from .stage import StageRunner

__all__ = ["LossReducer"]


class LossReducer:
    """The loss buffers of one pipeline rank (allocated for a dtype once the ranks agree on it).

    ctx: the rank. runner: the stage runner whose backward it seeds and whose micro-batch
    losses it takes. faults: the pipeline's failure handling (the broadcast over the control
    group goes through it). average: the data-parallel part's ``average(out)``, which
    averages the loss rank's loss over the replicas in place (None: no replicas).
    """

    def __init__(
        self,
        ctx: RankContext,
        runner: StageRunner,
        faults: Faults,
        reduction: str = "mean",
        average: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.ctx, self.runner, self.faults = ctx, runner, faults
        self.reduction = reduction
        self.dtype: torch.dtype | None = None
        self.out: torch.Tensor | None = None
        self.losses: torch.Tensor | None = None  # each micro-batch's loss, stacked
        self.seed: torch.Tensor | None = None  # the backward seed before a scaler
        self.average = average

    def ensure(self, dtype: torch.dtype, frozen: bool = False) -> None:
        """Buffers of ``dtype`` (kept while it stays); ``frozen``: the buffers are captured,
        so a change is an error."""
        if self.dtype == dtype:
            return
        if frozen:
            raise ValueError(f"the loss dtype changed to {dtype} after capture")
        self.dtype = dtype
        ctx = self.ctx
        self.losses = torch.zeros(ctx.num_microbatches, dtype=dtype, device=ctx.device)
        self.seed = torch.zeros((), dtype=dtype, device=ctx.device)
        self.out = torch.zeros((), dtype=dtype, device=ctx.device)

    def prepare_seed(self, scaler: Any) -> None:
        """The backward seed ``1 / M`` (``"sum"``: 1), scaled by ``scaler``, on the loss
        rank."""
        ctx, seed = self.ctx, self.seed
        if ctx.is_loss_rank:
            seed.fill_(1.0 / ctx.num_microbatches if self.reduction == "mean" else 1.0)
            self.runner.set_backward_seed(scaler.scale(seed) if scaler is not None else seed)
        elif scaler is not None:
            scaler.scale(torch.zeros((), device=ctx.device))  # initializes its scale here too

    def reduce(self) -> torch.Tensor:
        """The mean (``"sum"``: the sum) of the micro-batch losses into the static ``out``,
        broadcast from the loss rank."""
        ctx, out = self.ctx, self.out
        if ctx.is_loss_rank:
            torch.stack(self.runner.take_loss_parts(), out=self.losses)
            if self.reduction == "mean":
                torch.mean(self.losses, dim=0, out=out)
            else:
                torch.sum(self.losses, dim=0, out=out)
            if self.average is not None:  # the mean over the replicas' loss ranks
                self.average(out)
        if ctx.num_ranks == 1:
            return out
        if ctx.device.type == "cuda":  # on device: it runs inside captured graphs
            dist.broadcast(out, src=ctx.global_ranks[ctx.loss_rank], group=ctx.group)
            return out
        self.faults.control("loss", lambda g: g.broadcast(out, ctx.loss_rank))
        return out
