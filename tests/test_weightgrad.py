"""The input/weight split: deferrable Linear layers and their store (no processes)."""

from __future__ import annotations

import contextlib
import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphpipe
from graphpipe.weightgrad import (
    FUSED_ACCUMULATION_MIN_NUMEL,
    DeferrableLinear,
    WeightGradStore,
    make_deferrable,
    switch_linears,
)
from tests.pipeline_models import batch, build_stages, mse

# Float64 results of two different code paths that sum the same few products in other orders
# (addmm_ accumulating into .grad against mm then add_, the stashed GEMM or a custom backward
# against autograd's): equal only up to rounding, and which kernel MKL runs depends on the CPU
# (on an AMD EPYC, and on this Intel machine under MKL_ENABLE_INSTRUCTIONS=SSE4_2, 451 of the
# 262144 elements of the large layer's weight gradient differ, by at most 4.4e-16 absolute,
# 6e-12 relative where the sum cancels). The values are O(1): 1e-12 absolute is about 2000x
# that rounding, while a real error (a lost micro-batch, a wrong operand) is O(1).
ACROSS_KERNELS = {"rtol": 1e-12, "atol": 1e-12}


def _pair(bias: bool = True):
    torch.manual_seed(0)
    ref = nn.Linear(5, 3, bias=bias).double()
    lin = nn.Linear(5, 3, bias=bias).double()
    lin.load_state_dict(ref.state_dict())
    return ref, lin


class TitanLinear(nn.Linear):
    """Like torchtitan's Linear: a subclass that keeps nn.Linear.forward, adds an attribute and a
    method (module level: pickle finds it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tag = "titan"

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.weight, std=std)


class ScaledLinear(nn.Linear):
    """Overrides forward: the deferrable Linear's forward would replace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


class RawLinear(nn.Module):
    """Linear-like without being an nn.Linear: its own matrix weight and F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


def test_make_deferrable_switches_linear_layers_and_subclasses_that_keep_forward():
    model = nn.Sequential(
        nn.Linear(2, 2),
        nn.ReLU(),
        TitanLinear(2, 2),
        nn.Sequential(nn.Linear(2, 1), TitanLinear(1, 1)),
    )
    keys = list(model.state_dict())
    store = WeightGradStore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is left alone
        assert make_deferrable(model, store) == 4
    assert type(model[0]) is DeferrableLinear and isinstance(model[0], nn.Linear)
    assert type(model[3][0]) is DeferrableLinear
    titan = model[2]
    assert isinstance(titan, TitanLinear) and isinstance(titan, DeferrableLinear)
    assert type(titan) is type(model[3][1])  # one class per original class
    assert type(titan).__mro__[1:3] == (DeferrableLinear, TitanLinear)
    assert titan.tag == "titan" and type(titan).__name__ == "DeferrableTitanLinear"
    titan.init_weights(0.02)  # the original class's methods stay
    assert list(model.state_dict()) == keys


def test_a_switched_subclass_defers_its_weight_grad_to_W():
    torch.manual_seed(0)
    ref = TitanLinear(5, 3).double()
    lin = TitanLinear(5, 3).double()
    lin.load_state_dict(ref.state_dict())
    store = WeightGradStore()
    assert make_deferrable(lin, store) == 1
    x = torch.randn(4, 5, dtype=torch.float64)
    ref(x).sum().backward()
    with store.deferring("w"):
        lin(x).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None
    assert store.run("w") == 1
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-14, atol=0)


def test_layers_that_cannot_be_deferred_warn_once_naming_path_and_class():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(ScaledLinear(2, 3)), RawLinear())
    with pytest.warns(UserWarning) as record:
        assert make_deferrable(model, WeightGradStore(), where="stage 3") == 1
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2, messages
    assert messages[0].startswith(
        "graphpipe: stage 3.1.0 (tests.test_weightgrad.ScaledLinear) is not deferred: its "
        "class ScaledLinear overrides nn.Linear.forward"
    ), messages[0]
    assert messages[1].startswith(
        "graphpipe: stage 3.2 (tests.test_weightgrad.RawLinear) is not deferred: it holds the "
        "matrix weight 'w' [3, 2] but is not an nn.Linear"
    ), messages[1]
    assert type(model[1][0]) is ScaledLinear  # left alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module: a second pipeline says nothing
        assert make_deferrable(model, WeightGradStore()) == 1


def _wrap_forward(m: nn.Module) -> None:
    """What torchtitan's Module.parallelize does: a wrapper around the bound forward found
    now, set on the instance."""
    fn = m.forward

    def forward_with_redistribution(*args, **kwargs):
        return fn(*args, **kwargs)

    m.forward = forward_with_redistribution


def test_a_forward_wrapped_on_the_instance_defers_only_when_switched_before_the_wrapping():
    x = torch.randn(3, 2, dtype=torch.float64)
    late = nn.Linear(2, 2).double()
    _wrap_forward(late)
    with pytest.warns(UserWarning, match=r"its forward is an instance attribute .*switch_linears"):
        assert make_deferrable(nn.Sequential(late), WeightGradStore(), where="stage 1") == 0
    assert not isinstance(late, DeferrableLinear)  # a switch would not reach the wrapper
    early = nn.Linear(2, 2).double()
    assert switch_linears(nn.Sequential(early, graphpipe.no_defer(nn.Linear(2, 2)))) == 1
    assert isinstance(early, DeferrableLinear)
    _wrap_forward(early)
    store = WeightGradStore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_deferrable(early, store) == 1
    ref = copy.deepcopy(early)
    with store.deferring("w"):
        early(x).sum().backward()
    assert early.weight.grad is None  # deferred to the W, through the wrapper
    store.run("w")
    F_ref = torch.nn.functional.linear(x, ref.weight, ref.bias).sum()
    F_ref.backward()
    torch.testing.assert_close(early.weight.grad, ref.weight.grad, rtol=0, atol=0)


def test_no_defer_silences_the_warning_and_embeddings_never_warn():
    model = nn.Sequential(nn.Embedding(4, 2), graphpipe.no_defer(ScaledLinear(2, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_deferrable(model, WeightGradStore()) == 0


def test_multihead_attention_and_parametrized_linears_warn_and_stay_as_they_are():
    lin = nn.Linear(4, 4)
    torch.nn.utils.parametrizations.orthogonal(lin)
    model = nn.Sequential(nn.MultiheadAttention(4, 2), lin)
    with pytest.warns(UserWarning) as record:
        assert make_deferrable(model, WeightGradStore()) == 0
    text = " | ".join(str(w.message) for w in record)
    assert len(record) == 2, text
    assert "Sequential.0 (torch.nn.modules.activation.MultiheadAttention)" in text
    assert "F.multi_head_attention_forward" in text
    assert "Sequential.1 (torch.nn.utils.parametrize.ParametrizedLinear)" in text
    # MultiheadAttention never calls its out_proj: switching it would count a layer that
    # defers nothing
    assert not isinstance(model[0].out_proj, DeferrableLinear)
    assert not isinstance(lin, DeferrableLinear)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_switched_stage_copies_with_a_store_of_its_own(how):
    model = nn.Sequential(TitanLinear(3, 2), nn.Linear(2, 2)).double()
    store = WeightGradStore()
    make_deferrable(model, store)
    copied = pickle.loads(pickle.dumps(model)) if how == "pickle" else copy.deepcopy(model)
    assert type(copied[0]) is type(model[0]) and type(copied[1]) is DeferrableLinear
    assert copied[0].tag == "titan"
    mine = copied[0]._wgrad_store
    assert mine is copied[1]._wgrad_store and mine is not store
    assert int(copied[0]._wgrad_token) == int(mine._token) != int(store._token)
    for a, b in zip(model.state_dict().values(), copied.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    x = torch.randn(4, 3, dtype=torch.float64)
    with mine.deferring(0):
        copied(x).sum().backward()
    assert store.pending() == [] and mine.run(0) == 2


@pytest.mark.parametrize("bias", [True, False])
def test_deferred_weight_grad_runs_only_in_W_and_matches_full_backward(bias):
    ref, lin = _pair(bias)
    store = WeightGradStore()
    make_deferrable(lin, store)
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(2, 4, 3, dtype=torch.float64)
    ref(xr).backward(g)
    with store.deferring(("stage", 7)):
        lin(xd).backward(g)
    # I: input gradient now, no weight gradient yet
    torch.testing.assert_close(xd.grad, xr.grad)
    assert lin.weight.grad is None
    assert store.pending() == [("stage", 7)]
    assert store.run(("stage", 7)) == 1
    # W's GEMM on the reshaped operands against autograd's: ACROSS_KERNELS
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **ACROSS_KERNELS)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **ACROSS_KERNELS)
    assert store.pending() == []


def test_without_deferral_the_linear_is_a_plain_linear():
    ref, lin = _pair()
    make_deferrable(lin, WeightGradStore())
    x = torch.randn(3, 5, dtype=torch.float64)
    ref(x).sum().backward()
    lin(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_store_errors_name_the_key():
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match=r"no deferred weight-gradient work for \(1, 2\)"):
        store.run((1, 2))
    with store.deferring((1, 2)):
        pass
    with pytest.raises(RuntimeError, match=r"\(1, 2\) is already pending"):
        with store.deferring((1, 2)):
            pass


def test_deferred_linear_under_bf16_autocast_accumulates_fp32_grads():
    ref, lin = _pair()
    ref, lin = ref.float(), lin.float()
    store = WeightGradStore()
    make_deferrable(lin, store)
    x = torch.randn(4, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr = ref(x)
        with store.deferring(0):
            yd = lin(x)
            assert yd.dtype == torch.bfloat16
            yd.float().sum().backward()
    yr.float().sum().backward()
    store.run(0)
    assert lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=2e-2, atol=2e-2)


def test_W_accumulates_plain_gradients_without_an_autograd_graph():
    # The stashed input of an inner Linear requires grad (it is an activation of the stage):
    # W must not build a graph into .grad (that would keep the micro-batch alive).
    store = WeightGradStore()
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    make_deferrable(model, store)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with store.deferring("w"):
        model(x).sum().backward()
    store.run("w")
    for p in model.parameters():
        assert p.grad is not None and not p.grad.requires_grad and p.grad.grad_fn is None


class _Scale(torch.nn.Module):
    """A custom layer that defers its weight gradient through the store's hook."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([2.0]))
        self.store = None

    def bind_weight_grad_store(self, store: WeightGradStore) -> None:
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleFn.apply(x, self.weight, self)


class _ScaleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, layer):
        ctx.save_for_backward(x, w)
        ctx.layer = layer
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        layer = ctx.layer

        def weight_grad(x: torch.Tensor, g: torch.Tensor) -> None:
            gw = (x * g).sum().reshape(1)
            layer.weight.grad = gw if layer.weight.grad is None else layer.weight.grad + gw

        if layer.store.defer(weight_grad, x, g):
            return g * w, None, None
        return g * w, (x * g).sum().reshape(1), None


def test_a_custom_layer_defers_its_weight_grad_through_the_store_hook():
    layer, store = _Scale(), WeightGradStore()
    model = torch.nn.Sequential(layer, torch.nn.Linear(3, 1))
    assert make_deferrable(model, store) == 2  # the Linear and the custom layer
    assert layer.store is store
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    with store.deferring("W0"):
        model(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None  # input grad now, weight later
    assert store.run("W0") == 2
    torch.testing.assert_close(layer.weight.grad, (x.detach() * model[1].weight).sum().reshape(1))
    plain = _Scale()
    plain.store = WeightGradStore()  # not deferring: defer() returns False, work runs at once
    plain(x.detach()).sum().backward()
    torch.testing.assert_close(plain.weight.grad, x.detach().sum().reshape(1))


class _AtenLog(TorchDispatchMode):
    """Records ``(op name, shape of the first argument)`` of every aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.ops.append(
            (func.overloadpacket.__name__, tuple(first.shape) if first is not None else ())
        )
        return func(*args, **(kwargs or {}))


def _big_pair() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    out_f, in_f = 512, FUSED_ACCUMULATION_MIN_NUMEL // 512
    ref = nn.Linear(in_f, out_f).double()
    lin = nn.Linear(in_f, out_f).double()
    lin.load_state_dict(ref.state_dict())
    return ref, lin


@pytest.mark.parametrize("deferred", [False, True])
def test_weight_grads_accumulate_inside_the_gemm(deferred):
    # The second micro-batch's weight gradient goes into .grad as one addmm_ (beta = 1): no
    # weight-sized temporary, no second pass over .grad; for a full backward (B) too, when the
    # layer is large.
    ref, lin = _big_pair()
    store = WeightGradStore()
    make_deferrable(lin, store)
    store.split = deferred
    store.accumulating = not deferred  # as the executor sets it around a B
    xs = [torch.randn(3, lin.in_features, dtype=torch.float64) for _ in range(2)]
    gs = [torch.randn(3, lin.out_features, dtype=torch.float64) for _ in range(2)]
    for x, g in zip(xs, gs, strict=True):
        ref(x).backward(g)
    log = _AtenLog()
    for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
        y = lin(x)
        assert "LinearFn" in type(y.grad_fn).__name__  # not plain autograd
        if deferred:
            with store.deferring(i):
                y.backward(g)
            assert lin.weight.grad is None or i == 1
            with log if i == 1 else contextlib.nullcontext():
                store.run(i)
        else:
            with log if i == 1 else contextlib.nullcontext():
                y.backward(g)
    weight = tuple(lin.weight.shape)
    assert ("addmm_", weight) in log.ops, log.ops
    assert not [op for op in log.ops if op[1] == weight and op[0] in ("add_", "add", "mm")]
    # one addmm_ into .grad against autograd's mm then add: ACROSS_KERNELS
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **ACROSS_KERNELS)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **ACROSS_KERNELS)


def test_a_small_layer_in_a_full_backward_stays_plain_autograd():
    ref, lin = _pair()
    store = WeightGradStore()
    make_deferrable(lin, store)
    store.split = False
    assert lin.weight.numel() < FUSED_ACCUMULATION_MIN_NUMEL
    x = torch.randn(3, 5, dtype=torch.float64)
    y = lin(x)
    assert "LinearFn" not in type(y.grad_fn).__name__
    y.sum().backward()
    ref(x).sum().backward()
    # bitwise: both are plain autograd through F.linear, the same kernels in the same order
    assert torch.equal(lin.weight.grad, ref.weight.grad)


def test_outside_the_executor_a_large_layer_hands_its_weight_grad_to_autograd():
    # torch.autograd.grad on a stage used on its own must still get the weight gradient.
    ref, lin = _big_pair()
    make_deferrable(lin, WeightGradStore())
    for split in (True, False):
        lin.__dict__["_wgrad_store"].split = split
        x = torch.randn(3, lin.in_features, dtype=torch.float64)
        got = torch.autograd.grad(lin(x).sum(), [lin.weight, lin.bias])
        want = torch.autograd.grad(ref(x).sum(), [ref.weight, ref.bias])
        for a, b in zip(got, want, strict=True):  # the custom backward's GEMM: ACROSS_KERNELS
            torch.testing.assert_close(a, b, **ACROSS_KERNELS)
        assert lin.weight.grad is None


class _NeverDefers(nn.Module):
    """A layer that takes the store but always computes its weight gradient at once."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, dtype=torch.float64))

    def bind_weight_grad_store(self, store: WeightGradStore) -> None:
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _first_steps_warnings(stages, steps: int = 2) -> list[list[str]]:
    pipe = graphpipe.DualPipeV(stages, num_microbatches=2, loss_fn=mse)
    x, y = batch(4)
    seen = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.step(x, y)
        seen.append([str(w.message) for w in caught if "deferred no weight" in str(w.message)])
    return seen


def test_a_stage_whose_w_actions_find_no_work_is_named_after_the_first_step() -> None:
    stages = build_stages(2)
    idle = nn.Sequential(_NeverDefers(), _NeverDefers())  # deferrable by count, never defers
    # one rank: DualPipeV's only W is stage 0's (0I1, 0W1)
    seen = _first_steps_warnings((idle, stages[1]))
    assert len(seen[0]) == 1 and "stage(s) [0] deferred no weight gradient" in seen[0][0]
    assert seen[1] == []  # once


def test_stages_that_defer_or_hold_only_frozen_linears_do_not_warn() -> None:
    stages = build_stages(2)
    assert _first_steps_warnings((stages[0], stages[1]), steps=1) == [[]]
    stages = build_stages(2)
    for p in stages[0].parameters():
        p.requires_grad_(False)
    assert _first_steps_warnings((stages[0], stages[1]), steps=1) == [[]]
