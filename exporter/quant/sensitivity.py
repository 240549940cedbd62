"""How much each quantizable layer costs when it alone is int8, measured in eager PyTorch.

The simulation is what every int8 backend here does to a convolution or linear layer: symmetric
per-channel int8 weights and a symmetric per-tensor int8 input whose range minimises the rounding
plus clipping error on the calibration images (what a histogram or entropy calibrator aims at).
One batched forward pass per layer, no export: cheap enough to run whenever plain PTQ misses the
budget, and independent of the format, so the ONNX and ExecuTorch int8 artifacts rank layers alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..tasks.base import logit_fidelity
from .threads import one_thread

QUANTIZABLE = (nn.Conv2d, nn.Conv1d, nn.Linear)
SAMPLE = 1 << 16  # values per layer input used to pick its range


def quantizable_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, QUANTIZABLE)]


def _fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).round().clamp(-127, 127) * scale


def _weight_fake_quant(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().flatten(1).amax(1).clamp_min(1e-12) / 127
    return _fake_quant(w, scale.view(-1, *([1] * (w.dim() - 1))))


def _sample(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """max|x| exactly, and a fixed-seed sample of x's values (the whole of x when it is small)."""
    flat = x.detach().flatten()
    peak = flat.abs().max()
    if flat.numel() > SAMPLE:
        flat = flat[torch.randint(flat.numel(), (SAMPLE,), generator=torch.Generator().manual_seed(0))]
    return peak, flat


def activation_scale(peak: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The clipping range, among fractions of max|x|, with the least squared error on a sample of x."""
    peak = peak.clamp_min(1e-12)
    best, best_error = peak / 127, None
    for fraction in torch.logspace(0, -3, 31):
        scale = peak * fraction / 127
        error = (_fake_quant(flat, scale) - flat).pow(2).mean()
        if best_error is None or error < best_error:
            best, best_error = scale, error
    return best


def activation_scales(model: nn.Module, layers: list[str], images: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per layer, the int8 scale of its input that minimises the squared error on `images`. A layer called more
    than once (a head on every FPN level) gets one scale for all its inputs, as its quantized graph has."""
    modules = dict(model.named_modules())
    samples: dict[str, tuple] = {}

    def keep(name, x):
        peak, flat = _sample(x)
        if name in samples:
            peak, flat = torch.maximum(samples[name][0], peak), torch.cat([samples[name][1], flat])
        samples[name] = peak, flat

    hooks = [
        modules[name].register_forward_pre_hook(lambda _m, args, name=name: keep(name, args[0])) for name in layers
    ]
    with torch.no_grad(), one_thread():  # ranges that do not depend on --threads: byte-identical artifacts
        try:
            model(images)
        finally:
            for h in hooks:
                h.remove()
    return {name: activation_scale(*samples[name]) for name in layers if name in samples}


def _quantized_output(module: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    weight = _weight_fake_quant(module.weight)
    if isinstance(module, nn.Linear):
        return nn.functional.linear(_fake_quant(x, scale), weight, module.bias)
    return module._conv_forward(_fake_quant(x, scale), weight, module.bias)


def local_sqnr(model: nn.Module, layers: list[str], images: torch.Tensor, scales: dict) -> dict[str, float]:
    """Per layer, in one pass: SQNR (dB) of its own output when its input and weights are int8."""
    modules = dict(model.named_modules())
    result: dict[str, float] = {}

    def hook(module, args, output, name):
        error = (_quantized_output(module, args[0], scales[name]) - output).pow(2).mean()
        result[name] = (10 * torch.log10(output.pow(2).mean() / error.clamp_min(1e-30))).item()

    hooks = [modules[n].register_forward_hook(lambda m, a, o, n=n: hook(m, a, o, n)) for n in layers if n in scales]
    with torch.no_grad():
        try:
            model(images)
        finally:
            for h in hooks:
                h.remove()
    return result


@dataclass
class Sensitivity:
    local_sqnr_db: dict[str, float]  # every layer: SQNR of its own output with its input and weights int8
    output_psnr_db: dict[str, float]  # the screened layers: PSNR of the model's output with only that layer int8

    def ranking(self) -> list[str]:
        """Most costly first: the end-to-end measurements, then the unscreened layers by local SQNR."""
        measured = sorted(self.output_psnr_db, key=self.output_psnr_db.get)
        rest = sorted((n for n in self.local_sqnr_db if n not in self.output_psnr_db), key=self.local_sqnr_db.get)
        return measured + rest


def layer_sensitivity(
    model: nn.Module,
    layers: list[str],
    range_images: torch.Tensor,
    check_images: torch.Tensor,
    reference: torch.Tensor,
    screen: int = 24,
) -> Sensitivity:
    """How much each layer costs when it alone is int8. Every layer's own output SQNR comes from one
    pass; the `screen` worst then get the end-to-end measurement against `reference` (one forward
    pass each), which keeps deep networks affordable."""
    modules = dict(model.named_modules())
    scales = activation_scales(model, layers, range_images)
    local = local_sqnr(model, layers, check_images, scales)
    result = {}
    with torch.no_grad():
        for name in sorted(local, key=local.get)[:screen]:
            module = modules[name]
            original = module.weight.detach().clone()
            module.weight.copy_(_weight_fake_quant(original))
            hook = module.register_forward_pre_hook(lambda _m, args, s=scales[name]: (_fake_quant(args[0], s),))
            try:
                output = model(check_images)
            finally:
                hook.remove()
                module.weight.copy_(original)
            result[name] = logit_fidelity(reference.reshape(len(reference), -1), output.reshape(len(output), -1))[
                "psnr_db"
            ]
    return Sensitivity(local, result)
