"""Text in report.html's SVG charts: estimated text boxes, fitting, and point labels that never overlap.

No font is measured (the page is written without one): widths are a conservative per-character estimate
for 12px system-ui (DejaVu Sans, the widest of the usual ones), so a label's real box lies inside its box
here. The label layout is deterministic: the same points give the same SVG."""

from __future__ import annotations

import html
from dataclasses import dataclass

FONT_PX = 12
ASCENT, DESCENT = 0.95, 0.3  # of FONT_PX, above and below the baseline
LINE = round(FONT_PX * (ASCENT + DESCENT)) + 2  # one stacked label's height, 2px apart
# advance widths in em, DejaVu Sans rounded up; everything else 0.64
_EM = {
    **dict.fromkeys("ijl.,:;'|", 0.36),
    **dict.fromkeys("frt()[] -/!", 0.44),
    **dict.fromkeys('_"', 0.52),
    **dict.fromkeys("0123456789{}", 0.66),
    **dict.fromkeys("ABCDEFGHJKLNOPQRSTUVXYZ&?", 0.78),
    **dict.fromkeys("#+=<>^~", 0.86),
    **dict.fromkeys("mwMW%@", 1.0),
    "…": 1.0,
    "×": 0.86,
    "–": 0.5,
    "—": 1.0,
}
ELLIPSIS = "…"


@dataclass(frozen=True)
class Box:
    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, other: "Box", pad: float = 0.0) -> bool:
        return (
            self.x0 < other.x1 + pad
            and other.x0 < self.x1 + pad
            and self.y0 < other.y1 + pad
            and other.y0 < self.y1 + pad
        )

    def inside(self, bounds: "Box") -> bool:
        return bounds.x0 <= self.x0 and self.x1 <= bounds.x1 and bounds.y0 <= self.y0 and self.y1 <= bounds.y1


def text_width(text: str, px: float = FONT_PX) -> float:
    return px * sum(_EM.get(ch, 0.64) for ch in text)


def text_box(x: float, y: float, text: str, anchor: str = "start", px: float = FONT_PX) -> Box:
    """The box a <text x y text-anchor> (y its baseline) covers."""
    width = text_width(text, px)
    left = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
    return Box(left, y - ASCENT * px, left + width, y + DESCENT * px)


def fit(text: str, width: float) -> str:
    """`text`, or its start and end around an ellipsis, no wider than `width`."""
    if text_width(text) <= width:
        return text
    keep = len(text)
    while keep > 0:
        keep -= 1
        head, tail = text[: (keep + 1) // 2], text[len(text) - keep // 2 :] if keep // 2 else ""
        short = head + ELLIPSIS + tail
        if text_width(short) <= width:
            return short
    return ELLIPSIS if text_width(ELLIPSIS) <= width else ""


def wrap(text: str, width: float) -> list[str]:
    """`text` in lines no wider than `width`, broken between words (a word wider than that is fitted)."""
    lines: list[str] = []
    for word in text.split():
        if lines and text_width(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(fit(word, width))
    return lines


def text(x: float, y: float, shown: str, anchor: str = "start", full: str | None = None, attrs: str = "") -> str:
    """An SVG <text>; with `full` (what `shown` was fitted from) a <title> beside it says the whole of it."""
    anchored = "" if anchor == "start" else f' text-anchor="{anchor}"'
    element = f'<text x="{x:.1f}" y="{y:.1f}"{anchored}{attrs}>{html.escape(shown)}</text>'
    return f"<g><title>{html.escape(full)}</title>{element}</g>" if full is not None and full != shown else element


@dataclass(frozen=True)
class Label:
    text: str  # as shown (fitted)
    full: str
    x: float
    y: float  # baseline
    anchor: str
    box: Box
    leader: tuple[float, float, float, float] | None  # from the point to the label, when it is away from it


OFFSET = 8  # from a point's centre to its label's near edge


def _candidates(px: float, py: float, text: str):
    """Positions right beside the point, most readable first: right, left, above, below, then the corners."""
    d, mid = OFFSET, FONT_PX * (ASCENT - DESCENT) / 2  # a baseline that centres the text on the point
    yield px + d, py + mid, "start"
    yield px - d, py + mid, "end"
    yield px, py - d - DESCENT * FONT_PX, "middle"
    yield px, py + d + ASCENT * FONT_PX, "middle"
    for dy in (-d, d + ASCENT * FONT_PX - DESCENT * FONT_PX):
        yield px + d, py + dy, "start"
        yield px - d, py + dy, "end"


def place(
    points: list[tuple[float, float, str]],
    bounds: Box,
    obstacles: list[Box] = (),
    marker: float = 5.0,
    overflow_y: float | None = None,
) -> list[Label]:
    """A label per (x, y, text) point, none overlapping another label, a marker of another point or an
    obstacle, each inside `bounds`. Tried in order: beside the point; then stacked above or below it at a
    growing distance with a leader line; then (needing room the caller adds) in rows from `overflow_y` down,
    at bounds.x0, with a leader line. Labels come back in the order of `points`."""
    taken = [Box(x - marker, y - marker, x + marker, y + marker) for x, y, _ in points] + list(obstacles)
    room = bounds.x1 - bounds.x0
    order = sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0], points[i][2], i))
    placed: dict[int, Label] = {}
    overflow = 0

    def free(box: Box, own: Box) -> bool:
        return box.inside(bounds) and all(not box.overlaps(t, pad=1.0) for t in taken if t != own)

    for i in order:
        px, py, full = points[i]
        own = Box(px - marker, py - marker, px + marker, py + marker)
        shown = fit(full, room - 2)
        label = None
        for x, y, anchor in _candidates(px, py, shown):
            box = text_box(x, y, shown, anchor)
            if free(box, own):
                label = Label(shown, full, x, y, anchor, box, None)
                break
        if label is None:  # stacked: the same side, one line further each time, a leader line back
            steps = int((bounds.y1 - bounds.y0) // LINE) + 1
            for k in (k for step in range(1, steps + 1) for k in (-step, step)):
                for anchor, x in (("start", px + 2 * OFFSET), ("end", px - 2 * OFFSET)):
                    y = py + FONT_PX * (ASCENT - DESCENT) / 2 + k * LINE
                    box = text_box(x, y, shown, anchor)
                    if free(box, own):
                        edge = box.x0 if anchor == "start" else box.x1
                        label = Label(shown, full, x, y, anchor, box, (px, py, edge, (box.y0 + box.y1) / 2))
                        break
                if label is not None:
                    break
        if label is None:  # no room near the point: a row of its own below the chart
            top = (bounds.y1 if overflow_y is None else overflow_y) + overflow * LINE
            y = top + ASCENT * FONT_PX
            box = text_box(bounds.x0, y, shown)
            label = Label(shown, full, bounds.x0, y, "start", box, (px, py, box.x0, (box.y0 + box.y1) / 2))
            overflow += 1
        taken.append(label.box)
        placed[i] = label
    return [placed[i] for i in range(len(points))]


def overflow_rows(labels: list[Label], bounds: Box) -> int:
    """How many labels `place` put below `bounds` (the room, in LINEs, the caller adds to its SVG)."""
    return sum(1 for label in labels if not label.box.inside(bounds))
