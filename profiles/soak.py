"""Soak: run many training steps of a tiny model and watch every rank's resident memory.

    python profiles/soak.py --steps 1000                  # eager pipeline, 2 gloo ranks
    python profiles/soak.py --steps 1000 --capture step   # the captured (static replay) step
    python profiles/soak.py --steps 1000 --part local     # the same model, no pipeline/gloo
    python profiles/soak.py --steps 1000 --tracemalloc    # Python-level allocations too
    python profiles/soak.py --steps 1000 --smaps        # which mappings grow
    python profiles/soak.py --steps 1000 --mallinfo     # malloc: bytes in use vs free
    MALLOC_ARENA_MAX=1 python profiles/soak.py --steps 1000
    python profiles/soak.py --steps 1000 --malloc-trim    # glibc malloc_trim(0) every step

Each rank reads its resident set size from ``/proc/self/statm`` after every step and fits a
line through the steps after ``--skip`` (the warmup: allocator pools, the first handshakes;
default a fifth of ``--steps``);
rank 0 prints every rank's growth in bytes per step and the RSS at a few steps.

``--part`` bisects the step: ``pipeline`` (what ``graphpipe train`` runs: a batch on rank 0,
``DualPipeV.step``, AdamW), ``local`` (every stage of the model in one process, forward,
backward, AdamW: no pipeline, no gloo), ``gloo`` (only the P2P exchange of the step's
activation shapes between the two ranks), ``broadcast`` (only two broadcasts per step, as
many collectives as a pipeline step runs besides its P2P: the batch agreement and the loss),
``data`` (only drawing batches), ``idle`` (the loop and the RSS read alone).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tracemalloc
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch and graphpipe are imported by the ranks (and the launcher) once the arguments are
# known to be good: an argument error answers without waiting for torch.

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size, from ``/proc/self/statm`` (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_bytes() -> tuple[int, int]:
    """glibc's ``mallinfo2()``: (bytes in use, free bytes held) over all arenas; (0, 0)
    where glibc lacks it (before 2.33)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0, 0
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd, info.fordblks


def rss_by_mapping() -> dict[str, int]:
    """Resident bytes per mapping of this process (``/proc/self/smaps``): ``[heap]``, a file,
    or ``anon@START`` for an anonymous mapping (glibc arenas of other threads, big mallocs)."""
    out: dict[str, int] = {}
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                name = head[5] if len(head) > 5 else f"anon@{head[0].split('-')[0]}"
            elif head[0] == "Rss:":
                out[name] = out.get(name, 0) + int(head[1]) * 1024
    return out


def slope(ys: Sequence[int]) -> float:
    """Least-squares growth per step of ``ys`` (one value per step)."""
    n = len(ys)
    xs = range(n)
    mx, my = (n - 1) / 2, statistics.fmean(ys)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    den = sum((x - mx) ** 2 for x in xs)
    return num / den if den else 0.0


def _malloc_trim() -> Any:
    libc = ctypes.CDLL("libc.so.6")
    return lambda: libc.malloc_trim(0)


def _step_fn(rank: int, world: int, opts: dict) -> Any:
    """A function that runs one step of ``opts['part']``."""
    import torch
    import torch.distributed as dist

    from graphpipe import DualPipeV
    from graphpipe.data import ByteBatches, load_text_bytes
    from graphpipe.models import LlamaConfig, LlamaLoss, build_stages, unique_parameters

    cfg = LlamaConfig(hidden=32, n_layers=2, n_heads=2, max_seq_len=32, use_kernels=False)
    data = load_text_bytes(max_bytes=200_000)
    batches = iter(ByteBatches(data, 8, 32, seed=0))
    part = opts["part"]
    if part == "idle":
        return lambda: None
    if part == "data":
        return lambda: next(batches)
    if part == "gloo":
        buf = torch.zeros(2, 32, 32)  # one micro-batch's activation
        peer = 1 - rank

        def exchange() -> None:
            for _ in range(8):
                ops = [dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, buf, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

        return exchange
    if part == "broadcast":
        sig, loss = torch.zeros(256, dtype=torch.int64), torch.zeros(())

        def broadcasts() -> None:  # a pipeline step's two collectives besides its P2P
            dist.broadcast(sig, src=0)
            dist.broadcast(loss, src=0)

        return broadcasts
    stages = build_stages(cfg, 2 * world, seed=0)
    loss_fn = LlamaLoss(False)
    if part == "local":
        params = unique_parameters(stages)
        opt = torch.optim.AdamW(params, lr=1e-3)

        def local() -> float:
            x, y = next(batches)
            opt.zero_grad()
            h = x
            for s in stages:
                h = s(h)
            loss = loss_fn(h, y)
            loss.backward()
            opt.step()
            return float(loss)

        return local
    mine = (stages[rank], stages[2 * world - 1 - rank])
    capture = False if opts["capture"] == "none" else opts["capture"]
    pipe = DualPipeV(mine, num_microbatches=4 * world, loss_fn=loss_fn, capture=capture)
    opt = torch.optim.AdamW(unique_parameters(mine), lr=1e-3)

    def pipeline() -> float:
        x, y = next(batches) if rank == 0 else (None, None)
        opt.zero_grad(set_to_none=capture is False)
        loss = pipe.step(x, y)
        opt.step()
        return float(loss)

    pipeline.pipe = pipe  # type: ignore[attr-defined]
    return pipeline


def _rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    import torch.distributed as dist

    step = _step_fn(rank, world, opts)
    trim = _malloc_trim() if opts["malloc_trim"] else None
    # Preallocated arrays of raw ints: the measurement allocates nothing per step.
    rss, used, free = (array("q", bytes(8 * opts["steps"])) for _ in range(3))
    snap = None
    maps_before: dict[str, int] = {}
    for i in range(opts["steps"]):
        step()
        if opts["gc"]:
            gc.collect()
        if trim is not None:
            trim()
        rss[i] = rss_bytes()
        if opts["mallinfo"]:
            used[i], free[i] = malloc_bytes()
        if opts["smaps"] and i == opts["skip"]:
            maps_before = rss_by_mapping()
        if opts["tracemalloc"] and i == opts["skip"]:
            tracemalloc.start(8)
            snap = tracemalloc.take_snapshot()
    top = []
    if snap is not None:
        diff = tracemalloc.take_snapshot().compare_to(snap, "traceback")
        traced = sum(d.size_diff for d in diff)
        top = [f"python heap {traced / 1024:+.1f} KiB over the measured steps; largest:"]
        for d in diff[:5]:
            top.append(f"  {d.size_diff / 1024:+.1f} KiB {d.count_diff:+d} blocks")
            top += [f"      {line}" for line in d.traceback.format()[-4:]]
    if opts["every"]:
        k = opts["every"]
        series = used if opts["mallinfo"] else rss
        what = "malloc in use" if opts["mallinfo"] else "RSS"
        top.append(
            f"{what} MiB every {k} steps: "
            + " ".join(f"{series[i] / 2**20:.2f}" for i in range(k - 1, len(series), k))
        )
    if opts["mallinfo"]:
        top.append(
            f"malloc in use {slope(used[opts['skip'] :]):+.0f} B/step, "
            f"free held {slope(free[opts['skip'] :]):+.0f} B/step (mallinfo2)"
        )
    if opts["smaps"]:
        after = rss_by_mapping()
        grown = sorted(
            ((after.get(k, 0) - maps_before.get(k, 0), k) for k in after.keys() | maps_before),
            reverse=True,
        )
        top.append("RSS growth by mapping over the measured steps:")
        top += [f"  {d / 1024:+.0f} KiB {k}" for d, k in grown[:4] if d]
        top.append(f"  total {sum(d for d, _ in grown) / 1024:+.0f} KiB")
    if hasattr(step, "pipe"):
        step.pipe.close()
    measured = rss[opts["skip"] :]
    row = {
        "rank": rank,
        "slope": slope(measured),
        "marks": [rss[i] for i in (0, opts["skip"], len(rss) // 2, len(rss) - 1)],
        "top": top,
    }
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        env = os.environ.get("MALLOC_ARENA_MAX")
        print(
            f"soak: part {opts['part']}, capture {opts['capture']}, {opts['steps']} steps "
            f"(fit over steps {opts['skip'] + 1}..{opts['steps']}), "
            f"malloc_trim {'on' if trim else 'off'}, gc {'on' if opts['gc'] else 'off'}, "
            f"MALLOC_ARENA_MAX {env or 'unset'}"
        )
        for r in rows:
            marks = " / ".join(f"{m / 2**20:.1f}" for m in r["marks"])
            print(
                f"rank {r['rank']}: {r['slope']:+.0f} B/step; RSS MiB at steps 1 / "
                f"{opts['skip'] + 1} / {opts['steps'] // 2} / {opts['steps']}: {marks}"
            )
            for line in r["top"]:
                print(f"  {line}")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="steps to run (default 1000)")
    p.add_argument(
        "--skip",
        type=int,
        default=None,
        help="warmup steps left out of the fit (default: a fifth of --steps, 200 of 1000)",
    )
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument(
        "--part",
        choices=("pipeline", "local", "gloo", "broadcast", "data", "idle"),
        default="pipeline",
        help="what each step runs (default pipeline)",
    )
    p.add_argument("--capture", choices=("none", "step"), default="none")
    p.add_argument("--malloc-trim", action="store_true", help="glibc malloc_trim(0) per step")
    p.add_argument("--gc", action="store_true", help="gc.collect() after every step")
    p.add_argument("--tracemalloc", action="store_true", help="trace Python allocations")
    p.add_argument("--smaps", action="store_true", help="RSS growth per memory mapping")
    p.add_argument("--mallinfo", action="store_true", help="glibc malloc in-use / free bytes")
    p.add_argument(
        "--every", type=int, default=0, metavar="K", help="also print the series every K steps"
    )
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the fit needs two steps), got {args.steps}")
    if args.skip is None:
        args.skip = args.steps // 5
    if not 0 <= args.skip < args.steps - 1:
        p.error(f"--skip must be in [0, --steps - 1) = [0, {args.steps - 1}), got {args.skip}")
    from graphpipe.cmdline.launch import launch

    launch(_rank, args.ranks, "cpu", vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
