"""Rank 0's report of a ``graphpipe train`` run: the progress line and the metrics file.

Owns: ``Progress`` (the bar, ETA and total time on stderr), ``duration`` (how times are
written), ``open_metrics`` (the ``--metrics`` JSON-lines file, trimmed to the checkpoint's
step on resume), ``checkpoint_dirs`` and ``save_lines`` (what a save wrote, replaced and
removed, as lines for stderr) and ``DroppedTokens`` (the MoE dropped-token count of a step,
over every rank). Imports no torch at module level.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from graphpipe.checkpoint.files import read_marker, step_dirs

if TYPE_CHECKING:
    import torch

__all__ = [
    "DroppedTokens",
    "Progress",
    "checkpoint_dirs",
    "duration",
    "open_metrics",
    "save_lines",
]


def duration(seconds: float) -> str:
    """``8.2 s``, ``3m05s``, ``1h02m``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Rank 0's progress: one redrawn line on a terminal, plain lines elsewhere.

    Each line shows the step, a bar, the caller's text and the ETA (the mean step time of
    this run so far times the steps left); the last one shows the total time instead. On a
    terminal the line is redrawn in place (``\\r``, the line, then erase-to-end-of-line, cut
    to the terminal's width so it never wraps); elsewhere a line is written for the first
    step, every ``every`` steps and the last step. ``first``: the first step this run takes
    (a resumed run starts after its checkpoint's step).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO = sys.stderr,
        every: int = 10,
        *,
        first: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.stream, self.every, self.first = total, stream, every, first
        self.tty = stream.isatty()
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        """Seconds since this progress was created."""
        return self.clock() - self.start

    def update(self, step: int, text: str) -> None:
        width = 24
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        elapsed = self.elapsed()
        if step >= self.total:
            tail = f"{duration(elapsed)} total"
        else:
            per_step = elapsed / (step - self.first + 1)
            tail = f"ETA {duration(per_step * (self.total - step))}"
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {text} | {tail}"
        if self.tty:
            columns = shutil.get_terminal_size().columns
            self.stream.write("\r" + line[: max(1, columns - 1)] + "\x1b[K")
            if step >= self.total:
                self.stream.write("\n")
        elif step == self.first or step % self.every == 0 or step >= self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, line: str) -> None:
        """``line`` on a line of its own; on a terminal it replaces the redrawn progress line,
        which the next ``update`` draws again below it."""
        self.stream.write(("\r\x1b[K" if self.tty else "") + line + "\n")
        self.stream.flush()

    def end_line(self) -> None:
        """End a line redrawn in place (on a terminal), so that what follows starts on its own."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def open_metrics(path: str, resumed_step: int) -> TextIO:
    """The metrics file, for appending: a resumed run keeps the rows up to its checkpoint."""
    if resumed_step == 0 or not os.path.exists(path):
        return open(path, "w")
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= resumed_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return open(path, "a")


def checkpoint_dirs(root: str | os.PathLike) -> dict[Path, bool]:
    """The checkpoint directories (``step-*``) in ``root``, each with whether it is complete
    (holds its marker)."""
    return {path: read_marker(path) is not None for _, path in step_dirs(Path(root))}


def save_lines(
    path: Path,
    before: Mapping[Path, bool],
    after: Mapping[Path, bool],
    skipped: Mapping[str, str],
    keep: int,
) -> list[str]:
    """What one save did to ``--checkpoint-dir``, a line each: the checkpoint written (and what
    it replaced), then every checkpoint directory that is gone since ``before`` and why.

    skipped: the checkpoints ``--resume`` skipped (path -> why they did not verify).
    keep: ``--keep-checkpoints``.
    """

    def why_skipped(p: Path) -> str | None:
        return skipped.get(str(p))

    wrote = f"graphpipe train: saved {path}"
    if path in before:
        if (why := why_skipped(path)) is not None:
            wrote += f", replacing the one --resume skipped: {why}"
        elif not before[path]:
            wrote += ", replacing an incomplete one"
        else:
            wrote += ", replacing the one there"
    lines = [wrote]
    for gone in sorted(set(before) - set(after)):
        if (why := why_skipped(gone)) is not None:
            lines.append(f"graphpipe train: removed {gone}, which --resume skipped: {why}")
        elif not before[gone]:
            lines.append(f"graphpipe train: removed {gone}: incomplete (a save cut short)")
        else:
            lines.append(
                f"graphpipe train: removed {gone}: older than the newest {keep} that verify "
                f"(--keep-checkpoints {keep})"
            )
    return lines


class DroppedTokens:
    """The MoE blocks' dropped-token counters of this rank's stages: zeroed before each step
    (in place, so a captured step keeps counting into them), summed on the device over the
    step and over all ranks by one all-reduce, read on the host once per step."""

    def __init__(self, modules: Any, device: torch.device) -> None:
        self.modules, self.device, self.total = modules, device, 0

    def reset(self) -> None:
        from graphpipe.models import reset_dropped_tokens

        reset_dropped_tokens(self.modules)

    def gather(self) -> None:
        import torch.distributed as dist

        from graphpipe.models import dropped_tokens

        count = dropped_tokens(self.modules).to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
        self.total = int(count)
