"""Host cost of deferral in compiled stages: the custom op against the eager Function, and
against a graph break around every Linear (the other design). A plain script, not a test:

    python tests/benchmarks/compile_deferral.py [--dim 64] [--rows 16]

A stage of four Linear + tanh layers, float32 on the CPU. Per variant, one
micro-batch as the executor runs it: ``F+B`` (forward, then a full backward that accumulates
into ``.grad``) and ``F+I+W`` (forward, input-gradient backward with the weight work
deferred, then the ``W``). Processes of the variants alternate (the machine is shared); the
figure is the median over rounds of the mean CPU time (``time.process_time``) over
``--iters`` calls, each variant in processes of its own. Also: the cost of one
call of the op itself against calling its Python body directly, and the time of each
variant's first F+B + F+I+W (compiling): cold (a fresh inductor cache, the first pass) and
warm (the cache the first pass filled; dynamo and AOTAutograd still trace).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from graphpipe import weightgrad
from graphpipe.weightgrad import DeferrableLinear, WeightGradStore, make_deferrable


@torch.compiler.disable
def _eager_linear(module: DeferrableLinear, x: torch.Tensor) -> torch.Tensor:
    # A function of its own: disabling DeferrableLinear.forward itself would make dynamo skip
    # its code object in every model of the process, the custom-op variant's too.
    return DeferrableLinear.forward(module, x)


class _BreakingLinear(DeferrableLinear):
    """The graph-break design: dynamo leaves every Linear to the eager Function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _eager_linear(self, x)


class _Stage(nn.Module):
    """Four Linear + tanh, written out: dynamo cannot resume a frame after a graph break inside
    a loop (``nn.Sequential``'s), it would run such a stage eagerly with graph breaks."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.l2, self.l3 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.l0(x))
        x = torch.tanh(self.l1(x))
        x = torch.tanh(self.l2(x))
        return torch.tanh(self.l3(x))


class _Variant:
    def __init__(self, name: str, dim: int, compiled: bool, kind: str) -> None:
        self.name = name
        self.model = _Stage(dim)
        self.store = WeightGradStore() if kind != "plain" else None
        if self.store is not None:
            make_deferrable(self.model, self.store)
            if kind == "break":
                for m in self.model.modules():
                    if isinstance(m, DeferrableLinear):
                        m.__class__ = _BreakingLinear
        self.run = torch.compile(self.model) if compiled else self.model
        self.compile_s = 0.0

    def fb(self, x: torch.Tensor) -> None:
        if self.store is not None:
            self.store.split = False
            self.store.accumulating = True
        try:
            self.run(x).sum().backward()
        finally:
            if self.store is not None:
                self.store.accumulating = False

    def fiw(self, x: torch.Tensor) -> None:
        if self.store is None:
            self.run(x).sum().backward()  # nothing to defer: F+B
            return
        self.store.split = True
        y = self.run(x)
        with self.store.deferring(0):
            y.sum().backward()
        self.store.run(0)


def _mean_s(fn, x: torch.Tensor, iters: int) -> float:
    t = time.process_time()  # CPU time: on a shared machine, waits for a core do not count
    for _ in range(iters):
        fn(x)
    return (time.process_time() - t) / iters


def _op_call_cost(dim: int, rows: int, iters: int, rounds: int) -> tuple[float, float]:
    """(op call, direct call) seconds per call: the weight gradient of one Linear, not
    deferred, into an existing .grad."""
    w = nn.Parameter(torch.randn(dim, dim))
    b = nn.Parameter(torch.randn(dim))
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    x, g = torch.randn(rows, dim), torch.randn(rows, dim)
    store = WeightGradStore()
    op = torch.ops.graphpipe.linear_weight_grad
    direct = weightgrad._accumulate_weight_grad
    ops, directs = [], []
    for _ in range(rounds):
        with torch.no_grad():  # as in a backward
            t = time.process_time()
            for _ in range(iters):
                op(g, x, w, b, store._token)
            ops.append((time.process_time() - t) / iters)
            t = time.process_time()
            for _ in range(iters):
                direct(w, b, x, g)
            directs.append((time.process_time() - t) / iters)
    return statistics.median(ops), statistics.median(directs)


_SPECS = [
    ("eager nn.Linear", False, "plain"),
    ("eager deferrable (Function)", False, "defer"),
    ("compiled nn.Linear (no deferral)", True, "plain"),
    ("compiled deferrable (custom op)", True, "defer"),
    ("compiled, graph break per Linear", True, "break"),
]


def _measure(index: int, args: argparse.Namespace) -> dict:
    """One variant alone in this process (compiled variants of one process share dynamo's
    caches per code object, and one variant's cached frames were seen serving another's)."""
    torch.set_num_threads(1)
    name, compiled, kind = _SPECS[index]
    v = _Variant(name, args.dim, compiled, kind)
    x = torch.randn(args.rows, args.dim)
    t = time.perf_counter()
    v.fb(x)
    v.fiw(x)
    first = time.perf_counter() - t
    fb = [_mean_s(v.fb, x, args.iters) for _ in range(args.rounds)]
    fiw = [_mean_s(v.fiw, x, args.iters) for _ in range(args.rounds)]
    graphs = "-"
    if compiled:
        explained = torch._dynamo.explain(v.model)(x)
        graphs = f"{explained.graph_count} ({explained.graph_break_count} breaks)"
    return {
        "F+B": statistics.median(fb),
        "F+I+W": statistics.median(fiw),
        "first": first,
        "graphs": graphs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--passes", type=int, default=3, help="processes per variant, alternated")
    ap.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant is not None:
        print(json.dumps(_measure(args.variant, args)))
        return
    shape = ["--dim", str(args.dim), "--rows", str(args.rows)]
    shape += ["--iters", str(args.iters), "--rounds", str(args.rounds)]
    runs: list[list[dict]] = [[] for _ in _SPECS]
    # A fresh inductor cache: the first pass compiles cold, the others load what it compiled
    # (with this script's one thread: kernels cached by a process with more threads run
    # their OpenMP loops on as many, and measured twice the CPU time here).
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
    for _ in range(args.passes):
        for i in range(len(_SPECS)):
            out = subprocess.run(
                [sys.executable, __file__, "--variant", str(i), *shape],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            ).stdout
            runs[i].append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"stage: 4 x (Linear({args.dim}, {args.dim}) + tanh), x: "
        f"({args.rows}, {args.dim}) float32, 1 thread; CPU time, median over {args.passes} "
        f"processes of the median of {args.rounds} rounds"
    )
    print(
        f"{'variant':36s} {'F+B us':>8s} {'F+I+W us':>9s} {'first call: cold s':>19s} "
        f"{'warm s':>7s} graphs"
    )
    for (name, _, _), rs in zip(_SPECS, runs, strict=True):
        fb = statistics.median(r["F+B"] for r in rs) * 1e6
        fiw = statistics.median(r["F+I+W"] for r in rs) * 1e6
        cold = rs[0]["first"]
        warm = min((r["first"] for r in rs[1:]), default=float("nan"))
        graphs = rs[0]["graphs"]
        print(f"{name:36s} {fb:8.1f} {fiw:9.1f} {cold:19.1f} {warm:7.1f} {graphs}")
    torch.set_num_threads(1)
    op_s, direct_s = _op_call_cost(args.dim, args.rows, args.iters * 10, args.rounds)
    print(
        f"linear_weight_grad op call: {op_s * 1e6:.1f} us; its body called directly: "
        f"{direct_s * 1e6:.1f} us; dispatch {1e6 * (op_s - direct_s):.1f} us per Linear"
    )


if __name__ == "__main__":
    main()
