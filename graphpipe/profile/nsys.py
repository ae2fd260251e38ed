"""Reading an Nsight Systems SQLite export (``nsys export --type sqlite``) into ``Range``s.

The schema (Nsight Systems' "SQLite Export Schema Reference", and the queries of its own
``nvtx_pushpop_trace`` report):

* ``NVTX_EVENTS(start, end, eventType, text, textId, globalTid, domainId, ...)``: times in
  nanoseconds; ``end`` is NULL for a range never closed. Push/pop ranges have ``eventType``
  59 (``NvtxPushPopRange``; 70 for the NVTX-T variant); a domain is created by an event of
  type 75 (``NvtxDomainCreate``) whose ``text`` (or ``textId``) is the domain's name and
  whose ``domainId`` the other events of that process refer to.
* A range's name is ``text``, or ``StringIds.value`` for ``textId`` when the string was
  registered.
* ``globalTid`` packs the process and thread ids: pid = (globalTid >> 24) & 0xFFFFFF,
  tid = globalTid & 0xFFFFFF. ``globalPid`` (GPU activity tables) packs the pid the same way.
* The GPU clock projects each range onto the GPU work it launched:
  ``CUPTI_ACTIVITY_KIND_RUNTIME(start, end, globalTid, correlationId)`` holds the CUDA API
  calls, and ``CUPTI_ACTIVITY_KIND_KERNEL`` / ``_MEMCPY`` / ``_MEMSET(start, end, globalPid,
  correlationId)`` what they launched; with ``--cuda-graph-trace=node`` every kernel of a
  replayed graph carries the correlation id of its ``cudaGraphLaunch``.

An export holds every traced process; the ranks are the processes with graphpipe ranges.
``assign_ranks`` tells which process is which pipeline rank from the stages of the actions
each one ran (rank r runs exactly its own stages).
"""

from __future__ import annotations

import bisect
import sqlite3
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from .ranges import Kind, Range, action_of, kind_of

__all__ = ["DOMAIN", "assign_ranks", "has_cuda_trace", "load_nsys"]

DOMAIN = "graphpipe"
"""The NVTX domain the runtime's ranges live in."""

_PUSHPOP = (59, 70)  # NvtxPushPopRange, NvtxtPushPopRange
_DOMAIN_CREATE = 75  # NvtxDomainCreate
_GPU_TABLES = (
    "CUPTI_ACTIVITY_KIND_KERNEL",
    "CUPTI_ACTIVITY_KIND_MEMCPY",
    "CUPTI_ACTIVITY_KIND_MEMSET",
)


def _pid(global_id: int) -> int:
    return (global_id >> 24) & 0xFFFFFF


def _tables(db: sqlite3.Connection) -> set[str]:
    return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _nvtx_rows(db: sqlite3.Connection, domain: str, path: Path) -> list[tuple[int, int, int, str]]:
    """(start, end, globalTid, name) of every closed push/pop range in ``domain``."""
    strings = "StringIds" in _tables(db)
    name = "coalesce(e.text, s.value)" if strings else "e.text"
    join = "LEFT JOIN StringIds AS s ON e.textId = s.id" if strings else ""
    domains: dict[tuple[int, int], str] = {}
    for dom_id, gtid, text in db.execute(
        f"SELECT e.domainId, e.globalTid, {name} FROM NVTX_EVENTS AS e {join} "
        f"WHERE e.eventType = {_DOMAIN_CREATE}"
    ):
        domains[(_pid(gtid), dom_id)] = text
    # Without the nvtx package the runtime pushes through torch.cuda.nvtx, whose ranges live
    # in the default domain (id 0): read that one when no process created ``domain``.
    default = domain not in domains.values()
    rows = []
    for start, end, gtid, dom_id, text in db.execute(
        f"SELECT e.start, e.end, e.globalTid, e.domainId, {name} FROM NVTX_EVENTS AS e {join} "
        f"WHERE e.eventType IN {_PUSHPOP} AND e.end IS NOT NULL"
    ):
        mine = not dom_id if default else domains.get((_pid(gtid), dom_id)) == domain
        if mine and text is not None:
            rows.append((int(start), int(end), int(gtid), str(text)))
    if default and not any(kind_of(text) is Kind.STEP for *_, text in rows):
        found = sorted({d for d in domains.values() if d})
        raise ValueError(
            f"{path}: no NVTX domain {domain!r} (domains found: {found or 'none'}) and no "
            "graphpipe ranges in the default domain; was the run traced with --trace=nvtx and "
            "CUDA present (the runtime emits NVTX only then)?"
        )
    return rows


def _project(
    db: sqlite3.Connection, rows: list[tuple[int, int, int, str]], path: Path
) -> list[tuple[int, int, int, str]]:
    """Each range moved onto the GPU: from the first start to the last end of the GPU work
    launched by the CUDA calls its thread made inside it; ranges that launched none drop."""
    tables = _tables(db)
    gpu = [t for t in _GPU_TABLES if t in tables]
    if "CUPTI_ACTIVITY_KIND_RUNTIME" not in tables or not gpu:
        raise ValueError(
            f"{path} holds no CUDA trace (CUPTI_ACTIVITY_KIND_RUNTIME and kernel tables): "
            "the GPU clock needs --trace=cuda; use the host clock"
        )
    spans: dict[tuple[int, int], list[int]] = {}
    for table in gpu:
        for start, end, gpid, corr in db.execute(
            f"SELECT start, end, globalPid, correlationId FROM {table}"
        ):
            key = (_pid(gpid), corr)
            span = spans.setdefault(key, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
    calls: dict[int, list[tuple[int, int]]] = defaultdict(list)  # globalTid -> (start, corr)
    for start, gtid, corr in db.execute(
        "SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"
    ):
        calls[gtid].append((start, corr))
    for lst in calls.values():
        lst.sort()
    out = []
    for start, end, gtid, name in rows:
        lst = calls.get(gtid, [])
        lo = bisect.bisect_left(lst, (start, -1))
        hi = bisect.bisect_right(lst, (end, float("inf")))
        found = [spans[k] for k in ((_pid(gtid), c) for _, c in lst[lo:hi]) if k in spans]
        if found:
            out.append((min(s for s, _ in found), max(e for _, e in found), gtid, name))
    return out


def has_cuda_trace(path: str | Path) -> bool:
    """Whether the export holds CUDA API calls and the GPU work they launched (what the GPU
    clock needs)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"nsys export {path}: no such file")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = _tables(db)
            filled = {
                t
                for t in ("CUPTI_ACTIVITY_KIND_RUNTIME", *_GPU_TABLES)
                if t in tables and db.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone()
            }
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{path}: not a readable nsys SQLite export ({e})") from None
    return "CUPTI_ACTIVITY_KIND_RUNTIME" in filled and any(t in filled for t in _GPU_TABLES)


def load_nsys(
    path: str | Path, clock: str = "host", domain: str = DOMAIN
) -> dict[int, list[Range]]:
    """The ranges of ``domain`` in an nsys SQLite export, per process id (``Range.rank`` is
    the process id until ``assign_ranks``), in seconds from the earliest of them.
    ``clock``: ``host`` (when the ranges were pushed and popped) or ``gpu`` (projected onto
    the GPU work launched inside them, see the module doc)."""
    path = Path(path)
    if clock not in ("host", "gpu"):
        raise ValueError(f"unknown clock {clock!r}: expected 'host' or 'gpu'")
    if not path.is_file():
        raise ValueError(f"nsys export {path}: no such file")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        if "NVTX_EVENTS" not in _tables(db):
            raise ValueError(
                f"{path} has no NVTX_EVENTS table: not an nsys SQLite export with NVTX "
                "(profile with --trace=nvtx, export with `nsys export --type sqlite`)"
            )
        rows = _nvtx_rows(db, domain, path)
        if clock == "gpu":
            rows = _project(db, rows, path)
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{path}: not a readable nsys SQLite export ({e})") from None
    finally:
        db.close()
    origin = min((start for start, _, _, _ in rows), default=0)
    out: dict[int, list[Range]] = defaultdict(list)
    for start, end, gtid, name in rows:
        pid = _pid(gtid)
        out[pid].append(
            Range(pid, name, (start - origin) / 1e9, (end - origin) / 1e9, gtid & 0xFFFFFF)
        )
    return dict(out)


def assign_ranks(
    by_process: Mapping[int, Sequence[Range]], stage_to_rank: Sequence[int]
) -> tuple[dict[int, list[Range]], list[str]]:
    """Pipeline ranks for the processes of an export: a process that ran actions of stage
    ``s`` is rank ``stage_to_rank[s]``; processes without actions (e.g. a whole-step graph)
    take the remaining ranks in process-id order. Returns the ranges by rank and notes."""
    notes: list[str] = []
    rank_of: dict[int, int] = {}
    for pid, ranges in sorted(by_process.items()):
        ranks = set()
        for r in ranges:
            action = action_of(r.name) if r.kind is Kind.ACTION else None
            for part in action.parts() if action is not None else ():
                if not 0 <= part.stage < len(stage_to_rank):
                    raise ValueError(
                        f"process {pid} ran {r.name!r}, but the schedule has stages "
                        f"0..{len(stage_to_rank) - 1}"
                    )
                ranks.add(stage_to_rank[part.stage])
        if len(ranks) > 1:
            raise ValueError(
                f"process {pid} ran actions of ranks {sorted(ranks)}: one process per rank expected"
            )
        if ranks:
            (rank,) = ranks
            if rank in rank_of.values():
                other = next(p for p, q in rank_of.items() if q == rank)
                raise ValueError(f"processes {other} and {pid} both ran the actions of rank {rank}")
            rank_of[pid] = rank
    free = [r for r in range(len(by_process)) if r not in rank_of.values()]
    unplaced = sorted(set(by_process) - set(rank_of))
    if unplaced:
        notes.append(
            f"processes {unplaced} ran no actions: ranks {free[: len(unplaced)]} assigned in "
            "process-id order"
        )
    rank_of.update(zip(unplaced, free, strict=False))
    out = {
        rank_of[pid]: [Range(rank_of[pid], r.name, r.start, r.end, r.thread) for r in ranges]
        for pid, ranges in by_process.items()
    }
    return out, notes
