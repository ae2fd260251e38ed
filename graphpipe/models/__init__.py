"""Models that split into pipeline stages for graphpipe.

``split_hf_causal_lm``, ``causal_lm_loss`` and ``causal_lm_num_items`` (``graphpipe.models.hf``)
work on Hugging Face models without importing transformers themselves; ``export_hf_model``
(``graphpipe.models.hf_export``) writes a checkpoint of their stages as an HF model directory;
``plan_hf_split`` and ``plan_llama_split`` (``graphpipe.models.planning``) measure a model's
layers and plan its split (``graphpipe.plan_stages``)."""

from graphpipe.models.hf import causal_lm_loss, causal_lm_num_items, split_hf_causal_lm
from graphpipe.models.hf_export import export_hf_model
from graphpipe.models.hf_moe import HFExpertShard, shard_hf_experts
from graphpipe.models.llama import (
    LlamaBlock,
    LlamaConfig,
    LlamaLoss,
    LlamaMoEStage,
    LlamaStage,
    MoEBlock,
    RMSNorm,
    build_model,
    build_stages,
    layers_per_stage,
    llama_loss,
    num_parameters,
    unique_parameters,
)
from graphpipe.models.moe import (
    EXPERT_ATTR,
    ExpertGroups,
    MoEMLP,
    dropped_tokens,
    expert_layout,
    expert_parallel_groups,
    expert_parallel_size,
    expert_parameters,
    is_expert_parameter,
    reset_dropped_tokens,
)
from graphpipe.models.overlap import MoEEvent
from graphpipe.models.planning import measure_stage, plan_hf_split, plan_llama_split, rank_threads

__all__ = [
    "EXPERT_ATTR",
    "ExpertGroups",
    "HFExpertShard",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLoss",
    "LlamaMoEStage",
    "LlamaStage",
    "MoEBlock",
    "MoEEvent",
    "MoEMLP",
    "RMSNorm",
    "build_model",
    "build_stages",
    "causal_lm_loss",
    "causal_lm_num_items",
    "dropped_tokens",
    "expert_layout",
    "expert_parallel_groups",
    "expert_parallel_size",
    "expert_parameters",
    "export_hf_model",
    "is_expert_parameter",
    "layers_per_stage",
    "llama_loss",
    "measure_stage",
    "num_parameters",
    "plan_hf_split",
    "plan_llama_split",
    "rank_threads",
    "reset_dropped_tokens",
    "shard_hf_experts",
    "split_hf_causal_lm",
    "unique_parameters",
]
