"""``graphpipe bench`` end to end, tiny: every mode runs, the JSON is complete and consistent.

No timing assertions: only that each mode produced positive step times and that the derived
figures (ratios to graphpipe eager, tokens/s) agree with the step times they come from.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphpipe import bench
from graphpipe.bench.modes import torch_schedule_unavailable

pytestmark = pytest.mark.distributed

# Before torch 2.12 torch's ScheduleDualPipeV cannot start on gloo (a send from a rank to
# itself): bench reports it skipped with this reason, and the comparisons run without it.
TORCH_SKIPPED = torch_schedule_unavailable("gloo")

STEPS = 2
TINY = [
    "--ranks", "2", "--steps", str(STEPS), "--warmup", "1", "--hidden", "4",
    "--microbatches", "4", "--mb-rows", "1", "--regime", "both",
]  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``graphpipe bench ARGV`` with bench's own parser (what cli.py registers)."""
    parser = argparse.ArgumentParser(prog="graphpipe")
    sub = parser.add_subparsers(dest="command")
    bench.add_parser(sub)
    return parser.parse_args(["bench", *argv])


def _expected_modes() -> set[str]:
    torch_mode = {bench.MODE_TORCH} if TORCH_SKIPPED is None else set()
    return {bench.MODE_EAGER, bench.MODE_REPLAY, *torch_mode}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    js, svg = out / "bench.json", out / "timeline.svg"
    args = _parse([*TINY, "--json", str(js), "--plot", str(svg)])
    assert args.func(args) == 0
    return json.loads(js.read_text()), svg, bench.format_report(json.loads(js.read_text()))


def test_every_mode_ran_or_was_skipped_with_a_reason(result: tuple[dict, Path, str]) -> None:
    data, _, _ = result
    assert set(data["regimes"]) == {"overhead", "compute"}  # sweep needs CUDA
    for name, reg in data["regimes"].items():
        ran, skipped = set(reg["modes"]), set(reg["skipped"])
        assert _expected_modes() <= ran, name
        assert ran | skipped == set(bench.MODES), name
        assert not ran & skipped, name
        assert all(isinstance(why, str) and why for why in reg["skipped"].values())
        if TORCH_SKIPPED is not None:
            assert reg["skipped"][bench.MODE_TORCH] == TORCH_SKIPPED, name


@pytest.mark.parametrize(
    ("backend", "version", "runs"),
    [
        ("gloo", "2.11.0+cu130", False),  # the lent GPU machine's torch
        ("gloo", "2.11.0", False),
        ("gloo", "2.12.0", True),
        ("gloo", "2.13.0+cpu", True),
        ("nccl", "2.11.0+cu130", True),
    ],
)
def test_torch_schedule_on_gloo_needs_torch_2_12(backend: str, version: str, runs: bool) -> None:
    why = torch_schedule_unavailable(backend, version)
    assert (why is None) == runs
    if not runs:
        assert why.startswith("torch < 2.12 cannot run ScheduleDualPipeV on gloo")
        assert version in why


def test_step_times_are_positive_and_ratios_consistent(result: tuple[dict, Path, str]) -> None:
    data, _, _ = result
    for reg in data["regimes"].values():
        eager = reg["modes"][bench.MODE_EAGER]["median_s"]
        for name, m in reg["modes"].items():
            ts = m["step_times_s"]
            assert len(ts) == STEPS, name
            assert all(t > 0 for t in ts), name
            assert m["min_s"] <= m["q1_s"] <= m["median_s"] <= m["q3_s"] <= m["max_s"]
            assert math.isclose(m["ratio_to_eager"], m["median_s"] / eager, rel_tol=1e-9)
            assert math.isclose(
                m["tokens_per_s"] * m["median_s"], reg["tokens_per_step"], rel_tol=1e-9
            )
            assert len(m["peak_memory_per_rank"]) == data["config"]["ranks"]
            for r in m["peak_memory_per_rank"]:
                assert r.get("peak_rss_bytes", r.get("peak_bytes", 0)) > 0, name
                assert r["step_peak_bytes"] > 0, name
                assert r["params_and_grads_bytes"] > 0, name
            assert m["paired_ratio_to_eager"] > 0, name
        assert reg["modes"][bench.MODE_EAGER]["ratio_to_eager"] == 1.0
        assert reg["modes"][bench.MODE_EAGER]["paired_ratio_to_eager"] == 1.0


def test_all_modes_compute_the_same_loss_and_gradients(result: tuple[dict, Path, str]) -> None:
    data, _, _ = result
    for reg in data["regimes"].values():
        check = reg["check"]
        assert check["reference"] == bench.MODE_EAGER
        for name in reg["modes"]:
            if name == bench.MODE_EAGER:
                continue
            assert check[name]["abs_diff"] <= 1e-5 * abs(check["reference_loss"]), name
            assert check[name]["max_rel_grad_diff"] <= 1e-4, name


def test_host_overhead_and_simulation_figures(result: tuple[dict, Path, str]) -> None:
    data, _, _ = result
    host = data["host_overhead"]
    assert host["world"]["compute_cells_per_rank"] > 0
    assert all(v > 0 for v in host["world"]["per_action_s"].values())
    one = host["one_rank"]
    assert all(t > 0 for t in one["median_s"].values())
    assert math.isfinite(one["executor_overhead_per_action_s"])
    if TORCH_SKIPPED is None:
        assert math.isfinite(one["torch_overhead_per_action_s"])
    else:
        assert one["torch_overhead_per_action_s"] is None
        assert one["skipped"] == {bench.MODE_TORCH: TORCH_SKIPPED}
    for reg in data["regimes"].values():
        sim = reg["simulation"]
        assert all(sim["costs_s"][k] > 0 for k in "FBIW")
        for pred in sim["predictions"].values():
            assert pred["makespan_s"] > 0
            assert 0 <= pred["bubble_fraction"] < 1
        rec = sim["measured"]["recorded_step"]
        assert rec["makespan_s"] > 0
        slow = sim["measured"]["in_step_over_alone_per_rank"]
        assert len(slow) == data["config"]["ranks"] and all(x > 0 for x in slow)
        assert "with_p2p_mean_and_in_step_costs" in sim["predictions"]
        labels = {r["label"] for r in reg["timeline"]}
        assert "step" in labels and any(lbl.endswith("F0") for lbl in labels)


def test_report_and_plot(result: tuple[dict, Path, str]) -> None:
    data, svg, report = result
    for reg in data["regimes"].values():
        for name in reg["modes"]:
            assert name in report
    if TORCH_SKIPPED is not None:
        assert f"{bench.MODE_TORCH:<24} skipped: {TORCH_SKIPPED}" in report
    text = svg.read_text()
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>")
    assert "measured" in text and "simulated" in text and "rank 1" in text
    # one time axis per regime, shared by its measured and simulated timelines
    assert text.count(">time (ms)</text>") == len(data["regimes"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ranks", "2", "--microbatches", "3"], "--microbatches must be >= 2 * --ranks = 4"),
        (["--plot", "x.png"], "--plot writes SVG; use a .svg path, not 'x.png'"),
    ],
)
def test_bad_arguments_are_one_line_with_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphpipe bench: error: ") and err.count("\n") == 1
    assert message in err


def test_whole_number_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parse(["--warmup", "0"]).warmup == 0
    for argv, message in [
        (["--warmup", "-1"], "must be >= 0, got -1"),
        (["--steps", "0"], "must be >= 1, got 0"),
        (["--ranks", "two"], "expected a whole number, got 'two'"),
    ]:
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "graphpipe.bench", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("usage: graphpipe bench")


def test_the_help_of_all_names_every_regime_it_leaves_out() -> None:
    from graphpipe.bench.options import REGIMES

    parser = argparse.ArgumentParser(prog="graphpipe")
    sub = parser.add_subparsers(dest="command")
    regime = next(a for a in bench.add_parser(sub)._actions if a.dest == "regime")
    said = re.search(r"all: [^;]*every regime but ([^;]*);", " ".join(regime.help.split()))
    assert said is not None, regime.help
    named = set(re.findall(r"\w+", said[1])) - {"and"}
    # "all" runs REGIMES (regimes.workloads); "both" and "all" are themselves groups
    assert named == set(regime.choices) - set(REGIMES) - {"both", "all"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="only without CUDA")
def test_cuda_without_a_gpu_is_skipped_with_a_note(tmp_path: Path) -> None:
    js = tmp_path / "cuda.json"
    args = _parse(["--device", "cuda", "--regime", "sweep", "--json", str(js)])
    assert args.func(args) == 0
    assert "CUDA is not available" in json.loads(js.read_text())["skipped"]


def test_bench_world_runs_steps_on_every_rank() -> None:
    w = bench.Workload("overhead", "mlp", 4, 4, 1)
    with bench.BenchWorld(2) as world:
        names, skipped = world.setup(w)
        assert _expected_modes() <= set(names)
        assert set(names) | set(skipped) == set(bench.MODES)
        for name in names:
            assert world.step(name) > 0


def test_synthetic_regime_measures_each_schedule_against_its_dataflow_ideal(tmp_path) -> None:
    js = tmp_path / "synthetic.json"
    argv = ["--regime", "synthetic", "--ranks", "2", "--steps", "2", "--warmup", "1"]
    argv += ["--costs", "F=2,B=4,I=2,W=2", "--microbatches", "4", "--json", str(js)]
    args = _parse(argv)
    assert args.func(args) == 0
    rows = json.loads(js.read_text())["synthetic"]
    assert [r["schedule"] for r in rows] == ["1f1b", "dualpipev", "zbv"]
    for r in rows:
        assert r["ranks"] == 2 and r["microbatches"] == 4
        assert len(r["step_times_s"]) == 2 and all(t > 0 for t in r["step_times_s"])
        assert r["measured_over_ideal"] == pytest.approx(r["measured_step_s"] / r["ideal_step_s"])
        # the measured gloo latency lengthens the ideal, never shortens it
        assert r["p2p_latency_s"] > 0 and r["ideal_with_p2p_step_s"] > r["ideal_step_s"]
        assert r["measured_over_ideal_with_p2p"] == pytest.approx(
            r["measured_step_s"] / r["ideal_with_p2p_step_s"]
        )
    # 1F1B's dataflow makespan is the textbook (M + N - 1)(F + B): (4 + 1) * 6 ms
    assert rows[0]["ideal_step_s"] == pytest.approx(0.030)
    # every sleep really happens: no schedule beats its ideal
    assert all(r["measured_step_s"] >= r["ideal_step_s"] for r in rows)


def test_synthetic_regime_rejects_bad_costs(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(["--regime", "synthetic", "--costs", "F=fast"])
    assert info.value.code == 2
    assert "bad cost 'F=fast'" in capsys.readouterr().err


def test_in_step_slowdown_sets_each_ranks_actions_against_their_costs_alone() -> None:
    from graphpipe.bench.costs import in_step_slowdown

    costs = [{"F": 2.0, "B": 4.0, "I": 2.0, "W": 2.0}, {"F": 2.0, "B": 4.0, "I": 2.0, "W": 2.0}]
    # mean per stage over 4 stages: F=1, B=2, I=1, W=1
    records = [
        {"rank": 0, "label": "step", "start": 0.0, "end": 10.0},
        {"rank": 0, "label": "0F0", "start": 0.0, "end": 1.5},  # 1.5 for 1
        {"rank": 0, "label": "(0F1;3B0)OVERLAP_F_B", "start": 2.0, "end": 6.5},  # 4.5 for 3
        {"rank": 0, "label": "wait 3RECV_F0", "start": 6.5, "end": 9.0},  # not compute
        {"rank": 1, "label": "1I0", "start": 0.0, "end": 1.0},  # 1 for 1
        {"rank": 1, "label": "1W0", "start": 1.0, "end": 2.0},  # 1 for 1
    ]
    assert in_step_slowdown(records, 2, costs) == [6.0 / 4.0, 1.0]
    assert in_step_slowdown(records[:1], 2, costs) == [0.0, 0.0]
