"""Pictures: SVG from a schedule, a simulation or measured records; PNG needs matplotlib."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest

from graphpipe.schedule.generators import SCHEDULES
from graphpipe.schedule.lower import lower
from graphpipe.schedule.render import _COLOURS, _WAIT, render_svg, render_timelines, write_picture
from graphpipe.schedule.simulate import Costs, simulate

SVG = "{http://www.w3.org/2000/svg}"


def _parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def _boxes(root: ET.Element) -> list[ET.Element]:
    """The rects of action boxes (row height), in drawing order."""
    return [r for r in root.iter(f"{SVG}rect") if float(r.get("height")) == 28]


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def test_schedule_and_its_simulation_draw_the_same_picture() -> None:
    schedule, placement = SCHEDULES["dualpipev"](3, 7)
    result = simulate(lower(schedule, placement), placement, Costs())
    assert render_svg(schedule, placement) == render_svg(result, num_ranks=3)


def test_overlap_pairs_are_split_boxes_with_both_microbatches() -> None:
    records = [
        {"rank": 0, "start": 0.0, "end": 3.0, "label": "(0F5;7B2)OVERLAP_F_B"},
        {"rank": 1, "start": 0.0, "end": 1.0, "label": "1F0"},
    ]
    root = _parse(render_svg(records, num_ranks=2, width=400))
    rects = [r for r in root.iter(f"{SVG}rect") if float(r.get("height")) == 28]
    halves = [r for r in rects if r.get("fill") not in ("none", "#ffffff")]
    assert len(halves) == 3  # F half, B half, and the single F
    assert {"5", "2", "0"} <= set(_texts(root))
    outline = [r for r in rects if r.get("fill") == "none"]
    assert len(outline) == 1  # one heavier outline around the pair
    f_half, b_half = halves[0], halves[1]
    # split by the default costs F=1, B=2
    assert 2 * float(f_half.get("width")) == pytest.approx(float(b_half.get("width")), abs=0.02)
    assert f_half.get("fill") != b_half.get("fill")  # stage 0 F vs stage 7 B (way back)


def test_overlap_pairs_are_split_in_proportion_to_the_given_costs() -> None:
    records = [{"rank": 0, "start": 0.0, "end": 4.0, "label": "(0F5;7B2)OVERLAP_F_B"}]
    root = _parse(render_svg(records, costs=Costs(F=3, B=1), num_ranks=2, width=400))
    f_part, b_part = [r for r in _boxes(root) if r.get("fill") != "none"]
    assert float(f_part.get("width")) == pytest.approx(3 * float(b_part.get("width")), abs=0.02)
    assert float(f_part.get("x")) + float(f_part.get("width")) == pytest.approx(
        float(b_part.get("x")), abs=0.02
    )


def test_one_unit_boxes_carry_two_digit_microbatches_in_a_fitted_font() -> None:
    schedule, placement = SCHEDULES["dualpipev"](4, 16)
    root = _parse(render_svg(schedule, placement))
    rows = {float(r.get("y")) + 14 for r in _boxes(root)}
    labels = [t for t in root.iter(f"{SVG}text") if float(t.get("y")) in rows and t.text.isdigit()]
    shown = {int(t.text) for t in labels}
    assert shown == set(range(16))
    parts = [r for r in _boxes(root) if r.get("fill") != "none"]
    assert len(labels) == len(parts)  # every box is labelled, one-unit ones with 10..15 too
    assert all(6 <= float(t.get("font-size")) <= 11 for t in labels)
    # each label fits its box: font size x characters x 0.62 em <= box width
    widths = {
        round(float(r.get("x")) + float(r.get("width")) / 2, 2): float(r.get("width"))
        for r in _boxes(root)
    }
    for t in labels:
        box = widths[round(float(t.get("x")), 2)]
        assert float(t.get("font-size")) * 0.62 * len(t.text) <= box


def test_the_legend_shows_both_shades_of_every_op() -> None:
    schedule, placement = SCHEDULES["dualpipev"](2, 4)
    root = _parse(render_svg(schedule, placement))
    swatches = {r.get("fill") for r in root.iter(f"{SVG}rect") if r.get("height") == "14.00"}
    for light, dark in _COLOURS.values():
        assert {light, dark} <= swatches
    assert any("way back" in t for t in _texts(root))


def test_sections_share_one_time_axis_and_waits_are_drawn() -> None:
    measured = [
        {"rank": 0, "start": 0.0, "end": 2.0, "label": "0F0"},
        {"rank": 0, "start": 2.0, "end": 6.0, "label": "wait 1RECV_B0"},
        {"rank": 0, "start": 6.0, "end": 8.0, "label": "0B0"},
    ]
    simulated = [
        {"rank": 0, "start": 0.0, "end": 1.0, "label": "0F0"},
        {"rank": 0, "start": 1.0, "end": 3.0, "label": "0B0"},
    ]
    svg = render_timelines(
        [("measured", measured), ("simulated", simulated)], num_ranks=1, width=800, unit="ms"
    )
    root = _parse(svg)
    texts = _texts(root)
    assert "measured" in texts and "simulated" in texts and "time (ms)" in texts
    assert "P2P wait" in texts
    boxes = _boxes(root)
    m_f, m_b, s_f, s_b = (r for r in boxes if r.get("fill") != "none")
    # one axis: 1 time unit is the same number of pixels in both sections
    px = float(m_f.get("width")) / 2
    assert float(s_f.get("width")) == pytest.approx(px, abs=0.02)
    assert float(s_b.get("x")) == pytest.approx(float(m_f.get("x")) + px, abs=0.02)
    assert float(m_b.get("x")) == pytest.approx(float(m_f.get("x")) + 6 * px, abs=0.02)
    waits = [
        r for r in root.iter(f"{SVG}rect") if r.get("fill") == _WAIT and r.get("height") == "8.00"
    ]
    assert len(waits) == 1 and float(waits[0].get("width")) == pytest.approx(4 * px, abs=0.02)


def test_measured_records_with_op_and_microbatch_render() -> None:
    measured = [
        {"rank": 0, "start": 10.0, "end": 10.5, "op": "F", "microbatch": 0},
        {"rank": 0, "start": 10.5, "end": 11.5, "op": "B", "microbatch": 0},
        {"rank": 1, "start": 10.2, "end": 10.4, "op": "SEND_F", "microbatch": 0},
    ]
    root = _parse(render_svg(measured, title="measured"))
    texts = _texts(root)
    assert "measured" in texts and "rank 0" in texts and "rank 1" in texts
    assert "10" in texts  # the time axis starts at the first record


def test_records_without_what_ran_are_rejected() -> None:
    with pytest.raises(ValueError, match="action, a label or an op"):
        render_svg([{"rank": 0, "start": 0, "end": 1}])


def test_write_picture_svg_and_bad_suffix(tmp_path) -> None:
    schedule, placement = SCHEDULES["1f1b"](2, 3)
    path = write_picture(tmp_path / "p.svg", schedule, placement=placement)
    _parse(path.read_text())
    with pytest.raises(ValueError, match=r"use \.svg"):
        write_picture(tmp_path / "p.gif", schedule)


def test_png_needs_matplotlib_and_says_svg_works(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    schedule, _ = SCHEDULES["1f1b"](2, 3)
    with pytest.raises(RuntimeError, match=r"needs matplotlib.*\.svg"):
        write_picture(tmp_path / "p.png", schedule)


def test_the_svg_does_not_depend_on_the_order_of_the_records() -> None:
    schedule, placement = SCHEDULES["dualpipev"](3, 7)
    result = simulate(lower(schedule, placement), placement, Costs())
    records = [
        {"rank": r.rank, "start": r.start, "end": r.end, "action": r.action}
        for r in result.timeline
    ]
    records.append({"rank": 1, "start": 2.0, "end": 3.0, "label": "wait 1RECV_F0"})
    records.append({"rank": 0, "start": 0.5, "end": 1.5, "label": "wait 0RECV_B5"})
    forward = render_svg(records, num_ranks=3)
    assert render_svg(list(reversed(records)), num_ranks=3) == forward
    assert render_svg(records[1::2] + records[::2], num_ranks=3) == forward


def test_the_readme_picture_is_what_its_command_writes(tmp_path) -> None:
    # README: `graphpipe schedule --ranks 4 --microbatches 10 --out docs/dualpipev_n4_m10.svg`
    from pathlib import Path

    from graphpipe.cli import main

    out = tmp_path / "dualpipev_n4_m10.svg"
    assert main(["schedule", "--ranks", "4", "--microbatches", "10", "--out", str(out)]) == 0
    committed = Path(__file__).resolve().parent.parent / "docs" / "dualpipev_n4_m10.svg"
    assert out.read_bytes() == committed.read_bytes(), (
        "docs/dualpipev_n4_m10.svg is not what the README's command writes: run "
        "graphpipe schedule --ranks 4 --microbatches 10 --out docs/dualpipev_n4_m10.svg"
    )
