"""The job's c10d store as the runtime uses it: who hosts it, and every access wrapped.

The runtime keeps its failure notices, its construction agreement (``config``) and what a
blocked process is doing (``status``) in the store that ``init_process_group`` made
(``dist.distributed_c10d._get_default_store()``). When that store is lost, every access
raises a ``DistNetworkError`` (``Broken pipe``, ``Connection reset by peer``) or a
``DistStoreError``, which name nothing a user can act on; ``JobStore`` turns each into
``StoreLost``, whose message names the store's host.

Who hosts the store (``store_host``), from the init method torch recorded
(``dist.distributed_c10d._default_pg_init_method``) and the store object:

* ``env://`` (the default) and ``tcp://``: ``torch.distributed.rendezvous`` creates a
  ``TCPStore`` whose server runs in the process of **global rank 0** (``is_master = rank ==
  0`` in ``_create_c10d_store``), at ``MASTER_ADDR:MASTER_PORT``; every other rank is a
  client. Losing rank 0's process loses the store.
* torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True`` (its default): every rank is a client
  of the store of the torchrun agent on the first node, which outlives the ranks.
* ``file://``: a ``FileStore`` (no host process: the file).
* a ``store=`` passed to ``init_process_group``: whoever created its server; named by its
  address only.

Owns: nothing (the store is the job's). May touch: the store, under the keys its callers
give.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

from graphpipe.errors import PipelineError

__all__ = ["JobStore", "StoreLost", "first_line", "store_host"]


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (torch's errors append C++ stack traces)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


class StoreLost(PipelineError):
    """The job's c10d store cannot be reached: ``host`` describes who hosts it, ``cause`` is
    torch's error. A ``PipelineError``, so that one that escapes is already named."""

    def __init__(self, host: str, cause: BaseException) -> None:
        super().__init__(
            f"the job's c10d store is unreachable: its host, {host}, is gone or cannot be "
            f"reached ({type(cause).__name__}: {first_line(cause)})"
        )
        self.host, self.cause = host, cause


def _base(store: Any) -> Any:
    """The store under any ``PrefixStore`` wrappers."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def store_host(store: Any) -> str:
    """Who hosts ``store`` (the job's default store), in words (see the module doc)."""
    base = _base(store)
    if isinstance(base, dist.FileStore):
        return "the FileStore's file system"
    where = f" at {base.host}:{base.port}" if isinstance(base, dist.TCPStore) else ""
    launcher = os.environ.get("GRAPHPIPE_STORE_HOST")  # graphpipe.cmdline.launch serves it
    if launcher:
        return f"{launcher} (the TCPStore server{where})"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"the torchrun agent of the first node (the TCPStore server{where})"
    method = getattr(dist.distributed_c10d, "_default_pg_init_method", None)
    if isinstance(base, dist.TCPStore) and method is not None:
        if method.startswith(("env://", "tcp://")):
            return f"global rank 0 (the TCPStore server{where})"
    return f"the process that serves the store passed to init_process_group{where}"


class JobStore:
    """The job's store (``store``) with every access wrapped (see the module doc).

    host: who hosts it, in words (``store_host``). A failed access raises ``StoreLost``;
    ``wait`` returns False at its timeout instead of raising.
    """

    def __init__(self, store: Any, host: str | None = None) -> None:
        self.store = store
        self.host = host if host is not None else store_host(store)
        self._clone: JobStore | None = None

    def hosted_here(self, global_rank: int | None = None) -> bool:
        """This process, global rank ``global_rank`` (default: the process group's), serves
        the store (global rank 0 of an ``env://`` or ``tcp://`` job): its exit takes the
        store with it (``lifetime.hold_store``)."""
        if global_rank is None:
            global_rank = dist.get_rank() if dist.is_initialized() else -1
        return self.host.startswith("global rank 0") and global_rank == 0

    def clone(self) -> JobStore:
        """This store over a connection of its own (``Store.clone``), for another thread;
        made once."""
        if self._clone is None:
            with self._access():
                self._clone = JobStore(self.store.clone(), self.host)
        return self._clone

    def _lost(self, e: BaseException) -> StoreLost:
        return StoreLost(self.host, e.with_traceback(None))

    @contextlib.contextmanager
    def _access(self) -> Iterator[None]:
        """Any error of the store access inside is ``StoreLost``."""
        try:
            yield
        except Exception as e:
            raise self._lost(e) from None

    def set(self, key: str, value: str) -> None:
        with self._access():
            self.store.set(key, value)

    def get(self, key: str) -> str:
        """The value of ``key``, which must exist (``check`` first)."""
        with self._access():
            return self.store.get(key).decode()

    def check(self, key: str) -> bool:
        with self._access():
            return bool(self.store.check([key]))

    def peek(self, key: str) -> str | None:
        """The value of ``key``, or None when it is not set (no waiting)."""
        return self.get(key) if self.check(key) else None

    def add(self, key: str, amount: int) -> int:
        with self._access():
            return int(self.store.add(key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: is not set); the
        value it holds afterwards."""
        with self._access():
            return self.store.compare_set(key, expected, desired).decode()

    def delete(self, key: str) -> None:
        with self._access():
            self.store.delete_key(key)

    def multi_get(self, keys: Sequence[str]) -> list[str]:
        """The values of ``keys``, which must all exist."""
        with self._access():
            return [v.decode() for v in self.store.multi_get(list(keys))]

    def wait(self, keys: Sequence[str], seconds: float) -> bool:
        """Wait up to ``seconds`` for every key of ``keys`` to be set; False at the timeout."""
        try:
            self.store.wait(list(keys), datetime.timedelta(seconds=max(seconds, 0.001)))
        except dist.DistNetworkError as e:
            raise self._lost(e) from None
        except Exception as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return False
            raise self._lost(e) from None
        return True
