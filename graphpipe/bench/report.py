"""The report: the tables ``graphpipe bench`` prints, and the timeline plot (SVG)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["format_report", "write_plot"]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def format_report(result: dict[str, Any]) -> str:
    """The tables ``graphpipe bench`` prints, from its JSON result."""
    cfg = result["config"]
    lines = [
        f"graphpipe bench: {cfg['ranks']} ranks, {cfg['device']}/{cfg['backend']}, "
        f"{cfg['threads_per_rank']} thread(s) per rank, torch {cfg['torch']}; "
        f"{cfg['steps']} timed steps after {cfg['warmup']} warmup, modes interleaved; "
        "step time = slowest rank",
        "peak step mem: what one step allocates on the largest rank, above its start (CPU: "
        "tensor bytes from the profiler's allocation events; CUDA: max_memory_allocated)",
    ]
    for reg in result["regimes"].values():
        lines.append("")
        lines.append(f"[{reg['workload']['name']}] {reg['description']}")
        head = (
            f"{'mode':<24} {'median ms':>10} {'IQR ms':>17} {'min-max ms':>17} "
            f"{'tokens/s':>11} {'vs eager':>8} {'paired':>7} {'peak step mem':>14}"
        )
        lines.append(head)
        for name, m in reg["modes"].items():
            mem = max(r.get("step_peak_bytes", 0) for r in m["peak_memory_per_rank"])
            lines.append(
                f"{name:<24} {m['median_s'] * 1e3:>10.2f} "
                f"{m['q1_s'] * 1e3:>8.2f}-{m['q3_s'] * 1e3:<8.2f} "
                f"{m['min_s'] * 1e3:>8.2f}-{m['max_s'] * 1e3:<8.2f} "
                f"{m['tokens_per_s']:>11,.0f} {m['ratio_to_eager']:>7.2f}x "
                f"{m['paired_ratio_to_eager']:>6.2f}x {_mib(mem):>14}"
            )
        for name, why in reg["skipped"].items():
            lines.append(f"{name:<24} skipped: {why}")
        chk = reg["check"]
        for name, c in chk.items():
            if not isinstance(c, dict):
                continue
            text = f"loss check {name} vs {chk['reference']}: loss {c.get('loss')}"
            if "abs_diff" in c:
                text += f", |diff| {c['abs_diff']:.3g}"
            if "max_rel_grad_diff" in c:
                where = f" ({c['worst_param']})" if c["worst_param"] else ""
                text += f", max rel grad diff {c['max_rel_grad_diff']:.3g}{where}"
            lines.append(text)
        sim = reg["simulation"]
        costs = ", ".join(f"{k}={v * 1e3:.3f}" for k, v in sim["costs_s"].items())
        p2p = sim["p2p"]
        lines.append(
            f"stage costs ms (mean per stage): {costs}; P2P exchange median "
            f"{p2p['median_s'] * 1e6:.0f} us, mean {p2p['mean_s'] * 1e6:.0f} us "
            f"({p2p['over_1ms']:.0%} over 1 ms)"
        )
        meas = sim["measured"]
        rec = meas["recorded_step"]
        lines.append(
            f"measured: median step {meas['median_step_s'] * 1e3:.2f} ms; recorded step "
            f"{rec['makespan_s'] * 1e3:.2f} ms, bubble {rec['bubble_fraction']:.1%}"
        )
        slow = meas.get("in_step_over_alone_per_rank")
        if slow:
            lines.append(
                "actions inside the recorded step over the stage costs alone, per rank: "
                + ", ".join(f"{x:.2f}x" for x in slow)
            )
        for name, p in sim["predictions"].items():
            lines.append(
                f"simulated ({name}): makespan {p['makespan_s'] * 1e3:.2f} ms "
                f"({p['makespan_s'] / meas['median_step_s']:.2f}x measured), "
                f"bubble {p['bubble_fraction']:.1%}"
            )
    host = result["host_overhead"]
    world = host["world"]
    lines.append("")
    lines.append(
        f"[host overhead] trivial Linear(1,1) stages, M={world['workload']['microbatches']}, "
        f"{world['compute_cells_per_rank']} compute cells per rank"
    )
    for name, per in world["per_action_s"].items():
        lines.append(
            f"{name:<24} {per * 1e6:>8.1f} us per action ({cfg['ranks']} ranks, P2P incl.)"
        )
    one = host.get("one_rank")
    if one:
        lines.append(f"one-rank pipeline, {one['compute_cells']} cells, no P2P (medians):")
        for name, t in one["median_s"].items():
            lines.append(f"  {name:<30} {t * 1e3:>8.3f} ms per step")
        torch_per = one["torch_overhead_per_action_s"]
        lines.append(
            f"  per action over the nn.Linear bare loop: graphpipe "
            f"{one['graphpipe_overhead_per_action_s'] * 1e6:.1f} us (interpreter "
            f"{one['executor_overhead_per_action_s'] * 1e6:.1f} us + DeferrableLinear "
            f"{one['wsplit_linear_overhead_per_action_s'] * 1e6:.1f} us), torch schedule "
            + (f"{torch_per * 1e6:.1f} us" if torch_per is not None else "not run")
        )
        for name, why in one.get("skipped", {}).items():
            lines.append(f"  {name:<30} skipped: {why}")
    for name, why in result.get("skipped_regimes", {}).items():
        lines.append(f"regime {name} skipped: {why}")
    return "\n".join(lines)


def _svg_size(svg: str) -> tuple[int, int]:
    m = re.search(r'<svg[^>]*width="(\d+)"[^>]*height="(\d+)"', svg)
    if m is None:
        raise ValueError("render_svg produced an SVG without width/height")
    return int(m.group(1)), int(m.group(2))


def write_plot(path: str, result: dict[str, Any], pictures: dict[str, Any], world: int) -> Path:
    """Per regime, the measured timeline of one graphpipe eager step above the simulated one
    (``pictures``: regime -> ``SimResult``) on one time axis (ms), the regimes stacked into
    one SVG at ``path``."""
    from graphpipe.schedule.render import render_timelines
    from graphpipe.schedule.simulate import Costs

    out = Path(path)
    parts: list[str] = []
    for name, reg in result["regimes"].items():
        actions = [r for r in reg["timeline"] if r["label"] != "step"]
        t0 = min((r["start"] for r in actions), default=0.0)  # time from the first action
        measured = [
            {**r, "start": (r["start"] - t0) * 1e3, "end": (r["end"] - t0) * 1e3} for r in actions
        ]
        sections: list[tuple[str | None, Any]] = [
            ("measured: one step of graphpipe eager, from its first action", measured)
        ]
        pic = pictures.get(name)
        if pic is not None:
            sim = [
                {"rank": r.rank, "start": r.start * 1e3, "end": r.end * 1e3, "action": r.action}
                for r in pic.timeline
            ]
            sections.append(("simulated: measured stage costs, mean P2P per batch", sim))
        costs = Costs(**reg["simulation"]["costs_s"])  # splits the overlapped pairs
        parts.append(
            render_timelines(
                sections, costs=costs, num_ranks=world, title=f"[{name}]", width=1200, unit="ms"
            )
        )
    sizes = [_svg_size(s) for s in parts]
    width = max((w for w, _ in sizes), default=100)
    height = sum(h for _, h in sizes)
    body, y = [], 0
    for svg, (_, h) in zip(parts, sizes, strict=True):
        body.append(svg.replace("<svg ", f'<svg x="0" y="{y}" ', 1))
        y += h
    out.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n' + "".join(body) + "</svg>\n"
    )
    return out
