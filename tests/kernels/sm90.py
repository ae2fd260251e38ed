"""Ahead-of-time compilation of graphpipe's Triton kernels for sm_90 (H100/H200), on CPU.

No GPU is needed: ``triton.compile`` lowers a kernel to PTX and runs the ``ptxas`` that ships
inside Triton's wheel, giving the same cubin the JIT would build on the device.

What is compiled is exactly what the launchers launch: ``recorded_launches`` runs the real
launcher functions (``rms_norm_forward`` ...) on ``meta`` tensors (shapes, dtypes and storage
offsets, no memory) with every ``@triton.jit`` kernel of the kernel modules replaced by a
recorder, so the grid, the arguments, the constexprs and ``num_warps`` come from the launchers'
own code. ``specialize`` then turns each launch into the signature, constexprs and
``tt.divisibility`` attributes the JIT would derive from those arguments, with Triton's own
per-argument specializer (``native_specialize_impl``, the function ``JITFunction.run`` calls):
a pointer or integer divisible by 16 gets the divisibility hint, an integer equal to 1 becomes
a constexpr. The installed Triton's ``_pack_args`` packs that into what ``triton.compile``
takes, so its version's conventions hold (3.6 gives constexprs no attribute entry, 3.9 an empty
one), and ``jit_binder_agrees`` checks the whole derivation against Triton's generated binder.

It must run in a process where ``TRITON_INTERPRET`` is unset when triton is imported: under the
interpreter, triton.language's own ``@jit`` helpers (``tl.sum``, ...) are defined as
interpreted functions, and the code generator then fails on them ("InterpreterError:
'value' object has no attribute 'data'"). The tests' conftest sets the interpreter on CPU, so
``test_compile_sm90.py`` runs this module as a child process (``python -m
tests.kernels.sm90``), which prints one JSON report.

Spills are read from the cubin itself (``cuobjdump --dump-resource-usage``, also shipped with
Triton): ptxas puts spilled registers in the per-thread stack frame, so STACK and LOCAL both 0
means no spill. Cross-checked with ptxas's own report (``TRITON_DUMP_PTXAS_LOG=1``) on the old
RMSNorm backward at 16384 columns and 32 warps: cuobjdump STACK:152, ptxas "152 bytes stack
frame, 280 bytes spill stores, 216 bytes spill loads"; at 8192 columns STACK:0 and "0 bytes
spill stores".
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

# Where a piece needed for the AOT compile is missing, this says which; None when all is there.
MISSING: str | None = None
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError as exc:  # pragma: no cover - depends on the install
    MISSING = f"triton's compiler API did not import: {exc}"

if MISSING is None:
    try:
        from triton.runtime.jit import native_specialize_impl
    except ImportError:  # pragma: no cover - Triton < 3.5 names it differently
        MISSING = (
            f"triton {triton.__version__} has no triton.runtime.jit.native_specialize_impl "
            "(Triton >= 3.5 has it), which reproduces the JIT's argument specialization"
        )

if MISSING is None:
    try:
        from triton.compiler.compiler import make_backend
    except ImportError:  # pragma: no cover - depends on the install
        MISSING = f"triton {triton.__version__} has no triton.compiler.compiler.make_backend"

SM90 = (90, 32)  # compute capability 9.0, 32 threads per warp


def cuobjdump_path() -> str | None:
    """The cuobjdump that ships with Triton's NVIDIA backend (or one on PATH)."""
    try:
        from triton import knobs

        path = knobs.nvidia.cuobjdump.path
        if path and os.path.exists(path):
            return path
    except (ImportError, AttributeError, RuntimeError):  # pragma: no cover - older Triton
        pass
    return shutil.which("cuobjdump")


@dataclass
class Launch:
    """One kernel launch as a launcher issued it."""

    kernel: Any
    grid: Any
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is logged."""

    def __init__(self, kernel: Any, log: list[Launch]) -> None:
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append(Launch(self.kernel, grid, args, kwargs))

        return launch


def _is_kernel(obj: Any) -> bool:
    return isinstance(obj, JITFunction)


@contextlib.contextmanager
def recorded_launches(*modules: ModuleType) -> Iterator[list[Launch]]:
    """Within the block, every Triton kernel of ``modules`` only records its launches."""
    log: list[Launch] = []
    saved = {
        (mod, name): obj for mod in modules for name, obj in vars(mod).items() if _is_kernel(obj)
    }
    if not saved:
        raise ValueError(f"no Triton kernels found in {[m.__name__ for m in modules]}")
    try:
        for (mod, name), obj in saved.items():
            setattr(mod, name, _Recorder(obj, log))
        yield log
    finally:
        for (mod, name), obj in saved.items():
            setattr(mod, name, obj)


@dataclass(frozen=True)
class Specialized:
    """What ``triton.compile`` needs for one launch: the JIT's view of its arguments."""

    fn: Any
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], list]
    options: dict[str, Any]
    # Per parameter, the (type, key) pair the JIT's binder computes: ("constexpr", value),
    # ("*fp32", "D"), ("i32", "") ...; ``pack`` turns it into the three dicts above.
    specialization: tuple[tuple[Any, ...], ...] = ()

    def key(self) -> str:
        """Identifies the compiled binary: equal keys compile to the same cubin."""
        return repr((self.fn.__name__, self.signature, self.constexprs, self.attrs, self.options))

    def describe(self) -> str:
        consts = {self.fn.arg_names[i[0]]: v for i, v in self.constexprs.items()}
        ptrs = sorted({t for t in self.signature.values() if t.startswith("*")})
        return f"{self.fn.__name__}{consts} {self.options} {','.join(ptrs)}"


def pack(
    fn: Any, backend: Any, kwargs: dict[str, Any], bound: dict[str, Any], specialization: list
) -> tuple[dict[str, str], dict[tuple[int, ...], Any], dict[tuple[int, ...], list]]:
    """Signature, constexprs and attributes from the per-parameter specialization, packed by
    the installed Triton's own ``JITFunction._pack_args`` (what ``JITFunction.run`` calls), so
    that its conventions hold whatever its version: Triton 3.9 gives every constexpr an empty
    attribute entry, 3.6 gives constexprs none. Where that private method is missing or takes
    other arguments, the 3.9 convention is applied here."""
    packer = getattr(fn, "_pack_args", None)
    if packer is not None:
        try:
            _, signature, constexprs, attrs = packer(backend, kwargs, bound, specialization, None)
            return signature, constexprs, attrs
        except TypeError:  # pragma: no cover - another Triton's private signature
            pass
    signature, constexprs, attrs = {}, {}, {}
    for i, (p, (ty, spec)) in enumerate(zip(fn.params, specialization)):
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = bound[p.name]
            attrs[(i,)] = backend.parse_attr("")
        elif isinstance(spec, str):  # "D" (divisible by 16) or "" (no hint); floats: None
            attrs[(i,)] = backend.parse_attr(spec)
    return signature, constexprs, attrs


def specialize(launch: Launch, arch: int = SM90[0], warp_size: int = SM90[1]) -> Specialized:
    """Signature, constexprs, divisibility attributes and options for ``launch``, as
    ``JITFunction.run`` derives them on a device of compute capability ``arch``: the
    per-parameter specialization computed here with Triton's specializer, then ``pack``."""
    fn = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, warp_size))
    names = [p.name for p in fn.params]
    bound = inspect.signature(fn.fn).bind(
        *launch.args, **{k: v for k, v in launch.kwargs.items() if k in names}
    )
    bound.apply_defaults()
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    specialization: list[tuple[Any, ...]] = []
    for p in fn.params:
        value = bound.arguments[p.name]
        if p.is_constexpr:
            specialization.append(("constexpr", value))
        else:  # an integer equal to 1 comes back as ("constexpr", 1)
            specialize, align = not p.do_not_specialize, not p.do_not_specialize_on_alignment
            specialization.append(
                native_specialize_impl(backend, value, p.is_const, specialize, align)
            )
    signature, constexprs, attrs = pack(
        fn, backend, launch.kwargs, dict(bound.arguments), specialization
    )
    return Specialized(fn, signature, constexprs, attrs, options, tuple(specialization))


def jit_binder_agrees(launch: Launch, spec: Specialized) -> bool | None:
    """Whether Triton's own JIT binder (``JITFunction.run``'s path: the generated binder and
    ``_pack_args``) derives the same per-parameter specialization, signature, constexprs and
    attributes for ``launch``; None where this Triton's private binder API differs (it is
    there on Triton 3.6 and 3.9)."""
    try:
        from triton.runtime.jit import create_function_from_signature

        fn = launch.kernel
        backend = make_backend(GPUTarget("cuda", *SM90))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*launch.args, **launch.kwargs)
        _, signature, constexprs, attrs = fn._pack_args(
            backend, launch.kwargs, bound, specialization, options
        )
    except (ImportError, AttributeError, TypeError, ValueError):  # pragma: no cover
        return None
    same_specialization = tuple(tuple(s) for s in specialization) == spec.specialization
    packed = (signature, constexprs, attrs) == (spec.signature, spec.constexprs, spec.attrs)
    return same_specialization and packed


def compile_sm90(spec: Specialized) -> Any:
    """``triton.compile`` for sm_90; returns the compiled kernel (its ``asm`` holds the cubin)."""
    src = ASTSource(spec.fn, spec.signature, spec.constexprs, spec.attrs)
    return triton.compile(src, target=GPUTarget("cuda", *SM90), options=dict(spec.options))


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(compiled: Any) -> dict[str, int]:
    """Registers per thread, stack frame and local memory bytes per thread, and static shared
    memory of the compiled kernel, read from its cubin with cuobjdump."""
    tool = cuobjdump_path()
    if tool is None:
        raise RuntimeError("no cuobjdump found (Triton's NVIDIA backend ships one)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run(
            [tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    found = _USAGE.findall(out)
    if len(found) != 1:
        raise RuntimeError(f"expected one kernel's resource usage from cuobjdump, got:\n{out}")
    regs, stack, shared, local = map(int, found[0])
    return {"registers": regs, "stack_bytes": stack, "shared_bytes": shared, "local_bytes": local}


# --------------------------------------------------------------------------- the cases

ROWS = 4096  # tokens per launch, as in tests/benchmarks/bench_kernels.py
HIDDEN = (4096, 8192)
WIDE_HIDDEN = (16384, 65536, 131072)  # RMSNorm beyond the fused cap: the looped path
VOCAB = (32000, 128256)
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Case:
    """One op at one width and dtype; ``run`` issues every launch the op makes there."""

    op: str
    n_cols: int
    dtype: str

    @property
    def id(self) -> str:
        return f"{self.op}-{self.n_cols}-{self.dtype}"


def cases() -> list[Case]:
    """RMSNorm at hidden 4096 / 8192 and at the wide widths, SwiGLU at the built-in Llama's
    MLP width for hidden 4096 / 8192, cross-entropy at vocab 32000 / 128256; fp32 and bf16."""
    from graphpipe.models import LlamaConfig

    out = []
    for dtype in DTYPES:
        out += [Case("rms_norm", h, dtype) for h in HIDDEN + WIDE_HIDDEN]
        out += [
            Case("swiglu", LlamaConfig(hidden=h, n_heads=h // 128).ffn_dim, dtype) for h in HIDDEN
        ]
        out += [Case("cross_entropy", v, dtype) for v in VOCAB]
    return out


def _run_case(case: Case) -> None:
    """Call the op's launchers as autograd would, forward and backward, on meta tensors."""
    import torch

    from graphpipe.kernels.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from graphpipe.kernels.rms_norm import rms_norm_backward, rms_norm_forward
    from graphpipe.kernels.swiglu import swiglu_backward, swiglu_forward

    dtype = getattr(torch, case.dtype)

    def empty(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dt, device="meta")

    rows, n = ROWS, case.n_cols
    if case.op == "rms_norm":
        x, w = empty(rows, n), empty(n)
        _, _, rstd = rms_norm_forward(x, w, 1e-6)
        rms_norm_backward(empty(rows, n), x, w, rstd)
        _, h, rstd = rms_norm_forward(x, w, 1e-6, residual=empty(rows, n))
        rms_norm_backward(empty(rows, n), h, w, rstd, dh=empty(rows, n))
    elif case.op == "swiglu":
        # Separate gate / up tensors (the built-in MLP), and the two halves of one fused
        # projection (row-strided views, as the launchers accept them).
        for gate, up in ((empty(rows, n), empty(rows, n)), empty(rows, 2 * n).chunk(2, -1)):
            swiglu_forward(gate, up)
            swiglu_backward(empty(rows, n), gate, up)
    elif case.op == "cross_entropy":
        logits = empty(rows, n)
        target = empty(rows, dt=torch.int64)
        _, lse, n_valid = cross_entropy_forward(logits, target)
        cross_entropy_backward(empty((), dt=dtype), logits, target, lse, n_valid)
    else:
        raise ValueError(f"unknown op {case.op!r}")


def _kernel_modules() -> list[ModuleType]:
    import importlib

    # The package re-exports functions under the modules' names, so import the modules.
    names = ("rms_norm", "swiglu", "cross_entropy")
    return [importlib.import_module(f"graphpipe.kernels.{n}") for n in names]


def report(selected: list[str] | None = None) -> dict[str, Any]:
    """Compile every launch of every case (each distinct binary once) and return
    ``{"triton": version, "missing": reason or None, "cases": {id: [kernel, ...]}}``."""
    import time

    if MISSING is None and cuobjdump_path() is None:
        missing = "no cuobjdump: neither triton's knobs.nvidia.cuobjdump nor one on PATH"
    else:
        missing = MISSING
    out: dict[str, Any] = {"triton": getattr(triton, "__version__", None), "missing": missing}
    out["cases"] = {}
    if missing is not None:
        return out
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the sm_90 compile needs the real compiler")
    compiled: dict[str, dict[str, Any]] = {}
    modules = _kernel_modules()
    for case in cases():
        if selected and case.id not in selected:
            continue
        with recorded_launches(*modules) as log:
            _run_case(case)
        rows = []
        for launch in log:
            spec = specialize(launch)
            key = spec.key()
            if key not in compiled:
                t0 = time.perf_counter()
                entry: dict[str, Any] = {"kernel": spec.describe(), "name": spec.fn.__name__}
                entry["num_warps"] = spec.options.get("num_warps", 4)  # Triton's default: 4
                entry["matches_jit_binder"] = jit_binder_agrees(launch, spec)
                try:
                    entry.update(resource_usage(compile_sm90(spec)))
                except Exception as exc:  # reported per kernel; the test fails on it
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                entry["compile_s"] = round(time.perf_counter() - t0, 2)
                compiled[key] = entry
            rows.append(compiled[key])
        out["cases"][case.id] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="compile graphpipe's kernels for sm_90, print JSON")
    ap.add_argument("cases", nargs="*", help="case ids (default: all)")
    args = ap.parse_args(argv)
    print(json.dumps(report(args.cases or None), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
