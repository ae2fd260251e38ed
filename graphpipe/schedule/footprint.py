"""What a schedule size costs in memory, estimated before anything is built, and the limit.

``graphpipe schedule``, ``bench`` and ``profile`` call ``check_memory`` with their sizes
before they build a schedule: a size whose estimate is above the limit is a one-line error
naming both (exit status 2), where building it would run for minutes into the memory limit
(``graphpipe schedule --ranks 2 --microbatches 1000000000`` asks numpy for terabytes).

The estimate counts what the size decides, from the shapes of the arrays ``packed``
and the passes build (``timing``, ``lower``, ``simulate``):

- *actions*: at most 3 per (stage, micro-batch) pair a generator emits (F, and B or I and W);
  each is a few int32/int64 codes, times and offsets in the passes' arrays;
- *keys*: ``stages x micro-batch bound``, the (stage, micro-batch) key space the passes index
  by (ZB-V generates ``max(M, 2N - 1)`` micro-batches and keeps ``M``: its key space grows
  with ``N**2`` even at ``M = 1``);
- *ranks*: each rank's offsets and statistics.

The per-unit bytes below are ``tracemalloc`` peaks per unit with a margin, so that an
estimate is an upper bound: ``tests/test_footprint.py`` holds the estimates above the peaks of
the arrays and objects really built, for sizes of every schedule kind. Ranks are counted
generously, so a schedule of many ranks and few micro-batches is overestimated most
(docs/benchmarks.md sets estimates against measured peaks). It covers the schedule only: a
benchmark's or a profile's model, activations and batches come on top.

The limit: ``--memory-limit`` when given, else the memory available now, the smaller of
``/proc/meminfo``'s ``MemAvailable`` and what the process's cgroup (v2 ``memory.max``, v1
``memory.limit_in_bytes``) has left. Where neither can be read (not Linux) and no limit is
given, there is no check, and ``memory_limit`` says so.

Imports nothing heavy (no numpy): the check answers in the time the command line takes.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from graphpipe.schedule.ir import KINDS

__all__ = [
    "Limit",
    "Size",
    "add_memory_limit_argument",
    "check_memory",
    "figures_bytes",
    "format_bytes",
    "memory_limit",
    "parse_bytes",
    "runtime_bytes",
    "schedule_size",
]


ACTIONS_PER_PAIR = 3
"""F, and B or I and W: the most actions one (stage, micro-batch) pair has."""

ARRAY_BYTES = {"action": 128, "key": 96, "rank": 1024}
"""Bytes per action, key and rank of the passes' arrays (``figures``: cells, lowered
programs, times, per-rank statistics)."""

ARRAY_TEMPORARIES = (256, 64 << 20)
"""Bytes per action of the passes' temporaries, up to a cap: the passes that go rank by rank
work in chunks (``packed.CHUNK``), so their temporaries stop growing with the size."""

OBJECT_BYTES_PER_ACTION = 1024
"""Bytes per action of a schedule as ``Action`` objects, lowered with its ``Step`` objects
(what one ``Pipeline`` builds for every rank, and ``schedule --out``'s picture)."""

GRID_BYTES_PER_ACTION = 256
"""Bytes per action of the printed grid (every cell's name, then the grid's text): what
``graphpipe schedule --full`` adds; without ``--full`` the grid is printed up to 100 000
cells only."""

BASE_BYTES = 1 << 20
"""The fixed part: placements, result objects, small arrays."""


@dataclass(frozen=True)
class Size:
    """The units of a schedule size that memory grows with (see the module doc)."""

    ranks: int
    actions: int
    keys: int


def schedule_size(kind: str, num_ranks: int, num_microbatches: int) -> Size:
    """The ``Size`` of schedule ``kind`` (a name in ``graphpipe.schedule.generators.SCHEDULES``) on
    ``num_ranks`` ranks with ``num_microbatches`` micro-batches; nothing is built."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}: expected one of {sorted(KINDS)}")
    for name, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    per_rank, generated = KINDS[kind].stages_per_rank, KINDS[kind].generated
    stages = per_rank * num_ranks
    return Size(
        ranks=num_ranks,
        actions=ACTIONS_PER_PAIR * stages * num_microbatches,
        keys=stages * generated(num_ranks, num_microbatches),
    )


def _arrays(size: Size) -> int:
    per, cap = ARRAY_TEMPORARIES
    return (
        BASE_BYTES
        + ARRAY_BYTES["action"] * size.actions
        + ARRAY_BYTES["key"] * size.keys
        + ARRAY_BYTES["rank"] * size.ranks
        + min(cap, per * size.actions)
    )


def figures_bytes(kind: str, num_ranks: int, num_microbatches: int) -> int:
    """The estimated peak bytes of ``simulate.figures`` on the schedule (what ``graphpipe
    schedule`` runs for every format)."""
    return _arrays(schedule_size(kind, num_ranks, num_microbatches))


def runtime_bytes(kind: str, num_ranks: int, num_microbatches: int) -> int:
    """The estimated peak bytes of the schedule as ``Action`` objects, lowered, with the
    array checks it passes first: what one ``Pipeline`` builds in each rank's process (every
    rank's schedule, validated and lowered), and ``schedule --out`` before it draws."""
    size = schedule_size(kind, num_ranks, num_microbatches)
    return _arrays(size) + OBJECT_BYTES_PER_ACTION * size.actions


def format_bytes(n: int) -> str:
    """``n`` bytes for a message: ``7.45 GiB``, ``512.0 MiB``, ``300 B``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``--memory-limit``'s value: bytes, or a number with K, M, G, T or P (powers of 1024;
    ``GiB`` and ``GB`` read the same). Raises ValueError naming the text."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"expected a size such as 8G, 512M or 1000000 (bytes), got {text!r}")
    scale = 1024 ** "bkmgtp".index((m.group(2) or "b").lower())
    return int(float(m.group(1)) * scale)


@dataclass(frozen=True)
class Limit:
    """The memory a command may use: ``bytes``, and ``source``, where it comes from (for the
    message)."""

    bytes: int
    source: str


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, or "max"
        return None


def _cgroup_left(root: Path) -> int | None:
    """What the cgroup of this process may still allocate, where it has a limit."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),  # v2, the cgroup namespace's root
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # v1
    ):
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1: "none" is ~2**63
            return max(0, limit - usage)
    return None


def memory_limit(
    explicit: int | None = None,
    *,
    meminfo: Path = Path("/proc/meminfo"),
    cgroup: Path = Path("/sys/fs/cgroup"),
) -> Limit | None:
    """The limit the estimates are held to: ``explicit`` (``--memory-limit``) when given,
    else the memory available now (``MemAvailable``, or what the cgroup has left where that
    is less); None when none of them can be read."""
    if explicit is not None:
        return Limit(explicit, "--memory-limit")
    found = []
    if (available := _meminfo_available(meminfo)) is not None:
        found.append(Limit(available, "available (MemAvailable)"))
    if (left := _cgroup_left(cgroup)) is not None:
        found.append(Limit(left, "left in this process's cgroup"))
    return min(found, key=lambda limit: limit.bytes) if found else None


def check_memory(what: str, estimate: int, limit: Limit | None) -> str | None:
    """The one-line refusal of ``what`` (the sizes, as the user gave them) when its
    ``estimate`` is above ``limit``, else None."""
    if limit is None or estimate <= limit.bytes:
        return None
    if limit.source == "--memory-limit":
        than = f"--memory-limit {format_bytes(limit.bytes)}"
    else:
        than = f"the {format_bytes(limit.bytes)} {limit.source}"
    return (
        f"{what} needs an estimated {format_bytes(estimate)} of memory, more than {than}; "
        "choose fewer ranks or micro-batches"
    )


def _limit_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_memory_limit_argument(p: argparse.ArgumentParser) -> None:
    """``--memory-limit SIZE`` on ``p`` (``args.memory_limit``: bytes, or None)."""
    p.add_argument(
        "--memory-limit",
        type=_limit_arg,
        default=None,
        metavar="SIZE",
        help="refuse, before building anything, a size whose schedule needs an estimated "
        "memory above SIZE (bytes, or 512M, 8G, ...) (default: the memory available now, "
        "MemAvailable or the cgroup's limit)",
    )
