"""torchtitan's pipeline parallelism on graphpipe: ``pipelining_fn`` for a model spec.

torchtitan's ``Trainer`` reaches its pipeline through two calls only: the model spec's
``pipelining_fn(model, parallel_dims=, training=, parallelism=, ...)`` returns
``(schedule, model_parts, has_first_stage, has_last_stage)``, and the training loop calls
``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=,
return_outputs=False)`` (``schedule.eval(...)`` in validation). This ``pipelining_fn``
splits the model with torchtitan's own ``pipeline_llm`` (module FQNs unchanged, SPMD
parallelisms and compilation applied per part by the spec's ``parallelize_fn``: the
optimizer, LR scheduler, checkpoints and metrics keep working), and returns, in place of
torch's schedule, a ``graphpipe.integrations.torch_pipelining.PipelineSchedule`` over the same
``PipelineStage`` objects: graphpipe's runtime, its F&B overlap, and with ``capture`` the
static step (CUDA graphs on GPU).

Set it in a config module (``--module M --config F`` on torchtitan's command line)::

    import functools
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from graphpipe.integrations.torchtitan import pipelining_fn

    def graphpipe_debugmodel():
        config = llama3_debugmodel()
        config.model_spec.pipelining_fn = functools.partial(pipelining_fn, capture="step")
        return config

The schedule (``parallelism.pipeline_parallel_schedule``): ``DualPipeV``, ``ZBVZeroBubble``,
``1F1B`` and ``GPipe`` run graphpipe's own generators; any other multi-stage schedule
(``Interleaved1F1B``, ``InterleavedZeroBubble``, a CSV in
``pipeline_parallel_schedule_csv``) runs the compute order torch's class generated, read from
its ``pipeline_order``. Data parallelism (``dp_shard``, ``dp_replicate``: FSDP2 / HSDP applied
by the spec's ``parallelize_fn``) and tensor parallelism run with ``--parallelism.spmd_backend
partial_dtensor``: graphpipe's pipeline takes the ``batch`` mesh as its ``dp_group`` and FSDP2
reduces each stage's gradients once per step; the DTensor hidden states of tensor parallelism
cross the pipeline's edges as their local shards (``_TensorParallelEdges``); expert parallelism
(``ep``, MoE models) runs inside the stages as torchtitan applies it. Refused with a
``ValueError`` naming them: context parallelism, data, tensor or expert parallelism under
another SPMD backend, and ``backward_requires_autograd=False``.

torchtitan is an optional dependency: ``pip install 'graphpipe[torchtitan]'``; this module
imports it when ``pipelining_fn`` is called.

Owns: nothing. May touch: what torchtitan's ``pipeline_llm`` touches (the model it splits),
and hooks on its parts' modules (``_TensorParallelEdges``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphpipe.meta import is_dtensor
from graphpipe.schedule.ir import KINDS, Action
from graphpipe.weightgrad import switch_linears

from .torch_pipelining import PipelineSchedule

__all__ = ["SCHEDULES", "pipelining_fn"]

SCHEDULES = {
    **{kind.torch_name: name for name, kind in KINDS.items() if kind.torch_name},
    "GPipe": "gpipe",  # a single-stage schedule of integrations.torch_pipelining
}
"""torchtitan's schedule names that graphpipe generates itself (others: torch's order)."""


def _torch_order(torch_schedule: Any) -> dict[int, list[Action]]:
    """The compute order torch's multi-stage schedule generated (its ``pipeline_order``, idle
    steps dropped), as graphpipe actions."""
    order = getattr(torch_schedule, "pipeline_order", None)
    if not order:
        raise ValueError(
            f"torch's {type(torch_schedule).__name__} has no pipeline_order to run; use one of "
            f"{sorted(SCHEDULES)}"
        )
    return {
        rank: [Action.parse(str(a)) for a in actions if a is not None]
        for rank, actions in order.items()
    }


def _dp_group(parallel_dims: Any) -> Any:
    """The process group of the data-parallel replicas of this rank's stages: torchtitan's
    ``batch`` mesh (``dp_replicate x dp_shard``) when it has more than one rank, else the
    (one-rank) mesh dimension FSDP shards over (its name varies with the SPMD backend)."""
    names = ("batch",) if parallel_dims.dp_replicate * parallel_dims.dp_shard > 1 else ()
    for name in (*names, "fsdp", "dp_shard", "dp"):
        try:
            return parallel_dims.get_mesh(name).get_group()
        except (ValueError, KeyError, RuntimeError):
            continue
    raise ValueError("graphpipe found no batch / fsdp / dp_shard / dp mesh in parallel_dims")


def _degrees(parallel_dims: Any, names: tuple[str, ...]) -> dict[str, int]:
    """``{name: degree}`` of the parallelisms ``names`` that are on (not 1; -1: inferred)."""
    degrees = {name: getattr(parallel_dims, name, 1) for name in names}
    return {name: d for name, d in degrees.items() if d not in (1, -1)}


def _refuse_unsupported(parallel_dims: Any, parallelism: Any) -> None:
    """What this integration does not run exactly (or has not been shown to), by name."""
    others = _degrees(parallel_dims, ("cp",))
    if others:
        raise ValueError(
            f"graphpipe's torchtitan pipelining_fn runs pipeline parallelism with data "
            f"(dp_shard, dp_replicate), tensor and expert parallelism; this job also has "
            f"{others}: graphpipe has no context parallelism"
        )
    degrees = _degrees(parallel_dims, ("dp_replicate", "dp_shard", "tp", "ep"))
    backend = getattr(parallelism, "spmd_backend", "partial_dtensor")
    if degrees and backend != "partial_dtensor":
        raise ValueError(
            f"graphpipe's torchtitan pipelining_fn with {degrees} needs "
            f"--parallelism.spmd_backend partial_dtensor, got {backend!r}: the stages are "
            "then sharded over the data-parallel and tensor-parallel meshes with DTensor, "
            f"the composition graphpipe's tests compare with torch's schedule ({backend!r} "
            "shards on the full SPMD mesh, where torchtitan 0.3.0's own pipeline run fails "
            "on CPU)"
        )


class _TensorParallelEdges:
    """Pipeline edges for stages whose hidden states are DTensors (torchtitan's decoder under
    tensor parallelism with ``spmd_backend="partial_dtensor"``): its layers pass them on the
    tp mesh in one layout, ``Shard(1)`` (the sequence) with sequence parallelism, else
    ``Replicate()``. An edge carries plain tensors, so each stage but the last sends its
    output's local shard (``to_local``), after checking that the output has that layout on
    that mesh (a ``ValueError`` naming the stage and the placements otherwise, before
    anything is sent), and each stage but the first rebuilds the DTensor from the shard it
    received (``DTensor.from_local``). The gradients cross the same edges back through those
    two functions' autograd. A DTensor loss becomes a plain one with ``full_tensor``.

    Owns: the hooks it registers on the stages' modules. May touch: nothing else.
    """

    def __init__(self, mesh: Any, sequence_parallel: bool) -> None:
        from torch.distributed.tensor import Replicate, Shard

        self.mesh = mesh
        self.layout = (Shard(1),) if sequence_parallel else (Replicate(),)

    def install(self, stages: list[Any]) -> None:
        """Hooks on each ``PipelineStage``'s module: a send of the local shard after every
        stage but the last, a rebuild of the DTensor before every stage but the first."""
        for st in stages:
            if st.stage_index != st.num_stages - 1:
                st.submod.register_forward_hook(functools.partial(self.send, st.stage_index))
            if st.stage_index != 0:
                st.submod.register_forward_pre_hook(
                    functools.partial(self.receive, st.stage_index), with_kwargs=True
                )

    def send(self, stage: int, module: nn.Module, args: Any, out: Any) -> Any:
        """A forward hook: the output's local shard, in the edges' layout."""
        if not is_dtensor(out):
            raise TypeError(
                f"stage {stage}'s output is a {type(out).__name__}, not the DTensor on the tp "
                "mesh the other stages receive"
            )
        placements, dims = tuple(out.placements), out.device_mesh.mesh_dim_names
        if placements != self.layout or dims != self.mesh.mesh_dim_names:
            raise ValueError(
                f"stage {stage}'s output has placements {placements} on mesh {dims}, but the "
                f"pipeline's edges carry {self.layout} on mesh {self.mesh.mesh_dim_names}: "
                "the next stage would read its shards in the wrong layout"
            )
        for p in placements:
            dim = getattr(p, "dim", None)
            if dim is not None and out.shape[dim] % self.mesh.size():
                raise ValueError(
                    f"stage {stage}'s output {list(out.shape)} is sharded unevenly on dim "
                    f"{dim} over {self.mesh.size()} tp ranks: the next stage could not "
                    "rebuild its shape from the shard it receives"
                )
        return out.to_local()

    def receive(self, stage: int, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """A forward pre-hook: the received shard (the first argument) as the DTensor."""
        from torch.distributed.tensor import DTensor

        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            got = "nothing" if not args else type(args[0]).__name__
            if args and isinstance(args[0], torch.Tensor):
                got = f"a {args[0].dtype} tensor"
            raise TypeError(
                f"stage {stage} under tensor parallelism takes the previous stage's hidden "
                f"states (a floating-point shard) first, got {got}"
            )
        h = DTensor.from_local(args[0], self.mesh, self.layout, run_check=False)
        return (h, *args[1:]), kwargs


def pipelining_fn(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
    device: torch.device,
    model_config: Any,
    parallelize_fn: Callable[..., nn.Module],
    loss_fn: Callable[..., Any],
    capture: str | None = None,
    **options: Any,
) -> tuple[PipelineSchedule, list[nn.Module], bool, bool]:
    """torchtitan's ``pipelining_fn`` contract, run by graphpipe (see the module doc).

    ``capture``: None (eager), ``"step"`` or ``"action"`` (``Pipeline(capture=...)``).
    ``options``: further ``graphpipe.Pipeline`` keyword arguments (``receives``,
    ``timeout``, ``defer_weight_grads``, ...).

    Returns ``(schedule, model_parts, has_first_stage, has_last_stage)`` as torchtitan's own
    ``pipeline_llm`` does; ``schedule.step`` / ``schedule.eval`` take torchtitan's pre-split
    arguments, append each micro-batch's loss (``loss_fn(...)[0]``, already divided by
    ``global_valid_tokens``) to ``losses`` on the last stage's rank, and do not scale the
    gradients (torchtitan's ``scale_grads=False``).
    """
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    _refuse_unsupported(parallel_dims, parallelism)

    defer = options.get("defer_weight_grads", True)

    def parallelize_deferrable(part: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        # torchtitan's Module.parallelize wraps each layer's forward on the instance (the
        # wrapper calls the bound forward it found): the Linears become DeferrableLinear
        # first, so that the wrapper calls DeferrableLinear.forward and W finds its work.
        if defer:
            switch_linears(part)
        return parallelize_fn(part, *args, **kwargs)

    torch_schedule, model_parts, has_first, has_last = pipeline_llm(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac_config,
        dump_folder=dump_folder,
        device=device,
        model_config=model_config,
        parallelize_fn=parallelize_deferrable,
        loss_fn=loss_fn,
    )
    # torch's schedule objects keep their stages as _stages (multi-stage) or _stage.
    stages = getattr(torch_schedule, "_stages", None) or [torch_schedule._stage]
    name = parallelism.pipeline_parallel_schedule
    csv = getattr(parallelism, "pipeline_parallel_schedule_csv", None)
    schedule: Any = SCHEDULES.get(name) if not csv else None
    if schedule is None:
        schedule = _torch_order(torch_schedule)

    def scalar_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss, _ = loss_fn(*args, **kwargs)  # torchtitan's losses return (loss, extra)
        return loss.full_tensor() if is_dtensor(loss) else loss

    # torchtitan's parallelize_fn applies FSDP2 to every part, also unsharded (for its mixed
    # precision policy), with a gradient divide factor of 1.0 (its loss is divided by the
    # global token count): graphpipe takes the replicas' group, FSDP2 sums over it.
    if getattr(parallel_dims, "fsdp_enabled", False) or any(
        type(m).__name__.startswith("FSDP") for m in model_parts
    ):
        options.setdefault("dp_group", _dp_group(parallel_dims))
    if getattr(parallel_dims, "tp", 1) > 1:
        _TensorParallelEdges(
            parallel_dims.get_mesh("tp"), getattr(parallelism, "enable_sequence_parallel", True)
        ).install(stages)
    ours = PipelineSchedule(
        stages,
        torch_schedule._n_microbatches,
        scalar_loss,
        scale_grads=False,
        schedule=schedule,
        capture=capture or False,
        **options,
    )
    ours._torch_name = f"graphpipe's {name}"
    return ours, model_parts, has_first, has_last
