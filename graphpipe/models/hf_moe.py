"""Expert parallelism for the mixture-of-experts layers of Hugging Face stages.

``shard_hf_experts(stages, ep_group)`` replaces, in the stages of ``split_hf_causal_lm``,
every decoder layer's HF experts module (``mlp.experts`` holding all the experts stacked in
two 3-D parameters, ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, called
as ``experts(hidden_states, top_k_index, top_k_weights)``: Qwen3-MoE, Qwen2-MoE, Mixtral)
by an ``HFExpertShard`` holding this rank's ``E / ep`` of them, marked with
``graphpipe.mark_expert``. The router (``mlp.gate``) and everything else stay as they are.

The shard is dropless, so it computes what the HF module computes, expert for expert: the
``N`` tokens of the micro-batch are scattered into an ``[E, N, H]`` buffer (token ``t`` in
row ``t`` of each expert it chose: a token chooses an expert once, so no slot is shared and
none is dropped), one ``all_to_all_single`` with equal splits sends each rank the rows of
its experts from every rank of ``ep_group``, each local expert runs HF's
``act(x @ gate^T) * (x @ up^T) @ down^T`` on its ``ep * N`` rows, a second all-to-all brings
the outputs home, and each token's outputs are weighted by the router's ``top_k_weights``
and added up. Every shape follows from ``N``: no host read, no data-dependent branch (unlike
HF's eager experts, which find the experts hit with ``nonzero()``). The price is the
buffer: every expert gets ``N`` rows per rank, used or not (``E * N * H`` elements, ``E / k``
times a dropless exchange's traffic).

Every rank of ``ep_group`` must hold the same stages (the same layers: ``ep_group`` lies
inside the data-parallel group) and route micro-batches of the same number of tokens. The
experts' gradients on one rank sum the contributions of the whole ``ep_group`` (the tokens
came from all of them): pass ``expert_groups=graphpipe.models.expert_parallel_groups(ep,
dp_group)`` to the pipeline with its ``dp_group``, as for the built-in MoE layers. Checkpoints
name each shard's experts (``...experts.gate_up_proj[experts 0-1 of 4]``) and
``export_state_dict`` joins them, so the export is the unsplit HF model's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graphpipe.models.moe import _AllToAll
from graphpipe.roles import mark_expert

__all__ = ["HFExpertShard", "shard_hf_experts"]


def _is_hf_experts(module: Any) -> bool:
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and up.dim() == 3
        and down.dim() == 3
        and hasattr(module, "act_fn")
    )


class HFExpertShard(nn.Module):
    """This rank's share of an HF experts module (``gate_up_proj`` ``[E, 2I, H]``,
    ``down_proj`` ``[E, H, I]``): experts ``first_expert .. first_expert + local_experts - 1``
    of ``num_experts``, copied from ``experts``; ``forward(hidden_states [N, H], top_k_index
    [N, k], top_k_weights [N, k]) -> [N, H]`` as the HF module's (see the module docstring).
    """

    def __init__(self, experts: nn.Module, ep_group: Any) -> None:
        super().__init__()
        if not _is_hf_experts(experts):
            raise ValueError(
                f"shard_hf_experts: {type(experts).__name__} does not hold its experts as "
                "3-D gate_up_proj and down_proj parameters with an act_fn"
            )
        ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        total = int(experts.gate_up_proj.shape[0])
        if total % ep:
            raise ValueError(
                f"shard_hf_experts: {total} experts do not split over an expert-parallel "
                f"group of {ep} ranks"
            )
        local = total // ep
        first = rank * local
        self.num_experts, self.local_experts, self.first_expert = total, local, first
        self.ep_size, self.ep_group = ep, ep_group
        self.act_fn = experts.act_fn
        with torch.no_grad():
            part = slice(first, first + local)
            self.gate_up_proj = nn.Parameter(experts.gate_up_proj[part].clone())
            self.down_proj = nn.Parameter(experts.down_proj[part].clone())
        mark_expert(self.gate_up_proj, ep)
        mark_expert(self.down_proj, ep)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's chosen experts' outputs, ``[N, H]``."""
        tokens, hidden = hidden_states.shape
        k = top_k_index.shape[-1]
        token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
        slots = top_k_index.reshape(-1) * tokens + token  # expert-major rows, one per pair
        buf = hidden_states.new_zeros(self.num_experts * tokens, hidden)
        buf = buf.index_copy(0, slots, hidden_states.index_select(0, token))
        got = _AllToAll.apply(buf, self.ep_group)  # [ep (source), local, N, H] flat
        rows = got.reshape(self.ep_size, self.local_experts, tokens, hidden).transpose(0, 1)
        outs = []
        for e in range(self.local_experts):
            x = rows[e].reshape(self.ep_size * tokens, hidden)
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        back = torch.stack(outs).reshape(self.local_experts, self.ep_size, tokens, hidden)
        home = _AllToAll.apply(back.transpose(0, 1).reshape(-1, hidden), self.ep_group)
        pairs = home.index_select(0, slots) * top_k_weights.reshape(-1, 1)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token, pairs.to(out.dtype))

    def extra_repr(self) -> str:
        last = self.first_expert + self.local_experts - 1
        return f"experts {self.first_expert}-{last} of {self.num_experts}, ep={self.ep_size}"


def shard_hf_experts(stages: Iterable[nn.Module], ep_group: Any) -> int:
    """Replace every ``layers[j].mlp.experts`` of ``stages`` (HF stages from
    ``split_hf_causal_lm``) that holds stacked 3-D experts by an ``HFExpertShard`` over
    ``ep_group``; returns how many were replaced. Call it before building the pipeline and
    the optimizer (the shards are new parameters). ``ValueError`` when no stage holds such a
    layer, or the experts do not split over ``ep_group``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_hf_experts needs torch.distributed to be initialized")
    count = 0
    stages = list(stages)
    for stage in stages:
        for layer in getattr(stage, "layers", ()):
            mlp = getattr(layer, "mlp", None)
            experts = getattr(mlp, "experts", None)
            if experts is not None and _is_hf_experts(experts):
                mlp.experts = HFExpertShard(experts, ep_group)
                count += 1
    if count == 0:
        names = sorted({type(s).__name__ for s in stages})
        raise ValueError(
            f"shard_hf_experts: no decoder layer of these stages ({', '.join(names)}) has an "
            "mlp.experts module with 3-D gate_up_proj and down_proj parameters"
        )
    return count
