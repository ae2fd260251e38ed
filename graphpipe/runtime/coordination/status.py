"""What a blocked process is doing, for the peers that wait on it: published only when needed.

A rank that waits in a call which a peer never entered (the peer is idle, or in a call of
another pipeline), or on a transfer from a peer that itself waits on a third rank, times out
without knowing why; to name the rank to blame and what it is doing, it reads the peers'
*status* from the job's store. Publishing a status at every call would cost store round
trips per call, so a process publishes one only while it **blocks**:

* every wait on a pipeline gloo group's work goes through ``groups.PatientGroup``, which
  marks it as this process's current wait (``WATCH.current``: attribute stores, no store
  access) and unmarks it when it ends;
* one daemon thread per process (``Watch``) looks at the current wait every ``PERIOD_S``;
  a wait it sees twice in a row (blocked at least ``PERIOD_S``, at most twice that) gets
  its status published, over the thread's own clone of the store (``Store.clone``: a
  connection of its own, never shared with the main thread);
* the status is deleted when that wait ends, or, when the wait failed, at the start of the
  process's next call (so that a peer that times out a moment later still reads it);
* the construction's join (``config``) publishes its own status when its store wait has
  lasted ``patience(timeout)``.

One key per process (``graphpipe/status/<global rank>``): a process blocks in one wait at a
time. A peer with no status is in no blocked pipeline wait: idle, busy outside the pipeline
(or in its compute), or stopped; a status cannot tell those apart.

Owns: this process's status key, the watch thread. May touch: the job's store (through
``JobStore``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
from dataclasses import asdict, dataclass
from typing import Any

from .store import JobStore, StoreLost

__all__ = ["WATCH", "Blocked", "ProcessStatus", "Watch", "describe_pipeline", "patience"]

PERIOD_S = 0.25  # how often the watch thread looks at the current wait


def patience(timeout_s: float) -> float:
    """How long the construction's join waits before it publishes its status (seconds)."""
    return min(0.5 * timeout_s, 1.0)


def describe_pipeline(key: str) -> str:
    """``graphpipe/0_1/2`` in words: ``the 2nd pipeline built on global ranks [0, 1]``."""
    parts = key.split("/")
    try:
        ranks, index = [int(r) for r in parts[-2].split("_")], int(parts[-1])
    except (IndexError, ValueError):
        return f"pipeline {key!r}"
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(index % 10 if index % 100 not in (11, 12, 13) else 0)
    return f"the {index}{suffix or 'th'} pipeline built on global ranks {ranks}"


@dataclass(frozen=True)
class Blocked:
    """What a process blocks in: ``kind`` (``step``, ``forward``, ``construction``, ``rejoin``)
    number ``call`` of the pipeline ``pipeline`` (its store key), at ``at`` (the collective:
    ``batch agreement``, ``loss``), or on a transfer with pipeline rank ``peer``."""

    pipeline: str
    kind: str
    call: int
    at: str = ""
    peer: int | None = None

    def doing(self, same_pipeline: bool) -> str:
        """``in forward 2 of another pipeline (...)``: what this process is doing, for a
        peer of pipeline ``same_pipeline`` or not."""
        which = "this pipeline" if same_pipeline else f"another pipeline ({self.where()})"
        if self.kind == "construction":
            return "building " + ("this pipeline" if same_pipeline else self.where())
        if self.kind == "rejoin":
            return f"rebuilding the process groups of {which} after a failed call"
        at = f", waiting on rank {self.peer}" if self.peer is not None else ""
        at = at or (f", at {self.at}" if self.at else "")
        return f"in {self.kind} {self.call} of {which}{at}"

    def where(self) -> str:
        return describe_pipeline(self.pipeline)


class ProcessStatus:
    """The status of the processes in the job's store (see the module doc).

    store: the job's store. global_rank: this process.
    """

    _pending: ProcessStatus | None = None  # the instance whose status is in the store now

    def __init__(self, store: JobStore, global_rank: int) -> None:
        self.store, self.global_rank = store, global_rank

    @staticmethod
    def key(global_rank: int) -> str:
        return f"graphpipe/status/{global_rank}"

    def publish(self, blocked: Blocked, via: JobStore | None = None) -> None:
        """This process blocks in ``blocked`` (may raise ``StoreLost``); ``via``: the store
        connection to write it with (the watch thread's own), default ``store``."""
        (via or self.store).set(self.key(self.global_rank), json.dumps(asdict(blocked)))
        self._now_pending(self)

    @classmethod
    def _now_pending(cls, status: ProcessStatus) -> None:
        cls._pending = status

    @classmethod
    def clear(cls) -> None:
        """Delete this process's status if one is published (free when none is; a store
        that is gone took the status with it)."""
        pending = cls._pending
        if pending is None:
            return
        cls._pending = None
        with contextlib.suppress(StoreLost):
            pending.store.delete(pending.key(pending.global_rank))

    def of(self, global_rank: int) -> Blocked | None:
        """The status of the process ``global_rank``: None when it is not blocked."""
        text = self.store.peek(self.key(global_rank))
        if text is None:
            return None
        try:
            return Blocked(**json.loads(text))
        except (TypeError, ValueError):  # another writer's key: treat as no status
            return None


class Watch:
    """The watch thread of this process (``WATCH``, see the module doc).

    ``current``: the wait in progress, an object with ``blocked() -> (ProcessStatus,
    Blocked, JobStore) | None`` (this process's status, what to publish, and the store
    connection the thread may use), or None. Nothing else here holds a wait (a wait holds
    its process group, whose connections must close when the pipeline drops it): the
    thread remembers waits by ``id``.
    """

    def __init__(self) -> None:
        self.current: Any = None
        self.published = 0  # id of the wait whose status the thread published
        self.failed = 0  # id of the last wait that failed
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._registered = False

    def start(self) -> None:
        """Start the thread (once per process; stopped at exit, before the interpreter
        finalizes)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="graphpipe-status", daemon=True)
            self._thread.start()
            if not self._registered:
                atexit.register(self.stop)
                self._registered = True

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * PERIOD_S + 1.0)

    def enter(self, wait: Any) -> None:
        """``wait`` is this process's wait in progress."""
        self.current = wait

    def leave(self, wait: Any) -> None:
        """``wait`` ended well: its status, if the thread published one, goes."""
        self.current = None
        if self.published and self.published == id(wait):
            self.published = 0
            ProcessStatus.clear()

    def failed_in(self, wait: Any) -> None:
        """``wait`` failed: no wait in progress, and its published status stays for the
        peers."""
        self.current = None
        self.failed = id(wait)

    def _run(self) -> None:
        seen = 0
        while not self._stop.wait(PERIOD_S):
            cur = self.current
            ident = id(cur) if cur is not None else 0
            if ident != 0 and ident == seen and self.published != ident:
                with contextlib.suppress(Exception):  # the store or the pipeline is gone
                    self._publish(cur, ident)
            seen = ident
            cur = None  # not while sleeping: a wait holds its group's connections open

    def _publish(self, cur: Any, ident: int) -> None:
        got = cur.blocked()
        if got is None:
            return
        status, blocked, via = got
        status.publish(blocked, via)
        self.published = ident
        if self.current is not cur and self.failed != ident:  # it ended well meanwhile
            self.published = 0
            via.delete(status.key(status.global_rank))


WATCH = Watch()
