"""How well a random reference can judge each precision: eager itself with its tensors rounded.

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

import copy
import math

import torch
from torch import nn

PRECISIONS = ("fp32", "fp16", "int8")
STATIC = "int8_static"  # judged with the int8 thresholds
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)


def _round_fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _round_int8(t: torch.Tensor, per_channel: bool = False) -> torch.Tensor:
    if per_channel and t.dim() > 1:
        scale = t.abs().flatten(1).amax(1).clamp_min(1e-12) / 127
        scale = scale.view(-1, *([1] * (t.dim() - 1)))
    else:
        scale = t.abs().max().clamp_min(1e-12) / 127
    return (t / scale).round().clamp(-127, 127) * scale


def _leaves(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if not list(m.children())]


def _rounded_weights(model: nn.Module, precision: str) -> nn.Module:
    model = copy.deepcopy(model).float().eval()
    rnd = _round_fp16 if precision == "fp16" else (lambda t: _round_int8(t, per_channel=True))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, _WEIGHTED):
                module.weight.copy_(rnd(module.weight))
    return model


def _rounded_copy(model: nn.Module, precision: str) -> nn.Module:
    """A copy of `model` whose weights and leaf-module outputs are rounded to `precision`."""
    model = _rounded_weights(model, precision)
    rnd_out = _round_fp16 if precision == "fp16" else _round_int8

    def hook(_module, _inputs, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return rnd_out(output)
        return output

    for module in _leaves(model):
        module.register_forward_hook(hook)
    return model


class _CallSites:
    """Counts each leaf's calls within one forward, so that a module used twice (ResNet's shared ReLU) has
    two ranges, as a graph quantizer's two observers would."""

    def __init__(self, model: nn.Module):
        self.calls: dict[int, int] = {}
        model.register_forward_pre_hook(lambda *_: self.calls.clear())

    def next(self, module: nn.Module) -> tuple[int, int]:
        n = self.calls.get(id(module), 0)
        self.calls[id(module)] = n + 1
        return id(module), n


def _static_copy(model: nn.Module, calibration: list[torch.Tensor]) -> nn.Module:
    """`model` with per-channel int8 weights and each leaf output fake-quantized to uint8 with an affine range
    observed (min/max, zero included) over `calibration`; values outside it clip."""
    model = _rounded_weights(model, "int8")
    sites = _CallSites(model)
    ranges: dict[tuple[int, int], tuple[float, float]] = {}
    observing = True

    def hook(module, _inputs, output):
        if not (isinstance(output, torch.Tensor) and output.is_floating_point()):
            return output
        site = sites.next(module)
        if observing:
            lo, hi = ranges.get(site, (0.0, 0.0))
            ranges[site] = (min(lo, output.min().item()), max(hi, output.max().item()))
            return output
        if site not in ranges:  # a call site calibration never reached: leave it float
            return output
        lo, hi = ranges[site]
        scale = max(hi - lo, 1e-12) / 255
        zero = round(-lo / scale)
        return ((output / scale).round() + zero).clamp(0, 255).sub(zero).mul(scale)

    for module in _leaves(model):
        module.register_forward_hook(hook)
    with torch.no_grad():
        for x in calibration:
            model(x.float())
    observing = False
    return model


def outputs(model: nn.Module, images: torch.Tensor, precision: str, calibration=None) -> torch.Tensor:
    """`model`'s outputs on `images`, one image at a time (per-tensor scales are per image), as `precision`
    would leave them; float32 tensors (the fp32 row computes in float64). STATIC needs `calibration`
    (batch-1 images)."""
    if precision == "fp32":
        variant, cast = copy.deepcopy(model).double().eval(), torch.float64
    elif precision == STATIC:
        variant, cast = _static_copy(model, calibration), torch.float32
    else:
        variant, cast = _rounded_copy(model, precision), torch.float32
    with torch.no_grad():
        rows = [variant(x[None].to(cast)).float() for x in images]
    return torch.cat(rows)


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
    if calibration and "int8" in thresholds:
        variants.append((STATIC, "int8"))
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
