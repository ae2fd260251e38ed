"""What ``Pipeline.step`` refuses before looking at the batch (no grad mode, a tensor passed
as ``scaler``) is refused on every rank through the batch agreement: the refusing rank
raises its own error, the others a ``PipelineError`` naming it, no rank runs the step, and
the next step works on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.pipeline_models import batch, build_stages, local_stages, mse
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


def _case(rank: int, world: int, what: str) -> dict:
    import graphpipe

    pipe = graphpipe.DualPipeV(
        local_stages(build_stages(2 * world), rank, world), num_microbatches=4, loss_fn=mse
    )
    x, y = batch(8)
    xs, ys = (x, y) if rank == 0 else (None, None)
    out: dict = {}
    try:
        if rank == 1 and what == "no_grad":
            with torch.no_grad():
                pipe.step(xs, ys)
        elif rank == 1 and what == "scaler":
            pipe.step(xs, ys, scaler=torch.ones(1))
        else:
            pipe.step(xs, ys)
        out["refused"] = "no error"
    except Exception as e:
        out["refused"] = f"{type(e).__name__}: {e}"
    out["next"] = pipe.step(xs, ys).item()  # every rank goes on
    return out


@pytest.mark.parametrize("what,own", [("no_grad", "needs grad mode"), ("scaler", "scaler=")])
def test_a_step_refused_on_one_rank_is_refused_on_every_rank(what, own):
    results = run_ranks(_case, 2, what)
    assert results[1]["refused"].startswith(("RuntimeError", "ValueError")), results[1]
    assert own in results[1]["refused"]
    assert results[0]["refused"].startswith("PipelineError"), results[0]
    assert "rank 1 rejected this batch" in results[0]["refused"] and own in results[0]["refused"]
    assert results[0]["next"] == results[1]["next"]
