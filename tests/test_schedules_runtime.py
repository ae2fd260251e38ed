"""Every schedule the IR expresses runs on the runtime: ZB-V, 1F1B, and a schedule loaded from
torch's CSV format, eager and captured, against the single-process reference."""

from __future__ import annotations

import pytest
import torch

from tests.compose import csv_schedule
from tests.pipeline_models import batch, build_stages, mse, params, reference
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

# Float64, the pipeline against a single-process reference: the micro-batch losses are averaged
# and the weight gradients accumulated in another order (deferred GEMMs, addmm_ into .grad),
# with other GEMM shapes, so MKL may run other kernels on another CPU: equal up to rounding.
# RTOL is about 9000x float64's unit roundoff (1.1e-16); gradients also get 1e-14 absolute
# for elements that cancel to about 0.
RTOL = 1e-12


def _gpipe_loop_csv(n: int, m: int) -> str:
    """A looped schedule in torch's compute-only CSV (``tests.compose.csv_schedule``)."""
    return csv_schedule(n, m)


def _stage_ids(schedule, rank: int, n: int, m: int) -> tuple[int, ...]:
    from graphpipe.schedule.generators import SCHEDULES
    from graphpipe.schedule.ir import Placement, parse_csv

    if schedule == "csv":
        return Placement.from_schedule(parse_csv(_gpipe_loop_csv(n, m))).stages_of(rank)
    return SCHEDULES[schedule].placement(n).stages_of(rank)


def _num_stages(schedule: str, n: int) -> int:
    return 2 * n if schedule in ("dualpipev", "zbv", "csv") else n


def _case(
    rank: int,
    world: int,
    schedule: str,
    m: int,
    rows: int,
    capture: bool,
    receives: str | None = None,
) -> dict:
    import graphpipe
    from graphpipe.schedule.ir import parse_csv

    stages = build_stages(_num_stages(schedule, world))
    ids = _stage_ids(schedule, rank, world, m)
    mine = [stages[s] for s in ids]
    spec = parse_csv(_gpipe_loop_csv(world, m)) if schedule == "csv" else schedule
    pipe = graphpipe.Pipeline(
        mine,
        schedule=spec,
        num_microbatches=m,
        loss_fn=mse,
        capture="step" if capture else False,
        receives=receives,
    )
    losses = []
    for step in range(3):
        for s in mine:
            s.zero_grad(set_to_none=False)
        x, y = batch(rows, seed=5 + step)
        loss = pipe.step(
            x if pipe.is_input_rank else None,
            y if pipe.is_loss_rank else None,
        )
        losses.append(loss.clone())
    grads = {
        (s, name): p.grad.clone() for s, mod in zip(ids, mine) for name, p in mod.named_parameters()
    }
    out = pipe.forward(x if pipe.is_input_rank else None)
    pipe.close()
    return {"losses": losses, "grads": grads, "out": out, "loss_rank": pipe.is_loss_rank}


@pytest.mark.parametrize(
    ("schedule", "world", "m"),
    [("zbv", 2, 4), ("zbv", 2, 3), ("1f1b", 2, 3), ("1f1b", 4, 6), ("csv", 2, 4)],
)
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_schedule_matches_the_single_process_reference(schedule, world, m, capture) -> None:
    _check_against_the_reference(schedule, world, m, capture, None)


@pytest.mark.parametrize(
    ("schedule", "world", "m", "capture"),
    [
        ("zbv", 2, 4, False),
        ("zbv", 3, 6, False),
        ("zbv", 4, 8, False),
        ("dualpipev", 3, 6, False),
        ("dualpipev", 4, 8, False),
        ("zbv", 3, 7, True),
    ],
)
def test_plain_receives_run_every_v_schedule_like_the_reference(schedule, world, m, capture):
    # Issue 40 (c05, c06): refused at construction with an internal lowering message; the
    # plain rule now posts a rank pair's receives in its send order (lower.in_send_order).
    _check_against_the_reference(schedule, world, m, capture, "plain")


def _check_against_the_reference(
    schedule: str, world: int, m: int, capture: bool, receives: str | None
) -> None:
    rows = 2 * m
    results = run_ranks(_case, world, schedule, m, rows, capture, receives)
    stages = build_stages(_num_stages(schedule, world))
    x, y = batch(rows, seed=7)  # the last of the three steps
    # gradients accumulate over the three steps only if not zeroed: each step zeroes them
    ref_loss, ref_grads, ref_out = reference(stages, x, y)
    checked = set()
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["losses"][-1], ref_loss, rtol=RTOL, atol=0)
        for key, g in res["grads"].items():
            torch.testing.assert_close(g, ref_grads[key], rtol=RTOL, atol=1e-14, msg=str(key))
            checked.add(key)
        if res["loss_rank"]:
            torch.testing.assert_close(res["out"], ref_out, rtol=RTOL, atol=1e-14)
        else:
            assert res["out"] is None, rank
    assert checked == set(ref_grads)


def test_a_schedule_with_ranks_the_group_does_not_have_is_refused() -> None:
    import graphpipe
    from graphpipe.schedule.ir import parse_csv

    spec = parse_csv(_gpipe_loop_csv(2, 2))
    with pytest.raises(ValueError, match=r"the schedule has ranks \[0, 1\], but the pipeline"):
        graphpipe.Pipeline(build_stages(2), schedule=spec, num_microbatches=2, loss_fn=mse)


def test_stages_that_do_not_fit_the_placement_are_refused_naming_them() -> None:
    import graphpipe

    with pytest.raises(ValueError, match=r"rank 0 runs stages \[0\] of the 1f1b schedule"):
        graphpipe.Pipeline(build_stages(2), schedule="1f1b", num_microbatches=2, loss_fn=mse)
    with pytest.raises(ValueError, match="unknown schedule 'gpipe'"):
        graphpipe.Pipeline(build_stages(1), schedule="gpipe", num_microbatches=2, loss_fn=mse)
    with pytest.raises(TypeError, match="num_microbatches must be an int, got str '4'"):
        graphpipe.DualPipeV(build_stages(2), num_microbatches="4", loss_fn=mse)
    with pytest.raises(TypeError, match=r"num_microbatches must be an int, got float 4\.0"):
        graphpipe.DualPipeV(build_stages(2), num_microbatches=4.0, loss_fn=mse)


def test_one_rank_1f1b_trains_like_the_reference_with_an_optimizer() -> None:
    import graphpipe

    stages, ref_stages = build_stages(1), build_stages(1)
    pipe = graphpipe.Pipeline(stages, schedule="1f1b", num_microbatches=3, loss_fn=mse)
    opt = torch.optim.SGD(params(stages), lr=0.1)
    ref_opt = torch.optim.SGD(params(ref_stages), lr=0.1)
    for step in range(3):
        x, y = batch(6, seed=step)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(x, y)
        ref_loss, _, _ = reference(ref_stages, x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        opt.step()
        ref_opt.step()
