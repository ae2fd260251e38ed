"""Hugging Face's ``Conv1D`` (GPT-2's projections) defers its weight gradient like a Linear,
so a GPT-2 pipeline warns about nothing, under any schedule; ``make_deferrable(warn=False)``
(for a schedule without I/W split) says nothing about layers it cannot defer."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import graphpipe
from graphpipe.weightgrad import DeferrableConv1D, WeightGradStore, make_deferrable

transformers = pytest.importorskip("transformers", reason="Conv1D is transformers'")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from graphpipe.models import (  # noqa: E402
    causal_lm_loss,
    causal_lm_num_items,
    split_hf_causal_lm,
    unique_parameters,
)


def _pair(seed: int = 0) -> tuple[Conv1D, Conv1D]:
    torch.manual_seed(seed)
    ref = Conv1D(3, 5).double()
    torch.nn.init.normal_(ref.bias)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("split", [True, False], ids=["I then W", "B"])
def test_a_conv1d_defers_its_weight_gradient_to_w(split: bool) -> None:
    ref, layer = _pair()
    store = WeightGradStore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_deferrable(layer, store) == 1
    assert isinstance(layer, Conv1D) and isinstance(layer, DeferrableConv1D)
    assert set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).square().sum().backward()
    if split:
        with store.deferring("w"):
            layer(x).square().sum().backward()
        assert layer.weight.grad is None and layer.bias.grad is None
        assert store.run("w") == 1
    else:
        store.accumulating = True  # as the executor sets it around a B
        layer(x).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-14, atol=0)


def test_a_conv1d_under_autocast_defers_the_gradient_autocast_computes() -> None:
    ref, layer = _pair()
    ref, layer = ref.float(), layer.float()
    store = WeightGradStore()
    make_deferrable(layer, store)
    x = torch.randn(4, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(x)
        out = layer(x)
    assert out.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    out_ref.float().sum().backward()
    with store.deferring("w"):
        out.float().sum().backward()
    store.run("w")
    assert layer.weight.grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_switched_conv1d_copies_with_a_store_of_its_own(how: str) -> None:
    _, layer = _pair()
    store = WeightGradStore()
    make_deferrable(layer, store)
    copied = pickle.loads(pickle.dumps(layer)) if how == "pickle" else copy.deepcopy(layer)
    assert type(copied) is type(layer)
    assert copied._wgrad_store is not store and copied._wgrad_store is not None
    x = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(copied(x), layer(x), rtol=0, atol=0)


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


@pytest.mark.parametrize("schedule", ["dualpipev", "1f1b"])
def test_gpt2_stages_warn_about_nothing_and_match_the_unsplit_model(schedule: str) -> None:
    model = _gpt2()
    v = schedule == "dualpipev"
    stages = split_hf_causal_lm(model, 2 if v else 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: 4 Conv1D warnings per layer
        pipe = graphpipe.Pipeline(
            stages,
            schedule=schedule,
            num_microbatches=2,
            loss_fn=causal_lm_loss,
            loss_reduction="sum",
        )
    # per layer: c_attn, c_proj of the attention and c_fc, c_proj of the MLP; and the head
    assert sum(pipe.num_deferrable) == 4 * 2 + 1
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    labels = ids.clone()
    loss = pipe.step(ids, labels, num_items_in_batch=causal_lm_num_items(labels))
    ref = _gpt2()
    want = ref(ids, labels=labels).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.double(), rtol=1e-6, atol=0)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for p in unique_parameters(stages):
        name = next(n for n, q in model.named_parameters() if q is p)
        # HF's loss is float32: its rounding carries into the gradients (about 1e-7)
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-9, msg=name)
    pipe.close()


def test_warn_false_says_nothing_and_leaves_the_warning_for_later() -> None:
    class Scaled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Scaled(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_deferrable(model, WeightGradStore(), where="stage 0", warn=False) == 1
    with pytest.warns(UserWarning, match=r"stage 0\.1 .*overrides nn\.Linear\.forward"):
        assert make_deferrable(model, WeightGradStore(), where="stage 0") == 1
