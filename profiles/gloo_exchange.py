"""gloo P2P on this machine: how a two-way exchange's cost grows with the ops per batch.

Two ranks exchange 256 bytes, split into K messages each way, as one
``batch_isend_irecv`` (K isends + K irecvs, what one DualPipeV batch posts in steady state),
after a barrier and a little jittered compute, ``--reps`` times per K. Prints the median and
mean exchange time and the share of exchanges slower than 1 ms (transport stalls).

    python profiles/gloo_exchange.py [--reps 400] [--ops 1,2,4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from graphpipe.cmdline.launch import launch


def _rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    peer = 1 - rank
    for k in opts["ops"]:
        send = [torch.zeros(64 // k) for _ in range(k)]
        recv = [torch.zeros(64 // k) for _ in range(k)]
        times = []
        for i in range(opts["reps"]):
            dist.barrier()
            x = torch.randn(32, 32)
            for _ in range(i % 7):  # jitter: the two ranks do not post in lockstep
                x = x @ x * 0.01
            ops = [dist.P2POp(dist.isend, t, peer, tag=j) for j, t in enumerate(send)]
            ops += [dist.P2POp(dist.irecv, t, peer, tag=j) for j, t in enumerate(recv)]
            t0 = time.perf_counter()
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            slow = sum(t > 1e-3 for t in times) / len(times)
            print(
                f"{k} op(s) each way: median {statistics.median(times) * 1e6:6.0f} us, "
                f"mean {statistics.fmean(times) * 1e6:6.0f} us, {slow:5.1%} over 1 ms",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--ops", default="1,2,4", help="messages per direction, comma-separated")
    args = p.parse_args(argv)
    ops = [int(v) for v in args.ops.split(",")]
    launch(_rank, 2, "cpu", {"reps": args.reps, "ops": ops})
    return 0


if __name__ == "__main__":
    sys.exit(main())
