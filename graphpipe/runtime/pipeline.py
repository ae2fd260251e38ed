"""The public facade: ``Pipeline`` (any schedule) and ``DualPipeV`` (the default one).

A ``Pipeline`` packs its keywords into ``options``' records and builds the parts through
``build``'s steps, handing each the collaborators it uses, never itself: the schedule and
its placement (``schedule.validate``), the rank's context (``context``), the lowered program of this
rank (``lower`` + ``program``), the stage runner (``stage``), the communication engine
(``comm``) on its process groups (``groups``), the loss (``loss``), the step loop
(``step``), the batch agreement (``batch``), the capture driver (``capture``) and the parts
that run inside the step (``data_parallel``, ``clipping``). What it does itself is a call's
frame: the user-facing checks, the batch agreement, and what a failure does.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.meta import StepRecord
from graphpipe.nvtx import Ranges
from graphpipe.schedule.costs import Costs
from graphpipe.schedule.ir import Action
from graphpipe.weightgrad import WeightGradStore

from . import build
from .capture import StaticPlan
from .coordination.faults import CommFailure, construction_told, hold_construction
from .coordination.groups import refuse_to_join, taken_key
from .coordination.lifetime import HOLD_S, keep_through_exit
from .coordination.store import JobStore
from .core.batch import BatchSignature
from .options import ParallelGroups, PipelineOptions
from .parts.data_parallel import refuse_setup, setup_key

__all__ = ["DualPipeV", "Pipeline", "clip_grad_norm_"]


class Pipeline:
    """Pipeline-parallel training of one rank's stages under any schedule, over
    ``torch.distributed``.

    Args:
        stages: this rank's stage modules, in ascending stage order (for DualPipeV and ZB-V
            ``(stage r, stage 2N-1-r)``; for 1F1B ``(stage r,)``).
        schedule: ``"dualpipev"`` (default), ``"zbv"``, ``"1f1b"``, or a compute-only
            schedule ``{rank: [Action, ...]}`` (``schedule.ir.load_csv`` reads torch's CSV);
            its placement follows from which rank runs which stage.
        num_microbatches: M; each batch is split on dim 0 into M equal parts.
        loss_fn: ``loss_fn(output, labels) -> 0-dim tensor``, run after the last stage.
        group: the pipeline process group (default: the world; none needed for one rank).
        use_nvtx: emit NVTX ranges (default: when CUDA is available). Ranges also go to the
            torch profiler whenever one records.
        per_edge_groups: one process group per directed rank pair for P2P (default: on NCCL
            only); all ranks must pass the same value.
        capture: capture the training step. ``True`` or ``"step"``: on CUDA one graph per
            rank per step; ``"action"``: one CUDA graph per compute action, replayed in its
            range, the P2P between them. On CPU the graphs are CPU graphs, with CUDA
            graphs' semantics (docs/capture.md). Step 1 runs eagerly and records
            metadata, step 2 captures, later steps replay; with NCCL over several ranks
            step 2 runs the static step eagerly with the real transfers (warming every
            communicator) and step 3 captures.
        recapture: with capture, a batch of another shape or dtype captures a new graph for
            that signature instead of raising ``ValueError``.
        capture_optimizer: with capture, an optimizer over this rank's parameters whose step
            runs inside the step (in the graph on CUDA; it must be ``capturable=True`` there).
            Each step then zeroes the gradients in place first and steps the optimizer last.
        receives: when each receive is posted. ``"start"``: every receive of the step at its
            start (the default on gloo, where a send that comes before its receive waits for
            a hop through the sender's device thread, which waits for a core on a busy CPU:
            docs/benchmarks.md; each incoming buffer then lives from the start of the step).
            ``"timed"``: each just before its data is sent in the dataflow timing with
            ``costs`` (the default on NCCL: receive buffers live shorter). ``"plain"``: each
            in the batch of the compute that reads it (``schedule.lower``'s plain rule), or
            earlier where its rank pair's send order needs it (``lower.in_send_order``).
        costs: the expected action costs (``graphpipe.schedule.simulate.Costs``); with
            ``receives="timed"`` the lowering times the receives with them. Default: F=1,
            B=2, I=1, W=1.
        dp_group: the data-parallel group: the ranks that run this rank's stages in the other
            replicas (``mesh.get_group("dp")`` of a ``("dp", "pp")`` DeviceMesh, with
            ``group=mesh.get_group("pp")``). Each stage's gradients are averaged over it as
            soon as its last W (or B) of the step has run, and the loss is the mean over the
            replicas (``runtime/parts/data_parallel.py``). The replicas start from the first one's
            parameters (broadcast here).
        defer_weight_grads: switch the stages' ``nn.Linear`` layers (and subclasses that keep
            its ``forward``) to the deferrable one (default True); False computes every
            weight gradient during ``I`` (``W`` is then empty). A Linear-like layer that
            cannot defer warns at construction, naming it; ``graphpipe.no_defer(module)``
            opts out one module. ``pipe.num_deferrable``: a tuple, one entry per stage in
            the order of ``stages``, of the layers that defer (0: that stage's ``W`` does
            nothing). A stage with deferrable layers whose ``W`` actions found no work in the
            first step (a compiled stage with DTensor weights) is named in a warning then.
        clip_grad_norm: clip the gradients to this global norm at the end of every training
            step (``graphpipe.clip_grad_norm_``, after the data-parallel averaging, inside the
            captured step); the norm is then ``pipe.grad_norm``.
        clip_norm_type: the norm's p (default 2.0; ``float("inf")`` for the max norm).
        expert_groups: for stages with mixture-of-experts layers whose experts are sharded
            (``graphpipe.models.expert_parallel_groups(ep, dp_group)``): expert parameters
            are averaged over its ``expert_dp_group`` instead of ``dp_group``, and a clipped
            norm adds the experts of its ``ep_group``. Required with ``dp_group`` when the
            stages hold expert parameters, and whenever their experts are sharded.
        timeout: seconds (or a ``timedelta``) a rank waits for a silent peer before it raises
            ``PipelineError`` naming it (a failing or killed peer is reported at once).
        loss_reduction: ``"mean"`` (default): the step's loss is the mean of the micro-batch
            losses (backward seed ``1 / M``), and the mean over the replicas with
            ``dp_group`` (gradients averaged). ``"sum"``: their sum (seed 1; gradients summed
            over the replicas), for a token-weighted ``loss_fn`` that returns a micro-batch's
            summed token losses divided by the global number of valid tokens: the loss and
            gradients are then those of one process on the whole batch, padding and unequal
            valid tokens per micro-batch included.

    A failure on any rank ends the call on every rank: the failing rank raises its own
    exception (with a note naming the action), the others ``graphpipe.PipelineError`` naming
    the failing rank, its action and its error; the next call works again (or, when a peer is
    gone, raises ``PipelineClosed``). Gradients may then hold partial sums: zero them.

    ``step(inputs, labels)`` runs one training step and returns on every rank the mean over
    micro-batches of ``loss_fn`` (0-dim), accumulating into ``.grad`` the gradients of that
    mean. ``inputs`` are needed on the rank that runs stage 0, ``labels`` on the one that runs
    the last stage (both rank 0 for V schedules); other ranks pass ``None``.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        schedule: str | Mapping[int, Sequence[Action]] = "dualpipev",
        num_microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        group: dist.ProcessGroup | None = None,
        use_nvtx: bool | None = None,
        per_edge_groups: bool | None = None,
        capture: bool | str = False,
        recapture: bool = False,
        capture_optimizer: torch.optim.Optimizer | None = None,
        costs: Costs | None = None,
        receives: str | None = None,
        timeout: float | datetime.timedelta = 300.0,
        dp_group: dist.ProcessGroup | None = None,
        defer_weight_grads: bool = True,
        clip_grad_norm: float | None = None,
        clip_norm_type: float = 2.0,
        expert_groups: Any = None,
        loss_reduction: str = "mean",
    ) -> None:
        self._join_taken = self._dp_join_taken = False  # this rank took the join's key
        self._joined = self._dp_joined = False  # and passed the join (and what follows it)
        with self._tell_peers_on_failure(group, dp_group):  # a failure here is told at their joins
            options = PipelineOptions(  # checks M, loss_fn, capture, loss_reduction first
                schedule=schedule,
                num_microbatches=num_microbatches,
                loss_fn=loss_fn,
                use_nvtx=use_nvtx,
                per_edge_groups=per_edge_groups,
                capture=capture,
                recapture=recapture,
                capture_optimizer=capture_optimizer,
                costs=costs,
                receives=receives,
                timeout=timeout,
                defer_weight_grads=defer_weight_grads,
                clip_grad_norm=clip_grad_norm,
                clip_norm_type=clip_norm_type,
                loss_reduction=loss_reduction,
            )
            parallel = ParallelGroups(pp=group, dp=dp_group, experts=expert_groups)
            self.loss_fn, self.loss_reduction = loss_fn, loss_reduction
            # The steps of docs/runtime.md's construction, in order (runtime/build.py).
            res = build.resolve_rank(stages, options, parallel)  # 1. schedule, this rank
            self.context, self.receives, self._ranges = res.context, res.receives, res.ranges
            self.schedule, self.placement = res.schedule, res.placement
            self.schedule_name, self._check_labels = res.schedule_name, res.check_labels
            self.runner = runner = build.stage_runner(res, options)  # 2. the stages
            lowered = build.lower_programs(res, options.costs)  # 3. the programs
            config = build.agreement_config(res, options, parallel)  # 4. the agreement
            self.expert_groups = build.check_before_join(res, options, parallel, stages)
            self._join_taken = True  # PipelineGroups takes the pipeline's key and joins
            self.groups = groups = build.join(res, lowered, options, config)
            self._joined = True
            self.engine, self._faults = build.engine_and_faults(res, runner, groups)  # 5, 6.
            self.program, self._infer = build.compile_programs(res, lowered, runner, self.engine)
            self.capture = options.capture_mode  # 7. the parts inside the step
            self.grad_sync, self.fsdp = build.gradient_parts(res, options)
            self._dp_join_taken = True  # DataParallel joins its group's setup first
            self.data_parallel = build.data_parallel(
                res, self.program, self._faults, options, parallel, self.grad_sync, self.fsdp
            )
            self._dp_joined = True
            self.tied, self._clipper = build.trailing_parts(res, self.expert_groups, self.grad_sync)
            self._clips = clip_grad_norm is not None
            self._deferral_checked = False  # _check_deferral after the first step
            parts = self.grad_sync, self.data_parallel, self.fsdp, self.tied, self._clipper
            build.install_parts(self.program, self._infer, options, parts)
            c = build.call_machinery(  # 8. the call's machinery
                res, options, runner, groups, self.engine, self._faults, self.program, parts
            )
            self._agreement, self._loss_dtype, self.loss = c.agreement, c.loss_dtype, c.loss
            self._loop, self._capture, self.optimizer = c.loop, c.capture, capture_optimizer
            keep_through_exit(self)  # coordination/lifetime.py: closed, released at exit, no abort

    @contextlib.contextmanager
    def _tell_peers_on_failure(self, group: Any, dp_group: Any) -> Iterator[None]:
        """Construction: when it fails on this rank, the joins it has not taken yet (the
        pipeline's, the data-parallel setup's) say so, naming the error, so that no peer
        waits in one for the timeout or goes on to a collective this rank never enters.
        And the peers must be able to read it: see ``_told_at_exit``."""
        try:
            yield
        except Exception as e:
            if dist.is_available() and dist.is_initialized():
                with contextlib.suppress(Exception):  # never hide this rank's own error
                    self._tell_peers(group if group is not None else dist.group.WORLD, dp_group, e)
            raise

    def _tell_peers(self, group: Any, dp_group: Any, e: Exception) -> None:
        """The joins this failed construction took part in (``_tell_peers_on_failure``):
        refused where not taken yet, and told at exit (``_told_at_exit``)."""
        joins = []  # (key, members, this rank failed at or before it)
        if self._join_taken:
            key = taken_key(dist.get_process_group_ranks(group))
        else:
            key = refuse_to_join(group, e)
        joins.append((key, dist.get_world_size(group), not self._joined))
        if dp_group is not None:
            key = setup_key(dp_group) if self._dp_join_taken else refuse_setup(dp_group, e)
            joins.append((key, dist.get_world_size(dp_group), not self._dp_joined))
        self._told_at_exit(joins)

    @staticmethod
    def _told_at_exit(joins: list[tuple[str | None, int, bool]]) -> None:
        """A failed construction: this rank counts itself told at each join it took part in
        (``faults.construction_told``). When this process serves the job's store (global
        rank 0 of an ``env://`` job) and failed at or before a join, its exit waits until
        every member of that join is told, at most ``lifetime.HOLD_S`` (a member that comes
        late may come any time after the timeout), so that it reads why here instead of
        that the store is gone (``lifetime.hold_store``, as after a failed step)."""
        try:
            store = JobStore(dist.distributed_c10d._get_default_store())
            host = store.hosted_here()
        except Exception:  # no store to hold: the members find that out themselves
            return
        for key, members, before in joins:
            if key is None or members < 2:
                continue
            construction_told(store, key)
            if host and before:
                hold_construction(store, key, members, HOLD_S)

    # ------------------------------------------------------------------ this rank
    # Who this rank is: read off its RankContext (and its stage runner), never assigned.
    @property
    def group(self) -> dist.ProcessGroup | None:
        """The pipeline process group (None: one process without torch.distributed)."""
        return self.context.group

    @property
    def rank(self) -> int:
        """This rank in the pipeline group."""
        return self.context.rank

    @property
    def num_ranks(self) -> int:
        """The number of pipeline ranks."""
        return self.context.num_ranks

    @property
    def device(self) -> torch.device:
        """Where this rank computes."""
        return self.context.device

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """This rank's stage modules, in ascending stage order."""
        return self.context.modules

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """This rank's stages, ascending."""
        return self.context.stage_ids

    @property
    def num_microbatches(self) -> int:
        """M: the micro-batches of each batch."""
        return self.context.num_microbatches

    @property
    def input_rank(self) -> int:
        """The rank that runs stage 0 (and takes the inputs)."""
        return self.context.input_rank

    @property
    def loss_rank(self) -> int:
        """The rank that runs the last stage (and takes the labels)."""
        return self.context.loss_rank

    @property
    def is_input_rank(self) -> bool:
        """This rank runs stage 0."""
        return self.context.is_input_rank

    @property
    def is_loss_rank(self) -> bool:
        """This rank runs the last stage."""
        return self.context.is_loss_rank

    @property
    def last_stage(self) -> int:
        """The stage that computes the loss."""
        return self.placement.last_stage

    @property
    def stores(self) -> tuple[WeightGradStore, ...]:
        """The weight-gradient store of each local stage (``graphpipe.weightgrad``)."""
        return self.runner.stores

    @property
    def num_deferrable(self) -> tuple[int, ...]:
        """Per local stage, in the order of ``stages``, the layers that defer their weight
        gradient to ``W`` (0: that stage's ``W`` does nothing)."""
        return self.runner.num_deferrable

    # ------------------------------------------------------------------ steps
    def step(
        self, inputs: Any, labels: Any, /, *, scaler: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        """Run one training step; returns the mean loss (0-dim) on every rank.

        ``inputs``: on the rank running stage 0, ``labels``: on the rank running the last
        stage (a tensor or tuple of tensors, split on dim 0); ``None`` elsewhere. ``scaler``:
        an optional ``torch.amp.GradScaler``; the backward seed is scaled by it (call
        ``unscale_`` before ``scaler.step``).

        ``kwargs``: keyword tensors (a tensor or a tuple of tensors each), given on every
        rank with the same names and shapes, split on dim 0 into the micro-batches like the
        inputs and passed to every stage whose ``forward`` takes that keyword (or
        ``**kwargs``), and to ``loss_fn`` when it takes it: a mask or position ids reach every
        stage without crossing the pipeline. A keyword that nothing takes is an error, and so
        is one whose rows differ from the inputs'. ``inputs`` and ``labels`` are positional,
        so keyword tensors may take those names; ``scaler`` is this method's own (a tensor
        passed as ``scaler`` is refused).

        Gradients accumulate across calls: each call adds its own gradients to ``.grad``
        (the reductions across ranks count an earlier call's gradients once); inside
        ``no_sync()`` the reductions wait for the first call after it.

        With ``capture``, the returned loss of a replayed step is the static loss tensor: it
        aliases graph memory and is overwritten by the next step (clone it to keep it).
        """
        refused = self._refused(scaler)  # raised through the agreement: on every rank
        sig, dtype = self._agree(inputs, labels, kwargs, True, refused)
        with self._guard():
            if self._capture is not None:
                self.loss.ensure(dtype, frozen=bool(self._capture.captures))
                loss = self._capture.step(sig, inputs, labels, kwargs)
            else:
                self.loss.ensure(dtype)
                loss = self._loop.train(self.program, sig, inputs, labels, kwargs, scaler).clone()
            self.grad_sync.end()
        if not self._deferral_checked:
            self._check_deferral()
        return loss

    def _check_deferral(self) -> None:
        """After the first step: warn about stages whose W actions found nothing to do."""
        self._deferral_checked = True
        idle = self.runner.idle_weight_stages()
        if idle:
            warnings.warn(
                f"graphpipe: stage(s) {idle} deferred no weight gradient in the first step: "
                "their W actions had nothing to do and every weight gradient was computed "
                "during I (known cause: a torch.compile'd stage whose Linear weights are "
                "DTensors, as with tensor parallelism; graphpipe's compiled weight-gradient "
                "op has no DTensor rule). Run such a stage uncompiled to defer, or build the "
                "pipeline with defer_weight_grads=False to say that you do not.",
                UserWarning,
                stacklevel=3,
            )

    def _refused(self, scaler: Any) -> Exception | None:
        """What ``step()`` refuses before looking at the batch (None: nothing)."""
        if not torch.is_grad_enabled():
            return RuntimeError("Pipeline.step needs grad mode; use forward() for inference")
        if isinstance(scaler, torch.Tensor):
            return ValueError(
                "scaler= is step()'s GradScaler parameter, and a tensor was passed: a keyword "
                "tensor cannot be named 'scaler' (nor take the name of another parameter of "
                "step); rename the stage's (or loss_fn's) forward parameter"
            )
        if self.capture and scaler is not None:
            return ValueError("a GradScaler cannot be used with capture; pass scaler=None")
        if scaler is not None and self._clips:
            return ValueError(
                "clip_grad_norm clips inside the step, before a GradScaler could unscale: "
                "build the pipeline without it and call graphpipe.clip_grad_norm_ after "
                "pipe.unscale_(scaler, optimizer)"
            )
        return None

    def _agree(
        self,
        inputs: Any,
        labels: Any,
        kwargs: dict[str, Any],
        train: bool,
        refused: Exception | None = None,
    ) -> tuple[BatchSignature, Any]:
        """Start a call and agree on its batch (a rejected batch raises on every rank)."""
        faults = self._faults
        faults.begin("step" if train else "forward")
        faults.doing("batch agreement")
        try:
            return self._agreement.agree(
                inputs,
                labels,
                kwargs,
                train,
                self._loss_dtype,
                faults.call,
                self.device.type,
                self._keyword_mask,
                self.grad_sync.sync,
                self._check_labels,
                refused,
            )
        except CommFailure as f:
            raise faults.error_for_comm_failure(f) from f

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Failures inside a call: reset this rank's step state and tell every rank."""
        try:
            yield
        except BaseException as e:
            self._reset()
            error = self._faults.failure(e)  # e itself (published), or a PipelineError
            try:
                if error is e:
                    raise
                raise error from e
            finally:  # this frame is in error's traceback: holding error would be a cycle
                del error

    def _reset(self) -> None:
        """Forget a failed call's state: micro-batches, posted P2P, metadata, plan binding."""
        self.grad_sync.reset()
        self.runner.drop_state()
        self.engine.abandon()
        self._loop.forget()
        if self._capture is not None:
            self._capture.drop_graphs()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without the cross-rank reductions, like
        ``DistributedDataParallel.no_sync``: the steps inside skip the data-parallel
        all-reduce (and FSDP2's reduce-scatter, the expert data-parallel sum), the sum of
        weights tied across ranks and the in-step clipping; each rank's ``.grad`` holds its
        own unreduced sum. The first step after the block reduces everything the block
        accumulated, so ``.grad`` then equals the reducing path's (``k`` calls, each
        reducing), also when that step is another pipeline's over the same parameters (the
        window is the parameters', ``runtime/parts/accumulation.py``). Every rank of the pipeline
        and every replica must call its steps inside the block together (the pipeline's
        ranks check it, ``ValueError`` otherwise; the replicas too, ``PipelineError``).
        Refused with ``capture`` (the captured step reduces)."""
        if self.capture:
            raise ValueError(
                f"no_sync() with capture={self.capture!r}: the captured step always reduces "
                "its gradients; build the pipeline without capture to accumulate unreduced"
            )
        if not self.grad_sync.sync:
            raise RuntimeError("no_sync() is already active on this pipeline")
        with self.grad_sync.paused():
            yield

    def _keyword_mask(self, names: tuple[str, ...]) -> int:
        return self.runner.keyword_routes(names).mask

    @torch.no_grad()
    def forward(self, inputs: Any, /, **kwargs: Any) -> Any:
        """Forward only (no autograd state kept): the concatenated outputs on the rank that
        runs the last stage, ``None`` elsewhere. Always eager, also on a captured pipeline.
        ``kwargs``: keyword tensors, as for ``step``."""
        sig, _ = self._agree(inputs, None, kwargs, False)
        with self._guard():
            return self._loop.infer(self._infer, sig, inputs, kwargs)

    def unscale_(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.unscale_(optimizer)`` plus agreement on inf/NaN across the pipeline ranks.

        Every rank must skip (or take) the optimizer step together; call this, then
        ``scaler.step(optimizer)`` and ``scaler.update()`` on every rank.
        """
        scaler.unscale_(optimizer)
        if self.num_ranks > 1:
            # GradScaler keeps what unscale_ found per device in this dict, with no public
            # accessor; step() reads it from there.
            state = scaler._per_optimizer_states[id(optimizer)]
            with self._faults.outside("unscale_"):  # a failed all-reduce: PipelineError
                for t in state["found_inf_per_device"].values():
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    @property
    def ranges(self) -> Ranges:
        """The range emitter of the step, its actions and its waits (NVTX and the torch
        profiler); assign a ``Ranges`` (a subclass that records, say) to stand in for it."""
        return self._ranges

    @ranges.setter
    def ranges(self, value: Ranges) -> None:
        self._ranges = value
        for part in (self._loop, self.engine, self.data_parallel):
            if part is not None:
                part.set_ranges(value)

    # ------------------------------------------------------------- the model
    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once (a weight tied between two local
        stages is one Parameter): what an optimizer of this rank takes."""
        return self.context.parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``graphpipe.clip_grad_norm_(self, max_norm, norm_type)``."""
        with self._faults.outside("clip_grad_norm_"):  # a failed all-reduce: PipelineError
            return self._clipper.clip(max_norm, norm_type)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """With ``clip_grad_norm``: the global gradient norm of the last step (before
        clipping), a 0-dim tensor on every rank; None before the first step."""
        return self._clipper.norm

    # ---------------------------------------------------------------- capture
    def close(self) -> None:
        """Destroy captured graphs and plans; call before destroying the process group."""
        if self._capture is not None:
            self._capture.close()

    @property
    def plan(self) -> StaticPlan | None:
        """The static plan of the active capture (None before the warmup step, and without
        ``capture``)."""
        return self._capture.plan if self._capture is not None else None

    @property
    def record(self) -> StepRecord | None:
        """The metadata the warmup step recorded (None before it, and without
        ``capture``)."""
        return self._capture.record if self._capture is not None else None

    def memory_report(self) -> str:
        """Bytes per kind of the static plan (inputs, labels, P2P receive buffers and packets,
        against one buffer per micro-batch) and of what the warmup step recorded for the
        stored stage activations and gradients (held by autograd, or by the CUDA graph pool
        when captured)."""
        if self._capture is None:
            raise RuntimeError(
                "no plan: the memory report is of a captured pipeline's static plan; build "
                "the pipeline with capture=True (or 'step' / 'action') and run one step"
            )
        return self._capture.memory_report()


def clip_grad_norm_(pipe: Pipeline, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``pipe``'s parameters by their global norm; return the norm.

    Call it on every rank of every replica after ``pipe.step`` (it all-reduces over the
    pipeline group). The norm is the same 0-dim tensor on every rank (float32, or float64
    when a gradient is float64), computed before clipping, as
    ``torch.nn.utils.clip_grad_norm_`` over the model's unique parameters returns it. No host
    synchronization: to clip inside a captured step, pass ``clip_grad_norm=max_norm`` to the
    pipeline instead (the norm is then ``pipe.grad_norm``). See ``runtime/parts/clipping.py``.
    """
    return pipe.clip_grad_norm_(max_norm, norm_type)


class DualPipeV(Pipeline):
    """DeepSeek's DualPipeV: ``Pipeline(stages, schedule="dualpipev", ...)``.

    ``stages`` are this rank's two modules, ``(stage r, stage 2N-1-r)``; ``M >= 2N``. See
    ``Pipeline`` for the other arguments.
    """

    def __init__(self, stages: Sequence[nn.Module], **kwargs: Any) -> None:
        if "schedule" in kwargs:
            raise TypeError("DualPipeV runs the dualpipev schedule; use Pipeline for others")
        super().__init__(stages, schedule="dualpipev", **kwargs)
