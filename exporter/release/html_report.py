"""OUT/report.html: one self-contained page (inline CSS and SVG, opens offline)."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from .report import COLUMNS, eager_summary, rows, task_name

STATUS_COLOURS = {"passed": "#1a7f37", "failed": "#cf222e", "unavailable": "#9a6700"}
CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:1100px;color:#1f2328;padding:0 1rem}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #d0d7de;padding:.35rem .5rem;text-align:right;white-space:nowrap}
th:first-child,td:first-child,td.status{text-align:left}
.badge{color:#fff;border-radius:1rem;padding:.05rem .55rem;font-size:.85em}
.meta{color:#57606a}.charts{display:flex;gap:2rem;flex-wrap:wrap}
svg text{font:12px system-ui,sans-serif;fill:#1f2328}
li{margin:.2rem 0}
figure{margin:1rem 0}img{image-rendering:pixelated;max-width:100%}figcaption{color:#57606a}
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


def latency_chart(docs: list[dict], width: int = 620) -> str:
    """Horizontal bars: p50 of each artifact beside the eager p50 measured in the same run."""
    bars = []
    for name, a in _named(docs):
        if a.get("latency_ms"):
            bars.append((name, a["latency_ms"]["p50"], "#0969da"))
            bars.append((f"eager (vs {name})", a["eager_latency_ms"]["p50"], "#8c959f"))
    if not bars:
        return "<p class=meta>No latency was measured on this host.</p>"
    top = max(v for _, v, _ in bars)
    label_w, row_h = 300, 20
    height = row_h * len(bars) + 30
    parts = [f'<svg role="img" aria-label="latency p50" width="{width}" height="{height}">']
    for i, (label, value, colour) in enumerate(bars):
        y = 10 + i * row_h
        w = (width - label_w - 70) * value / top
        parts.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">{_esc(label)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 6}" fill="{colour}"/>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 13}">{value:.2f} ms</text>')
    parts.append(f'<text x="{label_w}" y="{height - 4}" class="meta">p50 latency, batch 1, {docs[0]["host"]["threads"]} threads</text>')
    return "".join(parts) + "</svg>"


def accuracy_size_chart(docs: list[dict], width: int = 640, height: int = 280) -> str:
    _, (metric, _, label) = COLUMNS[task_name(docs[0])]
    points = [
        (name, a["size_bytes"] / 1e6, a["accuracy"][metric])
        for name, a in _named(docs)
        if a.get("accuracy") and a.get("size_bytes")
    ]
    if not points:
        return "<p class=meta>Accuracy vs size needs labeled --data.</p>"
    left, bottom, pad = 50, 30, 12
    xs, ys = [p[1] for p in points], [p[2] for p in points]
    x0, x1 = 0.0, max(xs) * 1.15
    y0 = math.floor(min(ys) - 1)
    y1 = math.ceil(max(ys) + 0.5)

    def sx(x):
        return left + (width - left - pad) * (x - x0) / (x1 - x0)

    def sy(y):
        return height - bottom - (height - bottom - pad) * (y - y0) / max(y1 - y0, 1e-9)

    parts = [f'<svg role="img" aria-label="{label} vs size" width="{width}" height="{height}">',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - pad}" y2="{height - bottom}" stroke="#8c959f"/>',
             f'<line x1="{left}" y1="{pad}" x2="{left}" y2="{height - bottom}" stroke="#8c959f"/>',
             f'<text x="{left}" y="{height - 8}">size MB (0 – {x1:.1f})</text>',
             f'<text x="4" y="{pad + 10}">{y1:.0f}%</text><text x="4" y="{height - bottom}">{y0:.0f}%</text>']
    together: dict[tuple[float, float], list[str]] = {}  # artifacts at the same point share one label
    for name, x, y in points:
        together.setdefault((round(x, 2), round(y, 2)), []).append(name)
    for (x, y), names in together.items():
        label = ", ".join(names)
        parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="#0969da"><title>{_esc(label)}: {y:.2f}% at {x:.2f} MB</title></circle>')
        anchor = "end" if sx(x) > width / 2 else "start"
        dx = -8 if anchor == "end" else 8
        parts.append(f'<text x="{sx(x) + dx:.1f}" y="{sy(y) + 4:.1f}" text-anchor="{anchor}">{_esc(label)}</text>')
    return "".join(parts) + "</svg>"


def sensitivity_chart(name: str, q: dict, width: int = 620, most: int = 24) -> str:
    """The layers that cost most when alone int8 (output PSNR vs eager, lower is worse); float ones in red."""
    kept = {f["name"] for f in q.get("float_layers", [])}
    measured = ((q.get("sensitivity") or {}).get("output_psnr_db") or {})
    values = sorted(((layer, v) for layer, v in measured.items() if v is not None), key=lambda item: item[1])[:most]
    if not values:
        return ""
    top = max(v for _, v in values) or 1.0
    label_w, row_h = 260, 18
    height = row_h * len(values) + 34
    parts = [f'<svg role="img" aria-label="int8 layer sensitivity of {_esc(name)}" width="{width}" height="{height}">']
    for i, (layer, value) in enumerate(values):
        y = 8 + i * row_h
        w = max(1.0, (width - label_w - 90) * value / top)
        colour = "#cf222e" if layer in kept else "#0969da"
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{_esc(layer)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 5}" fill="{colour}"/>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 12}">{value:.1f} dB{" float" if layer in kept else ""}</text>')
    parts.append(f'<text x="4" y="{height - 6}" class="meta">output PSNR vs eager with only that layer int8 · '
                 f'{len(values)} worst of {q["layers"]} layers · red: kept in float</text>')
    return "".join(parts) + "</svg>"


def _quantization(docs: list[dict]) -> str:
    from .report import quantization_summary

    sections = []
    for name, a in _named(docs):
        q = (a.get("details") or {}).get("quantization")
        if q:
            chart = sensitivity_chart(name, q) or "<p class=meta>Plain PTQ met the budget: no layer sensitivity was needed.</p>"
            sections.append(f"<h3>{_esc(name)}</h3><p>{_esc(quantization_summary(q).replace('**', ''))}</p>{chart}")
    return "<h2>int8: budget and layer sensitivity</h2>" + "".join(sections) if sections else ""


def _reasons(docs: list[dict]) -> str:
    items = [f"<li><b>{_esc(name)}</b> {_badge(a['status'])} {_esc(r)}</li>"
             for name, a in _named(docs) for r in a.get("reasons", [])]
    return f"<h2>Why not passed</h2><ul>{''.join(items)}</ul>" if items else ""


def _table(docs: list[dict]) -> str:
    table = [({"target": d["target"]["name"]} if len(docs) > 1 else {}) | r for d in docs for r in rows(d)]
    head = "".join(f"<th>{_esc(h)}</th>" for h in table[0]) if table else ""
    body = "".join(
        "<tr>" + "".join(
            f'<td class="status">{_badge(v)}</td>' if k == "status" else f"<td>{_esc(v)}</td>" for k, v in r.items()
        ) + "</tr>"
        for r in table
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _previews(docs: list[dict], dirs: list[Path] | None) -> str:
    """The task's pictures (input | eager | artifact), inlined so that the page stays one file."""
    figures = []
    for doc, directory in zip(docs, dirs or []):
        for a in doc["artifacts"]:
            path = Path(directory) / a["preview"] if a.get("preview") else None
            if path is None or not path.is_file():
                continue
            name = f"{doc['target']['name']}/{a['name']}" if len(docs) > 1 else a["name"]
            data = base64.b64encode(path.read_bytes()).decode()
            figures.append(f'<figure><img alt="{_esc(name)}" src="data:image/png;base64,{data}">'
                           f"<figcaption>{_esc(name)}: input | eager | artifact (pixels that differ from eager in white)"
                           f"</figcaption></figure>")
    return "<h2>What the artifacts see</h2>" + "".join(figures) if figures else ""


def render(docs: list[dict], dirs: list[Path] | None = None) -> str:
    """One page for one build, or for several targets of the same weight side by side; `dirs` are the
    builds' directories, where the pictures named by the manifests are."""
    first = docs[0]
    status = "failed" if any(d["status"] == "failed" for d in docs) else "passed"
    targets = ", ".join(d["target"]["name"] for d in docs)
    host, data = first["host"], first["data"]
    eager_text = f"{task_name(first)}; eager {eager_summary(first).replace('**', '')}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc(first['weight']['name'])} → {_esc(targets)}</title>
<style>{CSS}</style></head><body>
<h1>{_esc(first['weight']['name'])} → {_esc(targets)} {_badge(status)}</h1>
<p class="meta">{_esc(first['weight']['model'])}, {first['weight']['num_classes']} classes · {_esc(eager_text)} ·
{_esc(data['validation'])} validation images from {_esc(data['source'])} · {_esc(host['cpu'])}, {host['threads']} threads for every runtime ·
exporter {_esc(first['exporter_version'])}, torch {_esc(first['tools'].get('torch'))}</p>
{_table(docs)}
{_reasons(docs)}
{_previews(docs, dirs)}
{_quantization(docs)}
<h2>Latency against eager (same run, same threads)</h2>
<div class="charts">{latency_chart(docs)}</div>
<h2>Labeled accuracy against size</h2>
<div class="charts">{accuracy_size_chart(docs)}</div>
</body></html>
"""
