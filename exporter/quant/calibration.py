"""What every int8 format is given: calibration images, optional labels, the accuracy budget and how
to meet it. Torch-free, so profiles and the CLI can build it without importing torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

# [quantization] keys of a target profile (and of --quant-budget), with their defaults
SETTINGS = {
    "fallback": True,  # keep the most sensitive layers in float until the budget holds
    "max_float_fraction": 0.25,  # cap on the share of quantizable layers kept in float
    "check_fraction": 0.5,  # share of the calibration images held out to check the budget
    "psnr_margin_db": 2.0,  # the budget's PSNR is the threshold plus this: the check set is small
    "onnx_calibration": "auto",  # auto (the best of the others on the check images) | mse | minmax | percentile
    "dynamic_ranges": True,  # .pte: when static ranges miss the budget, try ranges chosen per inference (dynamic int8)
}
ONNX_CALIBRATIONS = ("auto", "mse", "minmax", "percentile")
# Set only by a build, never by a profile: False makes a backend with ranges chosen per inference start from them
# (the artifact's calibrated ranges did not hold on the validation inputs). Absent from every other build's settings,
# so their cache keys and manifests are as before.
STATIC_RANGES = "static_ranges"
# settings only one kind of quantizer reads: a manifest lists them only for the backends that name them (`settings`)
BACKEND_SETTINGS = ("onnx_calibration", "dynamic_ranges", STATIC_RANGES)


@dataclass
class Calibration:
    """Batch-1 calibration images; iterating yields them, as formats did before budgets existed."""

    images: list
    labels: object = None  # per image: a class index, a mask... (the task's labels), or None for unlabeled data
    budget: dict = field(default_factory=dict)  # threshold key -> limit, as in [thresholds.int8]
    settings: dict = field(default_factory=lambda: dict(SETTINGS))
    log: Callable[[str], None] = field(default=lambda _message: None, repr=False)  # progress of the search
    task: object = None  # the build's exporter.tasks.Task: how outputs are judged against the budget

    def __iter__(self):
        return iter(self.images)

    def __len__(self) -> int:
        return len(self.images)

    def split(self) -> tuple[list, list, object]:
        """(images that set the ranges, images that check the budget, labels of the check images).
        Interleaved rather than halved, so that an ImageFolder's order cannot put one class on one side."""
        n = len(self.images)
        # check_fraction of them (at least one, never all), spread evenly: at 0.5 the odd-numbered images
        held = min(n - 1, max(1, math.floor(self.settings["check_fraction"] * n))) if n >= 4 else 0
        check_idx = [math.floor((j + 0.5) * n / held) for j in range(held)]
        ranges = [x for i, x in enumerate(self.images) if i not in set(check_idx)]
        check = [self.images[i] for i in check_idx]
        labels = None if self.labels is None or not check_idx else self.labels[check_idx]
        return ranges, check, labels

    def budget_thresholds(self) -> dict:
        budget = dict(self.budget)
        if "psnr_db" in budget:
            budget["psnr_db"] = budget["psnr_db"] + self.settings["psnr_margin_db"]
        return budget

    def describe(self, backend_settings: tuple[str, ...] = ()) -> dict:
        ranges, check, labels = self.split()
        settings = {k: v for k, v in self.settings.items() if k not in BACKEND_SETTINGS or k in backend_settings}
        return {
            "range_images": len(ranges),
            "check_images": len(check),
            "check_labeled": labels is not None,
            "budget": self.budget_thresholds(),
            **settings,
        }
