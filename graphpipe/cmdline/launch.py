"""Starting the ranks: spawn local gloo/NCCL processes, or join the world torchrun set up.

Spawned ranks ignore SIGINT: Ctrl-C reaches the whole foreground process group, and only the
launching process acts on it (it stops every rank, then raises ``KeyboardInterrupt``), so no
rank prints a traceback. A rank dies with its launcher (``PR_SET_PDEATHSIG`` on Linux). When
a rank fails, the others are stopped and ``launch`` raises ``RankFailed`` with the rank's
traceback (or, for a rank that raised ``RunStopped``, with its one-line reason).

The job's c10d store (a TCPStore) lives in the launching process, not in rank 0: it outlives
the ranks, as torchrun's agent store does, so a rank that fails and exits at once (global
rank 0 included) leaves its failure notice readable for the others (docs/failures.md).

torch is imported when ranks start, not with this module: ``RankFailed`` and
``joined_torchrun`` serve the command line before it has decided to run anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["RankFailed", "RunStopped", "joined_torchrun", "launch"]

_STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
STORE_HOST = "the graphpipe launcher process"  # who serves the store, as errors name it


class RankFailed(RuntimeError):
    """A spawned rank failed; the message names the rank and holds its traceback or exit code."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class RunStopped(Exception):
    """Raised by a rank's function to end the whole run with a one-line reason and no
    traceback (a planned stop, like a non-finite loss): spawned, ``launch`` raises
    ``RankFailed`` whose message is that line; under torchrun it propagates as itself."""


_TIMEOUT = datetime.timedelta(minutes=5)


def joined_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting the env)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_store(world: int) -> Any:
    """Under a torchrun that restarts its workers: a store private to this attempt, or None.

    torchrun's agent shares its TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE``)
    and keeps the same store across restarts (torch 2.13), so the keys that
    ``init_process_group`` writes (each rank's gloo address, NCCL's unique id) are still
    there from the failed attempt when the next one starts. A rank that reads a peer's key
    before the peer has rewritten it connects to a dead address (gloo: "Connection refused";
    torch issues 135712 and 167288). Prefixing the keys
    with the restart count (the same on every worker of a fixed-size job, since torchrun
    restarts them all together) keeps the attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=_TIMEOUT,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"graphpipe/attempt-{attempt}", store)


def _init(rank: int, world: int, device: str) -> torch.device:
    import torch
    import torch.distributed as dist

    if joined_torchrun():
        store = _torchrun_store(world)
    else:  # the launcher serves the store (``_serve_store``)
        store = dist.TCPStore(
            "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=_TIMEOUT
        )
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but CUDA is not available")
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"rank {rank} needs GPU {local}, but only {torch.cuda.device_count()} are visible "
                "(NCCL needs one GPU per rank)"
            )
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, timeout=_TIMEOUT, device_id=dev
        )
        return dev
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_TIMEOUT)
    return torch.device("cpu")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))


def _entry(rank: int, world: int, port: int, device: str, fn: Callable, args: tuple) -> None:
    import torch

    _die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dev = _init(rank, world, device)
    try:
        fn(rank, world, dev, *args)
    finally:
        _teardown()


def _teardown() -> None:
    """Free pipelines (and their graphs) before the process group they use.

    A ``DualPipeV`` sits in reference cycles (its bound-method dispatch tables), so only the
    cyclic garbage collector frees it; left to interpreter shutdown, a rank can abort at exit
    while gloo is torn down under it.
    """
    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def launch(fn: Callable[..., Any], num_ranks: int, device: str, *args: Any) -> None:
    """Run ``fn(rank, world, device, *args)`` on every rank.

    Under torchrun: this process is one rank of torchrun's world (``num_ranks`` is ignored).
    Otherwise: spawns ``num_ranks`` processes on this machine and waits for them. Raises
    ``RankFailed`` when a rank fails (after stopping the others) and ``KeyboardInterrupt`` on
    Ctrl-C (after stopping every rank).
    """
    if joined_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dev = _init(rank, world, device)
        try:
            fn(rank, world, dev, *args)
        finally:
            _teardown()
        return
    if num_ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {num_ranks}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = _serve_store()  # kept until every rank has ended
    port = store.port
    pipes = [ctx.Pipe(duplex=False) for _ in range(num_ranks)]
    procs = [
        ctx.Process(target=_spawned, args=(r, num_ranks, port, device, fn, args, pipes[r][1]))
        for r in range(num_ranks)
    ]
    try:
        # the ranks inherit the ignored SIGINT (see the module doc) and the store's host
        with _sigint_ignored(), _environ(GRAPHPIPE_STORE_HOST=STORE_HOST):
            for p in procs:
                p.start()
        for _, sender in pipes:
            sender.close()  # the ranks hold theirs
        _wait(procs, [receiver for receiver, _ in pipes])
    finally:
        _stop(procs)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` while the ranks start (spawn copies it), then as
    before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _serve_store() -> Any:
    """The job's store, served by this (the launching) process on a free port."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", _free_port(), is_master=True, wait_for_workers=False, timeout=_TIMEOUT
    )


def _spawned(
    rank: int, world: int, port: int, device: str, fn: Callable, args: tuple, report: Any
) -> None:
    try:
        _entry(rank, world, port, device, fn, args)
    except RunStopped as e:
        report.send(("stopped", str(e)))
        sys.exit(1)
    except Exception:
        report.send(("failed", traceback.format_exc()))
        sys.exit(1)


def _wait(procs: list[Any], reports: list[Any]) -> None:
    """Wait for every rank; on the first one that fails, raise ``RankFailed``.

    A rank's traceback arrives on its pipe before it exits; reading the pipes while waiting
    keeps a long traceback from filling the pipe and blocking the rank.
    """
    texts: dict[int, tuple[str, str]] = {}  # rank -> ("stopped" | "failed", text)
    readers = {conn: rank for rank, conn in enumerate(reports)}
    pending = {p.sentinel: rank for rank, p in enumerate(procs)}
    while pending:
        for ready in multiprocessing.connection.wait([*pending, *readers]):
            if ready in readers:
                rank = readers.pop(ready)
                with contextlib.suppress(EOFError, OSError):
                    texts[rank] = ready.recv()
                continue
            rank = pending.pop(ready)
            p = procs[rank]
            p.join()
            if p.exitcode == 0:
                continue
            conn = reports[rank]
            if rank not in texts and conn in readers and conn.poll():
                with contextlib.suppress(EOFError, OSError):
                    texts[rank] = conn.recv()
            if rank in texts:
                kind, text = texts[rank]
                if kind == "stopped":
                    raise RankFailed(rank, text)
                raise RankFailed(rank, f"rank {rank} failed:\n{text.rstrip()}")
            if p.exitcode < 0:
                name = signal.Signals(-p.exitcode).name
                raise RankFailed(rank, f"rank {rank} was killed by {name}")
            raise RankFailed(rank, f"rank {rank} exited with status {p.exitcode}")


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set signal handlers (and receives SIGINT)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop(procs: list[Any]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after a grace period; join all."""
    with _sigint_ignored():  # a second Ctrl-C must not leave ranks behind
        alive = [p for p in procs if p.pid is not None and p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join()
