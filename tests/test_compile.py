"""Compiled stages (``torch.compile``) keep their deferred weight gradients (one process).

Compiling is slow on a small shared CPU: each test here compiles the two stages of a 1-rank
DualPipeV pipeline (a LayerNorm, two Linears; forward and backward graphs). Stages of the same
class, attributes and input signature share compiled graphs within the process, so the tests
after the first mostly reuse them.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import graphpipe
from graphpipe.schedule.ir import Op
from graphpipe.weightgrad import DeferrableLinear, WeightGradStore, make_deferrable
from tests.pipeline_models import batch, build_stages, local_stages, mse, unique_params

# float64 everywhere; the compiled kernels may sum in another order than eager's (a
# LayerNorm's reductions, vectorized), so compiled and eager agree to rounding, not bitwise.
# The order is inductor's, which differs between torch versions: with torch 2.11 one
# gradient element of magnitude ~4e-4 differed by 1.2e-14 (3e-11 relative); the absolute
# bound covers such near-cancelling elements, the relative one the rest.
RTOL, ATOL = 1e-10, 1e-12

_GEMMS = {"aten::mm", "aten::addmm", "aten::addmm_"}
_ACTION = re.compile(r"^\d+[FBIW]\d+$|OVERLAP_F_B$")


def _compiled(stages: list[nn.Module], how: str, backend: str) -> list[nn.Module]:
    if how == "torch.compile":
        # an OptimizedModule around each stage
        return [torch.compile(s, backend=backend) for s in stages]
    for s in stages:
        s.compile(backend=backend)  # in place: the module itself
    return stages


def _result_shape(event) -> tuple[int, ...] | None:
    shapes = event.input_shapes
    if event.name == "aten::mm" and len(shapes) >= 2 and shapes[0] and shapes[1]:
        return (shapes[0][0], shapes[1][1])
    if event.name.startswith("aten::addmm") and shapes and shapes[0]:
        return tuple(shapes[0])
    return None


def _weight_gemms_by_action(prof, weight_shapes: set[tuple[int, ...]]) -> dict[str, int]:
    """Per action range of the step (``0W1``, ``0I1``, ...): how many GEMMs it ran whose result
    has the shape of a Linear weight (the weight-gradient GEMMs; the batch's rows are not a
    weight dimension here)."""
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name not in _GEMMS or _result_shape(e) not in weight_shapes:
            continue
        parent = e.cpu_parent
        while parent is not None and not _ACTION.search(parent.name):
            parent = parent.cpu_parent
        name = parent.name if parent is not None else "outside any action"
        counts[name] = counts.get(name, 0) + 1
    return counts


def _twins(how: str, backend: str, m: int = 2, **kw) -> tuple:
    """An eager and a compiled 1-rank DualPipeV on equal stages."""
    es, cs = build_stages(2), build_stages(2)
    eager = graphpipe.DualPipeV(local_stages(es, 0, 1), num_microbatches=m, loss_fn=mse)
    run = _compiled(list(local_stages(cs, 0, 1)), how, backend)
    compiled = graphpipe.DualPipeV(run, num_microbatches=m, loss_fn=mse, **kw)
    return eager, es, compiled, cs


def _assert_same_step(eager, es, compiled, cs, x, y, profile: bool = False):
    """One step of each on the same batch (grads zeroed first): loss and gradients agree.
    ``profile``: the compiled step runs under the CPU profiler, which is returned."""
    for s in (*es, *cs):
        s.zero_grad(set_to_none=False)
    le = eager.step(x, y)
    prof = None
    if profile:
        acts = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            lc = compiled.step(x, y)
    else:
        lc = compiled.step(x, y)
    torch.testing.assert_close(lc, le, rtol=RTOL, atol=0)
    for (name, pe), pc in zip(
        ((n, p) for s in es for n, p in s.named_parameters()),
        (p for s in cs for p in s.parameters()),
        strict=True,
    ):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=RTOL, atol=ATOL, msg=name)
    return prof


# inductor (torch.compile's default) for one; AOTAutograd alone (aot_eager: it traces the
# backward as inductor does, without compiling kernels) for the other, to spare compile time
@pytest.mark.parametrize(
    "how,backend", [("torch.compile", "inductor"), ("Module.compile", "aot_eager")]
)
def test_a_compiled_stage_runs_its_weight_gemms_in_W_and_matches_eager(how, backend):
    eager, es, compiled, cs = _twins(how, backend)
    assert compiled.num_deferrable == (2, 2)
    assert all(isinstance(s.fc1, DeferrableLinear) for s in cs)
    x, y = batch(4)
    _assert_same_step(eager, es, compiled, cs, x, y)  # compiles; the next step does not
    weights = {tuple(p.shape) for s in cs for p in s.parameters() if p.dim() == 2}
    prof = _assert_same_step(eager, es, compiled, cs, x, y, profile=True)
    counts = _weight_gemms_by_action(prof, weights)
    actions = [a for cell in compiled.schedule[0] for a in cell.parts()]
    ws = [a for a in actions if a.op is Op.W]
    assert [str(a) for a in ws] == ["0W1"]
    # the W of stage 0 runs both of its Linears' weight GEMMs, its I none of them
    assert counts.get("0W1") == 2, counts
    assert "0I1" not in counts, counts
    assert "outside any action" not in counts, counts


def test_a_compiled_stage_trains_under_the_static_step_like_eager():
    # capture=True on CPU: step 1 eager (records), then the static step on plan buffers
    # (the graphs of the test above serve here: same stage class, attributes and inputs)
    eager, es, compiled, cs = _twins("torch.compile", "inductor", capture=True)
    opt_e = torch.optim.SGD(unique_params(es), lr=0.1)
    opt_c = torch.optim.SGD(unique_params(cs), lr=0.1)
    for step in range(3):
        x, y = batch(4, seed=10 + step)
        _assert_same_step(eager, es, compiled, cs, x, y)
        opt_e.step()
        opt_c.step()
    assert compiled.plan is not None


def _layers(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [(nn.Linear(16, 16), nn.Tanh(), nn.LayerNorm(16)) for _ in range(3)]
    return nn.Sequential(*[m for block in layers for m in block]).double()


def test_the_compiled_split_is_decided_when_the_backward_runs():
    # One graph for I and for B: a deferring backward stashes the work (the weights get no
    # gradient until the W), another backward of the same graph accumulates at once. Three
    # equal blocks make inductor reuse the memory of the backward's intermediates: the W's
    # stashed tensors must be copies (else its gradients were off by ~1e-3 here).
    ref, model = _layers(), _layers()
    store = WeightGradStore()
    make_deferrable(model, store)
    run = torch.compile(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    xs = [torch.randn(4, 16, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        ref(x).pow(2).sum().backward()
    with store.deferring("I"):
        run(xs[0]).pow(2).sum().backward()
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert all(m.weight.grad is None and m.bias.grad is None for m in linears)
    store.split = False  # what B micro-batches get; the compiled path does not read it
    run(xs[1]).pow(2).sum().backward()  # not deferring: into .grad now
    assert all(m.weight.grad is not None for m in linears)
    store.split = True
    run(xs[2]).pow(2).sum().backward()
    assert store.run("I") == 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_a_compiled_linear_under_bf16_autocast_defers_fp32_grads():
    torch.manual_seed(0)
    ref, lin = nn.Linear(5, 3), nn.Linear(5, 3)
    lin.load_state_dict(ref.state_dict())
    store = WeightGradStore()
    make_deferrable(lin, store)
    run = torch.compile(lin, backend="aot_eager", fullgraph=True)  # no graph break either
    x = torch.randn(4, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr = ref(x)
        with store.deferring(0):
            y = run(x)
            assert y.dtype == torch.bfloat16
            y.float().sum().backward()
    yr.float().sum().backward()
    assert lin.weight.grad is None
    assert store.run(0) == 1
    assert lin.weight.grad.dtype == torch.float32
    # bf16 operands both ways; the GEMMs differ (eager autocast's backward vs the W's)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=2e-2, atol=2e-2)
