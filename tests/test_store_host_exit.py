"""The store's host fails and exits at once: its peers' errors still name its error.

Global rank 0 of an ``env://`` job serves the job's TCPStore. When its loss function raises
and the exception ends its process, the store would go with it before the peer read the
failure notice (the peer's error then said only that the store is unreachable). Its exit
waits, at most ``lifetime.HOLD_S`` (or the pipeline's timeout), until the peers have read the
notice. Two plain processes (``python script.py``, as a user starts them), not the test pool:
the exit is the point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.spawn import free_port

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import graphpipe
    from tests.pipeline_models import batch, build_stages, local_stages, mse

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        if calls["n"] == 2:  # the second micro-batch of the first step
            raise ValueError("injected loss fault")
        return mse(out, y)

    mine = local_stages(build_stages(4), rank, 2)
    if rank == 1:  # busy in a compute when rank 0 fails: it finds out after rank 0 exited
        import time

        real = mine[0].forward
        forwards = {"n": 0}

        def slow(*args):
            forwards["n"] += 1
            if forwards["n"] == 3:
                time.sleep(3.0)
            return real(*args)

        mine[0].forward = slow
    pipe = graphpipe.DualPipeV(mine, num_microbatches=4, loss_fn=loss_fn, timeout=60.0)
    for step in range(2):
        x, y = batch(8, seed=step)
        try:
            pipe.step(x if rank == 0 else None, y if rank == 0 else None)
        except graphpipe.PipelineError as e:
            print("PEER-ERROR:", str(e).splitlines()[0], flush=True)
            sys.exit(3)
    print("no error", flush=True)
    """
)


def _run_two_ranks(script: Path, *args: str) -> tuple[list[subprocess.Popen], list[tuple]]:
    """``script`` as ranks 0 and 1 of an env:// job (rank 0 hosts the store), to their end:
    the processes and their (stdout, stderr)."""
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=root,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs, [p.communicate(timeout=180) for p in procs]


def test_the_store_hosts_exit_waits_until_its_peer_read_its_error(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    procs, outs = _run_two_ranks(script)
    # rank 0's own exception ends its process (exit status 1, the traceback on stderr)
    assert procs[0].returncode == 1, outs[0]
    assert "ValueError: injected loss fault" in outs[0][1]
    # rank 1 read the notice before the store went: its error names rank 0's error
    assert procs[1].returncode == 3, outs[1]
    assert "PEER-ERROR: the step failed on rank 0 at" in outs[1][0], outs[1]
    assert "ValueError: injected loss fault" in outs[1][0], outs[1]


# ------------------------------------------------------------------ at construction
BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    import time
    import torch
    import torch.distributed as dist
    import graphpipe
    from tests.pipeline_models import build_stages, local_stages, mse

    CASE = sys.argv[1]
    T = 3.0  # the pipeline timeout (seconds)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = local_stages(build_stages(4), rank, 2)
    opt = None
    if rank == 1:  # builds late: rank 0 has given up (or refused) and ended by then
        time.sleep(T + 5.0)
    elif CASE == "refused":  # capture_optimizer without capture: refused on rank 0 only
        opt = torch.optim.SGD(mine[0].parameters(), lr=0.1)
    try:
        graphpipe.DualPipeV(
            mine, num_microbatches=4, loss_fn=mse, timeout=T, capture_optimizer=opt
        )
    except graphpipe.PipelineError as e:
        if rank == 0 and CASE == "late":
            raise  # rank 0's own error ends its process
        print("PEER-ERROR:", str(e).splitlines()[0], flush=True)
        sys.exit(3)
    print("no error", flush=True)
    """
)


@pytest.mark.parametrize("case", [pytest.param("late", marks=pytest.mark.slow), "refused"])
def test_the_store_hosts_exit_after_a_failed_construction_waits_for_a_late_peer(tmp_path, case):
    # Rank 0 gives up on a peer that starts late (or refuses its own arguments), and its
    # exception ends its process, which hosts the job's store: its exit waits until the
    # peers have read why, so that the late peer names rank 0's error, not a lost store.
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    procs, outs = _run_two_ranks(script, case)
    assert procs[0].returncode == 1, outs[0]  # rank 0's own exception ends its process
    assert procs[1].returncode == 3, outs[1]
    if case == "late":
        assert "PipelineError: rank 1 did not join the pipeline within 3 s" in outs[0][1]
        assert outs[1][0].startswith(
            "PEER-ERROR: rank 1 did not join the pipeline within 3 s (rank 0 gave up waiting "
            "for it); this rank (rank 1) came later"
        ), outs[1]
    else:
        assert "ValueError: capture_optimizer needs capture=True" in outs[0][1]
        assert outs[1][0].startswith(
            "PEER-ERROR: rank 0 could not build the pipeline: ValueError: capture_optimizer "
            "needs capture=True"
        ), outs[1]
