"""Failure agreement across the pipeline ranks: who failed, at which action, and why.

A failing step must end on every rank, fast and by name, not at the process group's timeout
with an anonymous transport error. The protocol:

1. The rank where an exception is raised (in a stage, in ``loss_fn``, in one of the
   runtime's own checks, a ``KeyboardInterrupt``) publishes a notice in the c10d store
   under the pipeline's key and the number of the call (``step``/``forward``) it was in:
   ``rank R at ACTION: Type: message``; the first notice of a call wins.
2. It then breaks its connections: it drops its pipeline process groups, so every peer
   blocked on it fails at once ("connection closed").
3. A rank whose P2P or control traffic fails (``CommFailure``) reads the notice and raises
   ``PipelineError`` with it; it breaks its own connections too, so that the ranks waiting
   on *it* learn in turn. No notice (a killed peer, or a peer silent past the pipeline's
   timeout): ``PipelineError`` naming the rank it was waiting for and its own action.
4. The next call rebuilds the process groups (a new generation, fresh connections: a message
   left in flight by the failed call can never be received by a later one). A rank that
   cannot rejoin (a dead peer) makes the pipeline closed: every later call raises.

Owns: the notices in the store. May touch: the pipeline's process groups (dropped on a
failure, rebuilt at the next call; the control group for ``control``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from graphpipe.errors import PipelineClosed, PipelineError

__all__ = ["CommFailure", "FaultNotices", "Faults", "PipelineClosed", "add_note"]

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


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python >= 3.11), by hand on 3.10."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


class FaultNotices:
    """The failure notices of one pipeline in the c10d store.

    store: the job's store (every rank's same one); key: the pipeline's key in it.
    """

    def __init__(self, store: Any, key: str, rank: int) -> None:
        self.store, self.key, self.rank = store, key, rank

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

    def peek(self, call: int) -> str | None:
        """The notice of call ``call`` if there is one now (no waiting)."""
        if self.store is None or not self.store.check([self._key(call)]):
            return None
        return self.store.get(self._key(call)).decode()

    def read(self, call: int, wait_s: float = 1.0) -> str | None:
        """The notice of call ``call``, waiting up to ``wait_s`` for it; None if none."""
        if self.store is None:
            return None
        key = self._key(call)
        try:
            self.store.wait([key], datetime.timedelta(seconds=wait_s))
        except Exception:  # the store's timeout (the type differs across torch versions)
            return None
        return self.store.get(key).decode()

    @staticmethod
    def lost(failure: CommFailure) -> str:
        """What a rank that lost a peer (and found no notice) tells the others."""
        cause = str(failure.cause).strip().splitlines()[0] if str(failure.cause) else ""
        who = f"rank {failure.peer}" if failure.peer is not None else "a peer"
        return (
            f"lost {who} during '{failure.what}', and no rank reported an error: {who} is gone "
            f"or stuck ({type(failure.cause).__name__}: {cause})"
        )

    @staticmethod
    def explain(notice: str, me: int, action: str) -> str:
        """The message of the ``PipelineError`` a rank raises for a failure ``notice``."""
        at = f" at {action}" if action else ""
        return f"the step failed on {notice} (this rank: rank {me}{at}); {_GRADS}"


class Faults:
    """What a pipeline does about failures, call by call (see the module doc).

    notices: the store's notices; groups: the pipeline's groups (dropped on a failure,
    rebuilt at the next call). ``action``: what this rank was doing when it failed.
    """

    def __init__(self, notices: FaultNotices, groups: Any, rank: int) -> None:
        self.notices, self.groups, self.rank = notices, groups, rank
        self.call = 0
        self.action = ""
        self.closed: str | None = None
        # With data parallelism: the notices shared with this rank's data-parallel group
        # (``replicas``, keyed like ``notices``) and this replica's index in it.
        self.replicas: FaultNotices | None = None
        self.replica = 0

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

    def begin(self) -> None:
        """Start a call: refuse if closed, rebuild the groups after a failed call."""
        if self.closed is not None:
            raise PipelineClosed(self.closed)
        self.call += 1
        self.action = ""
        if self.groups.dropped:
            try:
                self.groups.rebuild()
            except Exception as e:
                self.closed = (
                    f"pipeline closed: rank {self.rank} could not rebuild its process groups "
                    f"after a failed step (a peer is gone?): {type(e).__name__}: {e}"
                )
                raise PipelineClosed(self.closed) from None

    def control(self, what: str, op: Callable[[Any], Any]) -> None:
        """Run the collective ``op(control group)`` and wait; a failure is a ``CommFailure``."""
        self.action = what
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

    def original(self, exc: BaseException) -> None:
        """This rank raised ``exc``: publish it, tell the peers (drop the groups), note it."""
        self.notices.publish(self.call, self.action, exc)
        if self.replicas is not None:  # the pipeline's first notice (maybe another rank's)
            self.tell_replicas(self.notices.read(self.call) or self.notices.text(self.action, exc))
        self._drop()
        where = f" at action {self.action}" if self.action else ""
        add_note(
            exc,
            f"graphpipe: raised on rank {self.rank}{where}; every other rank raises "
            f"PipelineError naming it; {_GRADS}",
        )

    def consequence(self, failure: CommFailure) -> PipelineError:
        """This rank's traffic failed: the error to raise (naming the rank that failed)."""
        if failure.notice is not None:  # another replica failed: tell this pipeline first
            self.notices.publish_text(self.call, failure.notice)
        notice = self.notices.read(self.call)
        if notice is None and self.replicas is not None:
            notice = self.replicas.read(self.call)
            if notice is not None:
                self.notices.publish_text(self.call, notice)
        if notice is None:  # nobody reported: this rank found the loss; tell the others
            self.notices.publish(self.call, self.action, FaultNotices.lost(failure))
            notice = self.notices.read(self.call)
        if notice is not None:
            self.tell_replicas(notice)
        self._drop()
        if notice is None:  # a one-rank store-less pipeline cannot get here; be safe anyway
            notice = f"rank {self.rank}: {FaultNotices.lost(failure)}"
        return PipelineError(FaultNotices.explain(notice, self.rank, self.action))
