"""Keyword tensors are checked like inputs: their rows, their routing to a ``loss_fn`` module,
and their names against ``step``'s own parameters (one process; the refusal on every rank of
a spawned pipeline: tests/test_keywords.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphpipe

DIM = 4


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM).double()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * mask


class Named(nn.Module):
    """A stage taking keywords named like ``step``'s positional parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM).double()

    def forward(self, x: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor):
        return self.fc(x) + inputs - labels


def _pipe(stages, loss_fn=None, **kw) -> graphpipe.Pipeline:
    return graphpipe.Pipeline(
        stages,
        schedule="1f1b",
        num_microbatches=4,
        loss_fn=loss_fn if loss_fn is not None else nn.MSELoss(),
        **kw,
    )


def _batch(rows: int = 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    y = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    return x, y


def test_a_keyword_tensor_with_fewer_rows_than_the_batch_is_refused_naming_both_sizes():
    pipe = _pipe([Masked()])
    x, y = _batch()
    with pytest.raises(ValueError, match=r"keyword tensor 'mask' has 4 rows but the inputs have 8"):
        pipe.step(x, y, mask=torch.ones(4, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"keyword tensor 'mask' has 4 rows but the inputs"):
        pipe.forward(x, mask=torch.ones(4, 1, dtype=torch.float64))
    # the right rows train, and equal the whole batch in one process
    mask = (torch.arange(8) % 3 != 0).double().unsqueeze(1)
    loss = pipe.step(x, y, mask=mask)
    torch.testing.assert_close(loss, nn.functional.mse_loss(pipe.modules[0](x, mask), y))


def test_labels_with_other_rows_than_the_inputs_are_refused():
    pipe = _pipe([Masked()])
    x, y = _batch()
    with pytest.raises(ValueError, match=r"labels\[0\] has 4 rows but the inputs have 8"):
        pipe.step(x, y[:4], mask=torch.ones(8, 1, dtype=torch.float64))


def test_a_loss_fn_module_gets_only_the_keywords_its_forward_takes():
    # nn.MSELoss's __call__ takes **kwargs, its forward (input, target) no keyword: the mask
    # goes to the stage only (it raised "unexpected keyword argument 'mask'" in MSELoss).
    pipe = _pipe([Masked()], loss_fn=nn.MSELoss())
    x, y = _batch()
    mask = torch.ones(8, 1, dtype=torch.float64)
    loss = pipe.step(x, y, mask=mask)
    assert torch.isfinite(loss)

    class WeightedLoss(nn.Module):
        def forward(self, out, target, mask):
            return ((out - target) ** 2 * mask).mean()

    pipe = _pipe([Masked()], loss_fn=WeightedLoss())
    half = (torch.arange(8) < 4).double().unsqueeze(1)
    loss = pipe.step(x, y, mask=half)
    out = pipe.modules[0](x, half)
    # equal micro-batches: the mean of their means is the mean over the whole batch
    torch.testing.assert_close(loss, ((out - y) ** 2 * half).mean())


def test_keyword_tensors_may_be_named_inputs_or_labels_but_not_scaler():
    pipe = _pipe([Named()])
    x, y = _batch()
    a, b = _batch(8)
    loss = pipe.step(x, y, inputs=a, labels=b)
    want = nn.functional.mse_loss(pipe.modules[0](x, a, b), y)
    torch.testing.assert_close(loss, want)
    with pytest.raises(ValueError, match="a keyword tensor cannot be named 'scaler'"):
        pipe.step(x, y, scaler=torch.ones(8))
