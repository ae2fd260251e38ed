"""Pictures of schedules and timelines: ranks as rows, time on x, one box per action.

The picture follows the figure in DeepSeek DualPipe's README: F, B, I and W boxes in their
own colours with the micro-batch number inside, an overlapped (F, B) pair as one box split
into its F half and its B half, stages on the way back of a V (stage >= number of ranks) in a
darker shade, a legend underneath.

Input is any of:

* a compute-only ``Schedule`` (``{rank: [Action, ...]}``): lowered and simulated with
  ``costs`` to get the times;
* a ``simulate.SimResult``: its ``timeline``;
* records, simulated or measured: objects or mappings with ``rank``, ``start``, ``end`` and
  one of ``action`` (an ``Action`` or its string), ``label`` (an action string such as
  ``"0F3"`` or ``"(0F5;7B2)OVERLAP_F_B"``), or ``op`` (``"F"``, ``"B"``, ``"I"``, ``"W"``) with
  ``microbatch`` and optionally ``stage``.

SVG is written by hand (no dependency); PNG needs matplotlib and says so when it is missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from graphpipe.ir import Action
from graphpipe.schedules import Placement

__all__ = ["render_svg", "write_picture"]

# op -> (colour on the way down, colour on the way back)
_COLOURS: dict[str, tuple[str, str]] = {
    "F": ("#f6c28b", "#e08a3c"),
    "B": ("#a8d8a0", "#4f9d48"),
    "I": ("#a9c8ea", "#4d84c4"),
    "W": ("#d7bde8", "#9a69c0"),
}
_UNKNOWN = ("#d0d0d0", "#a0a0a0")
_LEGEND = (
    ("F", "forward"),
    ("B", "backward"),
    ("I", "backward, input grads"),
    ("W", "weight grads"),
)

_ROW, _GAP, _LEFT, _RIGHT, _TOP = 28, 6, 64, 16, 36


@dataclass(frozen=True, slots=True)
class _Part:
    op: str
    stage: int | None
    microbatch: int | None


@dataclass(frozen=True, slots=True)
class _Box:
    rank: int
    start: float
    end: float
    parts: tuple[_Part, ...]


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


def _parts_of(action: Action) -> tuple[_Part, ...]:
    return tuple(_Part(p.op.value, p.stage, p.microbatch) for p in action.parts())


def _box(record: Any) -> _Box:
    """One record (simulated or measured) as a box; see the module doc for accepted fields."""
    action = _field(record, "action")
    label = _field(record, "label")
    if isinstance(action, str):
        action = Action.parse(action)
    if action is None and isinstance(label, str):
        try:
            action = Action.parse(label)
        except ValueError:
            action = None
    if isinstance(action, Action):
        parts = _parts_of(action)
    else:
        op = _field(record, "op")
        if op is None:
            raise ValueError(f"a timeline record needs an action, a label or an op: {record!r}")
        op_name = str(getattr(op, "value", op))
        parts = (_Part(op_name, _field(record, "stage"), _field(record, "microbatch")),)
    rank, start, end = (_field(record, k) for k in ("rank", "start", "end"))
    if rank is None or start is None or end is None:
        raise ValueError(f"a timeline record needs rank, start and end: {record!r}")
    return _Box(int(rank), float(start), float(end), parts)


def _boxes(source: Any, placement: Placement | None, costs: Any) -> list[_Box]:
    """Boxes from a Schedule, a SimResult or an iterable of records."""
    if isinstance(source, Mapping):
        # local imports: lowering and simulating are only needed for a bare schedule
        from graphpipe.lower import lower
        from graphpipe.simulate import Costs, simulate

        costs = costs or Costs()
        placement = placement or Placement.from_schedule(source)
        source = simulate(lower(source, placement, durations=costs.of), placement, costs)
    records = getattr(source, "timeline", source)
    return [_box(r) for r in records]


# --------------------------------------------------------------------------------------------
# Layout


def _tick_step(span: float) -> float:
    """A round tick interval giving about 10 ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / 10
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _layout(
    boxes: Sequence[_Box], num_ranks: int | None, width: int, title: str | None
) -> tuple[list[_Rect | _Text], int]:
    """All shapes in pixel coordinates, and the picture height."""
    ranks = sorted({b.rank for b in boxes} | set(range(num_ranks or 0)))
    rows = {r: i for i, r in enumerate(ranks)}
    n_ranks = num_ranks or len(ranks)
    t0 = min((b.start for b in boxes), default=0.0)
    t1 = max((b.end for b in boxes), default=1.0)
    span = max(t1 - t0, 1e-9)
    scale = (width - _LEFT - _RIGHT) / span

    def x(t: float) -> float:
        return _LEFT + (t - t0) * scale

    def y(rank: int) -> float:
        return _TOP + rows[rank] * (_ROW + _GAP)

    shapes: list[_Rect | _Text] = []
    if title:
        shapes.append(_Text(_LEFT, 20, title, 14, "start"))
    for r in ranks:
        shapes.append(_Text(_LEFT - 8, y(r) + _ROW / 2, f"rank {r}", 12, "end"))
    back_seen = False
    for b in boxes:
        left, total = x(b.start), max((b.end - b.start) * scale, 0.5)
        part_w = total / len(b.parts)
        for i, p in enumerate(b.parts):
            back = p.stage is not None and p.stage >= n_ranks
            back_seen |= back
            fill = _COLOURS.get(p.op, _UNKNOWN)[back]
            px = left + i * part_w
            shapes.append(_Rect(px, y(b.rank), part_w, _ROW, fill))
            text = "" if p.microbatch is None else str(p.microbatch)
            if text and part_w >= 7 * len(text) + 2:
                size = min(11.0, part_w * 0.8)
                shapes.append(_Text(px + part_w / 2, y(b.rank) + _ROW / 2, text, size))
        if len(b.parts) > 1:  # one unit: a heavier outline around the split box
            shapes.append(_Rect(left, y(b.rank), total, _ROW, "none", "#000000", 1.6))

    axis_y = _TOP + len(ranks) * (_ROW + _GAP) + 4
    step = _tick_step(span)
    for k in range(int(span / step) + 1):
        t = t0 + k * step
        shapes.append(_Rect(x(t), axis_y, 0.1, 5, "#333333", "#333333", 0.5))
        shapes.append(_Text(x(t), axis_y + 16, f"{t:g}", 10))
    shapes.append(_Text(width - _RIGHT, axis_y + 32, "time", 10, "end"))

    legend_y = axis_y + 44
    lx = _LEFT
    entries = [(_COLOURS[op][0], f"{op}: {what}") for op, what in _LEGEND]
    if back_seen:
        entries.append((_COLOURS["F"][1], "darker: stages on the way back"))
    for fill, text in entries:
        shapes.append(_Rect(lx, legend_y, 14, 14, fill))
        shapes.append(_Text(lx + 20, legend_y + 7, text, 11, "start"))
        lx += 28 + 6.2 * len(text)
    shapes.append(_Rect(lx, legend_y, 7, 14, _COLOURS["F"][0], "#333333", 0.6))
    shapes.append(_Rect(lx + 7, legend_y, 7, 14, _COLOURS["B"][0], "#333333", 0.6))
    shapes.append(_Rect(lx, legend_y, 14, 14, "none", "#000000", 1.6))
    shapes.append(_Text(lx + 20, legend_y + 7, "F&B: overlapped pair", 11, "start"))
    return shapes, int(legend_y + 28)


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


def render_svg(
    source: Any,
    placement: Placement | None = None,
    costs: Any = None,
    *,
    title: str | None = None,
    width: int = 1200,
    num_ranks: int | None = None,
) -> str:
    """The picture of ``source`` (a Schedule, a SimResult or timeline records) as SVG text.

    placement, costs: only for a bare Schedule (defaults: the placement the schedule implies,
        ``simulate.Costs()``).
    num_ranks: rows to draw even when idle, and the stage from which boxes are drawn darker
        (the way back of a V); default: the placement's, else the ranks seen.
    """
    boxes = _boxes(source, placement, costs)
    if num_ranks is None and placement is not None:
        num_ranks = placement.num_ranks
    shapes, height = _layout(boxes, num_ranks, width, title)
    return _svg(shapes, width, height)


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
    width = kwargs.pop("width", 1200)
    boxes = _boxes(source, kwargs.pop("placement", None), kwargs.pop("costs", None))
    shapes, height = _layout(boxes, kwargs.get("num_ranks"), width, kwargs.get("title"))
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
