"""Run a function on N spawned gloo ranks and collect what each rank returns."""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any, pg_timeout: float
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        result = fn(rank, world, *args)
        # Send bytes, not tensors: a tensor on a queue lives in shared memory that dies with us.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # report every failure to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            import gc

            gc.collect()  # free pipelines before the process group they use
            dist.destroy_process_group()


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
    ranks that may end without a result (their entry is None).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, pg_timeout), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        required = set(range(world)) - set(may_die)
        while not required <= set(results):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}: {value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results.get(r) for r in range(world)]
