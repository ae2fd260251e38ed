"""``graphpipe train``: train the built-in byte-level Llama with DualPipeV.

Every argument is checked before any rank starts (a bad one is a one-line error, exit status
2). Rank 0 shows a progress bar (loss, tokens/s, step time, ETA, total time at the end) and
writes ``--metrics`` as JSON lines: ``{"step", "loss", "step_time_s", "tokens_per_s"}`` with
the global step number, plus ``"dropped_tokens"`` with ``--experts`` (the (token, expert)
assignments past capacity in the step, over every MoE block of every rank; the loss then
includes the load-balancing term). ``--checkpoint-dir`` saves the training state with
``graphpipe.checkpoint``; ``--resume`` continues from the newest complete checkpoint there, bit
for bit as if the run had not stopped. The first step whose loss is not finite stops the run
(one line naming the step, exit status 1; before that step's metrics row and checkpoint)
unless ``--allow-nonfinite``.

Modules, one concern each:

* ``options``: the model, data and pipeline options (shared with ``graphpipe profile``) and
  their defaults;
* ``checks``: every argument check, before any rank starts;
* ``resume``: which checkpoint to resume from, and loading it on every rank;
* ``command``: the parser of ``train``'s own options and ``run`` (check, then launch);
* ``loop``: one rank's pipeline, optimizer and batches (``RankRun``, ``build_rank``) and its
  training loop;
* ``progress``: rank 0's progress line and metrics file.

Only ``loop`` imports torch (on first use of ``RankRun`` or ``build_rank``): the parser, the
checks and ``--help`` run without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphpipe._lazy import lazy_attributes

from .command import add_parser, run
from .options import add_model_options, default_layers, default_microbatches
from .progress import Progress

if TYPE_CHECKING:
    from .loop import RankRun, build_rank

__all__ = [
    "Progress",
    "RankRun",
    "add_model_options",
    "add_parser",
    "build_rank",
    "default_layers",
    "default_microbatches",
    "run",
]

__getattr__, __dir__ = lazy_attributes(__name__, {"RankRun": ".loop", "build_rank": ".loop"})
