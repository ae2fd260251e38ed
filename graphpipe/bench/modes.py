"""The contenders: graphpipe eager and replay, torch's ``ScheduleDualPipeV``, DeepSeek's
DualPipeV. Each is a ``Mode`` with ``run_step(inputs, labels)`` on the same stages."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .regimes import Workload

__all__ = [
    "MODES",
    "MODE_DUALPIPE",
    "MODE_EAGER",
    "MODE_REPLAY",
    "MODE_TORCH",
    "TORCH_ON_GLOO_MIN",
    "Mode",
    "build_modes",
    "torch_schedule_unavailable",
]

MODE_EAGER = "graphpipe eager"
MODE_REPLAY = "graphpipe replay"
MODE_TORCH = "torch ScheduleDualPipeV"
MODE_DUALPIPE = "DeepSeek DualPipeV"
MODES = (MODE_EAGER, MODE_REPLAY, MODE_TORCH, MODE_DUALPIPE)


@dataclass
class Mode:
    """One contender: its local stages, its step function, and how to reset gradients.

    run_step: ``(inputs, labels) -> loss`` (the labels and inputs only matter on rank 0).
    pipe: graphpipe's ``DualPipeV`` (for the timeline recording and ``close``), else None.
    set_to_none: False for graphpipe replay, whose captured step accumulates into the static
    ``.grad`` tensors (it must keep them).
    """

    name: str
    modules: tuple[nn.Module, ...]
    run_step: Callable[[Any, Any], Any]
    pipe: Any = None
    set_to_none: bool = True

    def zero_grad(self) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=self.set_to_none)

    def step(self, x: Any, y: Any) -> Any:
        self.zero_grad()
        return self.run_step(x, y)

    def close(self) -> None:
        """Release captured graphs (before the process group goes)."""
        if self.pipe is not None:
            self.pipe.close()


def _graphpipe_mode(
    name: str, stages: tuple[nn.Module, ...], w: Workload, group: Any, **extra: Any
) -> Mode:
    from graphpipe.runtime.pipeline import DualPipeV

    pipe = DualPipeV(
        stages, num_microbatches=w.microbatches, loss_fn=w.loss_fn(), group=group, **extra
    )
    return Mode(name, stages, pipe.step, pipe, set_to_none=not extra.get("capture", False))


def _torch_mode(
    stages: tuple[nn.Module, ...],
    w: Workload,
    rank: int,
    world: int,
    device: torch.device,
    group: Any,
) -> Mode:
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

    return Mode(MODE_TORCH, stages, step)


# torch's ScheduleDualPipeV warms up its P2P at the first step: before 2.12 every stage sends
# one element to its neighbour stages (``_get_init_p2p_neighbors_ops``), also where the
# neighbour is on the same rank (stages 1 and 2 of a two-rank V, stages 0 and 1 of a one-rank
# one), and gloo has no pair from a rank to itself ("Pair is not connected"); from 2.12 a
# PipelineStage warms up through a vote that hands same-rank neighbours the value directly.
TORCH_ON_GLOO_MIN = (2, 12)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_schedule_unavailable(backend: str, version: str = torch.__version__) -> str | None:
    """Why torch's ``ScheduleDualPipeV`` cannot run on ``backend`` with torch ``version``, or
    None when it can."""
    if backend == "gloo" and _version(version) < TORCH_ON_GLOO_MIN:
        want = ".".join(map(str, TORCH_ON_GLOO_MIN))
        return (
            f"torch < {want} cannot run ScheduleDualPipeV on gloo (torch {version}: its "
            "start-up sends from a rank to itself, which gloo refuses)"
        )
    return None


def _dualpipe_mode(stages: tuple[nn.Module, ...], w: Workload, rank: int, group: Any) -> Mode:
    """DeepSeek's DualPipeV (``import dualpipe``); its P2P buffers are CUDA tensors."""
    import dualpipe

    _, inputs, _ = w.stage_inputs(2, torch.device("cpu"))
    act = inputs[1]  # the stage-to-stage activation
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

    return Mode(MODE_DUALPIPE, stages, step)


def _dualpipe_unavailable(device: torch.device) -> str | None:
    try:
        import dualpipe  # noqa: F401
    except ImportError:
        return "the dualpipe package is not installed"
    if device.type != "cuda":
        return "DeepSeek's DualPipe allocates its P2P buffers on CUDA"
    return None


def build_modes(
    w: Workload,
    rank: int,
    world: int,
    device: torch.device,
    group: Any,
    only: Collection[str] = MODES,
) -> tuple[list[Mode], dict[str, str]]:
    """The contenders named in ``only`` (in ``MODES`` order, graphpipe eager first), each on
    fresh copies of the same stages, and the unavailable ones with the reason."""
    skipped: dict[str, str] = {}
    if MODE_DUALPIPE in only and (why := _dualpipe_unavailable(device)) is not None:
        skipped[MODE_DUALPIPE] = why
    backend = dist.get_backend(group)
    if MODE_TORCH in only and (why := torch_schedule_unavailable(backend)) is not None:
        skipped[MODE_TORCH] = why
    make: dict[str, Callable[[tuple[nn.Module, ...]], Mode]] = {
        MODE_EAGER: lambda s: _graphpipe_mode(MODE_EAGER, s, w, group),
        MODE_REPLAY: lambda s: _graphpipe_mode(MODE_REPLAY, s, w, group, capture=True),
        MODE_TORCH: lambda s: _torch_mode(s, w, rank, world, device, group),
        MODE_DUALPIPE: lambda s: _dualpipe_mode(s, w, rank, group),
    }
    modes = [
        make[name](w.local_stages(rank, world, device))
        for name in MODES
        if name in only and name not in skipped
    ]
    return modes, skipped
