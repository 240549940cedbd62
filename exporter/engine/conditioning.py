"""Whether a failed artifact's reference could judge it at all: eager itself, rounded to the artifact's precision.

A checkpoint can be so ill-conditioned that any runtime computing in a given precision lands far from eager,
however correct its export (measured: a random EfficientNetV2-S whose batch norms were settled on other images is
23.5 dB from the same model in float64 on its validation inputs; its fp32 .pte failed at 15.5 dB). Eager is
run on the same validation inputs the way an artifact of that precision must compute, and judged against eager
with the artifact's own thresholds:

    fp32  eager in float64 (the reference's own rounding error: what any float32 runtime may differ by)
    fp16  weights and every layer's output rounded to float16
    int8  weights rounded per output channel, every layer's output per tensor, to 8 bits (symmetric,
          scale from the tensor's own max: finer than the calibrated static scales int8 runtimes use)
    int8_static  the same weights; every layer's output to 8 bits with one affine range per call site, fixed
          beforehand from the calibration images' min and max, as a static int8 runtime does: a model whose
          activation outliers move from image to image clips where the dynamic scale does not
          (measured: a random EfficientNetV2-S, 24.5 dB static against 29.3 dB dynamic)

When this "floor" (for int8, either of its two) already breaks every fidelity threshold the artifact broke, and
the artifact's PSNR is not far below the floor's, the failure is the checkpoint's conditioning, not the export:
the build adds a reason of kind ILL_CONDITIONED_REFERENCE (`add`). The status stays failed: the artifact does
not meet its thresholds, and the user learns that no export of this checkpoint would.

Only a failed artifact that broke a fidelity threshold pays for it (one more eager pass over the validation
inputs per floor); a passing one costs nothing. The coverage sweep (coverage/conditioning.py) measures the same
floors for every row."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..precision import Precision
from ..results import ArtifactResult, Kind, Reason, Status, kinds
from ..thresholds import THRESHOLD_KEYS, breaches

if TYPE_CHECKING:
    from .context import BuildContext

PRECISIONS = (Precision.FP32, Precision.FP16, Precision.INT8)  # the precisions eager can be rounded to
STATIC = "int8_static"  # judged with the int8 thresholds
# the floors an artifact is judged against
FLOORS = {
    Precision.FP32: (Precision.FP32,),
    Precision.FP16: (Precision.FP16,),
    Precision.INT8: (Precision.INT8, STATIC),
}
# an artifact this far below its floor's PSNR is worse than that rounding explains. fp16 and int8 floors stand for
# the artifact's own rounding: twice the floor's RMS error (over the 2026-11 coverage table, artifacts a floor
# explains sit within 3.5 dB of it; MaxViT-T's int8 .pte 17 dB below, which no rounding explains). The fp32 floor is
# eager's own float32 error; another float32 runtime's order of operations may err several times more (measured: a
# digits MobileNetV3 whose classifier cancels a 1e6 shift, its fp32 .pte 17 dB below eager's float64 floor): 10x.
PSNR_MARGIN_DB = {Precision.FP32: 20.0, Precision.FP16: 6.0, Precision.INT8: 6.0}
HOW = {
    Precision.FP32: "eager computed in float64 instead of float32",
    Precision.FP16: "eager with its weights and every layer's output rounded to float16",
    Precision.INT8: "eager with its weights rounded to int8 per channel and every layer's output to int8 (per tensor, "
    "each output's own range)",
    STATIC: "eager with its weights rounded to int8 per channel and every layer's output to int8 (ranges fixed "
    "on the calibration images)",
}
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
    rnd = _round_fp16 if precision == Precision.FP16 else (lambda t: _round_int8(t, per_channel=True))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, _WEIGHTED):
                module.weight.copy_(rnd(module.weight))
    return model


def _rounded_copy(model: nn.Module, precision: str) -> nn.Module:
    """A copy of `model` whose weights and leaf-module outputs are rounded to `precision`."""
    model = _rounded_weights(model, precision)
    rnd_out = _round_fp16 if precision == Precision.FP16 else _round_int8

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
    model = _rounded_weights(model, Precision.INT8)
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
    if precision == Precision.FP32:
        variant, cast = copy.deepcopy(model).double().eval(), torch.float64
    elif precision == STATIC:
        variant, cast = _static_copy(model, calibration), torch.float32
    else:
        variant, cast = _rounded_copy(model, precision), torch.float32
    with torch.no_grad():
        rows = [variant(x[None].to(cast)).float() for x in images]
    return torch.cat(rows)


def fidelity_limits(thresholds) -> dict:
    return {k: v for k, v in thresholds.items() if THRESHOLD_KEYS[k][0][0] == "fidelity"}


def broken_fidelity(fidelity: dict | None, thresholds) -> set[str]:
    """The fidelity threshold keys `fidelity` breaks (a metric not measured breaks none)."""
    if not fidelity:
        return set()
    return {key for key, limit in fidelity_limits(thresholds).items() if breaches({"fidelity": fidelity}, {key: limit})}


def ill_conditioned(
    task,
    model: nn.Module,
    images: torch.Tensor,
    reference: torch.Tensor,
    precision: str,
    thresholds,
    fidelity: dict | None,
    calibration=None,
) -> Reason | None:
    """A reason of kind ILL_CONDITIONED_REFERENCE when eager (`model`, whose float32 outputs on `images` are
    `reference`, one flattened row per input) rounded to `precision` already breaks every fidelity threshold an
    artifact broke (`fidelity`, the artifact's metrics), the artifact's PSNR within PSNR_MARGIN_DB of the
    floor's; else None (and at once, computing nothing, when the artifact broke no fidelity threshold)."""
    broken = broken_fidelity(fidelity, thresholds)
    if not broken or precision not in FLOORS:
        return None
    for floor in FLOORS[precision]:
        if floor == STATIC and not calibration:
            continue
        rounded = outputs(model, images, floor, calibration).reshape(len(images), -1)
        if not torch.isfinite(rounded).all():
            continue  # a rounding that overflows says nothing a threshold can weigh
        measured = task.fidelity(reference, rounded)
        if not broken <= broken_fidelity(measured, thresholds):
            continue
        limits = fidelity_limits(thresholds)
        found = "; ".join(str(r) for r in breaches({"fidelity": measured}, {k: limits[k] for k in sorted(broken)}))
        said = f"{HOW[floor]} breaks the same thresholds on the same validation inputs ({found})"
        if _far_below(fidelity, measured, PSNR_MARGIN_DB[precision]):
            continue  # further from eager than this rounding explains: it excuses nothing
        return Reason(
            Kind.ILL_CONDITIONED_REFERENCE,
            f"ill-conditioned reference: {said}: this checkpoint's outputs move that far under {precision} rounding "
            f"alone, so the failure is the checkpoint's (the eager reference's), not the export's",
        )
    return None


def _far_below(fidelity: dict, floor: dict, margin_db: float) -> bool:
    artifact, reached = fidelity.get("psnr_db"), floor.get("psnr_db")
    numbers = isinstance(artifact, (int, float)) and isinstance(reached, (int, float))
    return numbers and artifact < reached - margin_db


def note_ill_conditioned(session: BuildContext, entry: ArtifactResult) -> None:
    """After an artifact's validation: when it failed a fidelity threshold, the reason saying that its reference
    is ill-conditioned at its precision, if it is (see ill_conditioned). A passing artifact costs nothing; a floor
    that cannot be computed (a graph that does not run in float64) says nothing."""
    if entry.status is not Status.FAILED or not broken_fidelity(entry.fidelity, entry.thresholds):
        return
    if kinds(entry.reasons) & {Kind.NON_FINITE, Kind.DEGENERATE_REFERENCE}:
        return  # no rounding of eager explains NaN, and a degenerate reference judges nothing
    try:
        reason = ill_conditioned(
            session.task,
            session.loaded.eager,
            session.inputs.validation,
            session.reference,
            entry.precision,
            entry.thresholds,
            entry.fidelity,
            session.inputs.calibration,
        )
    except Exception:  # the floor is a hint about the reference; it never fails a build
        return
    if reason is not None:
        entry.reasons = [*entry.reasons, reason]
