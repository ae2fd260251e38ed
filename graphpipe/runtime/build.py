"""The construction of a ``Pipeline``, one function per step (docs/runtime.md, "Before the
first step: construction").

``Pipeline.__init__`` calls them in this order, inside ``Pipeline._tell_peers_on_failure``,
and keeps what they return; between them it marks the joins it takes (``_join_taken``,
``_joined``, ``_dp_join_taken``, ``_dp_joined``), which is what a failed construction tells
its peers.

1. ``resolve_rank``: the schedule and its placement, who this rank is (``RankContext``), the
   checks of the stages and of the groups' overlap.
2. ``stage_runner``: the ``StageRunner`` over this rank's stages.
3. ``lower_programs``: every rank's lowered steps and transfers, for training and inference.
4. ``agreement_config``, ``check_before_join``, ``join``: what every rank must agree on, the
   checks that need no peer, then the join (``PipelineGroups``).
5. ``engine_and_faults``: the ``CommEngine`` on those groups, ``Faults`` on the store.
6. ``compile_programs``: this rank's training and inference ``Program``.
7. ``gradient_parts``, ``data_parallel``, ``trailing_parts``, ``install_parts``: the parts
   that run inside the step, and their hooks installed in the programs.
8. ``call_machinery``: the batch agreement, the loss, the step loop and the capture driver.

Each function takes what it reads and returns what it builds (a part, a tuple of parts, or a
small record); none is given the pipeline, and none assigns a field of it.

Owns: nothing (the records it returns are the pipeline's). May touch: what each part's
construction touches (the process groups and the store at the joins, the stages' layers made
deferrable, the replicas' parameters broadcast by ``DataParallel``), the programs through
their ``install``.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from graphpipe.nvtx import Ranges
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.ir import Op, Placement, Schedule
from graphpipe.schedule.lower import Step, Transfer, forward_only, in_send_order, lower, transfers
from graphpipe.schedule.validate import resolve_schedule

from .capture import CaptureDriver
from .coordination.checks import (
    check_capture,
    check_capture_optimizer,
    check_disjoint_groups,
    check_expert_groups,
    check_stages,
    float_dtype,
    infer_device,
    loss_dtype,
    resolve_receives,
    seconds,
)
from .coordination.config import PipelineConfig, pipeline_config
from .coordination.faults import FaultNotices, Faults
from .coordination.groups import PipelineGroups
from .core.batch import BatchAgreement
from .core.comm import CommEngine
from .core.context import RankContext
from .core.loss import LossReducer
from .core.program import Program, StepHooks, compile_program
from .core.stage import StageRunner
from .core.step import StepLoop
from .options import ParallelGroups, PipelineOptions
from .parts.accumulation import GradSync
from .parts.clipping import GradClipper, check_clip_args
from .parts.data_parallel import DataParallel, check_stage_wrappers
from .parts.fsdp import ShardedStages, check_fsdp
from .parts.tied import TiedWeights

__all__ = [
    "Calls",
    "InStepParts",
    "Lowered",
    "Resolved",
    "agreement_config",
    "call_machinery",
    "check_before_join",
    "compile_programs",
    "data_parallel",
    "engine_and_faults",
    "gradient_parts",
    "install_parts",
    "join",
    "lower_programs",
    "resolve_rank",
    "stage_runner",
    "trailing_parts",
]


# --------------------------------------------------------------------------------------------
# 1. The schedule and this rank


@dataclass(frozen=True, eq=False)
class Resolved:
    """Step 1: the schedule this rank runs and who this rank is.

    context: the ``RankContext`` (its ``group`` is None without torch.distributed).
    distributed: torch.distributed is initialized (else one process, no group).
    nccl: the pipeline group's backend is NCCL.
    receives: when receives are posted, resolved for the backend (``checks.resolve_receives``).
    schedule / placement / schedule_name: the validated schedule (``resolve_schedule``).
    ranges: the range emitter of the step (NVTX and the torch profiler).
    check_labels: ``loss_fn.check_labels`` bound to M and the reduction (None: it has none).
    """

    context: RankContext
    distributed: bool
    nccl: bool
    receives: str
    schedule: Schedule
    placement: Placement
    schedule_name: str
    ranges: Ranges
    check_labels: Callable[..., Any] | None


def resolve_rank(
    stages: Sequence[nn.Module], options: PipelineOptions, parallel: ParallelGroups
) -> Resolved:
    """Step 1: the pipeline group (the world by default), the receives for its backend, the
    schedule and its placement, the checks of this rank's stages, the ``RankContext``, and
    ``check_disjoint_groups`` before any collective."""
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed and parallel.pp is not None:
        raise ValueError("group was given but torch.distributed is not initialized")
    group = parallel.pp if parallel.pp is not None or not distributed else dist.group.WORLD
    nccl = distributed and dist.get_backend(group) == "nccl"
    receives = resolve_receives(options.receives, nccl)
    rank = dist.get_rank(group) if distributed else 0
    n = dist.get_world_size(group) if distributed else 1
    m = options.num_microbatches
    schedule, placement, schedule_name = resolve_schedule(options.schedule, n, m)
    stage_ids = placement.stages_of(rank)
    check_stages(stages, stage_ids, rank, schedule_name)
    check_stage_wrappers(stages, stage_ids)  # DDP / FSDP stages: ValueError
    modules = tuple(stages)
    check = getattr(options.loss_fn, "check_labels", None)  # graphpipe.models.causal_lm_loss's
    check_labels = (
        functools.partial(check, num_microbatches=m, loss_reduction=options.loss_reduction)
        if callable(check)
        else None
    )
    ranges = Ranges(options.use_nvtx)
    device = infer_device(stages, group)
    ctx = RankContext(
        group=group if distributed else None,
        rank=rank,
        num_ranks=n,
        global_ranks=tuple(dist.get_global_rank(group, r) for r in range(n))
        if distributed
        else (0,),
        device=device,
        modules=modules,
        stage_ids=tuple(stage_ids),
        num_microbatches=m,
        input_rank=placement.rank_of(0),
        loss_rank=placement.rank_of(placement.last_stage),
    )
    if distributed:  # before any collective: an overlapping group would deadlock a step
        check_disjoint_groups(modules, ctx.global_ranks, rank, parallel.dp, parallel.experts)
    return Resolved(
        ctx, distributed, nccl, receives, schedule, placement, schedule_name, ranges, check_labels
    )


# --------------------------------------------------------------------------------------------
# 2. The stages


def stage_runner(resolved: Resolved, options: PipelineOptions) -> StageRunner:
    """Step 2: the ``StageRunner`` over this rank's modules (their ``nn.Linear`` layers made
    deferrable with ``defer_weight_grads``), told which micro-batches of each stage split
    their backward into ``I`` + ``W`` in this rank's schedule."""
    ctx = resolved.context
    split_flags = [[False] * ctx.num_microbatches for _ in ctx.stage_ids]
    local = {s: i for i, s in enumerate(ctx.stage_ids)}
    for cell in resolved.schedule[ctx.rank]:
        for part in cell.parts():
            if part.op is Op.I:
                split_flags[local[part.stage]][part.microbatch] = True
    return StageRunner(
        ctx.modules,
        ctx.stage_ids,
        resolved.placement.last_stage,
        ctx.num_microbatches,
        options.loss_fn,
        ctx.device,
        split_flags,
        options.defer_weight_grads,
    )


# --------------------------------------------------------------------------------------------
# 3. The programs


@dataclass(frozen=True, eq=False)
class Lowered:
    """Step 3: every rank's lowered steps and their transfers.

    train / infer: ``{rank: [Step, ...]}`` of the schedule and of its forward-only one.
    train_transfers / infer_transfers: their transfers, per directed rank pair in order.
    edges: the directed rank pairs the training step sends over.
    """

    train: dict[int, list[Step]]
    infer: dict[int, list[Step]]
    train_transfers: list[Transfer]
    infer_transfers: list[Transfer]
    edges: set[tuple[int, int]]


def lower_programs(resolved: Resolved, costs: Costs | None) -> Lowered:
    """Step 3: ``lower.lower`` of the schedule (its receives timed with ``costs`` under
    ``receives="timed"``) and of the forward-only schedule, and their transfers."""
    durations = costs.of if costs is not None else None
    latency = costs.p2p if costs is not None else 0.0
    schedule, placement, receives = resolved.schedule, resolved.placement, resolved.receives
    lowered = lower(schedule, placement, durations=durations, latency=latency, receives=receives)
    infer_lowered = lower(forward_only(schedule), placement, receives=receives)
    if receives == "plain":  # each rank pair one FIFO, as the transfers need
        lowered = in_send_order(lowered, placement)
        infer_lowered = in_send_order(infer_lowered, placement)
    train_transfers = transfers(lowered, placement)
    infer_transfers = transfers(infer_lowered, placement)
    edges = {(t.src, t.dst) for t in train_transfers}
    return Lowered(lowered, infer_lowered, train_transfers, infer_transfers, edges)


# --------------------------------------------------------------------------------------------
# 4. Agreement on the configuration, the checks before the join, the join


def agreement_config(
    resolved: Resolved, options: PipelineOptions, parallel: ParallelGroups
) -> PipelineConfig | None:
    """Step 4: what every rank must agree on, joined in the store before any group is built
    (coordination/config.py: a mismatch or a rank that does not come raises on every rank).
    Without torch.distributed there is nothing to agree on (and dp_group is refused): None."""
    if not resolved.distributed:
        return None
    per_edge_groups = options.per_edge_groups
    return pipeline_config(
        schedule_name=resolved.schedule_name,
        schedule=resolved.schedule,
        placement=resolved.placement,
        num_microbatches=options.num_microbatches,
        receives=resolved.receives,
        per_edge_groups=resolved.nccl if per_edge_groups is None else per_edge_groups,
        capture=options.capture_mode,
        loss_reduction=options.loss_reduction,
        dp_group=parallel.dp,
        expert_groups=parallel.experts,
        clip_grad_norm=options.clip_grad_norm,
        clip_norm_type=options.clip_norm_type,
        costs=options.costs,
    )


def check_before_join(
    resolved: Resolved,
    options: PipelineOptions,
    parallel: ParallelGroups,
    stages: Sequence[nn.Module],
) -> Any:
    """Step 4: every check that needs no peer runs before the join: a rank that refuses tells
    the others there (``Pipeline._tell_peers_on_failure``), and none of them enters a collective
    without it. In this order: the expert groups, FSDP2 stages, ``capture_optimizer``, the
    capture on this device and backend, the clipping arguments. Returns the checked expert
    groups (``checks.check_expert_groups``)."""
    ctx, capture = resolved.context, options.capture_mode
    expert_groups = check_expert_groups(ctx.modules, parallel.experts)
    check_fsdp(ctx.modules, capture, parallel.dp)
    check_capture_optimizer(options.capture_optimizer, options.capture, ctx.device)
    check_capture(capture, ctx.device, resolved.nccl, ctx.num_ranks, resolved.receives, stages)
    if options.clip_grad_norm is not None:
        check_clip_args(options.clip_grad_norm, options.clip_norm_type)
    return expert_groups


def join(
    resolved: Resolved, lowered: Lowered, options: PipelineOptions, config: PipelineConfig | None
) -> PipelineGroups:
    """Step 4: the join: ``PipelineGroups`` takes the pipeline's key in the store, joins every
    rank with ``config`` and builds the process groups (``timeout`` is checked here, after
    the key is taken)."""
    return PipelineGroups(
        resolved.context.group,
        lowered.edges,
        options.per_edge_groups,
        datetime.timedelta(seconds=seconds(options.timeout)),
        config,
    )


# --------------------------------------------------------------------------------------------
# 5. Communication and faults; 6. compile


def engine_and_faults(
    resolved: Resolved, runner: StageRunner, groups: PipelineGroups
) -> tuple[CommEngine, Faults]:
    """Step 5: the ``CommEngine`` on the joined groups (staged on NCCL over several ranks),
    and ``Faults`` with its notices on the store."""
    ctx = resolved.context
    staged = groups.nccl and ctx.num_ranks > 1
    engine = CommEngine(runner, ctx.rank, groups, ctx.device, resolved.ranges, staged=staged)
    faults = Faults(FaultNotices(groups.store, groups.key, ctx.rank), groups, ctx.rank)
    return engine, faults


def compile_programs(
    resolved: Resolved, lowered: Lowered, runner: StageRunner, engine: CommEngine
) -> tuple[Program, Program]:
    """Step 6: this rank's steps bound to the runner's handlers and the engine's transfers,
    once for training and once for inference: ``(program, infer)``."""
    rank, placement = resolved.context.rank, resolved.placement
    program = compile_program(
        lowered.train[rank], lowered.train_transfers, placement, rank, runner, engine
    )
    infer = compile_program(
        lowered.infer[rank], lowered.infer_transfers, placement, rank, runner, engine
    )
    return program, infer


# --------------------------------------------------------------------------------------------
# 7. Parts that run inside the training step as instructions of its program


InStepParts = tuple[GradSync, DataParallel | None, ShardedStages, TiedWeights, GradClipper]
"""The parts that run inside the training step, in ``Program.install``'s order: ``(grad_sync,
data_parallel, fsdp, tied, clipper)``."""


def gradient_parts(resolved: Resolved, options: PipelineOptions) -> tuple[GradSync, ShardedStages]:
    """Step 7: accumulation across calls and FSDP2's stages: ``(grad_sync, fsdp)``."""
    ctx = resolved.context
    # Accumulation across calls, no_sync: the window is the parameters' (shared with
    # any other pipeline over them), so the part is given them.
    grad_sync = GradSync(ctx.parameters())
    return grad_sync, ShardedStages(ctx, options.loss_reduction, grad_sync)


def data_parallel(
    resolved: Resolved,
    program: Program,
    faults: Faults,
    options: PipelineOptions,
    parallel: ParallelGroups,
    grad_sync: GradSync,
    fsdp: ShardedStages,
) -> DataParallel | None:
    """Step 7: with a ``dp`` group, ``DataParallel``, which first joins its group's setup in
    the store and broadcasts the first replica's parameters (None without one)."""
    if parallel.dp is None:
        return None
    ctx = resolved.context
    return DataParallel(
        ctx,
        program.grads_final(ctx.stage_ids),
        resolved.ranges,
        faults,
        parallel.dp,
        expert_groups=parallel.experts,
        loss_reduction=options.loss_reduction,
        managed=fsdp.managed,
        grad_sync=grad_sync,
    )


def trailing_parts(
    resolved: Resolved, expert_groups: Any, grad_sync: GradSync
) -> tuple[TiedWeights, GradClipper]:
    """Step 7: the parts that trail the step: the sum of the weights tied across ranks, and
    the clipper (given the checked expert groups, and the tied copies that another rank
    counts): ``(tied, clipper)``."""
    tied = TiedWeights(resolved.context, grad_sync)
    return tied, GradClipper(resolved.context, expert_groups, tied.counted_elsewhere)


def install_parts(
    program: Program, infer: Program, options: PipelineOptions, parts: InStepParts
) -> None:
    """Step 7: the parts' hooks installed in the training ``program`` and the ``infer`` one."""
    grad_sync, dp, fsdp, tied, clipper = parts
    # Where two parts run at one point of the step, in this order: the division of
    # earlier calls' gradients first; after a stage's last gradient the dp reductions
    # posted, then FSDP2's reduce-scatter; trailing, the wait for the dp reductions,
    # the sum of tied copies, the clipping (of the reduced gradients).
    clip, norm_type = options.clip_grad_norm, options.clip_norm_type
    program.install(
        grad_sync.step_hooks(),
        dp.step_hooks() if dp else StepHooks(),
        fsdp.step_hooks(),
        tied.step_hooks(),
        clipper.in_step(clip, norm_type, grad_sync, options.capture_mode is not None)
        if clip is not None
        else StepHooks(),
    )
    infer.install(fsdp.infer_hooks())


# --------------------------------------------------------------------------------------------
# 8. The call's machinery


@dataclass(frozen=True, eq=False)
class Calls:
    """Step 8: what runs a call.

    agreement: the ``BatchAgreement`` of each call's batch.
    loss_dtype: the loss rank's loss dtype (``checks.loss_dtype``).
    loss: the ``LossReducer`` (given the data-parallel loss average).
    loop: the ``StepLoop``.
    capture: the ``CaptureDriver`` (None: an eager pipeline).
    """

    agreement: BatchAgreement
    loss_dtype: Any
    loss: LossReducer
    loop: StepLoop
    capture: CaptureDriver | None


def call_machinery(
    resolved: Resolved,
    options: PipelineOptions,
    runner: StageRunner,
    groups: PipelineGroups,
    engine: CommEngine,
    faults: Faults,
    program: Program,
    parts: InStepParts,
) -> Calls:
    """Step 8: ``BatchAgreement``, ``LossReducer`` (given the data-parallel loss average),
    ``StepLoop`` and, with capture, ``CaptureDriver``."""
    grad_sync, dp = parts[0], parts[1]
    ctx, capture = resolved.context, options.capture_mode
    agreement = BatchAgreement(
        groups,
        ctx.rank,
        ctx.num_ranks,
        ctx.input_rank,
        ctx.loss_rank,
        ctx.num_microbatches,
        float_dtype(ctx.modules[0]),
        replicas=dp.agree if dp is not None and dp.agrees else None,
        refuse=grad_sync.check_captured if capture else None,
    )
    dtype = loss_dtype(ctx.modules)
    average = dp.average_loss if dp else None
    loss = LossReducer(ctx, runner, faults, options.loss_reduction, average=average)
    optimizer = options.capture_optimizer
    loop = StepLoop(ctx, runner, engine, loss, faults, resolved.ranges, groups.nccl, optimizer)
    # Only a captured pipeline has a capture driver: eager steps run the loop directly.
    driver = (
        CaptureDriver(ctx, loop, program, runner, engine, loss, capture, options.recapture)
        if capture
        else None
    )
    return Calls(agreement, dtype, loss, loop, driver)
