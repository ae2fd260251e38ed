"""``graphpipe bench``: graphpipe eager vs replay vs torch's ScheduleDualPipeV (and DualPipe).

One run, one process group, the same stages (built from one seed) and the same batch for every
mode. Methods, so that a reader can judge the figures:

* **Step time**: the modes are interleaved round by round (round ``i`` starts at mode
  ``i mod K``), each step starts after a barrier on every rank, and a step's time is the
  largest of the ranks' wall times (on CUDA after ``torch.cuda.synchronize``). Gradients are
  reset outside the timed region (``set_to_none``; in place for replay, whose captured step
  accumulates into the static ``.grad`` tensors); no optimizer runs. Every rank runs the same
  steps: ``--warmup`` untimed rounds, then ``--steps`` timed ones. The table shows the median,
  the inter-quartile range and min-max; ``vs eager`` is the ratio of medians, ``paired`` the
  median over rounds of (this mode's step / graphpipe eager's step in the same round), which
  cancels most of the drift of a shared machine.
* **Loss check**: before timing, one step of every mode on the same weights and batch; the
  losses (and, for the MLP, every gradient) are compared with graphpipe eager's.
* **Peak memory**: one extra untimed step per mode, gradients zeroed in place first (so the
  figure is what the step allocates: activations, P2P buffers, temporaries). CUDA:
  ``max_memory_allocated`` after ``reset_peak_memory_stats`` (absolute and above the start).
  CPU (torch has no CPU allocator statistics): the torch profiler's allocation events
  (``profile_memory=True``) summed in time order, peak above the step's start: exact tensor
  bytes. The JSON also has the step's RSS peak (``VmHWM`` reset through
  ``/proc/self/clear_refs``), absolute and above its start; that one depends on what the C
  allocator kept from earlier work, so it does not compare modes run one after another. Per
  rank; the table shows the largest rank. Parameter + gradient bytes and the process's peak
  RSS (``getrusage``, whole run) are in the JSON.
* **Host overhead per action**: trivial stages (one ``Linear(1, 1)``, one row per
  micro-batch). (a) the full world: step time / compute cells per rank (includes P2P);
  (b) a one-rank pipeline on rank 0 (a process group of rank 0 alone, both stages local, no
  P2P): ``(step - bare) / cells``, where *bare* runs the same stage calls and autograd
  backwards per micro-batch in a plain loop, with plain ``nn.Linear`` and with graphpipe's
  ``DeferrableLinear``; the difference between the two bares is the cost of the I/W split.
* **Bubble vs simulator**: each rank times its two stages alone (median of repeats): F (the
  last stage includes the loss), B, I (backward with the Linear weight GEMMs deferred) and W.
  The means over all stages, plus the median or the mean of 100 two-way P2P exchanges between
  ranks 0 and 1 (``Costs.p2p``, per communication batch), become ``simulate.Costs``;
  ``simulate(lower(dualpipev), placement, costs)`` predicts the makespan and the bubble,
  compared with the measured median step and with the bubble of one recorded step (per-action
  start/end taken by standing in for the executor's range emitter, ``DualPipeV.ranges``).
  ``--plot`` draws that recorded timeline above the simulated one (SVG).

Timings on a shared machine are noisy: read medians and spreads, repeat runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import math
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "MODES",
    "MODE_DUALPIPE",
    "MODE_EAGER",
    "MODE_REPLAY",
    "MODE_TORCH",
    "BenchWorld",
    "MLPStage",
    "TinyStage",
    "Workload",
    "add_parser",
    "capture_supported",
    "format_report",
    "main",
    "run",
]

MODE_EAGER = "graphpipe eager"
MODE_REPLAY = "graphpipe replay"
MODE_TORCH = "torch ScheduleDualPipeV"
MODE_DUALPIPE = "DeepSeek DualPipeV"
MODES = (MODE_EAGER, MODE_REPLAY, MODE_TORCH, MODE_DUALPIPE)

REGIMES = ("overhead", "compute", "realistic", "sweep")
_REGIME_CHOICES = (*REGIMES, "both", "all")


def capture_supported() -> bool:
    """Whether ``graphpipe.DualPipeV`` takes ``capture=`` (static replay / CUDA graphs)."""
    from . import DualPipeV

    return "capture" in inspect.signature(DualPipeV).parameters


def _say(text: str) -> None:
    print(f"graphpipe bench: {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Models and workloads


class MLPStage(nn.Module):
    """A residual MLP block, ``x + fc2(tanh(fc1(x)))`` with a 4x wide middle: plain Linears,
    so graphpipe defers their weight GEMMs to W."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TinyStage(nn.Module):
    """The cheapest stage with a weight: one ``Linear(1, 1)`` (for host-overhead figures)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (a module-level function: picklable for spawned ranks)."""
    return nn.functional.mse_loss(output, target)


@dataclass(frozen=True)
class Workload:
    """One benchmarked configuration.

    name: the regime (``overhead``, ``compute``, ``realistic``, ``sweep-<rows>``, ``host``).
    model: ``mlp`` (MLPStage), ``tiny`` (TinyStage) or ``llama`` (graphpipe.models).
    hidden: model width (``tiny``: 1).
    microbatches: M per step.
    mb_rows: rows (sequences for ``llama``) per micro-batch.
    seq_len: tokens per sequence (``llama`` only; 1 otherwise).
    seed: weights and batch.
    """

    name: str
    model: str
    hidden: int
    microbatches: int
    mb_rows: int
    seq_len: int = 1
    seed: int = 0

    @property
    def rows(self) -> int:
        """Rows per step."""
        return self.microbatches * self.mb_rows

    @property
    def tokens_per_step(self) -> int:
        """Rows per step times the sequence length (one token per row for the MLPs)."""
        return self.rows * self.seq_len

    def describe(self, world: int) -> str:
        what = {
            "mlp": f"residual MLP stages, hidden {self.hidden}",
            "tiny": "Linear(1, 1) stages",
            "llama": f"Llama stages, hidden {self.hidden}, seq {self.seq_len}",
        }[self.model]
        return (
            f"{world} ranks x 2 stages of {what}; M={self.microbatches} micro-batches of "
            f"{self.mb_rows} rows ({self.tokens_per_step} tokens per step)"
        )

    def all_stages(self, num_stages: int, device: torch.device) -> list[nn.Module]:
        """Every stage of the model, deterministic in ``seed`` (same on every rank)."""
        if self.model == "llama":
            from .models import LlamaConfig, build_stages

            cfg = LlamaConfig(
                hidden=self.hidden,
                n_layers=num_stages,  # one block per stage
                n_heads=4 if self.hidden % 8 == 0 else 1,
                max_seq_len=self.seq_len,
                use_kernels=False,
            )
            return list(build_stages(cfg, num_stages, seed=self.seed, device=device))
        gen = torch.Generator().manual_seed(self.seed)
        stages: list[nn.Module] = []
        for _ in range(num_stages):
            stage = MLPStage(self.hidden) if self.model == "mlp" else TinyStage()
            with torch.no_grad():
                for p in stage.parameters():
                    scale = 1.0 / math.sqrt(p.shape[-1])
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
            stages.append(stage.to(device))
        return stages

    def local_stages(self, rank: int, world: int, device: torch.device) -> tuple[nn.Module, ...]:
        """Fresh copies of rank ``rank``'s stages ``(r, 2N-1-r)`` (tied weights stay tied)."""
        stages = self.all_stages(2 * world, device)
        return (stages[rank], stages[2 * world - 1 - rank])

    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        if self.model == "llama":
            from .models import LlamaLoss

            return LlamaLoss(use_kernels=False)
        return mse_loss

    def batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step's ``(inputs, labels)``."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        if self.model == "llama":
            tokens = torch.randint(0, 256, (self.rows, self.seq_len + 1), generator=gen)
            return (
                tokens[:, :-1].contiguous().to(device),
                tokens[:, 1:].contiguous().to(device),
            )
        x = torch.randn(self.rows, self.hidden, generator=gen)
        y = torch.randn(self.rows, self.hidden, generator=gen)
        return x.to(device), y.to(device)


def _workloads(opts: dict, world: int, device: str) -> tuple[list[Workload], dict[str, str]]:
    """The regimes asked for (with --hidden/--microbatches/--mb-rows applied) and the regimes
    skipped with the reason."""
    n = world
    wanted = {
        "both": ["overhead", "compute", "sweep"],
        "all": list(REGIMES),
    }.get(opts["regime"], [opts["regime"]])
    m_over = opts.get("microbatches")
    h_over = opts.get("hidden")
    r_over = opts.get("mb_rows")
    out: list[Workload] = []
    skipped: dict[str, str] = {}

    def make(name: str, model: str, hidden: int, m: int, rows: int, seq: int = 1) -> Workload:
        return Workload(
            name,
            model,
            h_over or hidden,
            m_over or m,
            r_over or rows,
            seq,
        )

    for name in wanted:
        if name == "overhead":
            out.append(make("overhead", "mlp", 32, 16 * n, 2))
        elif name == "compute":
            out.append(make("compute", "mlp", 1024, 4 * n, 32))
        elif name == "realistic":
            out.append(make("realistic", "llama", 128, 4 * n, 2, seq=64))
        elif name == "sweep":
            if device != "cuda":
                if opts["regime"] == "sweep":
                    skipped["sweep"] = "needs --device cuda (launch-bound vs compute-bound GPU)"
                continue
            for rows in (1, 8, 64, 512):
                out.append(make(f"sweep-{rows}", "mlp", 1024, 4 * n, rows))
    return out, skipped


# --------------------------------------------------------------------------------------------
# Modes: one object per contender with step(inputs, labels) -> loss (rank 0) or None


@dataclass
class _Mode:
    """One contender: its local stages, its step function, and how to reset gradients.

    set_to_none: False for graphpipe replay, whose captured step accumulates into the static
    ``.grad`` tensors (it must keep them).
    """

    name: str
    modules: tuple[nn.Module, ...]
    run_step: Callable[[Any, Any], Any]
    pipe: Any = None  # graphpipe's DualPipeV, for the timeline recording
    set_to_none: bool = True

    def zero_grad(self) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=self.set_to_none)

    def step(self, x: Any, y: Any) -> Any:
        self.zero_grad()
        return self.run_step(x, y)

    def close(self) -> None:
        """Release captured graphs (before the process group goes)."""
        close = getattr(self.pipe, "close", None)
        if close is not None:
            close()


def _graphpipe_mode(
    name: str, stages: tuple[nn.Module, ...], w: Workload, group: Any, **extra: Any
) -> _Mode:
    from . import DualPipeV

    pipe = DualPipeV(
        stages, num_microbatches=w.microbatches, loss_fn=w.loss_fn(), group=group, **extra
    )
    return _Mode(name, stages, pipe.step, pipe, set_to_none=not extra.get("capture", False))


def _torch_mode(
    stages: tuple[nn.Module, ...], w: Workload, rank: int, world: int, device: torch.device, group
) -> _Mode:
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    ids = (rank, 2 * world - 1 - rank)
    pstages = [
        PipelineStage(mod, i, 2 * world, device, group=group)
        for mod, i in zip(stages, ids, strict=True)
    ]
    sched = ScheduleDualPipeV(pstages, w.microbatches, loss_fn=w.loss_fn())

    def step(x: Any, y: Any) -> Any:
        if rank == 0:
            losses: list[torch.Tensor] = []
            sched.step(x, target=y, losses=losses, return_outputs=False)
            return torch.stack([loss.detach() for loss in losses]).mean()
        sched.step(return_outputs=False)
        return None

    return _Mode(MODE_TORCH, stages, step)


def _dualpipe_mode(
    stages: tuple[nn.Module, ...], w: Workload, rank: int, device: torch.device, group: Any
) -> _Mode:
    """DeepSeek's DualPipeV (``import dualpipe``); its P2P buffers are CUDA tensors."""
    import dualpipe

    probe = w.all_stages(2, torch.device("cpu"))[0]  # the stage-to-stage activation shape
    x, _ = w.batch(torch.device("cpu"))
    with torch.no_grad():
        act = probe(x[: w.mb_rows])
    dualpipe.set_p2p_tensor_shapes([tuple(act.shape)])
    dualpipe.set_p2p_tensor_dtype(act.dtype)
    model = dualpipe.DualPipeV(stages, process_group=group)
    criterion = w.loss_fn()

    def step(x: Any, y: Any) -> Any:
        inputs = (x,) if rank == 0 else ()
        labels = [y] if rank == 0 else []
        loss, _ = model.step(
            *inputs,
            num_chunks=w.microbatches,
            criterion=criterion,
            labels=labels,
            return_outputs=False,
        )
        if loss is None:
            return None
        return loss.detach().float().mean()

    return _Mode(MODE_DUALPIPE, stages, step)


def _build_modes(
    w: Workload, rank: int, world: int, device: torch.device, group: Any
) -> tuple[list[_Mode], dict[str, str]]:
    """Every available contender on fresh copies of the same stages; skipped ones with why."""
    modes = [_graphpipe_mode(MODE_EAGER, w.local_stages(rank, world, device), w, group)]
    skipped: dict[str, str] = {}
    if capture_supported():
        extra = {"capture": True, "per_channel_groups": device.type == "cuda"}
        modes.append(
            _graphpipe_mode(MODE_REPLAY, w.local_stages(rank, world, device), w, group, **extra)
        )
    else:
        skipped[MODE_REPLAY] = "graphpipe.DualPipeV has no capture= option yet"
    modes.append(_torch_mode(w.local_stages(rank, world, device), w, rank, world, device, group))
    try:
        import dualpipe  # noqa: F401
    except ImportError:
        skipped[MODE_DUALPIPE] = "the dualpipe package is not installed"
    else:
        if device.type != "cuda":
            skipped[MODE_DUALPIPE] = "DeepSeek's DualPipe allocates its P2P buffers on CUDA"
        else:
            stages = w.local_stages(rank, world, device)
            modes.append(_dualpipe_mode(stages, w, rank, device, group))
    return modes, skipped


# --------------------------------------------------------------------------------------------
# Measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_rounds(
    modes: Sequence[_Mode],
    x: Any,
    y: Any,
    steps: int,
    warmup: int,
    ctrl: Any,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Interleaved A/B/...: per round every mode once, the order rotating by round."""
    times: dict[str, list[float]] = {m.name: [] for m in modes}
    k = len(modes)
    total = warmup + steps
    every = max(1, total // 4)
    for i in range(total):
        order = [modes[(i + j) % k] for j in range(k)]
        for mode in order:
            mode.zero_grad()
            _sync(device)
            dist.barrier(group=ctrl)
            t0 = time.perf_counter()
            mode.run_step(x, y)
            _sync(device)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[mode.name].append(dt)
        if progress is not None and ((i + 1) % every == 0 or i + 1 == total):
            progress(f"round {i + 1}/{total} ({warmup} warmup)")
    return times


def _loss_check(
    modes: Sequence[_Mode], x: Any, y: Any, rank: int, ctrl: Any, grads: bool
) -> dict[str, Any]:
    """One step per mode on the same weights; losses (and gradients) against graphpipe eager."""
    losses: dict[str, float] = {}
    for mode in modes:
        loss = mode.step(x, y)
        if rank == 0 and loss is not None:
            losses[mode.name] = float(loss.detach())
    ref = modes[0]
    grad_diff: dict[str, Any] = {}
    if grads:
        for mode in modes[1:]:
            worst, where = 0.0, ""
            for ma, mb in zip(ref.modules, mode.modules, strict=True):
                for (name, a), (_, b) in zip(
                    ma.named_parameters(), mb.named_parameters(), strict=True
                ):
                    if a.grad is None or b.grad is None:
                        if (a.grad is None) != (b.grad is None):
                            worst, where = math.inf, f"{name} (gradient missing in one)"
                        continue
                    ga, gb = a.grad.detach(), b.grad.detach()
                    scale = float(ga.abs().max()) or 1.0
                    d = float((ga - gb).abs().max()) / scale
                    if d > worst:
                        worst, where = d, name
            grad_diff[mode.name] = (worst, where)
    gathered: list[Any] = [None] * dist.get_world_size(ctrl)
    dist.all_gather_object(gathered, grad_diff, group=ctrl)
    out: dict[str, Any] = {"reference": ref.name, "reference_loss": losses.get(ref.name)}
    for mode in modes[1:]:
        entry: dict[str, Any] = {"loss": losses.get(mode.name)}
        if mode.name in losses and ref.name in losses:
            entry["abs_diff"] = abs(losses[mode.name] - losses[ref.name])
        if grads:
            per_rank = [g[mode.name] for g in gathered]
            worst = max(per_rank, key=lambda t: t[0])
            entry["max_rel_grad_diff"] = worst[0]
            entry["worst_param"] = f"rank {per_rank.index(worst)} {worst[1]}" if worst[0] else ""
        out[mode.name] = entry
    return out


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


def _peak_memory(mode: _Mode, x: Any, y: Any, device: torch.device, ctrl: Any) -> dict[str, int]:
    """One untimed step: the rank's peak memory (see the module doc).

    Gradients are zeroed in place for every mode here (they exist after the earlier steps),
    so that ``step_peak_bytes`` counts what the step itself allocates: activations, P2P
    buffers, temporaries, not the gradients a ``set_to_none`` reset would re-create.
    """
    for m in mode.modules:
        m.zero_grad(set_to_none=False)
    resident = _resident_bytes(mode.modules)
    dist.barrier(group=ctrl)
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        mode.run_step(x, y)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {
            "peak_bytes": int(peak),
            "step_peak_bytes": int(peak - base),
            "params_and_grads_bytes": resident,
        }
    return {**_cpu_step_peak(lambda: mode.run_step(x, y)), "params_and_grads_bytes": resident}


class _RangeClock:
    """Stands in for the executor's range emitter (``DualPipeV.ranges``) for one step and
    records every range (``step``, ``3F5``, ``(0F5;7B2)OVERLAP_F_B``) with its wall times."""

    __slots__ = ("records", "stack")

    def __init__(self) -> None:
        self.stack: list[tuple[str, float]] = []
        self.records: list[tuple[str, float, float]] = []

    def push(self, name: str) -> None:
        self.stack.append((name, time.perf_counter()))

    def pop(self) -> None:
        name, start = self.stack.pop()
        self.records.append((name, start, time.perf_counter()))


def _record_timeline(
    mode: _Mode, x: Any, y: Any, rank: int, device: torch.device, ctrl: Any
) -> list[dict[str, Any]]:
    """One untimed step with per-action wall times, in seconds from a common barrier."""
    pipe = mode.pipe
    clock = _RangeClock()
    saved = pipe.ranges
    mode.zero_grad()
    _sync(device)
    dist.barrier(group=ctrl)
    t0 = time.perf_counter()
    pipe.ranges = clock
    try:
        mode.run_step(x, y)
    finally:
        pipe.ranges = saved
    return [
        {"rank": rank, "label": name, "start": s - t0, "end": e - t0}
        for name, s, e in clock.records
    ]


def _median_time(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _stage_inputs(
    w: Workload, world: int, device: torch.device
) -> tuple[list[nn.Module], list[Any], Any]:
    """All stages, the input of each stage for micro-batch 0, and its labels."""
    stages = w.all_stages(2 * world, device)
    x, y = w.batch(device)
    h = x[: w.mb_rows]
    inputs = []
    with torch.no_grad():
        for s in stages:
            inputs.append(h)
            h = s(h)
    return stages, inputs, y[: w.mb_rows]


class _StageTimer:
    """Times one stage's F, B, I and W alone, with graphpipe's deferrable Linears."""

    def __init__(self, mod: nn.Module, x_in: Any, key: int, loss: Callable | None) -> None:
        from .weightgrad import WeightGradStore, make_deferrable

        self.mod, self.x_in, self.key, self.loss = mod, x_in, key, loss
        self.store = WeightGradStore()
        make_deferrable(mod, self.store)
        self.out: Any = None
        self.grad: Any = None

    def forward(self) -> None:
        x = self.x_in
        x = x.detach().requires_grad_() if x.is_floating_point() else x
        out = self.mod(x)
        if self.loss is not None:
            out = self.loss(out)
        self.out = out
        self.grad = torch.ones_like(out) if self.loss is not None else torch.randn_like(out)

    def backward(self) -> None:
        torch.autograd.backward(self.out, self.grad)

    def backward_input(self) -> None:
        with self.store.deferring(self.key):
            torch.autograd.backward(self.out, self.grad)

    def weight(self) -> None:
        self.store.run(self.key)


def _stage_costs(
    w: Workload, rank: int, world: int, device: torch.device, reps: int
) -> dict[str, float]:
    """Median F, B, I, W (seconds) of this rank's two stages, each alone, summed over both."""
    stages, inputs, labels = _stage_inputs(w, world, device)
    loss_fn = w.loss_fn()
    last = 2 * world - 1
    totals = dict.fromkeys("FBIW", 0.0)
    for s in (rank, last - rank):
        loss = (lambda out: loss_fn(out, labels)) if s == last else None
        timer = _StageTimer(copy.deepcopy(stages[s]), inputs[s], s, loss)
        times: dict[str, list[float]] = {k: [] for k in "FBIW"}
        for _ in range(reps):
            times["F"].append(_median_time(timer.forward, 1, device))
            times["B"].append(_median_time(timer.backward, 1, device))
            timer.forward()
            times["I"].append(_median_time(timer.backward_input, 1, device))
            times["W"].append(_median_time(timer.weight, 1, device))
        for key, ts in times.items():
            totals[key] += statistics.median(ts)
    return totals


def _p2p_cost(
    w: Workload, rank: int, world: int, device: torch.device, group: Any, reps: int
) -> dict[str, float]:
    """One batched two-way exchange of one activation between ranks 0 and 1, ``reps`` times:
    median and mean seconds, and the fraction slower than 1 ms (transport stalls)."""
    if world < 2:
        return {"median_s": 0.0, "mean_s": 0.0, "over_1ms": 0.0}
    _, inputs, _ = _stage_inputs(w, world, device)
    buf = inputs[1].detach().clone()
    out = torch.empty_like(buf)
    times = []
    for _ in range(reps + 2):
        if rank < 2:
            peer = 1 - rank
            ops = [
                dist.P2POp(dist.isend, buf, peer, group),
                dist.P2POp(dist.irecv, out, peer, group),
            ]
            _sync(device)
            t0 = time.perf_counter()
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            _sync(device)
            times.append(time.perf_counter() - t0)
    times = times[2:]
    if not times:
        return {"median_s": 0.0, "mean_s": 0.0, "over_1ms": 0.0}
    return {
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "over_1ms": sum(t > 1e-3 for t in times) / len(times),
    }


def _simulation(
    w: Workload,
    world: int,
    per_rank_costs: list[dict[str, float]],
    p2p: dict[str, float],
    host_per_action: float | None,
) -> tuple[dict[str, Any], Any]:
    """Costs (mean over stages) -> simulated makespan and bubble, in variants: compute only,
    plus the median or the mean P2P exchange per batch, plus the host overhead per action."""
    from .lower import lower
    from .schedules import SCHEDULES
    from .simulate import Costs, simulate

    stages = 2 * world
    mean = {k: sum(c[k] for c in per_rank_costs) / stages for k in "FBIW"}
    schedule, placement = SCHEDULES["dualpipev"](world, w.microbatches)
    variants: dict[str, Costs] = {
        "compute_only": Costs(**mean),
        "with_p2p_median": Costs(**mean, p2p=p2p["median_s"]),
        "with_p2p_mean": Costs(**mean, p2p=p2p["mean_s"]),
    }
    if host_per_action is not None:
        h = max(host_per_action, 0.0)
        variants["with_p2p_mean_and_host_overhead"] = Costs(
            **{k: v + h for k, v in mean.items()}, p2p=p2p["mean_s"]
        )
    out: dict[str, Any] = {"costs_s": mean, "p2p": p2p, "predictions": {}}
    picture = None
    for name, costs in variants.items():
        res = simulate(lower(schedule, placement, durations=costs.of), placement, costs)
        out["predictions"][name] = {
            "makespan_s": res.makespan,
            "bubble_fraction": res.bubble_fraction,
            "per_rank_bubble": [r.bubble_fraction for r in res.ranks],
        }
        if name == "with_p2p_mean":
            picture = res
    return out, picture


def _measured_bubble(records: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Busy time per rank (its actions) over the recorded step's makespan."""
    from .ir import Action

    steps = [r for r in records if r["label"] == "step"]
    makespan = max(r["end"] for r in steps) if steps else 0.0
    busy = [0.0] * world
    for r in records:
        if r["label"] == "step":
            continue
        try:
            Action.parse(r["label"])
        except ValueError:
            continue
        busy[r["rank"]] += r["end"] - r["start"]
    per_rank = [1 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return {
        "makespan_s": makespan,
        "bubble_fraction": sum(per_rank) / world,
        "per_rank_bubble": per_rank,
    }


# --------------------------------------------------------------------------------------------
# Host overhead per action


def _bare_loop(
    stages: tuple[nn.Module, nn.Module], loss_fn: Callable, xs: list, ys: list
) -> Callable[[], None]:
    """The stage calls of a one-rank pipeline step without a scheduler: per micro-batch the
    two forwards (stage 1 on a detached leaf), the loss, and two autograd backwards."""
    s0, s1 = stages
    inv_m = 1.0 / len(xs)

    def run() -> None:
        for m in stages:
            m.zero_grad(set_to_none=True)
        for x, y in zip(xs, ys, strict=True):
            h = s0(x)
            h_leaf = h.detach().requires_grad_()
            loss = loss_fn(s1(h_leaf), y) * inv_m
            loss.backward()
            torch.autograd.backward(h, h_leaf.grad)

    return run


def _host_overhead(
    rank: int,
    world: int,
    device: torch.device,
    group: Any,
    ctrl: Any,
    steps: int,
    warmup: int,
    microbatches: int,
) -> dict[str, Any]:
    """Per-action host overhead with trivial stages: the world, and a one-rank pipeline."""
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from . import DualPipeV
    from .schedules import dualpipev
    from .weightgrad import WeightGradStore, make_deferrable

    out: dict[str, Any] = {}
    # (a) the whole world, trivial stages: everything but compute, P2P included.
    w = Workload("host", "tiny", 1, microbatches, 1)
    modes, _ = _build_modes(w, rank, world, device, group)
    modes = [m for m in modes if m.name != MODE_DUALPIPE]
    x, y = w.batch(device)
    xs, ys = (x, y) if rank == 0 else (None, None)
    times = _timed_rounds(modes, xs, ys, steps, warmup, ctrl, device)
    for m in modes:
        m.close()
    cells = max(len(acts) for acts in dualpipev(world, w.microbatches).values())
    out["world"] = {
        "workload": asdict(w),
        "compute_cells_per_rank": cells,
        "step_times_s": times,
    }
    # (b) one rank, both stages local (no P2P): rank 0 alone in its own process group.
    solo = dist.new_group([dist.get_global_rank(group, 0)])
    if rank == 0:
        w1 = Workload("host-1rank", "tiny", 1, microbatches, 1)
        loss_fn = w1.loss_fn()
        x1, y1 = w1.batch(device)
        xs1, ys1 = list(x1.chunk(w1.microbatches)), list(y1.chunk(w1.microbatches))
        eager_stages = w1.local_stages(0, 1, device)
        pipe = DualPipeV(
            eager_stages, num_microbatches=w1.microbatches, loss_fn=loss_fn, group=solo
        )
        tstages = w1.local_stages(0, 1, device)
        psts = [PipelineStage(m, i, 2, device, group=solo) for i, m in enumerate(tstages)]
        sched = ScheduleDualPipeV(psts, w1.microbatches, loss_fn=loss_fn)
        plain = w1.local_stages(0, 1, device)
        deferrable = w1.local_stages(0, 1, device)
        for m in deferrable:
            make_deferrable(m, WeightGradStore())

        def zeroed(mods: Sequence[nn.Module], fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                for m in mods:
                    m.zero_grad(set_to_none=True)
                return fn()

            return run

        def torch_step() -> None:
            sched.step(x1, target=y1, losses=[], return_outputs=False)

        contenders: dict[str, Callable[[], Any]] = {
            MODE_EAGER: zeroed(eager_stages, lambda: pipe.step(x1, y1)),
            MODE_TORCH: zeroed(tstages, torch_step),
            "bare loop, nn.Linear": _bare_loop(plain, loss_fn, xs1, ys1),
            "bare loop, DeferrableLinear": _bare_loop(deferrable, loss_fn, xs1, ys1),
        }
        reps = max(10 * steps, 50)  # about a millisecond each
        solo_times: dict[str, list[float]] = {k: [] for k in contenders}
        names = list(contenders)
        for i in range(warmup + reps):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                _sync(device)
                t0 = time.perf_counter()
                contenders[name]()
                _sync(device)
                if i >= warmup:
                    solo_times[name].append(time.perf_counter() - t0)
        cells1 = len(dualpipev(1, w1.microbatches)[0])
        med = {k: statistics.median(v) for k, v in solo_times.items()}
        bare, bare_def = med["bare loop, nn.Linear"], med["bare loop, DeferrableLinear"]
        out["one_rank"] = {
            "workload": asdict(w1),
            "compute_cells": cells1,
            "step_times_s": solo_times,
            "median_s": med,
            "executor_overhead_per_action_s": (med[MODE_EAGER] - bare_def) / cells1,
            "graphpipe_overhead_per_action_s": (med[MODE_EAGER] - bare) / cells1,
            "wsplit_linear_overhead_per_action_s": (bare_def - bare) / cells1,
            "torch_overhead_per_action_s": (med[MODE_TORCH] - bare) / cells1,
        }
    dist.barrier(group=ctrl)
    return out


# --------------------------------------------------------------------------------------------
# The rank program


def _spread(times: Sequence[float]) -> dict[str, float]:
    ts = sorted(times)
    if len(ts) >= 2:
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
    else:
        q1 = q3 = ts[0]
    return {
        "median_s": statistics.median(ts),
        "q1_s": q1,
        "q3_s": q3,
        "min_s": ts[0],
        "max_s": ts[-1],
    }


def _max_over_ranks(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per mode, per step: the slowest rank's time (the step ends when the last rank does)."""
    return {
        name: [max(ts) for ts in zip(*(r[name] for r in per_rank), strict=True)]
        for name in per_rank[0]
    }


def _run_workload(
    w: Workload,
    rank: int,
    world: int,
    device: torch.device,
    group: Any,
    ctrl: Any,
    opts: dict,
    host_per_action: float | None,
) -> dict[str, Any]:
    say = _say if rank == 0 else (lambda _text: None)
    say(f"regime {w.name}: {w.describe(world)}")
    modes, skipped = _build_modes(w, rank, world, device, group)
    for name, why in skipped.items():
        say(f"  {name}: skipped ({why})")
    x, y = w.batch(device)
    xs, ys = (x, y) if rank == 0 else (None, None)
    check = _loss_check(modes, xs, ys, rank, ctrl, grads=w.model == "mlp")
    say(f"  timing {', '.join(m.name for m in modes)} interleaved")
    times = _timed_rounds(
        modes, xs, ys, opts["steps"], opts["warmup"], ctrl, device, lambda t: say(f"    {t}")
    )
    say("  peak memory, per-action timeline, stage costs")
    memory = {m.name: _peak_memory(m, xs, ys, device, ctrl) for m in modes}
    timeline = _record_timeline(modes[0], xs, ys, rank, device, ctrl)
    reps = max(3, min(opts["steps"], 10))
    costs = _stage_costs(w, rank, world, device, reps)
    dist.barrier(group=ctrl)
    p2p = _p2p_cost(w, rank, world, device, group, 100)
    # Gather to rank 0: one object per rank.
    mine = {
        "times": times,
        "memory": memory,
        "timeline": timeline,
        "costs": costs,
        "p2p": p2p,
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=ctrl)
    for m in modes:
        m.close()
    if rank != 0:
        return {}
    step_times = _max_over_ranks([g["times"] for g in gathered])
    eager_median = statistics.median(step_times[MODE_EAGER])
    result_modes: dict[str, Any] = {}
    for name, ts in step_times.items():
        spread = _spread(ts)
        mem = [g["memory"][name] for g in gathered]
        paired = [t / e for t, e in zip(ts, step_times[MODE_EAGER], strict=True)]
        result_modes[name] = {
            "step_times_s": ts,
            **spread,
            "tokens_per_s": w.tokens_per_step / spread["median_s"],
            "ratio_to_eager": spread["median_s"] / eager_median,
            "paired_ratio_to_eager": statistics.median(paired),
            "peak_memory_per_rank": mem,
        }
        say(
            f"  {name}: median {spread['median_s'] * 1e3:.2f} ms "
            f"({spread['median_s'] / eager_median:.2f}x eager)"
        )
    records = [r for g in gathered for r in g["timeline"]]
    p2p_all = gathered[0]["p2p"]
    sim, picture = _simulation(w, world, [g["costs"] for g in gathered], p2p_all, host_per_action)
    sim["measured"] = {
        "median_step_s": eager_median,
        "recorded_step": _measured_bubble(records, world),
    }
    return {
        "workload": asdict(w),
        "tokens_per_step": w.tokens_per_step,
        "description": w.describe(world),
        "modes": result_modes,
        "skipped": skipped,
        "check": check,
        "simulation": sim,
        "timeline": records,
        "maxrss_kib_per_rank": [g["maxrss_kib"] for g in gathered],
        "_picture": picture,
    }


def _bench_rank(rank: int, world: int, device: torch.device, opts: dict) -> None:
    """One rank of ``graphpipe bench``: measure, gather to rank 0, report there."""
    group = dist.group.WORLD
    ctrl = group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo")
    _bench(rank, world, device, opts, group, ctrl)
    # The pipelines sit in reference cycles (bound-method dispatch tables), so only the cyclic
    # GC frees them and their process-group references. Left to interpreter shutdown, after
    # destroy_process_group, that made about one spawned rank in twenty abort at exit
    # ("terminate called without an active exception"). Collect now; leave together.
    gc.collect()
    dist.barrier(group=ctrl)


def _bench(rank: int, world: int, device: torch.device, opts: dict, group: Any, ctrl: Any) -> None:
    torch.manual_seed(0)
    say = _say if rank == 0 else (lambda _text: None)
    workloads, skipped = _workloads(opts, world, device.type)
    for name, why in skipped.items():
        say(f"regime {name}: skipped ({why})")
    say(f"host overhead per action: trivial stages, {world} ranks and a one-rank pipeline")
    host = _host_overhead(
        rank, world, device, group, ctrl, opts["steps"], opts["warmup"], 4 * world
    )
    host_per_action = host["one_rank"]["graphpipe_overhead_per_action_s"] if rank == 0 else None
    # the per-rank world times were measured per rank: gather and take the slowest rank
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, host["world"]["step_times_s"], group=ctrl)
    regimes = {}
    for w in workloads:
        regimes[w.name] = _run_workload(w, rank, world, device, group, ctrl, opts, host_per_action)
    if rank != 0:
        return
    cells = host["world"]["compute_cells_per_rank"]
    world_times = _max_over_ranks(gathered)
    host["world"]["step_times_s"] = world_times
    host["world"]["per_action_s"] = {
        name: statistics.median(ts) / cells for name, ts in world_times.items()
    }
    result = {
        "config": {
            "ranks": world,
            "device": device.type,
            "backend": dist.get_backend(group),
            "steps": opts["steps"],
            "warmup": opts["warmup"],
            "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__,
            "capture_supported": capture_supported(),
            "command": opts.get("command_line"),
        },
        "skipped_regimes": skipped,
        "host_overhead": host,
        "regimes": regimes,
    }
    if opts.get("plot"):
        path = _write_plot(opts["plot"], result, world)
        say(f"wrote {path}")
    for reg in regimes.values():
        reg.pop("_picture", None)
    print(format_report(result), flush=True)
    if opts.get("json"):
        Path(opts["json"]).write_text(json.dumps(result, indent=2))
        say(f"wrote {opts['json']}")


# --------------------------------------------------------------------------------------------
# A pre-spawned world driven step by step (pytest-benchmark)


def _serve_rank(rank: int, world: int, port: int, device: str, conn: Any) -> None:
    """A rank of ``BenchWorld``: build modes on ``setup``, run one step on ``step``."""
    import traceback

    from .launch import _init

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    modes: dict[str, _Mode] = {}
    try:
        dev = _init(rank, world, device)
        group = dist.group.WORLD
        ctrl = group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo")
        batch: tuple[Any, Any] = (None, None)
        while True:
            cmd, arg = conn.recv()
            if cmd == "setup":
                for m in modes.values():
                    m.close()
                built, skipped = _build_modes(arg, rank, world, dev, group)
                modes = {m.name: m for m in built}
                x, y = arg.batch(dev)
                batch = (x, y) if rank == 0 else (None, None)
                conn.send(("ok", (list(modes), skipped)))
            elif cmd == "step":
                mode = modes[arg]
                mode.zero_grad()
                _sync(dev)
                dist.barrier(group=ctrl)
                t0 = time.perf_counter()
                mode.run_step(*batch)
                _sync(dev)
                conn.send(("ok", time.perf_counter() - t0))
            else:
                break
    except BaseException:
        conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        for m in modes.values():
            m.close()
        modes.clear()
        gc.collect()  # see _bench_rank
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


class BenchWorld:
    """``num_ranks`` spawned ranks that run one pipeline step of a mode per command.

    For pytest-benchmark: ``step(mode)`` sends the command to every rank (so every rank runs
    the same steps), each rank waits at a barrier, times its step, and replies; it returns
    the slowest rank's time. The caller's own timing of ``step`` adds the pipe round trip
    (tens of microseconds on one machine).
    """

    def __init__(self, num_ranks: int, device: str = "cpu", timeout: float = 300.0) -> None:
        import torch.multiprocessing as mp

        from .launch import _free_port

        ctx = mp.get_context("spawn")
        port = _free_port()
        self.timeout = timeout
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve_rank, args=(rank, num_ranks, port, device, child), daemon=True
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def _ask(self, cmd: str, arg: Any) -> list[Any]:
        for c in self.conns:
            c.send((cmd, arg))
        replies = []
        for c in self.conns:
            if not c.poll(self.timeout):
                self.close()
                raise TimeoutError(f"a bench rank did not answer {cmd!r} in {self.timeout} s")
            status, value = c.recv()
            if status != "ok":
                self.close()
                raise RuntimeError(value)
            replies.append(value)
        return replies

    def setup(self, workload: Workload) -> tuple[list[str], dict[str, str]]:
        """Build every mode for ``workload``; returns (mode names, skipped modes with why)."""
        return self._ask("setup", workload)[0]

    def step(self, mode: str) -> float:
        """One step of ``mode`` on every rank; the slowest rank's wall time (seconds)."""
        return max(self._ask("step", mode))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []

    def __enter__(self) -> BenchWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Report


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def format_report(result: dict[str, Any]) -> str:
    """The tables ``graphpipe bench`` prints, from its JSON result."""
    cfg = result["config"]
    lines = [
        f"graphpipe bench: {cfg['ranks']} ranks, {cfg['device']}/{cfg['backend']}, "
        f"{cfg['threads_per_rank']} thread(s) per rank, torch {cfg['torch']}; "
        f"{cfg['steps']} timed steps after {cfg['warmup']} warmup, modes interleaved; "
        "step time = slowest rank",
        "peak step mem: what one step allocates on the largest rank, above its start (CPU: "
        "tensor bytes from the profiler's allocation events; CUDA: max_memory_allocated)",
    ]
    for reg in result["regimes"].values():
        lines.append("")
        lines.append(f"[{reg['workload']['name']}] {reg['description']}")
        head = (
            f"{'mode':<24} {'median ms':>10} {'IQR ms':>17} {'min-max ms':>17} "
            f"{'tokens/s':>11} {'vs eager':>8} {'paired':>7} {'peak step mem':>14}"
        )
        lines.append(head)
        for name, m in reg["modes"].items():
            mem = max(r.get("step_peak_bytes", 0) for r in m["peak_memory_per_rank"])
            lines.append(
                f"{name:<24} {m['median_s'] * 1e3:>10.2f} "
                f"{m['q1_s'] * 1e3:>8.2f}-{m['q3_s'] * 1e3:<8.2f} "
                f"{m['min_s'] * 1e3:>8.2f}-{m['max_s'] * 1e3:<8.2f} "
                f"{m['tokens_per_s']:>11,.0f} {m['ratio_to_eager']:>7.2f}x "
                f"{m['paired_ratio_to_eager']:>6.2f}x {_mib(mem):>14}"
            )
        for name, why in reg["skipped"].items():
            lines.append(f"{name:<24} skipped: {why}")
        chk = reg["check"]
        for name, c in chk.items():
            if not isinstance(c, dict):
                continue
            text = f"loss check {name} vs {chk['reference']}: loss {c.get('loss')}"
            if "abs_diff" in c:
                text += f", |diff| {c['abs_diff']:.3g}"
            if "max_rel_grad_diff" in c:
                where = f" ({c['worst_param']})" if c["worst_param"] else ""
                text += f", max rel grad diff {c['max_rel_grad_diff']:.3g}{where}"
            lines.append(text)
        sim = reg["simulation"]
        costs = ", ".join(f"{k}={v * 1e3:.3f}" for k, v in sim["costs_s"].items())
        p2p = sim["p2p"]
        lines.append(
            f"stage costs ms (mean per stage): {costs}; P2P exchange median "
            f"{p2p['median_s'] * 1e6:.0f} us, mean {p2p['mean_s'] * 1e6:.0f} us "
            f"({p2p['over_1ms']:.0%} over 1 ms)"
        )
        meas = sim["measured"]
        rec = meas["recorded_step"]
        lines.append(
            f"measured: median step {meas['median_step_s'] * 1e3:.2f} ms; recorded step "
            f"{rec['makespan_s'] * 1e3:.2f} ms, bubble {rec['bubble_fraction']:.1%}"
        )
        for name, p in sim["predictions"].items():
            lines.append(
                f"simulated ({name}): makespan {p['makespan_s'] * 1e3:.2f} ms "
                f"({p['makespan_s'] / meas['median_step_s']:.2f}x measured), "
                f"bubble {p['bubble_fraction']:.1%}"
            )
    host = result["host_overhead"]
    world = host["world"]
    lines.append("")
    lines.append(
        f"[host overhead] trivial Linear(1,1) stages, M={world['workload']['microbatches']}, "
        f"{world['compute_cells_per_rank']} compute cells per rank"
    )
    for name, per in world["per_action_s"].items():
        lines.append(
            f"{name:<24} {per * 1e6:>8.1f} us per action ({cfg['ranks']} ranks, P2P incl.)"
        )
    one = host.get("one_rank")
    if one:
        lines.append(f"one-rank pipeline, {one['compute_cells']} cells, no P2P (medians):")
        for name, t in one["median_s"].items():
            lines.append(f"  {name:<30} {t * 1e3:>8.3f} ms per step")
        lines.append(
            f"  per action over the nn.Linear bare loop: graphpipe "
            f"{one['graphpipe_overhead_per_action_s'] * 1e6:.1f} us (interpreter "
            f"{one['executor_overhead_per_action_s'] * 1e6:.1f} us + DeferrableLinear "
            f"{one['wsplit_linear_overhead_per_action_s'] * 1e6:.1f} us), torch schedule "
            f"{one['torch_overhead_per_action_s'] * 1e6:.1f} us"
        )
    for name, why in result.get("skipped_regimes", {}).items():
        lines.append(f"regime {name} skipped: {why}")
    return "\n".join(lines)


def _svg_size(svg: str) -> tuple[int, int]:
    m = re.search(r'<svg[^>]*width="(\d+)"[^>]*height="(\d+)"', svg)
    if m is None:
        raise ValueError("render_svg produced an SVG without width/height")
    return int(m.group(1)), int(m.group(2))


def _write_plot(path: str, result: dict[str, Any], world: int) -> Path:
    """Measured timeline above the simulated one, per regime, stacked into one SVG (ms)."""
    from .render import render_svg

    out = Path(path)
    if out.suffix.lower() != ".svg":
        raise SystemExit(f"graphpipe bench: --plot writes SVG; use a .svg path, not {path!r}")
    parts: list[str] = []
    for name, reg in result["regimes"].items():
        actions = [r for r in reg["timeline"] if r["label"] != "step"]
        t0 = min((r["start"] for r in actions), default=0.0)  # time from the first action
        measured = [
            {**r, "start": (r["start"] - t0) * 1e3, "end": (r["end"] - t0) * 1e3} for r in actions
        ]
        parts.append(
            render_svg(
                measured,
                num_ranks=world,
                title=f"[{name}] measured, one step of graphpipe eager (ms)",
            )
        )
        pic = reg.get("_picture")
        if pic is not None:
            sim = [
                {"rank": r.rank, "start": r.start * 1e3, "end": r.end * 1e3, "action": r.action}
                for r in pic.timeline
            ]
            parts.append(
                render_svg(
                    sim,
                    num_ranks=world,
                    title=f"[{name}] simulated: measured stage costs, mean P2P per batch (ms)",
                )
            )
    sizes = [_svg_size(s) for s in parts]
    width = max((w for w, _ in sizes), default=100)
    height = sum(h for _, h in sizes)
    body, y = [], 0
    for svg, (_, h) in zip(parts, sizes, strict=True):
        body.append(svg.replace("<svg ", f'<svg x="0" y="{y}" ', 1))
        y += h
    out.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n' + "".join(body) + "</svg>\n"
    )
    return out


# --------------------------------------------------------------------------------------------
# Command line


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``graphpipe bench`` on the subparsers ``sub``; ``func`` is ``run``."""
    p = sub.add_parser(
        "bench",
        help="step time, tokens/s and memory: graphpipe eager/replay vs torch's DualPipeV",
        description=(
            "Benchmark graphpipe's DualPipeV (eager, and replay when available) against "
            "torch.distributed.pipelining.ScheduleDualPipeV (and DeepSeek's DualPipe where "
            "installed) on the same stages, batch and process group, A/B interleaved. Also "
            "measures the executor's host overhead per action and compares the measured "
            "step with the simulator's prediction from measured F/B/I/W costs. Without "
            "torchrun it spawns --ranks local processes (gloo on CPU, NCCL with --device "
            "cuda, one GPU per rank)."
        ),
    )
    p.add_argument("--ranks", type=_positive, default=2, help="pipeline ranks (default 2)")
    p.add_argument(
        "--microbatches",
        type=_positive,
        default=None,
        metavar="M",
        help="micro-batches per step for every regime (default: overhead 16N, others 4N)",
    )
    p.add_argument(
        "--hidden",
        type=_positive,
        default=None,
        metavar="H",
        help="model width for every regime (default: overhead 32, compute 1024, realistic 128)",
    )
    p.add_argument(
        "--mb-rows",
        type=_positive,
        default=None,
        metavar="R",
        help="rows per micro-batch for every regime (default: overhead 2, compute 32)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=_positive, default=20, help="timed steps per mode (default 20)")
    p.add_argument(
        "--warmup", type=_non_negative, default=3, help="untimed rounds first (default 3)"
    )
    p.add_argument(
        "--regime",
        choices=_REGIME_CHOICES,
        default="both",
        help="overhead: small hidden, many tiny micro-batches; compute: wide MLP; realistic: "
        "the built-in Llama; sweep: micro-batch sizes on CUDA; both: overhead + compute "
        "(+ sweep on CUDA); all: every regime (default both)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw the measured per-rank timeline of one step next to the simulated one (.svg)",
    )
    p.set_defaults(func=run)
    return p


def _check(args: argparse.Namespace) -> None:
    m = args.microbatches
    if m is not None and m < 2 * args.ranks:
        raise SystemExit(
            f"graphpipe bench: --microbatches must be >= 2 * --ranks = {2 * args.ranks}, got {m}"
        )
    if args.plot and Path(args.plot).suffix.lower() != ".svg":
        raise SystemExit(f"graphpipe bench: --plot writes SVG; use a .svg path, not {args.plot!r}")


def run(args: argparse.Namespace) -> int:
    """``graphpipe bench``: spawn (or join torchrun's) ranks, print the table, write JSON.

    ``--device cuda`` without CUDA skips the whole benchmark with a note (and a JSON holding
    only ``skipped``) and returns 0: the GPU figures exist only where a GPU does.
    """
    from .launch import joined_torchrun, launch

    if args.device == "cuda" and not torch.cuda.is_available():
        why = "--device cuda was asked for, but CUDA is not available"
        _say(f"skipped: {why}")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": why}, indent=2))
        return 0
    if not joined_torchrun():
        _check(args)
    opts = {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
    opts["command_line"] = " ".join(sys.argv)
    launch(_bench_rank, args.ranks, args.device, opts)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m graphpipe.bench ARGS``: the same as ``graphpipe bench ARGS``."""
    parser = argparse.ArgumentParser(prog="graphpipe")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
