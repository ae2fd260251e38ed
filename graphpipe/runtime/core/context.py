"""Who this pipeline rank is: the facts every part of the runtime reads.

``RankContext`` is built once by the facade (``pipeline``) and handed to each part that needs
it, in place of the facade itself: the pipeline group and this rank's place in it, the device,
this rank's stage modules and ids, the number of micro-batches, and which ranks hold the
batch's inputs and labels. It is read-only.

Owns: nothing. May touch: nothing (a record).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphpipe.roles import unique_parameters

__all__ = ["RankContext"]


@dataclass(frozen=True, eq=False)
class RankContext:
    """One pipeline rank.

    group: the pipeline process group (None: one process without torch.distributed).
    rank / num_ranks: this rank in the pipeline, and the pipeline's size.
    global_ranks: every pipeline rank's global rank, by pipeline rank.
    device: where this rank computes.
    modules / stage_ids: this rank's stages, in ascending stage order.
    num_microbatches: M.
    input_rank / loss_rank: the ranks that hold the inputs (stage 0) and the labels (the last
        stage).
    """

    group: Any
    rank: int
    num_ranks: int
    global_ranks: tuple[int, ...]
    device: torch.device
    modules: tuple[nn.Module, ...]
    stage_ids: tuple[int, ...]
    num_microbatches: int
    input_rank: int
    loss_rank: int

    @property
    def is_input_rank(self) -> bool:
        return self.rank == self.input_rank

    @property
    def is_loss_rank(self) -> bool:
        return self.rank == self.loss_rank

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once."""
        return unique_parameters(self.modules, trainable=True)
