"""Pictures: SVG from a schedule, a simulation or measured records; PNG needs matplotlib."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest

from graphpipe.lower import lower
from graphpipe.render import render_svg, write_picture
from graphpipe.schedules import SCHEDULES
from graphpipe.simulate import Costs, simulate

SVG = "{http://www.w3.org/2000/svg}"


def _parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


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
    assert float(f_half.get("width")) == pytest.approx(float(b_half.get("width")))
    assert f_half.get("fill") != b_half.get("fill")  # stage 0 F vs stage 7 B (way back)


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
