"""Image bytes in: the graph an app feeds its bitmap's RGB bytes, with the weight's preprocessing after the resize inside.

`--input-format uint8-nhwc` makes every artifact take `uint8` RGB, N x H x W x 3, at its input size: the cast, the
scaling to [0, 1], the weight's mean/std and the change to NCHW are the graph's first ops, torchvision's arithmetic
(`to(float32)`, `/ 255`, `- mean`, `/ std`; its v2 transforms multiply by 1/255, one float32 rounding apart), so
eager on the bytes gives what eager gives on torchvision's own output. The resize (and crop) stays in the app, as
preprocessing.json says.

The bytes fed in validation are the very images the float path validates on: every image task here resizes the
PIL image (bytes) before it becomes a tensor, so each normalized value is one byte's, recovered exactly
(`as_bytes` refuses inputs that are not).
"""

from __future__ import annotations

import PIL
import torch
from torch import nn

from ..device import preprocess
from ..errors import UsageError

FLOAT = "float32-nchw"
BYTES = "uint8-nhwc"


class ImageBytesInput(nn.Module):
    """`model` behind the weight's scaling and normalisation, taking uint8 N x H x W x 3."""

    def __init__(self, model: nn.Module, mean, std):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1))
        # what an fp16 graph computes in half (formats/onnx.py): the model (or the parts of it it names), never the
        # normalisation, which stays float32 as the app's bytes are exact there
        parts = getattr(model, "half_modules", None)
        self.half_modules = tuple(f"model.{name}" for name in parts) if parts else ("model",)

    def forward(self, x):
        # contiguous: a permuted input's strides would carry channels-last through the export, and ExecuTorch's
        # XNNPACK partitioner then splits the graph (measured: 11 delegated parts, 10 copies outside, 1.5x slower)
        x = x.permute(0, 3, 1, 2).contiguous().to(torch.float32).div(255).sub(self.mean).div(self.std)
        return self.model(x)


def as_bytes(images: torch.Tensor, mean, std) -> torch.Tensor:
    """The uint8 N x H x W x 3 images whose scaling and normalisation give `images` (normalized N x 3 x H x W), or
    a UsageError when they are not whole bytes (a transform that resized after scaling)."""
    m = torch.tensor(mean, dtype=torch.float64).reshape(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).reshape(1, -1, 1, 1)
    scaled = (images.double() * s + m) * 255
    pixels = scaled.round().clamp(0, 255)
    off = float((scaled - pixels).abs().max()) if scaled.numel() else 0.0
    if off > 1e-3:
        raise UsageError(
            f"--input-format {BYTES}: these inputs are not whole bytes after the weight's normalisation (off by "
            f"{off:.3g} of a grey level): the transform scales before it resizes, so no app's bitmap holds them"
        )
    return pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def preprocessing(task, weights, input_format: str) -> dict:
    """preprocessing.json for a build of `task` whose artifacts take `input_format`: the task's (the resize and crop
    the app does either way, naming the build's numpy reference of them), saying for uint8-nhwc that the rest is
    inside the graph."""
    described = task.preprocessing(weights)
    if preprocess.SHIPPED_AS in task.device_files():
        described["reference"] = {
            "file": preprocess.SHIPPED_AS,
            "functions": ["resize_and_crop", "normalized"],
            "note": "numpy alone: torchvision's resize (and crop) of a PIL image, to the byte, as this Pillow does it",
            "pillow": PIL.__version__,  # its pass order is Pillow 13's; an older Pillow rounds some pixels otherwise
        }
    if input_format != BYTES:
        return described
    return {
        **described,
        "input_format": BYTES,
        "layout": "NHWC",
        "dtype": "uint8",
        "range": "RGB bytes 0..255 after the resize (and crop); the graph scales them to [0, 1] and applies mean/std "
        "(listed for reference: the app does not)",
    }


def describe(input_format: str, example: torch.Tensor) -> dict:
    """An artifact's input as the manifest and bundle.json record it (`example`: what it was exported with)."""
    if input_format == BYTES:
        return {
            "format": BYTES,
            "dtype": "uint8",
            "layout": "NHWC",
            "shape": list(example.shape),
            "preprocessing": "inside the graph after the resize (and crop): cast, / 255, - mean, / std, to NCHW",
        }
    return {"format": FLOAT, "dtype": "float32", "layout": "NCHW", "shape": list(example.shape)}
