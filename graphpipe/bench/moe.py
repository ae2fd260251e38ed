"""``graphpipe bench --regime moe``: the overlapped F&B pair of an MoE stage against F then B.

Every rank holds the same middle stage of the built-in MoE Llama (every block an MoE block),
its experts sharded over all the ranks (``ep`` = ``--ranks``; one rank: local experts, no
exchange). A round, on every rank at once:

1. untimed: the forward of micro-batch ``b`` (its outputs and random output gradients);
2. timed, in an order that alternates between rounds: **pair**,
   ``overlapped_forward_backward`` (the forward of micro-batch ``a`` interleaved with the
   backward of ``b``, each all-to-all in flight while the other micro-batch computes), and
   **F then B**, the plain forward of ``a`` then the plain backward of ``b`` (each all-to-all
   waited as soon as it is posted), each after a barrier; a time is the slowest rank's wall
   time (and F and B are timed apart inside F then B).

The table gives medians with the inter-quartile range; ``pair / (F then B)`` is the ratio of
medians and ``paired`` the median over rounds of the per-round ratio. ``wait`` rows: the time
the slowest rank spent blocked in all-to-all waits (from the stage's event log, stamped: each
``waited`` event's time since the event before it), what the pair is meant to hide. Before
timing, one round checks that the pair's forward outputs and gradients equal F then B's
bitwise.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["moe_main", "moe_rank"]

# 4 layers over 3 stages: the middle stage holds 2 MoE blocks (4 exchanges each way)
_DEFAULTS = {"hidden": 256, "layers": 4, "experts": 8, "top_k": 2, "rows": 4, "seq": 128}


class _TimedEvents(list):
    """A stage's event log that stamps each event with ``time.perf_counter()``."""

    def append(self, event: Any) -> None:
        super().append((time.perf_counter(), event))

    def exposed_wait(self) -> float:
        """Seconds spent blocked in exchange waits: each ``... waited`` event's time since
        the event before it (a wait starts right after the previous chunk ends)."""
        return sum(
            t - self[i - 1][0]
            for i, (t, ev) in enumerate(self)
            if i and ev.what.endswith(" waited")
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, group: Any) -> float:
    t = torch.tensor(seconds, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


class _PairBench:
    """One rank's stage, batches and the two contenders."""

    def __init__(self, rank: int, world: int, device: torch.device, opts: dict) -> None:
        from graphpipe.models import LlamaConfig, build_stages

        self.device = device
        self.group = dist.group.WORLD if world > 1 else None
        h = opts.get("hidden") or _DEFAULTS["hidden"]
        rows = opts.get("mb_rows") or _DEFAULTS["rows"]
        seq, layers = _DEFAULTS["seq"], _DEFAULTS["layers"]
        self.config = LlamaConfig(
            hidden=h,
            n_layers=layers,
            n_heads=max(1, h // 64),
            max_seq_len=seq,
            use_kernels=device.type == "cuda",
            num_experts=_DEFAULTS["experts"],
            top_k=_DEFAULTS["top_k"],
        )
        # the middle one of three stages: hidden states in and out, every block an MoE block
        stages = build_stages(self.config, 3, device=device, ep_group=self.group)
        self.stage = stages[1]
        self.log = self.stage.events = _TimedEvents()
        self.layers = len(self.stage.layers)
        self.tokens = rows * seq
        self.capacity = self.stage.layers[0].mlp.capacity(self.tokens)
        g = torch.Generator().manual_seed(rank)
        self.x = [torch.randn(rows, seq, h, generator=g).to(device) for _ in range(2)]
        self.aux = torch.zeros(1, device=device)
        self.grad = torch.randn(rows, seq, h, generator=g).to(device)

    def _inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[k].clone().requires_grad_(), self.aux.clone().requires_grad_()

    def _prepared(self) -> tuple[tuple, tuple]:
        """The forward of micro-batch b: (outputs, output gradients) for its backward."""
        out = self.stage(*self._inputs(1))
        return out, (self.grad, torch.ones_like(out[1]))

    def pair(self) -> tuple[float, Any]:
        outs, grads = self._prepared()
        self._barrier()
        self.log.clear()
        t0 = time.perf_counter()
        y = type(self.stage).overlapped_forward_backward(
            self.stage, self._inputs(0), self.stage, outs, grads
        )
        _sync(self.device)
        return time.perf_counter() - t0, y

    def sequential(self) -> tuple[float, float, Any]:
        outs, grads = self._prepared()
        self._barrier()
        self.log.clear()
        t0 = time.perf_counter()
        y = self.stage(*self._inputs(0))
        _sync(self.device)
        t1 = time.perf_counter()
        torch.autograd.backward(list(outs), list(grads))
        _sync(self.device)
        return t1 - t0, time.perf_counter() - t1, y

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.stage.parameters() if p.grad is not None]

    def zero(self) -> None:
        self.stage.zero_grad(set_to_none=True)

    def check(self) -> bool:
        """One pair and one F then B from the same weights: bitwise the same?"""
        self.zero()
        _, yp = self.pair()
        gp = self.grads()
        self.zero()
        _, _, ys = self.sequential()
        gs = self.grads()
        self.zero()
        same = all(torch.equal(a, b) for a, b in zip(yp, ys, strict=True))
        return same and len(gp) == len(gs) and all(map(torch.equal, gp, gs))


def moe_rank(rank: int, world: int, device: torch.device, opts: dict) -> dict | None:
    """Time the pair and F then B on this rank; rank 0 returns the result row."""
    bench = _PairBench(rank, world, device, opts)
    same = bench.check()
    keys = ("pair", "seq", "f", "b", "pair_wait", "seq_wait")
    series: dict[str, list[float]] = {k: [] for k in keys}
    ratios = []
    for i in range(opts["warmup"] + opts["steps"]):
        times: dict[str, float] = {}
        for mode in ("pair", "seq") if i % 2 == 0 else ("seq", "pair"):
            bench.zero()
            if mode == "pair":
                times["pair"] = _slowest(bench.pair()[0], bench.group)
            else:
                tf, tb, _ = bench.sequential()
                times["f"], times["b"] = _slowest(tf, bench.group), _slowest(tb, bench.group)
                times["seq"] = _slowest(tf + tb, bench.group)
            times[f"{mode}_wait"] = _slowest(bench.log.exposed_wait(), bench.group)
        if i >= opts["warmup"]:
            for k in keys:
                series[k].append(times[k])
            ratios.append(times["pair"] / times["seq"])
    pair, seq = series["pair"], series["seq"]
    if rank != 0:
        return None
    cfg = bench.config
    return {
        "ranks": world,
        "ep": world,
        "device": device.type,
        "hidden": cfg.hidden,
        "moe_layers": bench.layers,
        "experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "capacity_factor": cfg.capacity_factor,
        "tokens_per_microbatch": bench.tokens,
        "capacity": bench.capacity,
        "bitwise_equal": same,
        "pair_s": _summary(pair),
        "f_then_b_s": _summary(seq),
        "f_s": _summary(series["f"]),
        "b_s": _summary(series["b"]),
        "pair_exposed_wait_s": _summary(series["pair_wait"]),
        "f_then_b_exposed_wait_s": _summary(series["seq_wait"]),
        "pair_over_f_then_b": statistics.median(pair) / statistics.median(seq),
        "paired_ratio": statistics.median(ratios),
    }


def _summary(xs: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "all": xs}


def format_row(row: dict[str, Any]) -> str:
    """The result as a small table, milliseconds."""

    def ms(key: str) -> str:
        s = row[key]
        return f"{s['median'] * 1e3:>8.2f}  [{s['q1'] * 1e3:.2f}, {s['q3'] * 1e3:.2f}]"

    lines = [
        f"MoE stage: {row['moe_layers']} MoE blocks, hidden {row['hidden']}, "
        f"{row['experts']} experts top-{row['top_k']} over ep={row['ep']} ranks, "
        f"{row['tokens_per_microbatch']} tokens per micro-batch, capacity {row['capacity']}",
        f"{'':<12} {'median ms':>9}  [IQR]",
        f"{'F':<12} {ms('f_s')}",
        f"{'B':<12} {ms('b_s')}",
        f"{'F then B':<12} {ms('f_then_b_s')}",
        f"{'pair':<12} {ms('pair_s')}",
        f"{'wait F+B':<12} {ms('f_then_b_exposed_wait_s')}  (blocked in exchange waits)",
        f"{'wait pair':<12} {ms('pair_exposed_wait_s')}",
        f"pair / (F then B): {row['pair_over_f_then_b']:.3f} (medians), "
        f"{row['paired_ratio']:.3f} (paired per round); results bitwise equal: "
        f"{row['bitwise_equal']}",
    ]
    return "\n".join(lines)


def moe_main(rank: int, world: int, device: torch.device, opts: dict) -> None:
    """``graphpipe bench --regime moe`` on one rank: rank 0 prints and writes JSON."""
    row = moe_rank(rank, world, device, opts)
    if row is None:
        return
    print(
        f"graphpipe bench: moe, {world} ranks, median of {opts['steps']} rounds "
        f"(after {opts['warmup']}), the slowest rank's wall time",
        file=sys.stderr,
    )
    print(format_row(row), flush=True)
    if opts.get("json"):
        result = {"config": {"command": opts.get("command_line")}, "moe": row}
        Path(opts["json"]).write_text(json.dumps(result, indent=2))
        print(f"graphpipe bench: wrote {opts['json']}", file=sys.stderr)
