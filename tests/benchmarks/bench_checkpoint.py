"""pytest-benchmark: what the checkpoint checksums cost on a realistic checkpoint.

Not part of the default test run (``--ignore=tests/benchmarks``); run it with

    python -m pytest tests/benchmarks/bench_checkpoint.py -p no:cacheprovider --benchmark-only \\
        --benchmark-columns=median,min,max,rounds

One process, one thread: the built-in model at hidden 1024, 8 layers (101M parameters) in two
stages with its AdamW state, about 1.1 GiB on disk (``/tmp`` by default: set ``TMPDIR``). The
groups: the whole ``save_checkpoint`` (which includes the CRC-32 of its files), the CRC-32
alone and blake2b alone over the same files (the choice of checksum), ``verify_checkpoint``
and an unverified ``load_checkpoint`` (what verifying adds to a resume). The files are in
the page cache, as they are right after a save.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from graphpipe import checkpoint
from graphpipe.models import LlamaConfig, build_stages, unique_parameters

CFG = LlamaConfig(hidden=1024, n_layers=8, n_heads=8, max_seq_len=64, use_kernels=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Iterator[tuple[dict, torch.optim.Optimizer, Path]]:
    torch.set_num_threads(1)
    stages = dict(enumerate(build_stages(CFG, 2)))
    opt = torch.optim.AdamW(unique_parameters(stages.values()), lr=1e-3)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    opt.step()  # the moments exist, as in training
    root = tmp_path_factory.mktemp("ckpt")
    yield stages, opt, checkpoint.save_checkpoint(root, 0, stages, opt)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name != checkpoint.MARKER)


def _blake2b(file: Path) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(file, "rb", buffering=0) as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.digest()


@pytest.mark.benchmark(group="save")
def test_save_with_checksums(benchmark, saved) -> None:
    stages, opt, path = saved
    # The same step again: each round replaces the fixture's checkpoint, whole.
    benchmark.pedantic(checkpoint.save_checkpoint, (path.parent, 0, stages, opt), rounds=3)


@pytest.mark.benchmark(group="checksum")
@pytest.mark.parametrize("kind", ["crc32", "blake2b"])
def test_checksum_of_every_file(benchmark, saved, kind) -> None:
    files = _files(saved[2])
    benchmark.extra_info["bytes"] = sum(f.stat().st_size for f in files)
    one = checkpoint._crc32 if kind == "crc32" else _blake2b
    benchmark.pedantic(lambda: [one(f) for f in files], rounds=3)


@pytest.mark.benchmark(group="resume")
@pytest.mark.parametrize("what", ["verify", "load unverified"])
def test_resume(benchmark, saved, what) -> None:
    stages, opt, path = saved
    if what == "verify":
        benchmark.pedantic(checkpoint.verify_checkpoint, (path,), rounds=3)
    else:
        benchmark.pedantic(
            checkpoint.load_checkpoint, (path, stages, opt), {"verify": False}, rounds=3
        )
