"""A ("dp", "pp", "tp") mesh of 8 gloo ranks (DP 2 x PP 2 x TP 2): tensor-parallel stages in a
DualPipeV pipeline, replicated over dp with graphpipe's data parallelism and clipped inside
the step, against one process training the whole model on the whole batch (the recipe of
docs/composition.md, "FSDP2 and tensor parallel", with a dp dim). One spawn of 8 ranks.
"""

from __future__ import annotations

import pytest

from tests.pipeline_models import mse
from tests.spawn import run_ranks
from tests.test_tensor_parallel import (
    _full_params,
    _parallel,
    _stages,
    _train,
    assert_trained_alike,
    whole_model,
)

pytestmark = pytest.mark.distributed

DP, PP, TP = 2, 2, 2
ROWS = 16  # the global batch: 8 rows per replica, 4 micro-batches of 2
CLIP = 0.1  # below the first step's norm (0.18): the case clips


def _run(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe

    mesh = init_device_mesh("cpu", (DP, PP, TP), mesh_dim_names=("dp", "pp", "tp"))
    d, p = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    stages = _stages()
    mine = [stages[p], stages[2 * PP - 1 - p]]
    _parallel(mine, mesh["tp"])
    pipe = graphpipe.DualPipeV(
        mine,
        num_microbatches=4,
        loss_fn=mse,
        group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        clip_grad_norm=CLIP,
    )
    share = ROWS // DP
    losses, norms, _ = _train(pipe, p == 0, ROWS, slice(d * share, (d + 1) * share))
    out = {"losses": losses, "norms": norms, "params": _full_params(pipe, mine)}
    pipe.close()
    return out


@pytest.mark.slow  # eight processes: the slow lane (docs/development.md)
def test_dp_pp_tp_mesh_trains_as_one_process_on_the_whole_batch() -> None:
    results = run_ranks(_run, DP * PP * TP, timeout=240)
    # the mean over the whole batch is the replicas' mean of their means (equal shares)
    losses, norms, want = whole_model(CLIP, ROWS)
    for res in results:  # every rank: the loss and norm of the whole model and batch
        assert_trained_alike(res, losses, want, norms)
