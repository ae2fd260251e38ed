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
* ``clip``: ``None`` or ``(max_norm, norm_type)``; ``seed``;
* ``mix``: ``None`` or one float per call: a ``PerMicrobatch`` keyword ``mix`` (``Mix``: a
  tensor per micro-batch and a function closing over the call's float, a constant that a
  captured step bakes in) that every stage takes; ``recapture``: the pipeline's
  ``recapture`` (a call whose constant differs from the captured one captures anew);
* ``capture`` may also be ``"action"``; ``alternate``: odd calls take twice the rows (another
  batch signature: with ``recapture``, each signature's own capture, replayed in turn);
* ``opt``: ``None`` or ``(lrs, weight_decay)``: each call is a training step of SGD (momentum
  0.9) with the call's learning rate ``lrs[c]``: under capture the pipeline's
  ``capture_optimizer`` (zeroing and stepping inside the step), else zeroed and stepped around
  it; a captured step whose learning rate changed after its capture is refused naming
  ``lr`` (the run stops there, and the calls before it are compared);
* ``unused``: every stage holds a parameter its forward never reads (no gradient: weight
  decay must leave it alone, as one process does);
* ``twin``: a second pipeline over the same stages; odd calls run on it (a ``no_sync``
  window belongs to the parameters, whichever pipeline opened it).

``run_case(rank, world, case)`` is the rank side (``tests.spawn.run_ranks``);
``reference(case)`` computes the same in one process on the whole batch: the losses of every
call, the gradients after the last one, the last clipped norm. ``compare`` checks one against
the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tests.pipeline_models import Block

DIM, SEQ = 4, 3


class SeqBlock(nn.Module):
    """A ``Block`` over tokens ``[B, T, D]`` that mixes a running mean of the valid tokens
    (a causal, masked stand-in for attention): ``mask`` ``[B, T]`` zeroes padded tokens.
    ``unused``: a parameter the forward never reads."""

    def __init__(self, index: int, num_stages: int, unused: bool = False) -> None:
        super().__init__()
        self.block = Block(DIM, index, num_stages)
        if unused:
            self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.block(x)
        if mask is None:
            return h
        w = mask.to(h.dtype).unsqueeze(-1)
        seen = torch.cumsum(w, dim=1).clamp(min=1.0)
        return h * w + torch.cumsum(h * w, dim=1) / seen


@dataclasses.dataclass
class Mix:
    """A ``PerMicrobatch`` value (case key ``mix``): a gain per row of the micro-batch and a
    function without tensors closing over the call's float (a constant of a captured step,
    compared by value before every replay)."""

    gain: torch.Tensor  # [rows of the micro-batch, 1, 1]
    fn: Any


def mix_fn(k: float) -> Any:
    """A new function every call, over the float ``k``."""

    def fn(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * k)

    return fn


class MixBlock(SeqBlock):
    """A ``SeqBlock`` that adds ``mix.gain * mix.fn(h)``: each micro-batch's own value."""

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, mix: Mix | None = None
    ) -> torch.Tensor:
        h = super().forward(x, mask)
        return h if mix is None else h + mix.gain * mix.fn(h)


def mix_of(case: dict, call: int, rows: slice) -> dict[str, Mix]:
    """The ``mix`` value of the global batch rows ``rows`` of call ``call`` ({} without)."""
    ks = case.get("mix")
    if not ks:
        return {}
    dp, total = case.get("dp", 1), rows_of(case, call)
    g = torch.Generator().manual_seed(5000 + 1000 * case.get("seed", 0) + call)
    gains = torch.rand(dp * total, 1, 1, generator=g, dtype=torch.float64) + 0.5
    return {"mix": Mix(gains[rows], mix_fn(ks[call]))}


def mix_keyword(case: dict, call: int, rows: slice) -> dict[str, Any]:
    """The ``PerMicrobatch`` keyword of a replica's rows ``rows`` ({} without ``mix``)."""
    import graphpipe

    if not case.get("mix"):
        return {}
    per = (rows.stop - rows.start) // case["m"]
    starts = range(rows.start, rows.stop, per)
    values = [mix_of(case, call, slice(i, i + per))["mix"] for i in starts]
    return {"mix": graphpipe.PerMicrobatch(values)}


def num_stages(case: dict) -> int:
    return case["n"] if case.get("schedule", "dualpipev") == "1f1b" else 2 * case["n"]


def build(case: dict) -> list[nn.Module]:
    """Every stage, the same in every process for ``case["seed"]``."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    k = num_stages(case)
    block = MixBlock if case.get("mix") else SeqBlock
    stages = [block(i, k, bool(case.get("unused"))).double() for i in range(k)]
    with torch.no_grad():
        for s in stages:
            for p in s.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return stages


def csv_schedule(n: int, m: int) -> str:
    """A looped schedule (rank r runs stages r and r+N): every forward of the lower stage, of
    the upper one, then the backwards; the upper stage's split into I and a deferred W."""
    from graphpipe.schedule.ir import Action, Op, format_csv

    rows = {}
    for r in range(n):
        lo, hi = r, r + n
        cells = [Action(lo, Op.F, i) for i in range(m)] + [Action(hi, Op.F, i) for i in range(m)]
        cells += [Action(hi, Op.I, i) for i in range(m)] + [Action(lo, Op.B, i) for i in range(m)]
        cells += [Action(hi, Op.W, i) for i in range(m)]
        rows[r] = cells
    return format_csv(rows)


def schedule_of(case: dict) -> Any:
    from graphpipe.schedule.ir import parse_csv

    name = case.get("schedule", "dualpipev")
    return parse_csv(csv_schedule(case["n"], case["m"])) if name == "csv" else name


def stage_ids(case: dict, rank: int) -> tuple[int, ...]:
    from graphpipe.schedule.generators import SCHEDULES
    from graphpipe.schedule.ir import Placement

    name = case.get("schedule", "dualpipev")
    if name == "csv":
        return Placement.from_schedule(schedule_of(case)).stages_of(rank)
    return SCHEDULES[name].placement(case["n"]).stages_of(rank)


def rows_of(case: dict, call: int) -> int:
    """Each replica's batch rows in call ``call`` (twice ``rows`` in odd calls with
    ``alternate``)."""
    return case["rows"] * (2 if case.get("alternate") and call % 2 else 1)


def lr_of(case: dict, call: int) -> float:
    return case["opt"][0][call]


def refused_at(case: dict) -> int | None:
    """The call a captured pipeline refuses (its learning rate changed after its capture:
    the second step of a signature captures), or None."""
    if not case.get("capture") or not case.get("opt"):
        return None
    seen: dict[int, int] = {}  # rows -> calls of that signature since its warmup
    baked: dict[int, float] = {}
    made_with: dict[int, Any] = {}  # rows -> the mix constant its warmup saw
    mix = case.get("mix")
    for c in range(case.get("calls", 1)):
        r = rows_of(case, c)
        if mix and r in made_with and mix[c] != made_with[r]:
            seen[r] = 0  # another constant (recapture=True): a new warmup and capture
        if seen.get(r, 0) == 0 and mix:
            made_with[r] = mix[c]
        seen[r] = seen.get(r, 0) + 1
        if seen[r] == 2:
            baked[r] = lr_of(case, c)
        elif seen[r] > 2 and lr_of(case, c) != baked[r]:
            return c
    return None


def call_batch(case: dict, call: int) -> dict[str, torch.Tensor]:
    """The global batch of call ``call`` (every replica's rows): ``x``, ``y`` ``[B, T, D]``,
    with padding ``mask`` ``[B, T]`` and with ``"sum"`` ``count``."""
    dp, rows, m = case.get("dp", 1), rows_of(case, call), case["m"]
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
    opt = None
    if case.get("opt"):
        unique = list({id(q): q for s in mine for q in s.parameters()}.values())
        opt = torch.optim.SGD(unique, lr=lr_of(case, 0), momentum=0.9, weight_decay=case["opt"][1])
    inside = opt if case.get("capture") else None  # capture_optimizer: inside the step

    def pipeline() -> Any:
        return graphpipe.Pipeline(
            mine,
            schedule=schedule_of(case),
            num_microbatches=case["m"],
            loss_fn=mean_loss if case.get("reduction", "mean") == "mean" else sum_loss,
            loss_reduction=case.get("reduction", "mean"),
            group=group,
            dp_group=dp_group,
            capture=case.get("capture", False),
            recapture=case.get("recapture", False),
            capture_optimizer=inside,
            clip_grad_norm=clip[0] if clip else None,
            clip_norm_type=clip[1] if clip else 2.0,
        )

    pipes = [pipeline(), pipeline()] if case.get("twin") else [pipeline()]
    losses = []
    calls = case.get("calls", 1)
    refused = None
    for c in range(calls):
        pipe = pipes[c % len(pipes)]
        rows = rows_of(case, c)
        mine_rows = slice(d * rows, (d + 1) * rows)
        batch = call_batch(case, c)
        kw = keywords(case, batch, mine_rows)
        kw.update(mix_keyword(case, c, mine_rows))
        x = batch["x"][mine_rows] if pipe.is_input_rank else None
        y = batch["y"][mine_rows] if pipe.is_loss_rank else None
        if opt is not None:
            for group_ in opt.param_groups:
                group_["lr"] = lr_of(case, c)
            if inside is None:
                opt.zero_grad()
        try:
            if case.get("no_sync") and c < calls - 1:
                with pipe.no_sync():
                    loss = pipe.step(x, y, **kw)
            else:
                loss = pipe.step(x, y, **kw)
        except RuntimeError as e:
            if "param_groups[0]['lr'] changed" not in str(e):
                raise
            refused = c  # the case's expected end: compared by compare()
            break
        if opt is not None and inside is None:
            opt.step()
        losses.append(loss.clone())
    grads = {}
    for s, mod in zip(ids, mine, strict=True):
        for name, q in mod.named_parameters(remove_duplicate=False):
            g = q.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads[(s, name)] = None if g is None else g.detach().clone()
    params = {}
    for s, mod in zip(ids, mine, strict=True):
        for name, q in mod.named_parameters(remove_duplicate=False):
            q = q.full_tensor() if hasattr(q, "full_tensor") else q
            params[(s, name)] = q.detach().clone()
    norm = pipes[(len(losses) - 1) % len(pipes)].grad_norm if losses else None
    for p_ in pipes:
        p_.close()
    if dist.is_initialized():
        dist.barrier()
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "norm": None if norm is None else norm.clone(),
        "refused": refused,
    }


# ------------------------------------------------------------------------------ reference
def reference(case: dict) -> dict:
    """One process, the whole model (a tied weight is one Parameter) on every replica's rows:
    the loss of every call, the gradients after the last, the last clipped norm."""
    stages = build(case)
    if case.get("tied"):
        stages[-1].block.fc1.weight = stages[0].block.fc1.weight
    unique = list({id(q): q for s in stages for q in s.parameters()}.values())
    dp, m = case.get("dp", 1), case["m"]
    reduction = case.get("reduction", "mean")
    calls = case.get("calls", 1)
    stop = refused_at(case)
    opt = None
    if case.get("opt"):
        opt = torch.optim.SGD(unique, lr=lr_of(case, 0), momentum=0.9, weight_decay=case["opt"][1])
    losses, norm = [], None
    for c in range(calls if stop is None else stop):
        if opt is not None:
            opt.zero_grad()
            for group in opt.param_groups:
                group["lr"] = lr_of(case, c)
        batch = call_batch(case, c)
        rows = rows_of(case, c)
        per = rows // m
        parts = []
        for d in range(dp):
            for i in range(m):
                r = slice(d * rows + i * per, d * rows + (i + 1) * per)
                kw = keywords(case, batch, r)
                h = batch["x"][r]
                for s in stages:
                    h = s(h, mask=kw.get("mask"), **mix_of(case, c, r))
                fn = mean_loss if reduction == "mean" else sum_loss
                parts.append(fn(h, batch["y"][r], **kw))
        loss = torch.stack(parts).mean() if reduction == "mean" else torch.stack(parts).sum()
        loss.backward()
        losses.append(loss.detach())
        clip = case.get("clip")
        if clip and not (case.get("no_sync") and c < calls - 1):
            norm = torch.nn.utils.clip_grad_norm_(unique, clip[0], clip[1])
        if opt is not None:
            opt.step()
    grads = {
        (i, name): (None if q.grad is None else q.grad.clone())
        for i, s in enumerate(stages)
        for name, q in s.named_parameters(remove_duplicate=False)
    }
    params = {
        (i, name): q.detach().clone()
        for i, s in enumerate(stages)
        for name, q in s.named_parameters(remove_duplicate=False)
    }
    return {"losses": losses, "grads": grads, "params": params, "norm": norm, "refused": stop}


# Float64, the pipeline against one process: micro-batch GEMMs and deferred weight gradients
# sum in another order than the whole-batch reference (and an accumulated gradient divided by
# a replica count that is not a power of two rounds once), so MKL's kernels may differ in the
# last bits between CPUs: equal up to rounding, about 1e4 units of float64's roundoff.
RTOL, ATOL = 1e-12, 1e-13
# With an optimizer stepping between calls, one call's rounding moves the next call's
# parameters, and momentum carries it on: the difference compounds over the calls (about
# 3e4 units of roundoff after three SGD steps with momentum, where the same case without the
# optimizer stays within the bound above). A wrong gradient is off by far more.
RTOL_STEPPED, ATOL_STEPPED = 1e-11, 1e-12


def compare(case: dict, results: list[dict], want: dict | None = None) -> None:
    """Every rank's losses and gradients equal the reference's (``AssertionError`` naming
    the case, the rank and the tensor otherwise)."""
    want = want if want is not None else reference(case)
    stepped = bool(case.get("opt")) and case.get("calls", 1) > 1
    rtol, atol = (RTOL_STEPPED, ATOL_STEPPED) if stepped else (RTOL, ATOL)
    for rank, res in enumerate(results):
        assert res["refused"] == want["refused"], (
            f"{case} rank {rank}: refused at call {res['refused']}, expected {want['refused']}"
        )
        for key, q in res["params"].items():
            torch.testing.assert_close(
                q,
                want["params"][key],
                rtol=rtol,
                atol=atol,
                msg=lambda s, key=key, r=rank: f"{case} rank {r} parameter {key}: {s}",
            )
        for c, (got, exp) in enumerate(zip(res["losses"], want["losses"], strict=True)):
            torch.testing.assert_close(
                got,
                exp,
                rtol=rtol,
                atol=atol,
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
                rtol=rtol,
                atol=atol,
                msg=lambda s, key=key, r=rank: f"{case} rank {r} {key}: {s}",
            )
        if want["norm"] is not None:
            assert res["norm"] is not None, f"{case} rank {rank}: no norm"
            torch.testing.assert_close(
                res["norm"].double(),
                want["norm"].double(),
                rtol=rtol,
                atol=atol,
                msg=lambda s, r=rank: f"{case} rank {r} norm: {s}",
            )


def world_of(case: dict) -> int:
    return case["n"] * case.get("dp", 1)


__all__ = ["compare", "reference", "run_case", "world_of"]
