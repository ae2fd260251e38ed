"""Data parallelism across pipeline replicas: gradient and loss averaging inside the step.

With ``Pipeline(..., group=pp_group, dp_group=dp_group)`` every pipeline rank belongs to two
groups: its pipeline (``group``) and the ranks that hold the same stages in the other
replicas (``dp_group``). Each replica runs the whole schedule on its own batch; this module
then makes the replicas' gradients equal to the gradients of the mean loss over all of them:

* **When.** A stage's gradients are final once its last ``B``, ``I`` or ``W`` of the step has
  run (``Program.grads_final``). Its reduction is posted right after that instruction
  (``StepHooks.after_grads``), as asynchronous all-reduces, so it overlaps the rest of the step;
  one trailing instruction waits for all of them (inside a ``wait dp grads`` range) before the
  step returns. Under capture they are part of the static step (and of its CUDA graph).
* **What.** Each parameter once: a Parameter used by two local stages (tied weights, e.g.
  stage 0 and the last stage on rank 0 under DualPipeV) is reduced with the stage whose last
  gradient action comes later. Parameters are grouped per stage into buckets of at most
  ``bucket_cap_mb`` (one dtype and device each): a bucket of several parameters is copied into
  one flat buffer (allocated in the first step, static afterwards), summed, divided by the
  number of replicas and copied back; a parameter alone in its bucket is reduced in place.
* **Loss.** The loss rank's mean loss is averaged over its ``dp_group`` (every replica's loss
  rank) before the pipeline broadcasts it, so every rank returns the global mean.
* **Setup.** The groups are checked (one pipeline position per ``dp_group``), and the stages'
  parameters and buffers are broadcast from the first replica, as
  ``DistributedDataParallel`` does, so that the replicas start equal.

Rank layout with ``init_device_mesh(device, (D, N), mesh_dim_names=("dp", "pp"))``: global
rank ``d * N + p`` is pipeline rank ``p`` of replica ``d``; ``mesh.get_group("pp")`` is its
pipeline and ``mesh.get_group("dp")`` its data-parallel group.

**Expert parameters** (mixture of experts: marked with ``graphpipe.mark_expert``, as
``graphpipe.models``' MoE layers do) differ between the ranks of an expert-parallel group,
so they are not averaged over ``dp_group``: with ``expert_groups`` (``expert_parallel_groups(ep,
dp_group)``) their gradients are summed over its ``expert_dp_group`` (the replicas that hold
the same experts; each copy already sums its ep group's replicas) and divided by the dp size,
and the initial broadcast sends them over ``expert_dp_group`` only. Without
``expert_groups`` (the pipeline allows it only when no experts are sharded: every rank holds
all of them) they are averaged over ``dp_group`` like the rest.

Stages wrapped in ``DistributedDataParallel`` or FSDP1's ``FullyShardedDataParallel`` are
refused (``check_stage_wrappers``): their hooks would fire per micro-batch and the deferred
weight gradients bypass them (DDP replicas would drift apart with no error). Stages sharded
with FSDP2's ``fully_shard`` are supported (``runtime/parts/fsdp.py``): their parameters are
reduce-scattered by FSDP and left out of this module's averaging (``managed``). A DTensor
parameter (tensor parallel) is broadcast and averaged as its local shard: the dp replicas of
one tp rank hold the same shard.

**Agreement.** The replicas must skip (or run) the reductions together (``no_sync``), or a
replica that runs them waits on one that does not, and their next collectives mismatch (gloo
aborts the process). So each training step's batch agreement (``batch.py``) ends with one
all-reduce of a few words over the replicas, on a gloo group of this module's own over the
``dp_group`` members (``agree``: host memory, whatever the device): whether each replica is
inside ``no_sync``, and whether it refused the step. A disagreement, or a replica that
refused, raises ``PipelineError`` on every rank of every replica before any reduction is
posted; nothing is closed, and the next step runs.

**Failures.** A failure on one replica must end the step on the others too: their ranks
are waiting on this step's reductions, which the failed replica will never post. On gloo the
pipeline's fault notices are also published under a key of the dp group (``Faults.replicas``);
a rank waiting on a reduction polls its work and looks for such a notice every 50 ms, and
raises ``PipelineError`` naming the replica, rank, action and error. The reductions already
posted cannot be matched any more, so after such a failure the pipeline is closed on every
rank (``PipelineClosed``): build new process groups and a new pipeline.

Owns: the buckets, their flat buffers and the in-flight works, the replicas' agreement
group and its buffer. May touch: the ``.grad`` of the pipeline's parameters (in place, or
set once when ``None``), the loss buffer, the ``dp_group``, the replicas' fault notices.
Must not: touch the pipeline group or run stage code.
"""

from __future__ import annotations

import datetime
import functools
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.errors import PipelineError
from graphpipe.roles import ExpertGroups, is_expert

from ..coordination.config import join
from ..coordination.faults import REPLICA_AGREEMENT, CommFailure, FaultNotices, Faults
from ..coordination.groups import PatientGroup, _gloo, refuse_to_join, store_key, taken_key
from ..coordination.lifetime import release_groups_at_exit
from ..coordination.store import first_line
from ..core.context import RankContext
from ..core.program import StepHooks, Trailing
from ..core.tensors import grad_or_zeros, local_shard
from .accumulation import GradSync, divide_existing

if TYPE_CHECKING:
    from graphpipe.nvtx import Ranges

__all__ = ["DataParallel", "check_stage_wrappers", "refuse_setup", "setup_key"]

_CHECK_S = 0.05  # how often a rank waiting on the other replicas looks for a failure notice


def _wrappers() -> tuple[tuple[type, str], ...]:
    """``(class, what to say)`` for the data-parallel wrappers that are loaded: a module that
    was never imported cannot have wrapped a stage, and importing FSDP (with DTensor and
    sympy) only to check costs seconds in every process."""
    out: list[tuple[type, str]] = []
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is not None:
        out.append((ddp.DistributedDataParallel, "DDP"))
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:  # FSDP2 (fully_shard) is supported: runtime/parts/fsdp.py
        out.append((fsdp.FullyShardedDataParallel, "FSDP"))
    return tuple(out)


def check_stage_wrappers(stages: Sequence[nn.Module], stage_ids: Sequence[int]) -> None:
    """``ValueError`` for a stage that is (or holds) a DDP or FSDP1 module, naming the stage,
    the module and what to pass instead."""
    kinds = _wrappers()
    for s, stage in zip(stage_ids, stages, strict=True):
        for path, mod in stage.named_modules():
            for cls, kind in kinds:
                if not isinstance(mod, cls):
                    continue
                where = f"stage {s}" + (f" (submodule {path!r})" if path else "")
                if kind == "DDP":
                    raise ValueError(
                        f"{where} is wrapped in DistributedDataParallel: its hooks reduce per "
                        "micro-batch and miss the deferred weight gradients, so replicas "
                        "would drift apart. Pass the module itself (ddp.module) and "
                        "dp_group=ddp.process_group: the pipeline averages each stage's "
                        "gradients once per step, after its last W"
                    )
                raise ValueError(
                    f"{where} is wrapped in FullyShardedDataParallel (FSDP1), which graphpipe "
                    "does not support: its hooks reduce per micro-batch and the split "
                    "backward (I, then a deferred W) bypasses them. Shard the stage with "
                    "torch.distributed.fsdp.fully_shard (FSDP2) instead and pass "
                    "dp_group=mesh.get_group('dp')"
                )


_SETUP = "dp-setup"  # the store-key kind of the data-parallel setup's join


def refuse_setup(dp_group: Any, exc: BaseException) -> str | None:
    """This rank will not take part in the data-parallel setup over ``dp_group`` (its
    construction failed first, ``exc``): the members waiting in the setup's join raise at
    once, naming this rank and ``exc``. Returns the join's key (None: one member)."""
    return refuse_to_join(dp_group, exc, _SETUP, "build its pipeline")


def setup_key(dp_group: Any) -> str | None:
    """The key of the last data-parallel setup join over ``dp_group`` this process took
    (None: none)."""
    return taken_key(dist.get_process_group_ranks(dp_group), _SETUP)


class _Bucket:
    """Parameters of one stage, dtype and device, reduced together."""

    __slots__ = ("flat", "params", "target", "views", "work")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat: torch.Tensor | None = None  # several parameters: their flat copy
        self.views: list[torch.Tensor] = []
        self.target: torch.Tensor | None = None  # what this step's all-reduce sums
        self.work: Any = None

    def load(self) -> torch.Tensor:
        """The tensor to sum: the one gradient in place, or the gradients copied flat."""
        grads = [local_shard(grad_or_zeros(p)) for p in self.params]  # a TP shard: its own
        if len(grads) == 1 and grads[0].is_contiguous():
            return grads[0]
        if self.flat is None:
            g0 = grads[0]
            self.flat = torch.empty(sum(g.numel() for g in grads), dtype=g0.dtype, device=g0.device)
            self.views = list(self.flat.split([g.numel() for g in grads]))
        return torch.cat([g.reshape(-1) for g in grads], out=self.flat)

    def store(self, size: int) -> None:
        """Divide the sum by ``size`` (1: keep the sum) and write it back into the
        gradients."""
        target = self.target
        if size != 1:
            target.div_(size)
        if target is not self.flat:
            return
        for p, v in zip(self.params, self.views, strict=True):
            g = local_shard(p.grad)
            g.copy_(v.view_as(g))


class DataParallel:
    """Averages a pipeline's gradients and loss over its data-parallel group.

    ``DataParallel(ctx, grads_final, ranges, faults, dp_group)`` checks the groups, broadcasts
    the stages' state from the first replica and declares the reductions for the training
    program (``step_hooks``, see the module doc); ``grads_final``: the training program's
    ``{stage: instruction}`` after which each stage's gradients are final
    (``Program.grads_final``); ``faults``: the pipeline's (the replicas' failure notices join
    it), ``ranges``: its ranges. ``bucket_cap_mb``: the largest bucket in MiB (a
    larger parameter is its own bucket). ``expert_groups``: the ``ExpertGroups`` of stages with
    expert parameters. ``loss_reduction``: ``"mean"`` averages the gradients and the loss over
    the replicas, ``"sum"`` sums them. ``managed``: ids of the parameters another part
    reduces (FSDP2 modules'): neither averaged nor broadcast here.
    """

    name = "dp grads"  # what a failure while waiting names (the program's ``wait dp grads``)

    def __init__(
        self,
        ctx: RankContext,
        grads_final: Mapping[int, int],
        ranges: Ranges,
        faults: Faults,
        dp_group: Any,
        bucket_cap_mb: float = 25.0,
        expert_groups: ExpertGroups | None = None,
        loss_reduction: str = "mean",
        managed: set[int] = frozenset(),
        grad_sync: GradSync | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("dp_group was given but torch.distributed is not initialized")
        self.group = dp_group
        self.size = dist.get_world_size(dp_group)
        # The loss is the mean over the replicas (gradients averaged), or their sum with
        # loss_reduction="sum" (a token-weighted loss already divides by the global count).
        self.divisor = self.size if loss_reduction == "mean" else 1
        self.ranges = ranges
        # Failures of the other replicas (gloo): notices shared over the dp group, looked for
        # while waiting on its reductions (a CUDA wait is a stream dependency: no polling).
        self.faults = faults
        store = faults.notices.store
        self.poll = self.size > 1 and ctx.device.type == "cpu" and store is not None
        if self.poll:
            key = store_key(dist.get_process_group_ranks(dp_group), "dp")
            self.faults.watch_replicas(FaultNotices(store, key, ctx.rank), dist.get_rank(dp_group))
        self.expert_group = expert_groups.expert_dp_group if expert_groups is not None else None
        self.managed = managed  # ids of parameters another part reduces (FSDP2's)
        self.grad_sync = grad_sync if grad_sync is not None else GradSync()
        self.replica = dist.get_rank(dp_group)
        # The replicas' agreement (``agree``): a gloo group of this part's own over the members
        # (built right after the join, which every member passed), and its words.
        self.control: PatientGroup | None = None
        self._words = torch.zeros(2 * self.size, dtype=torch.int64)
        if self.size > 1 and store is not None:  # every member here, or every member told
            dp_ranks = dist.get_process_group_ranks(dp_group)
            key = store_key(dp_ranks, _SETUP)
            timeout_s = faults.timeout_s if faults.timeout_s is not None else 300.0
            join(store, key, self.replica, dp_ranks, timeout_s, None, kind="data-parallel setup")
            try:
                raw = _gloo(
                    store.store,
                    f"{key}/replicas",
                    dp_ranks,
                    dist.get_rank(),
                    datetime.timedelta(seconds=timeout_s),
                )
            except Exception as e:  # a member died after joining, or the store went
                store.check(key)  # StoreLost, naming the store's host
                raise PipelineError(
                    f"rank {ctx.rank} could not build the data-parallel replicas' group after "
                    f"every member joined (a peer died meanwhile?): {type(e).__name__}: "
                    f"{first_line(e)}"
                ) from None
            self.control = PatientGroup(raw, faults.blocked)
            release_groups_at_exit(self)  # its gloo group let go at exit (coordination/lifetime)
        with faults.outside("the data-parallel setup", "dp_group"):  # a failed collective
            self._check_layout(ctx)
            self._sync_state(ctx.modules)
        ids = ctx.stage_ids
        at = {li: grads_final[s] for li, s in enumerate(ids)}
        self._hooks = StepHooks()
        owner: dict[int, tuple[int, nn.Parameter]] = {}
        for li in sorted(at, key=lambda li: (at[li], li)):  # the later stage keeps a tied one
            for p in ctx.modules[li].parameters():
                if p.requires_grad and id(p) not in managed:
                    owner.pop(id(p), None)
                    owner[id(p)] = (li, p)
        cap = int(bucket_cap_mb * 2**20)
        self.buckets: dict[int, list[_Bucket]] = {}
        self.expert_buckets: dict[int, list[_Bucket]] = {}
        by_stage: dict[int, list[nn.Parameter]] = {li: [] for li in at}
        experts: dict[int, list[nn.Parameter]] = {li: [] for li in at}
        apart = self.expert_group is not None  # else experts are replicated: like the rest
        for li, p in owner.values():
            (experts if apart and is_expert(p) else by_stage)[li].append(p)
        for li in at:
            self.buckets[li] = _bucketize(by_stage[li], cap)
            self.expert_buckets[li] = _bucketize(experts[li], cap)
        self._in_flight: list[_Bucket] = []
        self._first: int | None = None
        if self.size == 1:
            return  # nothing to average
        # What each reduction does to a gradient that is the same on every replica (one
        # accumulated in an earlier step): alpha = members / divisor (parts/accumulation.py).
        alpha = self.size / self.divisor
        e_alpha = (dist.get_world_size(self.expert_group) if apart else 0) / self.divisor
        self._existing = [
            (p, a)
            for buckets, a in ((self.buckets, alpha), (self.expert_buckets, e_alpha))
            if a != 1.0
            for bs in buckets.values()
            for b in bs
            for p in b.params
        ]
        if self._existing:
            self.grad_sync.add(self.divide_existing)
        starts = []
        for li in sorted(at, key=lambda li: (at[li], li)):
            if self.buckets[li] or self.expert_buckets[li]:
                self._first = li if self._first is None else self._first
                starts.append((ids[li], functools.partial(self.start, li)))
        self._hooks = StepHooks(after_grads=tuple(starts), trailing=(Trailing((self.wait,)),))

    def step_hooks(self) -> StepHooks:
        """In the training step: each stage's reductions posted after its last gradient
        (``start``), and one trailing wait for all of them (``wait``)."""
        return self._hooks

    # ------------------------------------------------------------------ setup
    def _check_layout(self, ctx: RankContext) -> None:
        """Every member of ``dp_group`` must be the same pipeline rank of a same-size pipeline."""
        mine = torch.tensor([ctx.rank, ctx.num_ranks], dtype=torch.int64)
        if self.size == 1:
            return
        if dist.get_backend(self.group) == "nccl":
            mine = mine.to(ctx.device)
        got = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(got, mine, group=self.group)
        seen = sorted({tuple(t.tolist()) for t in got})
        if len(seen) > 1:
            raise ValueError(
                "dp_group must join the ranks that run the same stages in each replica: its "
                f"members are (pipeline rank, pipeline size) {seen}; with a DeviceMesh "
                "('dp', 'pp') pass group=mesh.get_group('pp'), dp_group=mesh.get_group('dp')"
            )

    def _sync_state(self, modules: Sequence[nn.Module]) -> None:
        if self.size == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        edp = self.expert_group
        esrc = dist.get_global_rank(edp, 0) if edp is not None else None
        seen: set[int] = set()
        with torch.no_grad():
            for mod in modules:
                for t in [*mod.parameters(), *mod.buffers()]:
                    if id(t) in seen or id(t) in self.managed:  # FSDP shards differ
                        continue
                    seen.add(id(t))
                    data = local_shard(t.data)  # a tensor-parallel shard: the same on dp
                    if edp is None or not is_expert(t):
                        dist.broadcast(data, src=src, group=self.group)
                    elif dist.get_world_size(edp) > 1:  # the replicas with the same experts
                        dist.broadcast(data, src=esrc, group=edp)

    # -------------------------------------------------------------- agreement
    @property
    def agrees(self) -> bool:
        """The replicas agree at each training step (``agree``): more than one of them."""
        return self.control is not None

    def agree(self, unsynced: bool, refused: bool) -> tuple[list[bool], list[bool]]:
        """The replicas' part of a training step's agreement (see the module doc): this
        replica is inside ``no_sync`` (``unsynced``) and refused the step (``refused``: its
        pipeline's agreement raises on its ranks); returns both, per replica (index: the rank
        in ``dp_group``). Every rank of every replica calls it once per training step, after
        its pipeline's agreement, whatever that found. A failed collective, or another
        replica's failure notice while waiting, is a ``CommFailure``."""
        n, words = self.size, self._words
        vals = [0] * (2 * n)
        vals[self.replica] = int(unsynced)
        vals[n + self.replica] = int(refused)
        words.copy_(torch.tensor(vals, dtype=torch.int64))
        self.faults.doing(REPLICA_AGREEMENT)
        try:
            if self.control is None:
                raise RuntimeError("the data-parallel replicas' group was released")
            work = self.control.allreduce([words])
        except RuntimeError as e:
            raise CommFailure(None, REPLICA_AGREEMENT, e.with_traceback(None)) from None
        self._wait(work, REPLICA_AGREEMENT)
        got = words.tolist()
        return [bool(v) for v in got[:n]], [bool(v) for v in got[n:]]

    def release(self) -> None:
        """Let go of the replicas' agreement group (at exit, ``lifetime``); a later
        ``agree`` raises ``CommFailure``."""
        if self.control is not None:
            self.control.release()
        self.control = None

    # ------------------------------------------------------------------- step
    def divide_existing(self) -> None:
        """The start of a step: the gradients already there, divided by what the reductions
        will multiply them by (runtime/parts/accumulation.py)."""
        divide_existing(self._existing, local_shard)

    def start(self, li: int) -> None:
        """Post the reductions of local stage ``li`` (its gradients are final); nothing inside
        ``no_sync``."""
        if not self.grad_sync.sync:
            return
        if li == self._first:  # the step's first: forget what a failed step left posted
            self.abandon()
        for b in self.buckets[li]:
            b.target = b.load()
            b.work = dist.all_reduce(b.target, group=self.group, async_op=True)
            self._in_flight.append(b)
        edp = self.expert_group
        for b in self.expert_buckets[li]:  # summed over the same experts' holders, / dp size
            b.target = b.load()
            if dist.get_world_size(edp) > 1:
                b.work = dist.all_reduce(b.target, group=edp, async_op=True)
            self._in_flight.append(b)

    def wait(self) -> None:
        """Wait for every posted reduction and write the averages into ``.grad``."""
        if not self._in_flight:
            return
        ranges = self.ranges
        ranges.push("wait dp grads")
        try:
            for b in self._in_flight:
                if b.work is not None:
                    self._wait(b.work, "wait dp grads")
                b.store(self.divisor)
        finally:
            self.abandon()
            ranges.pop()

    def _wait(self, work: Any, what: str) -> None:
        """``work.wait()``; on gloo, polled so that another replica's failure notice ends the
        wait at once (``CommFailure`` carrying it) instead of at the group's timeout."""
        faults = self.faults
        if self.poll:
            faults.doing(what)
            check = 0.0
            while not work.is_completed():
                now = time.monotonic()
                if now >= check:
                    notice = faults.replicas.peek(faults.call)
                    if notice is not None:
                        cause = RuntimeError("another data-parallel replica failed")
                        raise CommFailure(None, what, cause, notice=notice)
                    check = now + _CHECK_S
                time.sleep(0.0002)
        try:
            work.wait()
        except RuntimeError as e:
            raise CommFailure(None, what, e.with_traceback(None)) from None

    def set_ranges(self, ranges: Ranges) -> None:
        """Emit the reductions' ranges through ``ranges`` from now on."""
        self.ranges = ranges

    def average_loss(self, loss: torch.Tensor) -> None:
        """On the loss rank: ``loss`` becomes the mean (``loss_reduction="sum"``: the sum) of
        every replica's ``loss``."""
        if self.size > 1:
            if self.poll:
                self._wait(dist.all_reduce(loss, group=self.group, async_op=True), "dp loss")
            else:
                dist.all_reduce(loss, group=self.group)
            if self.divisor != 1:
                loss.div_(self.divisor)

    def abandon(self) -> None:
        """Forget the posted reductions (after the wait, or a failed step)."""
        for b in self._in_flight:
            b.work = b.target = None
        self._in_flight.clear()


def _bucketize(params: list[nn.Parameter], cap: int) -> list[_Bucket]:
    """Consecutive parameters of one dtype and device, up to ``cap`` bytes per bucket."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[nn.Parameter]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for p in params:
        key = (p.dtype, p.device)
        nbytes = local_shard(p).numel() * p.element_size()
        runs = groups.setdefault(key, [[]])
        if runs[-1] and sizes[key] + nbytes > cap:
            runs.append([])
            sizes[key] = 0
        runs[-1].append(p)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [_Bucket(run) for runs in groups.values() for run in runs if run]
