"""Point-to-point plumbing: channels, metadata headers, batched send/recv.

A *channel* is one directed stage edge ``(src_stage, dst_stage)``: forward activations go
``(s, s+1)``, input gradients ``(s, s-1)``. Messages on a channel are tuples of tensors with
one metadata (shapes, dtypes) for the whole run; the first step (and any step whose batch
signature changed) sends a small int64 header before each message so that the receiver can
allocate its buffers, later steps reuse the recorded metadata.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .meta import DTYPE_CODE, DTYPES, TensorMeta, describe

__all__ = ["HEADER_LEN", "Channel", "decode_header", "encode_header"]

Channel = tuple[int, int]
HEADER_LEN = 128
HEADER_TAG_OFFSET = 1 << 16  # headers travel on their own tags


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
    for i, (t, m) in enumerate(zip(tensors, metas)):
        if t.shape != m.shape or t.dtype != m.dtype:
            raise ValueError(
                f"{what} on edge stage {channel[0]} -> stage {channel[1]}, tensor {i}: "
                f"shape {list(t.shape)} {str(t.dtype).removeprefix('torch.')}, but the first "
                f"step exchanged {m}"
            )


def issue(ops: list[dist.P2POp]) -> list[dist.Work]:
    """Issue ``ops`` as batched P2P (one ``batch_isend_irecv`` per process group)."""
    if not ops:
        return []
    group = ops[0].group
    if all(op.group is group for op in ops):
        return dist.batch_isend_irecv(ops)
    by_group: dict[int, list[dist.P2POp]] = {}
    for op in ops:
        by_group.setdefault(id(op.group), []).append(op)
    return [w for batch in by_group.values() for w in dist.batch_isend_irecv(batch)]


def wait_all(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()
