"""Activation checkpointing, the weight-gradient deferral switches, clipping and the program
hooks, in one process (N = 1: both stages local, no process group needed)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import graphpipe
from graphpipe.schedule.ir import Op
from graphpipe.weightgrad import DeferrableLinear
from tests.pipeline_models import (
    Checkpointed,
    batch,
    build_stages,
    local_stages,
    mse,
    params,
    reference,
    twin_step,
    unique_params,
)

# Float64, the pipeline against a single-process reference: the micro-batch losses are averaged
# and the weight gradients accumulated in another order (deferred GEMMs, addmm_ into .grad),
# with other GEMM shapes, so MKL may run other kernels on another CPU: equal up to rounding.
# RTOL is about 9000x float64's unit roundoff (1.1e-16); gradients also get 1e-14 absolute
# for elements that cancel to about 0.
RTOL = 1e-12


def _grads_by_name(stages) -> dict:
    return {
        (i, name.removeprefix("inner.")): p.grad.clone()
        for i, s in enumerate(stages)
        for name, p in s.named_parameters(remove_duplicate=False)
    }


def _assert_grads_match(stages, ref_grads) -> None:
    got = _grads_by_name(stages)
    assert set(got) == set(ref_grads)
    for key, g in got.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=RTOL, atol=1e-14, msg=str(key))


def _checkpointed(tied: bool = True) -> list[nn.Module]:
    return [Checkpointed(s) for s in build_stages(2, tied=tied)]


def test_checkpointed_stages_with_split_backward_match_the_reference() -> None:
    stages = _checkpointed()
    pipe = graphpipe.DualPipeV(local_stages(stages, 0, 1), num_microbatches=4, loss_fn=mse)
    # the schedule mixes full B and I + W on each stage: the case that used to crash with
    # "Recomputed values ... have different metadata"
    ops = {a.op for cell in pipe.schedule[0] for a in cell.parts()}
    assert {Op.B, Op.I, Op.W} <= ops
    assert pipe.num_deferrable == (2, 2)
    x, y = batch(8)
    loss = pipe.step(x, y)
    ref_loss, ref_grads, _ = reference(build_stages(2, tied=True), x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
    _assert_grads_match(stages, ref_grads)


def test_checkpointed_stages_replay_bitwise_equal_to_eager() -> None:
    es, cs = local_stages(_checkpointed(), 0, 1), local_stages(_checkpointed(), 0, 1)
    eager = graphpipe.DualPipeV(es, num_microbatches=4, loss_fn=mse)
    captured = graphpipe.DualPipeV(cs, num_microbatches=4, loss_fn=mse, capture=True)
    opt_e, opt_c = (torch.optim.SGD(unique_params(s), lr=0.1) for s in (es, cs))
    for step in range(4):
        x, y = batch(8, seed=step)
        assert twin_step(eager, es, captured, cs, x, y) == [], f"step {step}"
        opt_e.step()
        opt_c.step()
    assert captured.plan is not None


def test_defer_weight_grads_false_keeps_nn_linear_and_matches_the_reference() -> None:
    stages = build_stages(2)
    pipe = graphpipe.DualPipeV(
        local_stages(stages, 0, 1), num_microbatches=4, loss_fn=mse, defer_weight_grads=False
    )
    assert pipe.num_deferrable == (0, 0)
    assert all(
        type(m) is nn.Linear for s in stages for m in s.modules() if isinstance(m, nn.Linear)
    )
    x, y = batch(8)
    pipe.step(x, y)
    _assert_grads_match(stages, reference(build_stages(2), x, y)[1])


def test_no_defer_marks_one_module_and_its_contents() -> None:
    stages = build_stages(2)
    assert graphpipe.no_defer(stages[1]) is stages[1]
    pipe = graphpipe.DualPipeV(local_stages(stages, 0, 1), num_microbatches=4, loss_fn=mse)
    assert pipe.num_deferrable == (2, 0)
    assert type(stages[0].fc1) is DeferrableLinear
    assert type(stages[1].fc1) is nn.Linear and type(stages[1].fc2) is nn.Linear
    x, y = batch(8)
    pipe.step(x, y)
    _assert_grads_match(stages, reference(build_stages(2), x, y)[1])


def test_no_defer_rejects_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match=re.escape("no_defer takes an nn.Module, got Tensor")):
        graphpipe.no_defer(torch.zeros(1))


def _clipped_reference(max_norm: float, norm_type: float, x, y):
    stages = build_stages(2, tied=True)
    reference(stages, x, y)
    norm = torch.nn.utils.clip_grad_norm_(unique_params(stages), max_norm, norm_type)
    return norm, _grads_by_name(stages)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_counts_a_tied_weight_once_and_clips_like_torch(norm_type) -> None:
    stages = build_stages(2, tied=True)
    pipe = graphpipe.DualPipeV(local_stages(stages, 0, 1), num_microbatches=4, loss_fn=mse)
    x, y = batch(8)
    pipe.step(x, y)
    max_norm = 0.3
    norm = graphpipe.clip_grad_norm_(pipe, max_norm, norm_type)
    ref_norm, ref_grads = _clipped_reference(max_norm, norm_type, x, y)
    assert ref_norm > max_norm  # it clipped
    assert norm.dtype == torch.float64 and norm.dim() == 0
    torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=0)
    _assert_grads_match(stages, ref_grads)


def test_clip_grad_norm_in_the_captured_step_with_the_optimizer() -> None:
    es, cs = (
        local_stages(build_stages(2, tied=True), 0, 1),
        local_stages(build_stages(2, tied=True), 0, 1),
    )
    # SGD with momentum: a step that stays on tensors (torch's Adam reads its step count on
    # the host unless capturable=True, which torch has on CUDA only)
    opt_e, opt_c = (torch.optim.SGD(unique_params(s), lr=1e-2, momentum=0.9) for s in (es, cs))
    kw = dict(num_microbatches=4, loss_fn=mse, clip_grad_norm=0.3)
    eager = graphpipe.DualPipeV(es, **kw)
    captured = graphpipe.DualPipeV(cs, capture=True, capture_optimizer=opt_c, **kw)
    for step in range(4):
        x, y = batch(8, seed=step)
        opt_e.zero_grad(set_to_none=False)
        eager.step(x, y)
        norm = eager.grad_norm.clone()
        if step == 0:
            ref_norm, ref_grads = _clipped_reference(0.3, 2.0, x, y)
            torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=0)
            _assert_grads_match(es, ref_grads)
        opt_e.step()
        captured.step(x, y)
        # bitwise: the static replay runs the eager program's kernels in the same order
        assert torch.equal(captured.grad_norm, norm), f"step {step}"
        for a, b in zip(params(es), params(cs)):
            assert torch.equal(a, b), f"step {step}"
    # the clipping is a named instruction at the end of the program
    assert captured.program.instrs[-1].name == "clip_grad_norm"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(clip_grad_norm=0.0), "max_norm must be a positive number, got 0.0"),
        (dict(clip_grad_norm=1.0, clip_norm_type=-1), "norm_type must be a positive"),
    ],
)
def test_bad_clipping_arguments_name_the_value(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        graphpipe.DualPipeV(
            local_stages(build_stages(2), 0, 1), num_microbatches=2, loss_fn=mse, **kw
        )


def test_clipping_in_the_step_with_a_grad_scaler_is_refused() -> None:
    pipe = graphpipe.DualPipeV(
        local_stages(build_stages(2), 0, 1), num_microbatches=2, loss_fn=mse, clip_grad_norm=1.0
    )
    x, y = batch(4)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=re.escape("call graphpipe.clip_grad_norm_ after")):
        pipe.step(x, y, scaler=scaler)


def test_dp_group_without_torch_distributed_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("dp_group was given but torch.distributed")):
        graphpipe.DualPipeV(
            local_stages(build_stages(2), 0, 1), num_microbatches=2, loss_fn=mse, dp_group=object()
        )


def test_last_grad_steps_name_each_stages_last_backward_or_W() -> None:
    pipe = graphpipe.DualPipeV(local_stages(build_stages(2), 0, 1), num_microbatches=4, loss_fn=mse)
    program = pipe.program
    last = program.last_grad_steps()
    for stage, k in last.items():
        later = [
            a
            for step in program.steps[k + 1 :]
            if step.compute is not None
            for a in step.compute.parts()
            if a.stage == stage and a.op in (Op.B, Op.I, Op.W)
        ]
        assert later == [], f"stage {stage} has gradient work after instruction {k}"
        ops = {a.op for a in program.steps[k].compute.parts() if a.stage == stage}
        assert ops & {Op.B, Op.W}, f"instruction {k} is not a B or W of stage {stage}"
    assert set(last) == {0, 1}


def test_call_after_runs_right_after_its_instruction() -> None:
    pipe = graphpipe.DualPipeV(local_stages(build_stages(2), 0, 1), num_microbatches=4, loss_fn=mse)
    program = pipe.program
    seen: list[str] = []
    k = 2
    fn = program.instrs[k].handler

    def spy(*a):
        seen.append("compute")
        fn(*a)

    program.instrs[k] = program.instrs[k]._replace(handler=spy)
    program.call_after(k, lambda: seen.append("after"))
    program.call_after(len(program.instrs) - 1, lambda: seen.append("end"))
    x, y = batch(8)
    pipe.step(x, y)
    assert seen == ["compute", "after", "end"]
