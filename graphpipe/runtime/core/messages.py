"""What crosses a pipeline edge: the first step's headers and the later steps' checks.

The first step of a batch signature sends, ahead of each message, a header with the count,
dtypes, ``requires_grad`` and shapes of its tensors (``encode_header`` / ``decode_header``),
so that a receiver allocates exactly what arrives; later steps send data only and check it
against the recorded metadata (``check_message``), so that a stage whose output changes
shape is an error naming the edge, not a corrupted receive.

Owns: the header format. May touch: nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphpipe.meta import DTYPE_CODE, DTYPES, TensorMeta, describe

__all__ = [
    "DATA_TAG",
    "HEADER_LEN",
    "HEADER_TAG",
    "check_message",
    "decode_header",
    "encode_header",
]

Channel = tuple[int, int]
HEADER_LEN = 128
DATA_TAG = 0
HEADER_TAG = 1  # headers travel apart from the data (gloo matches per peer and tag, in order)


def encode_header(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write ``[count, (dtype, requires_grad, ndim, *shape) ...]`` into the int64 ``out``."""
    vals = [len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPE_CODE:
            raise ValueError(f"dtype {t.dtype} cannot cross a pipeline edge")
        vals += [DTYPE_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    if len(vals) > HEADER_LEN:
        raise ValueError(
            f"a stage output of {len(tensors)} tensors with shapes "
            f"{[tuple(t.shape) for t in tensors]} does not fit a {HEADER_LEN}-int header"
        )
    out.zero_()
    out[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return out


def decode_header(header: torch.Tensor, device: torch.device) -> tuple[TensorMeta, ...]:
    vals = header.tolist()
    count, i, metas = vals[0], 1, []
    for _ in range(count):
        code, rg, ndim = vals[i : i + 3]
        shape = tuple(vals[i + 3 : i + 3 + ndim])
        metas.append(TensorMeta(shape, DTYPES[code], device, bool(rg)))
        i += 3 + ndim
    return tuple(metas)


def check_message(
    what: str, channel: Channel, tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta]
) -> None:
    """Raise ``ValueError`` naming the edge and tensor when ``tensors`` do not fit ``metas``."""
    if len(tensors) != len(metas):
        raise ValueError(
            f"{what} on edge stage {channel[0]} -> stage {channel[1]}: {len(tensors)} tensors, "
            f"but the first step exchanged {len(metas)} {describe(metas)}"
        )
    for i, (t, m) in enumerate(zip(tensors, metas, strict=True)):
        if t.shape != m.shape or t.dtype != m.dtype:
            raise ValueError(
                f"{what} on edge stage {channel[0]} -> stage {channel[1]}, tensor {i}: "
                f"shape {list(t.shape)} {str(t.dtype).removeprefix('torch.')}, but the first "
                f"step exchanged {m}"
            )
