"""No silent NaN from padding: ``causal_lm_loss`` with micro-batches (or a whole batch) that
hold no valid token, under both reductions, on 2 gloo ranks and in one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphpipe.models import causal_lm_loss, causal_lm_num_items
from tests.spawn import run_ranks

V, D, T, ROWS, M = 11, 6, 5, 8, 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(self.emb(ids)))


class Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, V)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h)


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [m.double() for m in (Embed(), Mid(), Mid(), Head())]


def _batch(empty: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (ROWS, T), generator=g)
    labels = ids.clone()
    labels[torch.rand(ROWS, T, generator=g) < 0.3] = -100
    per = ROWS // M
    for i in empty:
        labels[i * per : (i + 1) * per] = -100
    return ids, labels


def _run(rank: int, world: int, reduction: str, empty: tuple[int, ...]) -> dict:
    import graphpipe

    stages = _stages()
    mine = [stages[rank], stages[3 - rank]]
    pipe = graphpipe.DualPipeV(
        mine, num_microbatches=M, loss_fn=causal_lm_loss, loss_reduction=reduction
    )
    ids, labels = _batch(empty)
    kw = {"num_items_in_batch": causal_lm_num_items(labels)} if reduction == "sum" else {}
    try:
        loss = pipe.step(ids if rank == 0 else None, labels if rank == 0 else None, **kw)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    grads = {
        (pipe.stage_ids[i], n): p.grad.clone()
        for i, m in enumerate(mine)
        for n, p in m.named_parameters()
    }
    return {"loss": loss.clone(), "grads": grads}


def _one_process(empty: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
    stages = _stages()
    ids, labels = _batch(empty)
    h = ids
    for s in stages:
        h = s(h)
    loss = causal_lm_loss(h, labels, num_items_in_batch=causal_lm_num_items(labels))
    loss.backward()
    grads = {(i, n): p.grad.clone() for i, s in enumerate(stages) for n, p in s.named_parameters()}
    return loss.detach(), grads


@pytest.mark.distributed
def test_an_empty_microbatch_under_mean_is_refused_on_every_rank_naming_it():
    results = run_ranks(_run, 2, "mean", (1,))
    assert results[0]["error"].startswith("ValueError: micro-batch 1 (rows 2 to 3) has no valid")
    assert "loss_reduction='sum'" in results[0]["error"]
    # the other rank names the rank, the micro-batch and the remedy too
    assert results[1]["error"].startswith(
        "PipelineError: rank 0 rejected this batch (ValueError: micro-batch 1"
    )
    assert "loss_reduction='sum'" in results[1]["error"]


@pytest.mark.distributed
@pytest.mark.parametrize("empty", [(1,), (0, 1, 2, 3)], ids=["one-empty", "all-empty"])
def test_empty_microbatches_under_sum_equal_one_process(empty):
    results = run_ranks(_run, 2, "sum", empty)
    loss, grads = _one_process(empty)
    if len(empty) == M:  # no valid token at all: 0 (HF divides by 0: NaN), no gradient
        assert loss.item() == 0.0
        assert all(not g.any() for g in grads.values())
    for res in results:
        assert "error" not in res, res
        torch.testing.assert_close(res["loss"], loss.to(res["loss"].dtype), rtol=1e-6, atol=1e-7)
        for key, g in res["grads"].items():
            # float32 cross-entropy (logits.float(), as HF does): float32 rounding
            torch.testing.assert_close(g, grads[key], rtol=1e-5, atol=1e-7, msg=str(key))


def test_causal_lm_loss_of_no_valid_token_is_zero_not_nan():
    logits = torch.randn(2, 3, V, requires_grad=True)
    labels = torch.full((2, 3), -100)
    for count in (causal_lm_num_items(labels), 0):
        loss = causal_lm_loss(logits, labels, num_items_in_batch=count)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, logits)
        assert not grad.any()
    # with valid tokens it is still the sum over the count
    labels[0, 1] = 4
    loss = causal_lm_loss(logits, labels, num_items_in_batch=causal_lm_num_items(labels))
    torch.testing.assert_close(loss, F.cross_entropy(logits[0, 0:1].float(), labels[0, 1:2]))
