"""OUT/report.html: one self-contained page (inline CSS and SVG, opens offline)."""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Iterator
from pathlib import Path

from ..results import ArtifactResult, Manifest, Status, texts
from . import arch_report, previews, recommend, svg_text
from .report import COLUMNS, about, closing, latency_warnings, notes, outliers_summary, rows, task_name
from .svg_text import Box

STATUS_COLOURS = {"passed": "#1a7f37", "failed": "#cf222e", "unavailable": "#9a6700"}
# Phone width (390 px) is a design case: tables scroll inside their own box (.scroll), names break only after "_"
# or "/" (<wbr>, see _name), and charts are drawn at most CHART_WIDTH wide so their 12px text is not scaled down.
CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:1100px;color:#1f2328;padding:0 1rem;
overflow-wrap:break-word}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #d0d7de;padding:.35rem .5rem;text-align:right;white-space:nowrap}
th:first-child,td:first-child,td.status{text-align:left}
td.name{white-space:normal;min-width:7em}th.name,td.name{text-align:left}
svg{max-width:100%;height:auto}
code{font-size:.92em}
.badge{color:#fff;border-radius:1rem;padding:.05rem .55rem;font-size:.85em}
.meta{color:#57606a}.charts{display:flex;gap:2rem;flex-wrap:wrap}
svg text{font:12px system-ui,sans-serif;fill:#1f2328}
li{margin:.2rem 0}
figure{margin:1rem 0}img{image-rendering:pixelated;max-width:100%}figcaption{color:#57606a}
.ship{border-left:4px solid #0969da;background:#f6f8fa;padding:.4rem .8rem;margin:1rem 0}.ship p{margin:.2rem 0}
details{margin:.6rem 0}summary{cursor:pointer}
.busy{border-left:4px solid #9a6700;background:#fff8c5;padding:.4rem .8rem;margin:1rem 0}.busy p,.busy ul{margin:.2rem 0}
"""


def _esc(value) -> str:
    return html.escape(str(value))


def _name(name: str) -> str:
    """An artifact's (or layer's) name, escaped, that a narrow column breaks after "_", "/" or "." only."""
    return re.sub(r"([_/.])", r"\1<wbr>", _esc(name))


def _inline(text: str) -> str:
    """A report.md line as HTML: escaped, **bold** and `code` (a name, breaking as _name does) kept."""
    parts = re.split(r"(`[^`]*`)", text)
    html_parts = [f"<code>{_name(p[1:-1])}</code>" if p.startswith("`") and p.endswith("`") else _esc(p) for p in parts]
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", "".join(html_parts))


def _scroll(table: str) -> str:
    """A table in a box of its own that scrolls sideways, so that a wide table never widens the page."""
    return f'<div class="scroll">{table}</div>'


def _badge(status: str) -> str:
    return f'<span class="badge" style="background:{STATUS_COLOURS.get(status, "#57606a")}">{_esc(status)}</span>'


def _named(docs: list[Manifest]) -> Iterator[tuple[str, ArtifactResult]]:
    """(display name, artifact): names carry the target when several targets share the page."""
    for doc in docs:
        for a in doc.artifacts:
            yield (f"{doc.target['name']}/{a.name}" if len(docs) > 1 else a.name), a


def _svg(label: str, width: float, height: float) -> str:
    return (
        f'<svg role="img" aria-label="{_esc(label)}" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}">'
    )


CHART_WIDTH = 350  # px: fits a 390 px phone (the page's padding taken off) at scale 1, so chart text stays 12px
BAR = 12  # a bar's height; each bar has a text LINE of its own


def _bar_chart(label: str, groups: list[tuple[str, list[tuple[float, str, str]]]], note: str, width: int) -> str:
    """Horizontal bars in groups: each group's name on a line of its own, the whole width, then its bars
    (value, text after the bar, colour), one LINE each; `note` wrapped under them."""
    top = max((value for _, bars in groups for value, _, _ in bars), default=0.0) or 1.0
    span = width - 12 - max(svg_text.text_width(shown) for _, bars in groups for _, shown, _ in bars)
    parts, y = [], 2.0
    for name, bars in groups:
        parts.append(svg_text.text(4, y + svg_text.ASCENT * svg_text.FONT_PX, svg_text.fit(name, width - 8), full=name))
        y += svg_text.LINE
        for value, shown, colour in bars:
            w = max(1.0, span * value / top)
            middle = y + svg_text.LINE / 2  # the bar and its text centred on one line
            parts.append(f'<rect x="4" y="{middle - BAR / 2:.1f}" width="{w:.1f}" height="{BAR}" fill="{colour}"/>')
            parts.append(
                svg_text.text(8 + w, middle + svg_text.FONT_PX * (svg_text.ASCENT - svg_text.DESCENT) / 2, shown)
            )
            y += svg_text.LINE
        y += 4
    for line in svg_text.wrap(note, width - 8):
        parts.append(svg_text.text(4, y + svg_text.ASCENT * svg_text.FONT_PX, line, attrs=' class="meta"'))
        y += svg_text.LINE
    return _svg(label, width, y + 2) + "".join(parts) + "</svg>"


def latency_chart(docs: list[Manifest], width: int = CHART_WIDTH) -> str:
    """Per artifact, its p50 (blue); eager's p50 (grey) once, when every artifact was timed against the build's one
    eager baseline, else beside each artifact as it was measured in the same run (manifests from before the
    baseline)."""
    timed = [(name, a) for name, a in _named(docs) if a.latency_ms is not None]
    if not timed:
        return "<p class=meta>No latency was measured on this host.</p>"
    eager = {a.eager_latency_ms.p50 for _, a in timed}
    grey = "#8c959f"
    groups = [(name, [(a.latency_ms.p50, f"{a.latency_ms.p50:.2f} ms", "#0969da")]) for name, a in timed]
    if len(eager) == 1:
        (p50,) = eager
        groups.insert(0, ("eager (the build's baseline)", [(p50, f"{p50:.2f} ms", grey)]))
        note = f"p50 latency, batch 1, {docs[0].host.threads} threads; grey: eager, timed once for the build"
    else:
        for (_, bars), (_, a) in zip(groups, timed):
            bars.append((a.eager_latency_ms.p50, f"{a.eager_latency_ms.p50:.2f} ms eager", grey))
        note = f"p50 latency, batch 1, {docs[0].host.threads} threads; grey: eager in the same run"
    return _bar_chart("latency p50", groups, note, width)


def sensitivity_chart(name: str, q: dict, width: int = CHART_WIDTH, most: int = 24) -> str:
    """The layers that cost most when alone int8 (output PSNR vs eager, lower is worse); float ones in red."""
    kept = {f["name"] for f in q.get("float_layers", [])}
    measured = (q.get("sensitivity") or {}).get("output_psnr_db") or {}
    values = sorted(((layer, v) for layer, v in measured.items() if v is not None), key=lambda item: item[1])[:most]
    if not values:
        return ""
    groups = [
        (
            layer,
            [(value, f"{value:.1f} dB{' float' if layer in kept else ''}", "#cf222e" if layer in kept else "#0969da")],
        )
        for layer, value in values
    ]
    note = (
        f"output PSNR vs eager with only that layer int8 · {len(values)} worst of {q['layers']} layers · "
        f"red: kept in float"
    )
    return _bar_chart(f"int8 layer sensitivity of {name}", groups, note, width)


def ticks(low: float, high: float, most: int = 5) -> list[float]:
    """Round values (1, 2 or 5 × a power of ten apart), at most `most`, the first ≤ low and the last ≥ high."""
    span = high - low if high > low else max(abs(high), 1.0)
    magnitude = 10 ** math.floor(math.log10(span / (most - 1)))
    step = next(
        m * magnitude
        for m in (1, 2, 5, 10, 20, 50)
        if math.ceil(high / (m * magnitude)) - math.floor(low / (m * magnitude)) <= most - 1
    )
    first, last = math.floor(low / step), math.ceil(high / step)
    return [round(k * step, 10) for k in range(first, max(last, first + 1) + 1)]


def _tick_text(value: float, values: list[float]) -> str:
    step = values[1] - values[0]
    return f"{value:.{max(0, -math.floor(math.log10(step)))}f}"


def _axis_ranges(points, percent: bool) -> tuple[list[float], list[float]]:
    """Ticks for the size axis (from 0) and the metric axis: one point, or points that agree, get a range of a few
    units around them; a percentage stays within 0–100."""
    xs, ys = [p[1] for p in points], [p[2] for p in points]
    low, high = min(ys), max(ys)
    pad = max((high - low) * 0.1, 1.0 if high - low < 1.0 else 0.0)
    low, high = low - pad, high + pad
    if percent:
        low, high = max(low, 0.0), min(high, 100.0)
    y_ticks = [t for t in ticks(low, high) if not percent or 0 <= t <= 100]
    return ticks(0.0, max(xs) * 1.1), y_ticks


def accuracy_size_chart(docs: list[Manifest], width: int = CHART_WIDTH, height: int = 250) -> str:
    """Each artifact's labeled metric against its size, on axes with round ticks; labels placed so that none
    overlaps another (svg_text.place), the point coloured by the artifact's status."""
    _, (metric, _, label) = COLUMNS[task_name(docs[0])]
    points = [
        (name, a.size_bytes / 1e6, a.accuracy[metric], str(a.status))
        for name, a in _named(docs)
        if a.accuracy and a.size_bytes and a.accuracy.get(metric) is not None
    ]
    if not points:
        if not any(d.data.get("labeled") for d in docs):
            return "<p class=meta>Accuracy vs size needs labeled --data.</p>"
        return f"<p class=meta>No artifact has both a measured {_esc(label)} and a size: nothing to plot.</p>"
    percent = metric != "epe"
    x_ticks, y_ticks = _axis_ranges(points, percent)
    left, right, top, bottom = 44, width - 12, 30, height - 36
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def sx(x):
        return left + (right - left) * (x - x0) / (x1 - x0)

    def sy(y):
        return bottom - (bottom - top) * (y - y0) / max(y1 - y0, 1e-9)

    centre = svg_text.FONT_PX * (svg_text.ASCENT - svg_text.DESCENT) / 2
    # (x, baseline, text, anchor, attrs): the axes' titles, then their ticks
    axis = [(4, 14, f"{label} %" if percent else label, "start", ""), (right, height - 3, "size MB", "end", "")]
    axis += [(left - 6, sy(v) + centre, _tick_text(v, y_ticks), "end", ' class="tick"') for v in y_ticks]
    axis += [(sx(v), bottom + 16, _tick_text(v, x_ticks), "middle", ' class="tick"') for v in x_ticks]
    grid = [f'<line x1="{left}" y1="{sy(v):.1f}" x2="{right}" y2="{sy(v):.1f}" stroke="#eaeef2"/>' for v in y_ticks]
    grid += [
        f'<line x1="{sx(v):.1f}" y1="{bottom}" x2="{sx(v):.1f}" y2="{bottom + 4}" stroke="#8c959f"/>' for v in x_ticks
    ]
    plot = Box(left + 2, 2, width - 2, bottom - 2)
    labels = svg_text.place(
        [(sx(x), sy(y), name) for name, x, y, _ in points],
        plot,
        [svg_text.text_box(x, y, t, anchor) for x, y, t, anchor, _ in axis],
        overflow_y=height + 2,
    )
    below = svg_text.overflow_rows(labels, plot)
    total = height + 2 + below * svg_text.LINE + (2 if below else 0)
    parts = [
        _svg(f"{label} vs size", width, total),
        *grid,
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#8c959f"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#8c959f"/>',
        *(svg_text.text(x, y, t, anchor, attrs=attrs) for x, y, t, anchor, attrs in axis),
    ]
    for (name, x, y, status), placed in zip(points, labels):
        if placed.leader:
            lx0, ly0, lx1, ly1 = placed.leader
            parts.append(
                f'<line x1="{lx0:.1f}" y1="{ly0:.1f}" x2="{lx1:.1f}" y2="{ly1:.1f}" stroke="#8c959f" stroke-width="0.8"/>'
            )
    unit = "%" if percent else ""
    for (name, x, y, status), placed in zip(points, labels):
        parts.append(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{STATUS_COLOURS.get(status, "#57606a")}">'
            f"<title>{_esc(name)} ({_esc(status)}): {label} {y:.2f}{unit} at {x:.2f} MB</title></circle>"
        )
        parts.append(svg_text.text(placed.x, placed.y, placed.text, placed.anchor, full=placed.full))
    return "".join(parts) + "</svg>"


def _quantization(docs: list[Manifest]) -> str:
    from .report import quantization_summary, retry_summary

    sections = []
    for name, a in _named(docs):
        q = (a.details or {}).get("quantization")
        if q:
            chart = sensitivity_chart(name, q) or (
                "<p class=meta>Plain PTQ met the budget: no layer sensitivity was needed.</p>"
                if (q.get("before") or {}).get("meets_budget", True)
                else "<p class=meta>No layer sensitivity was measured.</p>"
            )
            retry = f"<p>{_esc(retry_summary(a.details))}</p>" if a.details.get("validation_retry") else ""
            summary = _esc(quantization_summary(q).replace("**", ""))
            sections.append(f"<h3>{_name(name)}</h3><p>{summary}</p>{retry}{chart}")
    return "<h2>int8: budget and layer sensitivity</h2>" + "".join(sections) if sections else ""


def _profiles(docs: list[Manifest]) -> str:
    """Per artifact, side by side: its RAM figures and its top operators by time (manifest `memory`, `profile`)."""
    from .report import busy_profile, memory_line, profile_line, profile_repeats_memory

    cards = []
    for name, a in _named(docs):
        memory, profile = a.memory, a.profile
        if memory is None and profile is None:
            continue
        body = f"<p class=meta>{_esc(memory_line(memory))}</p>"
        if profile is not None and profile.available:
            ops = "".join(
                f"<tr><td class=name>{_esc(o.op)}</td><td>{o.ms:.3f}</td><td>{_esc(o.count)}</td>"
                f"<td>{o.share:.0%}</td></tr>"
                for o in profile.ops
            )
            body += (
                _scroll(
                    "<table><thead><tr><th>operator</th><th>ms/run</th><th>calls</th><th>share</th></tr></thead>"
                    f"<tbody>{ops}</tbody></table>"
                )
                + f"<p class=meta>{profile.ops_ms:.2f} ms in operators of "
                f"{profile.wall_ms:.2f} ms a run, {profile.runs} profiled run{'s' if profile.runs != 1 else ''}"
                f" apart from the timed ones; "
                f"{_esc(profile.source)}{_esc(busy_profile(profile))}</p>"
            )
        elif profile is not None and not profile_repeats_memory(profile, memory):
            body += f"<p class=meta>{_esc(profile_line(profile))}</p>"
        cards.append(f'<div style="flex:1 1 300px;min-width:0"><h3>{_name(name)}</h3>{body}</div>')
    return ("<h2>RAM and where the time goes</h2><div class=charts>" + "".join(cards) + "</div>") if cards else ""


def _reasons(docs: list[Manifest]) -> str:
    items = [
        f"<li><b>{_name(name)}</b> {_badge(str(a.status))} {_esc(r)}</li>"
        for name, a in _named(docs)
        for r in texts(a.reasons)
    ]
    items += [
        f"<li><b>{_name(name)}</b> {_esc(outliers_summary(a))}</li>" for name, a in _named(docs) if a.outlier_inputs
    ]
    return f"<h2>Why not passed</h2><ul>{''.join(items)}</ul>" if items else ""


def _latency_warning(docs: list[Manifest]) -> str:
    """Beside the table and the latency chart: which latencies were taken on a busy host, and why."""
    parts = []
    for doc in docs:
        head, noisy = latency_warnings(doc)
        if head:
            where = f"{doc.target['name']}: " if len(docs) > 1 else ""
            items = "".join(f"<li><b>{_esc(name)}</b>: {_esc(why)}</li>" for name, why in noisy)
            parts.append(f'<div class="busy"><p><b>{_esc(where + head)}:</b></p><ul>{items}</ul></div>')
    return "".join(parts)


def _table(docs: list[Manifest]) -> str:
    table = [({"target": d.target["name"]} if len(docs) > 1 else {}) | r for d in docs for r in rows(d)]
    head = "".join(f"<th{' class=name' if h == 'artifact' else ''}>{_esc(h)}</th>" for h in table[0]) if table else ""
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="status">{_badge(v)}</td>'
            if k == "status"
            else f'<td class="name" title="{_esc(v)}">{_name(v)}</td>'
            if k == "artifact"
            else f"<td>{_esc(v)}</td>"
            for k, v in r.items()
        )
        + "</tr>"
        for r in table
    )
    return _scroll(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


SAME = {
    "classification": "the same top-1 class as eager",
    "segmentation": "the same class as eager on every pixel",
    "detection": "the same boxes as eager",
    "video": "the same top-1 class as eager",
    "optical_flow": "the same flow as eager on every pixel",
}


def _panels(doc: Manifest) -> str:
    task = task_name(doc)
    if task == "video":
        return "the clip's middle frame | eager's five likeliest classes, eager (grey) over the artifact (blue; red when its top-1 differs)"
    if task == "classification":
        return (
            "input | eager's five likeliest classes, eager (grey) over the artifact (blue; red when its top-1 differs)"
        )
    if task == "segmentation":
        return "input | eager mask | artifact mask, pixels whose class differs in white"
    if task == "optical_flow":
        return "frame 1 | eager's flow | the artifact's flow (hue: direction, saturation: length)"
    score = ((doc.task or {}).get("decode") or {}).get("match_score")
    return f"input | eager boxes | artifact boxes{f' (score ≥ {score})' if score is not None else ''}"


def _preview(doc: Manifest, a: ArtifactResult, name: str, directory: Path) -> str:
    """One artifact's figure: the inputs where it departs most, open when the departure is one a person sees
    (a flipped class, a changed pixel, an unmatched box), folded into one line when only raw numbers move."""
    path = Path(directory) / a.preview
    if not path.is_file():
        return ""
    img = f'<img alt="{_esc(name)}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'
    rows = a.preview_rows
    if not rows:  # a manifest from before the rows were recorded: which inputs is not known
        return f"<figure><figcaption><b>{_esc(name)}</b>: {_esc(_panels(doc))}</figcaption>{img}</figure>"
    count = (a.fidelity or {}).get("samples") or doc.data["validation"]
    if previews.visible(rows[0]):
        shown = sum(map(previews.visible, rows))
        which = (
            f"the {shown} of {count} validation inputs where it departs most from eager"
            if shown == previews.MOST
            else f"the only {'input' if shown == 1 else f'{shown} inputs'} of {count} where it departs visibly from eager"
        )
        caption = f"<b>{_esc(name)}</b>: {which}; {_esc(_panels(doc))}"
        return f"<figure><figcaption>{caption}</figcaption>{img}</figure>"
    raw = ", ".join(previews.term(k, v) for k, v in list(rows[0]["departure"].items())[1:])
    summary = (
        f"<b>{_esc(name)}</b>: {SAME.get(task_name(doc), 'the same as eager')} on all {count} validation inputs; "
        f"only raw numbers differ (furthest: input {rows[0]['row']}, {_esc(raw)})"
    )
    caption = f"the {len(rows)} inputs with the largest raw difference; {_esc(_panels(doc))}"
    return f"<details><summary>{summary}</summary><figure><figcaption>{caption}</figcaption>{img}</figure></details>"


def _previews(docs: list[Manifest], dirs: list[Path] | None) -> str:
    """Per artifact, the task's pictures (input | eager | artifact) of the inputs where it departs most from
    eager, inlined so that the page stays one file; artifacts bit-identical to eager share one line."""
    parts = []
    for doc, directory in zip(docs, dirs or []):
        identical = []
        for a in doc.artifacts:
            name = f"{doc.target['name']}/{a.name}" if len(docs) > 1 else a.name
            if a.preview_rows == []:
                identical.append(name)
            elif a.preview:
                parts.append(_preview(doc, a, name, directory))
        if identical:
            count = doc.data["validation"]
            parts.append(
                f"<p>Bit-identical to eager on all {count} validation inputs, nothing to show: "
                f"<b>{_esc(', '.join(identical))}</b>.</p>"
            )
    parts = [p for p in parts if p]
    return "<h2>Where the artifacts depart from eager</h2>" + "".join(parts) if parts else ""


def _ship(docs: list[Manifest]) -> str:
    """One "ship this" line per target (exporter.release.recommend)."""
    lines = []
    for doc in docs:
        head, _, rest = recommend.shown(doc).partition(": ")
        lines.append(f"<p><b>{_esc(head)}:</b> {_esc(rest)}</p>")
        others = recommend.not_picked_line(doc)
        if others:
            lines.append(f"<p>{_esc(others)}</p>")
    return f'<div class="ship">{"".join(lines)}</div>'


def _per_target(docs: list[Manifest], body) -> str:
    """body(doc) for each target, under the target's name when the page has several."""
    if len(docs) == 1:
        return body(docs[0])
    return "".join(f"<h3>{_esc(doc.target['name'])}</h3>{body(doc)}" for doc in docs)


def _about(docs: list[Manifest]) -> str:
    """report.md's opening bullets (report.about): once when every target's are the same, else per target."""

    def body(doc: Manifest) -> str:
        return '<ul class="meta">' + "".join(f"<li>{_inline(line)}</li>" for line in about(doc)) + "</ul>"

    return body(docs[0]) if all(about(doc) == about(docs[0]) for doc in docs) else _per_target(docs, body)


def _notes(docs: list[Manifest]) -> str:
    """report.md's Notes, wall time and thresholds (report.notes, report.closing), per target: the same lines."""

    def body(doc: Manifest) -> str:
        said = "".join(f"<li>{_inline(line)}</li>" for line in notes(doc))
        return (f"<ul>{said}</ul>" if said else "") + "".join(f"<p>{_inline(line)}</p>" for line in closing(doc))

    return "<h2>Notes</h2>" + _per_target(docs, body)


def render(docs: list[Manifest], dirs: list[Path] | None = None) -> str:
    """One page for one build, or for several targets of the same weight side by side; `dirs` are the
    builds' directories, where the pictures named by the manifests are."""
    first = docs[0]
    status = "failed" if any(d.status is Status.FAILED for d in docs) else "passed"
    targets = ", ".join(d.target["name"] for d in docs)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_esc(first.weight.name)} → {_esc(targets)}</title>
<style>{CSS}</style></head><body>
<h1>{_name(first.weight.name)} → {_esc(targets)} {_badge(status)}</h1>
{_about(docs)}
<p class="meta">exporter {_esc(first.exporter_version)}, torch {_esc(first.tools.get("torch"))}</p>
{_ship(docs)}
{_table(docs)}
{_latency_warning(docs)}
{_reasons(docs)}
{arch_report.html(docs)}
{_notes(docs)}
{_previews(docs, dirs)}
{_quantization(docs)}
{_profiles(docs)}
<h2>Latency against eager (same run, same threads)</h2>
{_latency_warning(docs)}
<div class="charts">{latency_chart(docs)}</div>
<h2>Labeled accuracy against size</h2>
<div class="charts">{accuracy_size_chart(docs)}</div>
</body></html>
"""
