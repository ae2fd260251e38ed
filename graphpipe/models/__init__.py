"""Models that split into pipeline stages for graphpipe."""

from graphpipe.models.llama import (
    LlamaBlock,
    LlamaConfig,
    LlamaLoss,
    LlamaStage,
    RMSNorm,
    build_model,
    build_stages,
    layers_per_stage,
    llama_loss,
    num_parameters,
    unique_parameters,
)

__all__ = [
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLoss",
    "LlamaStage",
    "RMSNorm",
    "build_model",
    "build_stages",
    "layers_per_stage",
    "llama_loss",
    "num_parameters",
    "unique_parameters",
]
