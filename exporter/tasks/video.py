"""Video classification: one row of class logits per clip (N, 3, T, H, W); agreement of the top-1 class, acc@1.

A clip is FRAMES frames, as torchvision's video weights are evaluated; each frame preprocessed as the weight's
transforms do (resize, centre crop, normalize). Labeled clips are a folder per class holding a folder of frames
per clip; without --data the clips are synthetic (a synthetic image panned across the frames).

Measured 2026-11-23 and 2026-11-26 (torch 2.14.1, ExecuTorch 1.5.1, coremltools 9.0, ONNX Runtime 1.32; random
weights, docs/tasks.md): ONNX Runtime runs every video classifier matching eager, and so does the TorchScript lite
interpreter (r3d_18, mc3_18, r2plus1d_18, s3d, swin3d_t, mvit_v2_s); the .pte does not (REFUSED); Core ML converts
r3d_18 once its adaptive_avg_pool3d is written as a mean (formats.rewrites), and reports any other op that stops it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import data
from ..errors import UsageError
from .classification import Classification

FRAMES = 16  # torchvision's video references evaluate 16-frame clips; MViT-V2-S takes exactly 16
PAN_PIXELS = 4  # a synthetic clip moves this far per frame

# formats that cannot take a clip, and why (measured; formats never see the task, the pipeline asks here)
REFUSED = {
    "executorch": "XNNPACK has no 3-D convolution, and the portable conv kernel outside it refuses 5-D input at run "
    "time ('Expect input tensor to be 3-D or 4-D'; r3d_18, mc3_18, r2plus1d_18); s3d's .pte also lacks "
    "max_pool3d/avg_pool3d kernels, swin3d_t's and mvit_v2_s's fail to load in XNNPACK",
    "litert": "not attempted yet: LiteRT (.tflite) is built for classification, segmentation and single-stage "
    "detection graphs (issue 62); a video classifier's 3-D convolutions on 5-D input are not measured there",
}


@dataclass(frozen=True)
class Video(Classification):
    name = "video"
    image_bytes_refusal = (
        "a video classifier takes clips (N x 3 x T x H x W), which torchvision's preset scales to float before it "
        "resizes: not offered for video weights"
    )

    @classmethod
    def input_size_of(cls, weights, model_name, requested):
        if requested is not None:  # the 3-D convolutions and adaptive pooling take any frame size from the weight's min
            least = tuple(weights.meta.get("min_size") or (1, 1))
            if any(r < m for r, m in zip(requested, least)):
                raise UsageError(f"--input-size: {model_name} takes frames of at least {least[0]}x{least[1]}")
            return tuple(int(v) for v in requested)
        crop = weights.transforms().crop_size
        return crop[0], crop[-1]

    @classmethod
    def format_refusal(cls, format_name: str, precision: str | None = None) -> str | None:
        return REFUSED.get(format_name)

    def describe(self):
        return {**super().describe(), "frames": FRAMES}

    def preprocessing(self, weights):
        t = weights.transforms()
        scale = self.input_size[0] / t.crop_size[0]  # --input-size: resize in proportion to the crop
        return {
            "task": self.name,
            "input_size": list(self.input_size),
            "frames": FRAMES,
            "resize_size": [round(s * scale) for s in t.resize_size],
            "crop_size": list(self.input_size),
            "interpolation": t.interpolation.value,
            "antialias": False,  # as torchvision's VideoClassification preset
            "mean": list(t.mean),
            "std": list(t.std),
            "layout": "NCTHW",
            "dtype": "float32",
            "range": "RGB scaled to [0, 1] before normalization, every frame alike",
            "output": self.output(),
        }

    def transform(self, weights):
        return _ClipTransform(self.preprocessing(weights))

    def load_data(self, root, transform, calib_size, val_size, seed, class_names=None):
        return data.from_clipfolder(Path(root), transform, calib_size, val_size, seed, self.num_classes, class_names)

    def output(self):
        return {
            "name": self.output_name,
            "layout": "NC",
            "shape": [1, self.num_classes],
            "meaning": "class logits of the clip, before softmax",
        }

    def preview(self, image, eager_row, artifact_row, preprocessing, labels=None):
        """Classification's picture, of the clip's middle frame."""
        return super().preview(image[:, image.shape[1] // 2], eager_row, artifact_row, preprocessing, labels)


class _ClipTransform:
    """Frames (a list of PIL images; one image: a synthetic clip panning across it) -> (3, T, H, W), by
    torchvision's VideoClassification preset at the build's sizes."""

    def __init__(self, pre: dict):
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms._presets import VideoClassification

        self.frames = pre["frames"]
        self.preset = VideoClassification(
            crop_size=pre["crop_size"],
            resize_size=pre["resize_size"],
            mean=pre["mean"],
            std=pre["std"],
            interpolation=InterpolationMode(pre["interpolation"]),
        )

    def __call__(self, frames) -> torch.Tensor:
        from torchvision.transforms.functional import pil_to_tensor

        if not isinstance(frames, (list, tuple)):
            frames = _panned(frames, self.frames)
        chosen = [frames[math.floor(i * len(frames) / self.frames)] for i in range(self.frames)]
        return self.preset(torch.stack([pil_to_tensor(f.convert("RGB")) for f in chosen]))


def _panned(image, frames: int) -> list:
    """`frames` views of `image`, each PAN_PIXELS further right (wrapping round): a clip with motion."""
    from PIL import ImageChops

    return [ImageChops.offset(image, i * PAN_PIXELS, 0) for i in range(frames)]
