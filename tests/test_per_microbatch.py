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
from graphpipe.runtime.core.structured import (
    ConstantChanged,
    check_capturable,
    check_captured,
    structures,
)
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
    assert "ConstantChanged" in results[0]["error"]
    assert (
        "the value.tag changed since the step was captured: it is 'b', not 'a'"
        in (results[0]["error"])
    )
    assert len(results[0]["losses"]) == 2
    assert "PipelineError" in results[1]["error"] or "keyword 'ctx'" in results[1]["error"]


def test_ranks_passing_other_structures_are_refused_on_every_rank() -> None:
    results = run_ranks(_train, 2, False, 1, "rank", timeout=300)
    for res in results:
        assert "PerMicrobatch keyword values of different structures" in res["error"]
        assert "rank 1 differs from rank 0" in res["error"]
        assert res["losses"] == []


# ------------------------------------------- constants without tensors (issue 40, k03-k05)
# A value part that holds no tensor is a constant of a captured step: compared by value
# before every replay (a change is refused by name, or recaptured with recapture=True) and
# across the micro-batches before the warmup (the capture rebuilds all on micro-batch 0's).


class Rule:
    """A constant object without tensors (and without ``__eq__``): how a stage weighs."""

    def __init__(self, gain: float) -> None:
        self.gain = gain


@dataclasses.dataclass
class Ruled:
    """k03: a dataclass whose field ``rule`` holds a constant object."""

    scale: torch.Tensor  # [rows of the micro-batch, DIM]
    rule: Rule


def window_mask(window: float):
    """k04: a mask_mod closing over a float and no tensor (a constant as a whole)."""

    def mask_mod(q, kv):
        return (q - kv).abs() <= window

    return mask_mod


def document_window_mask(ids: torch.Tensor, window: float):
    """k04: a mask_mod closing over document ids (a tensor) and a float window."""

    def mask_mod(q, kv):
        return (ids[q] == ids[kv]) & ((q - kv).abs() <= window)

    return mask_mod


# Where each kind's constant sits inside the value (closure cells go by name: ids, window).
PLACES = {
    "object": "value.rule.gain",
    "closure": "value['mask_mod'].<closure 0>",
    "closure_ids": "value['mask_mod'].<closure 1>",
}


class KeyedBlock(nn.Module):
    """A stage that reads the constant of its ``ctx`` (the features stand in for tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x, *, ctx):
        if isinstance(ctx, Ruled):
            return x + torch.tanh(self.fc(x)) * ctx.scale * ctx.rule.gain
        q = torch.arange(DIM)
        mask = ctx["mask_mod"](q[:, None], q[None, :]).to(x.dtype)
        return x + (torch.tanh(self.fc(x)) * ctx["scale"]) @ mask


def keyed_stages() -> list[nn.Module]:
    torch.manual_seed(1)
    return [KeyedBlock().double() for _ in range(4)]


def keyed_data(kind: str, step: int, consts: list[float]) -> tuple:
    """Step ``step``'s batch and per-micro-batch values, built anew (new objects and
    functions every step) around the constants ``consts`` (one per micro-batch)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    values = []
    for c in consts:
        scale = torch.rand(ROWS // M, DIM, generator=g, dtype=torch.float64) + 0.5
        if kind == "object":
            values.append(Ruled(scale, Rule(c)))
        elif kind == "closure":
            values.append({"scale": scale, "mask_mod": window_mask(c)})
        else:
            ids = torch.randint(0, 2, (DIM,), generator=g)
            values.append({"scale": scale, "mask_mod": document_window_mask(ids, c)})
    return x, y, values


def changed_at_3(step: int) -> list[float]:
    """k03/k04: one constant for all micro-batches, another from step 3 on."""
    return [1.0 if step < 3 else 3.0] * M


def per_microbatch(step: int) -> list[float]:
    """k05: a constant of its own per micro-batch."""
    return [1.0 + i for i in range(M)]


def keyed_reference(kind: str, steps: int, consts) -> tuple[list[float], list[list]]:
    """One process, micro-batch by micro-batch, each with its own value."""
    stages = keyed_stages()
    losses, grads = [], []
    for step in range(steps):
        x, y, values = keyed_data(kind, step, consts(step))
        for s in stages:
            s.zero_grad()
        total = 0.0
        for xm, ym, v in zip(x.chunk(M), y.chunk(M), values, strict=True):
            h = xm
            for s in stages:
                h = s(h, ctx=v)
            loss = loss_fn(h, ym) / M
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append([p.grad.clone() for s in stages for p in s.parameters()])
    return losses, grads


def _keyed_train(
    rank: int, world: int, kind: str, capture, recapture: bool, steps: int, consts
) -> dict:
    stages = keyed_stages()
    mine = [stages[rank], stages[2 * world - 1 - rank]]
    pipe = graphpipe.DualPipeV(
        mine, num_microbatches=M, loss_fn=loss_fn, capture=capture, recapture=recapture
    )
    losses, grads, error = [], [], None
    for step in range(steps):
        x, y, values = keyed_data(kind, step, consts(step))
        for s in mine:
            s.zero_grad()
        try:
            loss = pipe.step(
                x if rank == 0 else None,
                y if rank == 0 else None,
                ctx=graphpipe.PerMicrobatch(values),
            )
        except (ValueError, graphpipe.PipelineError) as e:
            error = f"{type(e).__name__}: {e}"
            break
        losses.append(float(loss))
        grads.append([p.grad.clone() for s in mine for p in s.parameters()])
    pipe.close()
    return {"losses": losses, "grads": grads, "error": error}


def assert_matches(results: list[dict], want_losses: list, want_grads: list) -> None:
    for r, res in enumerate(results):
        assert len(res["losses"]) == len(want_losses), res["error"]
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL
        )
        for got, want in zip(res["grads"], want_grads, strict=True):
            ids = [r, 3 - r]
            per_stage = [want[2 * i : 2 * i + 2] for i in ids]  # fc.weight, fc.bias
            for a, b in zip(got, [t for ts in per_stage for t in ts], strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["object", "closure", "closure_ids"])
def test_a_constant_changed_after_capture_is_refused_naming_it(kind: str) -> None:
    """k03 (object), k04 (closure, closure_ids): steps 0-2 bring new objects with equal
    constants (warmup, capture, replay: exact); step 3 another constant: refused by name
    before the replay, which would bake in the captured one."""
    results = run_ranks(_keyed_train, 2, kind, "step", False, 4, changed_at_3, timeout=300)
    want_losses, want_grads = keyed_reference(kind, 3, changed_at_3)
    err = results[0]["error"]
    assert err is not None and err.startswith("ConstantChanged: keyword 'ctx'"), err
    assert f"the {PLACES[kind]} changed since the step was captured: it is 3.0, not 1.0" in err
    assert "recapture=True" in err and "as a tensor" in err
    assert "ConstantChanged" in results[1]["error"] or "PipelineError" in results[1]["error"]
    assert_matches(results, want_losses, want_grads)  # the steps before, exact


@pytest.mark.parametrize("kind", ["object", "closure", "closure_ids"])
def test_a_constant_changed_after_capture_is_recaptured_exactly(kind: str) -> None:
    """k03/k04 with recapture=True: the change at step 3 discards the capture and captures
    anew (3 warmup, 4 capture, 5 replay), every step exact."""
    results = run_ranks(_keyed_train, 2, kind, "step", True, 6, changed_at_3, timeout=300)
    for res in results:
        assert res["error"] is None, res["error"]
    assert_matches(results, *keyed_reference(kind, 6, changed_at_3))


@pytest.mark.parametrize("kind", ["object", "closure"])
def test_constants_differing_between_microbatches_are_refused_under_capture(kind) -> None:
    """k05: per-micro-batch constants that differ are refused at the warmup, naming the
    micro-batch and the place (a captured step would replay micro-batch 0's for all);
    eager passes each micro-batch its own value and is exact."""
    results = run_ranks(_keyed_train, 2, kind, "step", True, 2, per_microbatch, timeout=300)
    for res in results:
        assert res["losses"] == []
        assert res["error"] is not None and "keyword 'ctx'" in res["error"], res["error"]
    want = f"micro-batch 1's {PLACES[kind]} differs from micro-batch 0's: it is 2.0, not 1.0"
    assert want in results[0]["error"], results[0]["error"]
    assert "run without capture" in results[0]["error"]
    eager = run_ranks(_keyed_train, 2, kind, False, False, 2, per_microbatch, timeout=300)
    assert_matches(eager, *keyed_reference(kind, 2, per_microbatch))


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
    with pytest.raises(ConstantChanged, match=r"keyword 'ctx': the value\.tag .* 'z', not 'a'"):
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


def _change(before, after) -> str | None:
    """What ``check_captured`` says of a step whose constant ``after`` replaces the
    captured ``before`` (None: accepted)."""
    t = torch.ones(2)
    captured = {"k": graphpipe.PerMicrobatch([{"t": t, "c": before}])}
    check_capturable(captured)
    given = {"k": graphpipe.PerMicrobatch([{"t": t.clone(), "c": after}])}
    try:
        check_captured(structures(captured), given)
    except ConstantChanged as e:
        return str(e)
    return None


def test_constants_are_compared_by_value() -> None:
    """The comparison rules: by value where a replay would bake the value in, by identity
    where there is nothing else to compare, bounded on cycles."""
    cyclic = Rule(1.0)
    cyclic.me = cyclic
    module = nn.Linear(1, 1)

    class NoEq:  # no attributes and an == that raises: known equal only to itself
        __slots__ = ()

        def __eq__(self, other):
            raise RuntimeError("cannot compare")

    odd = NoEq()

    def with_default(q, w=1.0):
        return q * w

    def other_default(q, w=2.0):
        return q * w

    accepted = [
        (float("nan"), float("nan")),
        (Rule(2.0), Rule(2.0)),  # new objects, equal attributes
        (window_mask(1.0), window_mask(1.0)),  # new functions, equal code and cells
        (functools.partial(with_default, w=3), functools.partial(with_default, w=3)),
        (torch, torch),
        (module, module),
        (cyclic, cyclic),
        (odd, odd),
        ({1, 2}, {2, 1}),
    ]
    for before, after in accepted:
        assert _change(before, after) is None, (before, after)
    refused = [
        (0.0, -0.0, "the value['c'] changed since the step was captured: it is -0.0, not 0.0"),
        (1, 1.0, "it is 1.0, not 1"),
        (Rule(2.0), Rule(2.5), "the value['c'].gain changed"),
        (window_mask(1.0), window_mask(2.0), "the value['c'].<closure 0> changed"),
        (lambda q: q + 1, lambda q: q + 2, "with other code"),
        (with_default, other_default, "is the function"),
        (functools.partial(with_default, w=3), functools.partial(with_default, w=4), "keywords"),
        (module, nn.Linear(1, 1), "compared by identity"),
        (odd, NoEq(), "the value['c'] changed"),
        (
            Rule([1, 2]),
            Rule([1, 2, 3]),
            "the value['c'].gain changed since the step was captured: it is [1, 2, 3], not [1, 2]",
        ),
    ]
    for before, after, want in refused:
        said = _change(before, after)
        assert said is not None and want in said, (before, after, said)
        assert said.startswith("keyword 'k': ") and "recapture=True" in said


def test_a_constant_changed_in_place_and_a_recapture_that_could_not_serve() -> None:
    """The captured constants are a snapshot: changing the captured object in place is a
    change. A change whose new value hides tensors from capture is refused as at a warmup
    (``recapture=True`` would capture it), not reported as a mere change."""
    rule = Rule(2.0)
    t = torch.ones(2)
    value = graphpipe.PerMicrobatch([Ruled(t, rule)])
    captured = structures(value_kw := {"k": value})
    check_captured(captured, value_kw)  # the same value, unchanged: accepted
    rule.gain = 4.0
    with pytest.raises(ConstantChanged, match=r"the value\.rule\.gain .* it is 4\.0, not 2\.0"):
        check_captured(captured, {"k": graphpipe.PerMicrobatch([Ruled(t, rule)])})

    def mod(q, kv, ids=None):
        return q == kv

    kw = {"k": graphpipe.PerMicrobatch([{"t": t, "f": functools.partial(mod, ids=None)}])}
    hidden = {"k": graphpipe.PerMicrobatch([{"t": t, "f": functools.partial(mod, ids=t)}])}
    with pytest.raises(ValueError, match=r"functools\.partial .*holds tensors") as e:
        check_captured(structures(kw), hidden)
    assert not isinstance(e.value, ConstantChanged)
