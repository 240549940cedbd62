"""The aarch64 rows of a build (manifest `artifacts[].aarch64`, `aarch64`) as report.md lines and a report.html
section: per artifact and emulated CPU, its verdict, fidelity to eager, distance to its own x86 outputs and its
emulated instruction count (with eager's on the same core)."""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..results import EmulatedRow, Manifest


def _fidelity(row: EmulatedRow) -> str:
    fidelity = row.fidelity or {}
    parts = []
    for key, label, fmt in (
        ("top1_agreement", "top-1", ".3f"),
        ("pixel_agreement", "pixels", ".4f"),
        ("matched_recall", "recall", ".3f"),
        ("psnr_db", "PSNR dB", ".1f"),
    ):
        value = fidelity.get(key)
        if value is not None:
            parts.append(f"{label} {'∞' if value == 'inf' or value == float('inf') else format(value, fmt)}")
    return ", ".join(parts) or "—"


def _versus_x86(row: EmulatedRow) -> str:
    vs = row.vs_x86
    if not vs:
        return "—"
    if vs["bit_identical"]:
        return "bit-identical"
    return f"max |Δ| {vs['max_abs_diff']:.3g} ({vs['rows_differing']} inputs differ)"


def _instructions(row: EmulatedRow) -> str:
    counted = row.instructions
    if not counted:
        return "—"
    ratio = counted.ratio_to_eager
    eager = f" (eager {counted.eager_per_inference / 1e6:.2f} M, ratio {ratio:.2f})" if ratio else ""
    return f"{counted.per_inference / 1e6:.2f} M{eager}"


def rows(doc: Manifest) -> list[dict[str, str]]:
    """One row per artifact and CPU, for both reports."""
    table = []
    for entry in doc.artifacts:
        for row in entry.aarch64 or []:
            table.append(
                {
                    "artifact": entry.name,
                    "cpu": row.cpu,
                    "status": row.status.value,
                    "vs eager": _fidelity(row),
                    "vs x86": _versus_x86(row),
                    "instructions / inference": _instructions(row),
                    "emulated run s": format(row.seconds or 0, ".0f"),
                }
            )
    return table


def lacking(doc: Manifest) -> list[str]:
    """What a CPU lacks that an artifact was made for, one line each (an fp16 program on a core without FP16
    arithmetic)."""
    return [
        f"`{entry.name}` on {row.cpu}: {row.lacks}"
        for entry in doc.artifacts
        for row in entry.aarch64 or []
        if row.lacks
    ]


def summary_line(doc: Manifest) -> str | None:
    arm = doc.aarch64
    if not arm:
        return None
    runner = arm.get("runner") or {}
    not_run = "; ".join(f"{name}: {why}" for name, why in arm.get("not_run", {}).items())
    text = (
        f"aarch64 rows on {len(arm['cpus'])} emulated CPU(s) ({', '.join(arm['cpus'])}; qemu-user, runner "
        f"{runner.get('key', '—')}), {arm.get('seconds', 0):.0f} s in all. Emulated: fidelity is these CPUs' "
        "kernels' own; no latency is taken under emulation."
    )
    counted = arm.get("instructions") or {}
    if "unavailable" in counted:
        text += f" Instruction counts: unavailable ({counted['unavailable']})."
    elif counted:
        reference = counted.get("reference_cpu")
        text += (
            " Instructions: emulated aarch64 instructions per inference at one thread (deterministic, not time; a "
            "ratio to eager's count is no speedup; compare on one core only)"
            + (f"; ship-this ranks by them on {reference}" if reference else "")
            + "."
        )
        if counted.get("failed"):
            text += " Not counted: " + "; ".join(f"{k}: {v}" for k, v in counted["failed"].items()) + "."
    return text + (f" Not run there: {not_run}." if not_run else "")


def markdown(doc: Manifest) -> list[str]:
    line = summary_line(doc)
    if line is None:
        return []
    lines = ["", "## aarch64 (emulated)", "", line, ""]
    table = rows(doc)
    if table:
        headers = list(table[0])
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(str(r[h]) for h in headers) + " |" for r in table]
    notes = lacking(doc)
    return lines + ["", *(f"- {note}" for note in notes)] if notes else lines


def html(docs: list[Manifest]) -> str:
    sections = []
    for doc in docs:
        line = summary_line(doc)
        if line is None:
            continue
        table = rows(doc)
        head = "".join(f"<th>{escape(h)}</th>" for h in (table[0] if table else []))
        body = "".join(
            "<tr>"
            + "".join(
                f'<td class="{escape(str(v)) if k == "status" else ""}">{escape(str(v))}</td>' for k, v in r.items()
            )
            + "</tr>"
            for r in table
        )
        sections.append(
            f"<h3>{escape(doc.target['name'])}</h3><p>{escape(line)}</p>"
            + (f'<div class="scroll"><table><tr>{head}</tr>{body}</table></div>' if table else "")
        )
    return f"<h2>aarch64 (emulated)</h2>{''.join(sections)}" if sections else ""
