"""Keyword values given per micro-batch, of any structure (``graphpipe.PerMicrobatch``): a
dataclass of tensors and a FlexAttention ``BlockMask`` reach every stage that takes them,
eager and captured, against a single-process reference; what differs is refused by name."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import graphpipe
from graphpipe.runtime.structured import check_capturable, check_captured, structures
from tests.spawn import run_ranks

flex = pytest.importorskip(
    "torch.nn.attention.flex_attention", reason="this torch has no FlexAttention BlockMask"
)
BlockMask = flex.BlockMask

DIM, ROWS, M = 6, 8, 4
# The pipeline computes per micro-batch as the reference does, but sums the micro-batch
# gradients (deferred Linear GEMMs into .grad) in another order: float64 rounding.
RTOL, ATOL = 1e-10, 1e-12


@dataclasses.dataclass
class Ctx:
    """A dataclass of tensors with a constant: what every stage takes as ``ctx``."""

    scale: torch.Tensor  # [rows of the micro-batch, DIM]
    shift: torch.Tensor  # [DIM]
    tag: str = "a"


def block_mask(counts: torch.Tensor) -> BlockMask:
    """A BlockMask built from its tensors (no mask_mod closure): its kv_num_blocks vary."""
    kv_num_blocks = counts.view(1, 1, 2).to(torch.int32)
    kv_indices = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=128)


class Block(nn.Module):
    def __init__(self, takes_mask: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.takes_mask = takes_mask

    def body(self, x, ctx, bm):
        h = x + torch.tanh(self.fc(x)) * ctx.scale + ctx.shift
        if bm is not None:  # the mask's tensors weigh the activation
            h = h * (1 + 0.1 * bm.kv_num_blocks.to(h.dtype).sum())
        return h

    def forward(self, x, *, ctx):
        return self.body(x, ctx, None)


class MaskBlock(Block):
    def forward(self, x, *, ctx, bm):
        return self.body(x, ctx, bm)


def build(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [(MaskBlock(True) if i % 2 else Block(False)).double() for i in range(num_stages)]


def step_data(step: int, tag: str = "a") -> tuple:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    rows = ROWS // M
    ctxs = [
        Ctx(
            torch.rand(rows, DIM, generator=g, dtype=torch.float64),
            torch.randn(DIM, generator=g, dtype=torch.float64),
            tag,
        )
        for _ in range(M)
    ]
    masks = [block_mask(torch.randint(0, 3, (2,), generator=g)) for _ in range(M)]
    return x, y, ctxs, masks


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def reference(steps: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    stages = build(4)
    losses, grads = [], []
    for step in range(steps):
        x, y, ctxs, masks = step_data(step)
        for s in stages:
            s.zero_grad()
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M), strict=True)):
            h = xm
            for s in stages:
                kw = {"ctx": ctxs[i], **({"bm": masks[i]} if s.takes_mask else {})}
                h = s(h, **kw)
            loss = loss_fn(h, ym) / M
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append([p.grad.clone() for s in stages for p in s.parameters()])
    return losses, grads


def _train(rank: int, world: int, capture: str | bool, steps: int, bad: str) -> dict:
    stages = build(2 * world)
    mine = [stages[rank], stages[2 * world - 1 - rank]]
    pipe = graphpipe.DualPipeV(mine, num_microbatches=M, loss_fn=loss_fn, capture=capture)
    losses, grads, error = [], [], None
    for step in range(steps):
        tag = "b" if bad == "constant" and step == steps - 1 else "a"
        if bad == "rank" and rank == 1:
            tag = "b"
        x, y, ctxs, masks = step_data(step, tag)
        for s in mine:
            s.zero_grad()
        kw = {"ctx": graphpipe.PerMicrobatch(ctxs), "bm": graphpipe.PerMicrobatch(masks)}
        try:
            loss = pipe.step(x if rank == 0 else None, y if rank == 0 else None, **kw)
        except (ValueError, graphpipe.PipelineError) as e:
            error = f"{type(e).__name__}: {e}"
            break
        losses.append(float(loss))
        grads.append([p.grad.clone() for s in mine for p in s.parameters()])
    pipe.close()
    return {"losses": losses, "grads": grads, "error": error}


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("capture", [False, "step"])
def test_structured_keywords_reach_every_stage_eager_and_captured(capture) -> None:
    steps = 3  # captured: warmup, static step, replay, each with new values
    want_losses, want_grads = reference(steps)
    results = run_ranks(_train, 2, capture, steps, "", timeout=300)
    for r, res in enumerate(results):
        assert res["error"] is None, res["error"]
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL
        )
        ids = [r, 3 - r]
        for got, want in zip(res["grads"], want_grads, strict=True):
            per_stage = [want[2 * i : 2 * i + 2] for i in ids]  # fc.weight, fc.bias
            for a, b in zip(got, [t for ts in per_stage for t in ts], strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_a_captured_step_refuses_another_constant_naming_it() -> None:
    results = run_ranks(_train, 2, "step", 3, "constant", timeout=300)
    assert "keyword 'ctx'" in results[0]["error"], results[0]["error"]
    assert "tag='b'" in results[0]["error"] and "tag='a'" in results[0]["error"]
    assert len(results[0]["losses"]) == 2
    assert "PipelineError" in results[1]["error"] or "keyword 'ctx'" in results[1]["error"]


def test_ranks_passing_other_structures_are_refused_on_every_rank() -> None:
    results = run_ranks(_train, 2, False, 1, "rank", timeout=300)
    for res in results:
        assert "PerMicrobatch keyword values of different structures" in res["error"]
        assert "rank 1 differs from rank 0" in res["error"]
        assert res["losses"] == []


# ------------------------------------------------------------------ one process
def test_values_must_share_one_structure_and_hold_a_tensor() -> None:
    rows = torch.ones(2, DIM)
    with pytest.raises(ValueError, match=r"micro-batch 1's value\.scale is tensor\[3, 6\]"):
        graphpipe.PerMicrobatch([Ctx(rows, rows[0]), Ctx(torch.ones(3, DIM), rows[0])])
    with pytest.raises(ValueError, match=r"tag='b'.*not.*tag='a'"):
        graphpipe.PerMicrobatch([Ctx(rows, rows[0]), Ctx(rows, rows[0], "b")])
    with pytest.raises(TypeError, match="hold no tensor"):
        graphpipe.PerMicrobatch([1, 2])
    with pytest.raises(TypeError, match="non-empty list"):
        graphpipe.PerMicrobatch([])


def test_one_rank_pipeline_refuses_a_wrong_count_and_checks_structures() -> None:
    stages = build(2)
    pipe = graphpipe.DualPipeV(stages, num_microbatches=M, loss_fn=loss_fn)
    x, y, ctxs, masks = step_data(0)
    with pytest.raises(ValueError, match=r"PerMicrobatch of 3 values.*num_microbatches=4"):
        pipe.step(x, y, ctx=graphpipe.PerMicrobatch(ctxs[:3]), bm=graphpipe.PerMicrobatch(masks))
    kw = {"ctx": graphpipe.PerMicrobatch(ctxs), "bm": graphpipe.PerMicrobatch(masks)}
    pipe.step(x, y, **kw)  # works after the refusal
    other = {"ctx": graphpipe.PerMicrobatch([dataclasses.replace(c, tag="z") for c in ctxs])}
    with pytest.raises(ValueError, match=r"keyword 'ctx'.*tag='z'"):
        check_captured(structures(kw), other)


def test_a_closure_over_tensors_reads_its_static_buffers() -> None:
    """A mask_mod closing over document ids: its tensor is part of the value, so a rebuilt
    value (what a captured step holds) reads the static buffer, refreshed by a copy."""

    def document_mask(ids):
        def same_document(b, h, q, kv):
            return ids[q] == ids[kv]

        return same_document

    values = [{"mask_mod": document_mask(torch.tensor([0, 0, 1, 1]) * i)} for i in range(2)]
    given = graphpipe.PerMicrobatch(values)
    static = given.over([torch.zeros_like(t) for t in given])
    rebuilt = static.microbatches(2, torch.device("cpu"))
    q = torch.arange(4)
    assert bool(rebuilt[1]["mask_mod"](0, 0, q[:, None], q[None, :]).all())  # zeros: one doc
    static[0].copy_(given[0])  # what a replay's copy does
    want = values[1]["mask_mod"](0, 0, q[:, None], q[None, :])
    assert torch.equal(rebuilt[1]["mask_mod"](0, 0, q[:, None], q[None, :]), want)
    assert not bool(want.all())
    check_capturable({"m": given})  # nothing hidden from the static buffers


def test_capture_refuses_tensors_it_cannot_reach_naming_them() -> None:
    def mod(b, h, q, kv, ids):
        return ids[q] == ids[kv]

    value = graphpipe.PerMicrobatch(
        [{"mask_mod": functools.partial(mod, ids=torch.arange(4)), "t": torch.ones(1)}]
    )
    with pytest.raises(ValueError, match=r"functools\.partial of .*mod.*holds tensors"):
        check_capturable({"m": value})
