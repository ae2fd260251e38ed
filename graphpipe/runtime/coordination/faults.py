"""Failure agreement across the pipeline ranks: who failed, at which action, and why.

A failing step must end on every rank, fast and by name, not at the process group's timeout
with an anonymous transport error. The protocol:

1. The rank where an exception is raised (in a stage, in ``loss_fn``, in one of the
   runtime's own checks, a ``KeyboardInterrupt``) publishes a notice in the c10d store
   under the pipeline's key and the number of the call (``step``/``forward``) it was in:
   ``rank R at ACTION: Type: message``; the first notice of a call wins.
2. It then breaks its connections: it drops its pipeline process groups, so every peer
   blocked on it fails at once ("connection closed").
3. A rank whose P2P or control traffic fails (``CommFailure``, or a ``torch.distributed``
   error raised inside the step) reads the notice and raises ``PipelineError`` with it; it
   breaks its own connections too, so that the ranks waiting on *it* learn in turn.
4. No notice: this rank finds out who is to blame and publishes that (``diagnose``). A
   collective that timed out (the batch agreement: a call one rank never entered) reads each
   peer's status (``status``: published by a process only while it blocks) and names every
   peer that is not in the same call: ``rank 1 has not entered step 3: it is idle`` / ``...:
   it is in forward 2 of another pipeline (...)``. A peer that a transfer waited on and that
   is not blocked anywhere is *lost*: gone (its connection closed) or stuck or stopped
   (silent past the timeout); the rank that found it marks it lost and the pipeline closed
   (``<key>/lost/<call>``, ``<key>/closed``), so that every rank raises ``PipelineClosed``
   from the next call on, and the lost rank itself, should it come back (a process stopped
   past the timeout, then continued), raises ``PipelineClosed`` saying that its peers gave
   up on it.
5. The next call rebuilds the process groups (a new generation, fresh connections: a message
   left in flight by the failed call can never be received by a later one), after the ranks
   join again (``config.join``). A rank that cannot rejoin makes the pipeline closed: every
   later call raises ``PipelineClosed``.
6. The store itself lost (its host died: global rank 0 for the default ``env://`` store, see
   ``store``): ``PipelineError`` naming the store's host, then ``PipelineClosed`` on every
   later call (nothing can be agreed on without it).

The store's host (global rank 0 of an ``env://`` job) that fails holds the store at exit
until its peers have read why (``lifetime.hold_store``): after a failed step, the readers of
its notice (``FaultNotices.mark_read``); after a construction that failed at or before a
join, the members of that join, each counting itself told (``construction_told``,
``hold_construction``). A replicas' agreement (``REPLICA_AGREEMENT``, ``data_parallel``) that
times out blames the replica that did not come, not a pipeline peer.

Owns: the notices, the lost / closed marks and the construction counts in the store. May
touch: the pipeline's process groups (dropped on a failure, rebuilt at the next call; the
control group for ``control``), this process's status.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from graphpipe.errors import PipelineClosed, PipelineError

from .lifetime import HOLD_S, hold_store
from .status import Blocked, ProcessStatus
from .store import JobStore, StoreLost, first_line

__all__ = [
    "AGREEMENT",
    "REPLICA_AGREEMENT",
    "CommFailure",
    "FaultNotices",
    "Faults",
    "PipelineClosed",
    "add_note",
    "as_comm_failure",
    "construction_told",
    "hold_construction",
    "hold_seconds",
]

AGREEMENT = "batch agreement"  # the collective at the start of every call (``batch``)
REPLICA_AGREEMENT = "data-parallel agreement"  # the replicas' part of it (``data_parallel``)

_UNTOUCHED = "this rank had not started the call: its gradients are untouched"
_GRADS = (
    "parameters' .grad may hold partial sums from the failed step: zero the gradients "
    "before the next step"
)


class CommFailure(RuntimeError):
    """P2P or control traffic of this rank failed (a consequence, not a cause).

    peer: the pipeline rank it was talking to, or None (a collective).
    what: what it was doing (``wait 3RECV_F5``, ``wait sends``, ``batch agreement``).
    """

    def __init__(
        self, peer: int | None, what: str, cause: BaseException, notice: str | None = None
    ) -> None:
        super().__init__(f"{what}: {type(cause).__name__}: {cause}")
        self.peer, self.what, self.cause = peer, what, cause
        self.notice = notice  # a failure notice found while waiting (another replica's)


_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")  # torch's collective calls


def as_comm_failure(exc: BaseException, what: str) -> CommFailure | None:
    """``exc`` as a ``CommFailure`` during ``what`` when it is a ``torch.distributed``
    transport error (a ``DistError``, or a ``RuntimeError`` raised by one of torch's
    collective calls, as gloo's are): a collective failed, not the user's code; else None."""
    if isinstance(exc, (CommFailure, StoreLost)) or not isinstance(exc, RuntimeError):
        return None
    if not isinstance(exc, dist.DistError):
        tb, last = exc.__traceback__, ""
        while tb is not None:
            last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
        distributed = f"{os.sep}torch{os.sep}distributed{os.sep}"
        if distributed not in last or not last.endswith(_C10D_FILES):
            return None
    return CommFailure(None, what, exc.with_traceback(None))


def _timed_out(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python >= 3.11), by hand on 3.10."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


def hold_seconds(timeout_s: float | None) -> float:
    """How long the store's host waits at exit for its peers to read why it failed: the
    pipeline's timeout (as long as a peer may take to come), at most ``lifetime.HOLD_S``."""
    return min(timeout_s, HOLD_S) if timeout_s is not None else HOLD_S


def _told_key(key: str) -> str:
    return f"{key}/told"


def construction_told(store: JobStore, key: str) -> None:
    """This rank's construction failed and it knows why (its own error, or the one the join
    ``key`` gave it): counted for the store's host, which may wait at exit for it
    (``hold_construction``). Nothing when the store is gone."""
    with contextlib.suppress(StoreLost):
        store.add(_told_key(key), 1)


def hold_construction(store: JobStore, key: str, members: int, seconds: float) -> None:
    """This process serves the job's store and its construction failed at or before the join
    ``key`` of ``members`` ranks (it gave up on a late member, or refused before joining, or
    was refused): its exit waits until every member has learned why
    (``construction_told``, this rank's own count included), at most ``seconds``."""
    hold_store(
        lambda: store.add(_told_key(key), 0),
        members,
        seconds,
        "why its pipeline construction failed",
    )


class FaultNotices:
    """The failure notices of one pipeline in the c10d store.

    store: the job's store (every rank's same one; a ``JobStore``, or a raw store that is
    wrapped); key: the pipeline's key in it. Every access may raise ``StoreLost``.
    """

    def __init__(self, store: Any, key: str, rank: int) -> None:
        if store is not None and not isinstance(store, JobStore):
            store = JobStore(store)
        self.store: JobStore | None = store
        self.key, self.rank = key, rank

    def _key(self, call: int) -> str:
        return f"{self.key}/fail/{call}"

    def text(self, action: str, what: BaseException | str) -> str:
        """This rank's notice: ``rank R at ACTION: Type: message``."""
        where = f" at {action}" if action else ""
        why = what if isinstance(what, str) else f"{type(what).__name__}: {what}"
        return f"rank {self.rank}{where}: {why}"

    def publish(self, call: int, action: str, what: BaseException | str) -> bool:
        """Publish this rank's failure of call ``call`` (an exception, or a text); False if
        another rank was first."""
        return self.publish_text(call, self.text(action, what))

    def publish_text(self, call: int, text: str) -> bool:
        """Publish ``text`` as the notice of call ``call``; False if one was there first."""
        if self.store is None:
            return True
        key = self._key(call)
        if self.store.add(key + "/claims", 1) != 1:
            return False
        self.store.set(key, text)
        return True

    def mark_read(self, call: int) -> None:
        """This rank read the notice of call ``call`` (the store's host, when it failed,
        waits for its peers' marks before its process ends: ``lifetime.hold_store``)."""
        if self.store is not None:
            with contextlib.suppress(StoreLost):
                self.store.add(self._key(call) + "/read", 1)

    def readers(self, call: int) -> int:
        """How many ranks marked the notice of call ``call`` read."""
        return self.store.add(self._key(call) + "/read", 0) if self.store is not None else 0

    def peek(self, call: int) -> str | None:
        """The notice of call ``call`` if there is one now (no waiting)."""
        if self.store is None:
            return None
        return self.store.peek(self._key(call))

    def read(self, call: int, wait_s: float = 1.0) -> str | None:
        """The notice of call ``call``, waiting up to ``wait_s`` for it; None if none."""
        if self.store is None:
            return None
        key = self._key(call)
        if not self.store.wait([key], wait_s):
            return None
        return self.store.get(key)

    # ------------------------------------------------------- lost and closed
    def mark_lost(self, call: int, rank: int, why: str) -> None:
        """Rank ``rank`` is lost in call ``call``: the pipeline is closed, for ``why``."""
        if self.store is None:
            return
        self.store.set(f"{self.key}/lost/{call}", str(rank))
        self.mark_closed(why)

    def mark_closed(self, why: str) -> None:
        """The pipeline is closed, for ``why`` (the first reason stays)."""
        if self.store is not None:
            self.store.compare_set(f"{self.key}/closed", "", why)

    def lost(self, call: int) -> int | None:
        """The rank marked lost in call ``call``, if any."""
        if self.store is None:
            return None
        text = self.store.peek(f"{self.key}/lost/{call}")
        return int(text) if text is not None else None

    def closed(self) -> str | None:
        """Why the pipeline is closed, if a rank closed it."""
        return self.store.peek(f"{self.key}/closed") if self.store is not None else None

    # ------------------------------------------------------------- texts
    @staticmethod
    def lost_text(failure: CommFailure) -> str:
        """What a rank that lost a peer (and found no notice) tells the others."""
        cause = first_line(failure.cause)
        who = f"rank {failure.peer}" if failure.peer is not None else "a peer"
        return (
            f"lost {who} during '{failure.what}', and no rank reported an error: {who} is gone "
            f"or stuck ({type(failure.cause).__name__}: {cause})"
        )

    @staticmethod
    def explain(notice: str, me: int, action: str) -> str:
        """The message of the ``PipelineError`` a rank raises for a failure ``notice``."""
        at = f" at {action}" if action else ""
        here = "" if notice.startswith(f"rank {me}{at}: ") else f" (this rank: rank {me}{at})"
        after = _UNTOUCHED if action in (AGREEMENT, REPLICA_AGREEMENT) else _GRADS
        return f"the step failed on {notice}{here}; {after}"


class Faults:
    """What a pipeline does about failures, call by call (see the module doc).

    notices: the store's notices; groups: the pipeline's groups (dropped on a failure,
    rebuilt at the next call; their blocked control waits publish this process's status
    through ``blocked``). ``action``: what this rank was doing when it failed; ``kind``:
    the call (``step``, ``forward``).
    """

    def __init__(self, notices: FaultNotices, groups: Any, rank: int) -> None:
        self.notices, self.groups, self.rank = notices, groups, rank
        self.call = 0
        self.kind = "step"
        self.action = ""
        self.closed: str | None = None
        # With data parallelism: the notices shared with this rank's data-parallel group
        # (``replicas``, keyed like ``notices``) and this replica's index in it.
        self.replicas: FaultNotices | None = None
        self.replica = 0
        store = notices.store
        self.global_ranks = list(getattr(groups, "global_ranks", [0]))
        self.status = ProcessStatus(store, self.global_ranks[rank]) if store is not None else None
        timeout = getattr(groups, "timeout", None)
        self.timeout_s = timeout.total_seconds() if timeout is not None else None
        # This process serves the job's store (global rank 0 of an env:// or tcp:// job):
        # when it fails, its exit waits for the peers to read its notice (at most hold_s).
        self.hosts_store = store is not None and store.hosted_here(self.global_ranks[rank])
        self.hold_s = hold_seconds(self.timeout_s)
        groups.report_blocks_to(self.blocked)

    def doing(self, what: str) -> None:
        """This rank is now at ``what`` (an action, a transfer, a reduction): named if it
        fails."""
        self.action = what

    def watch_replicas(self, notices: FaultNotices, replica: int) -> None:
        """With data parallelism: the notices shared with this rank's data-parallel group
        (keyed like ``notices``) and this replica's index in it."""
        self.replicas, self.replica = notices, replica

    def blocked(self, peer: int | None) -> tuple[ProcessStatus, Blocked, JobStore] | None:
        """A wait of this call blocks (on a transfer with pipeline rank ``peer``, or on a
        control collective when None): what the watch thread publishes (``status``)."""
        status = self.status
        if status is None:
            return None
        at = self.action if peer is None else ""
        blocked = Blocked(self.notices.key, self.kind, self.call, at, peer)
        return status, blocked, status.store.clone()

    def tell_replicas(self, notice: str) -> None:
        """Forward a notice of this pipeline to the other replicas (first one wins) and close:
        their reductions of this step are posted and cannot be matched any more."""
        if self.replicas is None:
            return
        text = notice if notice.startswith("replica ") else f"replica {self.replica}: {notice}"
        self.replicas.publish_text(self.call, text)
        self.closed = (
            f"pipeline closed: a step failed (call {self.call}) with data parallelism, and the "
            "data-parallel group's reductions of that step cannot be matched any more; build "
            f"new process groups and a new pipeline (the failure: {text})"
        )

    def _close(self, why: str) -> PipelineClosed:
        """Close the pipeline for ``why`` (told to the peers when the store still works)."""
        self.closed = why
        with contextlib.suppress(StoreLost):
            self.notices.mark_closed(why)
        return PipelineClosed(why)

    def begin(self, kind: str = "step") -> None:
        """Start a call (``step`` or ``forward``): refuse if closed, rebuild the groups after
        a failed call."""
        if self.closed is not None:
            raise PipelineClosed(self.closed)
        ProcessStatus.clear()
        self.call += 1
        self.kind = kind
        self.action = ""
        if not self.groups.dropped:
            return
        try:
            why = self.notices.closed()
            if why is not None:
                self.closed = why
                raise PipelineClosed(why)
            self.groups.rebuild()
        except PipelineClosed:
            raise
        except StoreLost as e:
            self.closed = f"pipeline closed: {e}"
            raise PipelineClosed(self.closed) from None
        except Exception as e:
            raise self._close(
                f"pipeline closed: rank {self.rank} could not rebuild its process groups "
                f"after a failed call: {type(e).__name__}: {e}"
            ) from None

    def control(self, what: str, op: Callable[[Any], Any]) -> None:
        """Run the collective ``op(control group)`` and wait; a failure is a ``CommFailure``."""
        self.doing(what)
        control = self.groups.control
        try:
            if control is None:
                raise RuntimeError("the pipeline's process groups were dropped")
            op(control).wait()
        except RuntimeError as e:
            raise CommFailure(None, what, e.with_traceback(None)) from None

    def _drop(self) -> None:
        self.groups.drop()
        if self.groups.nccl:
            self.closed = (
                f"pipeline closed: a step failed (call {self.call}) and NCCL state cannot be "
                "recovered; build a new pipeline (and process groups)"
            )

    def failure(self, exc: BaseException) -> BaseException:
        """The error this rank raises for ``exc``, raised inside a call: ``exc`` itself when
        it is this rank's own (published, see ``report_own``), else a ``PipelineError``."""
        if isinstance(exc, CommFailure):
            return self.error_for_comm_failure(exc)
        comm = as_comm_failure(exc, self.action or "the step")
        if comm is not None:
            return self.error_for_comm_failure(comm)
        if isinstance(exc, StoreLost):
            return self._store_lost(exc, None)
        self.report_own(exc)
        return exc

    def report_own(self, exc: BaseException) -> None:
        """This rank raised ``exc``: publish it, tell the peers (drop the groups), note it."""
        told = "every other rank raises PipelineError naming it"
        try:
            self.notices.publish(self.call, self.action, exc)
            if self.hosts_store:  # its exit waits (bounded) until the peers have read it
                notices, call = self.notices, self.call
                hold_store(
                    lambda: notices.readers(call),
                    len(self.global_ranks) - 1,
                    self.hold_s,
                    f"its failure notice of {self.kind} {call}",
                )
            if self.replicas is not None:  # the pipeline's first notice (maybe another rank's)
                first = self.notices.read(self.call) or self.notices.text(self.action, exc)
                self.tell_replicas(first)
        except StoreLost as e:
            told = f"the other ranks could not be told: {e}"
            self.closed = f"pipeline closed: {e}"
        self._drop()
        where = f" at action {self.action}" if self.action else ""
        add_note(exc, f"graphpipe: raised on rank {self.rank}{where}; {told}; {_GRADS}")

    def _store_lost(self, lost: StoreLost, failure: CommFailure | None) -> PipelineError:
        """The store is gone: close, and say so naming its host (and what failed here)."""
        self._drop()
        self.closed = f"pipeline closed: {lost}"
        at = f" at {self.action}" if self.action else ""
        here = ""
        if failure is not None:
            here = (
                f"; this rank (rank {self.rank}{at}) had lost its traffic during "
                f"'{failure.what}': {type(failure.cause).__name__}: {first_line(failure.cause)}"
            )
        return PipelineError(f"{lost}{here}; every later call raises PipelineClosed")

    def error_for_comm_failure(self, failure: CommFailure) -> PipelineError:
        """This rank's traffic failed: the error to raise (naming the rank that failed).

        ``failure`` loses its traceback (it says what failed: ``what``): the frames of the
        communication it went through hold process groups and posted works, whose connections
        must close now (``_drop``), not when the caller lets go of the error."""
        failure.with_traceback(None)
        try:
            return self._error_for_comm_failure(failure)
        except StoreLost as e:
            return self._store_lost(e, failure)

    def _error_for_comm_failure(self, failure: CommFailure) -> PipelineError:
        notices = self.notices
        if failure.notice is not None:  # another replica failed: tell this pipeline first
            notices.publish_text(self.call, failure.notice)
        # Who is to blame, from the peers' status now: a peer that timed out too moves on
        # once it has waited for a notice, and its status goes with it.
        diagnosis = self.diagnose(failure) if notices.peek(self.call) is None else None
        notice = notices.read(self.call)
        if notice is None and self.replicas is not None:
            notice = self.replicas.read(self.call)
            if notice is not None:
                notices.publish_text(self.call, notice)
        if notice is None:  # nobody reported: this rank tells who is to blame
            why, lost = diagnosis if diagnosis is not None else self.diagnose(failure)
            if lost is not None:
                notices.mark_lost(self.call, lost, self._lost_closed(lost, why))
            notices.publish(self.call, self.action, why)
            notice = notices.read(self.call)
        if notice is not None:
            notices.mark_read(self.call)
            self.tell_replicas(notice)
        self._drop()
        if notice is None:  # a one-rank store-less pipeline cannot get here; be safe anyway
            notice = f"rank {self.rank}: {FaultNotices.lost_text(failure)}"
        if notices.lost(self.call) == self.rank:  # the peers gave up on this rank
            self.closed = (
                f"pipeline closed: the other ranks gave up on this rank (rank {self.rank}) in "
                f"{self.kind} {self.call}: {notice}; it came back too late (stopped, or stuck "
                "past the timeout); build a new pipeline (and process groups) on every rank"
            )
            return PipelineClosed(self.closed)
        why = notices.closed()
        if why is not None and self.closed is None:
            self.closed = why
        return PipelineError(FaultNotices.explain(notice, self.rank, self.action))

    def _lost_closed(self, lost: int, why: str) -> str:
        return (
            f"pipeline closed: rank {lost} was lost in {self.kind} {self.call} (rank "
            f"{self.rank}: {why}); build a new pipeline (and process groups)"
        )

    # ------------------------------------------------------------ diagnosis
    def diagnose(self, failure: CommFailure) -> tuple[str, int | None]:
        """Who is to blame for ``failure`` when no rank reported an error: the text of this
        rank's notice, and the rank that is lost (None: every peer is alive, or unknown).
        See the module doc."""
        base = FaultNotices.lost_text(failure)
        if self.status is None:
            return base, failure.peer
        if failure.peer is not None:
            return self._diagnose_transfer(failure, base)
        if not _timed_out(failure.cause):
            return base, None  # a collective whose connection closed: which peer, unknown
        here = f"{self.kind} {self.call}"
        if failure.what == REPLICA_AGREEMENT:  # the one to blame is in another replica
            return (
                f"a data-parallel replica did not come to the replicas' agreement of {here} "
                f"within {self._wait_text()}: it is not in the step (idle, in another call, "
                f"or gone); every replica must call step() together (rank {self.rank} waited "
                f"in '{failure.what}')",
                None,
            )
        agreement = failure.what == AGREEMENT  # the peers may not be in this call at all
        absent, silent = [], []
        for p in range(len(self.global_ranks)):
            if p == self.rank:
                continue
            blocked = self.status.of(self.global_ranks[p])
            if blocked is None:
                if agreement:
                    absent.append(f"rank {p} has not entered {here}: it is idle")
                else:
                    silent.append(p)
            elif blocked.pipeline != self.notices.key:
                absent.append(f"rank {p} has not entered {here}: it is {blocked.doing(False)}")
            elif (blocked.kind, blocked.call) != (self.kind, self.call):
                absent.append(f"rank {p} has not entered {here}: it is {blocked.doing(True)}")
        wait = self._wait_text()
        if silent:
            absent += [
                f"rank {p} is in {here} but did not reach '{failure.what}' within {wait} and "
                "waits on no rank (stuck in its compute, or stopped)"
                for p in silent
            ]
        if not absent:
            return base, None
        lost = silent[0] if len(silent) == 1 and len(absent) == 1 else None
        return "; ".join(absent) + f" (rank {self.rank} waited {wait} in '{failure.what}')", lost

    def _wait_text(self) -> str:
        return f"the {self.timeout_s:g} s timeout" if self.timeout_s is not None else "the timeout"

    def _diagnose_transfer(self, failure: CommFailure, base: str) -> tuple[str, int | None]:
        """A transfer with ``failure.peer`` failed: follow the peers that are blocked on
        another rank in this call to the one that is not (the lost one)."""
        assert self.status is not None and failure.peer is not None
        chain, q = [], failure.peer
        while True:
            blocked = self.status.of(self.global_ranks[q])
            if blocked is None:
                break
            same = blocked.pipeline == self.notices.key
            if not same or (blocked.kind, blocked.call) != (self.kind, self.call):
                return f"{base}; rank {q} is {blocked.doing(same)}", None
            if blocked.peer is None or blocked.peer == self.rank or blocked.peer in chain:
                return f"{base}; rank {q} is {blocked.doing(True)}", None
            chain.append(q)
            q = blocked.peer
        via = "".join(f", rank {c} waits on rank {n}" for c, n in zip(chain, [*chain[1:], q]))
        if _timed_out(failure.cause) or chain:
            return (
                f"lost rank {q} during '{failure.what}'{via}: rank {q} did not answer within "
                f"{self._wait_text()} and waits on no rank: it is stuck (in its compute) or "
                "stopped",
                q,
            )
        return f"{base}: its connection closed and it reported no error (its process is gone)", q

    # ---------------------------------------------------- outside the step
    @contextlib.contextmanager
    def outside(self, what: str, group: str = "the pipeline group") -> Iterator[None]:
        """A pipeline call outside the step protocol (``clip_grad_norm_``, ``unscale_``, the
        data-parallel setup): a ``torch.distributed`` error in it is a ``PipelineError``
        naming this rank, what failed and over which group."""
        try:
            yield
        except RuntimeError as e:
            if as_comm_failure(e, what) is None:
                raise
            raise PipelineError(
                f"rank {self.rank}: {what} failed in a collective over {group} "
                f"({type(e).__name__}: {first_line(e)}): a peer is gone, or did not call "
                f"{what} (every rank must)"
            ) from None
