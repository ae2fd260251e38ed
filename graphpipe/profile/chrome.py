"""Reading torch.profiler Chrome traces (``prof.export_chrome_trace``) into ``Range``s.

The runtime's ranges appear there as complete events (``"ph": "X"``) of category
``user_annotation`` (host side, the ``record_function`` ranges) and, when CUDA activity
was recorded, ``gpu_user_annotation`` (the same ranges projected by Kineto onto the GPU
kernels launched inside them). ``ts`` and ``dur`` are microseconds; ``ts`` counts from the
trace's ``baseTimeNanoseconds``, so traces of several processes on one machine share one
clock once that base is added.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .ranges import Range

__all__ = ["CLOCKS", "load_chrome_traces"]

CLOCKS: dict[str, str] = {"host": "user_annotation", "gpu": "gpu_user_annotation"}
"""Which clock to read -> the Chrome trace category holding the ranges on it."""


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"trace {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"trace {path} is not JSON: {e}") from None
    if isinstance(data, list):  # the bare-array form of the Chrome trace format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"trace {path} holds no traceEvents list: not a Chrome trace")
    return data


def load_chrome_traces(
    paths: Mapping[int, str | Path], clock: str = "host"
) -> dict[int, list[Range]]:
    """The ranges of each rank's trace (``paths``: rank -> file), in seconds from the
    earliest range of all of them. ``clock``: ``host`` (the ``record_function`` ranges) or
    ``gpu`` (Kineto's projection of them onto the GPU kernels they launched)."""
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}: expected one of {sorted(CLOCKS)}")
    category = CLOCKS[clock]
    raw: dict[int, tuple[int, list[tuple[str, float, float, int]]]] = {}
    for rank, p in paths.items():
        data = _read(Path(p))
        base_ns = int(data.get("baseTimeNanoseconds", 0))
        events = [
            (str(e["name"]), float(e["ts"]), float(e.get("dur", 0.0)), _tid(e.get("tid")))
            for e in data["traceEvents"]
            if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == category
        ]
        raw[rank] = (base_ns, events)
    base0 = min((b for b, _ in raw.values()), default=0)
    # microseconds on the shared clock, kept small before converting: ts alone is ~1e12 us
    shift = {r: (b - base0) / 1000 for r, (b, _) in raw.items()}
    starts = [shift[r] + ts for r, (_, ev) in raw.items() for _, ts, _, _ in ev]
    origin = min(starts, default=0.0)
    out: dict[int, list[Range]] = {}
    for rank, (_, events) in raw.items():
        out[rank] = [
            Range(
                rank,
                name,
                (shift[rank] + ts - origin) / 1e6,
                (shift[rank] + ts - origin + dur) / 1e6,
                tid,
            )
            for name, ts, dur, tid in events
        ]
    return out


def _tid(value: object) -> int:
    """Chrome trace thread ids are numbers, or strings such as ``"stream 7"`` on the GPU."""
    if isinstance(value, int):
        return value
    digits = "".join(ch for ch in str(value) if ch.isdigit())
    return int(digits) if digits else 0
