"""graphpipe.integrations.torch_pipelining against torch's own schedules on the same stages:
the same losses, outputs and gradients (float64), on spawned gloo ranks; and its refusals."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphpipe.integrations import torch_pipelining as gp_pp
from tests.spawn import run_ranks

pipelining = pytest.importorskip(
    "torch.distributed.pipelining", reason="this torch has no torch.distributed.pipelining"
)
for _name in ("PipelineStage", "ScheduleDualPipeV", "Schedule1F1B", "ScheduleGPipe"):
    if not hasattr(pipelining, _name):
        pytest.skip(f"torch {torch.__version__} has no pipelining.{_name}", allow_module_level=True)

DIM, ROWS = 8, 16
# torch and graphpipe run the same float64 ops per micro-batch, but accumulate the micro-batch
# weight gradients in other orders (graphpipe's deferred Linear adds g^T x into .grad; torch's
# split backward accumulates through autograd): equal to float64 rounding, not bitwise.
RTOL, ATOL = 1e-11, 1e-13


class Block(nn.Module):
    """A stage taking an optional keyword tensor ``shift`` (torch gives a rank's kwargs to
    every stage of that rank, so every stage takes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        h = x + torch.tanh(self.fc(self.norm(x)))
        return h if shift is None else h + shift


def build(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block().double() for _ in range(num_stages)]


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    shift = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    return x, y, shift


def mse(out: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None):
    loss = F.mse_loss(out, target)
    return loss if weight is None else loss * weight


def _placement(kind: str, rank: int, world: int) -> list[int]:
    if kind in ("ScheduleDualPipeV", "ScheduleZBVZeroBubble"):
        return [rank, 2 * world - 1 - rank]
    return [rank]


def _run(rank: int, world: int, kind: str, impl: str, case: dict) -> dict:
    """Two training steps (and an eval) with torch's schedule ``kind`` or graphpipe's."""
    ids = _placement(kind, rank, world)
    num_stages = 2 * world if len(ids) == 2 else world
    modules = build(num_stages)
    mine = [modules[i] for i in ids]
    stages = [
        pipelining.PipelineStage(mod, i, num_stages, torch.device("cpu"))
        for mod, i in zip(mine, ids, strict=True)
    ]
    cls = getattr(pipelining if impl == "torch" else gp_pp, kind)
    arg = stages if len(ids) == 2 else stages[0]
    extra = case.get("options", {}) if impl == "graphpipe" else {}
    sched = cls(arg, n_microbatches=case["m"], loss_fn=mse, scale_grads=case["scale"], **extra)
    first, last = 0 in ids, num_stages - 1 in ids
    out: dict = {"losses": [], "outputs": [], "grads": [], "eval": None}
    for step in range(case["steps"]):
        x, y, shift = batch(step)
        for mod in mine:
            mod.zero_grad()
        kwargs = {"shift": shift} if case["kwargs"] else {}
        if case["loss_kwargs"]:
            kwargs["loss_kwargs"] = {"weight": torch.tensor(0.5 + step, dtype=torch.float64)}
        losses: list = []
        args = (x,) if first else ()
        r = sched.step(
            *args,
            target=y if last else None,
            losses=losses if last else None,
            return_outputs=case["outputs"],
            **kwargs,
        )
        out["losses"].append([float(v.detach()) for v in losses])
        out["outputs"].append(r)
        out["grads"].append([p.grad.clone() for mod in mine for p in mod.parameters()])
    if case["eval"]:
        x, y, shift = batch(7)
        losses = []
        kw = {"shift": shift} if case["kwargs"] else {}
        r = sched.eval(*((x,) if first else ()), target=y if last else None, losses=losses, **kw)
        out["eval"] = (r, [float(v) for v in losses])
    if impl == "graphpipe":
        sched.close()
    return out


def _compare(kind: str, case: dict, world: int = 2) -> None:
    want = run_ranks(_run, world, kind, "torch", case, timeout=300)
    got = run_ranks(_run, world, kind, "graphpipe", case, timeout=300)
    for r in range(world):
        w, g = want[r], got[r]
        assert len(g["losses"]) == len(w["losses"])
        for lw, lg in zip(w["losses"], g["losses"], strict=True):
            assert len(lg) == len(lw)
            torch.testing.assert_close(torch.tensor(lg), torch.tensor(lw), rtol=RTOL, atol=ATOL)
        for ow, og in zip(w["outputs"], g["outputs"], strict=True):
            if ow is None:
                assert og is None
            else:
                torch.testing.assert_close(og, ow.detach(), rtol=RTOL, atol=ATOL)
        for gw, gg in zip(w["grads"], g["grads"], strict=True):
            assert len(gg) == len(gw)
            for a, b in zip(gg, gw, strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        if case["eval"]:
            (ow, lw), (og, lg) = w["eval"], g["eval"]
            if ow is None:
                assert og is None
            else:
                torch.testing.assert_close(og, ow, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(torch.tensor(lg), torch.tensor(lw), rtol=RTOL, atol=ATOL)
    assert any(w["losses"][0] for w in want), "no rank reported losses"


BASE = {
    "m": 4,
    "scale": True,
    "steps": 2,
    "kwargs": False,
    "loss_kwargs": False,
    "outputs": True,
    "eval": False,
}

pytestmark = pytest.mark.distributed


def test_dualpipev_equals_torchs_losses_outputs_and_gradients() -> None:
    _compare("ScheduleDualPipeV", BASE)


def test_dualpipev_keywords_loss_kwargs_and_unscaled_grads_equal_torchs() -> None:
    # No eval here: torch 2.13's ScheduleDualPipeV.eval after a training step fails inside
    # torch ("can't steal_bwd_input if this stage doesn't have backward"); the 1F1B test and
    # the one-process test check eval.
    case = {**BASE, "m": 8, "scale": False, "kwargs": True, "loss_kwargs": True}
    _compare("ScheduleDualPipeV", case)


def test_zbv_equals_torchs() -> None:
    if not hasattr(pipelining, "ScheduleZBVZeroBubble"):
        pytest.skip(f"torch {torch.__version__} has no pipelining.ScheduleZBVZeroBubble")
    _compare("ScheduleZBVZeroBubble", {**BASE, "kwargs": True})


def test_1f1b_equals_torchs_with_the_loss_on_the_last_rank() -> None:
    # eval after steps with loss_kwargs: torch's eval takes none, so its loss_fn runs without
    # the last step's (a validation loss must not be divided by a training step's tokens).
    _compare("Schedule1F1B", {**BASE, "kwargs": True, "eval": True, "loss_kwargs": True})


def test_gpipe_equals_torchs() -> None:
    _compare("ScheduleGPipe", {**BASE, "scale": False})


def test_captured_dualpipev_equals_torchs() -> None:
    # The captured step (on CPU: the static step on plan buffers) with a loss_kwargs tensor
    # that changes every step (its static copy is refreshed before each replay).
    case = {
        **BASE,
        "steps": 3,
        "outputs": False,
        "loss_kwargs": True,
        "kwargs": True,
        "options": {"capture": "step"},
    }
    _compare("ScheduleDualPipeV", case)


# ------------------------------------------------------------------ refusals (one process)
def _fake(index: int, num_stages: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(submod=Block().double(), stage_index=index, num_stages=num_stages)


def test_refuses_what_it_cannot_honour_naming_it() -> None:
    stages = [_fake(0, 2), _fake(1, 2)]
    with pytest.raises(ValueError, match="output_merge_spec"):
        gp_pp.ScheduleDualPipeV(stages, 2, mse, output_merge_spec={"a": 1})
    spec = pipelining.microbatch.TensorChunkSpec(1)
    with pytest.raises(ValueError, match=r"args_chunk_spec.*dim 0"):
        gp_pp.ScheduleDualPipeV(stages, 2, mse, args_chunk_spec=(spec,))
    with pytest.raises(ValueError, match="defer_pp_recv"):
        gp_pp.ScheduleDualPipeV(stages, 2, mse, defer_pp_recv=True)
    with pytest.raises(ValueError, match="backward_requires_autograd"):
        gp_pp.ScheduleDualPipeV(stages, 2, mse, backward_requires_autograd=False)
    with pytest.raises(ValueError, match="clip_grad_norm runs inside the step"):
        gp_pp.ScheduleDualPipeV(stages, 2, mse, clip_grad_norm=1.0)
    with pytest.raises(TypeError, match="loss_reduction"):
        gp_pp.ScheduleDualPipeV(stages, 2, mse, loss_reduction="mean")
    with pytest.raises(ValueError, match=r"places stages \[0, 1\].*stage_index \[1\]"):
        gp_pp.ScheduleDualPipeV([_fake(1, 2)], 2, mse)
    with pytest.raises(TypeError, match="PipelineStage objects"):
        gp_pp.ScheduleDualPipeV([nn.Linear(2, 2)], 2, mse)


def test_one_process_dualpipev_trains_like_the_modules_alone() -> None:
    """N = 1 (both stages local, no process group): the step's losses, outputs and gradients
    are those of the two modules run on each micro-batch."""
    stages = [_fake(0, 2), _fake(1, 2)]
    ref = [copy.deepcopy(s.submod) for s in stages]
    sched = gp_pp.ScheduleDualPipeV(stages, 2, mse)
    x, y, _ = batch(0)
    losses: list = []
    out = sched.step(x, target=y, losses=losses)
    want_losses, want_out = [], []
    for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
        o = ref[1](ref[0](xm))
        loss = mse(o, ym)
        loss.backward()
        want_losses.append(loss.detach())
        want_out.append(o.detach())
    for m in ref:
        for p in m.parameters():
            p.grad /= 2
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out, torch.cat(want_out), rtol=RTOL, atol=ATOL)
    got = [p.grad for s in stages for p in s.submod.parameters()]
    want = [p.grad for m in ref for p in m.parameters()]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # eval: the outputs of the modules on the batch, and each micro-batch's loss
    x, y, _ = batch(3)
    losses = []
    with torch.no_grad():
        want_out = ref[1](ref[0](x))
    out = sched.eval(x, target=y, losses=losses)
    torch.testing.assert_close(out, want_out, rtol=RTOL, atol=ATOL)
    want_losses = [mse(o, t) for o, t in zip(want_out.chunk(2), y.chunk(2), strict=True)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=RTOL, atol=ATOL)
    with pytest.raises(RuntimeError, match="loss_fn=None"):
        gp_pp.ScheduleDualPipeV([_fake(0, 2), _fake(1, 2)], 2).step(x)
    sched.close()


@pytest.mark.parametrize(
    ("cls", "schedule"),
    [
        ("ScheduleDualPipeV", "dualpipev"),
        ("ScheduleZBVZeroBubble", "zbv"),
        ("Schedule1F1B", "1f1b"),
        ("ScheduleGPipe", "gpipe"),
    ],
)
def test_a_named_schedule_class_refuses_another_schedule(cls: str, schedule: str) -> None:
    with pytest.raises(TypeError, match=f"^{cls} runs {schedule}; use PipelineSchedule"):
        getattr(gp_pp, cls)([], 4, schedule="1f1b")


# ------------------------------------------------- pipeline x FSDP2 data parallelism (4 ranks)
def _run_sharded(rank: int, world: int, impl: str) -> dict:
    """pp 2 x dp 2: DualPipeV's four stages, each sharded by FSDP2 over its dp pair with a
    gradient divide factor of 1.0 (the replicas' gradients summed, torchtitan's recipe; the
    loss divides by the global batch itself); each replica trains on its own batch for two
    steps. graphpipe's refusals of the compositions it cannot honour are checked first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    ids = [pp, 3 - pp]
    modules = build(4)
    mine = [modules[i] for i in ids]
    dp_group = mesh.get_group("dp")
    if impl == "graphpipe":
        # Refused: a stage with parameters outside FSDP2, then FSDP2's default mean.
        loose = [pipelining.PipelineStage(copy.deepcopy(m), i, 4, torch.device("cpu"),
                                          group=mesh.get_group("pp"))
                 for m, i in zip(mine, ids, strict=True)]  # fmt: skip
        with pytest.raises(ValueError, match=r"stage \d has \['fc.weight'.*outside it"):
            gp_pp.ScheduleDualPipeV(loose, 4, mse, dp_group=dp_group)
        for s in loose:
            fully_shard(s.submod, mesh=mesh["dp"])
        with pytest.raises(ValueError, match="gradient divide factor None"):
            gp_pp.ScheduleDualPipeV(loose, 4, mse, dp_group=dp_group)
    for m in mine:
        fully_shard(m, mesh=mesh["dp"])
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    stages = [
        pipelining.PipelineStage(m, i, 4, torch.device("cpu"), group=mesh.get_group("pp"))
        for m, i in zip(mine, ids, strict=True)
    ]
    extra = {"dp_group": dp_group} if impl == "graphpipe" else {}
    cls = (pipelining if impl == "torch" else gp_pp).ScheduleDualPipeV

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target, reduction="sum") / (2 * ROWS * DIM)

    sched = cls(stages, n_microbatches=4, loss_fn=loss_fn, scale_grads=False, **extra)
    out: dict = {"losses": [], "grads": []}
    for step in range(2):
        x, y, _ = batch(10 * step + dp)
        for m in mine:
            m.zero_grad()
        losses: list = []
        sched.step(
            *((x,) if pp == 0 else ()),
            target=y if pp == 0 else None,
            losses=losses if pp == 0 else None,
            return_outputs=False,
        )
        out["losses"].append([float(v.detach()) for v in losses])
        out["grads"].append([p.grad.to_local().clone() for m in mine for p in m.parameters()])
    if impl == "graphpipe":
        sched.close()
    return out


def test_dualpipev_over_fsdp2_sharded_replicas_equals_torchs() -> None:
    """With every parameter sharded by FSDP2 and a divide factor of 1.0, a dp_group of two
    ranks gives the losses and the sharded gradients torch's ScheduleDualPipeV gives."""
    want = run_ranks(_run_sharded, 4, "torch", timeout=300)
    got = run_ranks(_run_sharded, 4, "graphpipe", timeout=300)
    assert [len(w["losses"][0]) for w in want] == [4, 4, 0, 0]
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(w["losses"]),
                                   rtol=RTOL, atol=ATOL)  # fmt: skip
        for gw, gg in zip(w["grads"], g["grads"], strict=True):
            for a, b in zip(gg, gw, strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# ------------------------------------------- forwards per micro-batch (a counting stage)
class Counting(Block):
    """A stage that counts its training-mode forwards in a buffer, as an MoE layer counts
    its tokens per expert for the load-balancing bias."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        return super().forward(x, shift)


def _count_forwards(rank: int, world: int, impl: str) -> list[int]:
    torch.manual_seed(0)
    ids = [rank, 2 * world - 1 - rank]
    mods = [Counting().double() for _ in ids]
    stages = [pipelining.PipelineStage(m, i, 2 * world, torch.device("cpu"))
              for m, i in zip(mods, ids, strict=True)]  # fmt: skip
    sched = (pipelining if impl == "torch" else gp_pp).ScheduleDualPipeV(stages, 4, mse)
    x, y, _ = batch(0)
    for _ in range(2):
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
    if impl == "graphpipe":
        sched.close()
    return [int(m.forwards) for m in mods]


def test_each_stage_runs_one_forward_per_microbatch_where_torch_runs_one_more_at_first() -> None:
    """Two steps of 4 micro-batches: graphpipe runs each stage's forward 8 times. torch 2.13's
    PipelineStage infers its P2P metadata at the first step by running each stage's forward
    once more in training mode, so a module that counts in forward (MoE token counts) counts 9
    (docs/torchtitan.md; tests/torchtitan_trainer/launch.py undoes it for the Trainer test's
    reference). This asserts torch's present behaviour: when it changes, update both."""
    assert run_ranks(_count_forwards, 2, "graphpipe") == [[8, 8], [8, 8]]
    assert run_ranks(_count_forwards, 2, "torch") == [[9, 9], [9, 9]]
