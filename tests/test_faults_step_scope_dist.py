"""Failure notices belong to their step: when two ranks fail in the same step (each raising its
own error), every later step that all ranks enter cleanly runs, and no rank raises the earlier
step's notice. The faults are armed for one step only: a fault counted across steps (the
n-th forward of the process) fires in a later step when the earlier one ended first, which
is a new failure of that later step, not a notice that outlived its own."""

from __future__ import annotations

import time

import pytest

from tests.pipeline_models import batch, build_stages, local_stages, mse
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


def _both_fail_in_step_0(rank: int, world: int) -> list[str]:
    import graphpipe

    mine = local_stages(build_stages(2 * world), rank, world)
    pipe = graphpipe.DualPipeV(mine, loss_fn=mse, num_microbatches=4, timeout=30.0)
    state = {"forwards": 0, "armed": True}
    real = mine[0].forward

    def forward(*args, **kwargs):
        state["forwards"] += 1
        if state["armed"] and rank == 1 and state["forwards"] == 1:
            raise ValueError("planted on rank 1")
        if state["armed"] and rank == 0 and state["forwards"] == 3:
            faults = pipe._faults  # rank 1's notice of this call is there: fail too
            deadline = time.monotonic() + 60.0
            while faults.notices.peek(faults.call) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            raise ValueError("planted on rank 0")
        return real(*args, **kwargs)

    mine[0].forward = forward
    out = []
    for step in range(3):
        x, y = batch(8, seed=step)
        try:
            pipe.step(x if rank == 0 else None, y if rank == 0 else None)
            out.append("ok")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}".splitlines()[0][:60])
        state["armed"] = False  # the faults belong to step 0
    pipe.close()
    return out


def test_two_ranks_failing_in_one_step_leave_the_next_steps_clean():
    results = run_ranks(_both_fail_in_step_0, 2)
    assert results[0] == ["ValueError: planted on rank 0", "ok", "ok"]
    assert results[1] == ["ValueError: planted on rank 1", "ok", "ok"]
