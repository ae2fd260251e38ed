"""A ("dp", "pp", "tp") mesh of 8 gloo ranks (DP 2 x PP 2 x TP 2): tensor-parallel stages in a
DualPipeV pipeline, replicated over dp with graphpipe's data parallelism and clipped inside
the step, against one process training the whole model on the whole batch (the recipe of
docs/composition.md, "FSDP2 and tensor parallel", with a dp dim). One spawn of 8 ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.pipeline_models import batch, mse
from tests.spawn import run_ranks
from tests.test_tensor_parallel import LR, TOL, _stages

pytestmark = pytest.mark.distributed

DP, PP, TP = 2, 2, 2
ROWS = 16  # the global batch: 8 rows per replica, 4 micro-batches of 2
CLIP = 0.1  # below the first step's norm (0.18): the case clips


def _run(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import graphpipe

    mesh = init_device_mesh("cpu", (DP, PP, TP), mesh_dim_names=("dp", "pp", "tp"))
    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    stages = _stages()
    mine = [stages[p], stages[2 * PP - 1 - p]]
    for s in mine:
        parallelize_module(s, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    pipe = graphpipe.DualPipeV(
        mine,
        num_microbatches=4,
        loss_fn=mse,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        clip_grad_norm=CLIP,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, norms = [], []
    share = ROWS // DP
    for step in range(2):
        x, y = batch(ROWS, seed=5 + step)
        x, y = x[d * share : (d + 1) * share], y[d * share : (d + 1) * share]
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
    pipe.close()
    return {"losses": losses, "norms": norms, "params": params}


def test_dp_pp_tp_mesh_trains_as_one_process_on_the_whole_batch() -> None:
    results = run_ranks(_run, DP * PP * TP, timeout=240)
    stages = _stages()
    params = [q for s in stages for q in s.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for step in range(2):
        x, y = batch(ROWS, seed=5 + step)
        h = x
        for s in stages:
            h = s(h)
        loss = mse(h, y)  # the mean over the whole batch: the replicas' mean of means
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        losses.append(loss.item())
    assert norms[0] > CLIP  # the case clips
    want = {(i, n): q.detach() for i, s in enumerate(stages) for n, q in s.named_parameters()}
    for res in results:  # every rank: the loss and norm of the whole model and batch
        assert res["losses"] == pytest.approx(losses, rel=TOL)
        assert res["norms"] == pytest.approx(norms, rel=TOL)
        for key, value in res["params"].items():
            torch.testing.assert_close(value, want[key], rtol=TOL, atol=TOL, msg=str(key))
