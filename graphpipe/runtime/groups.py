"""Process groups of a pipeline: the P2P group of each directed rank pair, and a gloo control
group.

* P2P: on NCCL one process group per directed rank pair with traffic (``A -> B`` and
  ``B -> A`` are two groups), so that each communicator carries one direction of one rank
  pair, in the same order at both ends, and no two pairs' transfers queue behind each other
  on one NCCL stream (what capturing a V schedule needs: pytorch#195760, torchtitan#4485).
  On gloo the pipeline group serves every pair by default (gloo posts each op on its own).
* control: a gloo group over the pipeline's ranks for host-side agreement (batch signatures,
  the first step's handshake on NCCL); the pipeline group itself when that is gloo.

``torch.distributed.new_group`` is collective over the whole world: every process must create
every group, in the same order, even those it is not in. When the pipeline group is only
part of the world (data parallel: one pipeline per replica), the ranks first gather every
pipeline's ranks, then all create the groups of all pipelines in one agreed order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["PipelineGroups"]


class PipelineGroups:
    """The groups one pipeline rank uses.

    p2p: ``{(src, dst): group}`` per directed rank pair (pipeline ranks) with traffic that
        this rank is one end of.
    control: the gloo control group (None for one rank).
    global_ranks: the pipeline ranks' global ranks, by pipeline rank.
    """

    def __init__(self, p2p: dict[tuple[int, int], Any], control: Any, global_ranks: list[int]):
        self.p2p, self.control, self.global_ranks = p2p, control, global_ranks

    @classmethod
    def create(
        cls, group: Any, edges: Iterable[tuple[int, int]], per_edge: bool | None
    ) -> PipelineGroups:
        """Groups for the pipeline on ``group`` with traffic on ``edges`` (pipeline ranks).

        per_edge: one group per directed rank pair; None: on NCCL only.
        """
        n = dist.get_world_size(group)
        mine = [dist.get_global_rank(group, r) for r in range(n)]
        edges = sorted(set(edges))
        backend = dist.get_backend(group)
        if per_edge is None:
            per_edge = backend == "nccl"
        need_control = n > 1 and backend != "gloo"
        me = dist.get_rank(group)
        if not per_edge and not need_control:
            return cls({e: group for e in edges if me in e}, group if n > 1 else None, mine)
        pipelines = _all_pipelines(mine)
        p2p: dict[tuple[int, int], Any] = {}
        control = group if not need_control else None
        for ranks in pipelines:  # every process, same order
            if need_control:
                g = dist.new_group(ranks, backend="gloo")
                if ranks == mine:
                    control = g
            for src, dst in edges if per_edge else ():
                g = dist.new_group([ranks[src], ranks[dst]], backend=backend)
                if ranks == mine and me in (src, dst):
                    p2p[(src, dst)] = g
        if not per_edge:
            p2p = {e: group for e in edges if me in e}
        return cls(p2p, control, mine)


def _all_pipelines(mine: Sequence[int]) -> list[list[int]]:
    """Every pipeline's global ranks, the same list on every process (sorted)."""
    world = dist.get_world_size()
    if len(mine) == world:
        return [list(mine)]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, list(mine))
    return [list(g) for g in sorted({tuple(g) for g in gathered})]
