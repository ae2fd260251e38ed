"""Models that split into pipeline stages for graphpipe."""

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
    MoEMLP,
    dropped_tokens,
    expert_layout,
    expert_parallel_groups,
    expert_parameters,
    is_expert_parameter,
    reset_dropped_tokens,
)
from graphpipe.models.overlap import MoEEvent

__all__ = [
    "EXPERT_ATTR",
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
    "dropped_tokens",
    "expert_layout",
    "expert_parallel_groups",
    "expert_parameters",
    "is_expert_parameter",
    "layers_per_stage",
    "llama_loss",
    "num_parameters",
    "reset_dropped_tokens",
    "unique_parameters",
]
