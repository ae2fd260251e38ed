"""Peak memory of one step per rank: CUDA allocator statistics, or on CPU the torch
profiler's allocation events and the process's RSS."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .measure import sync
from .modes import Mode

__all__ = ["peak_memory"]


def _rss_kib() -> tuple[int, int]:
    """This process's (current, peak) resident set size in KiB (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        status = f.read()
    rss = re.search(r"VmRSS:\s+(\d+)", status)
    hwm = re.search(r"VmHWM:\s+(\d+)", status)
    if rss is None or hwm is None:
        raise OSError("no VmRSS/VmHWM in /proc/self/status")
    return int(rss.group(1)), int(hwm.group(1))


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto logs two lines per profiler start and stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_step_peak(run: Callable[[], Any]) -> dict[str, int]:
    """Memory of ``run()`` on CPU, two ways.

    ``step_peak_bytes``: the torch profiler's allocation events (``profile_memory=True``)
    summed in time order, peak above the start: exact tensor bytes, independent of what the
    C allocator caches. ``step_peak_rss_bytes`` / ``peak_rss_bytes``: RSS above the start and
    absolute (``VmHWM`` reset through ``/proc/self/clear_refs``); it depends on what earlier
    work left cached in the process, so it does not compare modes run one after another.
    """
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, int] = {}
    reset = _reset_peak_rss()
    before, _ = _rss_kib()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # and c10's "allocated before the profiling started" warnings
        prof.start()
        try:
            run()
        finally:
            prof.stop()
    _, peak = _rss_kib()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    live = top = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        top = max(top, live)
    out["step_peak_bytes"] = top
    out["peak_rss_bytes"] = peak * 1024
    if reset:
        out["step_peak_rss_bytes"] = max(peak - before, 0) * 1024
    return out


def _resident_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of this rank's parameters and their gradients (each tensor once)."""
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            for t in (p, p.grad):
                if t is not None:
                    seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def peak_memory(mode: Mode, x: Any, y: Any, device: torch.device, ctrl: Any) -> dict[str, int]:
    """One untimed step: the rank's peak memory (see the package doc).

    Gradients are zeroed in place for every mode here (they exist after the earlier steps),
    so that ``step_peak_bytes`` counts what the step itself allocates: activations, P2P
    buffers, temporaries, not the gradients a ``set_to_none`` reset would re-create.
    """
    for m in mode.modules:
        m.zero_grad(set_to_none=False)
    resident = _resident_bytes(mode.modules)
    dist.barrier(group=ctrl)
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        mode.run_step(x, y)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {
            "peak_bytes": int(peak),
            "step_peak_bytes": int(peak - base),
            "params_and_grads_bytes": resident,
        }
    return {**_cpu_step_peak(lambda: mode.run_step(x, y)), "params_and_grads_bytes": resident}
