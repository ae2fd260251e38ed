"""A pre-spawned world driven step by step over pipes (for pytest-benchmark)."""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist

from .measure import control_group, timed_step
from .modes import Mode, build_modes
from .regimes import Workload

__all__ = ["BenchWorld"]


def _serve(rank: int, world: int, device: torch.device, conn: Any) -> None:
    """A rank of ``BenchWorld`` (started by ``graphpipe.cmdline.launch``'s rank entry, which also
    tears down): build the modes on ``setup``, run one timed step on ``step``."""
    group = dist.group.WORLD
    ctrl = control_group(group)
    modes: dict[str, Mode] = {}
    batch: tuple[Any, Any] = (None, None)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "setup":
                for m in modes.values():
                    m.close()
                built, skipped = build_modes(arg, rank, world, device, group)
                modes = {m.name: m for m in built}
                x, y = arg.batch(device)
                batch = (x, y) if rank == 0 else (None, None)
                conn.send(("ok", (list(modes), skipped)))
            elif cmd == "step":
                conn.send(("ok", timed_step(modes[arg], *batch, ctrl, device)))
            else:
                break
    except BaseException:
        conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        for m in modes.values():
            m.close()
        conn.close()


class BenchWorld:
    """``num_ranks`` spawned ranks that run one pipeline step of a mode per command.

    For pytest-benchmark: ``step(mode)`` sends the command to every rank (so every rank runs
    the same steps), each rank waits at a barrier, times its step, and replies; it returns
    the slowest rank's time. The caller's own timing of ``step`` adds the pipe round trip
    between local processes, small against a step.
    """

    def __init__(self, num_ranks: int, device: str = "cpu", timeout: float = 300.0) -> None:
        import torch.multiprocessing as mp

        from graphpipe.cmdline.launch import STORE_HOST, _entry, _environ, _serve_store

        ctx = mp.get_context("spawn")
        self.store = _serve_store()  # the job's store, served here as graphpipe.cmdline.launch does
        self.ranks = num_ranks
        port = self.store.port
        self.timeout = timeout
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        with _environ(GRAPHPIPE_STORE_HOST=STORE_HOST):
            for rank in range(num_ranks):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_entry,
                    args=(rank, num_ranks, port, device, _serve, (child,)),
                    daemon=True,
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)

    def _ask(self, cmd: str, arg: Any) -> list[Any]:
        for c in self.conns:
            c.send((cmd, arg))
        replies = []
        for rank, c in enumerate(self.conns):
            if not c.poll(self.timeout):
                self.close()
                raise TimeoutError(f"a bench rank did not answer {cmd!r} in {self.timeout} s")
            try:
                status, value = c.recv()
            except EOFError:  # it died before answering (its traceback is on stderr)
                status, value = "error", f"rank {rank} exited without answering {cmd!r}"
            if status != "ok":
                self.close()
                raise RuntimeError(value)
            replies.append(value)
        return replies

    def setup(self, workload: Workload) -> tuple[list[str], dict[str, str]]:
        """Build every mode for ``workload``; returns (mode names, skipped modes with why)."""
        return self._ask("setup", workload)[0]

    def step(self, mode: str) -> float:
        """One step of ``mode`` on every rank; the slowest rank's wall time (seconds)."""
        return max(self._ask("step", mode))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []

    def __enter__(self) -> BenchWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
