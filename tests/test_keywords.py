"""Keyword tensors per micro-batch, integer and bool tensors crossing stage edges, and
``loss_reduction="sum"``, against a single-process reference of the same stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphpipe
from tests.spawn import run_ranks

DIM = 6
# The pipeline and the reference run the same float64 ops on the same rows, but the pipeline
# computes per micro-batch (other GEMM shapes, so other blockings and summation orders) and
# sums the micro-batch losses in another order: equal to float64 rounding, not bitwise.
RTOL, ATOL = 1e-10, 1e-12


class KwBlock(nn.Module):
    """A stage with a bool mask crossing every edge next to the activation, a keyword tensor
    ``scale`` that every stage takes and ``positions`` (int64) that only the odd stages take."""

    def __init__(self, index: int, num_stages: int, takes_positions: bool) -> None:
        super().__init__()
        self.index, self.last = index, index == num_stages - 1
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.emb = nn.Embedding(5, DIM) if takes_positions else None

    def _body(self, x, keep, scale, positions):
        h = x + torch.tanh(self.fc(self.norm(x))) * scale
        if positions is not None:
            h = h + self.emb(positions)
        h = torch.where(keep, h, 0.5 * h)
        return h if self.last else (h, keep, keep.sum(-1))  # an int64 count crosses too

    def forward(self, x, keep, count=None, *, scale):
        return self._body(x, keep, scale, None)


class KwPosBlock(KwBlock):
    def forward(self, x, keep, count=None, *, scale, positions):
        return self._body(x, keep, scale, positions)


def build(num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    stages = [
        (KwPosBlock if i % 2 else KwBlock)(i, num_stages, bool(i % 2)).double()
        for i in range(num_stages)
    ]
    return stages


def data(rows: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    keep = torch.rand(rows, DIM, generator=g) > 0.3
    y = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    scale = torch.rand(rows, 1, generator=g, dtype=torch.float64) + 0.5
    positions = torch.randint(0, 5, (rows,), generator=g)
    weight = torch.rand(rows, generator=g, dtype=torch.float64)
    return dict(x=x, keep=keep, y=y, scale=scale, positions=positions, weight=weight)


def weighted_mean(out, y, *, weight):
    """The mean over a micro-batch's rows, each weighted: averaged over micro-batches."""
    return (weight * (out - y).pow(2).mean(-1)).mean()


def weighted_share(out, y, *, weight):
    """A micro-batch's share of the whole batch's weighted loss (weights normalized over the
    whole batch): summed over micro-batches (``loss_reduction="sum"``)."""
    return (weight * (out - y).pow(2).mean(-1)).sum()


def reference(stages, d: dict, m: int, reduction: str):
    """Every stage in one process; the loss as the pipeline defines it, and the grads."""
    losses = []
    rows = d["x"].shape[0] // m
    for i in range(m):
        part = {k: v[i * rows : (i + 1) * rows] for k, v in d.items()}
        h = (part["x"], part["keep"])
        for s, stage in enumerate(stages):
            kw = {"scale": part["scale"]}
            if s % 2:
                kw["positions"] = part["positions"]
            h = stage(*h, **kw)
        fn = weighted_mean if reduction == "mean" else weighted_share
        losses.append(fn(h, part["y"], weight=part["weight"]))
    total = torch.stack(losses)
    loss = total.mean() if reduction == "mean" else total.sum()
    loss.backward()
    grads = {
        (s, n): p.grad.clone() for s, st in enumerate(stages) for n, p in st.named_parameters()
    }
    return loss.detach(), grads


def local(schedule: str, stages: list, rank: int, world: int) -> list:
    if schedule == "1f1b":
        return [stages[rank]]
    return [stages[rank], stages[2 * world - 1 - rank]]


def _run(rank: int, world: int, case: dict) -> dict:
    schedule, m, reduction = case["schedule"], case["m"], case["reduction"]
    stages = build(world if schedule == "1f1b" else 2 * world)
    mine = local(schedule, stages, rank, world)
    loss_fn = weighted_mean if reduction == "mean" else weighted_share
    pipe = graphpipe.Pipeline(
        mine,
        schedule=schedule,
        num_microbatches=m,
        loss_fn=loss_fn,
        loss_reduction=reduction,
        capture=case.get("capture", False),
    )
    d = data(case["rows"])
    if reduction == "sum":
        d["weight"] = d["weight"] / d["weight"].sum()
    first = pipe.is_input_rank
    last = pipe.is_loss_rank
    losses = []
    for _ in range(case.get("steps", 1)):
        for s in mine:
            s.zero_grad(set_to_none=False)
        loss = pipe.step(
            (d["x"], d["keep"]) if first else None,
            d["y"] if last else None,
            scale=d["scale"],
            positions=d["positions"],
            weight=d["weight"],
        )
        losses.append(loss.clone())
    out = pipe.forward(
        (d["x"], d["keep"]) if first else None, scale=d["scale"], positions=d["positions"]
    )
    ids = pipe.stage_ids
    grads = {
        (ids[i], n): p.grad.clone() for i, s in enumerate(mine) for n, p in s.named_parameters()
    }
    pipe.close()
    return {"losses": losses, "grads": grads, "out": out, "last": last}


def _check(case: dict, world: int, per_rank: list[dict]) -> None:
    schedule = case["schedule"]
    stages = build(world if schedule == "1f1b" else 2 * world)
    d = data(case["rows"])
    if case["reduction"] == "sum":
        d["weight"] = d["weight"] / d["weight"].sum()
    loss, grads = reference(stages, d, case["m"], case["reduction"])
    seen = set()
    for res in per_rank:
        for got in res["losses"]:
            torch.testing.assert_close(got, loss, rtol=RTOL, atol=ATOL)
        for key, g in res["grads"].items():
            # (the gradients are zeroed before each step: the last step's)
            torch.testing.assert_close(g, grads[key], rtol=RTOL, atol=ATOL, msg=f"{case} {key}")
            seen.add(key)
        if res["last"]:
            with torch.no_grad():
                h = (d["x"], d["keep"])
                for s, stage in enumerate(stages):
                    kw = {"scale": d["scale"]} | ({"positions": d["positions"]} if s % 2 else {})
                    h = stage(*h, **kw)
            torch.testing.assert_close(res["out"], h, rtol=RTOL, atol=ATOL)
        else:
            assert res["out"] is None
    assert seen == set(grads)


LOCAL = [
    dict(schedule="dualpipev", m=2, rows=6, reduction="mean"),
    dict(schedule="dualpipev", m=3, rows=9, reduction="sum", steps=2),
    dict(schedule="dualpipev", m=2, rows=4, reduction="sum", capture=True, steps=3),
    dict(schedule="zbv", m=2, rows=4, reduction="mean", capture="action", steps=2),
]


@pytest.mark.parametrize("case", LOCAL, ids=lambda c: "-".join(map(str, c.values())))
def test_keyword_tensors_and_integer_edges_in_one_process(case: dict) -> None:
    _check(case, 1, [_run(0, 1, case)])


DIST = [
    dict(schedule="dualpipev", m=4, rows=8, reduction="mean"),
    dict(schedule="dualpipev", m=5, rows=10, reduction="sum", capture=True, steps=3),
    dict(schedule="zbv", m=4, rows=8, reduction="sum", steps=2),
    dict(schedule="1f1b", m=3, rows=6, reduction="sum"),
    dict(schedule="1f1b", m=2, rows=4, reduction="mean", capture=True, steps=2),
]


def _run_all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_run(rank, world, c) for c in cases]


def test_keyword_tensors_and_integer_edges_on_two_ranks_every_schedule() -> None:
    results = run_ranks(_run_all, 2, DIST)
    for i, case in enumerate(DIST):
        _check(case, 2, [results[r][i] for r in range(2)])


def _bad_keywords(rank: int, world: int) -> list[str]:
    stages = build(2 * world)
    pipe = graphpipe.DualPipeV(
        local("dualpipev", stages, rank, world), num_microbatches=4, loss_fn=weighted_mean
    )
    d = data(8)
    x = (d["x"], d["keep"]) if rank == 0 else None
    y = d["y"] if rank == 0 else None
    out = []
    calls = [
        # rank 1 passes a narrower scale
        dict(
            scale=d["scale"] if rank == 0 else d["scale"][:4],
            positions=d["positions"],
            weight=d["weight"],
        ),
        # rank 1 leaves out a keyword
        dict(scale=d["scale"], positions=d["positions"], weight=d["weight"])
        if rank == 0
        else dict(scale=d["scale"], weight=d["weight"]),
        # a keyword nothing takes
        dict(scale=d["scale"], positions=d["positions"], weight=d["weight"], extra=d["scale"]),
        # a keyword that is not a tensor
        dict(scale=d["scale"], positions=d["positions"], weight=d["weight"], flag=True),
    ]
    for kw in calls:
        try:
            pipe.step(x, y, **kw)
            out.append("no error")
        except (ValueError, TypeError, graphpipe.PipelineError) as e:
            out.append(f"{type(e).__name__}: {e}".splitlines()[0])
    # and a good call still works after them
    pipe.step(x, y, scale=d["scale"], positions=d["positions"], weight=d["weight"])
    out.append("ok")
    return out


def test_keyword_tensors_that_differ_between_ranks_or_go_nowhere_are_named_on_every_rank():
    results = run_ranks(_bad_keywords, 2)
    for rank, got in enumerate(results):
        assert got[0] == (
            "ValueError: the pipeline ranks passed different keyword tensors: rank 1 has "
            "{'scale': [4, 1] float64}, rank 0 has {'scale': [8, 1] float64} (every rank "
            "passes the same keyword tensors)"
        ), rank
        assert got[1] == (
            "ValueError: the pipeline ranks passed different keyword tensors: rank 1 has "
            "no 'positions', rank 0 has {'positions': [8] int64} (every rank passes the same "
            "keyword tensors)"
        ), rank
        assert got[2].startswith(
            "ValueError: keyword tensor 'extra' is taken by no stage's forward (nor by loss_fn)"
        ), rank
        assert got[4] == "ok"
        # every rank checks its own keywords (they are given on every rank)
        assert got[3] == (
            "TypeError: keyword tensor 'flag' must be a tensor or a tuple of tensors, got bool"
        ), rank


def test_loss_reduction_is_checked_before_anything_is_built():
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum', got 'avg'"):
        graphpipe.DualPipeV(
            build(2), num_microbatches=2, loss_fn=weighted_mean, loss_reduction="avg"
        )


def _token_weighted_dp(rank: int, world: int, schedule: str) -> dict:
    """PP 2 x DP 2: each replica its half of the batch, the weights normalized over the whole
    batch (the token-weighted recipe), loss_reduction="sum"."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    stages = build(2 if schedule == "1f1b" else 4, seed=d)  # replicas start equal: broadcast
    mine = local(schedule, stages, p, 2)
    pipe = graphpipe.Pipeline(
        mine,
        schedule=schedule,
        num_microbatches=4,
        loss_fn=weighted_share,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        loss_reduction="sum",
    )
    full = data(16)
    full["weight"] = full["weight"] / full["weight"].sum()
    half = {k: v[d * 8 : (d + 1) * 8] for k, v in full.items()}
    loss = pipe.step(
        (half["x"], half["keep"]) if pipe.is_input_rank else None,
        half["y"] if pipe.is_loss_rank else None,
        scale=half["scale"],
        positions=half["positions"],
        weight=half["weight"],
    )
    ids = pipe.stage_ids
    grads = {
        (ids[i], n): q.grad.clone() for i, s in enumerate(mine) for n, q in s.named_parameters()
    }
    return {"loss": loss, "grads": grads}


@pytest.mark.parametrize("schedule", ["dualpipev", "1f1b"])
def test_summed_token_weighted_loss_with_data_parallelism_is_the_whole_batch_loss(schedule):
    results = run_ranks(_token_weighted_dp, 4, schedule)
    stages = build(2 if schedule == "1f1b" else 4, seed=0)
    full = data(16)
    full["weight"] = full["weight"] / full["weight"].sum()
    loss, grads = reference(stages, full, 8, "sum")  # the same rows in 8 micro-batches
    for res in results:
        torch.testing.assert_close(res["loss"], loss, rtol=RTOL, atol=ATOL)
        for key, g in res["grads"].items():
            torch.testing.assert_close(g, grads[key], rtol=RTOL, atol=ATOL, msg=str(key))
