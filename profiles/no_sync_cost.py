"""What ``Pipeline.no_sync()`` saves: K accumulated calls per optimizer step, reducing in
every call against reducing in the last one only (the calls before inside ``no_sync``).

PP 2 x DP 2 on 4 gloo ranks (``torch.multiprocessing``), DualPipeV, float32 MLP stages of
``--dim``; both modes interleaved round by round in one job. Prints, per mode, the median
wall time of one accumulation window of K calls (rank 0's clock, after a barrier) and the
bytes each rank all-reduces over ``dp_group`` per window, and checks that both modes leave
equal gradients (to float32 rounding).

    python profiles/no_sync_cost.py --dim 512 --calls 4 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

PP, DP = 2, 2


class Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _rank(rank: int, args: argparse.Namespace, port: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=PP * DP, timeout=datetime.timedelta(seconds=120)
    )
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    p = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    stages = [Mlp(args.dim) for _ in range(2 * PP)]
    mine = [stages[p], stages[2 * PP - 1 - p]]
    pipe = graphpipe.DualPipeV(
        mine,
        num_microbatches=4,
        loss_fn=nn.functional.mse_loss,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
    )
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(args.rows, args.dim, generator=g),
            torch.randn(args.rows, args.dim, generator=g),
        )
        for _ in range(args.calls)
    ]

    def window(no_sync: bool) -> float:
        for q in pipe.parameters():
            q.grad = None
        dist.barrier()
        start = time.perf_counter()
        for c, (x, y) in enumerate(data):
            args_ = (x if p == 0 else None, y if p == 0 else None)
            if no_sync and c < len(data) - 1:
                with pipe.no_sync():
                    pipe.step(*args_)
            else:
                pipe.step(*args_)
        dist.barrier()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"reduce every call": [], "no_sync": []}
    grads = {}
    window(False)  # warm up
    for _ in range(args.rounds):
        for mode in times:
            times[mode].append(window(mode == "no_sync"))
            grads[mode] = [q.grad.clone() for q in pipe.parameters()]
    same = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads["reduce every call"], grads["no_sync"], strict=True)
    )
    nbytes = sum(q.numel() * q.element_size() for q in pipe.parameters())
    if rank == 0:
        out.update(times=times, same=same, nbytes=nbytes)
    pipe.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512, help="the MLP width (default 512)")
    ap.add_argument("--rows", type=int, default=16, help="each replica's batch rows")
    ap.add_argument("--calls", type=int, default=4, help="calls per accumulation window")
    ap.add_argument("--rounds", type=int, default=5, help="windows timed per mode")
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args, port, out), nprocs=PP * DP)
        res = dict(out)
    k = args.calls
    print(f"PP {PP} x DP {DP}, dim {args.dim}, {k} calls per window, {args.rounds} rounds")
    for mode, ts in res["times"].items():
        reduced = k if mode == "reduce every call" else 1
        mib = res["nbytes"] * reduced / 2**20
        print(
            f"{mode:>18}: median {statistics.median(ts) * 1e3:8.1f} ms per window "
            f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}); "
            f"{mib:.1f} MiB all-reduced per rank"
        )
    print(f"gradients equal (float32 rounding): {res['same']}")


if __name__ == "__main__":
    main()
