"""Threshold names and the check of metrics against them (no torch: profiles are read without it)."""

from __future__ import annotations

import math
from typing import Mapping

from .results import Reason, threshold

MIN_INPUTS = 2  # validation inputs: whether eager's outputs vary, and so whether agreement means anything, takes two

# threshold key -> (metric path, "min" or "max")
THRESHOLD_KEYS = {
    "top1_agreement": (("fidelity", "top1_agreement"), "min"),
    "top5_agreement": (("fidelity", "top5_agreement"), "min"),
    "psnr_db": (("fidelity", "psnr_db"), "min"),
    "cosine": (("fidelity", "cosine"), "min"),
    "max_abs_error": (("fidelity", "max_abs_error"), "max"),
    "accuracy_drop": (("accuracy", "drop_points"), "max"),
    "pixel_agreement": (("fidelity", "pixel_agreement"), "min"),
    "miou_vs_eager": (("fidelity", "miou_vs_eager"), "min"),
    "miou_drop": (("accuracy", "miou_drop_points"), "max"),
    "matched_recall": (("fidelity", "matched_recall"), "min"),
    "matched_precision": (("fidelity", "matched_precision"), "min"),
    "map_drop": (("accuracy", "map_drop_points"), "max"),
    "flow_agreement": (("fidelity", "flow_agreement"), "min"),
    "epe_vs_eager": (("fidelity", "epe_vs_eager"), "max"),
    "epe_increase": (("accuracy", "epe_increase"), "max"),
}

# the keys that mean something for each task's metrics (exporter.tasks)
TASK_KEYS = {
    "classification": ("top1_agreement", "top5_agreement", "psnr_db", "cosine", "max_abs_error", "accuracy_drop"),
    "segmentation": ("pixel_agreement", "miou_vs_eager", "psnr_db", "cosine", "max_abs_error", "miou_drop"),
    "detection": ("matched_recall", "matched_precision", "psnr_db", "cosine", "max_abs_error", "map_drop"),
    "video": ("top1_agreement", "top5_agreement", "psnr_db", "cosine", "max_abs_error", "accuracy_drop"),
    "optical_flow": ("flow_agreement", "epe_vs_eager", "psnr_db", "cosine", "max_abs_error", "epe_increase"),
}
# fractions in [0, 1]
FRACTIONS = (
    "top1_agreement",
    "top5_agreement",
    "pixel_agreement",
    "miou_vs_eager",
    "matched_recall",
    "matched_precision",
    "flow_agreement",
)


def _lookup(metrics: dict, path: tuple[str, str]):
    section = metrics.get(path[0]) or {}
    return section.get(path[1])


def breaches(metrics: dict, thresholds: Mapping[str, float]) -> list[Reason]:
    """One reason (Kind.THRESHOLD: the key, the value measured, the limit and a sentence) per threshold the metrics
    break; [] means passed."""
    reasons = []
    for key, limit in thresholds.items():
        path, kind = THRESHOLD_KEYS[key]
        value = _lookup(metrics, path)
        if value is None:
            continue  # e.g. accuracy without labels: reported as not measured, not as a pass
        if value != value or (kind == "min" and value < limit) or (kind == "max" and value > limit):  # NaN breaks any
            sign = ">=" if kind == "min" else "<="
            text = f"{key} {value:.4g} (needs {sign} {limit:g})"
            reasons.append(threshold(key, text, float(value) if math.isfinite(value) else None, limit))
    return reasons
