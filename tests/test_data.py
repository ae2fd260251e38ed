"""Unit tests for graphpipe.data: stdlib byte text and ByteBatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphpipe.data import ByteBatches, load_text_bytes, stdlib_dir


def _first_stdlib_bytes(n: int) -> bytes:
    out = b""
    for file in sorted(stdlib_dir().glob("*.py")):
        out += file.read_bytes()
        if len(out) >= n:
            break
    return out[:n]


# --------------------------------------------------------------------------- load_text_bytes


def test_stdlib_text_is_deterministic_bytes() -> None:
    data = load_text_bytes(max_bytes=50_000)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert data.numel() == 50_000
    assert bytes(data.tolist()) == _first_stdlib_bytes(50_000)
    assert torch.equal(load_text_bytes(max_bytes=50_000), data)
    text = bytes(data.tolist()).decode("utf-8", errors="replace")
    assert "import " in text and "def " in text


def test_stdlib_default_size() -> None:
    data = load_text_bytes()
    assert data.numel() == min(4_000_000, sum(f.stat().st_size for f in stdlib_dir().glob("*.py")))
    assert data.numel() > 1_000_000


def test_user_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello, world\n" * 10)
    data = load_text_bytes(path)
    assert bytes(data.tolist()) == b"hello, world\n" * 10
    assert bytes(load_text_bytes(str(path), max_bytes=5).tolist()) == b"hello"


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        load_text_bytes(missing)


def test_short_file_names_the_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt.*0 bytes"):
        load_text_bytes(empty)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"short\.txt.*3 bytes.*min_bytes=10"):
        load_text_bytes(short, min_bytes=10)


def test_bad_max_bytes() -> None:
    with pytest.raises(ValueError, match="max_bytes=0"):
        load_text_bytes(max_bytes=0)


# --------------------------------------------------------------------------- ByteBatches


def test_batches_are_shifted_windows() -> None:
    # With data = arange, a token's value is its position, so windows can be checked exactly.
    n, seq = 1000, 32
    data = torch.arange(n)
    for inputs, labels in ByteBatches(data, 4, seq, seed=0, num_batches=50):
        assert inputs.shape == labels.shape == (4, seq)
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.is_contiguous() and labels.is_contiguous()
        offsets = inputs[:, :1]
        assert torch.equal(inputs, offsets + torch.arange(seq))
        assert torch.equal(labels, inputs + 1)
        assert offsets.min() >= 0 and labels.max() <= n - 1


def test_uint8_text_gives_int64_shifted_batches() -> None:
    data = load_text_bytes(max_bytes=20_000)
    inputs, labels = next(iter(ByteBatches(data, 8, 64, seed=1)))
    assert inputs.dtype == torch.int64 and inputs.shape == (8, 64)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert 0 <= int(inputs.min()) and int(inputs.max()) <= 255


def test_offsets_cover_the_whole_range() -> None:
    n, seq = 40, 8
    data = torch.arange(n)
    starts = torch.cat([x[:, 0] for x, _ in ByteBatches(data, 16, seq, seed=0, num_batches=40)])
    assert set(starts.tolist()) == set(range(n - seq))


def test_deterministic_per_seed() -> None:
    data = torch.arange(10_000)

    def take(seed: int, k: int = 5) -> list[torch.Tensor]:
        return [x for x, _ in ByteBatches(data, 4, 16, seed=seed, num_batches=k)]

    first, again, other = take(3), take(3), take(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    # Each iter() restarts the sequence; batches within one pass differ.
    batches = ByteBatches(data, 4, 16, seed=3, num_batches=5)
    assert torch.equal(next(iter(batches))[0], next(iter(batches))[0])
    assert not torch.equal(first[0], first[1])


def test_endless_and_finite() -> None:
    data = torch.arange(100)
    endless = ByteBatches(data, 2, 8)
    it = iter(endless)
    for _ in range(100):
        next(it)
    with pytest.raises(TypeError):
        len(endless)
    finite = ByteBatches(data, 2, 8, num_batches=3)
    assert len(finite) == 3 and len(list(finite)) == 3


def test_split_holds_out_the_tail() -> None:
    n, seq = 1000, 16
    data = torch.arange(n)
    train = ByteBatches(data, 8, seq, split="train", val_fraction=0.1, num_batches=50)
    val = ByteBatches(data, 8, seq, split="val", val_fraction=0.1, num_batches=50)
    assert all(int(y.max()) < 900 for _, y in train)
    assert all(int(x.min()) >= 900 for x, _ in val)
    assert max(int(y.max()) for _, y in val) <= n - 1


def test_too_short_data_raises() -> None:
    with pytest.raises(ValueError, match=r"holds 16 tokens.*seq_len \+ 1 = 17"):
        ByteBatches(torch.arange(16), 2, 16)
    ByteBatches(torch.arange(17), 2, 16)  # exactly enough
    with pytest.raises(ValueError, match=r"'val' split.*holds 10 tokens"):
        ByteBatches(torch.arange(100), 2, 16, split="val", val_fraction=0.1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"seq_len": -1}, "seq_len=-1"),
        ({"split": "test"}, "split='test'"),
        ({"split": "val", "val_fraction": 1.5}, "val_fraction=1.5"),
        ({"num_batches": -2}, "-2"),
        ({"seed": 1.5}, "seed=1.5"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"batch_size": 2, "seq_len": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        ByteBatches(torch.arange(100), **args)


def test_bad_data() -> None:
    with pytest.raises(ValueError, match="1-D"):
        ByteBatches(torch.zeros(4, 100, dtype=torch.int64), 2, 8)
    with pytest.raises(ValueError, match="float32"):
        ByteBatches(torch.zeros(100), 2, 8)


def test_a_restored_iterator_continues_with_the_same_batches() -> None:
    data = torch.arange(500) % 256
    it = iter(ByteBatches(data, 4, 16, seed=5))
    for _ in range(7):
        next(it)
    state = it.state_dict()
    expected = [next(it)[0] for _ in range(3)]
    resumed = iter(ByteBatches(data, 4, 16, seed=5))
    resumed.load_state_dict(state)
    assert resumed.position == 7
    for want in expected:
        assert torch.equal(next(resumed)[0], want)
    assert resumed.position == 10


def test_a_restored_finite_iterator_stops_at_num_batches() -> None:
    data = torch.arange(500) % 256
    it = iter(ByteBatches(data, 2, 8, num_batches=5))
    for _ in range(4):
        next(it)
    resumed = iter(ByteBatches(data, 2, 8, num_batches=5))
    resumed.load_state_dict(it.state_dict())
    assert len(list(resumed)) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"seed": 1}, "seed=0, this loader has seed=1"),
        ({"batch_size": 3}, "batch_size=4, this loader has batch_size=3"),
        ({"seq_len": 8}, "seq_len=16, this loader has seq_len=8"),
    ],
)
def test_loading_the_state_of_another_loader_names_the_setting(kwargs: dict, match: str) -> None:
    data = torch.arange(500) % 256
    state = iter(ByteBatches(data, 4, 16, seed=0)).state_dict()
    other = iter(ByteBatches(data, **{"batch_size": 4, "seq_len": 16, "seed": 0, **kwargs}))
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(state)
