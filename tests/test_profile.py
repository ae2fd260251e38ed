"""The profile analysis on synthetic traces: torch.profiler Chrome traces and an Nsight
Systems SQLite export (built here in nsys's schema), no processes."""

from __future__ import annotations

import json
import sqlite3
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from graphpipe.profile import Range, analyse, assign_ranks, load_chrome_traces, load_nsys
from graphpipe.profile.nsys import has_cuda_trace
from graphpipe.profile.report import format_table, timeline_svg, write_outputs
from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.simulate import Costs
from tests.profile_traces import Export, Spans, nsys_export, simulated_spans

MS = 1e-3
SVG = "{http://www.w3.org/2000/svg}"


def _ranges(spans: Spans) -> dict[int, list[Range]]:
    return {r: [Range(r, n, s * MS, e * MS) for n, s, e in rows] for r, rows in spans.items()}


def _chrome(
    tmp_path: Path, spans: Spans, base_ns: dict[int, int] | None = None, cat="user_annotation"
):
    """One Chrome trace per rank as torch.profiler writes it (ts and dur in us from
    baseTimeNanoseconds), with cpu_op noise; returns {rank: path}."""
    paths = {}
    for rank, rows in spans.items():
        base = (base_ns or {}).get(rank, 0)
        events = [
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::mm",
                "pid": 7,
                "tid": 7,
                "ts": 5.0,
                "dur": 1.0,
            }
        ]
        for name, s, e in rows:
            ts = s * 1e3 - base / 1e3  # the same instant, counted from this trace's base
            events.append(
                {
                    "ph": "X",
                    "cat": cat,
                    "name": name,
                    "pid": 7,
                    "tid": 7,
                    "ts": ts,
                    "dur": (e - s) * 1e3,
                }
            )
        path = tmp_path / f"trace_rank{rank}.json"
        path.write_text(json.dumps({"baseTimeNanoseconds": base, "traceEvents": events}))
        paths[rank] = path
    return paths


# --------------------------------------------------------------------------------------------
# the per-step figures


def test_busy_plus_idle_is_the_step_and_waits_are_counted_once() -> None:
    spans = {
        0: [
            ("step", 0.0, 10.0),
            ("0F0", 1.0, 3.0),
            ("(0F1;3B0)OVERLAP_F_B", 4.0, 7.0),
            ("0F0", 2.0, 2.5),  # a second thread inside the same busy time: counted once
            ("wait 1RECV_F3", 3.0, 4.5),  # 1 ms of it while idle, 0.5 ms inside the pair
            ("wait 1RECV_F3 6RECV_B2", 3.5, 4.0),  # nested in the first wait: once
            ("wait sends", 8.0, 9.0),
            ("gloo:recv", 0.5, 9.5),  # other ranges: apart
        ]
    }
    rep = analyse(_ranges(spans)).report
    (r,) = rep["per_rank"]
    assert r["step_s"] == pytest.approx(10 * MS)
    assert r["busy_s"] == pytest.approx(5 * MS)
    assert r["busy_s"] + r["idle_s"] == pytest.approx(r["step_s"], rel=1e-12)
    assert r["bubble_fraction"] == pytest.approx(0.5)
    assert r["comm_wait_s"] == pytest.approx(2.5 * MS)
    assert r["comm_wait_outside_actions_s"] == pytest.approx(2.0 * MS)
    assert r["actions"]["(0F1;3B0)OVERLAP_F_B"] == pytest.approx(3 * MS)
    assert r["actions"]["0F0"] == pytest.approx(2.5 * MS)  # both ranges of the name
    assert r["other_ranges_s"] == {"gloo:recv": pytest.approx(9 * MS)}
    assert r["visible"] == "actions"
    assert rep["comm_wait_ranges_found"] is True
    assert not any("no 'wait" in n for n in rep["notes"])


def test_ranges_are_clipped_to_their_step_and_figures_are_means_over_steps() -> None:
    spans = {
        0: [
            ("step", 0.0, 10.0),
            ("0F0", 2.0, 6.0),
            ("step", 20.0, 24.0),
            ("0F0", 19.0, 21.0),  # starts before the step: 1 ms inside
            ("wait 1RECV_B0", 23.0, 30.0),  # ends after it: 1 ms inside
        ]
    }
    rep = analyse(_ranges(spans)).report
    (r,) = rep["per_rank"]
    assert rep["steps_analysed"] == 2
    assert r["step_s"] == pytest.approx(7 * MS)  # (10 + 4) / 2
    assert r["busy_s"] == pytest.approx(2.5 * MS)  # (4 + 1) / 2
    assert r["comm_wait_s"] == pytest.approx(0.5 * MS)
    assert r["busy_s"] + r["idle_s"] == pytest.approx(r["step_s"], rel=1e-12)
    last = analyse(_ranges(spans), steps=1).report["per_rank"][0]
    assert last["step_s"] == pytest.approx(4 * MS) and last["busy_s"] == pytest.approx(1 * MS)


def test_idle_is_step_minus_busy_for_awkward_floats() -> None:
    """busy + idle = step up to rounding (an exact float sum is not always representable)."""
    for step, busy_end in [(0.3, 0.1), (1 / 3, 1 / 7), (0.7000000000000001, 0.6)]:
        spans = {0: [("step", 0.0, step), ("0F0", 0.0, busy_end)]}
        r = analyse(_ranges(spans)).report["per_rank"][0]
        assert r["idle_s"] == r["step_s"] - r["busy_s"] and r["idle_s"] > 0
        assert r["busy_s"] == pytest.approx(busy_end * MS) and r["step_s"] == pytest.approx(
            step * MS
        )


def test_no_wait_ranges_report_zero_and_say_so() -> None:
    rep = analyse(_ranges({0: [("step", 0.0, 2.0), ("0F0", 0.0, 1.0)]})).report
    assert rep["per_rank"][0]["comm_wait_s"] == 0
    assert rep["comm_wait_ranges_found"] is False
    assert any("no 'wait ...' ranges found" in n for n in rep["notes"])


def test_capture_step_shows_only_the_whole_step_and_no_fake_figures() -> None:
    spans = {r: [("step", 0.0, 5.0), ("step", 6.0, 11.0), ("loss", 10.0, 10.5)] for r in (0, 1)}
    analysis = analyse(_ranges(spans), microbatches=4)
    rep = analysis.report
    for r in rep["per_rank"]:
        assert r["visible"] == "step"
        assert r["step_s"] == pytest.approx(5 * MS)
        assert r["busy_s"] is None and r["idle_s"] is None and r["bubble_fraction"] is None
        assert r["actions"] == {}
    assert any("only the whole step is visible" in n for n in rep["notes"])
    assert rep["simulated"]["available"] is False
    assert "only the whole step is visible" in rep["simulated"]["note"]
    assert "measured" in timeline_svg(analysis)  # the picture still shows the steps
    assert "only the whole step" in rep["simulated"]["note"]


def test_a_rank_without_step_ranges_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="rank 1 has no 'step' range"):
        analyse(_ranges({0: [("step", 0.0, 1.0)], 1: [("0F0", 0.0, 1.0)]}))
    with pytest.raises(ValueError, match=r"ranks must be 0\.\.1, got \[0, 2\]"):
        analyse(_ranges({0: [("step", 0.0, 1.0)], 2: [("step", 0.0, 1.0)]}))


# --------------------------------------------------------------------------------------------
# the simulation next to the measurement


def test_a_run_that_took_the_simulated_times_is_predicted_exactly() -> None:
    costs = Costs(F=1.0, B=2.0, I=1.2, W=0.7, FB=2.6)
    spans, makespan = simulated_spans(2, 6, costs)
    rep = analyse(_ranges(spans)).report
    sim = rep["simulated"]
    assert rep["ranks"] == 2 and rep["microbatches"] == 6  # from the action names
    assert sim["available"] is True
    assert sim["costs_s"] == pytest.approx(
        {"F": 1 * MS, "B": 2 * MS, "I": 1.2 * MS, "W": 0.7 * MS, "FB": 2.6 * MS}
    )
    assert sim["makespan_s"] == pytest.approx(makespan * MS)
    assert sim["measured_step_over_simulated"] == pytest.approx(1.0)
    for measured, simulated in zip(rep["per_rank"], sim["per_rank"], strict=True):
        assert measured["busy_s"] == pytest.approx(simulated["busy_s"])
        assert measured["bubble_fraction"] == pytest.approx(simulated["bubble_fraction"])
    assert not any("differ from" in n for n in rep["notes"])


def test_costs_are_per_stage_so_a_heavy_stage_is_simulated_heavy() -> None:
    # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2: make stage 1 three times slower
    base = Costs(F=1.0, B=2.0, I=1.0, W=1.0)

    class Heavy:
        p2p = 0.0

        def of(self, action):
            if action is None:
                return 0.0
            return sum((3.0 if p.stage == 1 else 1.0) * base.of(p) for p in action.parts())

    costs = Heavy()
    spans, makespan = simulated_spans(2, 4, costs)
    sim = analyse(_ranges(spans)).report["simulated"]
    assert sim["stage_costs_s"]["1"]["F"] == pytest.approx(3 * MS)
    assert sim["stage_costs_s"]["2"]["F"] == pytest.approx(1 * MS)
    assert sim["makespan_s"] == pytest.approx(makespan * MS)


def test_actions_that_do_not_match_the_schedule_are_noted() -> None:
    spans = {0: [("step", 0.0, 9.0), ("0F0", 0.0, 1.0), ("5F0", 1.0, 2.0)]}
    rep = analyse(_ranges(spans), microbatches=2).report
    assert any("actions differ from dualpipev N=1 M=2" in n and "'5F0'" in n for n in rep["notes"])


# --------------------------------------------------------------------------------------------
# torch.profiler Chrome traces


def test_chrome_traces_of_two_processes_share_one_clock(tmp_path: Path) -> None:
    spans = {
        0: [("step", 100.0, 110.0), ("0F0", 101.0, 103.0)],
        1: [("step", 100.5, 110.0), ("1F0", 103.5, 105.0), ("wait 0RECV_F0", 100.5, 103.5)],
    }
    # rank 1's trace counts from a base 2 s later than rank 0's
    paths = _chrome(tmp_path, spans, base_ns={0: 0, 1: 2_000_000_000})
    ranges = load_chrome_traces(paths)
    assert {r.name for r in ranges[0]} == {"step", "0F0"}  # cpu_op events are not ranges
    step0 = next(r for r in ranges[0] if r.name == "step")
    step1 = next(r for r in ranges[1] if r.name == "step")
    assert step0.start == pytest.approx(0.0)  # seconds from the earliest range
    assert step1.start - step0.start == pytest.approx(0.5 * MS)
    rep = analyse(ranges).report
    assert rep["per_rank"][1]["comm_wait_s"] == pytest.approx(3 * MS)
    assert rep["per_rank"][1]["busy_s"] == pytest.approx(1.5 * MS)


def test_the_gpu_clock_reads_the_gpu_annotations(tmp_path: Path) -> None:
    paths = _chrome(tmp_path, {0: [("step", 0.0, 4.0), ("0F0", 1.0, 2.0)]})
    (tmp_path / "gpu").mkdir()
    gpu = _chrome(tmp_path / "gpu", {0: [("step", 0.5, 3.0)]}, cat="gpu_user_annotation")
    assert [r.name for r in load_chrome_traces(paths, "gpu")[0]] == []
    (only,) = load_chrome_traces(gpu, "gpu")[0]
    assert only.name == "step" and only.seconds == pytest.approx(2.5 * MS)
    with pytest.raises(ValueError, match="unknown clock 'wall'"):
        load_chrome_traces(paths, "wall")


def test_a_bad_trace_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "trace_rank0.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"trace_rank0\.json is not JSON"):
        load_chrome_traces({0: bad})
    with pytest.raises(ValueError, match="no such file"):
        load_chrome_traces({0: tmp_path / "missing.json"})


# --------------------------------------------------------------------------------------------
# Nsight Systems SQLite export


def test_an_nsys_export_gives_the_same_report_as_the_chrome_traces(tmp_path: Path) -> None:
    costs = Costs(F=1.0, B=2.0, I=1.0, W=0.5, FB=2.5)
    spans, _ = simulated_spans(2, 4, costs)
    spans[1].append(("wait 0RECV_F0", 0.0, 1.0))
    # rank 1 in the lower process id: ranks come from the actions, not the pid order
    db = nsys_export(tmp_path / "run.sqlite", spans, pids={0: 4242, 1: 4100})
    by_process = load_nsys(db)
    assert set(by_process) == {4242, 4100}
    names = {r.name for r in by_process[4242]}
    assert "step" in names and "0F0" in names
    assert len([r for r in by_process[4242] if r.name == "step"]) == 1  # other domain: out
    placement = SCHEDULES["dualpipev"].placement(2)
    by_rank, notes = assign_ranks(by_process, placement.stage_to_rank)
    assert notes == []
    assert {r.name for r in by_rank[0]} == names
    from_nsys = analyse(by_rank).report
    from_chrome = analyse(load_chrome_traces(_chrome(tmp_path, spans))).report
    for a, b in zip(from_nsys["per_rank"], from_chrome["per_rank"], strict=True):
        for key in ("step_s", "busy_s", "idle_s", "bubble_fraction", "comm_wait_s"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), key
        assert a["busy_s"] + a["idle_s"] == pytest.approx(a["step_s"], rel=1e-12)
        assert a["actions"] == pytest.approx(b["actions"], abs=1e-9)
    assert from_nsys["per_rank"][1]["comm_wait_s"] == pytest.approx(1 * MS)
    assert from_nsys["simulated"]["makespan_s"] == pytest.approx(
        from_chrome["simulated"]["makespan_s"]
    )


def test_nsys_processes_without_actions_take_the_free_ranks_in_pid_order(tmp_path: Path) -> None:
    spans = {0: [("step", 0.0, 5.0)], 1: [("step", 0.0, 5.0)]}
    db = nsys_export(tmp_path / "step.sqlite", spans, pids={0: 900, 1: 800})
    by_process = load_nsys(db)
    by_rank, notes = assign_ranks(by_process, SCHEDULES["dualpipev"].placement(2).stage_to_rank)
    assert notes and "ran no actions" in notes[0]
    rep = analyse(by_rank).report
    assert all(r["visible"] == "step" for r in rep["per_rank"])


def test_the_nsys_gpu_clock_projects_ranges_onto_the_work_they_launched(tmp_path: Path) -> None:
    ex = Export(tmp_path / "gpu.sqlite")
    ex.domain(10, 1, "graphpipe")
    ex.push_pop(10, 1, "step", 0.0, 1.0, registered=False)  # the host returns at once
    ex.push_pop(10, 1, "0F0", 0.1, 0.2, registered=True)
    ex.push_pop(10, 1, "0B0", 0.3, 0.4, registered=False)
    ex.push_pop(10, 1, "loss", 0.5, 0.6, registered=False)  # launched nothing: dropped
    ex.launch(10, 0.15, [(2.0, 3.0), (3.0, 5.0)])  # a graph of two kernels
    ex.launch(10, 0.35, [(6.0, 9.0)])
    ex.close()
    assert has_cuda_trace(tmp_path / "gpu.sqlite")
    assert not has_cuda_trace(nsys_export(tmp_path / "cpu.sqlite", {0: []}, pids={0: 1}))
    host = {r.name: r for r in load_nsys(tmp_path / "gpu.sqlite")[10]}
    assert host["0F0"].seconds == pytest.approx(0.1 * MS)
    gpu = {r.name: r for r in load_nsys(tmp_path / "gpu.sqlite", clock="gpu")[10]}
    assert set(gpu) == {"step", "0F0", "0B0"}
    assert gpu["0F0"].seconds == pytest.approx(3 * MS)  # 2 .. 5 ms
    assert gpu["step"].seconds == pytest.approx(7 * MS)  # 2 .. 9 ms
    r = analyse({0: list(gpu.values())}).report["per_rank"][0]
    assert r["busy_s"] == pytest.approx(6 * MS) and r["idle_s"] == pytest.approx(1 * MS)


def test_nsys_errors_name_the_file_and_what_is_missing(tmp_path: Path) -> None:
    ex = Export(tmp_path / "nodomain.sqlite")
    ex.domain(1, 1, "somebody_else")
    ex.close()
    with pytest.raises(
        ValueError,
        match=r"no NVTX domain .graphpipe. \(domains found: \[.somebody_else.\]\) and no",
    ):
        load_nsys(tmp_path / "nodomain.sqlite")
    plain = tmp_path / "plain.sqlite"
    sqlite3.connect(plain).execute("CREATE TABLE x (a)").connection.commit()
    with pytest.raises(ValueError, match=r"plain\.sqlite has no NVTX_EVENTS table"):
        load_nsys(plain)
    text = tmp_path / "notdb.sqlite"
    text.write_text("hello " * 200)
    with pytest.raises(ValueError, match=r"notdb\.sqlite: not a readable nsys SQLite export"):
        load_nsys(text)
    with pytest.raises(ValueError, match="needs --trace=cuda"):
        ex = Export(tmp_path / "nocuda.sqlite")
        ex.db.execute("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")
        ex.domain(1, 1, "graphpipe")
        ex.close()
        load_nsys(tmp_path / "nocuda.sqlite", clock="gpu")


# --------------------------------------------------------------------------------------------
# outputs


def test_report_table_and_timeline(tmp_path: Path) -> None:
    spans, _ = simulated_spans(2, 4, Costs())
    spans[0].append(("wait 1RECV_B0", 0.5, 1.5))
    analysis = analyse(_ranges(spans), source={"kind": "test", "clock": "host"})
    report_path, svg_path = write_outputs(analysis, tmp_path / "out")
    report = json.loads(report_path.read_text())
    assert set(report) >= {"ranks", "microbatches", "per_rank", "simulated"}
    for r in report["per_rank"]:
        assert set(r) >= {
            "rank",
            "step_s",
            "busy_s",
            "idle_s",
            "bubble_fraction",
            "comm_wait_s",
            "actions",
        }
        assert r["busy_s"] + r["idle_s"] == pytest.approx(
            r["step_s"], rel=1e-12
        )  # survives the JSON round trip
    table = format_table(report)
    lines = table.splitlines()
    assert lines[1].split()[:5] == ["rank", "step", "busy", "idle", "bubble"]
    assert lines[2].split()[0] == "0" and lines[3].split()[0] == "1"
    assert "makespan" in table and "stage  3 median ms" in table
    root = ET.fromstring(svg_path.read_text())
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert any(t.startswith("measured") for t in texts)
    assert any(t.startswith("simulated") for t in texts)
    assert "time (ms)" in texts and "P2P wait" in texts


def test_without_the_nvtx_package_the_ranges_are_read_from_the_default_domain(tmp_path: Path):
    # torch.cuda.nvtx (the runtime's fallback) pushes into the default domain, id 0
    ex = Export(tmp_path / "default.sqlite")
    ex.domain(7, 4, "other")
    for name, s, e in [("step", 0.0, 4.0), ("0F0", 0.5, 1.5), ("wait 1RECV_B0", 1.5, 2.0)]:
        ex.push_pop(7, 0, name, s, e, registered=False)
    ex.push_pop(7, 4, "0F1", 2.0, 3.0, registered=False)  # another domain: out
    ex.close()
    names = [r.name for r in load_nsys(tmp_path / "default.sqlite")[7]]
    assert sorted(names) == ["0F0", "step", "wait 1RECV_B0"]
