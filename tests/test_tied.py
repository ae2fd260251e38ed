"""Weights tied across pipeline ranks (``graphpipe.mark_tied``): copies start equal, their
gradients are summed in the step, a clipped norm counts them once; against a single process
where the weight is one Parameter."""

from __future__ import annotations

import contextlib

import pytest
import torch

import graphpipe
from tests.pipeline_models import batch, build_stages, mse, reference
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

# The pipeline runs per micro-batch (other GEMM shapes and summation orders than the
# whole-batch reference) and sums the two copies' gradients in another order: float64
# rounding, not bitwise.
RTOL, ATOL = 1e-10, 1e-12


def _one_f_one_b(rank: int, world: int, case: dict) -> dict:
    stages = build_stages(world)
    mine = stages[rank]
    graphpipe.mark_tied(mine.fc1.weight, "fc1")  # stage 0's and the last stage's fc1
    if rank == 1:
        with torch.no_grad():
            mine.fc1.weight.add_(1.0)  # a different start: the pipeline makes it rank 0's
    pipe = graphpipe.Pipeline(
        [mine],
        schedule="1f1b",
        num_microbatches=4,
        loss_fn=mse,
        clip_grad_norm=case.get("clip"),
        capture=case.get("capture", False),
    )
    start = mine.fc1.weight.detach().clone()
    x, y = batch(8)
    for _ in range(case.get("steps", 1)):
        mine.zero_grad(set_to_none=False)
        loss = pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
    grads = {(rank, n): p.grad.clone() for n, p in mine.named_parameters()}
    return {
        "loss": loss.clone(),
        "start": start,
        "grads": grads,
        "norm": pipe.grad_norm,
    }


CASES = [dict(), dict(clip=0.05, steps=2), dict(capture=True, steps=3)]


@pytest.mark.parametrize("case", CASES, ids=["plain", "clip", "capture"])
def test_a_weight_tied_across_ranks_trains_as_one_weight(case: dict) -> None:
    results = run_ranks(_one_f_one_b, 2, case)
    stages = build_stages(2, tied=True)  # one Parameter in one process
    x, y = batch(8)
    loss, grads, _ = reference(stages, x, y)
    torch.testing.assert_close(results[0]["start"], results[1]["start"], rtol=0, atol=0)
    want_norm = None
    if case.get("clip"):
        unique = list({id(p): p for s in stages for p in s.parameters()}.values())
        want_norm = torch.nn.utils.clip_grad_norm_(unique, case["clip"])  # clips in place
        grads = {
            (i, name): p.grad.clone()
            for i, s in enumerate(stages)
            for name, p in s.named_parameters(remove_duplicate=False)
        }
        assert want_norm > case["clip"]  # the case clips
    for res in results:
        torch.testing.assert_close(res["loss"], loss, rtol=RTOL, atol=ATOL)
        for (rank, name), g in res["grads"].items():
            torch.testing.assert_close(
                g, grads[(rank, name)], rtol=RTOL, atol=ATOL, msg=f"{rank} {name}"
            )
        if want_norm is not None:
            torch.testing.assert_close(res["norm"].double(), want_norm, rtol=RTOL, atol=ATOL)
    # both copies got the summed gradient of the one weight
    g0, g1 = results[0]["grads"][(0, "fc1.weight")], results[1]["grads"][(1, "fc1.weight")]
    torch.testing.assert_close(g0, g1, rtol=0, atol=0)


def test_tie_names_must_be_names() -> None:
    with pytest.raises(ValueError, match="a tie name must be a non-empty str, got ''"):
        graphpipe.mark_tied(torch.nn.Parameter(torch.zeros(1)), "")


# ------------------------------------------- two pipelines over the same tied weights
def _two_pipelines(rank: int, world: int, m: int, calls: list[tuple[str, bool]]) -> dict:
    stages = build_stages(world)
    mine = stages[rank]
    graphpipe.mark_tied(mine.fc1.weight, "fc1")
    pipes = {
        name: graphpipe.Pipeline([mine], schedule="1f1b", num_microbatches=m, loss_fn=mse)
        for name in ("A", "B")
    }
    mine.zero_grad(set_to_none=False)
    for c, (name, inside) in enumerate(calls):
        x, y = batch(8, seed=10 + c)
        args = (x if rank == 0 else None, y if rank == world - 1 else None)
        pipe = pipes[name]
        with pipe.no_sync() if inside else contextlib.nullcontext():
            pipe.step(*args)
    return {(rank, n): p.grad.clone() for n, p in mine.named_parameters()}


CALLS = {
    "A no_sync, B": [("A", True), ("B", False)],
    "A no_sync, B no_sync, A": [("A", True), ("B", True), ("A", False)],
    "A, B no_sync, A": [("A", False), ("B", True), ("A", False)],
    "A no_sync, B, A no_sync, A": [("A", True), ("B", False), ("A", True), ("A", False)],
}


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("calls", list(CALLS), ids=list(CALLS))
def test_no_sync_windows_of_two_pipelines_over_the_same_tied_weights_are_one(
    calls: str, m: int
) -> None:
    # The window of unreduced gradients belongs to the parameters, not to the pipeline that
    # opened it: a reducing call of another pipeline over the same weights reduces what the
    # window accumulated (it once divided it as an earlier call's reduced sum: 33% off).
    results = run_ranks(_two_pipelines, 2, m, CALLS[calls])
    stages = build_stages(2, tied=True)
    for c in range(len(CALLS[calls])):
        x, y = batch(8, seed=10 + c)
        _, grads, _ = reference(stages, x, y)  # accumulates, as the calls do
    for res in results:
        for key, g in res.items():
            torch.testing.assert_close(g, grads[key], rtol=RTOL, atol=ATOL, msg=str(key))


def _captured_beside_a_window(rank: int, world: int) -> dict:
    stages = build_stages(world)
    mine = stages[rank]
    graphpipe.mark_tied(mine.fc1.weight, "fc1")
    eager, captured = (
        graphpipe.Pipeline(
            [mine], schedule="1f1b", num_microbatches=2, loss_fn=mse, capture=capture
        )
        for capture in (False, "step")
    )
    mine.zero_grad(set_to_none=False)

    def step(pipe, c: int):
        x, y = batch(8, seed=10 + c)
        return pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)

    with eager.no_sync():
        step(eager, 0)
    try:  # its replay would divide the window's unreduced sum
        step(captured, 1)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    step(eager, 1)  # the window's reducing step
    grads = {(rank, n): p.grad.clone() for n, p in mine.named_parameters()}
    step(captured, 2)  # no window now: it runs
    return {"refused": refused, "grads": grads}


def test_a_captured_step_is_refused_while_another_pipelines_window_holds_its_weights():
    results = run_ranks(_captured_beside_a_window, 2)
    stages = build_stages(2, tied=True)
    for c in range(2):
        x, y = batch(8, seed=10 + c)
        _, grads, _ = reference(stages, x, y)
    for res in results:
        assert res["refused"].startswith(
            "a no_sync() window of another pipeline holds this captured pipeline's parameters"
        ), res["refused"]
        for key, g in res["grads"].items():
            torch.testing.assert_close(g, grads[key], rtol=RTOL, atol=ATOL, msg=str(key))
