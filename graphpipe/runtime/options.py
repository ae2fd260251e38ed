"""What a ``Pipeline`` is asked for, as records: its choices (``PipelineOptions``) and the
process groups it runs over (``ParallelGroups``).

``Pipeline(...)``'s keywords are a thin front over these two: the constructor packs them here,
and the construction steps (``build``) read them. ``PipelineOptions`` checks its own fields
when it is made (``__post_init__``: the checks that need neither a device nor a peer, the
first that any construction runs); what needs the device, the backend or the stages is
checked later, in ``build``, in a fixed order (which error a bad combination raises first
is part of the behaviour: the tests hold it).

Owns: nothing (records). May touch: nothing (the values it is given, read-only).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.schedule.costs import Costs
from graphpipe.schedule.ir import Action

from .coordination.checks import CAPTURE_MODES, check_arguments

__all__ = ["ParallelGroups", "PipelineOptions"]


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """The pipeline's choices (``Pipeline``'s docstring has each in full).

    schedule: ``"dualpipev"`` (default), ``"zbv"``, ``"1f1b"``, or a compute-only schedule
        ``{rank: [Action, ...]}``; its placement follows from which rank runs which stage.
    num_microbatches: M; each batch is split on dim 0 into M equal parts.
    loss_fn: ``loss_fn(output, labels) -> 0-dim tensor``, run after the last stage.
    use_nvtx: emit NVTX ranges (None: when CUDA is available).
    per_edge_groups: one process group per directed rank pair for P2P (None: on NCCL only).
    capture: ``False``, ``True`` / ``"step"`` (one graph per step) or ``"action"`` (one graph
        per compute action); ``capture_mode`` is the mode it names (None: eager).
    recapture: with capture, a batch of a new signature captures a new graph instead of
        raising.
    capture_optimizer: with capture, the optimizer whose step runs inside the step.
    costs: the expected action costs, which time the receives with ``receives="timed"``
        (None: F=1, B=2, I=1, W=1).
    receives: when each receive is posted: ``"start"``, ``"timed"`` or ``"plain"`` (None: by
        the backend, ``"start"`` on gloo and ``"timed"`` on NCCL).
    timeout: seconds (or a ``timedelta``) a rank waits for a silent peer.
    defer_weight_grads: make the stages' ``nn.Linear`` layers deferrable (``W`` actions).
    clip_grad_norm: clip the gradients to this global norm inside every step (None: no).
    clip_norm_type: that norm's p (``float("inf")``: the max norm).
    loss_reduction: ``"mean"`` or ``"sum"`` of the micro-batch losses (and over replicas).

    ``__post_init__`` runs ``checks.check_arguments`` (M, ``loss_fn``, ``capture``,
    ``loss_reduction``): the first check of every construction. The clipping arguments are
    checked later, after the checks of the schedule, the stages and the capture
    (``build.check_before_join``), so that an argument list with several faults raises the
    same error first as it always has; ``timeout`` is read at the join (``build.join``).
    """

    schedule: str | Mapping[int, Sequence[Action]] = "dualpipev"
    num_microbatches: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    use_nvtx: bool | None = None
    per_edge_groups: bool | None = None
    capture: bool | str = False
    recapture: bool = False
    capture_optimizer: torch.optim.Optimizer | None = None
    costs: Costs | None = None
    receives: str | None = None
    timeout: float | datetime.timedelta = 300.0
    defer_weight_grads: bool = True
    clip_grad_norm: float | None = None
    clip_norm_type: float = 2.0
    loss_reduction: str = "mean"

    def __post_init__(self) -> None:
        check_arguments(self.num_microbatches, self.loss_fn, self.capture, self.loss_reduction)

    @property
    def capture_mode(self) -> str | None:
        """The capture mode ``capture`` names: None (eager), ``"step"`` or ``"action"``."""
        return CAPTURE_MODES[self.capture]


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups a pipeline runs over, one per kind of parallelism around it.

    pp: the pipeline group (``Pipeline``'s ``group``; None: the world, or no group for one
        process without torch.distributed).
    dp: the data-parallel group (``dp_group``): the ranks that run this rank's stages in the
        other replicas (None: one replica).
    experts: the expert groups of sharded mixture-of-experts stages (``expert_groups``:
        ``graphpipe.models.expert_parallel_groups(ep, dp_group)``, an ``(ep_group,
        expert_dp_group)`` pair; None: no sharded experts).

    Context parallelism, when the runtime learns it, goes here as its own group (``cp``: the
    ranks that share one sequence), beside ``dp``; tensor parallelism needs none here, as its
    groups ride on the stages' DTensor meshes.
    """

    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    experts: Any = None
