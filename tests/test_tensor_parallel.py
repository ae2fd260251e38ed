"""Tensor-parallel stages (``parallelize_module`` with Colwise / Rowwise layers) on a
("pp", "tp") mesh of 4 gloo ranks (PP 2 x TP 2): the output of a RowwiseParallel layer (an
AsyncCollectiveTensor) crosses the edge, DTensor gradients are clipped over the tp group,
checkpoints round-trip and export the whole model; against one process and the whole model.
Compiled tensor-parallel stages train alike, and say that they do not defer.
"""

from __future__ import annotations

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


def _run(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import graphpipe
    from graphpipe.checkpoint import load_checkpoint, save_checkpoint

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    p = mesh.get_local_rank("pp")
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}

    def build():
        stages = _stages()
        mine = [stages[p], stages[2 * PP - 1 - p]]
        for s in mine:
            parallelize_module(s, mesh["tp"], plan)
        return mine

    mine = build()
    pipe = graphpipe.DualPipeV(
        mine, num_microbatches=4, loss_fn=mse, group=mesh.get_group("pp"), clip_grad_norm=CLIP
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(2):
        x, y = batch(8, seed=5 + step)
        opt.zero_grad()
        losses.append(pipe.step(x if p == 0 else None, y if p == 0 else None).item())
        norms.append(pipe.grad_norm.item())
        opt.step()
    ids = pipe.stage_ids
    params = {
        (ids[li], n): q.full_tensor().detach().clone()
        for li, m in enumerate(mine)
        for n, q in m.named_parameters()
    }
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
    stages = _stages()
    params = [q for s in stages for q in s.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for step in range(2):
        x, y = batch(8, seed=5 + step)
        h = x
        for s in stages:
            h = s(h)
        loss = mse(h, y)
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        losses.append(loss.item())
    assert norms[0] > CLIP  # the case clips
    want = {(i, n): q.detach() for i, s in enumerate(stages) for n, q in s.named_parameters()}
    for res in results:
        assert res["losses"] == pytest.approx(losses, rel=TOL)
        assert res["norms"] == pytest.approx(norms, rel=TOL)
        for key, value in res["params"].items():
            torch.testing.assert_close(value, want[key], rtol=TOL, atol=TOL, msg=str(key))
        assert res["resumed_equal"]
    exported = export_state_dict(f"{root}/step-00000002")
    for (i, n), value in want.items():  # the whole tensors, gathered from the tp shards
        torch.testing.assert_close(exported[f"{i}.{n}"], value, rtol=TOL, atol=TOL)
    nn.ModuleList(_stages()).load_state_dict(exported, strict=True)


def _compiled_run(rank: int, world: int) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import graphpipe

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    p = mesh.get_local_rank("pp")
    stages = _stages()
    mine = [stages[p], stages[2 * PP - 1 - p]]
    for s in mine:
        parallelize_module(s, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # aot_eager: AOTAutograd traces forward and backward as inductor does, without compiling
    # kernels (compile time); the DTensor weights are what matters here
    run = [torch.compile(s, backend="aot_eager") for s in mine]
    pipe = graphpipe.DualPipeV(
        run, num_microbatches=4, loss_fn=mse, group=mesh.get_group("pp"), clip_grad_norm=CLIP
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, warned = [], []
    for step in range(2):
        x, y = batch(8, seed=5 + step)
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = pipe.step(x if p == 0 else None, y if p == 0 else None)
        losses.append(loss.item())
        warned.append([str(w.message) for w in caught if "deferred no weight" in str(w.message)])
        opt.step()
    ids = pipe.stage_ids
    params = {
        (ids[li], n): q.full_tensor().detach().clone()
        for li, m in enumerate(mine)
        for n, q in m.named_parameters()
    }
    out = {"losses": losses, "warned": warned, "ids": ids, "params": params}
    out["deferrable"] = pipe.num_deferrable
    pipe.close()
    return out


def test_compiled_tensor_parallel_stages_train_as_the_whole_model_and_say_they_do_not_defer():
    results = run_ranks(_compiled_run, PP * TP)
    stages = _stages()
    params = [q for s in stages for q in s.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(2):
        x, y = batch(8, seed=5 + step)
        h = x
        for s in stages:
            h = s(h)
        loss = mse(h, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(loss.item())
    want = {(i, n): q.detach() for i, s in enumerate(stages) for n, q in s.named_parameters()}
    for res in results:
        assert res["deferrable"] == (2, 2)  # switched, but a DTensor weight keeps B whole
        assert res["losses"] == pytest.approx(losses, rel=TOL)
        for key, value in res["params"].items():
            torch.testing.assert_close(value, want[key], rtol=TOL, atol=TOL, msg=str(key))
        # once, after the first step, naming this rank's stages
        assert len(res["warned"][0]) == 1 and res["warned"][1] == []
        assert f"stage(s) {list(res['ids'])} deferred no weight gradient" in res["warned"][0][0]
