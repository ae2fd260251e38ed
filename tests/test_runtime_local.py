"""The eager runtime in one process (N = 1: both stages local, no process group needed)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import graphpipe
from graphpipe.schedule.ir import Op
from tests.pipeline_models import Block, batch, build_stages, local_stages, mse, reference


def _pipe(m: int = 3, **kw):
    stages = build_stages(2, **{k: kw.pop(k) for k in ("dtype", "tuple_io", "tied") if k in kw})
    return graphpipe.DualPipeV(local_stages(stages, 0, 1), num_microbatches=m, loss_fn=mse, **kw)


def test_every_action_runs_in_a_profiler_range_named_after_it():
    pipe = _pipe(4)
    x, y = batch(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(x, y)
    names = {e.name for e in prof.events()}
    expected = {str(a) for a in pipe.schedule[0]}
    assert any(a.op is Op.OVERLAP_F_B for a in pipe.schedule[0])
    assert expected <= names, expected - names
    assert "step" in names


def test_W_actions_run_the_deferred_linear_weight_gemms(monkeypatch):
    from graphpipe.weightgrad import WeightGradStore

    pipe = _pipe(3)
    runs = []
    real = WeightGradStore.run

    def counting(store, key):
        n = real(store, key)
        runs.append((pipe.stores.index(store), key, n))
        return n

    monkeypatch.setattr(WeightGradStore, "run", counting)
    x, y = batch(6)
    pipe.step(x, y)
    ws = [a for a in pipe.schedule[0] if a.op is Op.W]
    assert len(ws) == 1  # 2N - r - 1 with N = 1
    # each W ran the GEMMs of both Linears (fc1, fc2) of its stage, for its own micro-batch
    assert runs == [(0, (ws[0].stage, ws[0].microbatch), 2)]
    assert pipe.num_deferrable == (2, 2)


@pytest.mark.parametrize("hooked", [False, True])
def test_large_linears_accumulate_every_weight_grad_fused_and_match_the_reference(
    monkeypatch, hooked
):
    # Above FUSED_ACCUMULATION_MIN_NUMEL (lowered here to take in the test's small layers) a
    # full backward accumulates into .grad in the GEMM, like W: every Linear backward of the
    # step, B or I + W, overlap hook or not, goes through _accumulate_weight_grad.
    from graphpipe import weightgrad

    monkeypatch.setattr(weightgrad, "FUSED_ACCUMULATION_MIN_NUMEL", 1)
    calls = []
    real = weightgrad._accumulate_weight_grad

    def counting(weight, bias, x, g):
        calls.append(weight)
        real(weight, bias, x, g)

    monkeypatch.setattr(weightgrad, "_accumulate_weight_grad", counting)
    stages = build_stages(2)
    run = stages
    if hooked:
        run = []
        for s in stages:
            h = HookedBlock(8, s.index, s.num_stages).double()
            h.load_state_dict(s.state_dict())
            run.append(h)
    m = 4
    pipe = graphpipe.DualPipeV(local_stages(run, 0, 1), num_microbatches=m, loss_fn=mse)
    x, y = batch(8)
    loss = pipe.step(x, y)
    assert len(calls) == sum(pipe.num_deferrable) * m  # every Linear, every micro-batch
    ref_loss, ref_grads, _ = reference(stages, x, y)
    # float64, the pipeline against the reference loop: other summation orders (deferred
    # weight GEMMs, micro-batch losses averaged), equal up to rounding: 1e-12 relative, and
    # 1e-14 absolute for gradient elements that cancel to about 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for i, s in enumerate(run):
        for name, p in s.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[(i, name)], rtol=1e-12, atol=1e-14)


class HookedBlock(Block):
    calls: ClassVar[list] = []

    @classmethod
    def overlapped_forward_backward(cls, fmod, inputs, bmod, outputs, grads):
        cls.calls.append((fmod.index, bmod.index))
        y = fmod(*inputs)
        torch.autograd.backward(list(outputs), list(grads))
        return y


def test_an_overlap_hook_is_called_for_every_F_and_B_pair_and_gives_the_same_grads():
    stages = build_stages(2)
    hooked = []
    for s in stages:
        h = HookedBlock(8, s.index, s.num_stages).double()
        h.load_state_dict(s.state_dict())
        hooked.append(h)
    HookedBlock.calls = []
    pipe = graphpipe.DualPipeV(local_stages(hooked, 0, 1), num_microbatches=4, loss_fn=mse)
    x, y = batch(8)
    loss = pipe.step(x, y)
    pairs = [a for a in pipe.schedule[0] if a.op is Op.OVERLAP_F_B]
    assert len(HookedBlock.calls) == len(pairs) > 0
    ref_loss, ref_grads, _ = reference(stages, x, y)
    # float64 against the reference loop, other summation orders: see the test above
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for i, s in enumerate(hooked):
        for name, p in s.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[(i, name)], rtol=1e-12, atol=1e-14)


def test_bf16_autocast_matches_the_reference_under_autocast():
    pipe = _pipe(4, dtype=torch.float32)
    ref_stages = build_stages(2, dtype=torch.float32)
    x, y = batch(8, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, y)
        ref_loss, ref_grads, _ = reference(ref_stages, x, y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss.float(), rtol=2e-2, atol=2e-2)
    for li, s in zip(pipe.stage_ids, pipe.modules):
        for name, p in s.named_parameters():
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, ref_grads[(li, name)], rtol=5e-2, atol=5e-2)


def test_grad_scaler_scales_the_backward_and_unscale_restores_the_grads():
    plain, scaled = _pipe(4), _pipe(4)
    x, y = batch(8)
    plain.step(x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss = scaled.step(x, y, scaler=scaler)
    params = [p for m in scaled.modules for p in m.parameters()]
    ref = [p for m in plain.modules for p in m.parameters()]
    torch.testing.assert_close(params[0].grad, ref[0].grad * 1024.0)
    opt = torch.optim.SGD(params, lr=0.0)
    scaled.unscale_(scaler, opt)
    for p, r in zip(params, ref):  # float64 pipeline vs reference (scaling by 2**10 is exact)
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=1e-15)
    scaler.step(opt)
    scaler.update()
    assert loss.item() > 0


def test_forward_returns_the_concatenated_outputs_without_autograd_state():
    pipe = _pipe(4, tuple_io=True)
    x, _ = batch(8)
    out = pipe.forward(x)
    h = x
    for s in build_stages(2, tuple_io=True):
        h = s(*h) if isinstance(h, tuple) else s(h)
    # float64, micro-batch GEMMs against whole-batch ones (other shapes, other kernels)
    torch.testing.assert_close(out, h.detach(), rtol=1e-12, atol=1e-14)
    assert not out.requires_grad
    assert all(v is None for row in pipe.runner.outputs for v in row)


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: graphpipe.DualPipeV([torch.nn.Linear(1, 1)], num_microbatches=2, loss_fn=mse),
            r"rank 0 runs stages \[0, 1\] of the dualpipev schedule: stages must be 2",
        ),
        (lambda: _pipe(1), "num_microbatches must be >= 2"),
        (lambda: _pipe(2, capture="graph"), "capture must be"),
        (lambda: _pipe(2, receives="soon"), r"receives must be one of .* got 'soon'"),
    ],
)
def test_bad_construction_raises_value_error_naming_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_batches_raise_value_errors_naming_the_sizes():
    pipe = _pipe(3)
    x, y = batch(7)
    with pytest.raises(ValueError, match=r"inputs\[0\] of shape \[7, 8\] does not split .*=3"):
        pipe.step(x, y)
    with pytest.raises(ValueError, match="labels must not be None"):
        pipe.step(batch(6)[0], None)
    x, y = batch(6)
    assert pipe.step(x, y).dim() == 0  # still works after the errors


def test_a_loss_fn_that_returns_a_non_scalar_is_refused():
    stages = local_stages(build_stages(2), 0, 1)
    pipe = graphpipe.DualPipeV(stages, num_microbatches=2, loss_fn=lambda o, t: (o - t) ** 2)
    with pytest.raises(ValueError, match="loss_fn must return a 0-dim tensor"):
        pipe.step(*batch(4))


def test_a_step_that_fails_inside_an_action_leaves_the_pipeline_usable(monkeypatch):
    from graphpipe.weightgrad import WeightGradStore

    pipe = _pipe(3)
    x, y = batch(6)
    ref = pipe.step(x, y)
    real = WeightGradStore.run

    def failing(store, key):
        raise RuntimeError("boom in W")

    monkeypatch.setattr(WeightGradStore, "run", failing)
    with pytest.raises(RuntimeError, match="boom in W"):
        pipe.step(x, y)  # fails after its I: deferred work was pending
    assert pipe.ranges.depth == 0  # every range was closed
    monkeypatch.setattr(WeightGradStore, "run", real)
    for m in pipe.modules:
        m.zero_grad()
    assert torch.equal(pipe.step(x, y), ref)  # bitwise: the same program on the same inputs


def test_the_memory_report_names_every_kind_after_the_warmup_step():
    pipe = _pipe(3, capture=True)
    with pytest.raises(RuntimeError, match="no plan yet"):
        pipe.memory_report()
    pipe.step(*batch(6))
    report = pipe.memory_report()
    for kind in ("inputs", "labels", "recv_activation", "recv_grad", "saving:"):
        assert kind in report
    # 2 stages x 3 micro-batches x (input [2, 8] + output [2, 8]) x 8 bytes (float64)
    stored = pipe.record.nbytes()
    assert stored["activations"] == 2 * 3 * 2 * (2 * 8) * 8
    assert stored["grads"] == 3 * (2 * 8) * 8  # stage 1's input gradients (stage 0 has none)
    assert f"{stored['activations']:,} bytes" in report


def test_an_eager_pipeline_has_no_capture_driver_and_no_plan():
    pipe = _pipe(3)
    assert pipe._capture is None  # its steps run the step loop directly
    pipe.step(*batch(6))
    assert pipe.plan is None and pipe.record is None
    with pytest.raises(RuntimeError, match="build the pipeline with capture=True"):
        pipe.memory_report()
    pipe.close()


def test_constructing_a_pipeline_imports_nothing_it_only_recognises():
    """A one-rank construction must not import FSDP, DTensor or sympy (seconds of import in
    every process) just to check whether a stage is wrapped: a module never imported cannot
    have wrapped one."""
    import subprocess
    import sys

    code = (
        "import sys, torch, graphpipe\n"
        "DualPipeV = graphpipe.DualPipeV  # the runtime (graphpipe imports it on first use)\n"
        "before = set(sys.modules)\n"
        "stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]\n"
        "loss = lambda y, t: (y - t).pow(2).mean()\n"
        "pipe = DualPipeV(stages, num_microbatches=2, loss_fn=loss)\n"
        "pipe.step(torch.randn(4, 4), torch.randn(4, 4))\n"
        "print(sorted(set(sys.modules) - before))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sympy'"
        " or m.startswith(('torch.distributed.fsdp', 'torch.distributed.tensor'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == ["[]", "[]"], out
