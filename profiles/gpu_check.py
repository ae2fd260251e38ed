"""The GPU check's plan and runner: every check in order of value, each with a time budget,
within one total budget. ``profiles/gpu_check.sh`` runs it on the lent machine:

    bash profiles/gpu_check.sh [OUTDIR]            # default: $OUT, else /tmp/graphpipe-gpu

A check starts only if its whole budget fits in what is left of the total (default 420 s,
``GPU_CHECK_BUDGET_S``: with the summary the run ends within 8 minutes); otherwise it is never
started and is recorded ``skipped`` with ``skipped_for_time: true`` and the reason, and the
next, smaller check may still fit. A check that starts runs with its budget as its time limit
(past it, its whole process group is killed and it is recorded failed, ``timed_out``).
``GPU_CHECK_ONLY=name,name`` runs only those checks (an unknown name is an error).

Writes ``OUTDIR/gpu_check.json`` (``profiles/gpu_summary.py``: per check its status, seconds,
budget and figures; the run's seconds and budget) and ``OUTDIR/gpu_check.log`` (every check's
output), prints a table, and exits 1 when a check failed.

The budgets. Each is the check's estimated time times about 1.3, from these figures, measured
on the development machine (2 vCPUs shared with other engineers' test runs, no GPU, Python
3.12.1, torch 2.11.0, Triton 3.6.0, numpy 2.5.2, 2026-12-01) unless marked as an estimate:

- start, S = 15 s: ``python -m pytest`` of one tests/gpu file, every test skipped without
  CUDA, took 13.8-15.2 s (importing torch and graphpipe alone 12.0 s); plus E = 5 s for the
  CUDA context and libraries on the GPU (an estimate: no GPU here).
- compile, C = 2 s per Triton binary, and 8.5 s for a process's first (the compiler
  starting): the JIT's work (``triton.compile`` to a cubin, ptxas included), timed by
  ``python -m tests.kernels.sm90`` with an empty ``TRITON_CACHE_DIR``: 34 binaries in
  67.6 s, mean 2.0 s, median 1.3 s, the first 8.5 s.
- binaries per check: the distinct specializations its models and shapes launch, counted by
  running the launchers on ``meta`` tensors with the kernels recorded (the recorder of
  ``tests/kernels/sm90.py``), less those an earlier check compiled (Triton's on-disk cache
  is shared by the checks of one run): capture_llama 16, kernels_in_graph 26, action_ranges
  6 (of 8), replay_sweep 4 (of 12), kernel_bandwidth 4 (of 12), moe_capture 6 (of 8);
  kernel_tests about 165, counted by hand from its parametrization.
- GPU work: estimated from each check's steps and sizes (a few seconds to 20 s each).

By these figures the checks through ``kernel_bandwidth`` take about 367 s, so
``moe_capture`` (65 s) starts when the machine is a little faster than the development one
(its unshared 16 cores should be), and ``kernel_tests`` (about 240 s) needs a call of its
own: ``GPU_CHECK_ONLY=install,kernel_tests bash profiles/gpu_check.sh``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 420
KILL_GRACE_S = 10  # after SIGTERM at the limit, SIGKILL this much later


def _summary_module() -> Any:
    """``profiles/gpu_summary.py`` (a sibling script, not a package module)."""
    if "gpu_summary" in sys.modules:
        return sys.modules["gpu_summary"]
    spec = importlib.util.spec_from_file_location(
        "gpu_summary", Path(__file__).with_name("gpu_summary.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_summary"] = module
    spec.loader.exec_module(module)
    return module


gpu_summary = _summary_module()


@dataclass(frozen=True)
class Check:
    """One check: a command, its budget (seconds, also its time limit) and where that
    budget comes from. ``junit``: a pytest command, given ``--junitxml`` for its report."""

    name: str
    budget_s: int
    estimate: str
    argv: tuple[str, ...]
    junit: bool = False

    def __post_init__(self) -> None:
        if self.budget_s <= 0:
            raise ValueError(f"check {self.name!r}: budget_s must be > 0, got {self.budget_s}")


def _pytest(name: str, budget_s: int, estimate: str, *paths: str) -> Check:
    argv = ("python3", "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *paths)
    return Check(name, budget_s, estimate, argv, junit=True)


def _script(name: str, budget_s: int, estimate: str, code: str) -> Check:
    """A command line that may write its figures to $GPU_CHECK_FIGURES."""
    return Check(name, budget_s, estimate, ("bash", "-c", code))


# In order of value: what a first GPU run must show first comes first. S, E, C: the figures
# of the module docstring; "first compile": a process's first binary (8.5 s).
CHECKS: tuple[Check, ...] = (
    Check(
        "install",
        30,
        "pip install --no-deps --no-index -e . 4.5 s, then an import probe of torch and "
        "graphpipe.kernels 12 s: 17 s",
        ("python3", "profiles/gpu_summary.py", "install", "--repo", str(ROOT))
        + ("--figures", "{work}/install.figures.json", "--pip-timeout", "20"),
    ),
    _pytest(
        "capture_llama",
        120,
        "S + E + the first compile + 15 binaries x C + 12 twin runs of 5 steps with their "
        "captures (about 20 s) + the CPU graph against the CUDA graph, a tensor-lr schedule "
        "and grads set to None (about 10 s): 89 s",
        "tests/gpu/test_capture_gpu.py",
    ),
    _pytest(
        "kernels_in_graph",
        115,
        "S + E + the first compile + 25 binaries x C + 12 small captured graphs (about 10 s): 89 s",
        "tests/gpu/test_kernels_graph_gpu.py",
    ),
    _pytest(
        "nccl_capture",
        35,
        "S + E + a one-rank NCCL communicator and three replays (about 5 s): 25 s",
        "tests/gpu/test_nccl_capture_gpu.py",
    ),
    _pytest(
        "action_ranges",
        60,
        "S + E + the first compile + 5 binaries x C + 4 steps, one under torch.profiler "
        "(about 5 s): 44 s",
        "tests/gpu/test_action_ranges_gpu.py",
    ),
    _script(
        "replay_sweep",
        75,
        "S + E + the first compile + 3 binaries x C + 4 points x 3 modes x 15 steps, 12 "
        "pipelines built and captured (about 20 s; the largest point, 32768 tokens through a "
        "4-layer hidden-1024 model, is about 10 TFLOP a step, tens of ms on an H200): 55 s",
        'python3 profiles/gpu_replay_bench.py --steps 15 --json "$GPU_CHECK_FIGURES"',
    ),
    _script(
        "kernel_bandwidth",
        65,
        "S + E + the first compile + 3 binaries x C + 32 timings (do_bench: 25 ms warmup + "
        "100 ms each) and the copy bandwidth, about 15 s: 50 s",
        'python3 tests/benchmarks/bench_kernels.py --no-compile --json "$GPU_CHECK_FIGURES"',
    ),
    _pytest(
        "moe_capture",
        65,
        "S + E + the first compile + 5 binaries x C + 2 twin runs of 4 steps with their "
        "captures (about 10 s): 49 s",
        "tests/gpu/test_moe_capture_gpu.py",
    ),
    # The sm_90 compile test is left out here: it compiles ahead of time without the GPU, and
    # profiles/gpu_image_suite.sh runs it with this machine's Triton on CPU.
    _pytest(
        "kernel_tests",
        300,
        "S + E + about 165 binaries (tests/kernels' shapes, dtypes and kernel variants, "
        "counted by hand) x the median compile, 1.3 s (small blocks): about 240 s",
        "tests/kernels",
        "--ignore=tests/kernels/test_compile_sm90.py",
    ),
)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the check's process group, SIGKILL to whatever of it is left after the
    grace (spawned ranks included)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


def run_command(argv: Sequence[str], limit_s: float, log: Path, env: dict[str, str]) -> int:
    """Run ``argv`` in its own process group with output to ``log``; past ``limit_s`` the
    group is killed and 124 returned (timeout(1)'s code, which the summary reads)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return 124


def run_checks(
    checks: Sequence[Check],
    work: Path,
    budget_s: float,
    env: dict[str, str],
    only: Sequence[str] | None = None,
    log: Path | None = None,
    host: Callable[[], dict[str, Any]] = lambda: gpu_summary.host_info(),
) -> dict[str, Any]:
    """Run ``checks`` in order within ``budget_s`` (see the module docstring); returns the
    summary (``gpu_summary.merge``) with the run's seconds and budget."""
    names = [c.name for c in checks]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ValueError(f"GPU_CHECK_ONLY names no check {unknown}; the checks are {names}")
    start = time.monotonic()
    for check in checks:
        if only and check.name not in only:
            continue
        left = budget_s - (time.monotonic() - start)
        if check.budget_s > left:
            reason = (
                f"skipped for time: its budget is {check.budget_s} s and {max(left, 0):.0f} s "
                f"of the {budget_s:g} s are left"
            )
            gpu_summary.skipped_check(work, check.name, reason, check.budget_s, for_time=True)
            print(f"== {check.name}: {reason}", flush=True)
            continue
        argv = [a.replace("{work}", str(work)) for a in check.argv]
        if check.junit:
            argv.append(f"--junitxml={work}/{check.name}.xml")
        print(f"== {check.name} (budget {check.budget_s} s): {' '.join(argv)}", flush=True)
        started = time.time()
        check_env = {**env, "GPU_CHECK_FIGURES": str(work / f"{check.name}.figures.json")}
        rc = run_command(argv, check.budget_s, work / f"{check.name}.log", check_env)
        rec = gpu_summary.record_check(work, check.name, rc, started, check.budget_s)
        print(f"== {check.name}: {rec['status']} in {rec['seconds']} s", flush=True)
        if log is not None:
            with log.open("a") as out:
                out.write(f"== {check.name} (budget {check.budget_s} s, rc {rc})\n")
                out.write((work / f"{check.name}.log").read_text(errors="replace"))
    return gpu_summary.merge(
        gpu_summary.load_records(work),
        host(),
        budget_s=budget_s,
        seconds=time.monotonic() - start,
    )


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"{c['name']:<18} {c['status']:<8} {c['seconds']:>6.1f} s of {c.get('budget_s', 0):>4} s"
        f"  {c.get('reason', '')}"
        for c in summary["checks"]
    ]
    lines.append(
        f"overall: {summary['status']} in {summary['seconds']:.0f} s "
        f"(budget {summary['budget_s']:g} s)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else os.environ.get("OUT") or "/tmp/graphpipe-gpu")
    out.mkdir(parents=True, exist_ok=True)
    budget_s = float(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S))
    only = [n for n in os.environ.get("GPU_CHECK_ONLY", "").split(",") if n]
    env = dict(os.environ)
    env.pop("GPU_CHECK_FIGURES", None)
    env.update(
        PYTHONUNBUFFERED="1",
        CUBLAS_WORKSPACE_CONFIG=":4096:8",  # deterministic cuBLAS, for the bitwise checks
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    )
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log = out / "gpu_check.log"
    log.write_text("")
    try:
        summary = run_checks(CHECKS, work, budget_s, env, only=only, log=log)
    except ValueError as exc:  # an unknown name in GPU_CHECK_ONLY
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(summary, indent=1, default=str)
    (out / "gpu_check.json").write_text(text + "\n")
    with log.open("a") as f:
        f.write(text + "\n")
    print(text)
    print(table(summary))
    return 1 if summary["status"] == "failed" else 0


if __name__ == "__main__":
    raise SystemExit(main())
