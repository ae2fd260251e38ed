"""Exit soak: processes that end with pipelines alive (never closed) must exit with status 0.

    python profiles/exit_soak.py --runs 100               # 100 runs of 2 gloo ranks
    python profiles/exit_soak.py --runs 100 --parallel 2  # two runs at a time (busier CPUs)
    python profiles/exit_soak.py --runs 100 --destroy     # destroy_process_group() first

Each run starts ``--ranks`` fresh processes (``env://``, gloo); each builds an eager and a
captured ``DualPipeV``, steps them (the captured one three times: warmup, capture, replay),
prints its loss, and returns from its main function without ``close()``: the pipelines go
with its frame, while their process groups (``PipelineGroups``, in reference cycles) are
still alive at exit. With ``--destroy`` (or ``--destroy half``: every other run) each rank
calls ``dist.destroy_process_group()`` first. After graphpipe's exit hooks each rank prints
how many pipeline gloo groups are still held (a ``PatientGroup`` that was not released: it
would be destroyed, its worker threads joined, while the interpreter finalizes). A run fails
when a rank exits with another status (SIGABRT from ``terminate called without an active
exception`` is -6), does not print its loss, or reports a group still held; the first lines
of a failed rank's output are shown.

What it shows (2026-12-01, the shared 2-core machine, torch 2.13, 2 ranks, at f352bdf):
``--runs 300 --parallel 2``, 1065 s: no run aborted and no rank reported a group held; 1 run
failed before any pipeline was built (both ranks: ``Gloo connectFullMesh failed ... Connect
timeout`` in ``dist.init_process_group``, status 1). ``--runs 100 --parallel 2 --destroy
half``, 294 s: 0 of 100 failed. ``graphpipe/runtime/coordination/lifetime.py`` says what would abort
without the exit hooks. ``tests/test_exit_dist.py`` runs two runs of this in the default
suite.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

_RANK_ENV = "GRAPHPIPE_EXIT_SOAK_RANK"


def _rank_main(destroy: bool) -> None:
    """One rank of one run (in its own process; see the module doc)."""
    import torch
    import torch.distributed as dist

    import graphpipe

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    atexit.register(_report_held, rank)  # registered first: runs after graphpipe's hooks
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    dim = 8

    def stages() -> tuple[torch.nn.Module, torch.nn.Module]:
        mods = [
            torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh())
            for _ in range(2 * world)
        ]
        for m in mods:
            for p in m.parameters():
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return mods[rank], mods[2 * world - 1 - rank]

    x = torch.randn(4 * world, dim, generator=g)
    y = torch.randn(4 * world, dim, generator=g)
    batch = (x, y) if rank == 0 else (None, None)
    mse = torch.nn.functional.mse_loss
    eager = graphpipe.DualPipeV(stages(), num_microbatches=2 * world, loss_fn=mse)
    captured = graphpipe.DualPipeV(stages(), num_microbatches=2 * world, loss_fn=mse, capture=True)
    loss = eager.step(*batch)
    for _ in range(3):
        captured.step(*batch)
    print(f"rank {rank} loss {loss.item():.6f}", flush=True)
    if destroy:
        dist.destroy_process_group()
    # Return with both pipelines alive: the interpreter finalizes with them.


def _report_held(rank: int) -> None:
    """At exit, after graphpipe's exit hooks: how many pipeline gloo groups are still held
    (each one left would be destroyed, its worker threads joined, while the interpreter
    finalizes)."""
    from graphpipe.runtime.coordination.groups import _DROPPED, PatientGroup

    held = sum(
        1 for o in gc.get_objects() if isinstance(o, PatientGroup) and o.group is not _DROPPED
    )
    print(f"rank {rank} gloo groups held at exit: {held}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(world: int, destroy: bool) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        env[_RANK_ENV] = "destroy" if destroy else "exit"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """The problems of one run (empty: every rank printed its loss and exited with 0)."""
    problems = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            problems.append(f"rank {r} did not exit within {timeout:g} s")
            continue
        lines = [ln for ln in out.splitlines() if "Warning" not in ln]
        released = f"rank {r} gloo groups held at exit: 0" in lines
        if p.returncode != 0 or not any(ln.startswith(f"rank {r} loss ") for ln in lines):
            head = "\n    ".join(lines[:6])
            problems.append(f"rank {r} exited with status {p.returncode}:\n    {head}")
        elif not released:
            held = [ln for ln in lines if ln.startswith(f"rank {r} gloo groups held")]
            problems.append(
                f"rank {r} exited with 0 but its pipeline gloo groups outlived graphpipe's exit "
                f"hooks: {held[0] if held else 'no report'}"
            )
    return problems


def soak(runs: int, world: int = 2, parallel: int = 1, destroy: str = "no") -> list[str]:
    """Run the soak; returns one line per failed run (see the module doc)."""
    failed: list[str] = []
    pending: list[tuple[int, list[subprocess.Popen]]] = []
    for i in range(runs):
        mode = destroy == "yes" or (destroy == "half" and i % 2 == 1)
        pending.append((i, _start(world, mode)))
        if len(pending) >= parallel or i == runs - 1:
            for j, procs in pending:
                problems = _finish(procs, timeout=300)
                if problems:
                    failed.append(f"run {j}: " + "; ".join(problems))
            pending = []
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100, help="runs (default 100)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks per run (default 2)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument(
        "--destroy",
        nargs="?",
        const="yes",
        default="no",
        choices=("no", "yes", "half"),
        help="destroy_process_group() before exiting (half: every other run)",
    )
    args = p.parse_args(argv)
    start = time.monotonic()
    failed = soak(args.runs, args.ranks, args.parallel, args.destroy)
    for line in failed:
        print(line)
    print(
        f"exit soak: {len(failed)} of {args.runs} runs failed ({args.ranks} ranks, "
        f"parallel {args.parallel}, destroy {args.destroy}, {time.monotonic() - start:.0f} s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    if _RANK_ENV in os.environ:
        _rank_main(os.environ[_RANK_ENV] == "destroy")
    else:
        raise SystemExit(main())
