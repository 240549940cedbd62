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

When this "floor" already breaks a threshold that an artifact of that precision broke, the artifact's failure is
the reference's conditioning, not the export: the sweep says "ill-conditioned". When the floor passes and the
artifact fails, the failure is ours to explain."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

PRECISIONS = ("fp32", "fp16", "int8")
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


def _rounded_copy(model: nn.Module, precision: str) -> nn.Module:
    """A copy of `model` whose weights and leaf-module outputs are rounded to `precision`."""
    model = copy.deepcopy(model).float().eval()
    if precision == "fp16":
        rnd_weight, rnd_out = _round_fp16, _round_fp16
    else:
        rnd_weight, rnd_out = (lambda t: _round_int8(t, per_channel=True)), _round_int8
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, _WEIGHTED):
                module.weight.copy_(rnd_weight(module.weight))

    def hook(_module, _inputs, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return rnd_out(output)
        return output

    for module in model.modules():
        if not list(module.children()):
            module.register_forward_hook(hook)
    return model


def outputs(model: nn.Module, images: torch.Tensor, precision: str) -> torch.Tensor:
    """`model`'s outputs on `images`, one image at a time (per-tensor scales are per image), as `precision`
    would leave them; float32 tensors (the fp32 row computes in float64)."""
    if precision == "fp32":
        variant, cast = copy.deepcopy(model).double().eval(), torch.float64
    else:
        variant, cast = _rounded_copy(model, precision), torch.float32
    with torch.no_grad():
        rows = [variant(x[None].to(cast)).float() for x in images]
    return torch.cat(rows)


def floor(task, model: nn.Module, images: torch.Tensor, reference: torch.Tensor, thresholds: dict) -> dict:
    """Per precision in `thresholds`: the fidelity metrics eager rounded that way reaches against `reference`
    (eager's own float32 outputs on `images`) and the thresholds it breaks."""
    result = {}
    for precision in PRECISIONS:
        if precision not in thresholds:
            continue
        quality = task.quality(outputs(model, images, precision), reference, None, None, thresholds[precision])
        result[precision] = {
            "fidelity": {k: _finite(v) for k, v in quality["fidelity"].items() if isinstance(v, (int, float))},
            "reasons": quality["reasons"],
        }
    return result


def _finite(value):
    return "inf" if isinstance(value, float) and math.isinf(value) else value

