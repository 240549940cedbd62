"""Threshold names (results.Metric), where each is measured, and the check of metrics against them (no torch:
profiles are read without it)."""

from __future__ import annotations

import math
from typing import Mapping

from .results import Metric, Reason, threshold

MIN_INPUTS = 2  # validation inputs: whether eager's outputs vary, and so whether agreement means anything, takes two

# threshold key -> (metric path, "min" or "max")
THRESHOLD_KEYS = {
    Metric.TOP1_AGREEMENT: (("fidelity", "top1_agreement"), "min"),
    Metric.TOP5_AGREEMENT: (("fidelity", "top5_agreement"), "min"),
    Metric.PSNR_DB: (("fidelity", "psnr_db"), "min"),
    Metric.COSINE: (("fidelity", "cosine"), "min"),
    Metric.MAX_ABS_ERROR: (("fidelity", "max_abs_error"), "max"),
    Metric.ACCURACY_DROP: (("accuracy", "drop_points"), "max"),
    Metric.PIXEL_AGREEMENT: (("fidelity", "pixel_agreement"), "min"),
    Metric.MIOU_VS_EAGER: (("fidelity", "miou_vs_eager"), "min"),
    Metric.MIOU_DROP: (("accuracy", "miou_drop_points"), "max"),
    Metric.MATCHED_RECALL: (("fidelity", "matched_recall"), "min"),
    Metric.MATCHED_PRECISION: (("fidelity", "matched_precision"), "min"),
    Metric.MAP_DROP: (("accuracy", "map_drop_points"), "max"),
    Metric.FLOW_AGREEMENT: (("fidelity", "flow_agreement"), "min"),
    Metric.EPE_VS_EAGER: (("fidelity", "epe_vs_eager"), "max"),
    Metric.EPE_INCREASE: (("accuracy", "epe_increase"), "max"),
}

# the keys that mean something for each task's metrics (exporter.tasks)
_FIDELITY = (Metric.PSNR_DB, Metric.COSINE, Metric.MAX_ABS_ERROR)  # every task's outputs, as numbers
TASK_KEYS = {
    "classification": (Metric.TOP1_AGREEMENT, Metric.TOP5_AGREEMENT, *_FIDELITY, Metric.ACCURACY_DROP),
    "segmentation": (Metric.PIXEL_AGREEMENT, Metric.MIOU_VS_EAGER, *_FIDELITY, Metric.MIOU_DROP),
    "detection": (Metric.MATCHED_RECALL, Metric.MATCHED_PRECISION, *_FIDELITY, Metric.MAP_DROP),
    "video": (Metric.TOP1_AGREEMENT, Metric.TOP5_AGREEMENT, *_FIDELITY, Metric.ACCURACY_DROP),
    "optical_flow": (Metric.FLOW_AGREEMENT, Metric.EPE_VS_EAGER, *_FIDELITY, Metric.EPE_INCREASE),
}
# fractions in [0, 1]
FRACTIONS = (
    Metric.TOP1_AGREEMENT,
    Metric.TOP5_AGREEMENT,
    Metric.PIXEL_AGREEMENT,
    Metric.MIOU_VS_EAGER,
    Metric.MATCHED_RECALL,
    Metric.MATCHED_PRECISION,
    Metric.FLOW_AGREEMENT,
)


def _lookup(metrics: dict, path: tuple[str, str]):
    section = metrics.get(path[0]) or {}
    return section.get(path[1])


def breaches(metrics: dict, thresholds: Mapping[str, float]) -> list[Reason]:
    """One reason (Kind.THRESHOLD: the key, the value measured, the limit and a sentence) per threshold the metrics
    break; [] means passed."""
    reasons = []
    for key, limit in thresholds.items():
        path, kind = THRESHOLD_KEYS[key]  # KeyError: not a threshold (profiles refuse it before any build)
        value = _lookup(metrics, path)
        if value is None:
            continue  # e.g. accuracy without labels: reported as not measured, not as a pass
        if value != value or (kind == "min" and value < limit) or (kind == "max" and value > limit):  # NaN breaks any
            sign = ">=" if kind == "min" else "<="
            text = f"{key} {value:.4g} (needs {sign} {limit:g})"
            reasons.append(threshold(key, text, float(value) if math.isfinite(value) else None, limit))
    return reasons
