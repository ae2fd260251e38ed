"""What the runtime's named ranges are, as the profile analysis reads them.

Owns ``Range`` (one named time range of one rank, in seconds) and the naming contract with
the runtime (``graphpipe.nvtx.Ranges`` emits these names to NVTX and to the torch profiler):

* ``step``: one training step;
* a schedule action by its string, parsed with ``graphpipe.schedule.ir.Action.parse``: ``3F5``,
  ``0W2``, ``7I2``, ``2B4``, ``(0F5;7B2)OVERLAP_F_B``;
* ``wait ...``: time blocked on point-to-point communication, followed by what is awaited
  (``wait 1RECV_F3``, ``wait 1RECV_F3 6RECV_B2``, ``wait sends``);
* anything else (``loss``, ``p2p`` under ``capture="action"``, ranges of other code) is
  *other*: kept apart, never counted as busy or as waiting.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from graphpipe.schedule.ir import WAIT_PREFIX, Action

__all__ = ["STEP", "WAIT_PREFIX", "Kind", "Range", "action_of", "kind_of"]

STEP = "step"
"""The name of the range around one training step."""


class Kind(str, Enum):
    """What a range is, from its name."""

    STEP = "step"
    ACTION = "action"  # a compute action of the schedule: F, B, I, W or an overlapped pair
    WAIT = "wait"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Range:
    """One named range of one rank.

    rank: the pipeline rank that ran it.
    name: the range's name (see the module doc).
    start, end: seconds on a clock that all ranks of one profile share (origin arbitrary).
    thread: the thread (or, on the GPU clock, the stream) it was recorded on.
    """

    rank: int
    name: str
    start: float
    end: float
    thread: int = 0

    def __post_init__(self) -> None:
        if not self.end >= self.start:
            raise ValueError(
                f"range {self.name!r} of rank {self.rank} ends ({self.end}) before it starts "
                f"({self.start})"
            )

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> Kind:
        return kind_of(self.name)


@functools.lru_cache(maxsize=4096)
def action_of(name: str) -> Action | None:
    """The compute action a range is named after, or None (communication actions such as
    ``1SEND_F3`` are not compute: None)."""
    try:
        action = Action.parse(name)
    except ValueError:
        return None
    return action if action.is_compute else None


def kind_of(name: str) -> Kind:
    """What the range called ``name`` is."""
    if name == STEP:
        return Kind.STEP
    if name.startswith(WAIT_PREFIX):
        return Kind.WAIT
    if action_of(name) is not None:
        return Kind.ACTION
    return Kind.OTHER
