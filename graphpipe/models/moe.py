"""Mixture-of-experts feed-forward with a fixed expert capacity, and expert parallelism.

``MoEMLP`` replaces a block's SwiGLU MLP by ``num_experts`` SwiGLU experts and a router:

* **Router.** ``logits = router(x)`` (an ``nn.Linear``, computed in at least float32), softmax
  over all experts, then the top-k experts per token; each chosen expert's output is
  weighted by its softmax probability (not renormalized over the k: GShard / Switch style, so
  the router also learns from the language-model loss when ``k = 1``).
* **Capacity.** Each expert takes at most ``C = min(N, ceil(capacity_factor * N * k / E))``
  of the ``N`` tokens of a micro-batch (on each rank). Slots are given in priority order:
  every token's first choice, in token order, before any second choice, and so on; an
  assignment past ``C`` is dropped (its token gets nothing from that expert; the residual
  carries it). Every shape follows from ``N`` alone: the tokens are scattered into a fixed
  ``[E, C, H]`` buffer (``index_copy`` into one spare row for the dropped ones, which is cut
  off), gathered back with ``index_select``; no boolean indexing, no ``.item()``.
* **Dropped tokens.** ``dropped`` (an int64 buffer, on the device) adds up the dropped
  (token, expert) assignments of every forward; read it once per step
  (``dropped_tokens``), zero it with ``reset_dropped_tokens``.
* **Load-balancing loss.** Switch Transformer's ``E * sum_e f_e * P_e`` over the micro-batch
  (``f_e``: the fraction of the ``N * k`` assignments that chose expert ``e``, before capacity;
  ``P_e``: the mean router probability of ``e``); 1 when balanced. ``route`` returns it
  times ``aux_loss_coef``; the stage adds it to the loss it carries (see ``LlamaMoEStage``).
* **Expert parallelism.** With ``ep_group`` of size ``ep`` (which divides ``E``), this rank
  holds experts ``[rank * E/ep, (rank + 1) * E/ep)``. The dispatch buffer ``[E, C, H]`` is
  ``[ep, E/ep, C, H]``: an ``all_to_all_single`` with equal splits sends block ``r`` to rank
  ``r`` and brings each rank ``[ep (source), E/ep, C, H]``; the experts run on
  ``[E/ep, ep * C, H]``; a second all-to-all brings the outputs home. Every rank of the
  group must route micro-batches of the same number of tokens.

**Expert parameters** (``w_gate``, ``w_up``, ``w_down``: this rank's experts, stacked) are
marked with ``graphpipe.mark_expert(param, ep)`` (``is_expert_parameter``,
``expert_parameters``), which is how the runtime learns of them. Their
gradient on one rank already sums the contributions of every rank of its ``ep_group`` (the
tokens came from all of them). Data parallelism must therefore treat them apart: see
``expert_parallel_groups`` for the groups and the rule.

The weight-gradient GEMMs of the experts can be deferred to the pipeline's ``W`` actions
(``bind_weight_grad_store``); the router is a plain ``nn.Linear`` and defers like every other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.roles import EXPERT_ATTR, ExpertGroups, expert_parallel_size, mark_expert
from graphpipe.roles import is_expert as is_expert_parameter
from graphpipe.weightgrad import _accumulate

__all__ = [
    "EXPERT_ATTR",
    "ExpertGroups",
    "MoEMLP",
    "Routing",
    "dropped_tokens",
    "expert_capacity",
    "expert_layout",
    "expert_parallel_groups",
    "expert_parallel_size",
    "expert_parameters",
    "is_expert_parameter",
    "reset_dropped_tokens",
    "route_top_k",
]


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for ``tokens`` tokens: ``min(tokens, ceil(c * tokens * k / E))``, at
    least 1 (a token never picks one expert twice, so ``tokens`` slots never drop)."""
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


class Routing(NamedTuple):
    """What ``route_top_k`` decides for ``N`` tokens, ``k`` choices each (choice-major:
    entry ``j * N + t`` is token ``t``'s ``j``-th choice)."""

    slots: torch.Tensor
    """int64 ``[k * N]``: ``expert * C + position``, or ``E * C`` when dropped."""
    weights: torch.Tensor
    """``[k * N]``: the router probability of each choice (float32 or wider)."""
    aux: torch.Tensor
    """``[1]``: the load-balancing loss, unscaled (1 when balanced)."""
    dropped: torch.Tensor
    """int64 0-dim: how many of the ``k * N`` assignments were past the capacity."""


def route_top_k(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Top-k softmax routing of ``logits`` ``[N, E]`` into ``capacity`` slots per expert."""
    n, e = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top_p, top_e = probs.topk(top_k, dim=-1)  # [N, k]
    choice = top_e.t().reshape(-1)  # choice-major: all first choices first
    # [k * N, E] one-hot by scatter: F.one_hot checks the class range with .item() on CPU
    onehot = torch.zeros(choice.numel(), e, dtype=torch.int64, device=choice.device)
    onehot.scatter_(1, choice.unsqueeze(1), 1)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in the expert's queue
    kept = position < capacity
    slots = torch.where(kept, choice * capacity + position, e * capacity)
    fraction = onehot.sum(0).to(probs.dtype) / (n * top_k)
    aux = (e * (fraction * probs.mean(0)).sum()).reshape(1)
    dropped = (~kept).sum()
    return Routing(slots, top_p.t().reshape(-1), aux, dropped)


def _dispatch(x: torch.Tensor, slots: torch.Tensor, top_k: int, shape: tuple) -> torch.Tensor:
    """Tokens ``x`` ``[N, H]`` into the expert buffer of ``shape`` ``(E, C, H)`` (zeros where
    no token landed); the dropped ones go to a spare last row that is cut off."""
    e, c, h = shape
    buf = x.new_zeros(e * c + 1, h).index_copy(0, slots, x.repeat(top_k, 1))
    return buf[: e * c].view(e, c, h)


def _combine(
    y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The experts' outputs ``y`` ``[E, C, H]`` back to the ``N`` tokens, each choice weighted
    by its router probability and the ``k`` choices summed (a dropped one reads a zero row)."""
    h = y.shape[-1]
    padded = torch.cat((y.reshape(-1, h), y.new_zeros(1, h)))
    rows = padded.index_select(0, slots) * weights.unsqueeze(1).to(y.dtype)
    return rows.view(top_k, -1, h).sum(0)


def _expert_weight_grad(param: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> None:
    _accumulate(param, torch.bmm(x.transpose(1, 2), g))


class _ExpertMatmul(torch.autograd.Function):
    """``bmm(x, w)`` whose weight gradient goes through the stage's ``WeightGradStore``."""

    @staticmethod
    def forward(ctx, x, w, param, store):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.param, ctx.store = param, store
        return torch.bmm(x, w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        gx = torch.bmm(g, w.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1] or ctx.store.defer(_expert_weight_grad, ctx.param, x, g):
            return gx, None, None, None
        return gx, torch.bmm(x.transpose(1, 2), g), None, None


def _bmm(x: torch.Tensor, w: nn.Parameter, store: Any) -> torch.Tensor:
    if store is None or not store.split or not torch.is_grad_enabled():
        return torch.bmm(x, w)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            return _ExpertMatmul.apply(x.to(dt), w.to(dt), w, store)
    return _ExpertMatmul.apply(x, w, w, store)


class _AllToAll(torch.autograd.Function):
    """A blocking, differentiable all-to-all with equal splits (its own adjoint)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g.contiguous(), group=ctx.group)
        return out, None


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class MoEMLP(nn.Module):
    """Router + ``num_experts`` SwiGLU experts (this rank's share of them); see the module
    docstring. ``swiglu(gate, up)`` is the activation (the block's, kernels or torch).

    Parts, for a chunked caller (``LlamaMoEStage``): ``route`` (router, capacity, dispatch
    buffer), the exchange of that buffer over ``ep_group``, ``experts``, the exchange back,
    ``combine``. ``forward`` runs them all at once (blocking exchanges).
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float,
        aux_loss_coef: float,
        swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        ep_group: Any = None,
    ) -> None:
        super().__init__()
        ep, rank = _group_size_rank(ep_group)
        if num_experts % ep:
            raise ValueError(
                f"the expert-parallel group has {ep} ranks, which does not divide "
                f"num_experts={num_experts}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.swiglu = swiglu
        self.ep_group = ep_group if ep > 1 else None
        self.ep_size, self.ep_rank = ep, rank
        self.local_experts = num_experts // ep
        self.router = nn.Linear(hidden, num_experts, bias=False)
        e = self.local_experts
        self.w_gate = nn.Parameter(torch.empty(e, hidden, ffn_hidden))
        self.w_up = nn.Parameter(torch.empty(e, hidden, ffn_hidden))
        self.w_down = nn.Parameter(torch.empty(e, ffn_hidden, hidden))
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        self.mark_experts()
        self._store: Any = None

    @property
    def first_expert(self) -> int:
        """Global index of this rank's first expert."""
        return self.ep_rank * self.local_experts

    def mark_experts(self) -> None:
        """Set the expert marker on this rank's expert weights (again, after a conversion
        that made new Parameter objects)."""
        for p in (self.w_gate, self.w_up, self.w_down):
            mark_expert(p, self.ep_size)

    def bind_weight_grad_store(self, store: Any) -> None:
        """graphpipe's hook: the experts' weight-gradient GEMMs defer through ``store``."""
        self._store = store

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a micro-batch of ``tokens`` tokens (``expert_capacity``)."""
        return expert_capacity(tokens, self.num_experts, self.top_k, self.capacity_factor)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """Tokens ``x`` ``[N, H]`` -> (dispatch buffer ``[E, C, H]``, routing); the routing's
        ``aux`` is scaled by ``aux_loss_coef``. Adds the dropped count to ``dropped``."""
        n, h = x.shape
        logits = self.router(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        cap = self.capacity(n)
        r = route_top_k(logits, self.top_k, cap)
        with torch.no_grad():
            self.dropped.add_(r.dropped)
        buf = _dispatch(x, r.slots, self.top_k, (self.num_experts, cap, h))
        return buf, r._replace(aux=r.aux * self.aux_loss_coef)

    def experts(self, received: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``received`` ``[ep, E/ep, C, H]`` (each source rank's
        tokens for them); the outputs in the same layout."""
        ep, e, c, h = received.shape
        x = received.transpose(0, 1).reshape(e, ep * c, h)
        store = self._store
        hidden = self.swiglu(_bmm(x, self.w_gate, store), _bmm(x, self.w_up, store))
        y = _bmm(hidden, self.w_down, store)
        return y.view(e, ep, c, h).transpose(0, 1).contiguous()

    def combine(self, back: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts' outputs for this rank's tokens, ``back`` ``[E, C, H]``, to ``[N, H]``."""
        return _combine(back, routing.slots, routing.weights, self.top_k)

    def to_ranks(self, buf: torch.Tensor) -> torch.Tensor:
        """``[E, C, H]`` as the ``[ep, E/ep, C, H]`` blocks one exchange sends."""
        return buf.view(self.ep_size, self.local_experts, *buf.shape[1:])

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """The blocking, differentiable all-to-all of ``x`` over ``ep_group`` (local: ``x``)."""
        if self.ep_group is None:
            return x
        return _AllToAll.apply(x, self.ep_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., H]`` -> (``[..., H]``, the scaled load-balancing loss ``[1]``), unchunked."""
        shape = x.shape
        buf, routing = self.route(x.reshape(-1, shape[-1]))
        y = self.exchange(self.experts(self.exchange(self.to_ranks(buf))))
        out = self.combine(y.view(buf.shape), routing)
        return out.view(shape), routing.aux

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts} (local {self.first_expert}.."
            f"{self.first_expert + self.local_experts - 1}), top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}, ep={self.ep_size}"
        )


# --------------------------------------------------------------------------- helpers


def _modules(modules: Iterable[nn.Module] | nn.Module) -> list[nn.Module]:
    return [modules] if isinstance(modules, nn.Module) else list(modules)


def expert_parameters(modules: Iterable[nn.Module] | nn.Module) -> list[nn.Parameter]:
    """The expert weights of every ``MoEMLP`` in ``modules``, each once, marked again."""
    seen: dict[int, nn.Parameter] = {}
    for mod in _modules(modules):
        for m in mod.modules():
            if isinstance(m, MoEMLP):
                m.mark_experts()
                for p in (m.w_gate, m.w_up, m.w_down):
                    seen.setdefault(id(p), p)
    return list(seen.values())


def dropped_tokens(modules: Iterable[nn.Module] | nn.Module) -> torch.Tensor:
    """The dropped assignments counted by every ``MoEMLP`` in ``modules`` since the last
    reset, summed on the device (int64 0-dim; no host synchronization)."""
    counters = [
        m.dropped for mod in _modules(modules) for m in mod.modules() if isinstance(m, MoEMLP)
    ]
    if not counters:
        return torch.zeros((), dtype=torch.int64)
    return torch.stack(counters).sum()


def reset_dropped_tokens(modules: Iterable[nn.Module] | nn.Module) -> None:
    """Zero the dropped-token counters in place (static tensors: safe around a replay)."""
    for mod in _modules(modules):
        for m in mod.modules():
            if isinstance(m, MoEMLP):
                m.dropped.zero_()


def expert_layout(dp_ranks: Sequence[int], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """The expert groups inside one data-parallel group of ``dp_ranks`` (global ranks, in
    group order): ``(ep groups, expert-data-parallel groups)``.

    ep groups are consecutive blocks of ``ep`` replicas (each holds all ``E`` experts among
    its members); expert-data-parallel groups join the members at the same place of every
    block (they hold the same experts). ``ValueError`` unless ``ep`` divides the group size.
    """
    d = len(dp_ranks)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or d % ep:
        raise ValueError(
            f"ep={ep!r} must be a positive divisor of the data-parallel group size {d}"
        )
    ranks = list(dp_ranks)
    blocks = [ranks[i : i + ep] for i in range(0, d, ep)]
    strides = [ranks[j::ep] for j in range(ep)]
    return blocks, strides


def expert_parallel_groups(ep: int, dp_group: Any = None) -> ExpertGroups:
    """``(ep_group, expert_dp_group)`` of this rank, carved out of ``dp_group`` (default: the
    world) as ``expert_layout`` says. Collective over the world: every process calls it, with
    the same ``ep``, and all data-parallel groups (of every pipeline position) are split.

    ``Pipeline(..., dp_group=dp_group, expert_groups=...)`` applies the rule below.
    The contract with data-parallel gradient averaging over ``dp_group`` (size ``D``):
    non-expert parameters are averaged over ``dp_group`` (sum / ``D``) as usual; an expert
    parameter (``is_expert_parameter``) must **not** be: its gradient is summed over
    ``expert_dp_group`` (the ``D / ep`` ranks that hold the same experts) and divided by
    ``D`` (not by ``D / ep``: each copy already holds the sum over its ``ep`` group's
    replicas). Likewise the initial broadcast that makes replicas equal must skip expert
    parameters, or broadcast them over ``expert_dp_group`` only. With ``ep = D`` the
    expert-data-parallel groups have one rank: divide by ``D``, communicate nothing. A global
    gradient norm adds the experts' share over ``ep_group`` (each rank holds ``E / ep`` of
    them) before summing over the pipeline.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("expert_parallel_groups needs torch.distributed to be initialized")
    group = dp_group if dp_group is not None else dist.group.WORLD
    mine = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    expert_layout(mine, ep)  # ValueError before any collective
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    everyone = sorted({tuple(g) for g in gathered})
    me = dist.get_rank()
    ep_group = edp_group = None
    for ranks in everyone:  # every process creates every group, in the same order
        blocks, strides = expert_layout(ranks, ep)
        for is_ep, members in [*((True, b) for b in blocks), *((False, s) for s in strides)]:
            g = dist.new_group(members)
            if me in members and is_ep:
                ep_group = g
            elif me in members:
                edp_group = g
    return ExpertGroups(ep_group, edp_group)
