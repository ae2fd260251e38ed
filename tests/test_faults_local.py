"""Who is to blame when no rank raised, told from the peers' status, in one process: the
diagnosis of ``coordination/faults.py`` on a ``HashStore``, and the store's host (``store.py``).
The spawned cases are in ``test_faults_named_dist.py``."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from graphpipe.runtime.coordination.faults import CommFailure, FaultNotices, Faults
from graphpipe.runtime.coordination.status import Blocked, ProcessStatus, describe_pipeline
from graphpipe.runtime.coordination.store import JobStore, StoreLost, store_host

KEY = "graphpipe/0_1_2_3/1"
TIMED_OUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms")


def _groups(**fields) -> SimpleNamespace:
    """The pipeline groups as ``Faults`` sees them (``report_blocks_to`` takes its status)."""
    return SimpleNamespace(report_blocks_to=lambda on_block: None, **fields)


def _faults(rank: int = 0, n: int = 4, call: int = 3, kind: str = "step"):
    store = JobStore(dist.HashStore(), "global rank 0")
    groups = _groups(global_ranks=list(range(n)), timeout=datetime.timedelta(seconds=2))
    faults = Faults(FaultNotices(store, KEY, rank), groups, rank)
    faults.call, faults.kind = call, kind
    return faults, store


def _blocked(store: JobStore, rank: int, **kw) -> None:
    ProcessStatus(store, rank).publish(
        Blocked(**{"pipeline": KEY, "kind": "step", "call": 3, **kw})
    )


def test_a_transfer_timeout_blames_the_end_of_the_chain_of_waiting_ranks() -> None:
    faults, store = _faults()
    _blocked(store, 1, peer=2)  # rank 1 waits on rank 2, which waits on nobody
    why, lost = faults.diagnose(CommFailure(1, "wait 3RECV_F1", TIMED_OUT))
    assert lost == 2
    assert why == (
        "lost rank 2 during 'wait 3RECV_F1', rank 1 waits on rank 2: rank 2 did not answer "
        "within the 2 s timeout and waits on no rank: it is stuck (in its compute) or stopped"
    )


def test_a_peer_blocked_elsewhere_is_named_and_not_lost() -> None:
    faults, store = _faults()
    _blocked(store, 1, pipeline="graphpipe/0_1_2_3/2", kind="forward", call=2, at="loss")
    why, lost = faults.diagnose(CommFailure(1, "wait 3RECV_F1", TIMED_OUT))
    assert lost is None
    assert why.endswith(
        "; rank 1 is in forward 2 of another pipeline (the 2nd pipeline built on global ranks "
        "[0, 1, 2, 3]), at loss"
    ), why


def test_a_batch_agreement_timeout_names_every_rank_not_in_the_call() -> None:
    faults, store = _faults()
    _blocked(store, 1, at="batch agreement")  # in the same call: not to blame
    _blocked(store, 3, pipeline="graphpipe/0_1_2_3/2", call=7, at="batch agreement")
    why, lost = faults.diagnose(CommFailure(None, "batch agreement", TIMED_OUT))
    assert lost is None  # idle ranks are alive: nothing is closed
    assert why == (
        "rank 2 has not entered step 3: it is idle; rank 3 has not entered step 3: it is in "
        "step 7 of another pipeline (the 2nd pipeline built on global ranks [0, 1, 2, 3]), at "
        "batch agreement (rank 0 waited the 2 s timeout in 'batch agreement')"
    )


def test_a_peer_silent_at_a_later_collective_is_lost() -> None:
    faults, _ = _faults(n=2)
    why, lost = faults.diagnose(CommFailure(None, "loss", TIMED_OUT))
    assert lost == 1
    assert why.startswith("rank 1 is in step 3 but did not reach 'loss' within the 2 s timeout")


def test_a_lost_peer_closes_the_pipeline_and_the_lost_rank_learns_it() -> None:
    faults, store = _faults(n=2)
    groups = _groups(
        global_ranks=[0, 1], timeout=datetime.timedelta(seconds=2), nccl=False, drop=lambda: None
    )
    faults.groups = groups
    faults.doing("wait 3RECV_F1")  # what the step loop records
    error = faults.error_for_comm_failure(CommFailure(1, "wait 3RECV_F1", TIMED_OUT))
    assert type(error).__name__ == "PipelineError"
    assert faults.closed.startswith("pipeline closed: rank 1 was lost in step 3")
    peer = Faults(FaultNotices(store, KEY, 1), groups, 1)  # rank 1, continued later
    peer.call = 3
    peer.doing("wait 0RECV_B1")
    told = peer.error_for_comm_failure(
        CommFailure(0, "wait 0RECV_B1", RuntimeError("Connection closed"))
    )
    assert type(told).__name__ == "PipelineClosed"
    assert str(told).startswith(
        "pipeline closed: the other ranks gave up on this rank (rank 1) in step 3: rank 0 at"
    )


class _Broken:
    """A store whose every access fails as a lost TCPStore's does."""

    def __getattr__(self, name: str):
        def fail(*args, **kwargs):
            raise dist.DistNetworkError("Broken pipe")

        return fail


def test_every_access_to_a_lost_store_is_a_pipeline_error_naming_its_host() -> None:
    store = JobStore(_Broken(), "global rank 0 (the TCPStore server at 10.0.0.1:29500)")
    for access in (
        lambda: store.set("k", "v"),
        lambda: store.peek("k"),
        lambda: store.wait(["k"], 1.0),
        lambda: store.compare_set("k", "", "v"),
    ):
        with pytest.raises(StoreLost, match=r"its host, global rank 0 \(the TCPStore server"):
            access()


def test_the_store_host_of_an_env_init_is_global_rank_0(monkeypatch) -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    monkeypatch.setattr(dist.distributed_c10d, "_default_pg_init_method", "env://")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    wrapped = dist.PrefixStore("default_pg", server)
    assert store_host(wrapped) == f"global rank 0 (the TCPStore server at 127.0.0.1:{server.port})"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert store_host(wrapped).startswith("the torchrun agent of the first node")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    monkeypatch.setattr(dist.distributed_c10d, "_default_pg_init_method", None)
    assert store_host(wrapped).startswith("the process that serves the store passed to")


def test_pipelines_are_named_by_the_order_they_were_built_in() -> None:
    assert describe_pipeline("graphpipe/0_1/1") == "the 1st pipeline built on global ranks [0, 1]"
    assert describe_pipeline("graphpipe/0_1/12") == "the 12th pipeline built on global ranks [0, 1]"
    assert describe_pipeline("graphpipe/2_3/22") == "the 22nd pipeline built on global ranks [2, 3]"
