"""A process group beside the pipeline (tensor parallel, data parallel, expert parallel)
that shares ranks with the pipeline group is refused at construction on every rank, naming
the group, its ranks and the pipeline's, before any collective runs.

Such a group puts two pipeline ranks, busy with different actions of the schedule, into one
collective: a tensor-parallel mesh made of the pipeline's own ranks was accepted, and the
step deadlocked until a raw gloo timeout (``Timed out waiting 30000ms for recv operation``
on rank 0, a lost-rank error on rank 1).
"""

from __future__ import annotations

import pytest

from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


def _construct(rank: int, world: int, case: str) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import graphpipe
    from tests.pipeline_models import mse
    from tests.test_tensor_parallel import _parallel, _stages

    stages = _stages()
    mine = [stages[rank], stages[2 * world - 1 - rank]]
    kwargs: dict = {}
    if case.startswith("tp"):  # a tp mesh of the pipeline's own ranks
        _parallel(mine, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    elif case == "dp":
        kwargs["dp_group"] = dist.group.WORLD
    elif case == "ep":
        kwargs["expert_groups"] = (dist.group.WORLD, None)
    if case == "tp on rank 0 only" and rank != 0:
        return "not constructed"  # rank 1 enters no collective: rank 0 must not wait for it
    try:
        graphpipe.DualPipeV(mine, num_microbatches=4, loss_fn=mse, timeout=20, **kwargs)
    except ValueError as e:
        return str(e)
    return "constructed"


CASES = {
    "tp": "the mesh dim 'tp' of local stage 0's up.weight",
    "dp": "dp_group",
    "ep": "expert_groups.ep_group",
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_group_that_overlaps_the_pipeline_is_refused_on_every_rank(case: str) -> None:
    results = run_ranks(_construct, 2, case, timeout=120)
    for rank, got in enumerate(results):
        other = 1 - rank
        assert got == (
            f"{CASES[case]} overlaps the pipeline group: its global ranks [0, 1] include "
            f"pipeline ranks [{other}] besides this one (global rank {rank}); the pipeline's "
            "global ranks are [0, 1]. A group beside the pipeline must join one rank of each "
            "pipeline, e.g. a DeviceMesh ('pp', 'tp') with group=mesh.get_group('pp') and the "
            "stages on mesh['tp']"
        ), got


def test_the_refusal_comes_before_any_collective() -> None:
    # Only rank 0 constructs: had it entered any collective with rank 1 first, it would
    # wait for it there (until the timeout, then a different error).
    results = run_ranks(_construct, 2, "tp on rank 0 only", timeout=120)
    assert results[1] == "not constructed"
    assert results[0].startswith("the mesh dim 'tp' of local stage 0's up.weight overlaps"), (
        results[0]
    )
