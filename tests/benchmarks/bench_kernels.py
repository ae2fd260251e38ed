"""GPU benchmark of graphpipe.kernels: Triton vs torch eager vs torch.compile.

Reports achieved bandwidth in GB/s computed from each op's memory-traffic floor (the
``*_TRAFFIC_FLOOR`` constants documented in the kernel modules' headers): bytes the op
must move at minimum / measured time. Shapes are LLM-sized, bf16: 4096 tokens x hidden
4096 and 8192 for RMSNorm, fused residual RMSNorm and SwiGLU; 4096 rows x vocab 32000
and 128256 for cross-entropy. Forward and backward are timed separately (the backward
re-runs ``torch.autograd.grad`` over a retained graph).

Two ways to run it, both on a CUDA machine (everything is skipped without CUDA; the
default ``pytest`` run ignores tests/benchmarks, naming the file includes it):

    pytest tests/benchmarks/bench_kernels.py --benchmark-columns=median,ops
    python tests/benchmarks/bench_kernels.py [--ops rms_norm,cross_entropy] [--no-compile]
        [--json FILE]

The pytest form records GB/s in each benchmark's ``extra_info``; the script prints a table
and first measures the device-to-device copy bandwidth (``copy_`` of a 1 GiB buffer, bytes
read plus bytes written over the median time), the practical ceiling of these memory-bound
ops, and gives each GB/s figure as a fraction of it too. ``--json`` writes those figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from graphpipe.kernels import cross_entropy, rms_norm, rms_norm_residual, swiglu
from graphpipe.kernels._dispatch import use_triton
from graphpipe.kernels.cross_entropy import CROSS_ENTROPY_TRAFFIC_FLOOR
from graphpipe.kernels.rms_norm import RMS_NORM_RESIDUAL_TRAFFIC_FLOOR, RMS_NORM_TRAFFIC_FLOOR
from graphpipe.kernels.swiglu import SWIGLU_TRAFFIC_FLOOR

EPS = 1e-6
DEVICE = torch.device("cuda")
IMPLS = ("triton", "eager", "compile")
DIRECTIONS = ("fwd", "bwd")
# (fwd, bwd) elements moved per [rows, cols] element; times rows * cols * itemsize = bytes.
FLOORS: dict[str, tuple[int, int]] = {
    "rms_norm": RMS_NORM_TRAFFIC_FLOOR,
    "rms_norm_residual": RMS_NORM_RESIDUAL_TRAFFIC_FLOOR,
    "swiglu": SWIGLU_TRAFFIC_FLOOR,
    "cross_entropy": CROSS_ENTROPY_TRAFFIC_FLOOR,
}


@dataclass(frozen=True)
class Case:
    """One benchmarked op at one [rows, cols] shape."""

    op: str
    rows: int
    cols: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return f"{self.op}-{self.rows}x{self.cols}-{str(self.dtype).removeprefix('torch.')}"

    def floor_bytes(self, direction: str) -> int:
        factor = FLOORS[self.op][DIRECTIONS.index(direction)]
        return factor * self.rows * self.cols * self.dtype.itemsize


CASES = [
    *(
        Case(op, 4096, hidden)
        for op in ("rms_norm", "rms_norm_residual", "swiglu")
        for hidden in (4096, 8192)
    ),
    Case("cross_entropy", 4096, 32000),
    Case("cross_entropy", 4096, 128256),
]


# --------------------------------------------------------------------------- the ops


def _eager_fn(op: str) -> Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]:
    """Plain torch, written the way a model would without fused kernels."""
    if op == "rms_norm":
        return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS)
    if op == "rms_norm_residual":

        def add_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
            h = x + r
            return F.rms_norm(h, (h.shape[-1],), w, EPS), h

        return add_norm
    if op == "swiglu":
        return lambda g, u: F.silu(g) * u
    if op == "cross_entropy":
        return lambda logits, target: F.cross_entropy(logits, target)
    raise KeyError(op)


def _triton_fn(op: str) -> Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]:
    if op == "rms_norm":
        return lambda x, w: rms_norm(x, w, EPS)
    if op == "rms_norm_residual":
        return lambda x, r, w: rms_norm_residual(x, r, w, EPS)
    if op == "swiglu":
        return swiglu
    if op == "cross_entropy":
        return cross_entropy
    raise KeyError(op)


@functools.cache
def _compiled_fn(op: str) -> Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]:
    return torch.compile(_eager_fn(op), dynamic=False)


def _make_inputs(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(all inputs, the differentiable ones), on ``DEVICE``, seeded."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, device=DEVICE, dtype=case.dtype, generator=gen)
        return t.requires_grad_()

    r, c = case.rows, case.cols
    if case.op == "rms_norm":
        inputs = [randn(r, c), randn(c)]
        return inputs, inputs
    if case.op == "rms_norm_residual":
        inputs = [randn(r, c), randn(r, c), randn(c)]
        return inputs, inputs
    if case.op == "swiglu":
        inputs = [randn(r, c), randn(r, c)]
        return inputs, inputs
    logits = randn(r, c)
    target = torch.randint(0, c, (r,), device=DEVICE, generator=gen)
    target[::17] = -100
    return [logits, target], [logits]


def make_runner(case: Case, impl: str, direction: str) -> Callable[[], object]:
    """A zero-argument callable running one forward or one backward of ``case``."""
    inputs, diff_inputs = _make_inputs(case)
    if impl == "triton":
        if not use_triton(inputs[0]):
            raise RuntimeError("GRAPHPIPE_KERNELS forces the torch path; unset it to benchmark")
        fn = _triton_fn(case.op)
    elif impl == "eager":
        fn = _eager_fn(case.op)
    else:
        fn = _compiled_fn(case.op)
    if direction == "fwd":
        return lambda: fn(*inputs)
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
    return lambda: torch.autograd.grad(outs, diff_inputs, grads, retain_graph=True)


# --------------------------------------------------------------------------- pytest


def _params() -> list:
    return [
        pytest.param(case, impl, direction, id=f"{case.name}-{direction}-{impl}")
        for case in CASES
        for direction in DIRECTIONS
        for impl in IMPLS
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("case", "impl", "direction"), _params())
def test_kernel_bandwidth(benchmark, case: Case, impl: str, direction: str) -> None:
    """Median time of ``inner`` back-to-back calls, reported as GB/s of the floor."""
    inner = 10
    run = make_runner(case, impl, direction)
    run()  # compile / autotune outside the timing
    torch.cuda.synchronize()

    def timed() -> None:
        for _ in range(inner):
            run()
        torch.cuda.synchronize()

    benchmark.group = f"{case.name}-{direction}"
    benchmark.pedantic(timed, rounds=20, warmup_rounds=2, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing measured
        return
    seconds = benchmark.stats.stats.median / inner
    gbps = case.floor_bytes(direction) / seconds / 1e9
    benchmark.extra_info.update(ms=seconds * 1e3, gbps=round(gbps, 1))
    assert gbps > 0


# --------------------------------------------------------------------------- script


COPY_BYTES = 1 << 30  # 1 GiB: many times the H200's 60 MB of L2


def copy_bandwidth_gbps(do_bench: Callable[..., float]) -> float:
    """Device-to-device copy bandwidth in GB/s: 2 x COPY_BYTES moved (read + write) per copy."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


def main(argv: list[str] | None = None) -> int:
    """Print a table of ms and GB/s per op, shape, direction and implementation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(FLOORS), help="comma-separated ops")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: CUDA is not available; nothing to benchmark")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": "CUDA is not available"}, f)
        return 0
    from triton.testing import do_bench

    ops = {op.strip() for op in args.ops.split(",") if op.strip()}
    impls = [i for i in IMPLS if not (args.no_compile and i == "compile")]
    copy_gbps = copy_bandwidth_gbps(do_bench)
    torch.cuda.empty_cache()  # give the copy buffers back
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    header = f"{'case':<34} {'dir':<4} " + " ".join(
        f"{i + ' ms':>11} {'GB/s':>7} {'copy%':>6}" for i in impls
    )
    print(header)
    print("-" * len(header))
    rows = []
    for case in (c for c in CASES if c.op in ops):
        for direction in DIRECTIONS:
            cells = []
            for impl in impls:
                run = make_runner(case, impl, direction)
                ms = do_bench(run, warmup=25, rep=100, return_mode="median")
                gbps = case.floor_bytes(direction) / (ms * 1e-3) / 1e9
                cells.append(f"{ms:>11.4f} {gbps:>7.0f} {100 * gbps / copy_gbps:>6.1f}")
                rows.append(
                    {
                        "case": case.name,
                        "direction": direction,
                        "impl": impl,
                        "ms": ms,
                        "gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps,
                    }
                )
                del run
                torch.cuda.empty_cache()
            print(f"{case.name:<34} {direction:<4} " + " ".join(cells))
    if args.json:
        figures = {
            "device": torch.cuda.get_device_name(),
            "copy_gbps": copy_gbps,
            "floor": "bytes each op must move at minimum (the *_TRAFFIC_FLOOR constants)",
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
