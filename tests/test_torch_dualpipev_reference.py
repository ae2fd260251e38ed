"""Documents a defect of torch 2.13's own split backward, without torchtitan: why torch's stock
ScheduleDualPipeV is not the exactness reference of tests/test_torchtitan_trainer.py.

torch's BACKWARD_INPUT action (stage.py: backward_one_chunk(full_backward=False) ->
_backward.stage_backward_input) takes the weights whose gradients BACKWARD_WEIGHT will compute
from ``self.submod.parameters()`` when the action runs, and finds each one's node in the
autograd graph (``_get_grad_fn_or_grad_acc``). Under FSDP2 a module's parameters are the
sharded DTensors whenever its group is resharded, while the graph recorded in the forward holds
the unsharded ones. A loss that runs the head's backward itself, as torchtitan's
ChunkedLossWrapper does (lm_head on detached chunks, ``.backward()`` per chunk, then an autograd
Function that hands the accumulated gradient to the hidden states), runs FSDP2's post-backward
of the ``fully_shard([norm, lm_head])`` group inside the forward, which reshards that group
(here by FSDP2's default reshard_after_backward=True, which torch's stage turns off only at its
first backward; ChunkedLossWrapper calls ``lm_head.reshard()`` after every loss). At
BACKWARD_INPUT, norm.weight is then the sharded DTensor: no parameter group holds it,
BACKWARD_INPUT's ``autograd.grad`` computes the stage input's gradient only, and
BACKWARD_WEIGHT computes nothing for it. The norm's weight gradient of every micro-batch whose
last-stage backward is split is lost. DualPipeV on 2 ranks splits the last stage's backward
of micro-batch 0 only (rank 0: ``3I0 3W0``, then full ``3B1..3B3``), so norm.weight gets the
sum over micro-batches 1 to 3. Interleaved1F1B (full backward: ``autograd.backward`` into the
graph's own leaves) gets all four. Either ingredient alone (FSDP2, or the loss's own
backward) leaves DualPipeV exact.

These tests assert torch's behaviour on the versions in ``CHECKED``: the defect holds on torch
2.13.0; torch 2.11.0 crashes instead (SIGSEGV in the autograd engine, in the last stage's
backward under FSDP2 with a loss that runs its own backward, DualPipeV and Interleaved1F1B
alike), so the tests with both ingredients skip there, saying so; on a version not checked the
defect's test skips, saying so. When one fails, torch has changed it; update CHECKED,
docs/torchtitan.md ("How it is tested") and the checks against torch's stock DualPipeV in
tests/test_torchtitan_trainer.py.

torch 2.11's DualPipeV needs one hand on gloo to run at all (``_reference_stages`` of
tests/test_torch_pipelining.py: its first step's P2P warm-up sends to the rank itself)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.pipeline_models import Block
from tests.spawn import run_ranks
from tests.test_torch_pipelining import _reference_stages

pipelining = pytest.importorskip(
    "torch.distributed.pipelining", reason="this torch has no torch.distributed.pipelining"
)
if not hasattr(pipelining, "ScheduleDualPipeV"):
    pytest.skip(f"torch {torch.__version__} has no ScheduleDualPipeV", allow_module_level=True)

pytestmark = pytest.mark.distributed

DIM, VOCAB, TOKENS, M = 8, 16, 6, 4  # 4 micro-batches: DualPipeV needs one per stage
RTOL = 1e-10  # float64; the schedules sum the micro-batches' gradients in other orders
# What torch's schedules do under FSDP2 with a loss that runs its own backward, by the torch
# versions checked (major.minor): "loses" micro-batch 0's norm.weight gradient (DualPipeV; the
# full backward of Interleaved1F1B is exact), or "crashes" the process in that backward.
CHECKED = {"2.13": "loses", "2.11": "crashes"}
VERSION = ".".join(torch.__version__.split(".")[:2])
CRASHES = (
    f"torch {torch.__version__} crashes the process (SIGSEGV in the autograd engine, checked on "
    "2.11.0) in the last stage's backward under FSDP2 with a loss that runs its own backward, "
    "for DualPipeV and Interleaved1F1B alike: this needs a torch that runs it (2.13)"
)
FIXED = (
    "torch's {name} now gives norm.weight {what}: torch has changed its split backward under "
    "FSDP2; update docs/torchtitan.md and tests/test_torchtitan_trainer.py"
)


class _Last(nn.Module):
    """The last stage: a block, then RMSNorm; the head is applied by the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(DIM, 3, 4)
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.block(h))


class _HandOver(torch.autograd.Function):
    """The loss's value, whose backward gives ``hidden`` the gradient the loss computed."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor):
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    mods = [Block(DIM, i, 4) for i in range(3)] + [_Last()]
    with torch.no_grad():
        mods[3].norm.weight.uniform_(0.5, 1.5)
    return [m.double() for m in mods]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, TOKENS, DIM, generator=g, dtype=torch.float64)
    return x, torch.randint(0, VOCAB, (M, TOKENS), generator=g)


def _own_backward_loss(last: nn.Module, hidden: torch.Tensor, target: torch.Tensor):
    """ChunkedLossWrapper's pattern in one chunk: the head on detached hidden states, its
    backward run here, the hidden states' gradient handed over by an autograd Function."""
    h = hidden.detach().requires_grad_(hidden.requires_grad)
    loss = F.cross_entropy(last.lm_head(h).flatten(0, 1), target.flatten())
    if not hidden.requires_grad:
        return loss
    loss.backward()
    return _HandOver.apply(hidden, h.grad, loss.detach())


def _plain_loss(last: nn.Module, hidden: torch.Tensor, target: torch.Tensor):
    return F.cross_entropy(last.lm_head(hidden).flatten(0, 1), target.flatten())


def _autograd_norm_grads() -> list[torch.Tensor]:
    """norm.weight's gradient of each micro-batch, by plain autograd on the whole model."""
    x, y = _batch()
    grads = []
    for i in range(M):
        mods = _stages()
        h = x[i : i + 1]
        for m in mods:
            h = m(h)
        _plain_loss(mods[3], h, y[i : i + 1]).backward()
        grads.append(mods[3].norm.weight.grad)
    return grads


def _job(rank: int, world: int, name: str, fsdp: bool, own_backward: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor import DTensor

    mods = _stages()
    last = mods[3]
    # DualPipeV's V puts stages 0 and 3 on rank 0; Interleaved1F1B's loop 0 and 2.
    mine = [rank, 3 - rank] if name == "DualPipeV" else [rank, rank + 2]
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    if fsdp:  # torchtitan's wrapping, on a one-rank data-parallel mesh
        for i in mine:
            if i == 3:
                fully_shard([last.norm, last.lm_head], mesh=mesh["dp"], reshard_after_forward=False)
                fully_shard(last.block, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(mods[i], mesh=mesh["dp"], reshard_after_forward=False)

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (_own_backward_loss if own_backward else _plain_loss)(last, hidden, target)

    group = mesh["pp"].get_group()
    stages = [PipelineStage(mods[i], i, 4, torch.device("cpu"), group=group) for i in mine]
    stages = _reference_stages(stages)
    backwards: list[tuple[int, bool, bool]] = []  # the last stage's: (micro-batch, full, sharded)
    for stage in stages:
        if stage.is_last:
            run = stage.backward_one_chunk

            def noted(chunk: int, *args, run=run, **kwargs):
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                backwards.append((chunk, full, isinstance(last.norm.weight, DTensor)))
                return run(chunk, *args, **kwargs)

            stage.backward_one_chunk = noted
    schedule = get_schedule_class(name)(stages, M, loss_fn=loss_fn, scale_grads=False)
    x, y = _batch()
    schedule.step(*((x,) if 0 in mine else ()), target=y if 3 in mine else None)
    if 3 not in mine:
        return {}
    grad = last.norm.weight.grad
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return {"norm": grad, "backwards": backwards}


def _last_stage(name: str, fsdp: bool, own_backward: bool) -> dict:
    results = run_ranks(_job, 2, name, fsdp, own_backward, timeout=300)
    (got,) = [r for r in results if r]
    return got


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max())))


def test_torch_dualpipev_loses_the_split_microbatchs_norm_weight_grad() -> None:
    """FSDP2 and a loss that runs its own backward: micro-batch 0's norm.weight gradient
    (the one micro-batch whose last-stage backward DualPipeV splits) is missing (torch
    2.13.0)."""
    if CHECKED.get(VERSION) == "crashes":
        pytest.skip(CRASHES)
    if CHECKED.get(VERSION) != "loses":
        pytest.skip(
            f"documents torch 2.13's split backward under FSDP2 (checked on 2.13.0); torch "
            f"{torch.__version__} is not checked: run this file with it and add it to CHECKED"
        )
    per_mb = _autograd_norm_grads()
    full = torch.stack(per_mb).sum(0)
    got = _last_stage("DualPipeV", fsdp=True, own_backward=True)
    # Micro-batch 0's backward is the last stage's only split one, and it finds the norm's
    # group resharded by the loss.
    assert got["backwards"] == [
        (0, False, True),
        (1, True, False),
        (2, True, False),
        (3, True, False),
    ]
    assert not _close(got["norm"], full), FIXED.format(name="DualPipeV", what="autograd's value")
    assert _close(got["norm"], full - per_mb[0]), FIXED.format(
        name="DualPipeV", what="another value than autograd's without micro-batch 0"
    )


@pytest.mark.parametrize(
    ("name", "fsdp", "own_backward"),
    [
        ("Interleaved1F1B", True, True),  # full backward: no split
        ("DualPipeV", False, True),  # no FSDP2: parameters() are the graph's leaves
        ("DualPipeV", True, False),  # no backward in the loss: the group stays unsharded
    ],
)
def test_torch_schedules_give_autograds_norm_weight_grad_otherwise(
    name: str, fsdp: bool, own_backward: bool
) -> None:
    if fsdp and own_backward and CHECKED.get(VERSION) == "crashes":
        pytest.skip(CRASHES)
    full = torch.stack(_autograd_norm_grads()).sum(0)
    got = _last_stage(name, fsdp, own_backward)
    assert _close(got["norm"], full)
