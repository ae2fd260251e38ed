"""Run a function on N spawned gloo ranks and collect what each rank returns.

Starting a rank costs an interpreter and ``import torch`` (about 3 s of CPU per rank on the
2-core CI machine), more than most distributed tests spend running. ``run_ranks`` therefore
keeps one pool of ``world`` processes per world size for the whole test session: each call
sends its function to the pool's ranks, which create a fresh gloo process group on a fresh
port, run it, report, destroy the group and restore what a test may have changed (environment
variables, default dtype, grad mode, the torch RNG's start seed, graphpipe's counters of the
store keys it took), ready for the next call.

A call that fails or times out kills its pool (a rank may be stuck in a collective or hold a
broken group); the next call starts a new one. Before a rank that gave no result is killed,
it prints the Python stack of each of its threads to stderr (``faulthandler``, on
``SIGUSR1``), which pytest shows with the failing test: a hang says where it hangs.
``may_die`` calls (a rank is killed on purpose) run on their own fresh processes, as does
everything when ``GRAPHPIPE_TEST_FRESH_RANKS=1``.
"""

from __future__ import annotations

import faulthandler
import io
import itertools
import os
import queue as queue_mod
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

_TORCH_START_SEED = 67280421310721  # what a fresh process's torch generator starts from


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_one(
    rank: int, world: int, port: int, fn: Callable, args: tuple, pg_timeout: float
) -> tuple[str, Any]:
    """Run ``fn`` in a fresh process group; ``("ok", bytes)`` or ``("error", traceback)``."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        result = fn(rank, world, *args)
        # Send bytes, not tensors: a tensor on a queue lives in shared memory that dies with us.
        buf = io.BytesIO()
        torch.save(result, buf)
        return "ok", buf.getvalue()
    except BaseException as e:  # report every failure to the parent
        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        result = None
        if dist.is_initialized():
            gc.collect()  # free pipelines before the process group they use
            dist.destroy_process_group()


def _dump_on_signal() -> None:
    """This process prints every thread's stack to stderr on ``SIGUSR1`` (``_dump``)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _dump(procs: list, ranks: list[int]) -> None:
    """Ask the processes of ``ranks`` for their stacks, and give them a moment to print."""
    if not ranks or not hasattr(signal, "SIGUSR1"):
        return
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid is not None:
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)


def _worker(
    rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any, pg_timeout: float
) -> None:
    import torch

    _dump_on_signal()
    torch.set_num_threads(1)
    status, value = _run_one(rank, world, port, fn, args, pg_timeout)
    queue.put((0, rank, status, value))


def _serve(rank: int, world: int, tasks: Any, results: Any) -> None:
    """A pool rank: run tasks until told to stop, restoring the process between them."""
    import torch

    _dump_on_signal()
    torch.set_num_threads(1)
    environ = dict(os.environ)
    dtype = torch.get_default_dtype()
    while True:
        task = tasks.get()
        if task is None:
            return
        task_id, port, fn, args, pg_timeout = task
        torch.manual_seed(_TORCH_START_SEED)
        status, value = _run_one(rank, world, port, fn, args, pg_timeout)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(True)
        _forget_store_keys()
        results.put((task_id, rank, status, value))


def _forget_store_keys() -> None:
    """Each call is a new job with a new store: graphpipe's per-process counters of the keys
    it took (``runtime.groups.store_key``) start again, as in a fresh process. A call where
    the ranks took different numbers of keys (a rank that refused before a join another rank
    waited in) would otherwise leave the next call's ranks waiting on different keys."""
    import sys

    groups = sys.modules.get("graphpipe.runtime.coordination.groups")
    if groups is not None:
        groups._created.clear()


class _Pool:
    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, self.tasks[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)


_POOLS: dict[int, _Pool] = {}
_TASK_IDS = itertools.count(1)


def _collect(results: Any, world: int, task_id: int, timeout: float, may_die: tuple) -> tuple:
    import torch

    got: dict[int, Any] = {}
    errors: list[str] = []
    missing: list[int] = []  # the ranks that gave no result within the timeout
    required = set(range(world)) - set(may_die)
    while not required <= set(got):
        try:
            tid, rank, status, value = results.get(timeout=timeout)
        except queue_mod.Empty:
            missing += sorted(required - set(got))
            errors.append(
                f"ranks {missing} gave no result within {timeout} s (their stacks are in the "
                "captured stderr)"
            )
            break
        if tid != task_id:
            continue  # a late result of an earlier, failed call
        if status == "ok":
            got[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}: {value}")
            break
    return got, errors, missing


def run_ranks(
    fn: Callable,
    world: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    may_die: tuple[int, ...] = (),
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the results by rank.

    ``fn`` must be importable (a module-level function). Raises with the failing rank's
    traceback when a rank fails. ``pg_timeout``: the gloo timeout in seconds. ``may_die``:
    ranks that may end without a result (their entry is None); such a call gets fresh
    processes.
    """
    if may_die or os.environ.get("GRAPHPIPE_TEST_FRESH_RANKS") == "1":
        return _run_fresh(fn, world, args, timeout, pg_timeout, may_die)
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _POOLS[world] = _Pool(world)
    task_id, port = next(_TASK_IDS), free_port()
    for r in range(world):
        pool.tasks[r].put((task_id, port, fn, args, pg_timeout))
    got, errors, missing = _collect(pool.results, world, task_id, timeout, ())
    if errors:
        _dump(pool.procs, missing)
        pool.kill()
        del _POOLS[world]
        raise RuntimeError("\n".join(errors))
    return [got[r] for r in range(world)]


def _run_fresh(
    fn: Callable, world: int, args: tuple, timeout: float, pg_timeout: float, may_die: tuple
) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, pg_timeout), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    errors: list[str] = []
    try:
        got, errors, missing = _collect(queue, world, 0, timeout, may_die)
        _dump(procs, missing)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [got.get(r) for r in range(world)]


def nccl_world(rank: int, world: int) -> Any:
    """Inside a ``run_ranks`` function on a machine with ``world`` GPUs: replace the gloo world
    this module made with an NCCL one (on the next port), this rank on GPU ``rank``; returns
    that device. ``run_ranks`` destroys it afterwards like its own."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    return dev
