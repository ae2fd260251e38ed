"""Save, verify, resume and export a pipeline's training state (``torch.distributed.checkpoint``).

Every rank calls the same function with its own stages, keyed by their global stage index
(``{r: stage_r, 2N-1-r: stage_2N-1-r}`` on rank ``r`` of a DualPipeV pipeline)::

    from graphpipe.checkpoint import find_resumable, load_checkpoint, save_checkpoint

    stages = {rank: mine[0], 2 * n - 1 - rank: mine[1]}
    start = 0
    path, skipped = find_resumable("ckpt")  # the newest checkpoint that verifies
    if path is not None:
        start = load_checkpoint(path, stages, opt, extra={"data": batches})
    for step in range(start + 1, total + 1):
        ...  # pipe.step, opt.step
        if step % 100 == 0:
            save_checkpoint("ckpt", step, stages, opt, extra={"data": batches})

What one checkpoint ``ROOT/step-00000100`` holds (one DCP checkpoint, all ranks' files):

- ``model.stage{i}.{key}``: each stage's own ``state_dict()`` keys under its stage index, so
  the tensors of different ranks never share a name (DCP's planner treats tensors of equal
  name on several ranks as replicas and keeps one copy). graphpipe's in-place ``nn.Linear``
  class swap leaves every key as it was. A weight tied between stage 0 and stage 2N-1 (both
  on rank 0) is saved under both names and loaded into the one parameter.
- ``optim.*``: the optimizer state from ``torch.distributed.checkpoint.state_dict`` with
  ``flatten_optimizer_state_dict=True``: every entry, param groups included, is keyed by the
  parameter's name above, so ranks' optimizers never collide either (a tied parameter has
  one optimizer state).
- Expert-parallel sharded experts (``graphpipe.models`` MoE blocks with an ``ep_group``):
  their keys carry the experts they hold, ``...mlp.w_up[experts 2-3 of 4]``, so that the
  shards of one expert-parallel group, which share parameter names, are all stored; the
  replicas that hold the same experts store them once. Resuming needs the same ``ep``.
- ``step``: the global step.
- ``rank{r}.rng``: rank ``r``'s random number generator states: torch's CPU generator,
  every CUDA device's generator once CUDA is initialized, Python's ``random`` and NumPy's
  global generator.
- ``rank{r}.{name}``: every ``extra`` object of rank ``r`` with ``state_dict()`` and
  ``load_state_dict()``, for example the data iterator
  (``graphpipe.data.ByteBatchIterator``).
- ``graphpipe.json``, the marker: the step, the ranks and their stages, the saver's
  ``meta``, the size and CRC-32 of every other file of the checkpoint, each stage's unsplit
  key map (``graphpipe.keymap.set_unsplit_keys``; null: keys unchanged) and the names of the
  tensors that are one tensor on their rank (tied weights). Rank 0 writes it after every
  rank's files are complete (to a temporary name, then a rename). A checkpoint directory
  without it is incomplete (a rank died while saving): ``latest_checkpoint`` ignores it, a
  later save of the same step overwrites it and pruning deletes it.

**Verification.** Each rank computes the CRC-32 of the files it wrote (reading them back,
usually from the page cache) and rank 0 gathers the sizes and checksums into the marker:
the hashing is shared by the ranks and only names and numbers cross the process group,
where rank 0 hashing every file after a barrier would read the whole checkpoint on one rank.
CRC-32 detects accidental damage (every error burst up to 32 bits; anything else but for a
2**-32 chance), not tampering, and ``zlib.crc32`` hashes several times faster than a
cryptographic hash such as ``hashlib.blake2b`` (docs/checkpoints.md, docs/benchmarks.md).
``load_checkpoint`` verifies before it reads anything: every rank checks ``.metadata`` and
the files it wrote, and the shapes of its tensors against ``.metadata``, rank 0 the
directory's listing (a file the marker does not list is damage too: DCP would read it through
``.metadata``); the ranks exchange their verdicts, and all raise the same error. A damaged,
truncated, missing or unlisted file is a ``CheckpointError`` naming the checkpoint and the
file. ``save_checkpoint(..., keep=K)`` counts only the older checkpoints that verify (the
ranks check them as a load does) and never deletes ``resumed_from``. ``verify_checkpoint`` checks a
checkpoint in one process; ``find_resumable`` finds the newest one that verifies and says
which newer ones it skipped and why.

**Export.** ``export_state_dict(path)`` reads a checkpoint in one process, no process group
needed, and returns the unsplit model's ``state_dict``: every stage key renamed by its
stage's key map, tied weights as one tensor (under every name the unsplit model gives it),
expert-parallel shards concatenated, no optimizer state. ``graphpipe export DIR OUT.pt``
writes it with ``torch.save``.

Resuming needs the same number of ranks and the same stage split. Load before the
pipeline's first step: a captured step (``capture=...``, ``capture_optimizer=...``) holds the
optimizer's state tensors, which loading replaces. Resuming from a
checkpoint and continuing reproduces an uninterrupted run bit for bit when the step is
deterministic (``graphpipe train`` is; ``tests/test_checkpoint*.py`` check it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphpipe._lazy import lazy_attributes

if TYPE_CHECKING:
    from .state import (
        MARKER,
        CheckpointError,
        checkpoint_info,
        checkpoint_path,
        export_state_dict,
        find_resumable,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
        set_unsplit_keys,
        unsplit_keys,
        verify_checkpoint,
    )

__all__ = [
    "MARKER",
    "CheckpointError",
    "checkpoint_info",
    "checkpoint_path",
    "export_state_dict",
    "find_resumable",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "set_unsplit_keys",
    "unsplit_keys",
    "verify_checkpoint",
]

__getattr__, __dir__ = lazy_attributes(__name__, {name: ".state" for name in __all__})
