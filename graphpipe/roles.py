"""Parameter roles: what the runtime must know about a parameter, declared by the model.

The runtime treats every parameter alike (its gradient is averaged over the data-parallel
replicas, counted once in a clipped norm, broadcast from the first replica at start) except
where the model says otherwise, through these markers. Models call them; the runtime reads
them; neither knows the other.

* ``mark_expert(param, ep_size)``: ``param`` holds this rank's share of a mixture-of-experts
  layer's experts, sharded over an expert-parallel group of ``ep_size`` ranks (1: every rank
  holds all the experts). Its gradient already sums the contributions of the whole ep group,
  so data parallelism sums it over the replicas that hold the same experts only
  (``Pipeline(expert_groups=...)``), and a global norm adds the shares of the ep group.
* ``mark_tied(param, name)``: ``param`` is one copy of a weight that lives on several
  pipeline ranks under one ``name`` (an input embedding tied to the output head when stage 0
  and the last stage are on different ranks, as under 1F1B). The pipeline starts every copy
  from the lowest rank's, sums the copies' gradients in every step, and counts the weight
  once in a clipped norm (``runtime/parts/tied.py``). Copies on one rank that are one Parameter
  object need no mark.

``unique_parameters(modules)`` lists the parameters of several stages, each once (a weight
shared by two stages is one ``Parameter``): what the runtime counts and what a model hands an
optimizer.

Owns: the marker attributes. May touch: nothing else (pure functions of parameters).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "EXPERT_ATTR",
    "TIED_ATTR",
    "ExpertGroups",
    "expert_parallel_size",
    "is_expert",
    "mark_expert",
    "mark_tied",
    "tied_name",
    "unique_parameters",
]

EXPERT_ATTR = "_graphpipe_expert"
"""The attribute ``mark_expert`` sets on a parameter: its expert-parallel group size."""
TIED_ATTR = "_graphpipe_tied"
"""The attribute ``mark_tied`` sets on a parameter: its tie name."""


class ExpertGroups(NamedTuple):
    """This rank's expert groups (``graphpipe.models.expert_parallel_groups``); pass it to the
    pipeline as ``expert_groups`` next to its ``dp_group``."""

    ep_group: Any
    """The ranks that share one copy of all the experts."""
    expert_dp_group: Any
    """The ranks that hold the same experts (one per ep group of the dp group)."""


def mark_expert(param: torch.Tensor, ep_size: int = 1) -> torch.Tensor:
    """Mark ``param`` as expert weights sharded over ``ep_size`` ranks; returns ``param``."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    setattr(param, EXPERT_ATTR, ep_size)
    return param


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` was marked with ``mark_expert``."""
    return bool(getattr(param, EXPERT_ATTR, 0))


def expert_parallel_size(modules: Iterable[nn.Module] | nn.Module) -> int:
    """The expert-parallel group size of the expert parameters in ``modules`` (0: none);
    ``ValueError`` when they differ."""
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    sizes = {getattr(p, EXPERT_ATTR) for m in mods for p in m.parameters() if is_expert(p)}
    if len(sizes) > 1:
        raise ValueError(
            f"the expert parameters are sharded over groups of different sizes {sorted(sizes)}"
        )
    return int(sizes.pop()) if sizes else 0


def mark_tied(param: torch.Tensor, name: str) -> torch.Tensor:
    """Mark ``param`` as one copy of the tied weight ``name``; returns ``param``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tie name must be a non-empty str, got {name!r}")
    setattr(param, TIED_ATTR, name)
    return param


def tied_name(param: torch.Tensor) -> str | None:
    """The tie name ``mark_tied`` gave ``param`` (None: not tied across ranks)."""
    return getattr(param, TIED_ATTR, None)


def unique_parameters(
    modules: Iterable[nn.Module] | nn.Module, trainable: bool = False
) -> list[nn.Parameter]:
    """The parameters of ``modules`` in module order, each once (a weight tied between two
    stages, as an embedding and the output head, is in both); ``trainable``: only those that
    require a gradient."""
    seen: dict[int, nn.Parameter] = {}
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        for p in module.parameters():
            if p.requires_grad or not trainable:
                seen.setdefault(id(p), p)
    return list(seen.values())
