"""NVTX backend choice of ``graphpipe.nvtx.Ranges``, on CPU with stand-ins for CUDA and NVTX.

The lent GPU machine has CUDA but no ``nvtx`` package: there the ranges must go through
``torch.cuda.nvtx``. These tests hide the package (``sys.modules['nvtx'] = None`` makes its
import raise ``ImportError``), pretend CUDA is present and replace torch's NVTX calls with
recorders, so they prove on CPU which backend is picked and that every push and pop reaches it.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import graphpipe
from graphpipe.nvtx import NVTX_BACKENDS, Ranges


class _Recorder:
    """Stands in for an NVTX implementation; logs every call."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def push(self, name: str) -> int:
        self.log.append(f"push {name}")
        return 0

    def pop(self) -> int:
        self.log.append("pop")
        return 0


@pytest.fixture
def torch_nvtx(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    """CUDA 'present', the nvtx package hidden, torch.cuda.nvtx recording."""
    rec = _Recorder()
    monkeypatch.setitem(sys.modules, "nvtx", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", rec.push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", rec.pop)
    return rec


def test_without_the_nvtx_package_cuda_ranges_go_to_torch_cuda_nvtx(torch_nvtx):
    ranges = Ranges()  # default: NVTX on, since "CUDA" is available
    assert ranges.backend == "torch.cuda.nvtx"
    ranges.push("step")
    ranges.push("0F3")
    assert ranges.depth == 2
    ranges.pop()
    ranges.push("7I2")
    ranges.unwind(0)
    assert ranges.depth == 0
    assert torch_nvtx.log == ["push step", "push 0F3", "pop", "push 7I2", "pop", "pop"]


def test_fallback_ranges_still_reach_the_torch_profiler(torch_nvtx):
    ranges = Ranges()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ranges.push("0F3")
        torch.ones(4).sum()
        ranges.pop()
    assert torch_nvtx.log == ["push 0F3", "pop"]
    assert "0F3" in {e.name for e in prof.events()}


def test_the_nvtx_package_is_preferred_when_it_imports(monkeypatch, torch_nvtx):
    pkg = _Recorder()
    domains: list[str] = []

    def get_domain(name: str) -> SimpleNamespace:
        domains.append(name)
        return SimpleNamespace(push_range=lambda message: pkg.push(message), pop_range=pkg.pop)

    monkeypatch.setitem(sys.modules, "nvtx", SimpleNamespace(get_domain=get_domain))
    ranges = Ranges()
    ranges.push("3F5")
    ranges.pop()
    assert ranges.backend == "nvtx"
    assert domains == ["graphpipe"]
    assert pkg.log == ["push 3F5", "pop"]
    assert torch_nvtx.log == []


def test_nvtx_off_calls_no_nvtx_backend(torch_nvtx):
    ranges = Ranges(use_nvtx=False)
    ranges.push("step")
    ranges.pop()
    assert ranges.backend == "off"
    assert torch_nvtx.log == []


def test_default_without_cuda_is_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Ranges().backend == "off"
    assert set(NVTX_BACKENDS) == {"nvtx", "torch.cuda.nvtx", "off"}


def test_asking_for_nvtx_with_neither_backend_raises_naming_both(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"nvtx package.*torch\.cuda\.nvtx"):
        Ranges(use_nvtx=True)


def test_a_pipeline_builds_with_cuda_present_and_no_nvtx_package(torch_nvtx):
    """Issue 10: constructing DualPipeV raised there; now its ranges use the fallback."""
    stages = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    pipe = graphpipe.DualPipeV(
        stages, num_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
    )
    assert pipe.ranges.backend == "torch.cuda.nvtx"
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    pushed = [e.removeprefix("push ") for e in torch_nvtx.log if e != "pop"]
    assert torch_nvtx.log.count("pop") == len(pushed)
    assert pushed[0] == "step"
    assert sorted(pushed[1:]) == sorted(str(a) for a in graphpipe.dualpipev(1, 2)[0])
