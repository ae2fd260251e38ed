"""What publishing status only when a wait blocks costs a step (``runtime.coordination.status``).

    python profiles/status_cost.py --steps 200            # the overhead regime, 2 gloo ranks

Every wait on a pipeline gloo group goes through ``groups.PatientGroup`` (a small object per
operation, a few attribute stores per wait) and one watch thread per process wakes every
0.25 s. This measures, on the ``graphpipe bench`` overhead workload (many tiny micro-batches:
the step is host-bound):

* ``ops``: gloo operations (sends, receives, collectives) one rank posts per step;
* ``per op``: the wrapper's own cost per operation (posting and waiting on a work that is
  complete at once, wrapped against raw; medians of interleaved batches);
* ``step``: the median step of a pipeline as shipped and of the same pipeline with its
  groups unwrapped (steps in turns), in blocks of 4 steps with the watch thread running
  and stopped, alternately.

Rank 0 prints the figures; ``ops x per op`` is the wrapper's share of a step.

Three runs on the shared 2-core machine (torch 2.13, ``--steps 400``): 71 operations per
step; the wrapper +0.69, +0.85, +1.42 us per operation (raw 0.20-0.34 us), so 49, 61 and 101
us per step of 38.5-47.2 ms: 0.1-0.2%. The step medians, shipped with the thread running
against unwrapped without it: -0.4%, +0.1%, -5.7% (the machine's noise is larger than the
cost).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from graphpipe import DualPipeV
from graphpipe.bench import workloads
from graphpipe.bench.regimes import mse_loss
from graphpipe.cmdline.launch import launch
from graphpipe.runtime.coordination.groups import PatientGroup
from graphpipe.runtime.coordination.status import WATCH


def _unwrap(pipe: DualPipeV) -> None:
    """The pipeline's groups without their ``PatientGroup`` wrappers."""
    g = pipe.groups
    g.control = g.control.group
    g.p2p = {
        e: (pg.group if isinstance(pg, PatientGroup) else pg, i) for e, (pg, i) in g.p2p.items()
    }


class _Counting:
    """Counts the operations posted on a group."""

    def __init__(self, group: Any, counter: list) -> None:
        self.group, self.counter = group, counter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.group, name)
        if name in ("send", "recv", "allreduce", "broadcast"):
            self.counter[0] += 1
        return attr


class _Done:
    """A completed work: ``wait`` returns at once (the wrapper's own cost, nothing else)."""

    def wait(self, *args: Any) -> bool:
        return True


class _Instant:
    """A group whose operations complete at once."""

    done = _Done()

    def allreduce(self, *args: Any) -> _Done:
        return self.done


def _per_op_us(n: int = 20000, batches: int = 9) -> tuple[float, float]:
    """Median us per post + wait of an operation that completes at once: (raw, wrapped)."""
    raw_group = _Instant()
    wrapped = PatientGroup(raw_group, lambda peer: None)
    buf = torch.zeros(1)
    out: dict[str, list[float]] = {"raw": [], "wrapped": []}
    for _ in range(batches):
        for name, group in (("raw", raw_group), ("wrapped", wrapped)):
            t = time.perf_counter()
            for _ in range(n):
                group.allreduce([buf]).wait()
            out[name].append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out["raw"]), statistics.median(out["wrapped"])


def _rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    found, _ = workloads("overhead", world, "cpu")
    w = found[0]
    x, y = w.batch(device)
    batch = (x, y) if rank == 0 else (None, None)
    shipped = DualPipeV(
        w.local_stages(rank, world, device), num_microbatches=w.microbatches, loss_fn=mse_loss
    )
    bare = DualPipeV(
        w.local_stages(rank, world, device), num_microbatches=w.microbatches, loss_fn=mse_loss
    )
    _unwrap(bare)
    for pipe in (shipped, bare):  # warm up (the handshake step)
        pipe.step(*batch)
    counter = [0]
    g = bare.groups
    control, p2p = g.control, dict(g.p2p)
    g.control = _Counting(control, counter)
    g.p2p = {e: (_Counting(pg, counter), i) for e, (pg, i) in p2p.items()}
    bare.step(*batch)
    g.control, g.p2p = control, p2p
    ops = counter[0]
    # Blocks of steps with the watch thread running and stopped, alternately; in each step
    # pair the two pipelines in turns (which goes first alternates).
    times: dict[tuple[str, bool], list[float]] = {}
    block = 4
    for b in range(max(2, opts["steps"] // block)):
        thread = b % 2 == 0
        WATCH.start() if thread else WATCH.stop()
        for i in range(block):
            pair = [("shipped", shipped), ("bare", bare)]
            for name, pipe in pair if i % 2 == 0 else pair[::-1]:
                dist.barrier()
                t = time.perf_counter()
                pipe.step(*batch)
                times.setdefault((name, thread), []).append(time.perf_counter() - t)
    WATCH.start()
    raw, wrapped = _per_op_us()
    shipped.close()
    bare.close()
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"overhead regime, {world} ranks, M={w.microbatches}, {opts['steps']} steps per "
            f"pipeline: {ops} gloo ops per step on rank 0; per op {raw:.2f} us raw, "
            f"{wrapped:.2f} us wrapped (+{wrapped - raw:.2f} us, {ops * (wrapped - raw):.0f} us "
            "per step)"
        )
        print(
            "median step ms (watch thread on / off): "
            + ", ".join(
                f"{n} {med[n, True]:.2f} / {med[n, False]:.2f}" for n in ("shipped", "bare")
            )
            + f"; shipped with the thread against bare without: "
            f"{(med['shipped', True] / med['bare', False] - 1) * 100:+.2f}%"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per variant (default 200)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    args = p.parse_args(argv)
    launch(_rank, args.ranks, "cpu", vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
