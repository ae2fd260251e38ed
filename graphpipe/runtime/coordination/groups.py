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

Every gloo group is handed out as a ``PatientGroup``: the wait on one of its works is this
process's current wait, and one that blocks gets its status published (``status``: what
this process blocks in, and on which peer, for the peers that time out on it); NCCL groups
are not wrapped (their waits are stream dependencies).

Before any group is built, and before each rebuild, the ranks join in the store
(``config.join``): a rank that does not come within the timeout is named on every rank that
did, and ranks configured differently raise ``ValueError`` instead of training wrong.

A process that exits (or destroys its process groups) with pipelines alive must not abort:
``release`` lets go of the gloo groups at exit, before the interpreter finalizes
(``lifetime``).
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from graphpipe.errors import PipelineError

from .config import PipelineConfig, join, refuse
from .lifetime import release_groups_at_exit
from .status import WATCH
from .store import JobStore, first_line

__all__ = ["PatientGroup", "PipelineGroups", "refuse_to_join", "store_key", "taken_key"]

_created: Counter = Counter()  # keys this process made per (kind, rank set)


def store_key(global_ranks: Sequence[int], kind: str = "") -> str:
    """A fresh key in the job's store for an object of ``kind`` over ``global_ranks``
    (``graphpipe/[kind/]0_1/3`` for the third): the same on every member, as they build
    their objects in the same order."""
    ranks = "_".join(map(str, global_ranks))
    _created[kind, ranks] += 1
    return f"graphpipe/{kind + '/' if kind else ''}{ranks}/{_created[kind, ranks]}"


def taken_key(global_ranks: Sequence[int], kind: str = "") -> str | None:
    """The key ``store_key(global_ranks, kind)`` gave last in this process (None: none yet):
    the join a failed construction took part in (``Pipeline._tell_peers_on_failure``)."""
    ranks = "_".join(map(str, global_ranks))
    count = _created[kind, ranks]
    return f"graphpipe/{kind + '/' if kind else ''}{ranks}/{count}" if count else None


def refuse_to_join(
    group: Any, exc: BaseException, kind: str = "", what: str = "build the pipeline"
) -> str | None:
    """A join over ``group`` that this rank will not take (``exc``, raised by its own checks
    first): the members waiting in it raise at once naming this rank and ``exc``. Takes the
    join's key as its owner would (``store_key(ranks, kind)``: the pipeline's for ``kind``
    "", the same on every member) and returns it; a lost store, or one rank alone, leaves
    nothing to tell (None for one rank)."""
    if group is None or dist.get_world_size(group) < 2:
        return None
    ranks = dist.get_process_group_ranks(group)
    key = store_key(ranks, kind)
    try:
        store = JobStore(dist.distributed_c10d._get_default_store())
        refuse(store, key, dist.get_rank(group), ranks, exc, what)
    except Exception:  # the store is gone: the members find that out themselves
        pass
    return key


def _gloo(store: Any, prefix: str, ranks: Sequence[int], me: int, timeout: datetime.timedelta):
    """A gloo group of the global ``ranks`` (this process is ``me``), members only: a
    ``ProcessGroup`` over its gloo backend, so that its operations go through torch's
    dispatcher as ``c10d`` operations (which the CPU graph records) like those of a
    ``new_group``."""
    prefixed = dist.PrefixStore(prefix, store)
    rank, size = ranks.index(me), len(ranks)
    backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    group = dist.ProcessGroup(prefixed, rank, size)
    gloo = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(gloo)
    group._register_backend(torch.device("cpu"), gloo, backend)
    return group


class _Dropped:
    """What a released ``PatientGroup`` holds instead of its group: any use raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("the pipeline's process groups were dropped")


_DROPPED = _Dropped()


class _PatientWork:
    """A work of a ``PatientGroup``: its ``wait`` is this process's current wait while it
    lasts (``status.WATCH``: the watch thread publishes the status of one that blocks);
    anything else is the work's."""

    __slots__ = ("group", "work")

    def __init__(self, work: Any, group: PatientGroup) -> None:
        self.work, self.group = work, group

    def wait(self, *args: Any) -> Any:
        watch = WATCH
        watch.enter(self)
        try:
            done = self.work.wait(*args)
        except BaseException:
            watch.failed_in(self)  # its status stays for the peers (see status)
            self.work = None  # a failed work holds its connections open: let go of it
            raise
        watch.leave(self)
        return done

    def blocked(self) -> Any:
        """For the watch thread: what to publish (``status.Watch``)."""
        group = self.group
        return group.on_block(group.peer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class PatientGroup:
    """A pipeline gloo group whose works' waits are watched (``status``): one that blocks
    gets this process's status published, made by ``on_block(peer)`` (``peer``: the pipeline
    rank its P2P goes to; None for the control group's collectives). Any other attribute is
    the group's. Costs a small object per operation and a watched wait
    (``profiles/status_cost.py`` measures it, docs/failures.md); no store access unless a
    wait blocks.
    """

    def __init__(
        self, group: Any, on_block: Callable[[int | None], Any], peer: int | None = None
    ) -> None:
        self.group, self.on_block, self.peer = group, on_block, peer

    def release(self) -> None:
        """Let go of the group (``PipelineGroups.drop``): a reference to this object left
        anywhere (a frame of a failed call's traceback) must not keep its connections open,
        or the peers blocked on this rank would wait for the timeout. Any later use raises
        ``RuntimeError``."""
        self.group = _DROPPED

    def allreduce(self, *args: Any) -> _PatientWork:
        return _PatientWork(self.group.allreduce(*args), self)

    def broadcast(self, *args: Any) -> _PatientWork:
        return _PatientWork(self.group.broadcast(*args), self)

    def send(self, *args: Any) -> _PatientWork:
        return _PatientWork(self.group.send(*args), self)

    def recv(self, *args: Any) -> _PatientWork:
        return _PatientWork(self.group.recv(*args), self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


class PipelineGroups:
    """The groups one pipeline rank uses (see the module doc).

    p2p: ``{(src, dst): (group, the peer's index in it)}`` per directed rank pair (pipeline
        ranks) with traffic that this rank is one end of; empty after ``drop``.
    control: the gloo control group, a ``PatientGroup`` (None for one rank, or after
        ``drop``).
    global_ranks: the pipeline ranks' global ranks; rank: this pipeline rank.
    nccl: P2P goes over NCCL. store / key: the job's store (a ``JobStore``) and this
    pipeline's key in it. on_block: ``on_block(peer)`` makes the status of a wait that
    blocks (set by ``Faults``).

    ``config``: this rank's ``PipelineConfig``, agreed on by every rank before anything is
    built (``config.join``).
    """

    def __init__(
        self,
        group: Any,
        edges: Iterable[tuple[int, int]],
        per_edge: bool | None,
        timeout: datetime.timedelta,
        config: PipelineConfig | None = None,
    ) -> None:
        self.distributed = group is not None
        self.on_block: Callable[[int | None], Any] | None = None
        if not self.distributed:
            self.global_ranks, self.rank, self.nccl = [0], 0, False
            self.p2p: dict[tuple[int, int], tuple[Any, int]] = {}
            self.control: Any = None
            self.store: JobStore | None = None
            self.key = "graphpipe/local"
            return
        n = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(n)]
        self.rank = dist.get_rank(group)
        self.nccl = dist.get_backend(group) == "nccl"
        self.per_edge = self.nccl if per_edge is None else per_edge
        self.edges = sorted(e for e in set(edges) if self.rank in e)
        self.timeout = timeout
        self.store = JobStore(dist.distributed_c10d._get_default_store())
        self.key = store_key(self.global_ranks)
        self.generation = 0
        self.p2p, self.control = {}, None
        if n > 1:
            WATCH.start()
            join(self.store, self.key, self.rank, self.global_ranks, self._seconds, config)
        self._nccl_p2p = {}
        if self.nccl and n > 1:
            try:
                self._nccl_p2p = _nccl_edge_groups(group, edges)
            except RuntimeError as e:  # a peer died after joining, or the store went
                self.store.check(self.key)  # StoreLost, naming the store's host
                raise PipelineError(
                    f"rank {self.rank} could not create the pipeline's NCCL groups after every "
                    f"rank joined (a peer died meanwhile?): {type(e).__name__}: {first_line(e)}"
                ) from None
        if n > 1:
            self._build()
            release_groups_at_exit(self)  # released at exit even when the pipeline is gone

    @property
    def _seconds(self) -> float:
        return self.timeout.total_seconds()

    def report_blocks_to(self, on_block: Callable[[int | None], Any] | None) -> None:
        """``on_block(peer)`` makes the status the watch thread publishes for a wait on
        these groups that blocks (``Faults.blocked``)."""
        self.on_block = on_block

    def _blocked(self, peer: int | None) -> Any:
        return self.on_block(peer) if self.on_block is not None else None

    def _build(self) -> None:
        """The gloo groups of this generation; a failure (a peer that died after joining) is a
        ``PipelineError`` (``StoreLost`` when the store is gone)."""
        try:
            self._build_groups()
        except PipelineError:
            raise
        except Exception as e:
            self.store.check(self.key)  # StoreLost, naming the store's host, if it is gone
            self.drop()
            raise PipelineError(
                f"rank {self.rank} could not build the pipeline's process groups after every "
                f"rank joined (a peer died meanwhile?): {type(e).__name__}: "
                f"{first_line(e)}"
            ) from None

    def _build_groups(self) -> None:
        me = self.global_ranks[self.rank]
        prefix = f"{self.key}/gen{self.generation}"
        store = self.store.store
        raw = _gloo(store, f"{prefix}/control", self.global_ranks, me, self.timeout)
        self.control = PatientGroup(raw, self._blocked)
        for src, dst in self.edges:
            peer = dst if src == self.rank else src
            other = self.global_ranks[peer]
            if self.nccl:
                g = self._nccl_p2p[(src, dst)]
                self.p2p[(src, dst)] = (g, dist.get_group_rank(g, other))
            elif self.per_edge:
                pair = sorted((me, other))
                g = _gloo(store, f"{prefix}/{src}-{dst}", pair, me, self.timeout)
                patient = PatientGroup(g, self._blocked, peer)
                self.p2p[(src, dst)] = (patient, pair.index(other))
            else:
                self.p2p[(src, dst)] = (PatientGroup(raw, self._blocked, peer), peer)

    def drop(self) -> None:
        """Let go of the gloo groups: their connections close once nothing holds them, so
        every handed-out ``PatientGroup`` is released (the engine lets go of its posted work,
        ``CommEngine.abandon``; a failed wait of its work, ``_PatientWork``). NCCL groups are
        aborted instead."""
        if self.nccl:
            for g, _ in self.p2p.values():
                g.abort()
        self.release()
        self.p2p = {}

    def release(self) -> None:
        """Let go of this pipeline's own gloo groups now (at exit, ``lifetime``; on
        ``drop``): once nothing else holds them, their worker threads are joined. NCCL groups
        are torch's (registered ``new_group``s): they stay."""
        if self.control is not None:
            self.control.release()
        self.control = None
        if not self.nccl:
            for g, _ in self.p2p.values():
                g.release()
            self.p2p = {}

    def rebuild(self) -> None:
        """New gloo groups for the next call (every live pipeline rank calls this, in step),
        after the ranks join again (``config.join``: a rank that does not come back within
        the timeout is named)."""
        self.generation += 1
        prefix = f"{self.key}/gen{self.generation}"
        join(self.store, prefix, self.rank, self.global_ranks, self._seconds, None, "rejoin")
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
