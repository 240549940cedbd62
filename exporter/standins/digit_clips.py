"""A really trained torchvision video classifier, offline: R3D-18 trained on clips of scikit-learn's digits
moving across the frame (the digits stand-in's images, its split and its training loop), at a small frame
size so that training takes a minute or two. Its held-out clips are written as the video task reads labeled
clips: DIR/<class>/<clip>/<frame>.png."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from .. import files
from . import digits, one_at_a_time, save_checkpoint, weight_stem, write_once

WEIGHT = "R3D_18_Weights.KINETICS400_V1"
FRAME_SIZE = (16, 16)  # the graph's --input-size
CANVAS = 32  # frames are CANVAS pixels square; the digit (8x8, upscaled 2x) slides from left to right
EPOCHS = 2
TRAIN_CLIPS = 800  # of the digits' training split: enough for R3D-18 to learn them in two epochs
RECIPE_VERSION = 1


@dataclass(frozen=True)
class DigitClipsModel:
    weight: str
    checkpoint: Path
    data_dir: Path  # held-out clips, DIR/<class>/<clip>/<frame>.png
    labels_file: Path
    held_out_accuracy: float
    input_size: tuple[int, int] = FRAME_SIZE


def clip_frames(image: Image.Image, frames: int) -> list[Image.Image]:
    """The digit upscaled 2x and slid across a black CANVAS, one position per frame."""
    digit = image.resize((16, 16), Image.NEAREST)
    travel = CANVAS - digit.width
    out = []
    for t in range(frames):
        frame = Image.new("L", (CANVAS, CANVAS))
        frame.paste(digit, (round(t * travel / max(frames - 1, 1)), (CANVAS - digit.height) // 2))
        out.append(frame.convert("RGB"))
    return out


def _dataset(transform, frames: int):
    images, targets = digits._digit_images()
    x = torch.stack([transform(clip_frames(im, frames)) for im in images])
    train_idx, held_idx = digits._split(len(images))
    return x, torch.as_tensor(targets), train_idx[:TRAIN_CLIPS], held_idx, images, targets


def _write_held_out(cache_dir: Path, images, targets, held_idx, frames: int) -> Path:
    def write(data_dir: Path) -> None:
        with files.atomic_path(data_dir) as staging:
            for i in held_idx:
                clip = staging / str(int(targets[i])) / f"{i:04d}"
                clip.mkdir(parents=True)
                for t, frame in enumerate(clip_frames(images[i], frames)):
                    frame.save(clip / f"{t:02d}.png")

    return write_once(cache_dir / "digit_clips_val", write)


def prepare(cache_dir: Path, log=print) -> DigitClipsModel:
    """Train once and cache; later calls return the cached model."""
    cache_dir = Path(cache_dir).resolve()
    info_file = cache_dir / "digit_clips.json"
    with one_at_a_time(info_file):
        return _prepare(cache_dir, info_file, log)


def _prepare(cache_dir: Path, info_file: Path, log) -> DigitClipsModel:
    from torchvision.models import get_model, get_weight

    from .. import weights
    from ..tasks import video

    if info_file.exists():
        info = json.loads(info_file.read_text())
        if (
            info.get("recipe") == RECIPE_VERSION
            and Path(info["checkpoint"]).exists()
            and Path(info["data_dir"]).exists()
        ):
            return DigitClipsModel(
                WEIGHT, Path(info["checkpoint"]), Path(info["data_dir"]), Path(info["labels_file"]), info["accuracy"]
            )
    cache_dir.mkdir(parents=True, exist_ok=True)
    w = get_weight(WEIGHT)
    task = weights.bind_task(w, num_classes=10, input_size=FRAME_SIZE)
    x, y, train_idx, held_idx, images, targets = _dataset(task.transform(w), video.FRAMES)
    torch.manual_seed(digits.SEED)
    model = get_model(weights.model_name_of(w), weights=None, num_classes=10, **weights.builder_kwargs(w))
    digits._fit(model, x, y, train_idx, EPOCHS, 2e-3, log)
    accuracy = digits._accuracy(model, x, y, held_idx)
    log(f"digit clips held-out accuracy: {accuracy:.3%}")
    checkpoint = save_checkpoint(model.state_dict(), cache_dir, weight_stem(WEIGHT))
    data_dir = _write_held_out(cache_dir, images, targets, held_idx, video.FRAMES)
    labels_file = cache_dir / "labels.txt"
    files.write_text(labels_file, "".join(f"digit {d}\n" for d in range(10)))
    info = {
        "recipe": RECIPE_VERSION,
        "checkpoint": str(checkpoint),
        "data_dir": str(data_dir),
        "labels_file": str(labels_file),
        "accuracy": accuracy,
    }
    files.write_text(info_file, json.dumps(info, indent=2))
    return DigitClipsModel(WEIGHT, checkpoint, data_dir, labels_file, accuracy)


__all__ = ["DigitClipsModel", "prepare", "clip_frames"]
