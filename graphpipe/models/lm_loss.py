"""HF's causal-LM loss as a pipeline ``loss_fn``, and the token count it divides by.

``causal_lm_loss`` is HF's ``ForCausalLMLoss`` (labels shifted left, ``ignore_index=-100``,
logits upcast with ``.float()``), for either ``loss_reduction``; with ``num_items_in_batch``
(``causal_lm_num_items``) it is the token-weighted loss whose sum over micro-batches and
replicas is HF's mean over the whole batch's valid tokens. ``causal_lm_loss.check_labels``
refuses, before a step, a micro-batch without a valid token under ``"mean"`` (0 / 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["causal_lm_loss", "causal_lm_num_items"]


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """HF's causal-LM loss (``ForCausalLMLoss``): token ``t`` predicts ``labels[:, t + 1]``
    (the last token predicts nothing), labels equal to ``ignore_index`` count for nothing,
    and the cross-entropy is computed on ``logits.float()`` (float32 for float64 logits too,
    as HF does). Returns a 0-dim float32 tensor.

    Without ``num_items_in_batch``: the mean over the valid tokens of ``labels`` (with
    ``loss_reduction="mean"`` the pipeline averages these per-micro-batch means). With it:
    the sum of the token losses divided by ``num_items_in_batch``, the number of valid tokens
    of the whole batch (all micro-batches and replicas): a 0-dim tensor, an int, or, as a
    keyword tensor of ``pipe.step`` (split on dim 0 like the batch), a ``[B]`` tensor holding
    that count in every row (``causal_lm_num_items``; its first element is read, on the
    device). With ``loss_reduction="sum"`` the pipeline's loss and gradients are then HF's
    ``model(input_ids, attention_mask=..., labels=...)`` on the whole batch; a batch with no
    valid token at all gives 0 (HF: NaN), an empty micro-batch adds 0.

    Under ``loss_reduction="mean"`` without ``num_items_in_batch`` a micro-batch with no
    valid token is refused before the step, on every rank, naming it (``check_labels``): its
    mean would be 0 / 0.

    logits: ``[B, T, V]``; labels: int ``[B, T]``.
    """
    logits = logits.float()
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    target = shifted.reshape(-1).to(flat.device)
    if num_items_in_batch is None:
        return F.cross_entropy(flat, target, ignore_index=ignore_index)
    total = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
    count = num_items_in_batch
    if isinstance(count, torch.Tensor):
        # A batch without a valid token counts 0 items: its loss and gradients are 0 (HF's
        # sum / 0 is NaN). No host synchronization: clamped on the device.
        return total / count.reshape(-1)[0].to(total.device).clamp(min=1)
    return total / max(count, 1)


def _check_causal_lm_labels(
    labels: Any,
    keywords: tuple[str, ...],
    *,
    num_microbatches: int,
    loss_reduction: str,
    ignore_index: int = -100,
) -> None:
    """``causal_lm_loss.check_labels``, run by the pipeline on the loss rank before a step:
    under ``loss_reduction="mean"`` without ``num_items_in_batch`` every micro-batch needs a
    valid token (its loss is the mean over them: 0 / 0 otherwise); ``ValueError`` naming the
    first micro-batch that has none and the remedy. With ``num_items_in_batch`` an empty
    micro-batch adds 0 and needs no check."""
    if loss_reduction != "mean" or "num_items_in_batch" in keywords:
        return
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return
    valid = (labels[..., 1:] != ignore_index).reshape(num_microbatches, -1).any(dim=1)
    empty = [i for i, ok in enumerate(valid.tolist()) if not ok]
    if empty:
        rows = labels.shape[0] // num_microbatches
        i = empty[0]
        raise ValueError(
            f"micro-batch {i} (rows {i * rows} to {(i + 1) * rows - 1}) has no valid label "
            f"(every label past the first token is {ignore_index}; {len(empty)} of "
            f"{num_microbatches} micro-batches are so): under loss_reduction='mean' its loss, "
            "the mean over its valid tokens, would be 0 / 0 (NaN). Build the pipeline with "
            "loss_reduction='sum' and pass num_items_in_batch=causal_lm_num_items(labels) "
            "(then the step is the loss of one process on the whole batch, empty micro-batches "
            "included), or leave the empty rows out of the batch"
        )


causal_lm_loss.check_labels = _check_causal_lm_labels  # type: ignore[attr-defined]


def causal_lm_num_items(
    labels: torch.Tensor, *, dp_group: Any = None, ignore_index: int = -100
) -> torch.Tensor:
    """The ``num_items_in_batch`` keyword tensor of ``causal_lm_loss`` for this step: the
    number of tokens the loss counts in ``labels`` ``[B, T]`` (``labels[:, 1:] !=
    ignore_index``), summed over the data-parallel replicas with ``dp_group`` (an
    ``all_reduce`` of a device tensor: no host synchronization), as an int64 ``[B]`` tensor
    holding that count in every row.

    Every pipeline rank passes the same keyword tensors, so every rank calls it on its
    replica's labels (the ranks of one replica see the same batch).
    """
    count = (labels[..., 1:] != ignore_index).sum().reshape(1)
    if dp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(count, group=dp_group)
    return count.repeat(labels.shape[0])
