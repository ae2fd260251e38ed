"""graphpipe.integrations.torch_pipelining against torch's own schedules on the same stages:
the same losses, outputs and gradients (float64), on spawned gloo ranks; and its refusals.

Runs with every torch that pyproject.toml admits (2.11 on). Where torch's own reference needs a
version-specific hand, ``_reference_stages`` and ``_reference_loss`` say which and why."""

from __future__ import annotations

import copy
import inspect
import types

import pytest
import torch
import torch.distributed as dist
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


class Plain(Block):
    """A stage that takes no keyword (Block's parameters, drawn alike)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def build(num_stages: int, plain: tuple[int, ...] = ()) -> list[nn.Module]:
    """The stages, ``plain`` ones taking no keyword (the same parameters either way)."""
    torch.manual_seed(0)
    return [(Plain if i in plain else Block)().double() for i in range(num_stages)]


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


def _reference_stages(stages: list) -> list:
    """torch's stages for a reference run, without the first step's P2P warm-up to their own
    rank. torch 2.11's multi-stage schedules warm P2P up at the first step
    (``PipelineScheduleMulti._initialize_stages``) with a send and a receive to each
    neighbour stage (``_get_init_p2p_neighbors_ops``), also where that neighbour is on the
    same rank, as in a V placement (rank N-1 holds stages N-1 and N): a send to the rank
    itself, which gloo cannot carry (its TCP pair to itself is never connected: "Pair is not
    connected", tcp/pair.cc, in torch 2.11.0 and 2.13.0 alike; NCCL can). So torch 2.11.0's
    ScheduleDualPipeV and ScheduleZBVZeroBubble fail on any gloo job. The warm-up's values
    are never read: the reference drops those ops. torch 2.13.0 warms up by another protocol
    that does not call this method."""
    for stage in stages:
        ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
        if ops is None:
            continue
        me = dist.get_rank(stage.group)

        def without_self(ops=ops, me=me) -> list:
            return [op for op in ops() if op.group_peer != me]

        stage._get_init_p2p_neighbors_ops = without_self
    return stages


# torch 2.11's step takes no loss_kwargs (torch 2.13's does): the reference then binds them
# into its loss_fn, which computes the same.
TORCH_LOSS_KWARGS = "loss_kwargs" in inspect.signature(pipelining.Schedule1F1B.step).parameters


def _reference_loss(impl: str) -> tuple:
    """``(loss_fn, bind)``: ``bind(loss_kwargs)`` returns the keyword arguments of the next
    ``step`` (``loss_kwargs=`` where the schedule takes it, else none, the values bound into
    ``loss_fn``)."""
    if impl == "graphpipe" or TORCH_LOSS_KWARGS:
        return mse, lambda lkw: {"loss_kwargs": lkw} if lkw is not None else {}
    bound: dict = {}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mse(out, target, **bound)

    def bind(lkw: dict | None) -> dict:
        bound.clear()
        bound.update(lkw or {})
        return {}

    return loss_fn, bind


def _run(rank: int, world: int, kind: str, impl: str, case: dict) -> dict:
    """Two training steps (and an eval) with torch's schedule ``kind`` or graphpipe's.

    ``case["kwargs"]``: False, True (every rank passes ``shift``) or ``"first"`` (only the
    rank of stage 0 does, as torch's tests do; the other ranks' stages take no keyword)."""
    ids = _placement(kind, rank, world)
    num_stages = 2 * world if len(ids) == 2 else world
    first, last = 0 in ids, num_stages - 1 in ids
    plain: tuple[int, ...] = ()
    if case["kwargs"] == "first":
        plain = tuple(i for i in range(num_stages) if i not in _placement(kind, 0, world))
    modules = build(num_stages, plain)
    mine = [modules[i] for i in ids]
    stages = [
        pipelining.PipelineStage(mod, i, num_stages, torch.device("cpu"))
        for mod, i in zip(mine, ids, strict=True)
    ]
    if impl == "torch":
        stages = _reference_stages(stages)
    cls = getattr(pipelining if impl == "torch" else gp_pp, kind)
    # As torchtitan dispatches on torch's class hierarchy (graphpipe's classes are in it).
    arg = stages[0] if issubclass(cls, pipelining.schedules.PipelineScheduleSingle) else stages
    extra = case.get("options", {}) if impl == "graphpipe" else {}
    loss_fn, bind = _reference_loss(impl)
    sched = cls(arg, n_microbatches=case["m"], loss_fn=loss_fn, scale_grads=case["scale"], **extra)
    passes = case["kwargs"] is True or (case["kwargs"] == "first" and first)
    out: dict = {"losses": [], "outputs": [], "grads": [], "eval": None}
    for step in range(case["steps"]):
        x, y, shift = batch(step)
        for mod in mine:
            mod.zero_grad()
        kwargs = {"shift": shift} if passes else {}
        lkw = None
        if case["loss_kwargs"]:
            lkw = {"weight": torch.tensor(0.5 + step, dtype=torch.float64)}
        losses: list = []
        args = (x,) if first else ()
        r = sched.step(
            *args,
            target=y if last else None,
            losses=losses if last else None,
            return_outputs=case["outputs"],
            **bind(lkw),
            **kwargs,
        )
        out["losses"].append([float(v.detach()) for v in losses])
        out["outputs"].append(r)
        out["grads"].append([p.grad.clone() for mod in mine for p in mod.parameters()])
    if case["eval"]:
        x, y, shift = batch(7)
        losses = []
        kw = {"shift": shift} if passes else {}
        bind(None)  # torch's eval calls loss_fn(output, target)
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


@pytest.mark.parametrize("kind", ["Schedule1F1B", "ScheduleDualPipeV"])
def test_keywords_on_the_first_stages_rank_only_equal_torchs(kind: str) -> None:
    """``step(x, shift=s)`` on the rank of stage 0, ``step()`` elsewhere (torch's tests and
    tutorials): torch gives ``shift`` to that rank's stages only (for DualPipeV stages 0 and
    3), and so does graphpipe. (No eval for DualPipeV: see the test above.)"""
    _compare(kind, {**BASE, "kwargs": "first", "eval": kind == "Schedule1F1B"})


def _keyword_on_one_rank(rank: int, world: int, options: dict) -> str:
    """Every stage takes ``shift``; only rank 0 passes it (torch runs stage 1 without it)."""
    modules = build(2)
    stage = pipelining.PipelineStage(modules[rank], rank, 2, torch.device("cpu"))
    sched = gp_pp.Schedule1F1B(stage, 4, mse, **options)
    x, y, shift = batch(0)
    try:
        if rank == 0:
            sched.step(x, shift=shift)
        else:
            sched.step(target=y)
    except ValueError as e:
        return str(e)
    finally:
        sched.close()
    return "ran"


def test_a_keyword_a_rank_lacks_while_its_stage_takes_it_is_refused_on_every_rank() -> None:
    got = run_ranks(_keyword_on_one_rank, 2, {})
    for text in got:
        assert text.startswith(
            "keyword tensor 'shift' was passed on rank(s) [0] but not on rank 1, whose stage "
            "1 takes it: torch gives each rank's keyword arguments to that rank's stages only"
        ), text


def _refused_on_one_rank(rank: int, world: int) -> dict:
    """Rank 0 passes ``arg_mbs`` of 3 entries for M=4; rank 1 calls ``step()``. Then both
    run a valid step on the same batch."""
    ids = [rank, 3 - rank]
    modules = build(4)
    stages = [pipelining.PipelineStage(modules[i], i, 4, torch.device("cpu")) for i in ids]
    # A short timeout: without the agreement, rank 1's second step waits for a rank 0 that
    # is done, and this fails when that wait ends.
    sched = gp_pp.ScheduleDualPipeV(stages, 4, mse, timeout=20)
    x, y, _ = batch(0)
    out: dict = {}
    try:
        if rank == 0:
            sched.step(arg_mbs=[(c,) for c in x.chunk(4)][:3], target=y)
        else:
            sched.step()
        out["refused"] = "returned"
    except Exception as e:
        out["refused"] = f"{type(e).__name__}: {e}"
    losses: list = []
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None, losses=losses)
    out["losses"] = [float(v) for v in losses]
    sched.close()
    return out


def test_arguments_refused_on_one_rank_raise_on_every_rank_before_any_runs_the_step() -> None:
    """A check that fails on one rank (t18) raises on every rank, and no rank runs that
    step: rank 1 must not pair its step with rank 0's next one. The next step on both ranks
    is then exact (the four micro-batches through the modules alone)."""
    got = run_ranks(_refused_on_one_rank, 2, timeout=120)
    why = "ValueError: arg_mbs must be a list of n_microbatches=4 entries, got 3"
    assert got[0]["refused"] == why
    assert got[1]["refused"] == (
        f"PipelineError: ScheduleDualPipeV: rank 0 refused the arguments of this step() "
        f"({why}); no rank ran it"
    )
    modules = build(4)
    x, y, _ = batch(0)
    want = []
    with torch.no_grad():
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
            for mod in modules:
                xm = mod(xm)
            want.append(float(mse(xm, ym)))
    torch.testing.assert_close(
        torch.tensor(got[0]["losses"]), torch.tensor(want), rtol=RTOL, atol=ATOL
    )
    assert got[1]["losses"] == []


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


@pytest.mark.parametrize("cls", ["ScheduleDualPipeV", "Schedule1F1B", "PipelineSchedule"])
def test_a_microbatch_count_that_is_not_an_int_is_refused_naming_it(cls: str) -> None:
    """t19: ``n_microbatches=4.0`` failed inside numpy ("ufunc 'left_shift' not supported")."""
    stages = [_fake(0, 2), _fake(1, 2)] if cls != "Schedule1F1B" else _fake(0, 1)
    for bad in (4.0, True, "4"):
        with pytest.raises(
            TypeError, match=rf"^{cls}: n_microbatches must be an int, got \w+ {bad!r}$"
        ):
            getattr(gp_pp, cls)(stages, bad, mse)


def test_classes_sit_in_torchs_hierarchy_single_ones_take_a_stage_or_a_list() -> None:
    """Code that dispatches on torch's classes (torchtitan: ``issubclass(cls,
    PipelineScheduleSingle)``, ``issubclass(cls, PipelineScheduleMulti)``) picks graphpipe's
    as torch's; a single-stage class takes its stage, or a list of one, and no more."""
    schedules = pipelining.schedules
    for name in ("Schedule1F1B", "ScheduleGPipe"):
        assert issubclass(getattr(gp_pp, name), schedules.PipelineScheduleSingle)
        assert not issubclass(getattr(gp_pp, name), schedules.PipelineScheduleMulti)
    for name in ("ScheduleDualPipeV", "ScheduleZBVZeroBubble"):
        assert issubclass(getattr(gp_pp, name), schedules.PipelineScheduleMulti)
        assert not issubclass(getattr(gp_pp, name), schedules.PipelineScheduleSingle)
    assert issubclass(gp_pp.PipelineSchedule, schedules._PipelineSchedule)
    x, y, _ = batch(0)
    got = []
    for name in ("Schedule1F1B", "ScheduleGPipe"):
        for given in ("stage", "list"):
            stage = _fake(0, 1)
            torch.manual_seed(1)
            stage.submod = Block().double()
            sched = getattr(gp_pp, name)(stage if given == "stage" else [stage], 4, mse)
            assert sched._stage is stage  # torch's attribute
            losses: list = []
            sched.step(x, target=y, losses=losses)
            got.append(torch.stack(losses))
            sched.close()
    for g in got[1:]:
        torch.testing.assert_close(g, got[0], rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match=r"^Schedule1F1B runs one stage per rank, but this rank"):
        gp_pp.Schedule1F1B([_fake(0, 2), _fake(1, 2)], 4, mse)


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
def _sharded_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target, reduction="sum") / (2 * ROWS * DIM)


def _run_sharded(rank: int, world: int, impl: str, refuse: bool = False) -> dict:
    """pp 2 x dp 2: DualPipeV's four stages, each sharded by FSDP2 over its dp pair with a
    gradient divide factor of 1.0 (the replicas' gradients summed, torchtitan's recipe; the
    loss divides by the global batch itself); each replica trains on its own batch for two
    steps. graphpipe's refusals of the compositions it cannot honour are checked first.
    ``refuse``: before those steps, replica 1's pipeline rank 0 passes ``arg_mbs`` of 3
    entries for M=4 (what each rank raised: ``out["refused"]``)."""
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
    if impl == "torch":
        stages = _reference_stages(stages)
    extra = {"dp_group": dp_group} if impl == "graphpipe" else {}
    cls = (pipelining if impl == "torch" else gp_pp).ScheduleDualPipeV

    sched = cls(stages, n_microbatches=4, loss_fn=_sharded_loss, scale_grads=False, **extra)
    out: dict = {"losses": [], "grads": []}
    if refuse:
        x, y, _ = batch(0)
        try:
            if (pp, dp) == (0, 1):
                sched.step(arg_mbs=[(c,) for c in x.chunk(4)][:3], target=y)
            else:
                sched.step(*((x,) if pp == 0 else ()), target=y if pp == 0 else None)
            out["refused"] = "returned"
        except Exception as e:
            out["refused"] = f"{type(e).__name__}: {e}"
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


def test_arguments_refused_on_one_replica_raise_on_every_rank_of_every_replica() -> None:
    """pp 2 x dp 2, a check failing on replica 1's pipeline rank 0 (global rank 1): its
    pipeline's ranks raise, and so do replica 0's (which would otherwise wait for replica 1
    in the step's data-parallel agreement); the next steps run on every rank, exact."""
    got = run_ranks(_run_sharded, 4, "graphpipe", True, timeout=300)
    why = "ValueError: arg_mbs must be a list of n_microbatches=4 entries, got 3"
    replica = (
        f"PipelineError: ScheduleDualPipeV: data-parallel replica 1 refused this step() (its "
        f"rank 0: {why}); no rank of any replica ran it"
    )
    # global rank = 2 * pp + dp (the mesh's ("pp", "dp") layout)
    assert got[1]["refused"] == why
    assert got[3]["refused"] == (
        f"PipelineError: ScheduleDualPipeV: rank 0 refused the arguments of this step() "
        f"({why}); no rank ran it"
    )
    assert got[0]["refused"] == got[2]["refused"] == replica
    modules = build(4)
    for dp in (0, 1):
        for step in range(2):
            x, y, _ = batch(10 * step + dp)
            want = []
            with torch.no_grad():
                for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
                    for mod in modules:
                        xm = mod(xm)
                    want.append(float(_sharded_loss(xm, ym)))
            torch.testing.assert_close(
                torch.tensor(got[dp]["losses"][step]), torch.tensor(want), rtol=RTOL, atol=ATOL
            )


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
    if impl == "torch":
        stages = _reference_stages(stages)
    sched = (pipelining if impl == "torch" else gp_pp).ScheduleDualPipeV(stages, 4, mse)
    x, y, _ = batch(0)
    for _ in range(2):
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
    if impl == "graphpipe":
        sched.close()
    return [int(m.forwards) for m in mods]


def test_each_stage_runs_one_forward_per_microbatch() -> None:
    """Two steps of 4 micro-batches: graphpipe runs each stage's forward 8 times (torch one
    more: the next test)."""
    assert run_ranks(_count_forwards, 2, "graphpipe") == [[8, 8], [8, 8]]


# The torch versions whose extra forward (the next test) was checked.
EXTRA_FORWARD_CHECKED = ("2.11", "2.13")


def test_torch_runs_each_stages_forward_once_more_at_the_first_step() -> None:
    """torch's PipelineStage infers its P2P metadata at the first step by running each
    stage's forward once more in training mode, so over two steps of 4 micro-batches a module
    that counts in forward (MoE token counts) counts 9 (docs/torchtitan.md;
    tests/torchtitan_trainer/launch.py undoes it for the Trainer test's reference). This
    asserts torch's behaviour on the versions checked (2.11.0, 2.13.0); when it changes,
    update both."""
    version = ".".join(torch.__version__.split(".")[:2])
    if version not in EXTRA_FORWARD_CHECKED:
        pytest.skip(
            f"torch {torch.__version__}: its PipelineStage's forwards at the first step were "
            f"checked on torch {', '.join(EXTRA_FORWARD_CHECKED)} only; check this version and "
            "add it to EXTRA_FORWARD_CHECKED"
        )
    assert run_ranks(_count_forwards, 2, "torch") == [[9, 9], [9, 9]]
