"""Byte-level text for training and examples, with no download.

By default the text is the Python standard library's own source: the top-level ``*.py`` files
of ``sysconfig.get_paths()["stdlib"]`` in sorted order, concatenated and cut at ``max_bytes``.
It exists wherever Python does and is the same on every machine with the same Python version.
``ByteBatches`` draws random windows of it as ``(inputs, labels)`` next-byte pairs.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = ["ByteBatchIterator", "ByteBatches", "load_text_bytes", "stdlib_dir"]

Split = Literal["all", "train", "val"]


def stdlib_dir() -> Path:
    """The directory of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read_stdlib(max_bytes: int) -> tuple[bytes, str]:
    root = stdlib_dir()
    files = sorted(root.glob("*.py")) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.py files in the standard library directory {root}")
    chunks: list[bytes] = []
    total = 0
    for file in files:
        data = file.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks), f"the *.py files of {root}"


def load_text_bytes(
    path: str | Path | None = None, max_bytes: int = 4_000_000, *, min_bytes: int = 2
) -> torch.Tensor:
    """The first ``max_bytes`` bytes of a text, as a uint8 tensor of shape ``[N]``.

    path: a file to read; None reads the standard library's top-level ``*.py`` files (about
    4.7 MB on CPython 3.11), sorted by name, so the result is deterministic.
    min_bytes: the fewest bytes accepted (2 give one input/label pair).

    Raises ``FileNotFoundError`` naming the path if it is missing and ``ValueError`` naming it
    if it holds fewer than ``min_bytes`` bytes.
    """
    for name, value in (("max_bytes", max_bytes), ("min_bytes", min_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    if path is None:
        data, source = _read_stdlib(max_bytes)
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"text file not found: {str(path)!r}")
        with file.open("rb") as handle:
            data = handle.read(max_bytes)
        source = repr(str(path))
    if len(data) < min_bytes:
        raise ValueError(f"{source} holds {len(data)} bytes, fewer than min_bytes={min_bytes}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


class ByteBatches:
    """Random next-byte windows of ``data``: an endless, reproducible iterable of batches.

    Each batch is ``(inputs, labels)``, both int64 ``[batch_size, seq_len]`` and contiguous,
    with ``labels[:, t] == inputs[:, t + 1]`` inside the window (labels are the inputs shifted
    by one). Window offsets come from a ``torch.Generator`` seeded with ``seed``; every
    ``iter()`` starts the same sequence again and returns a ``ByteBatchIterator``, whose
    ``state_dict()`` / ``load_state_dict()`` save and restore the position (for checkpoints).
    ``num_batches`` makes it finite.

    split: ``"all"`` uses all of ``data``; ``"train"`` the head and ``"val"`` the held-out tail
    of ``val_fraction`` of it (windows never cross the boundary).
    device: where the batches are put (default: where ``data`` is).
    """

    def __init__(
        self,
        data: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        *,
        split: Split = "all",
        val_fraction: float = 0.1,
        num_batches: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
        if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
            raise ValueError(f"data must hold integer token ids, got dtype {data.dtype}")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got seed={seed!r}")
        if num_batches is not None and (
            not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 0
        ):
            raise ValueError(f"num_batches must be None or an int >= 0, got {num_batches!r}")
        if split not in ("all", "train", "val"):
            raise ValueError(f"split must be 'all', 'train' or 'val', got split={split!r}")
        if split != "all" and not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got val_fraction={val_fraction!r}")

        boundary = len(data) - int(len(data) * val_fraction) if split != "all" else len(data)
        part = data[boundary:] if split == "val" else data[:boundary]
        if len(part) < seq_len + 1:
            where = "data" if split == "all" else f"the {split!r} split of data"
            raise ValueError(
                f"{where} holds {len(part)} tokens, fewer than seq_len + 1 = {seq_len + 1}"
            )
        self.data = part
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.split = split
        self.num_batches = num_batches
        self.device = part.device if device is None else torch.device(device)
        self._window = torch.arange(seq_len + 1, device=part.device)

    def __len__(self) -> int:
        """``num_batches``; an endless iterable has no length (``TypeError``)."""
        if self.num_batches is None:
            raise TypeError("an endless ByteBatches has no len(); pass num_batches")
        return self.num_batches

    def __iter__(self) -> ByteBatchIterator:
        return ByteBatchIterator(self)


class ByteBatchIterator(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """One pass over a ``ByteBatches``, with a state that checkpoints can save and restore.

    ``position`` counts the batches drawn so far. ``state_dict()`` holds the position, the
    window generator's state and the loader's settings; ``load_state_dict()`` of a fresh
    iterator over an equal ``ByteBatches`` continues with exactly the batches the saved one
    would have drawn next (it raises ``ValueError`` naming the setting that differs).
    """

    def __init__(self, batches: ByteBatches) -> None:
        self.batches = batches
        self.position = 0
        self._gen = torch.Generator().manual_seed(batches.seed)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batches
        if b.num_batches is not None and self.position >= b.num_batches:
            raise StopIteration
        n_starts = len(b.data) - b.seq_len  # offsets 0 .. n_starts - 1
        offsets = torch.randint(n_starts, (b.batch_size,), generator=self._gen)
        index = offsets.to(b.data.device)[:, None] + b._window
        windows = b.data[index].to(device=b.device, dtype=torch.int64)
        self.position += 1
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _settings(self) -> dict[str, int | str]:
        b = self.batches
        return {
            "seed": b.seed,
            "batch_size": b.batch_size,
            "seq_len": b.seq_len,
            "split": b.split,
            "tokens": len(b.data),
        }

    def state_dict(self) -> dict[str, Any]:
        """``{"position", "generator", "settings"}``: everything needed to continue."""
        return {
            "position": self.position,
            "generator": self._gen.get_state(),
            "settings": self._settings(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the iterator that wrote ``state`` stopped."""
        saved: dict[str, Any] = state["settings"]
        for key, value in self._settings().items():
            if saved.get(key) != value:
                raise ValueError(
                    f"the saved data loader state has {key}={saved.get(key)!r}, "
                    f"this loader has {key}={value!r}"
                )
        position = state["position"]
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"the saved loader position must be an int >= 0, got {position!r}")
        self._gen.set_state(state["generator"])
        self.position = position
