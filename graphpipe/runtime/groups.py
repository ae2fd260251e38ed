"""Process groups of a pipeline: the P2P group of each directed rank pair, and a gloo control
group, all of them the pipeline's own.

* P2P on gloo: the pipeline's own gloo groups, built from the job's c10d store (a
  ``PrefixStore`` per group and generation): one over the pipeline ranks by default, or one
  per directed rank pair (``per_edge``). Being the pipeline's own, they can be dropped on a
  failure (which closes their connections, so that every peer blocked on this rank fails at
  once) and rebuilt for the next step (fresh connections: nothing of the failed step can
  arrive later). Only the members of a group take part in building it.
* P2P on NCCL: one registered process group (``dist.new_group``) per directed rank pair, so
  that each communicator carries one direction of one pair, in the same order at both ends,
  on its own stream (what capturing a V schedule needs: pytorch#195760, torchtitan#4485).
  ``new_group`` is collective over the whole world: every process creates every group in the
  same order, even those it is not in; when the pipeline is only part of the world (data
  parallel), the ranks first gather every pipeline's ranks. NCCL groups are not rebuilt: a
  failure closes the pipeline.
* control: the pipeline's own gloo group over its ranks (batch agreement, the loss, the
  first step's handshake on NCCL); index = pipeline rank.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["PipelineGroups", "store_key"]

_created: Counter = Counter()  # keys this process made per (kind, rank set)


def store_key(global_ranks: Sequence[int], kind: str = "") -> str:
    """A fresh key in the job's store for an object of ``kind`` over ``global_ranks``
    (``graphpipe/[kind/]0_1/3`` for the third): the same on every member, as they build
    their objects in the same order."""
    ranks = "_".join(map(str, global_ranks))
    _created[kind, ranks] += 1
    return f"graphpipe/{kind + '/' if kind else ''}{ranks}/{_created[kind, ranks]}"


def _gloo(store: Any, prefix: str, ranks: Sequence[int], me: int, timeout: datetime.timedelta):
    """A gloo group of the global ``ranks`` (this process is ``me``), members only."""
    return dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store), ranks.index(me), len(ranks), timeout
    )


class PipelineGroups:
    """The groups one pipeline rank uses (see the module doc).

    p2p: ``{(src, dst): (group, the peer's index in it)}`` per directed rank pair (pipeline
        ranks) with traffic that this rank is one end of; empty after ``drop``.
    control: the gloo control group (None for one rank, or after ``drop``).
    global_ranks: the pipeline ranks' global ranks; rank: this pipeline rank.
    nccl: P2P goes over NCCL. store / key: the job's store and this pipeline's key in it.
    """

    def __init__(
        self,
        group: Any,
        edges: Iterable[tuple[int, int]],
        per_edge: bool | None,
        timeout: datetime.timedelta,
    ) -> None:
        self.distributed = group is not None
        if not self.distributed:
            self.global_ranks, self.rank, self.nccl = [0], 0, False
            self.p2p: dict[tuple[int, int], tuple[Any, int]] = {}
            self.control: Any = None
            self.store, self.key = None, "graphpipe/local"
            return
        n = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(n)]
        self.rank = dist.get_rank(group)
        self.nccl = dist.get_backend(group) == "nccl"
        self.per_edge = self.nccl if per_edge is None else per_edge
        self.edges = sorted(e for e in set(edges) if self.rank in e)
        self.timeout = timeout
        self.store = dist.distributed_c10d._get_default_store()
        self.key = store_key(self.global_ranks)
        self.generation = 0
        self.p2p, self.control = {}, None
        self._nccl_p2p = _nccl_edge_groups(group, edges) if self.nccl and n > 1 else {}
        if n > 1:
            self._build()

    def _build(self) -> None:
        me = self.global_ranks[self.rank]
        prefix = f"{self.key}/gen{self.generation}"
        control = _gloo(self.store, f"{prefix}/control", self.global_ranks, me, self.timeout)
        self.control = control
        for src, dst in self.edges:
            other = self.global_ranks[dst if src == self.rank else src]
            if self.nccl:
                g = self._nccl_p2p[(src, dst)]
                self.p2p[(src, dst)] = (g, dist.get_group_rank(g, other))
            elif self.per_edge:
                pair = sorted((me, other))
                g = _gloo(self.store, f"{prefix}/{src}-{dst}", pair, me, self.timeout)
                self.p2p[(src, dst)] = (g, pair.index(other))
            else:
                self.p2p[(src, dst)] = (control, self.global_ranks.index(other))

    def drop(self) -> None:
        """Let go of the gloo groups (their connections close once nothing else holds them:
        the engine drops its posted work too). NCCL groups are aborted instead."""
        if self.nccl:
            for g, _ in self.p2p.values():
                g.abort()
        self.p2p, self.control = {}, None

    def rebuild(self) -> None:
        """New gloo groups for the next call (every live pipeline rank calls this, in step)."""
        self.generation += 1
        self._build()

    @property
    def dropped(self) -> bool:
        return len(self.global_ranks) > 1 and self.control is None


def _nccl_edge_groups(group: Any, edges: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """One registered NCCL group per directed rank pair, created by every process of the world
    for every pipeline in one agreed order; returns this pipeline's (all pairs, by pipeline
    rank; a process keeps only the groups it is in)."""
    n = dist.get_world_size(group)
    mine = [dist.get_global_rank(group, r) for r in range(n)]
    world = dist.get_world_size()
    pipelines = [mine]
    if n != world:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        pipelines = [list(g) for g in sorted({tuple(g) for g in gathered})]
    out = {}
    for ranks in pipelines:
        for src, dst in sorted(set(edges)):
            g = dist.new_group([ranks[src], ranks[dst]], backend="nccl")
            if ranks == mine:
                out[(src, dst)] = g
    return out
