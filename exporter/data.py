"""Calibration and validation inputs: an ImageFolder, or a deterministic synthetic set."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .errors import UsageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif"}


@dataclass
class Inputs:
    calibration: list[torch.Tensor]  # batch-1 tensors
    validation: torch.Tensor  # N x C x H x W (clips: N x C x T x H x W)
    labels: torch.Tensor | None  # N, or None when unlabeled
    classes: list[str] | None
    description: dict = field(default_factory=dict)
    calibration_labels: torch.Tensor | None = None  # lets int8 budgets check accuracy on held-out calibration images

    @property
    def example(self) -> torch.Tensor:
        return self.validation[:1]


def _class_folders(root: Path) -> list[str]:
    if not root.is_dir():
        raise UsageError(f"--data {root} is not a directory")
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def scan_imagefolder(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    root = Path(root)
    classes = _class_folders(root)
    samples = []
    for index, name in enumerate(classes):
        for f in sorted((root / name).rglob("*")):
            if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES:
                samples.append((f, index))
    if not samples:
        raise UsageError(f"--data {root} has no images in class folders (expected DIR/<class>/<image>)")
    return classes, samples


def scan_clipfolder(root: Path) -> tuple[list[str], list[tuple[list[Path], int]]]:
    """DIR/<class>/<clip>/<frame image>: the classes and, per clip, its frames in name order."""
    root = Path(root)
    classes = _class_folders(root)
    samples = []
    for index, name in enumerate(classes):
        for clip in sorted(d for d in (root / name).iterdir() if d.is_dir() and not d.name.startswith(".")):
            frames = sorted(f for f in clip.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
            if frames:
                samples.append((frames, index))
    if not samples:
        raise UsageError(f"--data {root} has no clips in class folders (expected DIR/<class>/<clip>/<frame image>)")
    return classes, samples


def split(n: int, calib_size: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if n < calib_size + val_size:
        calib_size = min(calib_size, n // 2)
        val_size = n - calib_size
    order = np.random.default_rng(seed).permutation(n)
    return order[:calib_size], order[calib_size : calib_size + val_size]


def _load_image(path: Path, preprocess) -> torch.Tensor:
    try:
        with Image.open(path) as im:
            return preprocess(im.convert("RGB"))
    except (UnidentifiedImageError, OSError) as e:
        raise UsageError(f"cannot read image {path}: {e}") from None


def _labeled(
    root: Path, classes, samples, load, calib_size: int, val_size: int, seed: int, num_classes: int, counted: str
) -> Inputs:
    """Calibration and labeled validation inputs from (item, class index) samples, `load` turning an item into
    one preprocessed input."""
    if len(classes) > num_classes:
        raise UsageError(f"--data {root} has {len(classes)} class folders but the model has {num_classes} classes")
    calib_idx, val_idx = split(len(samples), calib_size, val_size, seed)
    return Inputs(
        [load(samples[i][0])[None] for i in calib_idx],
        torch.stack([load(samples[i][0]) for i in val_idx]),
        torch.as_tensor([samples[i][1] for i in val_idx]),
        classes,
        calibration_labels=torch.as_tensor([samples[i][1] for i in calib_idx], dtype=torch.long),
        description={
            "source": str(Path(root).resolve()),
            "labeled": True,
            counted: len(samples),
            "classes": len(classes),
            "calibration": len(calib_idx),
            "validation": len(val_idx),
            "seed": seed,
        },
    )


def from_imagefolder(root: Path, preprocess, calib_size: int, val_size: int, seed: int, num_classes: int) -> Inputs:
    classes, samples = scan_imagefolder(root)
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
    images = []
    for path in frames:
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise UsageError(f"cannot read frame {path}: {e}") from None
    return preprocess(images)


def from_clipfolder(root: Path, preprocess, calib_size: int, val_size: int, seed: int, num_classes: int) -> Inputs:
    """Labeled clips: `preprocess` samples each clip's frames evenly to the graph's frame count."""
    classes, samples = scan_clipfolder(root)
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


def load_inputs(path: Path | None, task, weights, settings) -> Inputs:
    """The build's calibration and validation images, as `task` (bound to its input size) reads them: from the
    --data folder, else synthetic; `settings`: the plan's DataSettings."""
    transform = task.transform(weights)
    size = (settings.calib_size, settings.val_size, settings.seed)
    if path is None:
        return synthetic(transform, *size)
    return task.load_data(Path(path), transform, *size)
