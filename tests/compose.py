"""One composition of the pipeline's features, run on gloo ranks and in one process.

A *case* is a dict (every key optional but ``n``):

* ``n``: pipeline ranks; ``dp``: data-parallel replicas (1 or 2); ``schedule``:
  ``"dualpipev"``, ``"zbv"``, ``"1f1b"`` or ``"csv"`` (a looped schedule in torch's CSV);
  ``m``: micro-batches; ``rows``: each replica's batch rows (a multiple of ``m``);
* ``tied``: ``None``, ``"param"`` (stage 0's and the last stage's ``fc1.weight`` are one
  Parameter: both stages on one rank) or ``"marked"`` (copies marked with ``mark_tied``, on
  one rank or two);
* ``fsdp``: ``None``, ``"reshard"`` or ``"keep"`` (``fully_shard`` over the dp mesh dim with
  ``reshard_after_forward`` True or False; needs ``dp == 2``);
* ``reduction``: ``"mean"`` or ``"sum"``; ``padding``: ``None``, ``"right"`` or ``"left"``
  (a ``mask`` keyword tensor ``[B, T]`` of valid tokens, and with ``"sum"`` a ``count``
  keyword tensor holding the global number of valid tokens); ``empty``: micro-batch indices
  of replica 0 with no valid token;
* ``calls``: 1 to 3 ``step`` calls accumulated without zeroing; ``no_sync``: the calls but the
  last inside ``pipe.no_sync()``; ``capture``: ``False`` or ``"step"``;
* ``clip``: ``None`` or ``(max_norm, norm_type)``; ``seed``.

``run_case(rank, world, case)`` is the rank side (``tests.spawn.run_ranks``);
``reference(case)`` computes the same in one process on the whole batch: the losses of every
call, the gradients after the last one, the last clipped norm. ``compare`` checks one against
the other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.pipeline_models import Block

DIM, SEQ = 4, 3


class SeqBlock(nn.Module):
    """A ``Block`` over tokens ``[B, T, D]`` that mixes a running mean of the valid tokens
    (a causal, masked stand-in for attention): ``mask`` ``[B, T]`` zeroes padded tokens."""

    def __init__(self, index: int, num_stages: int) -> None:
        super().__init__()
        self.block = Block(DIM, index, num_stages)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.block(x)
        if mask is None:
            return h
        w = mask.to(h.dtype).unsqueeze(-1)
        seen = torch.cumsum(w, dim=1).clamp(min=1.0)
        return h * w + torch.cumsum(h * w, dim=1) / seen


def num_stages(case: dict) -> int:
    return case["n"] if case.get("schedule", "dualpipev") == "1f1b" else 2 * case["n"]


def build(case: dict) -> list[nn.Module]:
    """Every stage, the same in every process for ``case["seed"]``."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    k = num_stages(case)
    stages = [SeqBlock(i, k).double() for i in range(k)]
    with torch.no_grad():
        for s in stages:
            for p in s.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return stages


def csv_schedule(n: int, m: int) -> str:
    """A looped schedule (rank r runs stages r and r+N): every forward of the lower stage, of
    the upper one, then the backwards; the upper stage's split into I and a deferred W."""
    from graphpipe.ir import Action, Op, format_csv

    rows = {}
    for r in range(n):
        lo, hi = r, r + n
        cells = [Action(lo, Op.F, i) for i in range(m)] + [Action(hi, Op.F, i) for i in range(m)]
        cells += [Action(hi, Op.I, i) for i in range(m)] + [Action(lo, Op.B, i) for i in range(m)]
        cells += [Action(hi, Op.W, i) for i in range(m)]
        rows[r] = cells
    return format_csv(rows)


def schedule_of(case: dict) -> Any:
    from graphpipe.ir import parse_csv

    name = case.get("schedule", "dualpipev")
    return parse_csv(csv_schedule(case["n"], case["m"])) if name == "csv" else name


def stage_ids(case: dict, rank: int) -> tuple[int, ...]:
    from graphpipe.ir import Placement
    from graphpipe.schedules import SCHEDULES

    name = case.get("schedule", "dualpipev")
    if name == "csv":
        return Placement.from_schedule(schedule_of(case)).stages_of(rank)
    return SCHEDULES[name].placement(case["n"]).stages_of(rank)


def call_batch(case: dict, call: int) -> dict[str, torch.Tensor]:
    """The global batch of call ``call`` (every replica's rows): ``x``, ``y`` ``[B, T, D]``,
    with padding ``mask`` ``[B, T]`` and with ``"sum"`` ``count``."""
    dp, rows, m = case.get("dp", 1), case["rows"], case["m"]
    g = torch.Generator().manual_seed(1000 * case.get("seed", 0) + call)
    total = dp * rows
    out = {
        "x": torch.randn(total, SEQ, DIM, generator=g, dtype=torch.float64),
        "y": torch.randn(total, SEQ, DIM, generator=g, dtype=torch.float64),
    }
    padding = case.get("padding")
    if padding is not None:
        lengths = torch.randint(1, SEQ + 1, (total,), generator=g)
        per = rows // m
        for i in case.get("empty", ()):  # replica 0's micro-batch i: no valid token
            lengths[i * per : (i + 1) * per] = 0
        pos = torch.arange(SEQ).expand(total, SEQ)
        if padding == "right":
            mask = pos < lengths[:, None]
        else:
            mask = pos >= SEQ - lengths[:, None]
        out["mask"] = mask.to(torch.int64)
    return out


def mean_loss(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None):
    """The mean squared error over the valid tokens of one micro-batch (0 for none)."""
    err = (out - y) ** 2
    if mask is None:
        return err.mean()
    w = mask.to(err.dtype).unsqueeze(-1)
    return (err * w).sum() / (w.sum() * err.shape[-1]).clamp(min=1.0)


def sum_loss(
    out: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
):
    """The summed squared error over the valid tokens, divided by the global ``count``."""
    err = (out - y) ** 2
    if mask is not None:
        err = err * mask.to(err.dtype).unsqueeze(-1)
    return err.sum() / count.reshape(-1)[0].to(err.dtype)


def keywords(case: dict, batch: dict, rows: slice) -> dict[str, torch.Tensor]:
    """The keyword tensors of replica rows ``rows`` of ``batch``."""
    kw = {}
    if "mask" in batch:
        kw["mask"] = batch["mask"][rows]
    if case.get("reduction", "mean") == "sum":
        if "mask" in batch:
            n = int(batch["mask"].sum()) * DIM
        else:
            n = batch["y"].numel()
        kw["count"] = torch.full((rows.stop - rows.start,), max(n, 1), dtype=torch.int64)
    return kw


# ------------------------------------------------------------------------------ rank side
def run_case(rank: int, world: int, case: dict) -> dict:
    """This rank's pipeline of ``case``: the losses of every call, the gradients of its
    stages' parameters after the last (full tensors under FSDP2) and the clipped norm."""
    import torch.distributed as dist

    import graphpipe

    n, dp = case["n"], case.get("dp", 1)
    assert world == n * dp
    mesh = None
    group = dp_group = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, n), mesh_dim_names=("dp", "pp"))
        d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
        group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    else:
        d, p = 0, rank
    stages = build(case)
    ids = stage_ids(case, p)
    last = num_stages(case) - 1
    tied = case.get("tied")
    if tied == "param" and 0 in ids and last in ids:  # one rank holds both
        stages[last].block.fc1.weight = stages[0].block.fc1.weight
    mine = [stages[s] for s in ids]
    if tied == "marked":
        for s in ids:
            if s in (0, last):
                graphpipe.mark_tied(stages[s].block.fc1.weight, "fc1")
    if case.get("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for s in mine:
            fully_shard(s, mesh=mesh["dp"], reshard_after_forward=case["fsdp"] == "reshard")
    clip = case.get("clip")
    pipe = graphpipe.Pipeline(
        mine,
        schedule=schedule_of(case),
        num_microbatches=case["m"],
        loss_fn=mean_loss if case.get("reduction", "mean") == "mean" else sum_loss,
        loss_reduction=case.get("reduction", "mean"),
        group=group,
        dp_group=dp_group,
        capture=case.get("capture", False),
        clip_grad_norm=clip[0] if clip else None,
        clip_norm_type=clip[1] if clip else 2.0,
    )
    rows = case["rows"]
    mine_rows = slice(d * rows, (d + 1) * rows)
    losses = []
    calls = case.get("calls", 1)
    for c in range(calls):
        batch = call_batch(case, c)
        kw = keywords(case, batch, mine_rows)
        x = batch["x"][mine_rows] if pipe.is_input_rank else None
        y = batch["y"][mine_rows] if pipe.is_loss_rank else None
        if case.get("no_sync") and c < calls - 1:
            with pipe.no_sync():
                loss = pipe.step(x, y, **kw)
        else:
            loss = pipe.step(x, y, **kw)
        losses.append(loss.clone())
    grads = {}
    for s, mod in zip(ids, mine, strict=True):
        for name, q in mod.named_parameters(remove_duplicate=False):
            g = q.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads[(s, name)] = None if g is None else g.detach().clone()
    norm = pipe.grad_norm
    pipe.close()
    if dist.is_initialized():
        dist.barrier()
    return {"losses": losses, "grads": grads, "norm": None if norm is None else norm.clone()}


# ------------------------------------------------------------------------------ reference
def reference(case: dict) -> dict:
    """One process, the whole model (a tied weight is one Parameter) on every replica's rows:
    the loss of every call, the gradients after the last, the last clipped norm."""
    stages = build(case)
    if case.get("tied"):
        stages[-1].block.fc1.weight = stages[0].block.fc1.weight
    unique = list({id(q): q for s in stages for q in s.parameters()}.values())
    dp, rows, m = case.get("dp", 1), case["rows"], case["m"]
    reduction = case.get("reduction", "mean")
    calls = case.get("calls", 1)
    losses, norm = [], None
    for c in range(calls):
        batch = call_batch(case, c)
        per = rows // m
        parts = []
        for d in range(dp):
            for i in range(m):
                r = slice(d * rows + i * per, d * rows + (i + 1) * per)
                kw = keywords(case, batch, r)
                h = batch["x"][r]
                for s in stages:
                    h = s(h, mask=kw.get("mask"))
                fn = mean_loss if reduction == "mean" else sum_loss
                parts.append(fn(h, batch["y"][r], **kw))
        loss = torch.stack(parts).mean() if reduction == "mean" else torch.stack(parts).sum()
        loss.backward()
        losses.append(loss.detach())
        clip = case.get("clip")
        if clip and not (case.get("no_sync") and c < calls - 1):
            norm = torch.nn.utils.clip_grad_norm_(unique, clip[0], clip[1])
    grads = {
        (i, name): (None if q.grad is None else q.grad.clone())
        for i, s in enumerate(stages)
        for name, q in s.named_parameters(remove_duplicate=False)
    }
    return {"losses": losses, "grads": grads, "norm": norm}


# Float64, the pipeline against one process: micro-batch GEMMs and deferred weight gradients
# sum in another order than the whole-batch reference (and an accumulated gradient divided by
# a replica count that is not a power of two rounds once), so MKL's kernels may differ in the
# last bits between CPUs: equal up to rounding, about 1e4 units of float64's roundoff.
RTOL, ATOL = 1e-12, 1e-13


def compare(case: dict, results: list[dict], want: dict | None = None) -> None:
    """Every rank's losses and gradients equal the reference's (``AssertionError`` naming
    the case, the rank and the tensor otherwise)."""
    want = want if want is not None else reference(case)
    for rank, res in enumerate(results):
        for c, (got, exp) in enumerate(zip(res["losses"], want["losses"], strict=True)):
            torch.testing.assert_close(
                got,
                exp,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda s, c=c, r=rank: f"{case} rank {r} loss {c}: {s}",
            )
        for key, g in res["grads"].items():
            exp = want["grads"][key]
            if exp is None or g is None:
                assert (exp is None or not exp.any()) and (g is None or not g.any()), (
                    f"{case} rank {rank} {key}: one side has no gradient"
                )
                continue
            torch.testing.assert_close(
                g,
                exp,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda s, key=key, r=rank: f"{case} rank {r} {key}: {s}",
            )
        if want["norm"] is not None:
            assert res["norm"] is not None, f"{case} rank {rank}: no norm"
            torch.testing.assert_close(
                res["norm"].double(),
                want["norm"].double(),
                rtol=RTOL,
                atol=ATOL,
                msg=lambda s, r=rank: f"{case} rank {r} norm: {s}",
            )


def world_of(case: dict) -> int:
    return case["n"] * case.get("dp", 1)


__all__ = ["compare", "reference", "run_case", "world_of"]
