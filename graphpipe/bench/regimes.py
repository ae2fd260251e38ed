"""The benchmarked models and workloads: stage modules, ``Workload`` and the regimes.

Not named ``workloads``: the package exports the function ``workloads`` (imported on first
use), which a submodule of that name would replace in the package's namespace once imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .options import REGIME_CHOICES, REGIMES

__all__ = [
    "REGIMES",
    "REGIME_CHOICES",
    "MLPStage",
    "TinyStage",
    "Workload",
    "host_workload",
    "mse_loss",
    "workloads",
]


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
    threads: intra-op threads per rank while it runs (None: the launcher's, the cores over
        the ranks). The overhead regime takes 1: its operations are too small for threads to
        help, and the fork-join of a second thread adds a fixed cost to each of them
        (docs/benchmarks.md), which would hide the host work the regime measures.
    """

    name: str
    model: str
    hidden: int
    microbatches: int
    mb_rows: int
    seq_len: int = 1
    seed: int = 0
    threads: int | None = None

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
        threads = f"; {self.threads} thread(s) per rank" if self.threads is not None else ""
        return (
            f"{world} ranks x 2 stages of {what}; M={self.microbatches} micro-batches of "
            f"{self.mb_rows} rows ({self.tokens_per_step} tokens per step){threads}"
        )

    def all_stages(self, num_stages: int, device: torch.device) -> list[nn.Module]:
        """Every stage of the model, deterministic in ``seed`` (same on every rank)."""
        if self.model == "llama":
            from graphpipe.models import LlamaConfig, build_stages

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

    def stage_inputs(
        self, num_stages: int, device: torch.device
    ) -> tuple[list[nn.Module], list[Any], Any]:
        """All stages, the input of each stage for micro-batch 0, and its labels."""
        stages = self.all_stages(num_stages, device)
        x, y = self.batch(device)
        h = x[: self.mb_rows]
        inputs = []
        with torch.no_grad():
            for s in stages:
                inputs.append(h)
                h = s(h)
        return stages, inputs, y[: self.mb_rows]

    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        if self.model == "llama":
            from graphpipe.models import LlamaLoss

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


def host_workload(microbatches: int, name: str = "host") -> Workload:
    """Trivial ``Linear(1, 1)`` stages, one row per micro-batch: everything but compute."""
    return Workload(name, "tiny", 1, microbatches, 1)


def workloads(
    regime: str,
    world: int,
    device: str,
    *,
    hidden: int | None = None,
    microbatches: int | None = None,
    mb_rows: int | None = None,
) -> tuple[list[Workload], dict[str, str]]:
    """The workloads of ``regime`` (one of ``REGIME_CHOICES``) for ``world`` ranks, with
    ``hidden`` / ``microbatches`` / ``mb_rows`` overriding every regime's default, and the
    regimes skipped on ``device`` with the reason."""
    n = world
    wanted = {"both": ["overhead", "compute", "sweep"], "all": list(REGIMES)}.get(regime, [regime])
    out: list[Workload] = []
    skipped: dict[str, str] = {}

    def make(
        name: str, model: str, h: int, m: int, rows: int, seq: int = 1, threads: int | None = None
    ) -> Workload:
        return Workload(
            name, model, hidden or h, microbatches or m, mb_rows or rows, seq, threads=threads
        )

    for name in wanted:
        if name == "overhead":
            out.append(make("overhead", "mlp", 32, 16 * n, 2, threads=1))
        elif name == "compute":
            out.append(make("compute", "mlp", 1024, 4 * n, 32))
        elif name == "realistic":
            out.append(make("realistic", "llama", 128, 4 * n, 2, seq=64))
        elif name == "sweep":
            if device != "cuda":
                if regime == "sweep":
                    skipped["sweep"] = "needs --device cuda (launch-bound vs compute-bound GPU)"
                continue
            for rows in (1, 8, 64, 512):
                out.append(make(f"sweep-{rows}", "mlp", 1024, 4 * n, rows))
    return out, skipped
