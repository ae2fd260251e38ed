"""Stage plans for real models: every layer measured on the micro-batch's shape, then
``graphpipe.plan_stages``.

``plan_hf_split(model, num_stages, input_ids=..., num_microbatches=M)`` plans a Hugging Face
``LlamaForCausalLM`` (or Mistral, Qwen2, Qwen3: what ``split_hf_causal_lm`` takes);
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
  on all pieces alike. Per action the median round: the prediction is of a typical step
  (``profiles/plan_check.py`` holds it against measured ones, docs/planning.md);
* on the CPU with as many intra-op threads as each rank of the pipeline will have
  (``rank_threads``: the cores over the ranks, as ``graphpipe.launch`` sets them);
* memory: what autograd saves in the forward (tensors that are not parameters, each storage
  once: held until the backward), what the deferred GEMMs keep from ``I`` to ``W`` (each
  ``nn.Linear``'s input and output gradient), and the parameters with their gradients
  (twice the parameter bytes; optimizer state is not counted).

Each piece runs on a copy of its modules (``copy.deepcopy``), so the model's modules and
gradients are left as they were. ``num_microbatches`` may be a list of candidates: each is
measured on its own micro-batch shape and planned, and the fastest plan that fits
``memory_budget`` is returned.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from graphpipe.planner import LayerCost, MemoryBudgetExceeded, StagePlan, plan_stages

__all__ = ["measure_stage", "plan_hf_split", "plan_llama_split", "rank_threads"]


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
                piece.mod.zero_grad(set_to_none=True)
        return [piece.cost() for piece in pieces]
    finally:
        torch.set_num_threads(before)


def rank_threads(num_stages: int, schedule: str) -> int:
    """The intra-op threads ``graphpipe.launch`` gives each CPU rank of a pipeline of
    ``num_stages`` stages under ``schedule`` (a name, or ``"auto"``) on this machine: the
    cores over the ranks."""
    import os

    from graphpipe.schedules import SCHEDULES

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


def _best(plans: list[StagePlan], refused: list[MemoryBudgetExceeded]) -> StagePlan:
    """The fastest plan, or (none fits the budget) the refusal that comes closest."""
    if plans:
        return min(plans, key=lambda p: p.predicted_step_s)
    raise min(refused, key=lambda e: e.shortfall)


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
) -> StagePlan:
    """Measure a Hugging Face causal LM on one micro-batch of ``input_ids`` (``[B, T]``, the
    whole step's batch: a micro-batch is ``B / num_microbatches`` rows of it, with the same
    rows of ``attention_mask`` and ``labels``) and plan its split into ``num_stages`` stages
    (``graphpipe.plan_stages``, with the schedule, budget and ``p2p`` given here).

    threads: torch's intra-op threads while measuring on the CPU (default ``rank_threads``:
    what each rank of the planned pipeline gets from ``graphpipe.launch`` on this machine,
    so that a piece costs what it will cost on its rank); restored afterwards.

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
    plans: list[StagePlan] = []
    refused: list[MemoryBudgetExceeded] = []
    for m in _candidates(num_microbatches, input_ids.shape[0]):
        rows = input_ids.shape[0] // m
        ids, lab = input_ids[:rows], labels[:rows]
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask[:rows]}
        with torch.no_grad():
            hidden = pieces[0](ids, **kwargs)
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
        _plan_one(
            plans, refused, layers, first, last, pieces, num_stages, m, schedule, memory_budget, p2p
        )
    return _best(plans, refused)


def _plan_one(
    plans: list[StagePlan],
    refused: list[MemoryBudgetExceeded],
    layers: list[LayerCost],
    first: LayerCost,
    last: LayerCost,
    pieces: list[nn.Module],
    num_stages: int,
    m: int,
    schedule: str,
    memory_budget: float | None,
    p2p: float,
) -> None:
    """``plan_stages`` of the measured costs for ``m`` micro-batches: the plan into ``plans``,
    or a budget refusal into ``refused``."""
    try:
        plans.append(
            plan_stages(
                layers,
                num_stages,
                num_microbatches=m,
                schedule=schedule,
                first_costs=first,
                last_costs=last,
                memory_budget=memory_budget,
                p2p=p2p,
                tied_parameter_bytes=_shared_bytes(pieces[0], pieces[-1]),
            )
        )
    except MemoryBudgetExceeded as e:
        refused.append(e)


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
    plans: list[StagePlan] = []
    refused: list[MemoryBudgetExceeded] = []
    for m in _candidates(num_microbatches, tokens.shape[0]):
        rows = tokens.shape[0] // m
        x = labels = tokens[:rows]  # the loss's cost does not depend on the labels' values
        with torch.no_grad():
            hidden = pieces[0](x)
        parts = [_Piece(pieces[0], x, None, None, None)]
        parts += [_Piece(piece, hidden, None, None, None) for piece in pieces[1:-1]]
        parts.append(
            _Piece(pieces[-1], hidden, None, lambda out, labels=labels: loss_fn(out, labels), None)
        )
        first, *layers, last = _measure(parts, reps, threads)
        _plan_one(
            plans, refused, layers, first, last, pieces, num_stages, m, schedule, memory_budget, p2p
        )
    return _best(plans, refused)


def _shape(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
