"""The bench's report: the latency table, ratios between rows, top operators, rewrites, the ARM columns, the host
while timing, and the comparison with the baseline run."""

from __future__ import annotations

from .. import hostload
from ..quant import SETTINGS
from . import counts
from .rows import BUDGET_PSNR_DB, ORT_AS_ON_ARM, ORT_OWN_INT8, RATIOS, REGRESSION, RUNTIMES, UNREWRITTEN


def _host_lines(results: dict) -> list[str]:
    """Per model, what the host did while it was timed (exporter.hostload), and why a busy run is unreliable."""
    lines = ["", "host while timing (1-min load, CPU other processes took, steal, worst p90/p50):", ""]
    for model, r in results.items():
        c = r.get("latency_conditions")
        if not c:
            continue
        share = "—" if c.get("other_cpu_share") is None else f"{c['other_cpu_share']:.0%}"
        steal = "—" if c.get("steal_s") is None else f"{c['steal_s']:.2f} s"
        worst = max((v for v in (c.get("spread") or {}).values() if v is not None), default=None)
        verdict = "reliable" if c["reliable"] else f"**unreliable**: {hostload.summary(c)}"
        lines.append(
            f"- {model}: load {c.get('load_avg_1m')}, others {share} over {c['window_s']:.1f} s, steal {steal}, "
            f"p90/p50 up to {worst if worst is None else f'{worst:.2f}'}; {verdict}"
        )
    return lines


def ratios(result: dict) -> dict[str, float]:
    """RATIOS of one model's run: how many times faster a is than b."""
    lat = {k: v["p50"] for k, v in result["latency_ms"].items()}
    return {name: round(lat[b] / lat[a], 3) for name, a, b in RATIOS if a in lat and b in lat}


def kinds_line(q: dict) -> str:
    return f" and every {', '.join(q['float_kinds'])}" if q.get("float_kinds") else ""


COUNTED_REWRITES = {  # formats.rewrites that report how many times they applied
    "padded_avg_pools_as_pad": "padded average pool(s) as a zero pad and a pool",
    "single_tensor_cats_dropped": "one-tensor cat(s) dropped",
    "adaptive_pools_as_pools": "adaptive pool(s) as plain pools",
    "means_keeping_dims": "spatial mean(s) keeping their dims",
    "chunks_as_slices": "chunk(s) or split(s) as slices",
    "attention_as_matmuls": "attention(s) as matmuls and a softmax",
    "matmuls_as_bmm": "batched matmul(s) as one bmm",
    "constants_folded": "tensor(s) computed once at export",
    "nearest_upsamples_as_deconvs": "nearest upsampling(s) as depthwise transposed convolutions",
}


def rewrites_line(rewrites: dict) -> str:
    lines = [
        f"{r['module']} ({'x'.join(map(str, r['kernel']))} dilation {r['dilation'][0]} on "
        f"{'x'.join(map(str, r['input']))}) -> {len(r['parts'])} part(s) "
        f"{', '.join('x'.join(map(str, k)) for k in r['parts'])}"
        for r in rewrites.get("padding_taps_dropped", [])
    ]
    splits: dict[str, int] = {}
    for r in rewrites.get("large_depthwise_split", []):
        how = f"{'x'.join(map(str, r['kernel']))} depthwise -> {' + '.join('x'.join(map(str, k)) for k in r['parts'])}"
        splits[how] = splits.get(how, 0) + 1
    lines += [f"{count} {how}" for how, count in splits.items()]
    lines += [
        f"{m or 'the model'}: input transform as one multiply-add"
        for m in rewrites.get("input_transform_as_affine", [])
    ]
    lines += [f"{rewrites[name]} {what}" for name, what in COUNTED_REWRITES.items() if rewrites.get(name)]
    halved = rewrites.get("half_activations_as_arithmetic")
    lines += [f"{len(halved)} fp16 hard sigmoid(s) or SiLU(s) as their arithmetic"] if halved else []
    return "; ".join(lines)


def _size_and_psnr(results: dict, labels: list[str]) -> list[str]:
    """Per model, each file's size and its outputs' PSNR against eager (random weights: the rounding, not accuracy)."""
    if not any(r.get("size_bytes") for r in results.values()):
        return []
    lines = ["", "size MB / PSNR dB against eager (three images; random weights: how much each file rounds):", ""]
    for model, r in results.items():
        sizes, psnr = r.get("size_bytes") or {}, r.get("psnr_db") or {}
        shown = [label for label in labels if label in sizes]
        lines.append(
            f"- {model}: " + ", ".join(f"{label} {sizes[label] / 1e6:.1f} / {psnr.get(label, '—')}" for label in shown)
        )
    return lines


def table(results: dict) -> str:
    labels = ["eager", "eager NHWC"] + [label for label, *_ in RUNTIMES] + [ORT_OWN_INT8, ORT_AS_ON_ARM, UNREWRITTEN]
    lines = [
        "| model | "
        + " | ".join(f"{label} p50 ms" for label in labels)
        + " | "
        + " | ".join(n for n, *_ in RATIOS)
        + " |",
        "|---|" + "---|" * (len(labels) + len(RATIOS)),
    ]
    for model, r in results.items():
        lat = {k: v["p50"] for k, v in r["latency_ms"].items()}
        cells = [f"{lat[label]:.2f}" if label in lat else "—" for label in labels]
        ratio = ratios(r)
        busy = "" if (r.get("latency_conditions") or {}).get("reliable", True) else " (busy host: unreliable)"
        lines.append(
            f"| {model} {'x'.join(map(str, r['input']))}{busy} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{ratio[n]:.2f}×" if n in ratio else "—" for n, *_ in RATIOS)
            + " |"
        )
    lines += ["", "top operators (share of operator time, ms per run; profiled after the timed rounds):", ""]
    for model, r in results.items():
        for label, profile in (r.get("profiles") or {}).items():
            if profile.get("available", True) and profile.get("ops"):
                lines.append(
                    f"- {model} {label}: "
                    + ", ".join(
                        f"{o['op']} {o['share']:.0%} ({o['ms']:.2f} ms ×{o['count']})" for o in profile["ops"][:4]
                    )
                )
    for model, r in results.items():
        for label, rewrite in (r.get("rewrites") or {}).items():
            lines.append(f"- {model} {label} rewritten before lowering: {rewrites_line(rewrite)}")
    lines += _size_and_psnr(results, labels)
    lines += counts.table(results, [label for label, *_ in RUNTIMES] + [ORT_OWN_INT8])
    lines += _host_lines(results)
    lines += [
        "",
        f"int8 budget: output PSNR >= {BUDGET_PSNR_DB:g} dB (+{SETTINGS['psnr_margin_db']:g} margin) on held-out "
        f"calibration images; layers kept in float, build seconds (quantization seconds):",
        "",
    ]
    for model, r in results.items():
        for label, q in r.get("quantization", {}).items():
            lines.append(
                f"- {model} {label}: {q['float_layers']} of {q['layers']} layers in float{kinds_line(q)}, check PSNR "
                f"{q['check_psnr_db']} dB ({q['ranges']} ranges), build {r['build_s'][label]} s ({q['seconds']} s)"
            )
    if any(r.get("memory_bytes") for r in results.values()):
        lines += [
            "",
            "RAM each artifact needs (peak resident memory of a fresh process loading and running it, minus "
            "the runtime's own after import), MB:",
            "",
        ]
        for model, r in results.items():
            if r.get("memory_bytes"):
                lines.append(
                    f"- {model}: " + ", ".join(f"{label} {b / 1e6:.1f}" for label, b in r["memory_bytes"].items())
                )
    for model, r in results.items():
        if "postprocess_ms" in r:
            post = {k: v["p50"] for k, v in r["postprocess_ms"].items()}
            trained = post["trained stand-in"]
            total = ", ".join(f"{label} {v['p50'] + trained:.2f}" for label, v in r["latency_ms"].items())
            lines += [
                "",
                f"{model} post-processing (numpy decode + NMS, one thread), p50 ms: "
                + ", ".join(f"{k} {v:.2f}" for k, v in post.items()),
                f"{model} raw heads + post-processing (trained stand-in's), p50 ms: {total}",
            ]
        if r.get("decode_in_graph_ms"):
            lines.append(
                f"{model} trained stand-in in ONNX Runtime, per canvas, p50 ms: "
                + ", ".join(f"{k} {v['p50']:.2f}" for k, v in r["decode_in_graph_ms"].items())
            )
    return "\n".join(lines)


def against_baseline(results: dict, baseline: dict | None) -> str:
    """Each model's RATIOS now and in the baseline run (ratios only: single cells move between runs)."""
    if not baseline:
        return ""
    then = baseline["results"]
    lines = [
        "",
        f"against the baseline run of {baseline.get('date', '?')} ({baseline.get('host', {}).get('cpu', '?')}, "
        f"{baseline.get('threads', '?')} threads): ratio then → now, marked with a warning sign"
        f" where now is below {REGRESSION:.0%} of then",
        "",
    ]
    for model, r in results.items():
        if model not in then:
            lines.append(f"- {model}: not in the baseline")
            continue
        old, new = ratios(then[model]), ratios(r)
        cells = [
            f"{n} {old[n]:.2f}× → {new[n]:.2f}×" + (" ⚠ fell" if new[n] < REGRESSION * old[n] else "")
            for n, *_ in RATIOS
            if n in old and n in new
        ]
        lines.append(f"- {model}: " + "; ".join(cells))
    return "\n".join(lines)
