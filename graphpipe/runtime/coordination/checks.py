"""The checks of ``Pipeline``'s arguments, and what it infers from its stages.

Every check raises before anything is built, with a message that names the offending value,
so that a bad argument costs nothing (no process group, no swapped ``nn.Linear``).

Owns: nothing (pure functions). May touch: the arguments it checks, read-only.
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.meta import is_dtensor
from graphpipe.roles import ExpertGroups, expert_parallel_size
from graphpipe.schedule.lower import RECEIVES

__all__ = [
    "CAPTURE_MODES",
    "LOSS_REDUCTIONS",
    "check_arguments",
    "check_capture",
    "check_capture_optimizer",
    "check_disjoint_groups",
    "check_expert_groups",
    "check_stages",
    "float_dtype",
    "infer_device",
    "loss_dtype",
    "resolve_receives",
    "seconds",
]

CAPTURE_MODES = {False: None, True: "step", "step": "step", "action": "action"}


LOSS_REDUCTIONS = ("mean", "sum")


def check_arguments(
    num_microbatches: Any, loss_fn: Any, capture: Any, loss_reduction: Any = "mean"
) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise TypeError(
            f"num_microbatches must be an int, got {type(num_microbatches).__name__} "
            f"{num_microbatches!r}"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if capture not in CAPTURE_MODES:
        raise ValueError(f"capture must be False, True, 'step' or 'action', got {capture!r}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")


def resolve_receives(receives: Any, nccl: bool) -> str:
    """``Pipeline(receives=...)``: the value, or the backend's default ("start" on gloo, where a
    send that comes before its receive waits for a hop through the sender's device thread;
    "timed" on NCCL, where receive buffers then live shorter)."""
    if receives is None:
        return "timed" if nccl else "start"
    if receives not in RECEIVES:
        raise ValueError(f"receives must be one of {RECEIVES} or None, got {receives!r}")
    return receives


def check_stages(stages: Any, stage_ids: Sequence[int], rank: int, schedule_name: str) -> None:
    """``stages`` must be one ``nn.Module`` per stage this rank runs, in order."""
    want = len(stage_ids)
    if (
        isinstance(stages, nn.Module)
        or len(stages) != want
        or not all(isinstance(s, nn.Module) for s in stages)
    ):
        got = (
            [type(s).__name__ for s in stages]
            if not isinstance(stages, nn.Module)
            else [type(stages).__name__]
        )
        raise ValueError(
            f"rank {rank} runs stages {list(stage_ids)} of the {schedule_name} schedule: "
            f"stages must be {want} nn.Modules in that order, got {got}"
        )


def check_capture_optimizer(
    optimizer: torch.optim.Optimizer | None, capture: Any, device: torch.device
) -> None:
    if optimizer is None:
        return
    if capture is False:
        raise ValueError("capture_optimizer needs capture=True, 'step' or 'action'")
    name = type(optimizer).__name__
    if optimizer.defaults.get("capturable") is False:
        if device.type == "cuda":
            raise ValueError(
                f"capture_optimizer {name} must be created with capturable=True to run "
                "inside a CUDA graph"
            )
        raise ValueError(
            f"capture_optimizer {name} reads its step count on the host (.item()) unless "
            "capturable=True, which torch supports on CUDA only: a graph on the CPU cannot "
            "hold its step. Pass an optimizer whose step stays on tensors (torch.optim.SGD), "
            "or call its step() after pipe.step() (capture_optimizer=None)"
        )


def check_capture(
    mode: str | None,
    device: torch.device,
    nccl: bool,
    num_ranks: int,
    receives: str,
    modules: Sequence[nn.Module],
) -> None:
    """What a capture of ``mode`` cannot hold on this device and backend: ``ValueError``
    naming it (a compiled stage on CPU: a warning)."""
    if mode is None:
        return
    if device.type == "cuda" and num_ranks > 1 and not nccl:
        raise ValueError(
            f"capture={mode!r} on CUDA over a gloo pipeline group: a CUDA graph cannot hold "
            "gloo's operations; build the pipeline's group with the nccl backend"
        )
    if nccl and os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0":
        raise ValueError(
            f"capture={mode!r} with NCCL_GRAPH_MIXING_SUPPORT=0: the captured step uses the "
            "same communicators as eager operations (the first steps, forward(); with "
            "capture='action' the P2P between the graphs), which NCCL then does not support; "
            "unset it (NCCL's default is 1)"
        )
    if mode == "action" and nccl and receives != "timed":
        raise ValueError(
            f"capture='action' on NCCL with receives={receives!r}: the receives would stay "
            "posted across the per-action graphs, each rank capturing while its peers' "
            "transfers are in flight; pass receives='timed' (NCCL's default), or "
            "capture='step'"
        )
    if device.type == "cpu":
        dynamo = sys.modules.get("torch._dynamo.eval_frame")
        compiled = getattr(dynamo, "OptimizedModule", None)
        found = [
            type(getattr(m, "_orig_mod", m)).__name__
            for stage in modules
            for m in stage.modules()
            if compiled is not None and isinstance(m, compiled)
        ]
        if found:
            warnings.warn(
                f"graphpipe: capture={mode!r} on CPU with torch.compile'd modules "
                f"({', '.join(sorted(set(found)))}): the CPU graph records operations at "
                "torch's dispatcher, which compiled code does not run through, so they run "
                "uncompiled inside the captured step (the same values up to rounding); on "
                "CUDA the graph captures the compiled kernels",
                UserWarning,
                stacklevel=3,
            )


def seconds(timeout: float | datetime.timedelta) -> float:
    """``timeout`` in seconds (a positive number or a ``timedelta``)."""
    value = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(value)


def infer_device(modules: Sequence[nn.Module], group: dist.ProcessGroup | None) -> torch.device:
    """The device of the first parameter; without parameters, the process group's."""
    for mod in modules:
        for p in mod.parameters():
            return p.device
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def float_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of the module's first floating-point parameter (None without one)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def loss_dtype(modules: Sequence[nn.Module]) -> torch.dtype:
    """The loss rank's choice, from its parameters (the other ranks learn it in the batch
    agreement, whatever their own parameters are)."""
    for mod in modules:
        for p in mod.parameters():
            if p.is_floating_point():
                return torch.promote_types(p.dtype, torch.float32)
    return torch.float32


def check_expert_groups(modules: Sequence[nn.Module], expert_groups: Any) -> Any:
    """``expert_groups`` (None, or ``(ep_group, expert_dp_group)``), checked against the
    experts' own group size: sharded experts need it, and the sizes must agree."""
    ep = expert_parallel_size(modules)  # 0: no expert parameter on this rank
    if expert_groups is None:
        if ep > 1:
            raise ValueError(
                f"the stages' experts are sharded over an ep group of {ep} ranks: pass "
                "expert_groups=graphpipe.models.expert_parallel_groups(ep, dp_group)"
            )
        return None
    groups = ExpertGroups(*expert_groups)
    size = dist.get_world_size(groups.ep_group) if groups.ep_group is not None else 1
    if ep and size != ep:
        raise ValueError(
            f"expert_groups.ep_group has {size} ranks, but the stages' experts are sharded "
            f"over {ep}"
        )
    return groups


def _stage_mesh_groups(modules: Sequence[nn.Module]) -> list[tuple[str, Any]]:
    """``(name, group)`` of every dim of every ``DeviceMesh`` the stages' DTensor parameters
    and buffers live on (tensor parallel, FSDP2), each once."""
    out: list[tuple[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    for li, mod in enumerate(modules):
        for name, t in [*mod.named_parameters(), *mod.named_buffers()]:
            if not is_dtensor(t):
                continue
            mesh = t.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim {d}" for d in range(mesh.ndim))
            for d in range(mesh.ndim):
                if (id(mesh), d) in seen:
                    continue
                seen.add((id(mesh), d))
                what = f"the mesh dim {names[d]!r} of local stage {li}'s {name}"
                out.append((what, mesh.get_group(d)))
    return out


def check_disjoint_groups(
    modules: Sequence[nn.Module],
    global_ranks: Sequence[int],
    rank: int,
    dp_group: Any,
    expert_groups: Any,
) -> None:
    """Every other process group the pipeline's parts run collectives on (``dp_group``, the
    expert groups, the mesh dims of DTensor stages: tensor parallel, FSDP2) must hold no
    rank of this pipeline but this one: a group that overlaps the pipeline group would have
    two pipeline ranks, busy with different actions, enter one collective, and the step
    would deadlock. Raises ``ValueError`` naming the group, its ranks and the pipeline's,
    before any collective (the ranks are read locally)."""
    pipeline = list(global_ranks)
    me = pipeline[rank]
    groups: list[tuple[str, Any]] = [("dp_group", dp_group)]
    if expert_groups is not None:
        eg = ExpertGroups(*expert_groups)
        groups += [("expert_groups.ep_group", eg.ep_group)]
        groups += [("expert_groups.expert_dp_group", eg.expert_dp_group)]
    groups += _stage_mesh_groups(modules)
    for what, group in groups:
        if group is None:
            continue
        members = dist.get_process_group_ranks(group)
        shared = sorted(set(members) & set(pipeline) - {me})
        if shared:
            raise ValueError(
                f"{what} overlaps the pipeline group: its global ranks {sorted(members)} "
                f"include pipeline ranks {shared} besides this one (global rank {me}); the "
                f"pipeline's global ranks are {pipeline}. A group beside the pipeline must "
                "join one rank of each pipeline, e.g. a DeviceMesh ('pp', 'tp') with "
                "group=mesh.get_group('pp') and the stages on mesh['tp']"
            )
