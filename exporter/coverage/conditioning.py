"""How well a random reference can judge each precision: eager itself with its tensors rounded (the roundings are
the engine's, exporter/engine/conditioning.py, which every build runs on an artifact that failed fidelity; the
sweep measures them for every row, with the margins and errors its table weighs).

A random model can be so ill-conditioned that any runtime computing in a given precision lands far from eager,
however correct its export (measured: a random EfficientNetV2-S in float32 is ~22 dB from the same model in
float64; random MobileNetV3 int8 agrees on top-1 with eager on 3 of 8 images while its logits are 32 dB close,
because a random head's top-1 margins are tiny). Such a row says nothing about the exporter. So, per weight, on
the build's own validation inputs, eager is run three more ways and judged against eager with the artifacts'
thresholds:

    fp32  eager in float64 (the reference's own rounding error: what any float32 runtime may differ by)
    fp16  weights and every layer's output rounded to float16
    int8  weights rounded per output channel, every layer's output per tensor, to 8 bits (symmetric,
          scale from the tensor's own max: finer than the calibrated static scales int8 runtimes use)
    int8_static  the same weights; every layer's output to 8 bits with one affine range per call site, fixed
          beforehand from the calibration images' min and max, as a static int8 runtime does: a random model
          whose activation outliers move from image to image clips where the dynamic scale does not
          (measured: a random EfficientNetV2-S, 24.5 dB static against 29.3 dB dynamic)

When this "floor" (for int8, either of its two) already breaks a threshold that an artifact of that precision
broke, the artifact's failure is the reference's conditioning, not the export: the sweep says "ill-conditioned".
For class scores it also keeps, per image, eager's top-1 margin and each rounding's RMS error, so that a top-1
the floor happened to keep can be told to be a near-tie (coverage.outcome).
When the floor passes and the artifact fails, the failure is ours to explain."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..engine.conditioning import PRECISIONS, STATIC, outputs
from ..precision import Precision

__all__ = ["PRECISIONS", "STATIC", "floor", "outputs", "top1_margins", "weight_row"]


def floor(
    task,
    model: nn.Module,
    images: torch.Tensor,
    reference: torch.Tensor,
    thresholds: dict,
    calibration=None,
    labels=None,
) -> dict:
    """Per precision in `thresholds` (and STATIC, given `calibration` and int8 thresholds): the fidelity metrics
    eager rounded that way reaches against `reference` (eager's own float32 outputs on `images`) and the
    thresholds it breaks; with `labels` (the trained tier), the labeled ones (accuracy_drop) too."""
    result = {"labeled": True} if labels is not None else {}
    eager_labeled = task.labeled(reference, labels) if labels is not None else None
    variants = [(p, p) for p in PRECISIONS if p in thresholds]
    if calibration and Precision.INT8 in thresholds:
        variants.append((STATIC, Precision.INT8))
    margins = top1_margins(reference)
    if margins is not None:
        result["margins"] = margins
    for variant, precision in variants:
        rounded = outputs(model, images, variant, calibration)
        quality = task.quality(rounded, reference, labels, eager_labeled, thresholds[precision])
        result[variant] = {
            "fidelity": {k: _finite(v) for k, v in quality["fidelity"].items() if isinstance(v, (int, float))},
            "reasons": quality["reasons"],
        }
        if quality.get("accuracy"):
            result[variant]["accuracy"] = {k: v for k, v in quality["accuracy"].items() if isinstance(v, (int, float))}
        if margins is not None:
            error = (rounded.double() - reference.double()).reshape(len(reference), -1)
            result[variant]["rms"] = [round(v, 6) for v in error.pow(2).mean(1).sqrt().tolist()]
    return result


def weight_row(
    task, quantized: nn.Module, images: torch.Tensor, reference: torch.Tensor, labels, thresholds: dict
) -> dict:
    """An eager-quantized weight (torchvision's int8 models) run as it is and judged against its float model
    (`reference`, on `images`) with the int8 thresholds, labeled ones included: what the weight itself loses,
    which no artifact of it can win back."""
    with torch.no_grad():
        outputs = torch.cat([quantized(x[None]) for x in images]).float()
    eager_labeled = task.labeled(reference, labels) if labels is not None else None
    quality = task.quality(outputs, reference, labels, eager_labeled, thresholds)
    return {
        "fidelity": {k: _finite(v) for k, v in quality["fidelity"].items() if isinstance(v, (int, float))},
        "reasons": quality["reasons"],
    }


def top1_margins(reference: torch.Tensor) -> list[float] | None:
    """Per image, eager's top-1 score minus its runner-up's, where the outputs are one row of class scores per
    image (else None): how far a rounding must move the scores to flip that image's top-1."""
    if reference.dim() != 2 or reference.shape[1] < 2:
        return None
    top2 = reference.double().topk(2, 1).values
    return [round(v, 6) for v in (top2[:, 0] - top2[:, 1]).tolist()]


def _finite(value):
    return "inf" if isinstance(value, float) and math.isinf(value) else value
