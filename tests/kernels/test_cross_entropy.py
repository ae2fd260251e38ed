"""Triton cross-entropy against torch.nn.functional.cross_entropy, forward and backward."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from graphpipe.kernels import cross_entropy
from graphpipe.kernels.cross_entropy import cross_entropy_reference

ce_module = importlib.import_module("graphpipe.kernels.cross_entropy")

DTYPE_TOLS = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]
# (rows, vocab, block_size): block_size None = one chunk per row; small powers of two
# force several chunks with a ragged tail.
CASES = [(1, 37, None), (5, 129, None), (5, 129, 32), (3, 1000, 128), (8, 64, 16)]


def _inputs(rows, vocab, dtype, device, seed, n_ignored=1, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(device, dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[: min(n_ignored, rows - 1)] = -100  # keep at least one valid row
    return logits.requires_grad_(), target.to(device)


@pytest.mark.usefixtures("triton_loop_path")
@pytest.mark.parametrize(("rows", "vocab", "block_size"), CASES, ids=str)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPE_TOLS)
def test_cross_entropy_matches_torch(rows, vocab, block_size, dtype, atol, rtol, device):
    logits, target = _inputs(rows, vocab, dtype, device, seed=rows * vocab)
    loss = cross_entropy(logits, target, block_size=block_size)
    assert type(loss.grad_fn).__name__ == "_CrossEntropyFnBackward"  # really Triton
    assert loss.shape == () and loss.dtype == dtype
    (grad,) = torch.autograd.grad(loss * 3.0, logits)  # grad_output != 1 is honoured

    # torch itself, on float32 copies of the same logits
    logits_ref = logits.detach().float().requires_grad_()
    loss_ref = F.cross_entropy(logits_ref, target)
    (grad_ref,) = torch.autograd.grad(loss_ref * 3.0, logits_ref)
    torch.testing.assert_close(loss.float(), loss_ref, atol=atol, rtol=rtol)
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(grad.float(), grad_ref, atol=atol, rtol=rtol)
    assert torch.count_nonzero(grad[target == -100]) == 0  # ignored rows: zero gradient


@pytest.mark.usefixtures("triton_loop_path")
def test_cross_entropy_extreme_and_masked_logits(device):
    """Huge logits (overflow without the running max) and -inf masked vocab entries."""
    logits, target = _inputs(4, 129, torch.float32, device, seed=7, n_ignored=0, scale=1e4)
    with torch.no_grad():
        logits[:, 100:] = float("-inf")
        target.clamp_(max=99)
        logits[0, :64] = float("-inf")  # a whole first chunk masked
        target[0] = 70
    loss = cross_entropy(logits, target, block_size=64)
    (grad,) = torch.autograd.grad(loss, logits)
    logits_ref = logits.detach().clone().requires_grad_()
    loss_ref = F.cross_entropy(logits_ref, target)
    (grad_ref,) = torch.autograd.grad(loss_ref, logits_ref)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, loss_ref, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.usefixtures("triton_loop_path")
def test_cross_entropy_all_ignored_is_nan_like_torch(device):
    logits, target = _inputs(3, 37, torch.float32, device, seed=8)
    target = torch.full_like(target, -100)
    loss = cross_entropy(logits, target)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits.detach(), target))
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.count_nonzero(grad) == 0  # torch's gradient here is all zeros too


@pytest.mark.usefixtures("triton_loop_path")
def test_cross_entropy_custom_ignore_index_and_int32_target(device):
    logits, target = _inputs(6, 37, torch.float32, device, seed=9, n_ignored=0)
    target[1] = 5
    loss = cross_entropy(logits, target.int(), ignore_index=5)
    torch.testing.assert_close(loss, F.cross_entropy(logits.detach(), target, ignore_index=5))


class _LargeAllocations(TorchDispatchMode):
    """Records every new storage of at least ``numel`` elements that an aten op returns."""

    def __init__(self, numel: int, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.numel = numel
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.new: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.seen:
                    self.seen.add(ptr)
                    self.new.append(str(func))
        return out


@pytest.mark.usefixtures("triton_loop_path")
def test_cross_entropy_backward_allocates_one_logits_sized_buffer(device, monkeypatch):
    """The gradient autograd hands back is the one buffer the kernel wrote, and the only
    [rows, vocab] allocation of the backward."""
    rows, vocab = 6, 129
    logits, target = _inputs(rows, vocab, torch.bfloat16, device, seed=10)

    written: list[int] = []
    launcher = ce_module.cross_entropy_backward

    def spy(*args, **kwargs):
        grad = launcher(*args, **kwargs)
        written.append(grad.data_ptr())
        return grad

    monkeypatch.setattr(ce_module, "cross_entropy_backward", spy)
    loss = cross_entropy(logits, target)
    with _LargeAllocations(rows * vocab, [logits]) as allocs:
        loss.backward()
    assert len(written) == 1
    assert logits.grad is not None and logits.grad.data_ptr() == written[0]
    assert allocs.new == ["aten.empty.memory_format"], allocs.new

    # Control: the same probe does see the extra buffers of the plain-torch path.
    logits_ref = logits.detach().clone().requires_grad_()
    loss_ref = cross_entropy_reference(logits_ref, target)
    with _LargeAllocations(rows * vocab, [logits_ref]) as allocs_ref:
        loss_ref.backward()
    assert len(allocs_ref.new) >= 2, allocs_ref.new


def test_cross_entropy_bad_shapes_raise(device):
    with pytest.raises(ValueError, match="rows"):
        cross_entropy(torch.zeros(2, 3, 5, device=device), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="rows"):
        cross_entropy(torch.zeros(2, 5, device=device), torch.zeros(3, dtype=torch.long))


def test_reference_matches_torch():
    logits, target = torch.randn(5, 37), torch.randint(0, 37, (5,))
    target[0] = -100
    torch.testing.assert_close(
        cross_entropy_reference(logits, target), F.cross_entropy(logits, target)
    )
