"""The CPU graph (graphpipe/runtime/capture/cpu_graph.py) on its own: what it records and how
it replays, against eager runs of the same function.

Bitwise comparisons hold because a replay runs the kernels the eager call ran, in the same
order, on the same shapes (the ``out=`` forms it uses are the same structured kernels).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn

from graphpipe.runtime.capture.cpu_graph import _OUT_SAFE, CaptureError, CpuGraph, _out_variant
from tests.spawn import run_ranks


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Dropout(0.25), nn.Linear(24, 5))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def test_a_replayed_training_step_equals_eager_bitwise_and_runs_no_python():
    eager, graphed = _mlp(), _mlp()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    calls = []
    graphed[0].register_forward_pre_hook(lambda *_: calls.append(1))
    x, y = torch.randn(7, 16), torch.randn(7, 5)
    sx, sy = x.clone(), y.clone()
    for seed in (1, 2):  # eager warm-up of both: momentum buffers exist before capture
        torch.manual_seed(seed)
        _train_step(eager, opt_e, x, y)
        torch.manual_seed(seed)
        _train_step(graphed, opt_g, sx, sy)
    g = CpuGraph()
    torch.manual_seed(3)
    expected = _train_step(eager, opt_e, x, y)
    torch.manual_seed(3)
    loss = g.capture(lambda: _train_step(graphed, opt_g, sx, sy))
    assert torch.equal(loss, expected)
    n_calls = len(calls)
    for step in range(5):
        x, y = torch.randn(7, 16), torch.randn(7, 5)
        torch.manual_seed(10 + step)
        expected = _train_step(eager, opt_e, x, y)
        sx.copy_(x)
        sy.copy_(y)
        torch.manual_seed(10 + step)  # dropout draws what the eager step drew
        g.replay()
        assert torch.equal(loss, expected), step  # the captured loss tensor, rewritten
        for pe, pg in zip(eager.parameters(), graphed.parameters(), strict=True):
            assert torch.equal(pe, pg) and torch.equal(pe.grad, pg.grad)
    assert len(calls) == n_calls  # the module's Python did not run again
    assert g.stats["views"] > 0 and g.stats["c10d"] == 0
    # the step's temporaries share memory, as in a CUDA graph's pool
    assert g.stats["reused_bytes"] > 0 and g.stats["pooled_bytes"] > 0


def _awkward(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Views, in-place writes through views, an ``out=`` call, a copy into a slice."""
    t = x.t()  # (5, 3) view
    y = t @ w  # (5, 4)
    y[:, 1:3].mul_(2.0)  # in place through a view
    y.view(-1)[::3].add_(1.0)
    torch.add(y, 1.5, out=out)  # the caller's out=
    z = torch.cat([y, y.flip(0)], dim=1).contiguous()
    z[0].copy_(w[0].repeat(2))  # a copy into a row
    s = z.transpose(0, 1).reshape(-1)[:7]  # a non-contiguous view, then a copy
    return s.sum() + out.mean()


def test_views_in_place_writes_and_out_variants_replay_on_new_values():
    x, w, out = torch.randn(3, 5), torch.randn(3, 4), torch.empty(5, 4)
    g = CpuGraph()
    res = g.capture(lambda: _awkward(x, w, out))
    ptr = res.data_ptr()
    for seed in range(4):
        torch.manual_seed(seed)
        x.copy_(torch.randn(3, 5))
        w.copy_(torch.randn(3, 4))
        out_e = torch.empty(5, 4)
        expected = _awkward(x.clone(), w.clone(), out_e)
        g.replay()
        assert torch.equal(res, expected) and torch.equal(out, out_e)
        assert res.data_ptr() == ptr  # the graph's memory, rewritten in place


def _every_out_safe_op(a, b, m, n, v, labels):
    """A function whose forward and backward run every operation of ``_OUT_SAFE``."""
    r = torch.addmm(v, m, n)  # addmm, mm (backward)
    r = r + torch.bmm(a, b).sum(0)[:, :4]  # bmm, sum.dim_IntList, add
    r = torch.baddbmm(a @ b, a, b).mean(0)[:, :4] * r  # baddbmm, mean.dim, mul
    r = r - r.neg().exp().log1p().rsqrt().sqrt()  # sub, neg, exp, rsqrt, sqrt
    r = r / (r.abs() + 1)  # div
    r = torch.tanh(r) + torch.sigmoid(r) + nn.functional.silu(r) + nn.functional.gelu(r)
    r = torch.relu(r) + r.pow(2)  # threshold_backward, pow.Tensor_Scalar
    r = torch.where(r > 0.1, r, -r) + torch.maximum(r, v) + torch.minimum(r, v)
    r = torch.addcmul(r, r, v) + torch.addcdiv(r, r, v.abs() + 1)
    r = torch.cat([r, r.softmax(-1)], dim=1).log()  # cat, _softmax, log
    loss = nn.functional.nll_loss(r.log_softmax(-1), labels)
    loss.backward()
    return loss


def test_each_out_safe_operation_replays_bitwise_into_the_same_storage():
    def leaves(seed: int):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(2, 5, 3, generator=g)
        b = torch.randn(2, 3, 5, generator=g)
        m, n, v = (
            torch.randn(5, 3, generator=g),
            torch.randn(3, 4, generator=g),
            torch.rand(4, generator=g),
        )
        labels = torch.randint(0, 8, (5,), generator=g)
        return [a, b, m.requires_grad_(), n.requires_grad_(), v.requires_grad_(), labels]

    static = leaves(0)
    g = CpuGraph()
    loss = g.capture(lambda: _every_out_safe_op(*static))
    used = set(g.names)
    grads = [t.grad for t in static if t.grad is not None]
    ptrs = [t.data_ptr() for t in [loss, *grads]]
    for seed in (1, 2):
        fresh = leaves(seed)
        for s, f in zip(static, fresh, strict=True):
            s.detach().copy_(f)
            if s.grad is not None:
                s.grad.zero_()
        expected = _every_out_safe_op(*fresh)
        g.replay()
        assert torch.equal(loss, expected)
        for s, f in zip(static, fresh, strict=True):
            if f.grad is not None:
                assert torch.equal(s.grad, f.grad)
        assert [t.data_ptr() for t in [loss, *grads]] == ptrs
    missing = set()
    for name in _OUT_SAFE:
        base, _, overload = name.removeprefix("aten::").partition(".")
        variant = _out_variant(getattr(getattr(torch.ops.aten, base), overload or "default"))
        if variant is None or str(variant[0]) not in used:
            missing.add(name)
    assert missing == set(), f"not exercised: {sorted(missing)}"


def test_a_higher_order_operator_is_recorded_through_its_dense_implementation():
    """flex_attention compiles its operator with torch.compile: while capturing, compiled
    code runs as its Python, and the operator through its dense implementation."""
    from torch.nn.attention.flex_attention import flex_attention

    def causal(score, b, h, q, kv):
        return torch.where(q >= kv, score, -float("inf"))

    shape = (1, 2, 8, 4)  # forward only: torch 2.13's FlexAttention has no CPU backward
    static = [torch.randn(shape) for _ in range(3)]
    g = CpuGraph()
    out = g.capture(lambda: flex_attention(*static, score_mod=causal))
    assert g.stats["ops"] > 3  # the operations flex_attention is made of
    for seed in (1, 2):
        torch.manual_seed(seed)
        fresh = [torch.randn(shape) for _ in range(3)]
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        g.replay()
        assert torch.equal(out, flex_attention(*fresh, score_mod=causal))


def test_each_fast_path_computes_what_its_operation_computes():
    """The replay calls some operations through torch's Python API (``_FAST``): each one,
    on the arguments recorded from real steps, equals the operation's own call bitwise."""
    from graphpipe.runtime.capture.cpu_graph import _FAST

    static = [torch.randn(2, 5, 3), torch.randn(2, 3, 5)]
    static += [torch.randn(5, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)]
    static += [torch.rand(4, requires_grad=True), torch.randint(0, 8, (5,))]
    graphs = [CpuGraph(), CpuGraph()]
    graphs[0].capture(lambda: _every_out_safe_op(*static))
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(3, 16), torch.randn(3, 5)
    _train_step(model, opt, x, y)
    graphs[1].capture(lambda: _train_step(model, opt, x, y))
    seen = set()
    for g in graphs:
        for (_fn, args, kwargs), name in zip(g.nodes, g.names, strict=True):
            if name not in _FAST:
                continue
            seen.add(name)

            def fresh(v):
                return v.clone() if isinstance(v, torch.Tensor) else v

            a1 = [fresh(a) for a in args]
            k1 = {k: fresh(v) for k, v in kwargs.items()}
            a2 = [fresh(a) for a in args]
            k2 = {k: fresh(v) for k, v in kwargs.items()}
            op = getattr(torch.ops.aten, name.split(".")[1])
            op = getattr(op, name.split(".")[2])
            with torch.no_grad():
                op(*a1, **k1)
                _FAST[name](*a2, **k2)
            for u, v in zip([*a1, *k1.values()], [*a2, *k2.values()], strict=True):
                if isinstance(u, torch.Tensor):  # the recorded arguments are whatever the
                    # graph's reused memory holds now: NaN where it must be NaN
                    torch.testing.assert_close(u, v, rtol=0, atol=0, equal_nan=True, msg=name)
    assert len(seen) >= 10, sorted(seen)


def test_temporaries_share_memory_and_constants_made_in_the_step_keep_theirs():
    """The graph's pool: temporaries whose lives do not overlap share memory; a constant the
    step made from Python data (``torch.tensor``: no recorded operation writes it) keeps its
    own, though only the graph holds it after the capture."""
    x, out = torch.randn(64), torch.empty(64)

    def step():
        c = torch.tensor([0.5, -1.5, 2.0, 3.0]).repeat(16)  # a constant of the step
        h = x
        for k in range(6):  # temporaries, each dead after the next
            h = torch.tanh(h * (k + 1)) + 1
        torch.add(h, c, out=out)

    g = CpuGraph()
    g.capture(step)
    assert g.stats["reused_bytes"] > 0
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn(64))
        expected = torch.empty(64)
        h = x.clone()
        for k in range(6):
            h = torch.tanh(h * (k + 1)) + 1
        torch.add(h, torch.tensor([0.5, -1.5, 2.0, 3.0]).repeat(16), out=expected)
        g.replay()
        assert torch.equal(out, expected), seed


def test_random_operations_draw_fresh_numbers_at_each_replay():
    x = torch.ones(1000)
    out = torch.empty(1000)
    g = CpuGraph()
    g.capture(lambda: out.copy_(nn.functional.dropout(x, 0.5) + torch.randn_like(x)))
    seen = []
    for seed in range(3):
        torch.manual_seed(seed)
        expected = nn.functional.dropout(x, 0.5) + torch.randn_like(x)
        torch.manual_seed(seed)
        g.replay()
        assert torch.equal(out, expected)
        seen.append(out.clone())
    g.replay()  # no reseed: the generator moves on
    assert not torch.equal(out, seen[-1]) and not torch.equal(seen[0], seen[1])


def test_python_scalars_are_baked_in_at_capture():
    x, out = torch.ones(3), torch.empty(3)
    scale = {"s": 2.0}
    g = CpuGraph()
    g.capture(lambda: torch.mul(x, scale["s"], out=out))
    scale["s"] = 3.0
    g.replay()
    assert out.tolist() == [2.0, 2.0, 2.0]


def _host_syncs(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    if y.sum() > 0:  # bool(t)
        y = y + 1
    y.tolist()
    float(y[0])
    y.nonzero()
    y.max().item()
    return y


def test_host_syncs_are_refused_naming_each_place_and_the_label():
    label = ["action 0F3"]
    g = CpuGraph(label=lambda: label[0])
    with pytest.raises(CaptureError) as err:
        g.capture(lambda: _host_syncs(torch.randn(4)))
    text = str(err.value)
    assert len(err.value.syncs) == 5
    for op in ("aten._local_scalar_dense", "Tensor.tolist", "aten.nonzero"):
        assert op in text
    assert "in action 0F3" in text
    assert f"{__file__}:" in text and "`y.tolist()`" in text and "`if y.sum() > 0:" in text
    assert len(g) == 0 and not g.captured
    with pytest.raises(RuntimeError, match="holds no capture"):
        g.replay()


def _undisturbed() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_


def test_a_failure_during_capture_leaves_nothing_half_made():
    x = torch.randn(3)

    def failing():
        x.mul(2)
        raise ValueError("boom inside the step")

    g = CpuGraph()
    with pytest.raises(ValueError, match="boom"):
        g.capture(failing)
    assert len(g) == 0 and not g.captured
    _undisturbed()
    out = torch.empty(3)
    g.capture(lambda: torch.mul(x, 2, out=out))  # the graph is usable again
    g.replay()
    assert torch.equal(out, x * 2)
    _undisturbed()


def test_a_storage_resized_inside_the_step_is_resized_again_at_each_replay():
    """FSDP2 frees and re-allocates unsharded parameters with ``UntypedStorage.resize_``."""
    full = torch.empty(6)
    nbytes = full.untyped_storage().nbytes()
    full.untyped_storage().resize_(0)
    src, out = torch.arange(6.0), torch.empty(())

    def step():
        full.untyped_storage().resize_(nbytes)  # all-gather into it
        full.copy_(src)
        torch.sum(full * 2, dim=0, out=out)
        full.untyped_storage().resize_(0)  # reshard

    g = CpuGraph()
    g.capture(step)
    for k in range(3):
        src.add_(1)
        g.replay()
        assert out.item() == 2 * float(src.sum()) and full.untyped_storage().nbytes() == 0, k


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_ten_thousand_replays_keep_memory_flat():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(4, 16), torch.randn(4, 5)
    _train_step(model, opt, x, y)
    g = CpuGraph()
    g.capture(lambda: _train_step(model, opt, x, y))
    nodes = len(g)
    for _ in range(500):
        g.replay()
    gc.collect()
    objects = len(gc.get_objects())
    samples = []  # RSS every 1,000 replays: a leak grows it in every interval
    for _ in range(10):
        for _ in range(1_000):
            g.replay()
        samples.append(_rss_bytes())
    gc.collect()
    # The allocator's arenas grow in steps now and then; a leak grows without end. The
    # second half must stay within 1 MiB of the first half's peak (a leak of one small
    # tensor per replay adds several MiB over 5,000 replays).
    grown = max(samples[5:]) - max(samples[:5])
    assert grown < 2**20, f"RSS grew {grown:,} bytes over the last 5,000 replays: {samples}"
    assert len(gc.get_objects()) - objects < 100 and len(g) == nodes
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------- c10d


def _collectives(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    group = dist.new_group(list(range(world)))
    peer = 1 - rank
    x, got = torch.empty(6), torch.empty(6)
    summed, gathered, out = torch.empty(6), torch.empty(12), torch.empty(())

    def step():
        # a P2P exchange in both directions, read only after its wait
        ops = [dist.P2POp(dist.isend, x, peer, group), dist.P2POp(dist.irecv, got, peer, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        summed.copy_(x * got)
        dist.all_reduce(summed, group=group)  # in place
        dist.all_gather_into_tensor(gathered, summed, group=group)
        r = fc.all_reduce(got + 1, "sum", group)  # functional: a fresh tensor, waited on use
        dist.broadcast(gathered, src=0, group=group)
        torch.sum(r * gathered[:6], dim=0, out=out)

    def eager(xs: list[torch.Tensor]) -> torch.Tensor:
        a, b = xs
        summed = a * b + b * a
        return ((a + 1) + (b + 1)).mul(summed).sum()

    problems = []
    x.copy_(torch.arange(6.0) + rank)
    g = CpuGraph()
    g.capture(step)
    if g.stats["c10d"] < 5:
        problems.append(f"recorded {g.stats['c10d']} c10d operations")
    for k in range(3):
        vals = [torch.arange(6.0) * (k + 2) + r for r in range(world)]
        x.copy_(vals[rank])
        g.replay()
        if not torch.allclose(out, eager(vals)):
            problems.append(f"replay {k}: {out.item()} != {eager(vals).item()}")
    return problems


@pytest.mark.distributed
def test_p2p_and_collectives_replay_with_their_waits_on_two_ranks():
    for rank, problems in enumerate(run_ranks(_collectives, 2)):
        assert problems == [], f"rank {rank}"


def _fsdp2_step(rank: int, world: int) -> list[str]:
    """FSDP2 on 2 gloo ranks: an unannotated custom operation that writes its argument
    (``fsdp.all_gather_copy_in``), storage freed and re-allocated (``resize_``), gloo's
    reduce-scatter copying its result out inside ``wait()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        fully_shard(m, mesh=mesh, reshard_after_forward=False)
        models.append(m)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    sx, sy = torch.empty(4, 6, dtype=torch.float64), torch.empty(4, 3, dtype=torch.float64)

    def step(m, x, y):
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    problems, g, loss = [], CpuGraph(), None
    for k in range(5):
        gen = torch.Generator().manual_seed(10 * k + rank)
        x, y = torch.randn(4, 6, generator=gen).double(), torch.randn(4, 3, generator=gen).double()
        for opt in opts:
            opt.zero_grad(set_to_none=False)
        expected = step(models[0], x, y)
        sx.copy_(x)
        sy.copy_(y)
        if k == 0:
            step(models[1], sx, sy)  # eager: FSDP2 initializes its state
        elif k == 1:
            loss = g.capture(lambda: step(models[1], sx, sy))
        else:
            g.replay()
        if k and not torch.equal(loss, expected):
            problems.append(f"step {k}: loss {loss.item()} != {expected.item()}")
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            if not torch.equal(a.grad.to_local(), b.grad.to_local()):
                problems.append(f"step {k}: a gradient differs")
        for opt in opts:
            opt.step()
    return problems


@pytest.mark.distributed
def test_an_fsdp2_step_replays_its_all_gathers_reduce_scatters_and_storage_resizes():
    for rank, problems in enumerate(run_ranks(_fsdp2_step, 2)):
        assert problems == [], f"rank {rank}"
