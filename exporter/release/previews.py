"""previews/<artifact>.png: the validation inputs where an artifact departs most from eager, one under another.

The task scores every input (Task.departure: terms in ranking order, what a person sees first, the raw error
last); inputs whose outputs are bit-identical to eager's are never shown, so an artifact identical to eager
on every input gets no picture, only `preview_rows: []` in its manifest entry."""

from __future__ import annotations

import math

MOST = 4  # inputs in one artifact's picture
GAP = 8  # white pixels between two inputs' strips
TITLE = 18  # pixels of the band above each strip that names its input and how it departs
# how a departure term reads (Task.departure's terms); an unknown term reads as its name and value
TERMS = {
    "top1_flipped": lambda v: "top-1 flipped" if v else "same top-1",
    "margin_change": lambda v: f"top-2 margin moved {v:.3g}",
    "changed_pixels": lambda v: f"{v:.2%} of pixels change class",
    "unmatched_boxes": lambda v: f"{v:.0f} unmatched box{'' if v == 1 else 'es'}",
    "logit_rmse": lambda v: f"logit RMSE {v:.2g}",
    "head_rmse": lambda v: f"raw-head RMSE {v:.2g}",
}
# What a picture means: part of the validation cache key, so that a cached record never serves a picture
# drawn by other rules. Change it whenever the choice of rows or the drawing changes.
VERSION = "departures-1"


def _scores(departure: dict) -> list[dict]:
    """Per row, {term: score} as the manifest can hold it: a row with a NaN term (an artifact that returned
    NaN) scores infinity on every term, so that it ranks first and counts as seen."""
    columns = {term: [float(v) for v in scores.tolist()] for term, scores in departure.items()}
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    return [dict.fromkeys(row, math.inf) if any(math.isnan(v) for v in row.values()) else row for row in rows]


def term(name: str, value) -> str:
    value = float(value)  # the manifest writes infinity as "inf"
    return TERMS[name](value) if name in TERMS else f"{name.replace('_', ' ')} {value:.3g}"


def describe(row: dict) -> str:
    """ "input 3: 2 unmatched boxes, raw-head RMSE 4.9" for a `preview_rows` item."""
    return f"input {row['row']}: {', '.join(term(k, v) for k, v in row['departure'].items())}"


def visible(row: dict) -> bool:
    """Whether a `preview_rows` item departs in what a person sees (its first term), not only in raw numbers."""
    return float(next(iter(row["departure"].values()))) > 0


def choose(departure: dict, identical, most: int = MOST) -> list[int]:
    """Up to `most` rows, furthest first: compared on the first term, ties on the next ones, then the lower
    row first; rows marked in `identical` are left out, and so are rows that depart only in raw numbers
    when some depart visibly (first term above 0)."""
    scores = [list(row.values()) for row in _scores(departure)]
    rows = [i for i, same in enumerate(identical.tolist()) if not same]
    rows.sort(key=lambda i: (*(-v for v in scores[i]), i))
    if rows and scores[rows[0]][0] > 0:
        rows = [i for i in rows if scores[i][0] > 0]
    return rows[:most]


def stack(pictures: list, titles: list[str]):
    """The strips one under another, left-aligned, GAP white pixels apart, each under a band with its title."""
    from PIL import Image, ImageDraw, ImageFont

    width = max(p.width for p in pictures)
    height = sum(p.height + TITLE for p in pictures) + GAP * (len(pictures) - 1)
    sheet = Image.new("RGB", (width, height), "white")
    draw, font = ImageDraw.Draw(sheet), ImageFont.load_default(size=TITLE - 5)
    y = 0
    for picture, title in zip(pictures, titles):
        draw.text((2, y + 2), title, font=font, fill=(31, 35, 40))
        sheet.paste(picture, (0, y + TITLE))
        y += TITLE + picture.height + GAP
    return sheet


def draw(task, inputs, reference, outputs, preprocessing: dict, labels=None, most: int = MOST):
    """(picture or None, rows): rows are [{"row": index, "departure": {term: score}}] of the inputs shown,
    furthest first; no rows when every output is bit-identical to eager's. The picture is None also when
    the task draws none."""
    departure = task.departure(reference, outputs)
    identical = (outputs == reference).reshape(len(reference), -1).all(1)
    chosen = choose(departure, identical, most)
    scores = _scores(departure)
    rows = [{"row": i, "departure": scores[i]} for i in chosen]
    pictures = [task.preview(inputs[i], reference[i], outputs[i], preprocessing, labels) for i in chosen]
    if not pictures or any(p is None for p in pictures):
        return None, rows
    return stack(pictures, [describe(r) for r in rows]), rows
