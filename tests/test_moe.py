"""Mixture of experts without processes: router, capacity, drops, aux loss, the chunked
backward, the overlapped pair and a one-rank DualPipeV (eager and static replay)."""

from __future__ import annotations

import math

import pytest
import torch

import graphpipe
from graphpipe.models import (
    LlamaConfig,
    LlamaLoss,
    LlamaMoEStage,
    MoEEvent,
    build_model,
    build_stages,
    dropped_tokens,
    expert_layout,
    expert_parameters,
    is_expert_parameter,
    reset_dropped_tokens,
    unique_parameters,
)
from graphpipe.models.moe import MoEMLP, expert_capacity, route_top_k

F64 = torch.float64


def _config(**kw) -> LlamaConfig:
    base = dict(hidden=16, n_layers=2, n_heads=2, max_seq_len=8, use_kernels=False)
    base.update(num_experts=4, top_k=2, capacity_factor=1.0)
    base.update(kw)
    return LlamaConfig(**base)


def _tokens(rows: int, seq: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 256, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _grads(modules) -> dict:
    return {
        (i, n): p.grad.clone()
        for i, m in enumerate(modules)
        for n, p in m.named_parameters()
        if p.grad is not None
    }


# --------------------------------------------------------------------------- routing


def test_capacity_is_ceil_of_factor_times_tokens_times_k_over_experts() -> None:
    assert expert_capacity(16, 4, 2, 1.0) == 8
    assert expert_capacity(10, 4, 1, 1.25) == math.ceil(1.25 * 10 / 4) == 4
    assert expert_capacity(16, 4, 2, 100.0) == 16  # never more than the tokens
    assert expert_capacity(3, 64, 1, 0.1) == 1  # never less than one slot
    moe = MoEMLP(8, 8, 4, 2, 1.5, 0.0, lambda g, u: g * u)
    assert moe.capacity(6) == math.ceil(1.5 * 6 * 2 / 4)


def test_first_choices_take_slots_before_second_choices_and_drops_are_counted() -> None:
    # 3 tokens, 3 experts, k=2, capacity 1. Token 0 prefers e2 then e0; tokens 1 and 2 prefer
    # e0 then e1 (token 2 likes e1 less than token 1 does). Choice-major priority: first
    # choices in token order (t0->e2, t1->e0, t2->e0 dropped), then second choices
    # (t0->e0 dropped: e0 is full; t1->e1; t2->e1 dropped).
    logits = torch.tensor([[2.0, 0.0, 3.0], [3.0, 2.0, 0.0], [3.0, 1.0, 0.0]], dtype=F64)
    r = route_top_k(logits, top_k=2, capacity=1)
    e_c = 3 * 1  # the spare slot index for dropped assignments
    assert r.slots.tolist() == [2, 0, e_c, e_c, 1, e_c]
    assert r.dropped.dtype == torch.int64 and r.dropped.dim() == 0
    assert torch.equal(r.dropped, torch.tensor(3))
    # bitwise: the routing weights are this same softmax of the same logits, only selected
    probs = torch.softmax(logits, -1)
    want = torch.stack(
        [probs[0, 2], probs[1, 0], probs[2, 0], probs[0, 0], probs[1, 1], probs[2, 1]]
    )
    torch.testing.assert_close(r.weights, want, rtol=0, atol=0)


def test_aux_loss_is_switch_formula_and_one_when_balanced() -> None:
    logits = torch.randn(12, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    r = route_top_k(logits, top_k=2, capacity=12)
    probs = torch.softmax(logits, -1)
    counts = torch.zeros(4, dtype=F64)
    for row in probs.topk(2, dim=-1).indices:
        for e in row:
            counts[e] += 1
    want = 4 * sum(counts[e] / 24 * probs[:, e].mean() for e in range(4))
    torch.testing.assert_close(r.aux, want.reshape(1))
    balanced = torch.eye(4, dtype=F64) * 50  # token i goes to expert i with probability ~1
    torch.testing.assert_close(route_top_k(balanced, 1, 4).aux, torch.ones(1, dtype=F64))


def _naive_moe(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the kept choices' expert outputs weighted by their probabilities."""
    n = x.shape[0]
    probs = torch.softmax(moe.router(x), -1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    cap, used = moe.capacity(n), [0] * moe.num_experts
    out = torch.zeros_like(x)
    for j in range(moe.top_k):
        for t in range(n):
            e = int(top_e[t, j])
            if used[e] >= cap:
                continue
            used[e] += 1
            h = torch.nn.functional.silu(x[t] @ moe.w_gate[e]) * (x[t] @ moe.w_up[e])
            out[t] += top_p[t, j] * (h @ moe.w_down[e])
    return out


@pytest.mark.parametrize(("top_k", "factor"), [(1, 1.0), (2, 0.5), (2, 2.0), (3, 1.0)])
def test_moe_layer_matches_a_token_by_token_reference_with_drops(top_k: int, factor: float) -> None:
    torch.manual_seed(0)
    moe = MoEMLP(8, 12, 4, top_k, factor, 0.01, lambda g, u: torch.nn.functional.silu(g) * u)
    moe = moe.to(F64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    moe.dropped.zero_()
    x = torch.randn(2, 5, 8, dtype=F64)
    out, aux = moe(x)
    torch.testing.assert_close(out.reshape(10, 8), _naive_moe(moe, x.reshape(10, 8)))
    assert aux.shape == (1,)
    r = route_top_k(moe.router(x.reshape(10, 8)), top_k, moe.capacity(10))
    torch.testing.assert_close(aux, r.aux * 0.01)
    assert torch.equal(moe.dropped, r.dropped)


def test_dropped_tokens_add_up_on_the_device_and_reset() -> None:
    model = build_model(_config(capacity_factor=0.5), dtype=F64)
    x, _ = _tokens(2)
    with torch.no_grad():
        model(x)
        once = dropped_tokens(model).clone()
        model(x)
    assert once.dtype == torch.int64 and once > 0
    assert torch.equal(dropped_tokens(model), 2 * once)
    reset_dropped_tokens(model)
    assert torch.equal(dropped_tokens(model), torch.tensor(0))
    # capacity_factor = E / k: every expert can take every token: nothing is dropped
    roomy = build_model(_config(capacity_factor=2.0), dtype=F64)
    with torch.no_grad():
        roomy(x)
    assert torch.equal(dropped_tokens(roomy), torch.tensor(0))


# --------------------------------------------------------------------------- the model


def test_moe_config_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="top_k=5, num_experts=4"):
        _config(top_k=5)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        _config(capacity_factor=0)
    with pytest.raises(ValueError, match="num_experts=-1"):
        _config(num_experts=-1)
    with pytest.raises(ValueError, match="moe_every=0"):
        _config(moe_every=0)
    with pytest.raises(ValueError, match="aux_loss_coef=nan"):
        _config(aux_loss_coef=float("nan"))


def test_moe_every_keeps_dense_blocks_and_marks_only_expert_weights() -> None:
    cfg = _config(n_layers=4, moe_every=2)
    (stage,) = build_stages(cfg, 1, dtype=F64)
    assert isinstance(stage, LlamaMoEStage)
    kinds = [type(b.mlp).__name__ for b in stage.layers]
    assert kinds == ["MLP", "MoEMLP", "MLP", "MoEMLP"]
    experts = expert_parameters(stage)
    assert len(experts) == 6
    assert {id(p) for p in experts} == {id(p) for p in stage.parameters() if is_expert_parameter(p)}
    assert experts[0].shape == (4, 16, cfg.ffn_dim)
    assert not is_expert_parameter(stage.layers[1].mlp.router.weight)
    dense = build_stages(LlamaConfig(hidden=16, n_layers=2, n_heads=2, use_kernels=False), 1)
    assert type(dense[0]).__name__ == "LlamaStage"


def test_stages_return_hidden_and_aux_and_the_loss_adds_aux() -> None:
    cfg = _config(aux_loss_coef=0.5)
    stages = build_stages(cfg, 3, dtype=F64)
    x, y = _tokens(2)
    with torch.no_grad():
        h, aux0 = stages[0](x)
        h, aux1 = stages[1](h, aux0)
        logits, aux2 = stages[2](h, aux1)
    assert h.shape == (2, 8, 16) and logits.shape == (2, 8, 256)
    assert aux0.shape == aux2.shape == (1,)
    # blocks per stage [1, 1, 0]: each stage adds its blocks' share; the head adds nothing
    # (it passes aux on untouched, hence bitwise)
    assert 0 < float(aux0) < float(aux1) and torch.equal(aux1, aux2)
    ce = LlamaLoss(False)(logits, y)
    torch.testing.assert_close(LlamaLoss(False)((logits, aux2), y), ce + aux2[0])


def test_chunked_backward_equals_unchunked_backward() -> None:
    x, y = _tokens(2)
    results = []
    for chunked in (True, False):
        model = build_model(_config(capacity_factor=0.75), dtype=F64)
        model.chunked = chunked
        loss = LlamaLoss(False)(model(x), y)
        loss.backward()
        results.append((loss.detach(), _grads([model])))
    (la, ga), (lb, gb) = results
    # The loss bitwise: chunking cuts the autograd graph, the forward runs the same kernels in
    # the same order. The gradients within float64 rounding: the chunked backward sums a
    # tensor's gradient contributions chunk by chunk, in another order than one graph does
    # (1e-12 relative; 1e-15 absolute for elements that cancel to about 0).
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for key in ga:
        torch.testing.assert_close(ga[key], gb[key], rtol=1e-12, atol=1e-15, msg=str(key))


def _pair_case(use_hook: bool, last: bool):
    """Stage 1 of 2 (``last``) or stage 0 of 2 (hidden in and out) of a fresh model: the F of
    micro-batch b, then the F of a with the B of b, paired or one after the other."""
    stages = build_stages(_config(capacity_factor=0.75), 2, dtype=F64)
    stage = stages[1] if last else stages[0]
    stage.events = []
    xa, _ = _tokens(2, seed=1)
    xb, yb = _tokens(2, seed=2)
    if last:
        with torch.no_grad():
            ha, hb = stages[0](xa), stages[0](xb)
        ins_a = tuple(t.detach().requires_grad_() for t in ha)
        ins_b = tuple(t.detach().requires_grad_() for t in hb)
    else:
        ins_a, ins_b = (xa,), (xb,)
    out_b = stage(*ins_b)
    if last:
        tensors, grads = (LlamaLoss(False)(out_b, yb),), (torch.tensor(0.5, dtype=F64),)
    else:
        tensors = out_b
        g = torch.Generator().manual_seed(5)
        grads = tuple(torch.randn(t.shape, dtype=F64, generator=g) for t in out_b)
    if use_hook:
        out_a = LlamaMoEStage.overlapped_forward_backward(stage, ins_a, stage, tensors, grads)
    else:
        out_a = stage(*ins_a)
        torch.autograd.backward(tensors, grads)
    input_grads = [t.grad for t in ins_b if t.is_floating_point()]
    return out_a, _grads([stage]), input_grads, stage.events


@pytest.mark.parametrize("last", [False, True])
def test_overlapped_pair_gives_bitwise_the_forward_then_the_backward(last: bool) -> None:
    # bitwise: paired or not, each micro-batch runs the same chunks with the same gradients
    # in the same order (graphpipe.models.overlap)
    out_p, grads_p, in_p, events = _pair_case(True, last)
    out_s, grads_s, in_s, _ = _pair_case(False, last)
    assert all(torch.equal(a, b) for a, b in zip(out_p, out_s, strict=True))
    assert grads_p.keys() == grads_s.keys() and grads_p
    for key in grads_p:
        assert torch.equal(grads_p[key], grads_s[key]), key
    assert all(torch.equal(a, b) for a, b in zip(in_p, in_s, strict=True))
    assert MoEEvent("pair", -1, "begin") in events


def _check_interleaving(events: list[MoEEvent]) -> int:
    """Every exchange of one side of a pair is in flight while the other side completes a
    compute chunk; returns how many exchanges were checked."""
    checked, pair, inside = 0, [], False
    for ev in events:
        if ev.role == "pair":
            inside = ev.what == "begin"
            if not inside:
                checked += _check_pair(pair)
                pair = []
            continue
        if inside:
            pair.append(ev)
    return checked


def _check_pair(pair: list[MoEEvent]) -> int:
    checked = 0
    roles_left = {ev.role for ev in pair}
    for i, ev in enumerate(pair):
        if not ev.what.endswith(" issued"):
            continue
        name = ev.what.removesuffix(" issued")
        j = next(
            k
            for k in range(i + 1, len(pair))
            if pair[k] == MoEEvent(ev.role, ev.layer, f"{name} waited")
        )
        other = "B" if ev.role == "F" else "F"
        # the other side computes while this exchange is in flight, unless it has finished
        other_later = any(e.role == other for e in pair[i + 1 :])
        if not other_later:
            continue
        between = [e for e in pair[i + 1 : j] if e.role == other and e.what.endswith(" done")]
        assert between, f"{ev} waited with no {other} compute in flight: {pair[i : j + 1]}"
        checked += 1
    assert roles_left == {"F", "B"}
    return checked


def test_pair_runs_the_other_microbatch_compute_while_an_exchange_is_in_flight() -> None:
    _, _, _, events = _pair_case(True, last=False)
    assert _check_interleaving(events) >= 4
    # ... and the order is the ping-pong: F issues, B computes, F waits
    pair = events[events.index(MoEEvent("pair", -1, "begin")) :]
    assert pair[1:6] == [
        MoEEvent("F", 0, "attn done"),
        MoEEvent("F", 0, "dispatch issued"),
        MoEEvent("B", 0, "post-bwd done"),
        MoEEvent("B", 0, "combine-bwd issued"),
        MoEEvent("F", 0, "dispatch waited"),
    ]


def test_expert_layout_blocks_and_strides() -> None:
    assert expert_layout([0, 2, 4, 6], 2) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    assert expert_layout([1, 3], 2) == ([[1, 3]], [[1], [3]])
    assert expert_layout([5], 1) == ([[5]], [[5]])
    with pytest.raises(ValueError, match=r"ep=3 must be a positive divisor of .* size 4"):
        expert_layout([0, 1, 2, 3], 3)


# --------------------------------------------------------------------------- one-rank pipeline


def _reference(cfg: LlamaConfig, x, y, m: int):
    """One process, the 2 stages on each micro-batch alone (capacity and aux per micro-batch,
    as in the pipeline), loss averaged over micro-batches."""
    stages = build_stages(cfg, 2, dtype=F64)
    total = torch.zeros((), dtype=F64)
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        loss = LlamaLoss(False)(stages[1](*stages[0](xm)), ym) / m
        loss.backward()
        total += loss.detach()
    return total, _grads(stages), dropped_tokens(stages)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_one_rank_dualpipev_with_overlapped_pairs_matches_the_reference(factor: float) -> None:
    cfg, m = _config(capacity_factor=factor), 4
    x, y = _tokens(8)
    ref_loss, ref_grads, ref_dropped = _reference(cfg, x, y, m)
    stages = build_stages(cfg, 2, dtype=F64)
    log: list = []
    for s in stages:
        s.events = log
    pipe = graphpipe.DualPipeV(stages, num_microbatches=m, loss_fn=LlamaLoss(False))
    loss = pipe.step(x, y)
    # float64, other code paths than the reference loop (overlapped pairs, deferred weight
    # GEMMs accumulated into .grad): equal up to rounding. The loss, a sum of positive terms,
    # to 1e-13 relative (about 900x float64's unit roundoff); each gradient to 1e-10 relative
    # and 1e-14 absolute (elements that cancel to about 0).
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    grads = _grads(stages)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-10, atol=1e-14)
    assert torch.equal(dropped_tokens(stages), ref_dropped)
    assert (factor == 2.0) == (int(ref_dropped) == 0)
    assert _check_interleaving(log) > 0  # the pipeline called the hook


def test_one_rank_static_replay_is_bitwise_equal_to_eager() -> None:
    cfg, m = _config(capacity_factor=0.75), 4
    runs = []
    for capture in (False, True):
        stages = build_stages(cfg, 2, dtype=F64)
        opt = torch.optim.SGD(unique_parameters(stages), lr=0.1)
        pipe = graphpipe.DualPipeV(
            stages, num_microbatches=m, loss_fn=LlamaLoss(False), capture=capture
        )
        losses, drops = [], []
        for step in range(3):
            x, y = _tokens(8, seed=10 + step)
            opt.zero_grad(set_to_none=False)
            reset_dropped_tokens(stages)
            losses.append(pipe.step(x, y).clone())
            drops.append(dropped_tokens(stages).clone())
            opt.step()
        pipe.close()
        runs.append((losses, drops, [p.detach().clone() for s in stages for p in s.parameters()]))
    (le, de, pe), (lc, dc, pc) = runs
    # bitwise: the static replay runs the eager program's kernels in the same order
    assert all(torch.equal(a, b) for a, b in zip(le, lc, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(de, dc, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(pe, pc, strict=True))
