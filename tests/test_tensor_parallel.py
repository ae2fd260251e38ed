"""Tensor-parallel stages (``parallelize_module`` with Colwise / Rowwise layers) on a
("pp", "tp") mesh of 4 gloo ranks (PP 2 x TP 2): the output of a RowwiseParallel layer (an
AsyncCollectiveTensor) crosses the edge, DTensor gradients are clipped over the tp group,
checkpoints round-trip and export the whole model; against one process and the whole model.
Compiled tensor-parallel stages train alike, and say that they do not defer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.pipeline_models import batch, mse
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

PP, TP, DIM, LR, CLIP = 2, 2, 8, 0.1, 0.2
# float64; the tensor-parallel GEMMs split the hidden dim over two ranks and add the halves
# (another summation order than one GEMM), per micro-batch: equal to rounding, not bitwise.
TOL = 1e-12


class Mlp(nn.Module):
    """Linear, GELU, Linear: the stage's output comes straight from the second Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _stages() -> list[nn.Module]:
    from graphpipe.keymap import set_unsplit_keys

    torch.manual_seed(0)
    stages = [Mlp().double() for _ in range(2 * PP)]
    for i, s in enumerate(stages):  # the whole model: a ModuleList of the stages
        set_unsplit_keys(s, {"": str(i)})
    return stages


def _parallel(mine: list[nn.Module], tp_mesh) -> None:
    """Colwise ``up``, rowwise ``down``: the stage output is the rowwise layer's."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for s in mine:
        parallelize_module(s, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _train(pipe, is_first: bool, rows: int = 8, share=slice(None)) -> tuple[list, list, Any]:
    """Two SGD steps of ``pipe`` on ``share`` of the batches of ``rows``: losses, norms and
    the optimizer."""
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(2):
        x, y = batch(rows, seed=5 + step)
        x, y = x[share], y[share]
        opt.zero_grad()
        losses.append(pipe.step(x if is_first else None, y if is_first else None).item())
        norms.append(pipe.grad_norm.item() if pipe.grad_norm is not None else None)
        opt.step()
    return losses, norms, opt


def _full_params(pipe, mine: list[nn.Module]) -> dict:
    """``(stage, name) -> the whole tensor`` of this rank's stages."""
    ids = pipe.stage_ids
    return {
        (ids[li], n): q.full_tensor().detach().clone()
        for li, m in enumerate(mine)
        for n, q in m.named_parameters()
    }


def whole_model(clip: float, rows: int = 8) -> tuple[list, list, dict]:
    """One process trains every stage on the whole batches: losses, clipped norms, weights."""
    stages = _stages()
    params = [q for s in stages for q in s.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for step in range(2):
        x, y = batch(rows, seed=5 + step)
        h = x
        for s in stages:
            h = s(h)
        loss = mse(h, y)
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        opt.step()
        losses.append(loss.item())
    assert norms[0] > clip  # the case clips
    want = {(i, n): q.detach() for i, s in enumerate(stages) for n, q in s.named_parameters()}
    return losses, norms, want


def assert_trained_alike(res: dict, losses: list, want: dict, norms: list | None = None):
    assert res["losses"] == pytest.approx(losses, rel=TOL)
    if norms is not None:
        assert res["norms"] == pytest.approx(norms, rel=TOL)
    for key, value in res["params"].items():
        torch.testing.assert_close(value, want[key], rtol=TOL, atol=TOL, msg=str(key))


def _run(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe
    from graphpipe.checkpoint import load_checkpoint, save_checkpoint

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    p = mesh.get_local_rank("pp")

    def build():
        stages = _stages()
        mine = [stages[p], stages[2 * PP - 1 - p]]
        _parallel(mine, mesh["tp"])
        return mine

    mine = build()
    pipe = graphpipe.DualPipeV(
        mine, num_microbatches=4, loss_fn=mse, group=mesh.get_group("pp"), clip_grad_norm=CLIP
    )
    losses, norms, opt = _train(pipe, p == 0)
    ids = pipe.stage_ids
    params = _full_params(pipe, mine)
    # every rank of the world holds a shard of some stage: the checkpoint is the world's
    save_checkpoint(root, 2, dict(zip(ids, mine)), opt)
    fresh = build()
    opt2 = torch.optim.SGD([q for m in fresh for q in m.parameters()], lr=LR)
    load_checkpoint(f"{root}/step-00000002", dict(zip(ids, fresh)), opt2)
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for m, f in zip(mine, fresh)
        for a, b in zip(m.parameters(), f.parameters())
    )
    pipe.close()
    return {"losses": losses, "norms": norms, "params": params, "resumed_equal": same}


def test_tensor_parallel_stages_train_clip_and_checkpoint_as_the_whole_model(tmp_path):
    from graphpipe.checkpoint import export_state_dict

    root = str(tmp_path / "ckpt")
    results = run_ranks(_run, PP * TP, root)
    losses, norms, want = whole_model(CLIP)
    for res in results:
        assert_trained_alike(res, losses, want, norms)
        assert res["resumed_equal"]
    exported = export_state_dict(f"{root}/step-00000002")
    for (i, n), value in want.items():  # the whole tensors, gathered from the tp shards
        torch.testing.assert_close(exported[f"{i}.{n}"], value, rtol=TOL, atol=TOL)
    nn.ModuleList(_stages()).load_state_dict(exported, strict=True)


def _compiled_run(rank: int, world: int) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    p = mesh.get_local_rank("pp")
    stages = _stages()
    mine = [stages[p], stages[2 * PP - 1 - p]]
    _parallel(mine, mesh["tp"])
    # aot_eager: AOTAutograd traces forward and backward as inductor does, without compiling
    # kernels (compile time); the DTensor weights are what matters here
    run = [torch.compile(s, backend="aot_eager") for s in mine]
    pipe = graphpipe.DualPipeV(
        run, num_microbatches=4, loss_fn=mse, group=mesh.get_group("pp"), clip_grad_norm=CLIP
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _, _ = _train(pipe, p == 0)
    warned = [str(w.message) for w in caught if "deferred no weight" in str(w.message)]
    out = {"losses": losses, "warned": warned, "ids": pipe.stage_ids}
    out.update(params=_full_params(pipe, mine), deferrable=pipe.num_deferrable)
    pipe.close()
    return out


def test_compiled_tensor_parallel_stages_train_as_the_whole_model_and_say_they_do_not_defer():
    results = run_ranks(_compiled_run, PP * TP)
    losses, _, want = whole_model(CLIP)
    for res in results:
        assert res["deferrable"] == (2, 2)  # switched, but a DTensor weight keeps B whole
        assert_trained_alike(res, losses, want)
        # once (after the first of two steps), naming this rank's stages
        assert len(res["warned"]) == 1
        assert f"stage(s) {list(res['ids'])} deferred no weight gradient" in res["warned"][0]


def _accumulate_run(rank: int, world: int) -> dict:
    """Two calls without zeroing, then the whole gradients of this rank's stages."""
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    p = mesh.get_local_rank("pp")
    stages = _stages()
    mine = [stages[p], stages[2 * PP - 1 - p]]
    _parallel(mine, mesh["tp"])
    pipe = graphpipe.DualPipeV(mine, num_microbatches=4, loss_fn=mse, group=mesh.get_group("pp"))
    for step in range(2):
        x, y = batch(8, seed=5 + step)
        pipe.step(x if p == 0 else None, y if p == 0 else None)
    ids = pipe.stage_ids
    grads = {
        (ids[li], n): q.grad.full_tensor().clone()
        for li, m in enumerate(mine)
        for n, q in m.named_parameters()
    }
    pipe.close()
    return grads


def test_tensor_parallel_stages_accumulate_two_calls_as_their_sum():
    results = run_ranks(_accumulate_run, PP * TP)
    stages = _stages()
    for step in range(2):  # one process accumulates both backward passes
        x, y = batch(8, seed=5 + step)
        h = x
        for s in stages:
            h = s(h)
        mse(h, y).backward()
    want = {(i, n): q.grad for i, s in enumerate(stages) for n, q in s.named_parameters()}
    for grads in results:
        for key, g in grads.items():
            torch.testing.assert_close(g, want[key], rtol=TOL, atol=TOL, msg=str(key))
