"""Pictures of schedules and timelines: ranks as rows, time on x, one box per action.

The picture follows the figure in DeepSeek DualPipe's README: F, B, I and W boxes in their
own colours with the micro-batch number inside (the font fitted to the box), an overlapped
(F, B) pair as one box split into its F part and its B part in proportion to their costs,
stages on the way back of a V (stage >= number of ranks) in a darker shade, a legend
underneath that shows both shades.

Input is any of:

* a compute-only ``Schedule`` (``{rank: [Action, ...]}``): lowered and simulated with
  ``costs`` to get the times;
* a ``simulate.SimResult``: its ``timeline``;
* records, simulated or measured: objects or mappings with ``rank``, ``start``, ``end`` and
  one of ``action`` (an ``Action`` or its string), ``label`` (an action string such as
  ``"0F3"`` or ``"(0F5;7B2)OVERLAP_F_B"``, or a communication wait ``"wait ..."``, drawn as a
  grey bar under the row's boxes), or ``op`` (``"F"``, ``"B"``, ``"I"``, ``"W"``) with
  ``microbatch`` and optionally ``stage``.

``render_timelines`` draws several such sources as sections (e.g. measured above simulated)
on one time axis; ``render_svg`` draws one.

SVG is written by hand (no dependency); PNG needs matplotlib and says so when it is missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from graphpipe.schedule.ir import WAIT_PREFIX, Action, Placement
from graphpipe.schedule.lower import lower
from graphpipe.schedule.simulate import Costs, simulate

__all__ = ["render_svg", "render_timelines", "write_picture"]

# op -> (colour on the way down, colour on the way back)
_COLOURS: dict[str, tuple[str, str]] = {
    "F": ("#f6c28b", "#e08a3c"),
    "B": ("#a8d8a0", "#4f9d48"),
    "I": ("#a9c8ea", "#4d84c4"),
    "W": ("#d7bde8", "#9a69c0"),
}
_UNKNOWN = ("#d0d0d0", "#a0a0a0")
_WAIT = "#8c8c8c"
_LEGEND = (
    ("F", "forward"),
    ("B", "backward"),
    ("I", "backward, input grads"),
    ("W", "weight grads"),
)

_ROW, _GAP, _LEFT, _RIGHT, _TOP = 28, 6, 64, 16, 36
_SECTION = 22  # height of a section's title line
_MIN_WIDTH, _MAX_WIDTH = 1200, 4800  # automatic width: the range it stays in
_UNIT_PX = 16  # automatic width: the shortest box gets at least this many pixels
_FONT, _MIN_FONT, _CHAR_EM = 11.0, 6.0, 0.62  # label font: largest, smallest, width per char


@dataclass(frozen=True, slots=True)
class _Part:
    op: str
    stage: int | None
    microbatch: int | None
    weight: float = 1.0  # share of the box, relative to the other parts


@dataclass(frozen=True, slots=True)
class _Box:
    rank: int
    start: float
    end: float
    parts: tuple[_Part, ...]  # empty for a communication wait

    @property
    def is_wait(self) -> bool:
        return not self.parts


@dataclass(frozen=True, slots=True)
class _Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str = "#333333"
    stroke_width: float = 0.6


@dataclass(frozen=True, slots=True)
class _Text:
    x: float
    y: float
    text: str
    size: float = 11.0
    anchor: str = "middle"  # middle | start | end


# --------------------------------------------------------------------------------------------
# Input normalisation


def _field(record: Any, name: str) -> Any:
    if isinstance(record, Mapping):
        return record.get(name)
    return getattr(record, name, None)


def _parts_of(action: Action, costs: Any) -> tuple[_Part, ...]:
    parts = action.parts()
    weights = [1.0] * len(parts)
    if costs is not None and len(parts) > 1:
        weights = [max(float(costs.of(p)), 0.0) for p in parts]
        if sum(weights) <= 0:
            weights = [1.0] * len(parts)
    return tuple(
        _Part(p.op.value, p.stage, p.microbatch, w) for p, w in zip(parts, weights, strict=True)
    )


def _box(record: Any, costs: Any = None) -> _Box:
    """One record (simulated or measured) as a box; see the module doc for accepted fields."""
    rank, start, end = (_field(record, k) for k in ("rank", "start", "end"))
    if rank is None or start is None or end is None:
        raise ValueError(f"a timeline record needs rank, start and end: {record!r}")
    action = _field(record, "action")
    label = _field(record, "label")
    if isinstance(label, str) and label.startswith(WAIT_PREFIX) and action is None:
        return _Box(int(rank), float(start), float(end), ())
    if isinstance(action, str):
        action = Action.parse(action)
    if action is None and isinstance(label, str):
        try:
            action = Action.parse(label)
        except ValueError:
            action = None
    if isinstance(action, Action):
        parts = _parts_of(action, costs)
    else:
        op = _field(record, "op")
        if op is None:
            raise ValueError(f"a timeline record needs an action, a label or an op: {record!r}")
        op_name = str(getattr(op, "value", op))
        parts = (_Part(op_name, _field(record, "stage"), _field(record, "microbatch")),)
    return _Box(int(rank), float(start), float(end), parts)


def _default_costs(costs: Any) -> Any:
    return Costs() if costs is None else costs


def _boxes(source: Any, placement: Placement | None, costs: Any) -> list[_Box]:
    """Boxes from a Schedule, a SimResult or an iterable of records. Overlapped pairs are
    split by ``costs`` (default ``simulate.Costs()``)."""
    costs = _default_costs(costs)
    if isinstance(source, Mapping):
        placement = placement or Placement.from_schedule(source)
        source = simulate(lower(source, placement, durations=costs.of), placement, costs)
    records = getattr(source, "timeline", source)
    return [_box(r, costs) for r in records]


# --------------------------------------------------------------------------------------------
# Layout


def _tick_step(span: float) -> float:
    """A round tick interval giving about 10 ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / 10
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _auto_width(sections: Sequence[tuple[str | None, list[_Box]]]) -> int:
    """Wide enough that the shortest box gets ``_UNIT_PX`` pixels, within the limits."""
    boxes = [b for _, bs in sections for b in bs]
    lengths = [b.end - b.start for b in boxes if not b.is_wait and b.end > b.start]
    if not lengths:
        return _MIN_WIDTH
    span = max(b.end for b in boxes) - min(b.start for b in boxes)
    want = _LEFT + _RIGHT + span / min(lengths) * _UNIT_PX
    return int(min(max(want, _MIN_WIDTH), _MAX_WIDTH))


def _label(shapes: list[_Rect | _Text], x: float, y: float, w: float, text: str) -> None:
    """The micro-batch number centred in a box, its font fitted to the box's width; a box
    too narrow for ``_MIN_FONT`` stays unlabelled."""
    size = min(_FONT, (w - 2) / (_CHAR_EM * len(text)))
    if size >= _MIN_FONT:
        shapes.append(_Text(x + w / 2, y + _ROW / 2, text, round(size, 1)))


def _legend(shapes: list[_Rect | _Text], y: float, back_seen: bool, wait_seen: bool) -> float:
    """The legend at height ``y``; returns the height below it."""
    lx = _LEFT
    for op, what in _LEGEND:
        light, dark = _COLOURS[op]
        if back_seen:
            shapes.append(_Rect(lx, y, 9, 14, light))
            shapes.append(_Rect(lx + 9, y, 9, 14, dark))
            sw = 18
        else:
            shapes.append(_Rect(lx, y, 14, 14, light))
            sw = 14
        text = f"{op}: {what}"
        shapes.append(_Text(lx + sw + 6, y + 7, text, 11, "start"))
        lx += sw + 20 + 6.2 * len(text)
    shapes.append(_Rect(lx, y, 7, 14, _COLOURS["F"][0], "#333333", 0.6))
    shapes.append(_Rect(lx + 7, y, 11, 14, _COLOURS["B"][0], "#333333", 0.6))
    shapes.append(_Rect(lx, y, 18, 14, "none", "#000000", 1.6))
    text = "F&B: overlapped pair (split by cost)"
    shapes.append(_Text(lx + 24, y + 7, text, 11, "start"))
    lx += 44 + 6.2 * len(text)
    if wait_seen:
        shapes.append(_Rect(lx, y + 9, 18, 5, _WAIT, _WAIT, 0.4))
        shapes.append(_Text(lx + 24, y + 7, "P2P wait", 11, "start"))
    if back_seen:
        y += 20
        shapes.append(
            _Text(
                _LEFT,
                y + 7,
                "left shade: stage on the way down (stage < ranks); right, darker: on the way "
                "back of the V",
                11,
                "start",
            )
        )
    return y + 28


def _drawing_order(b: _Box) -> tuple[Any, ...]:
    """Where ``b`` is drawn: waits first (action boxes on top of them), then by rank, time and
    what the box holds. The SVG depends on the boxes alone, not on the order a simulator or a
    trace listed them in, so the same picture is the same file byte for byte."""
    parts = tuple(
        (
            p.op,
            -1 if p.stage is None else p.stage,
            -1 if p.microbatch is None else p.microbatch,
            p.weight,
        )
        for p in b.parts
    )
    return (not b.is_wait, b.rank, b.start, b.end, parts)


def _layout(
    sections: Sequence[tuple[str | None, list[_Box]]],
    num_ranks: int | None,
    width: int,
    title: str | None,
    unit: str | None = None,
) -> tuple[list[_Rect | _Text], int]:
    """All shapes in pixel coordinates, and the picture height. Every section gets one row
    per rank; all share one time axis."""
    every = [b for _, bs in sections for b in bs]
    ranks = sorted({b.rank for b in every} | set(range(num_ranks or 0)))
    n_ranks = num_ranks or len(ranks)
    t0 = min((b.start for b in every), default=0.0)
    t1 = max((b.end for b in every), default=1.0)
    span = max(t1 - t0, 1e-9)
    scale = (width - _LEFT - _RIGHT) / span

    def x(t: float) -> float:
        return _LEFT + (t - t0) * scale

    shapes: list[_Rect | _Text] = []
    if title:
        shapes.append(_Text(_LEFT, 20, title, 14, "start"))
    back_seen = wait_seen = False
    top = _TOP
    for name, boxes in sections:
        if name:
            shapes.append(_Text(_LEFT, top + _SECTION / 2 - 2, name, 12, "start"))
            top += _SECTION
        rows = {r: top + i * (_ROW + _GAP) for i, r in enumerate(ranks)}
        for r in ranks:
            shapes.append(_Text(_LEFT - 8, rows[r] + _ROW / 2, f"rank {r}", 12, "end"))
        for b in sorted(boxes, key=_drawing_order):  # waits first, boxes on top
            left, total = x(b.start), max((b.end - b.start) * scale, 0.5)
            if b.is_wait:
                wait_seen = True
                shapes.append(_Rect(left, rows[b.rank] + _ROW - 8, total, 8, _WAIT, _WAIT, 0.4))
                continue
            weights = sum(p.weight for p in b.parts)
            px = left
            for p in b.parts:
                part_w = total * p.weight / weights
                back = p.stage is not None and p.stage >= n_ranks
                back_seen |= back
                fill = _COLOURS.get(p.op, _UNKNOWN)[back]
                shapes.append(_Rect(px, rows[b.rank], part_w, _ROW, fill))
                if p.microbatch is not None:
                    _label(shapes, px, rows[b.rank], part_w, str(p.microbatch))
                px += part_w
            if len(b.parts) > 1:  # one unit: a heavier outline around the split box
                shapes.append(_Rect(left, rows[b.rank], total, _ROW, "none", "#000000", 1.6))
        top += len(ranks) * (_ROW + _GAP)

    axis_y = top + 4
    step = _tick_step(span)
    for k in range(int(span / step) + 1):
        t = t0 + k * step
        shapes.append(_Rect(x(t), axis_y, 0.1, 5, "#333333", "#333333", 0.5))
        shapes.append(_Text(x(t), axis_y + 16, f"{t:g}", 10))
    axis = "time" if not unit else f"time ({unit})"
    shapes.append(_Text(width - _RIGHT, axis_y + 32, axis, 10, "end"))
    height = _legend(shapes, axis_y + 44, back_seen, wait_seen)
    return shapes, int(height)


# --------------------------------------------------------------------------------------------
# Writers


def _svg(shapes: Iterable[_Rect | _Text], width: int, height: int) -> str:
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for s in shapes:
        if isinstance(s, _Rect):
            out.append(
                f'<rect x="{s.x:.2f}" y="{s.y:.2f}" width="{s.w:.2f}" height="{s.h:.2f}" '
                f'fill="{s.fill}" stroke="{s.stroke}" stroke-width="{s.stroke_width}"/>'
            )
        else:
            out.append(
                f'<text x="{s.x:.2f}" y="{s.y:.2f}" font-size="{s.size:.1f}" '
                f'text-anchor="{s.anchor}" dominant-baseline="central">{escape(s.text)}</text>'
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _shapes(
    sections: Sequence[tuple[str | None, Any]],
    placement: Placement | None,
    costs: Any,
    title: str | None,
    width: int | None,
    num_ranks: int | None,
    unit: str | None,
) -> tuple[list[_Rect | _Text], int, int]:
    boxed = [(name, _boxes(source, placement, costs)) for name, source in sections]
    if num_ranks is None and placement is not None:
        num_ranks = placement.num_ranks
    width = width or _auto_width(boxed)
    shapes, height = _layout(boxed, num_ranks, width, title, unit)
    return shapes, width, height


def render_timelines(
    sections: Sequence[tuple[str | None, Any]],
    placement: Placement | None = None,
    costs: Any = None,
    *,
    title: str | None = None,
    width: int | None = None,
    num_ranks: int | None = None,
    unit: str | None = None,
) -> str:
    """Several timelines as SVG text, one section each, above each other on one time axis.

    sections: ``(heading or None, source)`` pairs; a source is what ``render_svg`` takes.
    costs: splits overlapped pairs in proportion to ``costs.of(F)`` and ``costs.of(B)``
        (default ``simulate.Costs()``); for a bare Schedule also the simulation's costs.
    width: pixels; default: wide enough for a label in the shortest box (1200 to 4800).
    unit: the time unit written on the axis (``"ms"``), none by default.
    Other arguments as for ``render_svg``.
    """
    shapes, width, height = _shapes(sections, placement, costs, title, width, num_ranks, unit)
    return _svg(shapes, width, height)


def render_svg(
    source: Any,
    placement: Placement | None = None,
    costs: Any = None,
    *,
    title: str | None = None,
    width: int | None = None,
    num_ranks: int | None = None,
    unit: str | None = None,
) -> str:
    """The picture of ``source`` (a Schedule, a SimResult or timeline records) as SVG text.

    placement: only for a bare Schedule (default: the placement the schedule implies).
    costs: for a bare Schedule, the simulation's costs; for every source, the split of
        overlapped pairs (default ``simulate.Costs()``).
    num_ranks: rows to draw even when idle, and the stage from which boxes are drawn darker
        (the way back of a V); default: the placement's, else the ranks seen.
    width: pixels; default: wide enough for a label in the shortest box (1200 to 4800).
    unit: the time unit written on the axis, none by default.
    """
    return render_timelines(
        [(None, source)],
        placement,
        costs,
        title=title,
        width=width,
        num_ranks=num_ranks,
        unit=unit,
    )


def _write_svg(path: Path, source: Any, **kwargs: Any) -> None:
    path.write_text(render_svg(source, **kwargs))


def _write_png(path: Path, source: Any, **kwargs: Any) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        raise RuntimeError(
            f"writing {path.name} needs matplotlib, which is not installed; "
            "write an SVG instead (a path ending in .svg)"
        ) from None
    shapes, width, height = _shapes(
        [(None, source)],
        kwargs.get("placement"),
        kwargs.get("costs"),
        kwargs.get("title"),
        kwargs.get("width"),
        kwargs.get("num_ranks"),
        kwargs.get("unit"),
    )
    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    align = {"middle": "center", "start": "left", "end": "right"}
    for s in shapes:
        if isinstance(s, _Rect):
            face = "none" if s.fill == "none" else s.fill
            patch = Rectangle((s.x, s.y), s.w, s.h, facecolor=face, edgecolor=s.stroke)
            patch.set_linewidth(s.stroke_width)
            ax.add_patch(patch)
        else:
            ax.text(s.x, s.y, s.text, fontsize=s.size * 0.75, ha=align[s.anchor], va="center")
    fig.savefig(path, dpi=100)
    plt.close(fig)


_WRITERS = {".svg": _write_svg, ".png": _write_png}


def write_picture(path: str | Path, source: Any, **kwargs: Any) -> Path:
    """Write the picture of ``source`` to ``path``: ``.svg`` always works, ``.png`` needs
    matplotlib (a RuntimeError naming SVG as the alternative otherwise). ``kwargs`` as for
    ``render_svg``. Returns the path."""
    path = Path(path)
    writer = _WRITERS.get(path.suffix.lower())
    if writer is None:
        raise ValueError(
            f"cannot write a picture as {path.suffix or 'a file without suffix'!r}: "
            "use .svg (always available) or .png (needs matplotlib)"
        )
    writer(path, source, **kwargs)
    return path
