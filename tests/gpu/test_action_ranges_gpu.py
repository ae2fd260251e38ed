"""With ``capture="action"``, each schedule action's range contains its graph launch: the
NVTX proof without Nsight Systems (skipped without CUDA).

The ranges graphpipe pushes go to NVTX and, while a torch profiler records, to
``record_function``, so a torch.profiler trace of one replayed step shows them on the CPU
timeline together with the CUDA runtime calls. The test replays the one-rank pipeline of the
built-in Llama under the profiler and checks that every action of the rank's schedule
(``0F0``, ``(1F1;0B0)OVERLAP_F_B``, ...) has a range and that each such range encloses at least
one ``cudaGraphLaunch``, all inside the ``step`` range. Only the public API is used:
``DualPipeV(capture="action")``, ``step()``, ``close()``, and the documented range names.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

M = 4  # micro-batches


def _intervals(events, pred) -> list[tuple[str, float, float]]:
    return [(e.name, e.time_range.start, e.time_range.end) for e in events if pred(e.name)]


def test_each_action_range_encloses_its_graph_launch(gpu_figures):
    import graphpipe
    from graphpipe.models import LlamaConfig, LlamaLoss, build_stages

    dev = torch.device("cuda")
    cfg = LlamaConfig(hidden=128, n_layers=2, n_heads=2, max_seq_len=32)
    stages = build_stages(cfg, 2, seed=0, device=dev)
    pipe = graphpipe.DualPipeV(stages, num_microbatches=M, loss_fn=LlamaLoss(), capture="action")
    tokens = torch.randint(0, cfg.vocab_size, (2 * M, 33), device=dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    actions = {str(a) for a in graphpipe.dualpipev(1, M)[0]}
    try:
        for _ in range(3):  # eager warmup, capture, first replay
            pipe.step(x, y)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            pipe.step(x, y)
            torch.cuda.synchronize()
    finally:
        pipe.close()
    events = list(prof.events())
    ranges = _intervals(events, lambda n: n in actions)
    steps = _intervals(events, lambda n: n == "step")
    launches = _intervals(events, lambda n: n.startswith("cudaGraphLaunch"))

    def inside(t: tuple[str, float, float], r: tuple[str, float, float]) -> bool:
        return r[1] <= t[1] and t[2] <= r[2]

    without_launch = sorted({r[0] for r in ranges if not any(inside(g, r) for g in launches)})
    gpu_figures.update(
        schedule_actions=len(actions),
        action_ranges=len(ranges),
        graph_launches=len(launches),
        launches_in_action_ranges=sum(any(inside(g, r) for r in ranges) for g in launches),
        ranges_without_launch=without_launch,
        step_ranges=len(steps),
    )
    assert steps, "no step range in the trace"
    assert {r[0] for r in ranges} == actions, "an action of the schedule has no range"
    assert without_launch == [], f"ranges with no cudaGraphLaunch inside: {without_launch}"
    assert all(any(inside(r, s) for s in steps) for r in ranges), "an action outside the step"
