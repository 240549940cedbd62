"""What one build of the coverage sweep came to: a manifest's artifacts read into cells, and why a cell failed.

A cell is one artifact of one weight on one target. Its `outcome`:

    passed       ✅  built and validated within the target's thresholds
    failed       ❎  built, but broke a threshold (the first reason), or its runtime failed on it (`kind` "runtime
                     error"); `kind` "ill-conditioned reference" when eager itself, rounded to the artifact's
                     precision, broke the same thresholds (coverage.conditioning);
                     "quantized weight" when a torchvision int8 weight, run as it is in eager PyTorch, broke them
                     against its float model: what the weight loses, not the export
    export       ❌  export failed (the first line of the error), `kind` classified by CLASSIFIERS
    unavailable  ⚪  this host cannot run (or build) it: Core ML predicts only on macOS, TensorRT needs a GPU
    refused      ⛔  refused by design (Mask/Keypoint R-CNN, a format that cannot take an eager-quantized
                     model, a format that cannot take the task's graph)
    time         ⏱  the build hit the sweep's time limit before this artifact was done
    skipped      ⏭  not built: the weight is larger than --max-params
    not_run      ·   not reached: the build stopped (crashed or was killed) at an artifact it makes before this one

Torch-free: the sweep's parent process and `--merge` use it without importing torch."""

from __future__ import annotations

import math
import re

from ..precision import Precision
from ..results import Kind, broken_metrics, broken_value, kinds, revived
from .memory import oom_text, others_to_blame

SYMBOLS = {
    "passed": "✅",
    "failed": "❎",
    "export": "❌",
    "unavailable": "⚪",
    "refused": "⛔",
    "time": "⏱",
    "skipped": "⏭",
    "not_run": "·",
}
ORDER = tuple(SYMBOLS)

# what a cell's kind is when its artifact's first reason has one of these kinds (exporter.results)
KINDS = {
    Kind.DEGENERATE_REFERENCE: "degenerate reference",
    Kind.DISK_FULL: "disk full",  # the host's, not_a_verdict
}

# first match wins; tested against the first line of a converter's error (lower case): its text, not ours
CLASSIFIERS = (
    ("degenerate reference", re.compile(r"degenerate")),  # an error a build stopped with (its reasons have kinds)
    ("disk full", re.compile(r"no space left on device|disk quota exceeded")),  # the host's, not_a_verdict
    (
        "out of memory",
        re.compile(
            r"out of memory|outofmemory|memoryerror|can't allocate memory|cannot allocate memory|"
            r"std::bad_alloc|killed by the kernel|\boom\b"
        ),
    ),
    ("time limit", re.compile(r"time limit|timed out|timeout")),
    ("fixed batch", re.compile(r"runs at batch 1 but not at batch")),
    ("delegate fallback", re.compile(r"xnnpack|delegate|partition|lowered|backend_details")),
    (
        "unsupported op",
        re.compile(
            r"unsupported|not supported|not implemented|notimplementederror|no decomposition|"
            r"no kernel|could not find .*(op|kernel)|unknown (op|operator|builtin)|"
            r"exporting the operator|is not a registered|missing .*(op|lowering)|"
            r"cannot convert|unable to convert|no (converter|translation)|"
            r"dynamic shape|data-dependent|guardonDataDependent|constraint|"
            r"opset|onnxruntime.*(invalid_graph|not_implemented)",
            re.I,
        ),
    ),
)


def classify(error_line: str) -> str:
    """An export failure's kind from the first line of its error; anything else is a converter crash."""
    text = error_line.lower()
    for kind, pattern in CLASSIFIERS:
        if pattern.search(text):
            return kind
    return "converter crash"


def broken_keys(reasons) -> set[str]:
    """The threshold keys the reasons (JSON records, or Reason values) say were broken."""
    return broken_metrics(reasons)


FLOOR_PSNR_MARGIN_DB = 6.0  # twice the floor's RMS error


# decisions taken from margins (argmax, mask, matched boxes): on a random model's near-ties any rounding flips some
DECISION_KEYS = {
    "top1_agreement",
    "top5_agreement",
    "pixel_agreement",
    "miou_vs_eager",
    "matched_recall",
    "matched_precision",
}


# the floors an artifact of a precision is judged against (coverage.conditioning): int8 has a dynamic and a static one
FLOORS = {Precision.INT8: (Precision.INT8, "int8_static")}
WEIGHT_FLOOR = "quantized_weight"  # the floor row of an eager-quantized weight run as it is (conditioning.weight_row)
JUDGED_KINDS = ("validation", "ill-conditioned reference", "quantized weight")


# a top-1 margin under this many times a rounding's RMS score error is a near-tie: two scores, each off by that
# error independently, flip it with a probability over 2 % (the floor's one sample may well have kept it)
NEAR_TIE = 2 * math.sqrt(2)


def floor_explains(
    floor: dict | None, precision: str, reasons, psnr_db: float | None = None, flipped_rows=None
) -> bool:
    """True when eager with its tensors rounded to `precision` (coverage.conditioning; for int8, either of its
    floors) already broke every threshold the artifact broke, and the artifact's PSNR is not far below the
    floor's: the failure is the random reference's conditioning, not the export. Measured over the 2026-11
    table, artifacts the floor explains sit within 3.5 dB of it; MaxViT-T's int8 .pte sat 17 dB below, which no
    rounding explains."""
    margins = (floor or {}).get("margins")
    return any(
        _one_floor_explains((floor or {}).get(name), reasons, psnr_db, margins, flipped_rows)
        for name in FLOORS.get(precision, (precision,))
    )


def _one_floor_explains(row: dict | None, reasons, psnr_db: float | None, margins=None, flipped_rows=None) -> bool:
    if not row:
        return False
    broken = broken_keys(reasons)
    floor_broken = broken_keys(row.get("reasons"))
    floor_psnr = (row.get("fidelity") or {}).get("psnr_db")
    kept = (broken & DECISION_KEYS) - floor_broken  # decisions the floor's rounding happened to keep
    if not broken or not broken - kept <= floor_broken:
        return False
    if kept:
        # closer to eager than eager's own rounding: the decisions it flips sit on margins no rounding keeps
        # (measured: Wide-ResNet50-2's ONNX fp16 at 47.4 dB against a 44.2 dB floor that happened to flip none)
        closer = isinstance(psnr_db, (int, float)) and isinstance(floor_psnr, (int, float)) and psnr_db >= floor_psnr
        return closer or (kept == {"top1_agreement"} and near_ties(row, reasons, psnr_db, margins, flipped_rows))
    artifact_psnr = broken_value(reasons, "psnr_db")
    if artifact_psnr is not None and isinstance(floor_psnr, (int, float)):
        return artifact_psnr >= floor_psnr - FLOOR_PSNR_MARGIN_DB
    return True


def near_ties(row: dict, reasons, psnr_db, margins, flipped_rows) -> bool:
    """True when every top-1 the artifact flipped is listed (`flipped_rows`, from its manifest's preview rows)
    and sat on a near-tie: eager's margin there under NEAR_TIE times this rounding's RMS error on that image,
    with the artifact's PSNR within FLOOR_PSNR_MARGIN_DB of the rounding's (measured: Swin-V2-S's random int8
    .pte flipped one of 8 at 39.5 dB, floors 39.6/39.9 dB, on an image whose margin was a fifth of the error)."""
    rms = row.get("rms")
    agreement = broken_value(reasons, "top1_agreement")
    floor_psnr = (row.get("fidelity") or {}).get("psnr_db")
    if not (
        margins
        and rms
        and flipped_rows
        and agreement is not None
        and isinstance(psnr_db, (int, float))
        and isinstance(floor_psnr, (int, float))
    ):
        return False
    flips = round((1 - agreement) * len(margins))
    images = [r["row"] for r in flipped_rows]
    return (
        len(images) == flips
        and psnr_db >= floor_psnr - FLOOR_PSNR_MARGIN_DB
        and all(0 <= i < len(margins) and margins[i] < NEAR_TIE * rms[i] for i in images)
    )


# thresholds on labeled data: a floor measured without the labels cannot have broken them
LABELED_KEYS = {"accuracy_drop", "miou_drop", "map_drop"}


def floor_wanted(row: dict) -> bool:
    """True when a cached row has a validation failure that a floor it lacks might explain: built before floors,
    or before the int8 static one, were measured, or (a labeled failure) before floors were judged on labels."""
    measured = row.get("floor")
    if measured is not None and "error" in measured:
        return False
    wanted = set(FLOORS.get(Precision.INT8)) | ({WEIGHT_FLOOR} if row.get("quantized") else set())
    return any(
        c.get("outcome") == "failed"
        and c.get("kind") != "runtime error"
        and (
            measured is None
            or (
                c.get("kind") == "validation"
                and (
                    not (wanted if c.get("precision") == Precision.INT8 else set()) <= set(measured)
                    or (broken_keys(c.get("reasons")) & LABELED_KEYS and not measured.get("labeled"))
                )
            )
        )
        for c in row.get("cells", [])
    )


def cell_from_artifact(artifact: dict) -> dict:
    """One manifest artifact entry -> a cell: its outcome and kind from its reasons' kinds (exporter.results), and
    an export failure's kind from the converter's error (CLASSIFIERS)."""
    reasons = [r.to_json() for r in revived(artifact.get("reasons"))]
    first = revived(reasons[:1])[0] if reasons else None
    reason = first.text if first else ""
    on_host = {r.kind for r in revived(reasons) if r.cpu is None}  # found on this host, not on an emulated CPU
    built = artifact.get("path") is not None
    details = artifact.get("details") or {}
    cell = {
        "name": artifact["name"],
        "format": artifact["format"],
        "precision": artifact["precision"],
        "status": artifact["status"],
        "reason": reason,
        "reasons": reasons,
        "size_bytes": artifact.get("size_bytes"),
        "export_s": artifact.get("export_s"),
    }
    reused = [
        step
        for step, key in (("export", "artifact_reused_from_cache"), ("validation", "validation_reused_from_cache"))
        if artifact.get(key)
    ]
    if reused:  # done by another build of the weight (another target's, or an earlier one kept in --builds)
        cell["reused"] = reused
    if "delegation" in details:
        delegation = details["delegation"]
        cell["delegation"] = {
            k: delegation.get(k)
            for k in (
                "delegated_nodes",
                "non_delegated_nodes",
                "delegated_subgraphs",
                "ops_outside_delegate",
                "ops_outside_on_tensors",
            )
        }
    flipped = [
        {"row": r["row"], **r["departure"]}
        for r in artifact.get("preview_rows") or []
        if (r.get("departure") or {}).get("top1_flipped")
    ]
    if flipped and artifact["status"] == "failed":  # the images where its top-1 flipped (outcome.near_ties)
        cell["flipped_rows"] = flipped
    outliers = artifact.get("outlier_inputs")
    if outliers:  # a few inputs carry the error (validation.outlier_inputs)
        cell["outlier_inputs"] = {
            "count": len(outliers["rows"]),
            "of": outliers["of"],
            "thresholds_met_without": outliers["thresholds_met_without"],
        }
    if "quantization" in details and isinstance(details["quantization"], dict):
        q = details["quantization"]
        cell["quantization"] = {k: q[k] for k in ("float_layers", "layers", "meets_budget", "perturbation") if k in q}
        if isinstance(q.get("after"), dict) and q["after"].get("ranges"):  # which range method won (static, dynamic)
            cell["quantization"]["ranges"] = q["after"]["ranges"]
        if isinstance(q.get("lowering_fault"), dict):  # the ranges whose lowered program missed what its graph met
            cell["quantization"]["lowering_fault"] = q["lowering_fault"]["ranges"]
        if isinstance(details.get("validation_retry"), dict):  # made again: its calibrated ranges failed validation
            cell["quantization"]["validation_retry"] = details["validation_retry"]["kept"]
    if artifact.get("aarch64"):  # its verdict on each emulated ARM CPU (the status above already holds them)
        cell["aarch64"] = {r["cpu"]: r["status"] for r in artifact["aarch64"]}
    psnr = (artifact.get("fidelity") or {}).get("psnr_db")
    if isinstance(psnr, (int, float)) and math.isfinite(psnr):
        cell["psnr_db"] = round(psnr, 2)
    accuracy = artifact.get("accuracy")
    if isinstance(accuracy, dict):  # labeled data (the trained tier): the artifact's and eager's
        cell["accuracy"] = {k: v for k, v in accuracy.items() if isinstance(v, (int, float))}
    if Kind.DEGENERATE_REFERENCE in kinds(reasons):
        cell.update(outcome="failed" if built else "export", kind=KINDS[Kind.DEGENERATE_REFERENCE])
    elif artifact["status"] == "passed":
        cell["outcome"] = "passed"
    elif artifact["status"] == "unavailable":
        refused = first is not None and first.kind is Kind.NOT_MADE
        cell["outcome"] = "refused" if refused else "unavailable"
        cell["kind"] = "by design" if refused else ("built, cannot run here" if built else "cannot build here")
    elif built and reasons and all(map(_emulator_timeout, reasons)):
        cell.update(outcome="time", kind="time limit")  # qemu ran out of time: the artifact was not judged there
    elif built and first is not None and first.cpu is None and first.kind in (Kind.DOES_NOT_LOAD, Kind.DOES_NOT_RUN):
        cell.update(outcome="failed", kind="runtime error")
    elif built:
        cell.update(outcome="failed", kind="validation")
    elif Kind.DISK_FULL in on_host:
        cell.update(outcome="export", kind=KINDS[Kind.DISK_FULL])
    else:  # the converter's own message says what kind of failure it was
        cell.update(outcome="export", kind=classify(_error(reason)))
    return cell


def _error(reason: str) -> str:
    """The converter's error in a reason's text (after the exporter's own words), for CLASSIFIERS."""
    return reason.removeprefix("export failed: ")


def _emulator_timeout(reason) -> bool:
    """The reason (a JSON record) is an emulated CPU's run stopped by its time limit under qemu."""
    return Kind(reason["kind"]) is Kind.EMULATOR_TIMEOUT and reason.get("cpu") is not None


def cells_from_manifest(doc: dict) -> list[dict]:
    return [cell_from_artifact(a) for a in doc.get("artifacts", [])]


def kill_kind(returncode: int | None, timed_out: bool, error: str | None) -> tuple[str, str]:
    """(outcome, kind) for the artifact a build was at when it stopped without finishing."""
    if timed_out:
        return "time", "time limit"
    if error:
        return "export", classify(error)
    if returncode == -9:
        return "export", "out of memory"  # SIGKILL we did not send: the kernel's OOM killer
    if killed_from_outside(returncode):
        return "export", "killed"
    return "export", "converter crash"


def killed_from_outside(returncode: int | None) -> bool:
    """A build process ended by SIGTERM, SIGINT or SIGHUP that the sweep did not send (`kill`, a logout): it
    says nothing about the weight, unlike a crash (SIGSEGV, SIGABRT) or the kernel's OOM kill."""
    import signal

    return returncode in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)


def not_a_verdict(row: dict) -> bool:
    """A build ended by something other than its weight: killed from outside the sweep, by the kernel's OOM
    killer while other processes held much of the host (exporter.coverage.memory), or an artifact not written for a
    full disk. Not cached, built again next time, and never hides a built row in a merge."""
    if killed_from_outside(row.get("returncode")):
        return True
    if any(c.get("kind") == "disk full" for c in row.get("cells", [])):
        return True
    return (
        row.get("outcome") == "stopped"
        and not row.get("timed_out")
        and row.get("returncode") == -9
        and others_to_blame(row.get("memory"))
    )


def death_reason(returncode: int | None, memory: dict | None = None) -> str:
    """Why a build process ended without a result; `memory` as exporter.coverage.memory samples it."""
    why = f"the build process died (exit code {returncode})"
    if returncode == -9:
        return f"{why}: {oom_text(memory)}"
    if killed_from_outside(returncode):
        return f"{why}: killed from outside the sweep, built again next time"
    return why


def stopped_cells(
    planned: list[dict],
    done: list[dict],
    returncode,
    timed_out: bool,
    error: str | None,
    limit: str | None,
    memory: dict | None = None,
) -> list[dict]:
    """Cells for a build that did not finish, in the target's order: those it completed, the one it was at (the first
    not completed in the order the build makes them, build.plan.export_order), and those not reached.
    `limit` says what the time limit stopped, e.g. "900 s of CPU time (1210 s wall clock)"."""
    from ..engine.plan import export_order

    made = {c["name"]: c for c in done}
    at = next(
        (planned[i]["name"] for i in export_order([s["precision"] for s in planned]) if planned[i]["name"] not in made),
        None,
    )  # the build makes its int8 artifacts last
    cells = []
    outcome, kind = kill_kind(returncode, timed_out, error)
    if timed_out:
        why = f"time limit: the build was stopped after {limit}"
    elif error:
        why = error
    else:
        why = death_reason(returncode, memory)
    whole = error is not None and not done  # stopped before any artifact: the error is every artifact's
    for spec in planned:
        if spec["name"] in made:
            cells.append(made.pop(spec["name"]))
            continue
        cell = {
            "name": spec["name"],
            "format": spec["format"],
            "precision": spec["precision"],
            "status": None,
            "size_bytes": None,
            "export_s": None,
        }
        if spec["name"] == at or whole:
            cell.update(outcome=outcome, kind=kind, reason=why)
        elif timed_out:
            cell.update(outcome=outcome, kind=kind, reason=f"not reached within the time limit ({limit})")
        else:
            cell.update(outcome="not_run", kind="not reached", reason=f"not reached: {why}")
        cells.append(cell)
    return cells + list(made.values())


def reclassify(row: dict) -> dict:
    """A row with its cells' kinds derived from their reasons: export failures by today's CLASSIFIERS,
    validation failures by the row's precision `floor` (a cached row keeps its reasons and floor)."""
    for cell in row.get("cells", []):
        if cell.get("outcome") == "failed" and cell.get("reasons") and all(map(_emulator_timeout, cell["reasons"])):
            cell.update(outcome="time", kind="time limit")
        elif (
            cell.get("outcome") == "export"
            and cell.get("reason")
            and cell.get("kind") not in ("out of memory", "time limit", "killed", KINDS[Kind.DEGENERATE_REFERENCE])
        ):
            cell["kind"] = classify(_error(cell["reason"]))
        elif cell.get("outcome") == "failed" and cell.get("kind") in JUDGED_KINDS:
            reasons = cell.get("reasons") or []
            if _one_floor_explains((row.get("floor") or {}).get(WEIGHT_FLOOR), reasons, cell.get("psnr_db")):
                cell["kind"] = "quantized weight"
                continue
            explained = floor_explains(
                row.get("floor"), cell["precision"], reasons, cell.get("psnr_db"), cell.get("flipped_rows")
            )
            cell["kind"] = "ill-conditioned reference" if explained else "validation"
    return row


def icon(cell: dict) -> str:
    return SYMBOLS[cell["outcome"]]
