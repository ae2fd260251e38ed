"""torch.distributed.pipelining's schedules, run by graphpipe: switch by changing the import.

::

    # from torch.distributed.pipelining import ScheduleDualPipeV
    from graphpipe.integrations.torch_pipelining import ScheduleDualPipeV

    schedule = ScheduleDualPipeV(pp_stages, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(x, target=y, losses=losses)  # rank 0; schedule.step() elsewhere

Each class takes the constructor of torch's class of that name (``stages`` a list of
``PipelineStage``, or one stage for the single-stage schedules, ``n_microbatches``,
``loss_fn``, ``scale_grads``, ...) and offers its ``step(*args, target=None, losses=None,
return_outputs=True, loss_kwargs=None, **kwargs)`` and ``eval``, plus torch 2.14's pre-split
``step(arg_mbs=, kwarg_mbs=, target_mbs=)``. It builds a ``graphpipe.Pipeline`` from the
stages' modules (``stage.submod``), their ``stage_index`` and ``group``; torch's stage objects
themselves are not run (their P2P buffers are never allocated).

What equals torch's schedule on the same stages, and how:

- The losses (``losses`` on the rank of the last stage, one 0-dim tensor per micro-batch, the
  values ``loss_fn`` returned) and the gradients: the pipeline sums the micro-batch
  gradients (``loss_reduction="sum"``, backward seed 1, as torch's backward of each loss) and
  with ``scale_grads=True`` (the default) divides each stage's ``.grad`` by
  ``n_microbatches`` after the step, as torch's ``stage.scale_grads`` does (gradients that
  were there before the step are divided too, as in torch: zero them each step).
- ``step`` returns the last stage's outputs, concatenated on dim 0, on the rank that runs it
  (``return_outputs=True``, detached), ``None`` elsewhere.
- Positional ``args`` go to stage 0 (ignored on other ranks, as torch does), ``target`` to
  the last stage's ``loss_fn`` (ignored elsewhere); both are split on dim 0.
- Keyword tensors (``**kwargs``) are split on dim 0 and reach every stage of the rank that
  takes them. torch gives a rank's kwargs to every stage of that rank; graphpipe gives each
  keyword to the stages whose ``forward`` takes it, and requires every rank to pass the same
  keywords (a rank that passes others is a ``ValueError`` naming it on every rank).
  ``loss_kwargs`` go to ``loss_fn`` on every micro-batch, as in torch.

What is refused, naming it (``ValueError``): chunk specs other than dim 0
(``args_chunk_spec`` / ``kwargs_chunk_spec``), ``output_merge_spec``,
``backward_requires_autograd=False`` (a custom backward), ``defer_pp_recv=True`` (pass
graphpipe's ``receives=`` instead), stage indices that are not the placement of the schedule,
``return_outputs=True`` with ``capture`` (a replayed step runs no Python to collect them),
``capture_optimizer`` or ``clip_grad_norm`` with ``scale_grads=True`` (both run inside the
step, before the division), and a ``dp_group`` of more than one rank unless every parameter
is sharded by FSDP2 with ``set_gradient_divide_factor(1.0)`` (the replicas' gradients are
then summed, by FSDP2, as torch's schedule does on those modules).

graphpipe's own options (``capture``, ``receives``, ``timeout``, ``defer_weight_grads``,
``use_nvtx``, ...) are keyword arguments of the constructor, passed to ``Pipeline``.

Owns: nothing of the runtime; the wrapper's loss buffers (static copies of tensor
``loss_kwargs`` under capture). May touch: the stages' ``.grad`` (``scale_grads``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.ir import Action, Op
from graphpipe.runtime import PerMicrobatch, Pipeline
from graphpipe.simulate import resolve_schedule

__all__ = [
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleZBVZeroBubble",
]

# Pipeline arguments the wrapper sets itself from torch's arguments.
_RESERVED = ("schedule", "num_microbatches", "loss_fn", "group", "loss_reduction")


def _gpipe(num_ranks: int, num_microbatches: int) -> dict[int, list[Action]]:
    """GPipe as a compute-only schedule: every forward, then every backward (torch's order)."""
    m = range(num_microbatches)
    return {
        r: [Action(r, Op.F, i) for i in m] + [Action(r, Op.B, i) for i in m]
        for r in range(num_ranks)
    }


def _no_loss(output: Any, target: Any) -> torch.Tensor:
    raise RuntimeError("this schedule was built with loss_fn=None: it can only run eval()")


def _check_spec(name: str, spec: Any) -> None:
    """Chunk specs: only splitting on dim 0 (graphpipe's split) is accepted."""
    if spec is None:
        return
    values = spec.values() if isinstance(spec, Mapping) else spec
    for s in values:
        dim = getattr(s, "split_dim", None)
        if dim != 0:
            raise ValueError(
                f"{name}={spec!r}: graphpipe splits every batch on dim 0; a chunk spec of "
                f"{s!r} cannot be honoured"
            )


def _cat(what: str, mbs: Sequence[Any]) -> Any:
    """Pre-split micro-batches (tensors or tuples of tensors) back into one batch on dim 0."""
    first = mbs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(mbs))
    if isinstance(first, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in first):
        return tuple(torch.cat(parts) for parts in zip(*mbs, strict=True))
    raise TypeError(
        f"{what}: graphpipe takes tensors (or tuples of tensors) per micro-batch, got "
        f"{type(first).__name__}"
    )


def _keyword(name: str, mbs: list[Any]) -> Any:
    """A pre-split keyword: tensors (or tuples of them) concatenated on dim 0 into a keyword
    tensor, other values (a BlockMask, a dataclass of tensors) as ``PerMicrobatch``."""
    first = mbs[0]
    if isinstance(first, torch.Tensor) or (
        isinstance(first, (tuple, list))
        and first
        and all(isinstance(t, torch.Tensor) for t in first)
    ):
        return _cat(f"kwarg_mbs[...][{name!r}]", mbs)
    return PerMicrobatch(mbs)


class _StaticLossKwargs:
    """``loss_kwargs`` as ``loss_fn`` sees them: the given values (eager), or under capture
    static copies of the tensors, refreshed before each step (a captured graph reads them),
    and non-tensor values that must stay the same."""

    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.values: dict[str, Any] = {}

    def set(self, given: Mapping[str, Any] | None) -> None:
        given = dict(given or {})
        if not self.capture:
            self.values = given
            return
        if self.values and set(given) != set(self.values):
            raise ValueError(
                f"loss_kwargs changed from {sorted(self.values)} to {sorted(given)} after "
                "capture: a captured step reads the same names every step"
            )
        for name, v in given.items():
            old = self.values.get(name)
            if isinstance(v, torch.Tensor):
                if old is None:
                    self.values[name] = v.detach().clone()
                elif old.shape != v.shape or old.dtype != v.dtype or old.device != v.device:
                    raise ValueError(
                        f"loss_kwargs[{name!r}] changed from {list(old.shape)} {old.dtype} to "
                        f"{list(v.shape)} {v.dtype} after capture"
                    )
                else:
                    old.copy_(v)
            elif name in self.values and old != v:
                raise ValueError(
                    f"loss_kwargs[{name!r}] changed from {old!r} to {v!r} after capture: a "
                    "captured step keeps non-tensor values; pass a tensor to change it"
                )
            else:
                self.values[name] = v


class PipelineSchedule:
    """A torch.distributed.pipelining schedule run by ``graphpipe.Pipeline``.

    Args:
        stages: this rank's ``PipelineStage`` objects (any order; their ``submod``,
            ``stage_index``, ``num_stages`` and ``group`` are read).
        n_microbatches: M.
        loss_fn: ``loss_fn(output, target, **loss_kwargs) -> 0-dim tensor`` per micro-batch;
            None: only ``eval`` runs.
        schedule: graphpipe's schedule: ``"dualpipev"``, ``"zbv"``, ``"1f1b"``, ``"gpipe"``,
            or a compute-only ``{rank: [Action, ...]}``.
        scale_grads: divide each stage's gradients by M after the step (torch's default),
            for a ``loss_fn`` that averages; False for one that sums.
        args_chunk_spec, kwargs_chunk_spec: only dim 0 (``TensorChunkSpec(0)``) or None.
        output_merge_spec: only None (outputs are concatenated on dim 0).
        use_full_backward: ignored, as torch does (deprecated there).
        backward_requires_autograd: only True.
        defer_pp_recv: only False (graphpipe's ``receives=`` chooses when receives are
            posted).
        **options: passed to ``graphpipe.Pipeline`` (``capture``, ``receives``, ``timeout``,
            ``defer_weight_grads``, ``use_nvtx``, ``per_edge_groups``, ``costs``, ...).
    """

    _torch_name = "PipelineSchedule"

    def __init__(
        self,
        stages: Sequence[Any],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        use_full_backward: bool | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        schedule: str | Mapping[int, Sequence[Action]] = "dualpipev",
        **options: Any,
    ) -> None:
        name = self._torch_name
        _check_spec("args_chunk_spec", args_chunk_spec)
        _check_spec("kwargs_chunk_spec", kwargs_chunk_spec)
        if output_merge_spec is not None:
            raise ValueError(
                f"output_merge_spec={output_merge_spec!r}: graphpipe's {name} concatenates the "
                "outputs on dim 0 only; pass None"
            )
        if not backward_requires_autograd:
            raise ValueError(
                f"backward_requires_autograd=False: graphpipe's {name} runs autograd's "
                "backward (no custom backward functions)"
            )
        if defer_pp_recv:
            raise ValueError(
                f"defer_pp_recv=True: graphpipe's {name} posts receives by its own rule; pass "
                "receives='timed' (or 'start') instead"
            )
        reserved = sorted(set(options) & set(_RESERVED))
        if reserved:
            raise TypeError(
                f"{name} sets {reserved} itself from torch's arguments (the stages' group, "
                "n_microbatches, loss_fn, scale_grads)"
            )
        inside = [k for k in ("capture_optimizer", "clip_grad_norm") if options.get(k) is not None]
        if scale_grads and inside:
            raise ValueError(
                f"{inside[0]} runs inside the step, before scale_grads=True divides the "
                "gradients by n_microbatches after it: pass scale_grads=False with a loss_fn "
                f"that divides by n_microbatches itself, or drop {inside[0]}"
            )
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not stages:
            raise ValueError(f"{name} needs this rank's PipelineStage objects, got none")
        for s in stages:
            missing = [a for a in ("submod", "stage_index", "num_stages") if not hasattr(s, a)]
            if missing:
                raise TypeError(
                    f"{name} takes torch.distributed.pipelining PipelineStage objects; got a "
                    f"{type(s).__name__} without {missing}"
                )
        _check_replicas(name, options.get("dp_group"), stages)
        stages.sort(key=lambda s: s.stage_index)
        groups = {id(getattr(s, "group", None)) for s in stages}
        if len(groups) > 1:
            raise ValueError(f"{name}: this rank's stages have different process groups")
        group = getattr(stages[0], "group", None)
        self._stages = stages
        self._n_microbatches = m = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._capture = bool(options.get("capture", False))
        self._loss_kwargs = _StaticLossKwargs(self._capture)
        self._outputs: list[Any] = []
        self._collect_outputs = False

        distributed = dist.is_available() and dist.is_initialized()
        n = dist.get_world_size(group) if distributed else 1
        rank = dist.get_rank(group) if distributed else 0
        if isinstance(schedule, str) and schedule == "gpipe":
            schedule = _gpipe(n, m)
        built, placement, _ = resolve_schedule(schedule, n, m)
        want = tuple(placement.stages_of(rank))
        got = tuple(s.stage_index for s in stages)
        if got != want:
            raise ValueError(
                f"{name} on {n} ranks places stages {list(want)} on rank {rank}, but this rank "
                f"was given PipelineStage objects with stage_index {list(got)}"
            )
        num_stages = {s.num_stages for s in stages}
        if num_stages != {placement.num_stages}:
            raise ValueError(
                f"{name} on {n} ranks runs {placement.num_stages} stages, but the "
                f"PipelineStage objects have num_stages={sorted(num_stages)}"
            )
        # The last stage's forwards in ascending micro-batch order: loss_fn is then called in
        # micro-batch order, and the outputs it sees are collected in that order.
        last = placement.num_stages - 1
        order = [
            p.microbatch
            for cell in built[placement.rank_of(last)]
            for p in cell.parts()
            if p.op is Op.F and p.stage == last
        ]
        self._outputs_in_order = order == sorted(order)
        self._first = rank == placement.rank_of(0)
        self._last = rank == placement.rank_of(last)
        self._schedule, self._group = built, group if distributed else None
        self._options = options
        self._pipe: Pipeline | None = None

    @property
    def pipe(self) -> Pipeline:
        """The ``graphpipe.Pipeline``, built at the first ``step`` or ``eval`` (every rank
        calls it then), as torch's schedules initialize their stages at the first step: a
        model built on the meta device and initialized after the schedule (torchtitan's
        order) is seen with its real parameters."""
        if self._pipe is None:
            self._pipe = Pipeline(
                [s.submod for s in self._stages],
                schedule=self._schedule,
                num_microbatches=self._n_microbatches,
                loss_fn=self._loss if self._loss_fn is not None else _no_loss,
                group=self._group,
                loss_reduction="sum",
                **self._options,
            )
        return self._pipe

    # -------------------------------------------------------------- the loss
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """What the pipeline calls per micro-batch: torch's ``loss_fn(output, target,
        **loss_kwargs)``, collecting the output for ``return_outputs``. It takes no other
        keyword, so no keyword tensor of ``step`` is routed to it (torch gives none)."""
        if self._collect_outputs:
            self._outputs.append(output.detach() if isinstance(output, torch.Tensor) else output)
        assert self._loss_fn is not None
        return self._loss_fn(output, target, **self._loss_kwargs.values)

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank runs the last stage (its ``loss_fn``, its ``losses``)."""
        return self._last

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank runs stage 0 (it takes the positional arguments)."""
        return self._first

    # -------------------------------------------------------------- the batch
    def _batch(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        arg_mbs: list | None,
        kwarg_mbs: list | None,
        target_mbs: list | None,
    ) -> tuple[Any, Any, dict[str, Any]]:
        """The pipeline's ``(inputs, labels, keywords)`` of torch's step arguments."""
        m = self._n_microbatches
        given = {"arg_mbs": arg_mbs, "kwarg_mbs": kwarg_mbs, "target_mbs": target_mbs}
        for what, mbs in given.items():
            if mbs is not None and (not isinstance(mbs, list) or len(mbs) != m):
                got = len(mbs) if isinstance(mbs, list) else type(mbs).__name__
                raise ValueError(f"{what} must be a list of n_microbatches={m} entries, got {got}")
        if arg_mbs is not None:
            if args:
                raise ValueError("pass either positional args or arg_mbs, not both")
            if all(len(a) == 0 for a in arg_mbs):
                args = ()
            else:
                args = tuple(torch.cat([a[i] for a in arg_mbs]) for i in range(len(arg_mbs[0])))
        if kwarg_mbs is not None:
            if kwargs:
                raise ValueError("pass either keyword arguments or kwarg_mbs, not both")
            names = sorted(kwarg_mbs[0])
            for i, kw in enumerate(kwarg_mbs):
                if sorted(kw) != names:
                    raise ValueError(
                        f"kwarg_mbs[{i}] has keywords {sorted(kw)}, kwarg_mbs[0] has {names}"
                    )
            kwargs = {k: _keyword(k, [kw[k] for kw in kwarg_mbs]) for k in names}
        if target_mbs is not None:
            if target is not None:
                raise ValueError("pass either target or target_mbs, not both")
            target = _cat("target_mbs", target_mbs)
        inputs = None
        if self._first:
            inputs = args[0] if len(args) == 1 else (tuple(args) if args else None)
        labels = target if self._last else None
        return inputs, labels, kwargs

    def _outputs_merged(self) -> Any:
        outs, self._outputs = self._outputs, []
        if not outs:
            return None
        return _cat("the last stage's outputs", outs)

    # -------------------------------------------------------------- the calls
    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step, as torch's ``step``: the last stage's outputs (concatenated on
        dim 0, detached) on its rank with ``return_outputs``, else None; ``losses`` (on the
        last stage's rank) is cleared and given each micro-batch's loss. Every rank calls it
        (with its own arguments, as in torch)."""
        if self._loss_fn is None:
            raise RuntimeError(
                f"{self._torch_name} was built with loss_fn=None: step() trains; use eval()"
            )
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses).__name__}")
        pipe = self.pipe
        if return_outputs and self._capture:  # on every rank: none is left waiting
            raise ValueError(
                "return_outputs=True cannot be served by a captured step (a replay runs no "
                "Python that could collect the outputs): pass return_outputs=False"
            )
        if return_outputs and not self._outputs_in_order:  # on every rank, too
            raise ValueError(
                "return_outputs=True: this schedule runs the last stage's forwards out of "
                "micro-batch order, so the outputs cannot be merged in order; pass "
                "return_outputs=False"
            )
        inputs, labels, kw = self._batch(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        self._loss_kwargs.set(loss_kwargs)
        self._outputs = []
        self._collect_outputs = return_outputs and self._last
        try:
            pipe.step(inputs, labels, **kw)
        finally:
            self._collect_outputs = False
        if self.scale_grads and self._n_microbatches != 1:
            with torch.no_grad():  # torch's stage.scale_grads, stage by stage
                for s in self._stages:
                    for p in s.submod.parameters():
                        if p.grad is not None:
                            p.grad.div_(self._n_microbatches)
        if pipe.is_loss_rank:
            if losses is not None:
                losses.clear()
                losses.extend(pipe.loss.losses.detach().clone().unbind(0))
            if return_outputs:
                return self._outputs_merged()
        return None

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list | None = None,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forward only, as torch's ``eval``: the last stage's outputs (concatenated on dim 0)
        on its rank, None elsewhere; with a target there and a ``loss_fn``, ``losses`` is
        given each micro-batch's ``loss_fn(output, target)`` (no ``loss_kwargs``, as in
        torch). Always eager (also with ``capture``)."""
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses).__name__}")
        inputs, labels, kw = self._batch(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        out = self.pipe.forward(inputs, **kw)
        if not self.pipe.is_loss_rank:
            return None
        if labels is not None and self._loss_fn is not None and losses is not None:
            m = self._n_microbatches
            outs = [o.chunk(m) for o in (out if isinstance(out, tuple) else (out,))]
            tgts = [t.chunk(m) for t in (labels if isinstance(labels, tuple) else (labels,))]
            losses.clear()
            with torch.no_grad():
                for i in range(m):
                    o = tuple(c[i] for c in outs)
                    t = tuple(c[i] for c in tgts)
                    # No loss_kwargs: torch's eval takes none (not the last step's).
                    losses.append(
                        self._loss_fn(o[0] if len(o) == 1 else o, t[0] if len(t) == 1 else t)
                    )
        return out

    def close(self) -> None:
        """``Pipeline.close``: destroy captured graphs before the process group."""
        self.pipe.close()


def _check_replicas(name: str, dp_group: Any, stages: Sequence[Any]) -> None:
    """A ``dp_group`` of more than one rank: every parameter of the stages must be sharded by
    FSDP2 with a gradient divide factor of 1.0 (``set_gradient_divide_factor(1.0)``, the loss
    already divided by the global token count, as torchtitan does). The pipeline sums the
    micro-batches (``loss_reduction="sum"``) and FSDP2 then sums the replicas: the gradient
    torch's schedule gives on the same modules. Anything else is refused: parameters torch's
    schedule leaves unsynchronised would be averaged by graphpipe's data parallelism, and
    FSDP2's default mean over the replicas would become a sum."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return
    from torch.distributed.fsdp import fully_shard

    from graphpipe.runtime.fsdp import fsdp_modules, param_groups

    size = dist.get_world_size(dp_group)
    for s in stages:
        mods = fsdp_modules(s.submod)
        managed = {id(p) for m in mods for p in m.parameters()}
        loose = [n for n, p in s.submod.named_parameters() if id(p) not in managed]
        if loose:
            raise ValueError(
                f"{name}: a dp_group of {size} ranks needs every parameter sharded by FSDP2 "
                f"(fully_shard), but stage {s.stage_index} has {loose[:3]} outside it: torch's "
                "schedule would leave their gradients per replica, graphpipe would average "
                "them; shard the stage, or pass a dp_group of one rank"
            )
        for m in mods:
            for group in param_groups(fully_shard.state(m)):
                factor = getattr(group, "gradient_divide_factor", None)
                if factor != 1.0:
                    raise ValueError(
                        f"{name}: a dp_group of {size} ranks sums the replicas' gradients "
                        f"(loss_reduction='sum'), but the FSDP2 module {type(m).__name__} of "
                        f"stage {s.stage_index} has gradient divide factor {factor!r} (None: "
                        "FSDP2's mean over the replicas): call set_gradient_divide_factor(1.0) "
                        "on it and divide the loss by the global number of tokens (as "
                        "torchtitan does), or pass a dp_group of one rank"
                    )


class _OneSchedule(PipelineSchedule):
    """A torch schedule class that runs one graphpipe schedule (``_schedule``)."""

    _schedule = ""

    def __init__(self, stages: Sequence[Any], n_microbatches: int, *a: Any, **kw: Any) -> None:
        if "schedule" in kw:
            raise TypeError(
                f"{self._torch_name} runs {self._schedule}; use PipelineSchedule for others"
            )
        super().__init__(stages, n_microbatches, *a, schedule=self._schedule, **kw)


class ScheduleDualPipeV(_OneSchedule):
    """torch's ``ScheduleDualPipeV`` (``stages``: this rank's two, stages ``r`` and
    ``2N-1-r``; ``n_microbatches >= 2N``), run as graphpipe's DualPipeV with its F&B overlap.
    See ``PipelineSchedule``."""

    _torch_name = "ScheduleDualPipeV"
    _schedule = "dualpipev"


class ScheduleZBVZeroBubble(_OneSchedule):
    """torch's ``ScheduleZBVZeroBubble`` (V placement, two stages per rank), as graphpipe's
    ``"zbv"``. See ``PipelineSchedule``."""

    _torch_name = "ScheduleZBVZeroBubble"
    _schedule = "zbv"


class Schedule1F1B(_OneSchedule):
    """torch's ``Schedule1F1B``: one ``PipelineStage`` per rank (``stage``, not a list).
    See ``PipelineSchedule`` (torch's single-stage schedules take no ``use_full_backward``,
    ``backward_requires_autograd`` or ``defer_pp_recv``)."""

    _torch_name = "Schedule1F1B"
    _schedule = "1f1b"

    def __init__(
        self,
        stage: Any,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        **kw: Any,
    ) -> None:
        super().__init__(
            [stage],
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads=scale_grads,
            **kw,
        )


class ScheduleGPipe(Schedule1F1B):
    """torch's ``ScheduleGPipe``: one stage per rank, every forward then every backward.
    See ``PipelineSchedule``."""

    _torch_name = "ScheduleGPipe"
    _schedule = "gpipe"
