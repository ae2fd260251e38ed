"""Synthetic traces for the profile tests: ranges of a run that took exactly the
simulator's times, and Nsight Systems SQLite exports written in nsys's schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.lower import lower
from graphpipe.schedule.simulate import simulate

# (name, start ms, end ms) per rank
Spans = dict[int, list[tuple[str, float, float]]]


def simulated_spans(n: int, m: int, costs: Any) -> tuple[Spans, float]:
    """What a run that took exactly the simulator's times would record (ms), and its
    makespan: one step range per rank covering the whole simulated step."""
    schedule, placement = SCHEDULES["dualpipev"](n, m)
    result = simulate(lower(schedule, placement, durations=costs.of), placement, costs)
    spans: Spans = {r: [("step", 0.0, result.makespan)] for r in range(n)}
    for rec in result.timeline:
        spans[rec.rank].append((rec.label, rec.start, rec.end))
    return spans, result.makespan


# The tables as `nsys export --type sqlite` creates them (Nsight Systems' SQLite export schema
# reference; the kernel table with the columns used here and a few more).
NSYS_SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS (
    start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
    category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER,
    textId INTEGER REFERENCES StringIds(id), domainId INTEGER, uint64Value INTEGER,
    int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER,
    floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData BLOB
);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (
    start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
    globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL REFERENCES StringIds(id),
    returnValue INTEGER NOT NULL, callchainId INTEGER
);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (
    start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
    contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER,
    globalPid INTEGER, demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL,
    graphNodeId INTEGER
);
"""
T0_NS = 1_700_000_000_000_000  # nsys timestamps are large integers of nanoseconds
VM_BITS = 1 << 56  # globalTid also packs a hardware / VM id above the pid


def _gtid(pid: int, tid: int) -> int:
    return VM_BITS | (pid << 24) | tid


class Export:
    """Writes NVTX ranges (and optionally the CUDA work they launch) in nsys's schema."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path)
        self.db.executescript(NSYS_SCHEMA)
        self.strings: dict[str, int] = {}
        self.corr = 0

    def string(self, text: str) -> int:
        if text not in self.strings:
            self.strings[text] = len(self.strings) + 1
            self.db.execute("INSERT INTO StringIds VALUES (?, ?)", (self.strings[text], text))
        return self.strings[text]

    def domain(self, pid: int, domain_id: int, name: str) -> None:
        self.db.execute(
            "INSERT INTO NVTX_EVENTS (start, eventType, text, globalTid, domainId) "
            "VALUES (?, 75, ?, ?, ?)",
            (T0_NS, name, _gtid(pid, pid), domain_id),
        )

    def push_pop(
        self, pid: int, domain_id: int, name: str, s_ms: float, e_ms: float | None, registered: bool
    ) -> None:
        text, text_id = (None, self.string(name)) if registered else (name, None)
        end = None if e_ms is None else T0_NS + round(e_ms * 1e6)
        self.db.execute(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, domainId) "
            "VALUES (?, ?, 59, ?, ?, ?, ?)",
            (T0_NS + round(s_ms * 1e6), end, text, _gtid(pid, pid), text_id, domain_id),
        )

    def launch(self, pid: int, call_ms: float, gpu: list[tuple[float, float]]) -> None:
        """A CUDA call at ``call_ms`` on the process's main thread, and the kernels it ran."""
        self.corr += 1
        at = T0_NS + round(call_ms * 1e6)
        self.db.execute(
            "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, ?, 0, NULL)",
            (at, at + 1000, _gtid(pid, pid), self.corr, self.string("cudaGraphLaunch_v10000")),
        )
        for s, e in gpu:
            self.db.execute(
                "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, ?, ?, ?, ?, NULL)",
                (
                    T0_NS + round(s * 1e6),
                    T0_NS + round(e * 1e6),
                    self.corr,
                    VM_BITS | (pid << 24),
                    self.string("k"),
                    self.string("k"),
                ),
            )

    def close(self) -> None:
        self.db.commit()
        self.db.close()


def nsys_export(path: Path, spans: Spans, pids: dict[int, int]) -> Path:
    """The ranks' ranges in process ``pids[rank]`` (graphpipe domain id 3), half of them as
    registered strings; plus ranges of another domain and an unclosed range, to be ignored."""
    ex = Export(path)
    for rank, rows in spans.items():
        pid = pids[rank]
        ex.domain(pid, 3, "graphpipe")
        ex.domain(pid, 4, "other")
        for i, (name, s, e) in enumerate(rows):
            ex.push_pop(pid, 3, name, s, e, registered=i % 2 == 1)
        ex.push_pop(pid, 4, "step", 0.0, 99.0, registered=False)  # not graphpipe's
        ex.push_pop(pid, 3, "0F0", 1.0, None, registered=False)  # never closed
    ex.close()
    return path
