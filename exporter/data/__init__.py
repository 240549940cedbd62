"""Calibration and validation inputs: an ImageFolder, or a deterministic synthetic set."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from ..errors import UsageError
from .class_names import folder_classes, unnamed

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif"}


@dataclass
class Inputs:
    calibration: list[torch.Tensor]  # batch-1 tensors
    validation: torch.Tensor  # N x C x H x W (clips: N x C x T x H x W)
    labels: torch.Tensor | None  # N, or None when unlabeled
    classes: list[str] | None  # class folders, in class-index order
    description: dict = field(default_factory=dict)
    calibration_labels: torch.Tensor | None = None  # lets int8 budgets check accuracy on held-out calibration images

    @property
    def example(self) -> torch.Tensor:
        return self.validation[:1]


def _class_folders(root: Path) -> list[str]:
    if not root.is_dir():
        raise UsageError(f"--data {root} is not a directory")
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def _scan(root: Path, items_in, num_classes: int, class_names: Sequence[str] | None):
    """Class folder -> the model's class index, by the folder's name (data.class_names), in class-index order, and
    every item `items_in(folder)` finds with its folder's class index; a folder holding none is no class folder.
    `class_names`: the labels in effect for the build (None: the model's classes have no names)."""

    found = {name: items_in(root / name) for name in _class_folders(root)}
    found = {name: items for name, items in found.items() if items}
    if not found:
        return {}, []
    names = class_names if class_names is not None else unnamed(num_classes)
    classes = folder_classes(root, list(found), names, num_classes)
    return classes, [(item, index) for name, index in classes.items() for item in found[name]]


def _images_in(folder: Path) -> list[Path]:
    return [f for f in sorted(folder.rglob("*")) if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]


def _clips_in(folder: Path) -> list[list[Path]]:
    """Per clip (a subfolder), its frames in name order."""
    clips = sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    per_clip = [sorted(f for f in d.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES) for d in clips]
    return [frames for frames in per_clip if frames]


def scan_imagefolder(
    root: Path, num_classes: int, class_names: Sequence[str] | None = None
) -> tuple[dict[str, int], list[tuple[Path, int]]]:
    """DIR/<class>/<image>: class folder -> class index, and every image with its folder's class index."""
    root = Path(root)
    classes, samples = _scan(root, _images_in, num_classes, class_names)
    if not samples:
        raise UsageError(f"--data {root} has no images in class folders (expected DIR/<class>/<image>)")
    return classes, samples


def scan_clipfolder(
    root: Path, num_classes: int, class_names: Sequence[str] | None = None
) -> tuple[dict[str, int], list[tuple[list[Path], int]]]:
    """DIR/<class>/<clip>/<frame image>: class folder -> class index, and per clip its frames in name order with
    its folder's class index."""
    root = Path(root)
    classes, samples = _scan(root, _clips_in, num_classes, class_names)
    if not samples:
        raise UsageError(f"--data {root} has no clips in class folders (expected DIR/<class>/<clip>/<frame image>)")
    return classes, samples


def split(n: int, calib_size: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if n < calib_size + val_size:
        calib_size = min(calib_size, n // 2)
        val_size = n - calib_size
    order = np.random.default_rng(seed).permutation(n)
    return order[:calib_size], order[calib_size : calib_size + val_size]


# what Pillow 13 raises on a hostile or broken file besides OSError, as seen on truncated and byte-flipped PNG, PPM,
# TIFF and BMP files: DecompressionBombError (a header past 2 x Image.MAX_IMAGE_PIXELS), ValueError (a PPM header,
# TIFF extents), SyntaxError ("broken PNG file"); its plugins also raise EOFError (APNG frames) and struct.error
_UNREADABLE = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


def _rgb(path: Path, what: str) -> Image.Image:
    """The image file as RGB, or a one-line refusal naming it."""
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except _UNREADABLE as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UsageError(f"cannot read {what} {path}: {reason}") from None


def _load_image(path: Path, preprocess) -> torch.Tensor:
    return preprocess(_rgb(path, "image"))


def _labeled(
    root: Path,
    classes: dict[str, int],
    samples,
    load,
    calib_size: int,
    val_size: int,
    seed: int,
    num_classes: int,
    counted: str,
) -> Inputs:
    """Calibration and labeled validation inputs from (item, class index) samples, `load` turning an item into
    one preprocessed input; `classes`: class folder -> class index."""
    calib_idx, val_idx = split(len(samples), calib_size, val_size, seed)
    val_labels = torch.as_tensor([samples[i][1] for i in val_idx], dtype=torch.long)
    return Inputs(
        [load(samples[i][0])[None] for i in calib_idx],
        torch.stack([load(samples[i][0]) for i in val_idx]),
        val_labels,
        list(classes),
        calibration_labels=torch.as_tensor([samples[i][1] for i in calib_idx], dtype=torch.long),
        description={
            "source": str(Path(root).resolve()),
            "labeled": True,
            counted: len(samples),
            "classes": len(classes),  # class folders
            "model_classes": num_classes,
            "scored_classes": len(set(val_labels.tolist())),  # among the validation inputs
            "class_folders": classes,  # by name (data.class_names), not by position
            "calibration": len(calib_idx),
            "validation": len(val_idx),
            "seed": seed,
        },
    )


def from_imagefolder(
    root: Path, preprocess, calib_size: int, val_size: int, seed: int, num_classes: int, class_names=None
) -> Inputs:
    """Labeled images, DIR/<class>/<image>; `class_names`: the labels in effect (data.class_names reads each
    folder's name against them), None where the model's classes have no names."""
    classes, samples = scan_imagefolder(root, num_classes, class_names)
    return _labeled(
        root,
        classes,
        samples,
        lambda path: _load_image(path, preprocess),
        calib_size,
        val_size,
        seed,
        num_classes,
        "images",
    )


def _load_clip(frames: list[Path], preprocess) -> torch.Tensor:
    return preprocess([_rgb(path, "frame") for path in frames])


def from_clipfolder(
    root: Path, preprocess, calib_size: int, val_size: int, seed: int, num_classes: int, class_names=None
) -> Inputs:
    """Labeled clips, DIR/<class>/<clip>/<frame image>: `preprocess` samples each clip's frames evenly to the
    graph's frame count; `class_names` as from_imagefolder's."""
    classes, samples = scan_clipfolder(root, num_classes, class_names)
    return _labeled(
        root,
        classes,
        samples,
        lambda frames: _load_clip(frames, preprocess),
        calib_size,
        val_size,
        seed,
        num_classes,
        "clips",
    )


def _synthetic_image(rng: np.random.Generator, size: int = 256) -> Image.Image:
    # smooth colour fields plus texture: natural-ish statistics, unlike plain noise
    yy, xx = np.mgrid[0:size, 0:size] / size
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.5, 6, 2).tolist() + [rng.uniform(0, 2 * np.pi)]
        channels.append(0.5 + 0.35 * np.sin(2 * np.pi * (fx * xx + fy * yy) + phase))
    img = np.stack(channels, -1) + rng.normal(0, 0.08, (size, size, 3))
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8), "RGB")


def synthetic(preprocess, calib_size: int, val_size: int, seed: int) -> Inputs:
    rng = np.random.default_rng(seed)
    images = [preprocess(_synthetic_image(rng)) for _ in range(calib_size + val_size)]
    return Inputs(
        [x[None] for x in images[:calib_size]],
        torch.stack(images[calib_size:]),
        None,
        None,
        {
            "source": "synthetic",
            "labeled": False,
            "calibration": calib_size,
            "validation": val_size,
            "seed": seed,
            "note": "no --data: labeled accuracy was not measured; int8 was calibrated on synthetic images",
        },
    )


def load_inputs(path: Path | None, task, weights, settings, class_names: Sequence[str] | None = None) -> Inputs:
    """The build's calibration and validation images, as `task` (bound to its input size) reads them: from the
    --data folder, else synthetic; `settings`: the plan's DataSettings; `class_names`: the labels in effect for the
    build (a class folder is read by its name against them)."""
    transform = task.transform(weights)
    size = (settings.calib_size, settings.val_size, settings.seed)
    if path is None:
        return synthetic(transform, *size)
    return task.load_data(Path(path), transform, *size, class_names=class_names)
