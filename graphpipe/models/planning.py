"""Stage plans for real models: every layer measured on the micro-batch's shape, then
``graphpipe.plan_stages``.

``plan_hf_split(model, num_stages, input_ids=..., num_microbatches=M)`` plans a Hugging Face
causal LM, any that ``split_hf_causal_lm`` takes (the families of
``graphpipe.models.hf.SUPPORTED_MODEL_TYPES``, and others of their layouts that pass its
probe);
``plan_llama_split(config, num_stages, tokens=..., num_microbatches=M)`` the built-in model.
Both measure in this process, one piece at a time (``measure_stage``):

* the embedding alone (stage 0 without layers), every decoder layer as a one-layer stage (so
  each layer's cost includes the rotary embedding and the mask its stage builds: a stage of
  k layers is predicted as k of those, where the stage builds them once), and the final
  norm, the head and the loss together: the stages ``split_hf_causal_lm(model, L + 2,
  layers_per_stage=[0, 1, ..., 1, 0])`` (``build_stages`` for the built-in model) makes;
* ``reps`` rounds after one warm-up round, each in the order a step runs them: the forward
  (``F``) of every piece in turn, the full backward (``B``) of every piece in reverse, then
  the backward split as the pipeline splits it (``graphpipe.weightgrad``: ``I`` computes
  the input gradient, in reverse, the weight-gradient GEMMs of every ``nn.Linear`` are
  deferred to ``W``). So a piece's backward finds its weights and activations pushed out of
  the caches by the other pieces, as in a step, and a slow spell of a shared machine falls
  on all pieces alike. The gradients stay allocated from the warm-up on, so every backward
  adds into them as every micro-batch of a step but the first does (the first only stores
  its gradient: for an embedding of a large vocabulary that skips an add of the whole
  table, which made its ``I`` look several times its ``B``). Per action the median round:
  the prediction is of a typical step (``profiles/plan_check.py`` holds it against
  measured ones, docs/planning.md);
* on the CPU with as many intra-op threads as each rank of the pipeline will have
  (``rank_threads``: the cores over the ranks, as ``graphpipe.cmdline.launch`` sets them);
* memory: what autograd saves in the forward (tensors that are not parameters, each storage
  once: held until the backward), what the deferred GEMMs keep from ``I`` to ``W`` (each
  ``nn.Linear``'s input and output gradient), and the parameters with their gradients
  (twice the parameter bytes; optimizer state is not counted).

Each piece runs on a copy of its modules (``copy.deepcopy``), so the model's modules and
gradients are left as they were. ``num_microbatches`` may be a list of candidates: each is
measured on its own micro-batch shape and planned (under each of ``AUTO_SCHEDULES`` for
``schedule="auto"``), and ``schedule.planner.choose_plan`` chooses among the plans that fit
``memory_budget``: of those within ``tie_margin`` (``TIE_MARGIN``, 5%) of the fastest,
the one that holds least on the even split (bytes measured from shapes: the same in every
run), so that two runs on the same machine choose alike although their measured costs
differ a little; the plan's ``candidates`` and ``choice()`` say what it was chosen among
and why. A module whose weight gradient cannot be deferred to ``W``
(``weightgrad.make_deferrable`` warns per module and piece) is named in one warning for the
model when the schedule splits backwards into ``I`` and ``W``, and not at all under one
that does not (1F1B: nothing is deferred there).
"""

from __future__ import annotations

import contextlib
import copy
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from graphpipe.schedule.planner import (
    AUTO_SCHEDULES,
    LayerCost,
    MemoryBudgetExceeded,
    PlanProgress,
    StagePlan,
    choose_plan,
    plan_stages,
)

__all__ = ["TIE_MARGIN", "measure_stage", "plan_hf_split", "plan_llama_split", "rank_threads"]

TIE_MARGIN = 0.05
"""The default ``tie_margin`` of ``plan_hf_split`` and ``plan_llama_split``: plans whose
predicted steps are within 5% of the fastest are tied (see docs/planning.md for how much
measured predictions move between runs)."""


def _floats(out: Any) -> list[torch.Tensor]:
    """The float tensors of a stage's output (one tensor, or a tuple: MoE's (hidden, aux))."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def _saved_bytes(params: set[int]) -> tuple[Any, Callable[[], int]]:
    """A ``saved_tensors_hooks`` context that counts the bytes autograd saves (each storage
    once, parameters left out), and the function that reads the count."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    return hooks, lambda: sum(seen.values())


def _linear_bytes(module: nn.Module) -> tuple[list[Any], Callable[[], int]]:
    """Forward hooks on every ``nn.Linear``: the bytes of its input (each storage once) and of
    its output (its gradient's size), what a deferred weight-gradient GEMM keeps until W."""
    inputs: dict[int, int] = {}
    outputs = [0]

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        x = args[0]
        storage = x.untyped_storage()
        inputs[storage.data_ptr()] = storage.nbytes()
        outputs[0] += out.numel() * out.element_size()

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, nn.Linear)]
    return handles, lambda: sum(inputs.values()) + outputs[0]


class _Piece:
    """One piece (a copy of its modules) with its input, timed a round at a time."""

    def __init__(
        self,
        stage: nn.Module,
        x: torch.Tensor,
        kwargs: dict[str, Any] | None,
        loss: Callable[[Any], torch.Tensor] | None,
        parameter_bytes: int | None,
    ) -> None:
        from graphpipe.weightgrad import WeightGradStore, make_deferrable

        if parameter_bytes is None:
            parameter_bytes = 2 * sum(p.numel() * p.element_size() for p in stage.parameters())
        self.parameter_bytes = parameter_bytes
        self.mod = copy.deepcopy(stage)
        self.store = WeightGradStore()
        make_deferrable(self.mod, self.store, where=type(stage).__name__)
        self.x, self.kwargs, self.loss = x, dict(kwargs or {}), loss
        self.gen = torch.Generator(device=x.device).manual_seed(0)
        self.state: dict[str, Any] = {}
        self.times: dict[str, list[float]] = {k: [] for k in "FBIW"}

    def forward(self, split: bool = False) -> None:
        self.store.split = split
        x = self.x
        inp = x.detach().requires_grad_() if x.is_floating_point() else x
        out = self.mod(inp, **self.kwargs)
        if self.loss is not None:
            out = self.loss(out)
        outs = _floats(out)
        if self.loss is None:
            grads = [
                torch.randn(t.shape, generator=self.gen, device=t.device, dtype=t.dtype)
                for t in outs
            ]
        else:
            grads = [torch.ones_like(t) for t in outs]
        self.state["outs"], self.state["grads"] = outs, grads

    def _backward(self) -> None:
        self.store.accumulating = True
        try:
            torch.autograd.backward(self.state["outs"], self.state["grads"])
        finally:
            self.store.accumulating = False

    def _backward_input(self) -> None:
        with self.store.deferring("W"):
            torch.autograd.backward(self.state["outs"], self.state["grads"])

    def _weight(self) -> None:
        self.store.run("W")

    def _timed(self, fn: Callable[[], None]) -> float:
        cuda = self.x.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.x.device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(self.x.device)
        return time.perf_counter() - t0

    def timed(self, key: str, fn: Callable[[], None], keep: bool) -> None:
        """Run ``fn`` (one of F, B, I, W); ``keep``: count its time (else a warm-up)."""
        t = self._timed(fn)
        if keep:
            self.times[key].append(t)

    def cost(self) -> LayerCost:
        """The median rounds, and the bytes of one more forward (see the module doc)."""
        params = {p.untyped_storage().data_ptr() for p in self.mod.parameters()}
        hooks, saved = _saved_bytes(params)
        handles, linear = _linear_bytes(self.mod)
        try:
            with hooks:
                self.forward()
        finally:
            for h in handles:
                h.remove()
        self.state.clear()
        self.store.clear()
        med = {k: statistics.median(v) for k, v in self.times.items()}
        return LayerCost(
            forward=med["F"],
            backward_input=med["I"],
            backward_weight=med["W"],
            backward=med["B"],
            activation_bytes=saved(),
            weight_grad_bytes=linear(),
            parameter_bytes=self.parameter_bytes,
        )


def _measure(pieces: list[_Piece], reps: int, threads: int | None = None) -> list[LayerCost]:
    """One warm-up round, then ``reps`` rounds in a step's order (every piece's F, every B in
    reverse, every split forward, I in reverse, every W; see the module doc), with
    ``threads`` intra-op threads (None: torch's setting as it is)."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got reps={reps!r}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for rep in range(reps + 1):
            keep = rep > 0
            for piece in pieces:
                piece.timed("F", piece.forward, keep)
            for piece in reversed(pieces):
                piece.timed("B", piece._backward, keep)
            for piece in pieces:
                piece.forward(split=True)
            for piece in reversed(pieces):
                piece.timed("I", piece._backward_input, keep)
            for piece in pieces:
                piece.timed("W", piece._weight, keep)
                # the gradients stay allocated: every action after the warm-up adds into
                # them, as every micro-batch of a step but the first does (the first only
                # stores its own, which for an embedding's weight costs far less)
                piece.mod.zero_grad(set_to_none=False)
        return [piece.cost() for piece in pieces]
    finally:
        torch.set_num_threads(before)


def rank_threads(num_stages: int, schedule: str) -> int:
    """The intra-op threads ``graphpipe.cmdline.launch`` gives each CPU rank of a pipeline of
    ``num_stages`` stages under ``schedule`` (a name, or ``"auto"``) on this machine: the
    cores over the ranks."""
    import os

    from graphpipe.schedule.generators import SCHEDULES

    if schedule != "auto" and schedule not in SCHEDULES:
        raise ValueError(
            f'unknown schedule {schedule!r}: expected "auto" or one of {sorted(SCHEDULES)}'
        )
    per_rank = 2 if schedule == "auto" else SCHEDULES[schedule].stages_per_rank
    return max(1, (os.cpu_count() or 1) // max(1, num_stages // per_rank))


def _threads(
    threads: int | None, device: torch.device, num_stages: int, schedule: str
) -> int | None:
    """The threads to measure with (see ``plan_hf_split``); checks ``schedule`` first."""
    default = rank_threads(num_stages, schedule)
    if threads is not None:
        return _check_int("threads", threads)
    return default if device.type == "cpu" else None


def measure_stage(
    stage: nn.Module,
    x: torch.Tensor,
    *,
    kwargs: dict[str, Any] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    reps: int = 3,
    parameter_bytes: int | None = None,
) -> LayerCost:
    """What one micro-batch ``x`` costs in ``stage`` (a copy of it is measured; see the
    module doc): F, B, I, W seconds (the median of ``reps`` after one warm-up), activation and
    weight-gradient bytes, and ``parameter_bytes`` (default: twice the stage's parameter
    bytes, for the parameters and their gradients).

    kwargs: keyword tensors of the stage's forward (an attention mask). loss: applied to the
    output of a last stage (its backward starts from the loss); other stages' backward
    starts from a fixed random output gradient.
    """
    return _measure([_Piece(stage, x, kwargs, loss, parameter_bytes)], reps)[0]


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    return value


def _candidates(num_microbatches: int | Sequence[int], batch: int) -> list[int]:
    values = (
        list(num_microbatches) if isinstance(num_microbatches, Sequence) else [num_microbatches]
    )
    if not values:
        raise ValueError("num_microbatches: no candidate given")
    for m in values:
        _check_int("num_microbatches", m)
        if batch % m:
            raise ValueError(
                f"the batch of {batch} rows does not split into num_microbatches={m} equal "
                "micro-batches"
            )
    return values


def _schedules(schedule: str, num_stages: int) -> list[str]:
    """The schedules to plan for: ``schedule``, or ``AUTO_SCHEDULES`` for ``"auto"``."""
    if schedule != "auto":
        return [schedule]
    if num_stages % 2:
        raise ValueError(
            f'schedule="auto" chooses among {", ".join(AUTO_SCHEDULES)}, which place two '
            f"stages on each rank: num_stages={num_stages} is odd"
        )
    return list(AUTO_SCHEDULES)


def _defers(schedules: list[str], num_stages: int, candidates: list[int]) -> bool:
    """Whether any of ``schedules`` splits a backward into I and W for any of the
    micro-batch counts (sizes a schedule refuses count as not)."""
    from graphpipe.schedule import packed
    from graphpipe.schedule.generators import SCHEDULES

    for name in schedules:
        kind = SCHEDULES.get(name)
        if kind is None or num_stages % kind.stages_per_rank:
            continue
        for m in candidates:
            try:
                cells = kind.cells(num_stages // kind.stages_per_rank, m)
            except ValueError:
                continue
            if (packed.op_of(cells.first[cells.first >= 0]) == packed.W).any():
                return True
    return False


@contextlib.contextmanager
def _deferral_warnings(model: nn.Module, deferred: bool) -> Iterator[None]:
    """Around building the pieces: ``make_deferrable`` warns once per piece for every module
    whose weight gradient it cannot defer to W. Under a schedule without W (1F1B) nothing is
    deferred anyway: say nothing; under one that defers, one warning for the whole model.
    Other warnings pass as they were."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    kinds: dict[str, int] = {}
    for w in caught:
        text = str(w.message)
        found = re.match(r"graphpipe: \S+ \(([\w.]+)\) is not deferred", text)
        if found is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            kinds[found[1]] = kinds.get(found[1], 0) + 1
    if kinds and deferred:
        names = ", ".join(f"{count} {cls.rsplit('.', 1)[-1]}" for cls, count in kinds.items())
        warnings.warn(
            f"graphpipe: {type(model).__name__}: modules whose weight gradients cannot be "
            f"deferred to W ({names}, counted over the pieces measured) compute them during "
            "I: the plan's I includes them, and the pipeline's I will too",
            UserWarning,
            stacklevel=4,
        )


def plan_hf_split(
    model: nn.Module,
    num_stages: int,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    num_microbatches: int | Sequence[int],
    schedule: str = "dualpipev",
    memory_budget: float | None = None,
    reps: int = 3,
    p2p: float = 0.0,
    threads: int | None = None,
    tie_margin: float = TIE_MARGIN,
    progress: Callable[[PlanProgress], None] | None = None,
) -> StagePlan:
    """Measure a Hugging Face causal LM on one micro-batch of ``input_ids`` (``[B, T]``, the
    whole step's batch: a micro-batch is ``B / num_microbatches`` rows of it, with the same
    rows of ``attention_mask`` and ``labels``) and plan its split into ``num_stages`` stages
    (``graphpipe.plan_stages``, with the schedule, budget and ``p2p`` given here).

    threads: torch's intra-op threads while measuring on the CPU (default ``rank_threads``:
    what each rank of the planned pipeline gets from ``graphpipe.cmdline.launch`` on this machine,
    so that a piece costs what it will cost on its rank); restored afterwards.
    tie_margin: with several candidates (``schedule="auto"``, several ``num_microbatches``),
    the plans within this fraction of the fastest predicted step count as tied, and the one
    that holds least on the even split wins (``schedule.planner.choose_plan``): measured
    costs vary from run to run, and the choice should not follow the noise.
    progress: passed to ``plan_stages`` (a ``PlanProgress`` after every batch of
    simulations).

    Returns the ``StagePlan``; its ``layers_per_stage`` (``num_stages`` counts summing to
    ``config.num_hidden_layers``) is what ``split_hf_causal_lm(model, num_stages,
    layers_per_stage=...)`` takes. The loss is ``causal_lm_loss`` (labels default to
    ``input_ids``). Raises ``ValueError`` for a model ``split_hf_causal_lm`` refuses, a batch
    that does not split into ``num_microbatches``, or (``MemoryBudgetExceeded``) no plan that
    fits ``memory_budget``.
    """
    from graphpipe.models.hf import causal_lm_loss

    pieces = _one_layer_stages(model)  # the model's checks; its modules, not copies
    _check_int("num_stages", num_stages)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, seq] tensor, got {_shape(input_ids)}")
    for name, t in (("attention_mask", attention_mask), ("labels", labels)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != input_ids.shape):
            raise ValueError(
                f"{name} must have the shape of input_ids {list(input_ids.shape)}, got {_shape(t)}"
            )
    labels = input_ids if labels is None else labels
    threads = _threads(threads, input_ids.device, num_stages, schedule)
    names = _schedules(schedule, num_stages)
    candidates = _candidates(num_microbatches, input_ids.shape[0])
    deferred = _defers(names, num_stages, candidates)
    plans: list[StagePlan] = []
    for m in candidates:
        rows = input_ids.shape[0] // m
        ids, lab = input_ids[:rows], labels[:rows]
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask[:rows]}
        with torch.no_grad():
            hidden = pieces[0](ids, **kwargs)
        with _deferral_warnings(model, deferred and m == candidates[0]):
            parts = [_Piece(pieces[0], ids, kwargs, None, None)]
            parts += [_Piece(piece, hidden, kwargs, None, None) for piece in pieces[1:-1]]
            parts.append(
                _Piece(
                    pieces[-1],
                    hidden,
                    kwargs,
                    lambda logits, lab=lab: causal_lm_loss(logits, lab),
                    None,
                )
            )
        first, *layers, last = _measure(parts, reps, threads)
        plans += _plan_one(
            layers, first, last, pieces, num_stages, m, names, memory_budget, p2p, progress
        )
    return choose_plan(plans, tie_margin=tie_margin)


def _plan_one(
    layers: list[LayerCost],
    first: LayerCost,
    last: LayerCost,
    pieces: list[nn.Module],
    num_stages: int,
    m: int,
    schedules: list[str],
    memory_budget: float | None,
    p2p: float,
    progress: Callable[[PlanProgress], None] | None,
) -> list[StagePlan]:
    """``plan_stages`` of the measured costs for ``m`` micro-batches under each of
    ``schedules``: the plans (a budget refusal gives its closest plan, which does not fit;
    with several schedules, one whose sizes do not run is left out)."""
    out, refused = [], []
    for name in schedules:
        try:
            out.append(
                plan_stages(
                    layers,
                    num_stages,
                    num_microbatches=m,
                    schedule=name,
                    first_costs=first,
                    last_costs=last,
                    memory_budget=memory_budget,
                    p2p=p2p,
                    tied_parameter_bytes=_shared_bytes(pieces[0], pieces[-1]),
                    progress=progress,
                )
            )
        except MemoryBudgetExceeded as e:
            out.append(e.closest)
        except ValueError as e:  # the schedule's own sizes (DualPipeV: M >= 2N)
            if len(schedules) == 1:
                raise
            refused.append(f"{name}: {e}")
    if not out:
        raise ValueError('schedule="auto": no schedule runs here: ' + "; ".join(refused))
    return out


def _shared_bytes(a: nn.Module, b: nn.Module) -> int:
    """Twice the bytes of the parameters ``a`` and ``b`` share (a tied embedding and head)."""
    mine = {id(p) for p in a.parameters()}
    return 2 * sum(p.numel() * p.element_size() for p in b.parameters() if id(p) in mine)


def _one_layer_stages(model: nn.Module) -> list[nn.Module]:
    """``model`` as ``split_hf_causal_lm`` splits it into ``L + 2`` stages: the embedding
    alone, one decoder layer each, the final norm and head alone (the model's modules)."""
    from graphpipe.models.hf import split_hf_causal_lm

    (whole,) = split_hf_causal_lm(model, 1)
    n = len(whole.layers)
    return split_hf_causal_lm(model, n + 2, layers_per_stage=[0] + [1] * n + [0])


def plan_llama_split(
    config: Any,
    num_stages: int,
    *,
    tokens: torch.Tensor,
    num_microbatches: int | Sequence[int],
    schedule: str = "dualpipev",
    memory_budget: float | None = None,
    reps: int = 3,
    p2p: float = 0.0,
    threads: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    tie_margin: float = TIE_MARGIN,
    progress: Callable[[PlanProgress], None] | None = None,
) -> StagePlan:
    """``plan_hf_split`` for the built-in model of ``config`` (a ``LlamaConfig``; built here
    with ``seed`` and ``dtype`` on ``device``, default ``tokens``' device): ``tokens``
    ``[B, T]`` is the step's batch, the loss ``LlamaLoss``. Its ``layers_per_stage`` is what
    ``build_stages(config, num_stages, layers_per_stage=...)`` and ``graphpipe train
    --layers-per-stage`` take."""
    from graphpipe.models.llama import LlamaLoss, build_stages

    _check_int("num_stages", num_stages)
    if config.num_experts:
        raise ValueError(
            f"plan_llama_split: a model with experts (num_experts={config.num_experts}) is "
            "not planned: its stages carry the load-balancing loss beside the hidden states, "
            "which measure_stage does not feed"
        )
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"tokens must be a [batch, seq] tensor, got {_shape(tokens)}")
    device = tokens.device if device is None else torch.device(device)
    tokens = tokens.to(device)
    threads = _threads(threads, device, num_stages, schedule)
    n = config.n_layers
    # one stage per layer, the embedding and the head alone: every piece is measured apart
    pieces = build_stages(
        config,
        n + 2,
        seed=seed,
        dtype=dtype,
        device=device,
        layers_per_stage=[0] + [1] * n + [0],
    )
    loss_fn = LlamaLoss(config.use_kernels)
    names = _schedules(schedule, num_stages)
    candidates = _candidates(num_microbatches, tokens.shape[0])
    deferred = _defers(names, num_stages, candidates)
    plans: list[StagePlan] = []
    for m in candidates:
        rows = tokens.shape[0] // m
        x = labels = tokens[:rows]  # the loss's cost does not depend on the labels' values
        with torch.no_grad():
            hidden = pieces[0](x)
        with _deferral_warnings(pieces[0], deferred and m == candidates[0]):
            parts = [_Piece(pieces[0], x, None, None, None)]
            parts += [_Piece(piece, hidden, None, None, None) for piece in pieces[1:-1]]
            parts.append(
                _Piece(
                    pieces[-1], hidden, None, lambda out, labels=labels: loss_fn(out, labels), None
                )
            )
        first, *layers, last = _measure(parts, reps, threads)
        plans += _plan_one(
            layers, first, last, pieces, num_stages, m, names, memory_budget, p2p, progress
        )
    return choose_plan(plans, tie_margin=tie_margin)


def _shape(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
