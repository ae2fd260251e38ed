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
themselves are not run (their P2P buffers are never allocated). The classes sit in torch's
hierarchy, so that code dispatching on it picks them as torch's: ``Schedule1F1B`` and
``ScheduleGPipe`` are ``PipelineScheduleSingle`` subclasses (one stage, or a list of one),
``ScheduleDualPipeV`` and ``ScheduleZBVZeroBubble`` ``PipelineScheduleMulti`` ones, and
``PipelineSchedule`` a ``_PipelineSchedule``; torch's methods they do not override are not
meant to be called on them. Works with every torch that ``pyproject.toml`` admits (2.11 on).

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
- Keyword tensors (``**kwargs``) are split on dim 0 and go, as in torch, to the stages of the
  rank that passes them: ``step(x, mask=m)`` on the first stage's rank and ``step()``
  elsewhere (torch's own tests and tutorials) gives ``mask`` to that rank's stages only
  (those whose ``forward`` takes it; torch passes it to every stage of the rank). Ranks that
  pass the same keyword each give their own tensor to their own stages. Refused (on every
  rank, naming the keyword and the rank): a keyword passed on some ranks but not on a rank
  whose stage takes it (torch runs that stage without it, graphpipe gives a keyword to every
  stage that takes it), ranks that pass one keyword with other shapes, and a pre-split
  non-tensor keyword (``PerMicrobatch``) that some rank does not pass.
  ``loss_kwargs`` go to ``loss_fn`` on every micro-batch, as in torch (on the last stage's
  rank; other ranks' are ignored, as in torch).
- Every call checks its arguments on each rank, and the ranks agree on the outcome before any
  of them runs the step: a rank whose arguments are refused raises its error, every other
  rank a ``PipelineError`` naming that rank and the error, and no rank runs the call (one
  ``all_gather_object`` per call over the stages' group when it is gloo, else over a gloo
  group of the same ranks built at the first call). With a ``dp_group`` of several replicas,
  a step refused in one replica is refused in every replica (one more gather, over the
  ``dp_group`` or a gloo group of its ranks), as the pipeline's own agreement does.

What is refused, naming it (``ValueError``; ``TypeError`` for a ``n_microbatches`` that is
not an int): chunk specs other than dim 0
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

Owns: the wrapper's loss buffers (static copies of tensor ``loss_kwargs`` under capture) and,
when the stages' group (or the ``dp_group``) is not gloo, the gloo groups of the calls'
agreement (destroyed by ``close``). May touch: the stages' ``.grad`` (``scale_grads``).
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

try:  # torch's classes that graphpipe's subclass (torch 2.11 and 2.13 have them)
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        _PipelineSchedule,
    )
except ImportError as e:  # pragma: no cover - a torch that moved them
    raise ImportError(
        "graphpipe.integrations.torch_pipelining subclasses torch.distributed.pipelining's "
        "PipelineScheduleSingle, PipelineScheduleMulti and _PipelineSchedule, which torch "
        f"{torch.__version__} does not have where 2.11 to 2.13 do ({e})"
    ) from e

from graphpipe.errors import PipelineError
from graphpipe.meta import DTYPES
from graphpipe.runtime import PerMicrobatch, Pipeline
from graphpipe.runtime.core.batch import KwSig, describe_keywords, keywords_signature
from graphpipe.schedule.ir import Action, Op
from graphpipe.schedule.simulate import resolve_schedule

__all__ = [
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleZBVZeroBubble",
]

# Pipeline arguments the wrapper sets itself from torch's arguments.
_RESERVED = ("schedule", "num_microbatches", "loss_fn", "group", "loss_reduction")
# Pipeline.step's own keyword parameters: a keyword tensor of that name cannot pass through.
_STEP_PARAMETERS = ("scaler",)


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
    and non-tensor values that must stay the same. ``check`` raises for values ``set`` would
    refuse, and changes nothing."""

    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.values: dict[str, Any] = {}

    def check(self, given: Mapping[str, Any] | None) -> None:
        if given is not None and not isinstance(given, Mapping):
            raise TypeError(f"loss_kwargs must be a dict or None, got {type(given).__name__}")
        given = dict(given or {})
        if not self.capture or not self.values:
            return
        if set(given) != set(self.values):
            raise ValueError(
                f"loss_kwargs changed from {sorted(self.values)} to {sorted(given)} after "
                "capture: a captured step reads the same names every step"
            )
        for name, v in given.items():
            old = self.values[name]
            if isinstance(v, torch.Tensor):
                if not isinstance(old, torch.Tensor):
                    raise ValueError(
                        f"loss_kwargs[{name!r}] changed from {old!r} to a tensor after capture"
                    )
                if old.shape != v.shape or old.dtype != v.dtype or old.device != v.device:
                    raise ValueError(
                        f"loss_kwargs[{name!r}] changed from {list(old.shape)} {old.dtype} to "
                        f"{list(v.shape)} {v.dtype} after capture"
                    )
            elif isinstance(old, torch.Tensor) or old != v:
                raise ValueError(
                    f"loss_kwargs[{name!r}] changed from {old!r} to {v!r} after capture: a "
                    "captured step keeps non-tensor values; pass a tensor to change it"
                )

    def set(self, given: Mapping[str, Any] | None) -> None:
        self.check(given)
        given = dict(given or {})
        if not self.capture:
            self.values = given
            return
        for name, v in given.items():
            old = self.values.get(name)
            if isinstance(v, torch.Tensor):
                if old is None:
                    self.values[name] = v.detach().clone()
                else:
                    old.copy_(v)
            else:
                self.values[name] = v


def _keyword_parameters(module: Any) -> frozenset[str] | None:
    """The keywords a stage's ``forward`` takes, by the rule ``graphpipe.Pipeline`` routes
    keyword tensors with (runtime/core/stage.py ``_taken``: a compiled module's ``_orig_mod``,
    named parameters); None: any (``**kwargs``)."""
    fn = getattr(module, "_orig_mod", module)
    fn = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: takes none
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


@dataclass(frozen=True)
class _CallPart:
    """One rank's part of a call's agreement (``PipelineSchedule._agree``).

    call: ``"step"`` or ``"eval"``. error: why this rank refused its arguments
    (``"ValueError: ..."``), or None. keywords: the keyword tensors it passes
    (``keywords_signature``). per_microbatch: which of them are ``PerMicrobatch`` values.
    takes: ``(stage index, the keywords its forward takes, None: any)`` per stage of the rank.
    """

    call: str
    error: str | None
    keywords: KwSig
    per_microbatch: frozenset[str]
    takes: tuple[tuple[int, frozenset[str] | None], ...]


def _described(e: BaseException) -> str:
    """``"ValueError: <the first line of its message>"``."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _placeholder(descr: tuple[tuple[int, ...], ...]) -> Any:
    """A keyword value of the description ``descr`` that holds no memory (stride-0 views of
    one zero): what a rank that was not given a keyword passes to the pipeline, whose
    agreement checks every rank's keywords but which gives this rank's stages none of it
    (none of them takes it)."""
    ts = tuple(torch.zeros((), dtype=DTYPES[code]).expand(*shape) for code, *shape in descr)
    return ts[0] if len(ts) == 1 else ts


def _keyword_verdict(parts: Sequence[_CallPart], rank: int) -> dict[str, Any]:
    """The keywords of one call that this rank was not given and passes as placeholders (see
    the module doc); ``ValueError``, the same on every rank, for those that torch would route
    where graphpipe cannot (every rank reads the same ``parts``)."""
    given = [dict(p.keywords) for p in parts]
    names = sorted({name for g in given for name in g})
    out: dict[str, Any] = {}
    for name in names:
        passers = [r for r, g in enumerate(given) if name in g]
        lacking = [r for r in range(len(parts)) if r not in passers]
        if not lacking:
            continue  # passed everywhere: the pipeline's batch agreement compares them
        if any(name in parts[r].per_microbatch for r in passers):
            raise ValueError(
                f"keyword {name!r} holds values per micro-batch (kwarg_mbs that are not "
                f"tensors, or a PerMicrobatch) and was passed on rank(s) {passers} only: "
                f"graphpipe needs such a keyword on every rank; pass it on rank(s) {lacking} too"
            )
        first = passers[0]
        for r in passers[1:]:
            if given[r][name] != given[first][name]:
                raise ValueError(
                    f"keyword tensor {name!r} is not passed on rank(s) {lacking}, and the "
                    f"ranks that pass it differ: rank {first} has "
                    f"{describe_keywords(((name, given[first][name]),))}, rank {r} has "
                    f"{describe_keywords(((name, given[r][name]),))}"
                )
        for r in lacking:
            for stage, params in parts[r].takes:
                if params is None or name in params:
                    raise ValueError(
                        f"keyword tensor {name!r} was passed on rank(s) {passers} but not on "
                        f"rank {r}, whose stage {stage} takes it: torch gives each rank's "
                        f"keyword arguments to that rank's stages only, so it runs stage "
                        f"{stage} without {name!r}, while graphpipe gives a keyword to every "
                        f"stage that takes it; pass {name!r} on rank {r} too (its stages then "
                        f"get it), or give stage {stage}'s parameter another name"
                    )
        if rank in lacking:
            out[name] = _placeholder(given[first][name])
    return out


class PipelineSchedule(_PipelineSchedule):
    """A torch.distributed.pipelining schedule run by ``graphpipe.Pipeline``.

    Args:
        stages: this rank's ``PipelineStage`` objects (any order; their ``submod``,
            ``stage_index``, ``num_stages`` and ``group`` are read).
        n_microbatches: M (an int).
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
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
            raise TypeError(
                f"{name}: n_microbatches must be an int, got {type(n_microbatches).__name__} "
                f"{n_microbatches!r}"
            )
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
        self._has_backward = loss_fn is not None  # torch's attribute, for code that reads it
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
        self._num_stages = placement.num_stages
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
        self._rank, self._num_ranks = rank, n
        self._takes = tuple((s.stage_index, _keyword_parameters(s.submod)) for s in stages)
        self._schedule, self._group = built, group if distributed else None
        self._options = options
        self._pipe: Pipeline | None = None
        # The gloo groups of the calls' agreement (``_gloo``), and those it built.
        self._agreement_groups: dict[str, Any] = {}
        self._own_groups: list[Any] = []

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
        reserved = sorted(set(kwargs) & set(_STEP_PARAMETERS))
        if reserved:
            raise ValueError(
                f"keyword argument {reserved[0]!r} is the name of a parameter of "
                "graphpipe.Pipeline.step, so it cannot reach a stage: give the stage's "
                "parameter another name"
            )
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

    # -------------------------------------------------------------- the agreement
    def _gloo(self, which: str, group: Any) -> Any:
        """The group a call's agreement gathers over, for ``which`` (``"pipeline"``: the
        stages' group; ``"replicas"``: the ``dp_group``): ``group`` itself when it is gloo,
        else a gloo group of its ranks, built once (at the first call, which every rank
        makes): a gather over NCCL would wait for the device."""
        if which not in self._agreement_groups:
            if dist.get_backend(group) == "gloo":
                self._agreement_groups[which] = group
            else:
                ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
                timeout = self._options.get("timeout", 300.0)
                if not isinstance(timeout, datetime.timedelta):
                    timeout = datetime.timedelta(seconds=float(timeout))
                built = dist.new_group(
                    ranks, timeout=timeout, backend="gloo", use_local_synchronization=True
                )
                self._agreement_groups[which] = built
                self._own_groups.append(built)
        return self._agreement_groups[which]

    def _agree(
        self, call: str, error: BaseException | None, kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Every rank's outcome of its local checks, gathered before any rank runs the call
        (over the pipeline's ranks, then, for a step, over the data-parallel replicas):
        raises ``error`` (this rank's), a ``PipelineError`` naming the rank (or replica) that
        refused, or the ``ValueError`` of keywords the ranks pass in a way graphpipe cannot
        route as torch does, on every rank; else returns the placeholders of the keywords
        this rank was not given (``_keyword_verdict``)."""
        part = _CallPart(call, None, (), frozenset(), self._takes)
        if error is None:
            try:
                part = _CallPart(
                    call,
                    None,
                    keywords_signature(kwargs, self._n_microbatches),
                    frozenset(k for k, v in kwargs.items() if isinstance(v, PerMicrobatch)),
                    self._takes,
                )
            except (TypeError, ValueError) as e:
                error = e
        if error is not None:
            part = _CallPart(call, _described(error), (), frozenset(), ())
        if self._num_ranks == 1:
            parts = [part]
        else:
            parts = [None] * self._num_ranks
            dist.all_gather_object(parts, part, group=self._gloo("pipeline", self._group))
        # What this rank raises (None: the call runs) and why its pipeline does not run the
        # call (the same on each of its ranks), decided before the replicas' gather, which
        # every rank takes part in, so that no replica is left waiting in it.
        verdict: BaseException | None = error
        cause: str | None = None
        placeholders: dict[str, Any] = {}
        calls = [p.call for p in parts]
        refused = [r for r, p in enumerate(parts) if p.error is not None]
        if refused:
            r = refused[0]
            cause = f"its rank {r}: {parts[r].error}"
            if verdict is None:
                verdict = PipelineError(
                    f"{self._torch_name}: rank {r} refused the arguments of this {call}() "
                    f"({parts[r].error}); no rank ran it"
                )
        elif len(set(calls)) > 1:
            who = ", ".join(f"rank {r}: {c}()" for r, c in enumerate(calls))
            cause = f"its ranks are not in the same call ({who})"
            verdict = PipelineError(
                f"{self._torch_name}: the pipeline ranks are not in the same call ({who}): "
                "every rank calls step() (or eval()) together; no rank ran it"
            )
        else:
            try:
                placeholders = _keyword_verdict(parts, self._rank)
            except ValueError as e:
                cause, verdict = _described(e), e
        # The replicas agree in training steps only, as the pipeline's own agreement does
        # (an eval is each replica's own).
        dp_group = self._options.get("dp_group")
        if call == "step" and dp_group is not None and dist.get_world_size(dp_group) > 1:
            replicas: list[Any] = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(replicas, cause, group=self._gloo("replicas", dp_group))
            others = [d for d, c in enumerate(replicas) if c is not None]
            if verdict is None and others:
                d = others[0]
                verdict = PipelineError(
                    f"{self._torch_name}: data-parallel replica {d} refused this {call}() "
                    f"({replicas[d]}); no rank of any replica ran it"
                )
        if verdict is not None:
            raise verdict
        return placeholders

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
        (with its own arguments, as in torch); arguments refused on one rank raise on every
        rank before any runs the step."""
        error: Exception | None = None
        inputs = labels = None
        kw: dict[str, Any] = {}
        try:
            if self._loss_fn is None:
                raise RuntimeError(
                    f"{self._torch_name} was built with loss_fn=None: step() trains; use eval()"
                )
            if not torch.is_grad_enabled():
                raise RuntimeError(
                    f"{self._torch_name}.step() needs grad mode (it runs the backward); "
                    "call eval() for inference"
                )
            if losses is not None and not isinstance(losses, list):
                raise TypeError(f"losses must be a list but got a {type(losses).__name__}")
            if return_outputs and self._capture:
                raise ValueError(
                    "return_outputs=True cannot be served by a captured step (a replay runs no "
                    "Python that could collect the outputs): pass return_outputs=False"
                )
            if return_outputs and not self._outputs_in_order:
                raise ValueError(
                    "return_outputs=True: this schedule runs the last stage's forwards out of "
                    "micro-batch order, so the outputs cannot be merged in order; pass "
                    "return_outputs=False"
                )
            inputs, labels, kw = self._batch(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
            if self._last:
                self._loss_kwargs.check(loss_kwargs)
        except Exception as e:
            error = e
        kw = {**kw, **self._agree("step", error, kw)}
        if self._last:
            self._loss_kwargs.set(loss_kwargs)
        pipe = self.pipe
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

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """torch's entry point for micro-batches split already (its ``step`` splits, then
        calls it): ``step(arg_mbs=, kwarg_mbs=, target_mbs=)`` here."""
        return self.step(
            losses=losses,
            return_outputs=return_outputs,
            loss_kwargs=loss_kwargs,
            arg_mbs=arg_mbs,
            kwarg_mbs=kwarg_mbs,
            target_mbs=target_mbs,
        )

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
        torch). Always eager (also with ``capture``). Keyword arguments and refusals as for
        ``step``."""
        error: Exception | None = None
        inputs = labels = None
        kw: dict[str, Any] = {}
        try:
            if losses is not None and not isinstance(losses, list):
                raise TypeError(f"losses must be a list but got a {type(losses).__name__}")
            inputs, labels, kw = self._batch(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        except Exception as e:
            error = e
        kw = {**kw, **self._agree("eval", error, kw)}
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
        """``Pipeline.close`` (destroy captured graphs before the process group) when a call
        built it, and the agreement's own gloo group when one was built."""
        if self._pipe is not None:
            self._pipe.close()
        for group in self._own_groups:
            dist.destroy_process_group(group)
        self._own_groups, self._agreement_groups = [], {}


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

    from graphpipe.runtime.parts.fsdp import fsdp_modules, param_groups

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


class ScheduleDualPipeV(_OneSchedule, PipelineScheduleMulti):
    """torch's ``ScheduleDualPipeV`` (``stages``: this rank's two, stages ``r`` and
    ``2N-1-r``; ``n_microbatches >= 2N``), run as graphpipe's DualPipeV with its F&B overlap.
    See ``PipelineSchedule``."""

    _torch_name = "ScheduleDualPipeV"
    _schedule = "dualpipev"


class ScheduleZBVZeroBubble(_OneSchedule, PipelineScheduleMulti):
    """torch's ``ScheduleZBVZeroBubble`` (V placement, two stages per rank), as graphpipe's
    ``"zbv"``. See ``PipelineSchedule``."""

    _torch_name = "ScheduleZBVZeroBubble"
    _schedule = "zbv"


class _SingleStage(_OneSchedule, PipelineScheduleSingle):
    """A single-stage schedule: ``stage`` is this rank's ``PipelineStage`` (or a list of
    one), as for torch's ``PipelineScheduleSingle`` (which takes no ``use_full_backward``,
    ``backward_requires_autograd`` or ``defer_pp_recv``)."""

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
        if isinstance(stage, (list, tuple)) and len(stage) > 1:
            raise ValueError(
                f"{self._torch_name} runs one stage per rank, but this rank was given "
                f"{len(stage)} PipelineStage objects: pass its stage; for several stages per "
                "rank use ScheduleDualPipeV, ScheduleZBVZeroBubble or PipelineSchedule"
            )
        super().__init__(
            stage,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads=scale_grads,
            **kw,
        )
        self._stage = self._stages[0]  # torch's attribute, for code that reads it


class Schedule1F1B(_SingleStage):
    """torch's ``Schedule1F1B``: one ``PipelineStage`` per rank. See ``PipelineSchedule``."""

    _torch_name = "Schedule1F1B"
    _schedule = "1f1b"


class ScheduleGPipe(_SingleStage):
    """torch's ``ScheduleGPipe``: one stage per rank, every forward then every backward.
    See ``PipelineSchedule``."""

    _torch_name = "ScheduleGPipe"
    _schedule = "gpipe"
