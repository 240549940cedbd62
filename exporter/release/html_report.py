"""OUT/report.html: one self-contained page (inline CSS and SVG, opens offline)."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from ..results import texts
from . import arch_report, previews, recommend, svg_text
from .report import COLUMNS, eager_summary, latency_warnings, outliers_summary, rows, task_name
from .svg_text import Box

STATUS_COLOURS = {"passed": "#1a7f37", "failed": "#cf222e", "unavailable": "#9a6700"}
CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:1100px;color:#1f2328;padding:0 1rem}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #d0d7de;padding:.35rem .5rem;text-align:right;white-space:nowrap}
th:first-child,td:first-child,td.status{text-align:left}
td.name{white-space:normal;overflow-wrap:anywhere}
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


def _badge(status: str) -> str:
    return f'<span class="badge" style="background:{STATUS_COLOURS.get(status, "#57606a")}">{_esc(status)}</span>'


def _named(docs: list[dict]):
    """(display name, artifact): names carry the target when several targets share the page."""
    for doc in docs:
        for a in doc["artifacts"]:
            yield (f"{doc['target']['name']}/{a['name']}" if len(docs) > 1 else a["name"]), a


def _svg(label: str, width: float, height: float) -> str:
    return (
        f'<svg role="img" aria-label="{_esc(label)}" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}">'
    )


def latency_chart(docs: list[dict], width: int = 620) -> str:
    """Horizontal bars: p50 of each artifact beside the eager p50 measured in the same run."""
    bars = []
    for name, a in _named(docs):
        if a.get("latency_ms"):
            bars.append((name, a["latency_ms"]["p50"], "#0969da"))
            bars.append((f"eager (vs {name})", a["eager_latency_ms"]["p50"], "#8c959f"))
    if not bars:
        return "<p class=meta>No latency was measured on this host.</p>"
    top = max(v for _, v, _ in bars) or 1.0
    label_w, row_h = 300, 20
    values = [f"{value:.2f} ms" for _, value, _ in bars]
    span = width - label_w - 8 - max(svg_text.text_width(v) for v in values)  # the longest bar and its value fit
    height = row_h * len(bars) + 30
    parts = [_svg("latency p50", width, height)]
    for i, ((label, value, colour), shown) in enumerate(zip(bars, values)):
        y = 10 + i * row_h
        w = span * value / top
        parts.append(svg_text.text(label_w - 6, y + 13, svg_text.fit(label, label_w - 10), "end", full=label))
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 6}" fill="{colour}"/>')
        parts.append(svg_text.text(label_w + w + 4, y + 13, shown))
    note = f"p50 latency, batch 1, {docs[0]['host']['threads']} threads"
    parts.append(svg_text.text(4, height - 6, svg_text.fit(note, width - 8), full=note, attrs=' class="meta"'))
    return "".join(parts) + "</svg>"


def accuracy_size_chart(docs: list[dict], width: int = 640, height: int = 280) -> str:
    """Each artifact's labeled metric against its size; labels placed so that none overlaps another
    (svg_text.place), the point coloured by the artifact's status."""
    _, (metric, _, label) = COLUMNS[task_name(docs[0])]
    points = [
        (name, a["size_bytes"] / 1e6, a["accuracy"][metric], a["status"])
        for name, a in _named(docs)
        if a.get("accuracy") and a.get("size_bytes") and a["accuracy"].get(metric) is not None
    ]
    if not points:
        return "<p class=meta>Accuracy vs size needs labeled --data.</p>"
    left, bottom, pad = 50, 30, 12
    xs, ys = [p[1] for p in points], [p[2] for p in points]
    x0, x1 = 0.0, max(xs) * 1.15
    y0 = math.floor(min(ys) - 1)
    y1 = max(min(math.ceil(max(ys) + 0.5), 100), math.ceil(max(ys)))  # percentages: no axis past 100%

    def sx(x):
        return left + (width - left - pad) * (x - x0) / (x1 - x0)

    def sy(y):
        return height - bottom - (height - bottom - pad) * (y - y0) / max(y1 - y0, 1e-9)

    axis_note = f"size MB (0 – {x1:.1f})"
    # (x, baseline, text, anchor): the size axis titled at its right end, clear of overflow labels' leader lines
    axis = [
        (width - pad, height - 8, axis_note, "end"),
        (4, pad + 10, f"{y1:.0f}%", "start"),
        (4, height - bottom, f"{y0:.0f}%", "start"),
    ]
    plot = Box(left + 2, 2, width - 2, height - bottom - 2)
    labels = svg_text.place(
        [(sx(x), sy(y), name) for name, x, y, _ in points],
        plot,
        [svg_text.text_box(*a) for a in axis],
        overflow_y=height + 2,
    )
    below = svg_text.overflow_rows(labels, plot)
    total = height + 2 + below * svg_text.LINE + (2 if below else 0)
    parts = [
        _svg(f"{label} vs size", width, total),
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - pad}" y2="{height - bottom}" stroke="#8c959f"/>',
        f'<line x1="{left}" y1="{pad}" x2="{left}" y2="{height - bottom}" stroke="#8c959f"/>',
        *(svg_text.text(x, y, t, anchor) for x, y, t, anchor in axis),
    ]
    for (name, x, y, status), placed in zip(points, labels):
        if placed.leader:
            lx0, ly0, lx1, ly1 = placed.leader
            parts.append(
                f'<line x1="{lx0:.1f}" y1="{ly0:.1f}" x2="{lx1:.1f}" y2="{ly1:.1f}" stroke="#8c959f" stroke-width="0.8"/>'
            )
    for (name, x, y, status), placed in zip(points, labels):
        parts.append(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{STATUS_COLOURS.get(status, "#57606a")}">'
            f"<title>{_esc(name)} ({_esc(status)}): {y:.2f}% at {x:.2f} MB</title></circle>"
        )
        parts.append(svg_text.text(placed.x, placed.y, placed.text, placed.anchor, full=placed.full))
    return "".join(parts) + "</svg>"


def sensitivity_chart(name: str, q: dict, width: int = 620, most: int = 24) -> str:
    """The layers that cost most when alone int8 (output PSNR vs eager, lower is worse); float ones in red."""
    kept = {f["name"] for f in q.get("float_layers", [])}
    measured = (q.get("sensitivity") or {}).get("output_psnr_db") or {}
    values = sorted(((layer, v) for layer, v in measured.items() if v is not None), key=lambda item: item[1])[:most]
    if not values:
        return ""
    top = max(v for _, v in values) or 1.0
    label_w, row_h = 260, 18
    shown = [f"{value:.1f} dB{' float' if layer in kept else ''}" for layer, value in values]
    span = width - label_w - 8 - max(svg_text.text_width(v) for v in shown)
    height = row_h * len(values) + 34
    parts = [_svg(f"int8 layer sensitivity of {name}", width, height)]
    for i, ((layer, value), text) in enumerate(zip(values, shown)):
        y = 8 + i * row_h
        w = max(1.0, span * value / top)
        colour = "#cf222e" if layer in kept else "#0969da"
        parts.append(svg_text.text(label_w - 6, y + 12, svg_text.fit(layer, label_w - 10), "end", full=layer))
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 5}" fill="{colour}"/>')
        parts.append(svg_text.text(label_w + w + 4, y + 12, text))
    note = (
        f"output PSNR vs eager with only that layer int8 · {len(values)} worst of {q['layers']} layers · "
        f"red: kept in float"
    )
    parts.append(svg_text.text(4, height - 8, svg_text.fit(note, width - 8), full=note, attrs=' class="meta"'))
    return "".join(parts) + "</svg>"


def _quantization(docs: list[dict]) -> str:
    from .report import quantization_summary, retry_summary

    sections = []
    for name, a in _named(docs):
        q = (a.get("details") or {}).get("quantization")
        if q:
            chart = sensitivity_chart(name, q) or (
                "<p class=meta>Plain PTQ met the budget: no layer sensitivity was needed.</p>"
                if (q.get("before") or {}).get("meets_budget", True)
                else "<p class=meta>No layer sensitivity was measured.</p>"
            )
            retry = f"<p>{_esc(retry_summary(a['details']))}</p>" if a["details"].get("validation_retry") else ""
            summary = _esc(quantization_summary(q).replace("**", ""))
            sections.append(f"<h3>{_esc(name)}</h3><p>{summary}</p>{retry}{chart}")
    return "<h2>int8: budget and layer sensitivity</h2>" + "".join(sections) if sections else ""


def _profiles(docs: list[dict]) -> str:
    """Per artifact, side by side: its RAM figures and its top operators by time (manifest `memory`, `profile`)."""
    from .report import busy_profile, memory_line, profile_line

    cards = []
    for name, a in _named(docs):
        memory, profile = a.get("memory"), a.get("profile")
        if not memory and not profile:
            continue
        body = f"<p class=meta>{_esc(memory_line(memory or {}))}</p>"
        if (profile or {}).get("available"):
            ops = "".join(
                f"<tr><td class=name>{_esc(o['op'])}</td><td>{o['ms']:.3f}</td><td>{_esc(o['count'])}</td>"
                f"<td>{o['share']:.0%}</td></tr>"
                for o in profile["ops"]
            )
            body += (
                f"<table><thead><tr><th>operator</th><th>ms/run</th><th>calls</th><th>share</th></tr></thead>"
                f"<tbody>{ops}</tbody></table><p class=meta>{profile['ops_ms']:.2f} ms in operators of "
                f"{profile['wall_ms']:.2f} ms a run, {profile['runs']} profiled run{'s' if profile['runs'] != 1 else ''}"
                f" apart from the timed ones; "
                f"{_esc(profile['source'])}{_esc(busy_profile(profile))}</p>"
            )
        elif profile and profile != memory:
            body += f"<p class=meta>{_esc(profile_line(profile))}</p>"
        cards.append(f'<div style="flex:1 1 300px;min-width:300px"><h3>{_esc(name)}</h3>{body}</div>')
    return ("<h2>RAM and where the time goes</h2><div class=charts>" + "".join(cards) + "</div>") if cards else ""


def _reasons(docs: list[dict]) -> str:
    items = [
        f"<li><b>{_esc(name)}</b> {_badge(a['status'])} {_esc(r)}</li>"
        for name, a in _named(docs)
        for r in texts(a.get("reasons"))
    ]
    items += [
        f"<li><b>{_esc(name)}</b> {_esc(outliers_summary(a))}</li>"
        for name, a in _named(docs)
        if a.get("outlier_inputs")
    ]
    return f"<h2>Why not passed</h2><ul>{''.join(items)}</ul>" if items else ""


def _latency_warning(docs: list[dict]) -> str:
    """Beside the table and the latency chart: which latencies were taken on a busy host, and why."""
    parts = []
    for doc in docs:
        head, noisy = latency_warnings(doc)
        if head:
            where = f"{doc['target']['name']}: " if len(docs) > 1 else ""
            items = "".join(f"<li><b>{_esc(name)}</b>: {_esc(why)}</li>" for name, why in noisy)
            parts.append(f'<div class="busy"><p><b>{_esc(where + head)}.</b></p><ul>{items}</ul></div>')
    return "".join(parts)


def _table(docs: list[dict]) -> str:
    table = [({"target": d["target"]["name"]} if len(docs) > 1 else {}) | r for d in docs for r in rows(d)]
    head = "".join(f"<th>{_esc(h)}</th>" for h in table[0]) if table else ""
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="status">{_badge(v)}</td>'
            if k == "status"
            else f'<td class="name">{_esc(v)}</td>'
            if k == "artifact"
            else f"<td>{_esc(v)}</td>"
            for k, v in r.items()
        )
        + "</tr>"
        for r in table
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


SAME = {
    "classification": "the same top-1 class as eager",
    "segmentation": "the same class as eager on every pixel",
    "detection": "the same boxes as eager",
    "video": "the same top-1 class as eager",
    "optical_flow": "the same flow as eager on every pixel",
}


def _panels(doc: dict) -> str:
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
    score = ((doc.get("task") or {}).get("decode") or {}).get("match_score")
    return f"input | eager boxes | artifact boxes{f' (score ≥ {score})' if score is not None else ''}"


def _preview(doc: dict, a: dict, name: str, directory: Path) -> str:
    """One artifact's figure: the inputs where it departs most, open when the departure is one a person sees
    (a flipped class, a changed pixel, an unmatched box), folded into one line when only raw numbers move."""
    path = Path(directory) / a["preview"]
    if not path.is_file():
        return ""
    img = f'<img alt="{_esc(name)}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'
    rows = a.get("preview_rows")
    if not rows:  # a manifest from before the rows were recorded: which inputs is not known
        return f"<figure><figcaption><b>{_esc(name)}</b>: {_esc(_panels(doc))}</figcaption>{img}</figure>"
    count = (a.get("fidelity") or {}).get("samples") or doc["data"]["validation"]
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


def _previews(docs: list[dict], dirs: list[Path] | None) -> str:
    """Per artifact, the task's pictures (input | eager | artifact) of the inputs where it departs most from
    eager, inlined so that the page stays one file; artifacts bit-identical to eager share one line."""
    parts = []
    for doc, directory in zip(docs, dirs or []):
        identical = []
        for a in doc["artifacts"]:
            name = f"{doc['target']['name']}/{a['name']}" if len(docs) > 1 else a["name"]
            if a.get("preview_rows") == []:
                identical.append(name)
            elif a.get("preview"):
                parts.append(_preview(doc, a, name, directory))
        if identical:
            count = doc["data"]["validation"]
            parts.append(
                f"<p>Bit-identical to eager on all {count} validation inputs, nothing to show: "
                f"<b>{_esc(', '.join(identical))}</b>.</p>"
            )
    parts = [p for p in parts if p]
    return "<h2>Where the artifacts depart from eager</h2>" + "".join(parts) if parts else ""


def _ship(docs: list[dict]) -> str:
    """One "ship this" line per target (exporter.release.recommend)."""
    lines = []
    for doc in docs:
        head, _, rest = recommend.line(doc).partition(": ")
        lines.append(f"<p><b>{_esc(head)}:</b> {_esc(rest)}</p>")
    return f'<div class="ship">{"".join(lines)}</div>'


def render(docs: list[dict], dirs: list[Path] | None = None) -> str:
    """One page for one build, or for several targets of the same weight side by side; `dirs` are the
    builds' directories, where the pictures named by the manifests are."""
    first = docs[0]
    status = "failed" if any(d["status"] == "failed" for d in docs) else "passed"
    targets = ", ".join(d["target"]["name"] for d in docs)
    host, data = first["host"], first["data"]
    eager_text = f"{task_name(first)}; eager {eager_summary(first).replace('**', '')}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc(first["weight"]["name"])} → {_esc(targets)}</title>
<style>{CSS}</style></head><body>
<h1>{_esc(first["weight"]["name"])} → {_esc(targets)} {_badge(status)}</h1>
<p class="meta">{_esc(first["weight"]["model"])}, {first["weight"]["num_classes"]} classes · {_esc(eager_text)} ·
{_esc(data["validation"])} validation images from {_esc(data["source"])} · {_esc(host["cpu"])}, {host["threads"]} threads for every runtime ·
exporter {_esc(first["exporter_version"])}, torch {_esc(first["tools"].get("torch"))}</p>
{_ship(docs)}
{_table(docs)}
{_latency_warning(docs)}
{_reasons(docs)}
{arch_report.html(docs)}
{_previews(docs, dirs)}
{_quantization(docs)}
{_profiles(docs)}
<h2>Latency against eager (same run, same threads)</h2>
{_latency_warning(docs)}
<div class="charts">{latency_chart(docs)}</div>
<h2>Labeled accuracy against size</h2>
<div class="charts">{accuracy_size_chart(docs)}</div>
</body></html>
"""  # noqa: E501  (the page itself)
