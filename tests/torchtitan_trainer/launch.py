"""Runs torchtitan's train main on CPU: the shims torchtitan 0.3.0 needs there, applied at
import, no torchtitan file edited (tests/test_torchtitan_trainer.py starts it with torchrun).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as fa
from torch.distributed.pipelining import PipelineStage, schedules


class _CpuDevice:
    """torch.cpu plus the device queries torchtitan's metrics and Trainer make (torchtitan
    falls back to torch.cuda without an accelerator); memory figures are zeros on CPU."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device=None):
        return types.SimpleNamespace(total_memory=1 << 30, name="cpu")

    def reset_peak_memory_stats(self, *args) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, *args) -> dict:
        return {
            "active_bytes.all.peak": 0,
            "reserved_bytes.all.peak": 0,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def max_memory_allocated(self, *args) -> int:
        return 0

    def max_memory_reserved(self, *args) -> int:
        return 0

    def set_device(self, *args) -> None:
        pass


import torchtitan.trainer  # noqa: E402, F401  (imports every module that reads device_type)
from torchtitan.models.common import attention  # noqa: E402

# torchtitan picks "cuda" (and torch.cuda) without an accelerator, in each module at import.
_cpu = _CpuDevice()
for _name, _mod in list(sys.modules.items()):
    if _name.startswith("torchtitan"):
        if getattr(_mod, "device_type", None) == "cuda":
            _mod.device_type = "cpu"
        if getattr(_mod, "device_module", None) is torch.cuda:
            _mod.device_module = _cpu
# torch refuses FlexAttention's backward on CPU tensors; its eager reference implementation
# computes it (torchtitan itself uses that path on ROCm).
fa._validate_device = lambda *args: None
# torchtitan compiles flex_attention and create_block_mask with inductor: the eager functions
# give the same values on CPU without minutes of compilation.
attention.FlexAttention._compiled_flex_attn = fa.flex_attention
attention._compiled_create_block_mask = fa.create_block_mask
# torchtitan 0.3.0 calls torch.distributed.set_timeout, which torch 2.13 has as a private one.
if not hasattr(dist, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.set_timeout = _set_pg_timeout

# torchtitan sets FSDP2's gradient divide factor to 1.0 (it divides the loss by the global
# token count itself), which FSDP2 reduces with ReduceOp.PREMUL_SUM, an NCCL-only op; gloo
# sums, and a post-division by 1.0 is exact.
from torchtitan.distributed import fsdp as _titan_fsdp  # noqa: E402

_disable_division = _titan_fsdp.disable_fsdp_gradient_division


def _sum_reductions(model):
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, torch.distributed.fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


_titan_fsdp.disable_fsdp_gradient_division = _sum_reductions

_torch_step = schedules.PipelineScheduleMulti.step


def _presplit_step(
    self,
    *args,
    arg_mbs=None,
    kwarg_mbs=None,
    target_mbs=None,
    losses=None,
    return_outputs=True,
    loss_kwargs=None,
    **kwargs,
):
    """For torch's own schedules only: torch 2.14's pre-split step keywords, which
    torchtitan's Trainer passes, on torch 2.13 (its step's body on pre-split micro-batches)."""
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        return _torch_step(
            self,
            *args,
            losses=losses,
            return_outputs=return_outputs,
            loss_kwargs=loss_kwargs,
            **kwargs,
        )
    for stage in self._stages:
        stage.has_backward = self._has_backward
        stage.clear_runtime_states()
    self._step_microbatches(
        arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
    )
    return None


schedules.PipelineScheduleMulti.step = _presplit_step

# For torch's own schedules only: torch's PipelineStage infers its P2P metadata at the first
# step by running each stage's forward once more, in training mode (torch 2.13: stage 0 on the
# first micro-batch, the others on placeholder tensors; before: zeros). A module that counts in
# its forward counts that run too: MoE's tokens_per_expert_E gets one micro-batch more on every
# MoE layer, and the first expert-bias update differs from what the step's micro-batches give
# (tests/test_torch_pipelining.py shows it on a counting stage). The buffers are put back as
# they were, so that torch's schedule is the reference of what the step computes.
_INFER = next(
    n for n in ("_forward_metadata_inference", "_shape_inference") if hasattr(PipelineStage, n)
)
_infer_forward = getattr(PipelineStage, _INFER)


def _metadata_inference_without_side_effects(self, *args, **kwargs):
    saved = [(b, b.detach().clone()) for b in self.submod.buffers()]
    try:
        return _infer_forward(self, *args, **kwargs)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


setattr(PipelineStage, _INFER, _metadata_inference_without_side_effects)

if __name__ == "__main__":
    from torchtitan.train import main

    main()
