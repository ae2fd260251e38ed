"""Small stage models shared by the runtime tests, and the single-process reference."""

from __future__ import annotations

import torch
from torch import nn

from graphpipe.roles import unique_parameters


class Block(nn.Module):
    """A residual MLP stage: LayerNorm (a non-Linear parameter), two Linears, tanh.

    tuple_io: stages pass ``(h, side)`` tuples between them instead of one tensor.
    """

    def __init__(self, dim: int, index: int, num_stages: int, tuple_io: bool = False) -> None:
        super().__init__()
        self.index, self.num_stages, self.tuple_io = index, num_stages, tuple_io
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None):
        h = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        if side is not None:
            h = h + 0.5 * side
        if self.tuple_io and self.index < self.num_stages - 1:
            return h, torch.sin(h)
        return h


def build_stages(
    num_stages: int,
    dim: int = 8,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    tuple_io: bool = False,
    tied: bool = False,
) -> list[nn.Module]:
    """All stages of the test model, deterministic in ``seed``.

    tied: stage 0's ``fc1`` weight and the last stage's ``fc1`` weight are one Parameter
    (both live on rank 0 under DualPipeV).
    """
    g = torch.Generator().manual_seed(seed)
    stages = []
    for i in range(num_stages):
        block = Block(dim, i, num_stages, tuple_io).to(dtype)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.3)
        stages.append(block)
    if tied and num_stages > 1:
        stages[-1].fc1.weight = stages[0].fc1.weight
    return stages


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def local_stages(stages: list[nn.Module], rank: int, num_ranks: int) -> tuple[nn.Module, nn.Module]:
    return stages[rank], stages[2 * num_ranks - 1 - rank]


def reference(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    """One process runs every stage on the whole batch: (loss, grads by (stage, name), out)."""
    h = x
    for s in stages:
        h = s(*h) if isinstance(h, tuple) else s(h)
    loss = mse(h, y)
    loss.backward()
    grads = {
        (i, name): p.grad.clone()
        for i, s in enumerate(stages)
        for name, p in s.named_parameters(remove_duplicate=False)
    }
    return loss.detach(), grads, h.detach()


def batch(num_rows: int, dim: int = 8, seed: int = 1, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_rows, dim, generator=g, dtype=dtype),
        torch.randn(num_rows, dim, generator=g, dtype=dtype),
    )


def params(stages) -> list[torch.nn.Parameter]:
    return [p for s in stages for p in s.parameters()]


unique_params = unique_parameters
"""The parameters of ``stages``, a tied one once (what an optimizer or a clip takes)."""


def twin_diffs(eager, eager_stages, captured, captured_stages, x, y) -> dict[str, float]:
    """One step of an eager and a captured pipeline on the same batch (grads zeroed in place
    first); the largest absolute difference of the loss and of each parameter's gradient,
    0.0 exactly where the two are bitwise equal (``torch.equal``)."""
    for s in (*eager_stages, *captured_stages):
        s.zero_grad(set_to_none=False)
    le = eager.step(x, y)
    lc = captured.step(x, y).clone()
    if le.is_cuda:
        torch.cuda.synchronize()

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return 0.0 if torch.equal(a, b) else float((a.double() - b.double()).abs().max())

    out = {"loss": diff(le, lc)}
    for i, (a, b) in enumerate(zip(params(eager_stages), params(captured_stages))):
        out[f"grad of parameter {i}"] = diff(a.grad, b.grad)
    return out


def twin_step(eager, eager_stages, captured, captured_stages, x, y) -> list[str]:
    """``twin_diffs``, as the list of what differs bitwise (empty: all equal)."""
    diffs = twin_diffs(eager, eager_stages, captured, captured_stages, x, y)
    return [f"{name}: max diff {d!r}" for name, d in diffs.items() if d != 0.0]


class Checkpointed(nn.Module):
    """``inner`` under non-reentrant activation checkpointing (its forward is recomputed
    during the backward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=False)
