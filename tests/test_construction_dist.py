"""Construction errors on some ranks reach every rank at once, by name: a rank that refuses
its arguments before the ranks join marks its join key, so the others raise there instead of
entering a collective it never enters (issue: the other replica waited 60 s in the
data-parallel setup and got a raw gloo error; rank 1 blocked in the tied-weights all-reduce
until rank 0's process ended)."""

from __future__ import annotations

import time

import pytest

from tests.pipeline_models import build_stages, mse
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


def _attempt(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _dp_none_on_one_rank(rank: int, world: int) -> tuple[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    p = mesh.get_local_rank("pp")
    stages = build_stages(4)
    dp = None if rank == 2 else mesh.get_group("dp")  # replica 1's rank 0 forgets it
    return _attempt(
        lambda: graphpipe.DualPipeV(
            (stages[p], stages[3 - p]),
            num_microbatches=4,
            loss_fn=mse,
            group=mesh.get_group("pp"),
            dp_group=dp,
            timeout=5.0,  # rank 0 waits it out (see the test)
        )
    )


def test_one_rank_without_dp_group_fails_every_rank_of_both_replicas():
    results = run_ranks(_dp_none_on_one_rank, 4, timeout=240)
    texts = [t for t, _ in results]
    # replica 1 (global ranks 2, 3): their configurations differ, named on both
    for r in (2, 3):
        assert texts[r].startswith("ValueError: the pipeline ranks are configured differently")
    # replica 0's rank 1 (dp peer of rank 3) is told rank 3's reason at once
    assert texts[1].startswith(
        "PipelineError: rank 1 (global rank 3) could not build its pipeline:"
    )
    assert "configured differently" in texts[1]
    # rank 0's dp peer (rank 2) never knew its group: rank 0 waits the timeout, naming it
    assert texts[0].startswith(
        "PipelineError: rank 1 (global rank 2) did not join the data-parallel setup"
    )


def _capture_refused_on_rank_0(rank: int, world: int) -> str:
    import graphpipe

    stages = build_stages(2, tied=False)
    mine = stages[rank]
    graphpipe.mark_tied(mine.fc1.weight, "fc1")  # a tied-weights all-reduce follows the join
    opt = None
    if rank == 0:  # capture_optimizer without capture: refused on rank 0 only
        import torch

        opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    return _attempt(
        lambda: graphpipe.Pipeline(
            [mine],
            schedule="1f1b",
            num_microbatches=2,
            loss_fn=mse,
            capture_optimizer=opt,
            timeout=60.0,
        )
    )[0]


def test_a_rank_refusing_its_arguments_is_named_on_its_peer_at_once():
    results = run_ranks(_capture_refused_on_rank_0, 2, timeout=120)
    assert results[0] == "ValueError: capture_optimizer needs capture=True, 'step' or 'action'"
    assert results[1] == (
        "PipelineError: rank 0 could not build the pipeline: ValueError: capture_optimizer "
        "needs capture=True, 'step' or 'action'"
    )
