"""The human-readable report: the manifest as tables."""

from __future__ import annotations

import math
from collections.abc import Iterator

from .. import hostload
from ..precision import Precision
from ..results import ArtifactResult, DataDescription, FormatDetails, Kind, Manifest, Memory, Profile, ProxyMetrics
from ..results import SizeRow, texts
from . import arch_report, recommend


def _num(value, fmt: str, missing: str = "—") -> str:
    if value is None:
        return missing
    if value == "inf" or (isinstance(value, float) and math.isinf(value)):
        return "∞"
    return format(value, fmt)


def _measured(doc: Manifest) -> Iterator[tuple[str, str, ArtifactResult | ProxyMetrics, ArtifactResult | None]]:
    """Each artifact, then its proxy rows (stand-ins measured where the runtime is unavailable): (name, status, what
    was measured, the artifact itself; None for a proxy row, which has no size, memory or timing of its own)."""
    for a in doc.artifacts:
        yield a.name, str(a.status), a, a
        for label, metrics in (a.proxy or {}).items():
            yield f"{a.name} [proxy: {label}]", f"proxy {metrics.status}", metrics, None


def quantization_summary(q: dict) -> str:
    """One line: how the int8 budget was met (or not), which layers stayed in float and why."""
    if "before" not in q:
        return f"int8 by plain PTQ ({q.get('note', '')})"
    before, after = q["before"], q["after"]
    verdict = "met" if q["meets_budget"] else "**not met**"
    text = (
        f"int8 budget {verdict} on {q['check_images']} held-out calibration images; "
        f"{q['int8_layers']} of {q['layers']} layers int8; "
    )
    # fallback steps were taken (ranges tried only when the first miss count as one)
    if len(q["steps"]) > len({s["ranges"] for s in q["steps"]}) or q["after"] != q["before"]:
        text += (
            f"PSNR {_num(before['psnr_db'], '.1f')} → {_num(after['psnr_db'], '.1f')} dB, agreement "
            f"{_num(before['agreement'], '.1%')} → {_num(after['agreement'], '.1%')} (plain PTQ → chosen)"
        )
    else:
        text += f"plain PTQ: PSNR {_num(after['psnr_db'], '.1f')} dB, agreement {_num(after['agreement'], '.1%')}"
    if q["float_layers"]:
        kept = ", ".join(
            f"{f['name']} ({f['why']})"
            if f.get("why")
            else f"{f['name']} (output {_num(f['output_psnr_db'], '.1f')} dB when alone int8, "
            f"own SQNR {_num(f['local_sqnr_db'], '.1f')} dB)"
            for f in q["float_layers"]
        )
        text += f"; kept in float: {kept}"
    if q.get("float_kinds"):
        text += f"; every {', '.join(q['float_kinds'])} kept in float{_kinds_step(q)}"
    if q.get("float_ops"):
        ops = ", ".join(f"{name}×{n}" for name, n in q["float_ops"].items())
        text += f"; ops computed in float (no int8 pattern in the quantizer, or kept in float): {ops}"
    if q.get("program"):
        program = q["program"]
        text += f"; the lowered program on the same images: PSNR {_num(program['psnr_db'], '.1f')} dB, budget " + (
            "met" if program["meets_budget"] else "**not met**"
        )
    if q.get("lowering_fault"):
        fault = q["lowering_fault"]
        static = (fault.get("static_program") or {}).get("psnr_db")
        text += (
            f"; with {fault['ranges']} ranges the lowered program was at {_num(fault['program']['psnr_db'], '.1f')}"
            f" dB where its graph was at {_num(fault['graph']['psnr_db'], '.1f')}: made again with static ranges "
            f"({_num(static, '.1f')} dB), the {fault['kept']} program kept"
        )
    budget = (q.get("budget") or {}).get("accuracy_drop")
    if q.get("check_labeled") and budget is not None and 100 / q["check_images"] > budget:
        text += (
            f"; one of {q['check_images']} check images is {100 / q['check_images']:.1f} points of acc@1, "
            f"coarser than the {budget:g}-point budget (a larger --calib-size checks it finer)"
        )
    return text + f"; {q['calibration_method']}; {q['seconds']} s"


def _kinds_step(q: dict) -> str:
    step = next((s for s in q["steps"] if s.get("float_kinds") == q["float_kinds"] and not s["float_layers"]), None)
    if step is None:
        return ""
    return (
        f" (plain PTQ {_num(q['before']['psnr_db'], '.1f')} dB, with them float and every layer int8 "
        f"{_num(step['psnr_db'], '.1f')} dB)"
    )


def retry_summary(details: FormatDetails) -> str:
    """One line: an int8 artifact made again after its calibrated ranges failed validation (validation_retry)."""
    retry = details["validation_retry"]
    if "first" in retry:
        first = retry["first"]
        return (
            f"made again with ranges chosen per inference: with {first['ranges']} ranges it had failed validation "
            f"({'; '.join(texts(first['reasons']))}) after meeting its budget on the check images"
        )
    other = retry["per_inference"]
    return (
        f"made again with ranges chosen per inference after failing validation; that one did not pass either "
        f"({'; '.join(texts(other['reasons']))}), so this (calibrated ranges) is kept"
    )


def outliers_summary(a: ArtifactResult) -> str:
    """One line: the few validation inputs that carry a failed artifact's error, and what the rest measure."""
    o = a.outlier_inputs
    count, rest = len(o["rows"]), o["of"] - len(o["rows"])
    without = ", ".join(
        f"{key} {_num(o['fidelity_without'].get(key), '.4g')}" for key in a.thresholds if key in o["fidelity_without"]
    )
    ratio, peak = o["rms_over_median"], o.get("peak_over_median")
    over = (
        f"over {ratio['over']:g}× the median input's, up to {ratio['max']:g}×"
        if ratio.get("max")
        else "where most inputs have none"
    )
    peaked = f"; eager's outputs on them peak at {peak:g}× the median input's peak" if peak else ""
    verdict = "meet" if o["thresholds_met_without"] else "still break"
    text = (
        f"{count} of {o['of']} validation inputs carry {o['error_share']:.1%} of the error (RMS error {over}"
        f"{peaked}); the other {rest} {verdict} the fidelity thresholds ({without}); rows "
        f"{', '.join(map(str, o['rows'][:10]))}"
    )
    after = ((a.details or {}).get("quantization") or {}).get("after") or {}
    static = "dynamic" not in after.get("ranges", "")  # ranges chosen per inference clip nothing
    if a.precision == Precision.INT8 and peak and peak >= 2 and static:
        text += (
            " — likely activations past the ranges the calibration images set, which static int8 clips: "
            "calibration data with inputs like these (--data) widens them"
        )
    return text


# per task (the manifest's task.name): its fidelity columns and its labeled metric (key, drop key, label);
# here rather than in exporter.tasks because reports are written without importing torch
COLUMNS = {
    "classification": ({"top-1 agree": "top1_agreement"}, ("acc1", "drop_points", "acc@1")),
    "video": ({"top-1 agree": "top1_agreement"}, ("acc1", "drop_points", "acc@1")),
    "segmentation": (
        {"pixel agree": "pixel_agreement", "mIoU vs eager": "miou_vs_eager"},
        ("miou", "miou_drop_points", "mIoU"),
    ),
    "detection": (
        {"matched recall": "matched_recall", "matched precision": "matched_precision"},
        ("map", "map_drop_points", "mAP"),
    ),
    "optical_flow": ({"within 1 px of eager": "flow_agreement"}, ("epe", "epe_increase", "EPE px")),
}


def task_name(doc: Manifest) -> str:
    return (doc.task or {}).get("name", "classification")


def eager_summary(doc: Manifest) -> str:
    eager = doc.eager.accuracy
    if not eager:
        return "**not measured** (no labeled --data)"
    if task_name(doc) == "segmentation":
        return f"mIoU {eager['miou']:.2f}, pixel accuracy {eager['pixel_acc']:.2f}%"
    if task_name(doc) == "detection":
        return f"COCO mAP {_num(eager['map'], '.2f')}, mAP@0.5 {_num(eager['map50'], '.2f')}"
    if task_name(doc) == "optical_flow":
        return f"EPE {eager['epe']:.3f} px, Fl-all {eager['fl_all']:.2f}%"
    return f"acc@1 {eager['acc1']:.2f}%, acc@5 {eager['acc5']:.2f}%"


def unreliable_latency(a: ArtifactResult) -> bool:
    """Whether an artifact's latency was judged unreliable (exporter.hostload: a busy host, or timings that moved)."""
    return not (a.latency_conditions or {}).get("reliable", True)


def latency_warnings(doc: Manifest) -> tuple[str, list[tuple[str, str]]]:
    """('' , []) when every timed latency stands; else a headline and (artifact, why) per unreliable one."""
    noisy = [
        (a.name, "; ".join(a.latency_conditions.get("reasons") or ["host busy"]))
        for a in doc.artifacts
        if unreliable_latency(a)
    ]
    if not noisy:
        return "", []
    threads = doc.host.threads
    timed = sum(1 for a in doc.artifacts if a.latency_ms is not None)
    head = (
        f"Latency unreliable for {len(noisy)} of {timed} timed "
        f"artifacts ({threads} threads timed): a busy host, or timings that moved between rounds; ratios to eager shown "
        "as measured, the verdict "
        "does not use them, and the cache does not keep them (the next run times them again)"
    )
    return head, noisy


def _latency_markdown(doc: Manifest) -> list[str]:
    head, noisy = latency_warnings(doc)
    return ["", f"**{head}:**", *(f"- `{name}`: {why}" for name, why in noisy)] if head else []


def rows(doc: Manifest) -> list[dict]:
    table = []
    fidelity_columns, (metric, drop, label) = COLUMNS[task_name(doc)]
    for name, status, m, own in _measured(doc):
        fid, acc = m.fidelity or {}, m.accuracy or {}
        lat, eager = m.latency_ms, m.eager_latency_ms
        size, memory = (own.size_bytes, own.memory) if own is not None else (None, None)
        table.append(
            {
                "artifact": name,
                "status": status,
                **{header: _num(fid.get(key), ".1%") for header, key in fidelity_columns.items()},
                "PSNR dB": _num(fid.get("psnr_db"), ".1f"),
                f"{label} ({'drop' if 'drop' in drop else 'change'})": f"{_num(acc.get(metric), '.2f')} ({_num(acc.get(drop), '+.2f')})"
                if acc
                else "not measured",
                "p50 ms": _num(lat.p50 if lat is not None else None, ".2f"),
                "p90 ms": _num(lat.p90 if lat is not None else None, ".2f"),
                "eager p50": _num(eager.p50 if eager is not None else None, ".2f"),
                "speedup": _num(m.speedup_vs_eager, ".2f", "—")
                + ("×" if m.speedup_vs_eager else "")
                + (" (unreliable)" if own is not None and unreliable_latency(own) else ""),
                "MB": _num(size / 1e6 if size else None, ".2f"),
                "RAM MB": _num(
                    (memory.peak_rss_increase_bytes or 0) / 1e6 if memory and memory.available else None, ".1f"
                ),
            }
        )
    return table


def memory_line(memory: Memory | None) -> str:
    """One line: what the artifact needs in RAM (exporter/engine/memory_profile.py); None: not measured."""
    if memory is None or not memory.available:
        reason = memory.reason if memory is not None and memory.reason is not None else "no measurement"
        return f"memory not measured ({reason})"
    mb = lambda value: _num(value / 1e6, ".1f") if value is not None else "—"  # noqa: E731
    parts = [
        f"needs {mb(memory.peak_rss_increase_bytes)} MB RAM (peak over the runtime's own "
        f"{mb(memory.runtime_baseline_rss_bytes)} MB in a fresh process; process peak {mb(memory.peak_rss_bytes)} MB)"
    ]
    if memory.planned_bytes is not None:
        parts.append(f"planned memory {mb(memory.planned_bytes)} MB")
    if memory.constants_bytes is not None:
        parts.append(f"constants {mb(memory.constants_bytes)} MB")
    return "; ".join(parts)


def profile_line(profile: Profile, top: int = 4) -> str:
    """One line: the top operators by time, e.g. "top ops by time: Conv 61%, …"."""
    if not profile.available:
        return f"no operator profile ({profile.reason if profile.reason is not None else 'not measured'})"
    ops = ", ".join(f"{o.op} {o.share:.0%}" for o in profile.ops[:top])
    return (
        f"top ops by time: {ops} (of {_num(profile.ops_ms, '.2f')} ms in operators, "
        f"{_num(profile.wall_ms, '.2f')} ms a run, {profile.runs} profiled run{'s' if profile.runs != 1 else ''}; "
        f"{profile.source})" + busy_profile(profile)
    )


def busy_profile(profile: Profile) -> str:
    """'' or what says the profile was taken on a busy host (its wall-clock times stretched)."""
    busy = hostload.summary(profile.conditions or {})
    return f"; profiled on a busy host ({busy}): its times are stretched, its shares less so" if busy else ""


def profile_repeats_memory(profile: Profile, memory: Memory | None) -> bool:
    """Whether `profile` says no more than `memory` (one unavailable measurement, with the same reason, behind both):
    the reports then say it once."""
    return memory is not None and profile.to_json() == memory.to_json()


def sizes_line(a: ArtifactResult) -> str:
    """One line: the further sizes a dynamic-size artifact was judged at, and how it did at each."""
    low, high = a.input.size_range

    def one(row: SizeRow) -> str:
        agreement = (row.fidelity or {}).get("pixel_agreement")
        drop = (row.accuracy or {}).get("miou_drop_points")
        measured = ", ".join(
            part
            for part in (
                f"pixel agreement {agreement:.2%}" if agreement is not None else "",
                f"mIoU drop {drop:+.2f}" if drop is not None else "",
            )
            if part
        )
        return f"{row.size[0]}x{row.size[1]} {row.status}" + (f" ({measured})" if measured else "")

    return f"any height and width from {low} to {high}; also validated at " + "; ".join(map(one, a.sizes))


def memory_profile_notes(a: ArtifactResult) -> list[str]:
    lines = []
    if a.memory is not None:
        lines.append(f"- `{a.name}`: {memory_line(a.memory)}")
    if a.profile is not None and (a.profile.available or not profile_repeats_memory(a.profile, a.memory)):
        lines.append(f"- `{a.name}`: {profile_line(a.profile)}")
    return lines


def scored_classes(data: DataDescription) -> str:
    """How many of the model's classes the labeled inputs cover (class folders read by name), or ""."""
    if "model_classes" not in data:
        return ""
    return (
        f"; labels by folder name: {data['scored_classes']} of the model's {data['model_classes']} classes scored "
        f"({data['classes']} class folders)"
    )


def about(doc: Manifest) -> list[str]:
    """What was built from what, where, on which data: report.md's opening bullets and report.html's list under its
    title (Markdown inline: **bold**, `code`)."""
    host, data = doc.host, doc.data
    lines = [
        f"model: `{doc.weight.model}`, {doc.weight.num_classes} classes; "
        f"checkpoint sha256 `{doc.checkpoint.sha256[:16]}…` ({doc.checkpoint.source})",
        f"host: {host.cpu}, {host.cores} cores; **{host.threads} threads** for eager and every runtime",
        f"data: {data['source']}; {data['validation']} validation / {data['calibration']} calibration images (seed {data.get('seed')})"
        + scored_classes(data),
        f"task: {task_name(doc)}, input {'x'.join(map(str, (doc.task or {}).get('input_size', [])))}; "
        f"eager: {eager_summary(doc)}",
    ]
    decode = doc.target.get("detection") or {}
    if decode.get("kept_host_because"):  # asked for final detections in the graph, which no format here takes
        lines.append(
            "detections: **raw heads**, decoded by detection_decode.py (asked: in the graph; no format of this "
            f"target takes it: {decode['kept_host_because']})"
        )
    elif decode.get("decode") == "graph":
        lines.append("detections: **final, inside the graph** (torchvision's post-processing; no decode in the app)")
    reference = doc.eager.reference
    if (
        reference is not None and reference.note
    ):  # a quantized weight: which eager model the artifacts were measured against
        lines.append(f"eager reference: **{reference.kind}** — {reference.note}")
    return lines


def _delegation_note(d: dict) -> str:
    outside = ", ".join(f"{op}×{n}" for op, n in d["ops_outside_delegate"].items()) or "none"
    on_tensors = ", ".join(f"{op}×{n}" for op, n in d.get("ops_outside_on_tensors", {}).items())
    return (
        f"{d['delegated_nodes']} nodes in {d['delegated_subgraphs']} {d['delegate']} subgraph(s); "
        f"{d['non_delegated_nodes']} outside ({outside}); "
        + (f"**on real tensors: {on_tensors}**" if on_tensors else "none of them on real tensors (scalar casts only)")
    )


def _artifact_notes(a: ArtifactResult) -> list[str]:
    notes = [f"`{a.name}` {a.status}: {reason}" for reason in texts(a.reasons)]
    said = []
    if a.outlier_inputs:
        said.append(outliers_summary(a))
    details = a.details or {}
    if "delegation" in details:
        said.append(_delegation_note(details["delegation"]))
    if details.get("quantization"):
        said.append(quantization_summary(details["quantization"]))
    if details.get("validation_retry"):
        said.append(retry_summary(details))
    notes += [f"`{a.name}`: {text}" for text in said]
    notes += [line.removeprefix("- ") for line in memory_profile_notes(a)]
    if a.sizes:
        notes.append(f"`{a.name}`: {sizes_line(a)}")
    notes += [f"`{a.name}`: {r.text}" for r in a.reasons if r.kind is Kind.NOTE]
    if details.get("xnnpack_rewrite") == "unavailable":
        notes.append(
            f"`{a.name}`: optimize_for_mobile unavailable, unoptimized lite model written ({details['xnnpack_rewrite_reason']})"
        )
    return notes


def notes(doc: Manifest) -> list[str]:
    """Everything said about the artifacts, the cache and the data beside the table: report.md's Notes and
    report.html's (Markdown inline)."""
    lines = [note for a in doc.artifacts for note in _artifact_notes(a)]
    lines += [f"cache: {event}" for event in (doc.cache.events if doc.cache is not None else [])]
    if doc.data.get("note"):
        lines.append(doc.data["note"])
    return lines


def closing(doc: Manifest) -> list[str]:
    """The build's wall time per step and the thresholds it was held to: report.md's last paragraphs."""
    lines = []
    if doc.timings_s:
        steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in doc.timings_s.items())
        when = " of the build reused from the cache" if doc.cache is not None and doc.cache.build_record else ""
        lines.append(f"Wall time per step{when}: {steps}.")
    lines.append("Thresholds per precision: " + ", ".join(f"{p}: {t}" for p, t in doc.target["thresholds"].items()))
    return lines


def markdown(doc: Manifest) -> str:
    lines = [f"# {doc.weight.name} → {doc.target['name']}: **{str(doc.status).upper()}**", ""]
    lines += [f"- {line}" for line in about(doc)]
    head, _, rest = recommend.shown(doc, markdown=True).partition(": ")
    lines += ["", f"**{head}:** {rest}", ""]
    others = recommend.not_picked_line(doc, markdown=True)
    lines += [others, ""] if others else []
    table = rows(doc)
    if table:
        headers = list(table[0])
        lines.append("| " + " | ".join(headers) + " |")
        lines.append("|" + "---|" * len(headers))
        lines += ["| " + " | ".join(str(r[h]) for h in headers) + " |" for r in table]
    lines += _latency_markdown(doc)
    lines += arch_report.markdown(doc)
    said = notes(doc)
    if said:
        lines += ["", "## Notes", *(f"- {note}" for note in said)]
    for line in closing(doc):
        lines += ["", line]
    return "\n".join([*lines, ""])
