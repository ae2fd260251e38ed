"""Writing the answer: ``report.json``, ``timeline.svg`` (measured per rank above simulated,
one time axis, P2P waits drawn) and the table printed on the terminal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graphpipe.schedule.render import render_timelines

from .analysis import Analysis

__all__ = ["format_table", "timeline_svg", "write_outputs"]


def _ms(x: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if x is None else f"{x * 1e3:>{width}.3f}"


def _pct(x: float | None, width: int = 7) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.1%}"


def format_table(report: dict[str, Any]) -> str:
    """The report as the table ``graphpipe profile`` prints."""
    src = report["source"]
    where = src.get("kind", "ranges")
    clock = f", {src['clock']} clock" if "clock" in src else ""
    lines = [
        f"graphpipe profile: {report['ranks']} ranks, {report['microbatches']} micro-batches "
        f"({report['schedule']}); {report['steps_analysed']} step(s) from {where}{clock}; "
        "figures: mean per step, ms",
    ]
    sim = report["simulated"]
    sim_rows = {r["rank"]: r for r in sim.get("per_rank", [])}
    head = (
        f"{'rank':>4} {'step':>9} {'busy':>9} {'idle':>9} {'bubble':>7} {'comm wait':>9} "
        f"{'(idle)':>9} | {'sim busy':>9} {'sim idle':>9} {'sim bub.':>8}"
    )
    lines.append(head)
    for r in report["per_rank"]:
        s = sim_rows.get(r["rank"], {})
        lines.append(
            f"{r['rank']:>4} {_ms(r['step_s'])} {_ms(r['busy_s'])} {_ms(r['idle_s'])} "
            f"{_pct(r['bubble_fraction'])} {_ms(r['comm_wait_s'])} "
            f"{_ms(r['comm_wait_outside_actions_s'])} | {_ms(s.get('busy_s'))} "
            f"{_ms(s.get('idle_s'))} {_pct(s.get('bubble_fraction'), 8)}"
        )
    lines.append("comm wait: time in 'wait ...' ranges; (idle): the part of it outside actions")
    if sim["available"]:
        ratio = sim["measured_step_over_simulated"]
        lines.append(
            f"simulated {sim['schedule']} with the measured median costs per stage, no P2P "
            f"cost: makespan {sim['makespan_s'] * 1e3:.3f} ms, bubble "
            f"{sim['bubble_fraction']:.1%}; slowest measured step / simulated "
            f"{'-' if ratio is None else f'{ratio:.2f}x'}"
        )
        for stage, c in sim["stage_costs_s"].items():
            costs = " ".join(f"{op}={sec * 1e3:.3f}" for op, sec in c.items())
            lines.append(f"  stage {stage:>2} median ms: {costs}")
        if sim["overlap_pair_costs_s"]:
            pairs = " ".join(
                f"({k})={sec * 1e3:.3f}" for k, sec in sim["overlap_pair_costs_s"].items()
            )
            lines.append(f"  overlapped F&B (F stage, B stage) median ms: {pairs}")
    else:
        lines.append(f"simulated: not available: {sim['note']}")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def timeline_svg(analysis: Analysis, width: int = 1400) -> str:
    """One analysed step per rank as measured (actions and P2P waits, ms from the earliest
    start of that step on any rank) above the simulated step, on one time axis."""
    k = analysis.picture_step
    steps = {rank: figs[k] for rank, figs in analysis.steps.items()}
    t0 = min(f.step.start for f in steps.values())
    measured: list[dict[str, Any]] = []
    for rank, f in sorted(steps.items()):
        if f.has_actions:
            shown = f.inside
            measured += [
                {
                    "rank": rank,
                    "start": (r.start - t0) * 1e3,
                    "end": (r.end - t0) * 1e3,
                    "label": r.name,
                }
                for r in shown
            ]
        else:  # only the whole step is visible
            measured.append(
                {
                    "rank": rank,
                    "start": (f.step.start - t0) * 1e3,
                    "end": (f.step.end - t0) * 1e3,
                    "op": "step",
                }
            )
    report = analysis.report
    src = report["source"]
    sections: list[tuple[str | None, Any]] = [
        (
            f"measured: analysed step {k} of {report['steps_analysed']} "
            f"({src.get('kind', 'ranges')}, {src.get('clock', 'host')} clock); "
            "grey bars: P2P waits",
            measured,
        )
    ]
    if analysis.simulation is not None:
        sim = [
            {"rank": r.rank, "start": r.start * 1e3, "end": r.end * 1e3, "action": r.action}
            for r in analysis.simulation.timeline
        ]
        sections.append(
            ("simulated: the schedule with the measured median costs per stage, no P2P cost", sim)
        )
    else:
        sections.append((f"simulated: not available ({report['simulated']['note']})", []))
    title = (
        f"graphpipe profile: {report['ranks']} ranks, {report['microbatches']} micro-batches, "
        f"{report['schedule']}"
    )
    return render_timelines(
        sections,
        costs=analysis.costs,
        title=title,
        width=width,
        num_ranks=report["ranks"],
        unit="ms",
    )


def write_outputs(analysis: Analysis, out: str | Path) -> tuple[Path, Path]:
    """``out/report.json`` and ``out/timeline.svg``; returns both paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report_path, svg_path = out / "report.json", out / "timeline.svg"
    report_path.write_text(json.dumps(analysis.report, indent=2) + "\n")
    svg_path.write_text(timeline_svg(analysis))
    return report_path, svg_path
