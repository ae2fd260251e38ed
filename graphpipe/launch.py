"""Starting the ranks: spawn local gloo/NCCL processes, or join the world torchrun set up."""

from __future__ import annotations

import datetime
import gc
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["joined_torchrun", "launch"]

_TIMEOUT = datetime.timedelta(minutes=5)


def joined_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting the env)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, device: str) -> torch.device:
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
            "nccl", rank=rank, world_size=world, timeout=_TIMEOUT, device_id=dev
        )
        return dev
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_TIMEOUT)
    return torch.device("cpu")


def _entry(rank: int, world: int, port: int, device: str, fn: Callable, args: tuple) -> None:
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
    gc.collect()
    dist.destroy_process_group()


def launch(fn: Callable[..., Any], num_ranks: int, device: str, *args: Any) -> None:
    """Run ``fn(rank, world, device, *args)`` on every rank.

    Under torchrun: this process is one rank of torchrun's world (``num_ranks`` is ignored).
    Otherwise: spawns ``num_ranks`` processes on this machine.
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
    mp.spawn(_entry, args=(num_ranks, _free_port(), device, fn, args), nprocs=num_ranks, join=True)
