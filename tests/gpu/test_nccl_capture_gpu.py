"""The NCCL capture path on one GPU: a one-rank NCCL process group, an ``all_reduce`` captured
inside ``torch.cuda.graph`` between two kernels, replayed (skipped without CUDA or NCCL).

With one rank a sum all-reduce leaves the values as they are, so the captured sequence
``x = 2 x; all_reduce(x); x = x + 1`` must map x to 2x + 1 on every replay; three replays
from 1 give 3, 7, 15. A graph that dropped the collective, or one the communicator could not
run, fails that check or raises. The communicator is warmed up eagerly first and the graph is
destroyed before the process group, the order NCCL needs.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()), reason="needs NCCL"),
]


def test_all_reduce_captured_in_a_graph_replays_on_a_one_rank_nccl_group(gpu_figures):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        "nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=dev,
        timeout=datetime.timedelta(seconds=60),
    )
    graph = torch.cuda.CUDAGraph()
    try:
        x = torch.ones(1 << 20, device=dev)
        dist.all_reduce(x)  # eager: creates and warms up the communicator
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones_like(x))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(x)  # warm up on the stream capture uses
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            x.mul_(2)
            dist.all_reduce(x)
            x.add_(1)
        x.fill_(1.0)
        values = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            values.append(float(x[0]))
            assert torch.equal(x, torch.full_like(x, values[-1]))
        gpu_figures.update(
            values_after_replays=values, nccl_version=".".join(map(str, torch.cuda.nccl.version()))
        )
        assert values == [3.0, 7.0, 15.0]
    finally:
        torch.cuda.synchronize()
        graph.reset()  # graphs that reference the communicator go first
        dist.destroy_process_group()
