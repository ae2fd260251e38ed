"""The graph layer's replay and the driver's order of steps, with stand-in graphs."""

from __future__ import annotations

import torch

from graphpipe.nvtx import Ranges
from graphpipe.runtime.capture import CapturedGraphs


class FakeGraph:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def replay(self) -> None:
        self.log.append(self.name)

    def reset(self) -> None:
        self.log.append(f"reset {self.name}")


def _graphs(names: list[str], log: list) -> CapturedGraphs:
    out = CapturedGraphs()
    out.graphs = [FakeGraph(log, n) for n in names]
    out.names = list(names)
    return out


def test_action_graphs_replay_in_capture_order_each_in_its_named_range():
    log: list[str] = []
    names = ["0F0", "(1F1;0B0)OVERLAP_F_B", "0W2", "loss"]
    graphs = _graphs(names, log)
    ranges = Ranges(use_nvtx=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        graphs.replay(ranges)
    assert log == names
    seen = [e.name for e in prof.events() if e.name in {"step", *names}]
    assert seen[0] == "step" and seen[1:] == names
    assert ranges.depth == 0


def test_a_failing_replay_closes_its_ranges_and_reset_drops_every_graph():
    log: list[str] = []
    graphs = _graphs(["a", "b"], log)

    def boom() -> None:
        raise RuntimeError("replay failed")

    graphs.graphs[1].replay = boom
    ranges = Ranges(use_nvtx=False)
    try:
        graphs.replay(ranges)
    except RuntimeError:
        pass
    assert ranges.depth == 0
    graphs.reset()
    assert log == ["a", "reset a", "reset b"]
    assert graphs.graphs == [] and graphs.names == []


def _captured_pipeline_with_fake_graphs(log: list):
    import graphpipe
    from tests.pipeline_models import batch, build_stages, local_stages, mse

    pipe = graphpipe.DualPipeV(
        local_stages(build_stages(2), 0, 1), num_microbatches=2, loss_fn=mse, capture=True
    )
    pipe.step(*batch(4))  # the warmup step: one capture (CPU: no graphs of its own)
    (cap,) = pipe._capture.captures.values()
    cap.graphs = _graphs(["g"], log)
    return pipe


def test_close_destroys_the_graphs_and_the_pipeline_captures_again_after_it():
    from tests.pipeline_models import batch

    log: list[str] = []
    pipe = _captured_pipeline_with_fake_graphs(log)
    pipe.close()
    assert log == ["reset g"] and pipe._capture.captures == {}
    assert pipe.step(*batch(4)).dim() == 0  # a new warmup step
    assert len(pipe._capture.captures) == 1


def test_a_pipeline_dropped_without_close_releases_its_graphs_when_collected():
    import gc

    log: list[str] = []
    pipe = _captured_pipeline_with_fake_graphs(log)
    del pipe
    gc.collect()
    assert log == ["reset g"]


def _order_of_calls(rank: int, world: int, staged: bool) -> list[list[str]]:
    """Four captured steps with stand-in CUDA graphs; what each step ran."""
    import graphpipe
    from tests.pipeline_models import batch, build_stages, local_stages, mse

    pipe = graphpipe.DualPipeV(
        local_stages(build_stages(2 * world), rank, world),
        num_microbatches=4,
        loss_fn=mse,
        capture=True,
    )
    pipe.engine.staged = staged  # NCCL's first step (handshake over the control group), on gloo
    driver, loop = pipe._capture, pipe._loop
    log: list[str] = []
    train, static = loop.train, loop.static

    def logged(name, fn):
        def call(*args, **kwargs):
            log.append(name)
            return fn(*args, **kwargs)

        return call

    class Graphs:
        def replay(self, ranges) -> None:
            log.append("replay")

        def reset(self) -> None:
            pass

    def capture(cap):  # captures and runs the step once
        log.append("capture")
        cap.graphs = Graphs()

    loop.train, loop.static = logged("eager step", train), logged("eager static step", static)
    driver._capture_graphs = capture
    x, y = batch(8)
    steps = []
    for _ in range(4):
        log.clear()
        pipe.step(x if rank == 0 else None, y if rank == 0 else None)
        steps.append(list(log))
    pipe.close()
    return steps


def test_with_nccl_every_communicator_carries_one_real_eager_step_before_the_capture():
    from tests.spawn import run_ranks

    staged = run_ranks(_order_of_calls, 2, True)
    for steps in staged:
        assert steps == [
            ["eager step"],  # records the metadata (the handshake over the control group)
            ["eager static step"],  # the real transfers on every rank pair, not captured
            ["capture"],  # the capture runs the step
            ["replay"],
        ]
    plain = run_ranks(_order_of_calls, 2, False)  # gloo P2P, or one rank: capture at once
    for steps in plain:
        assert steps == [["eager step"], ["capture"], ["replay"], ["replay"]]
