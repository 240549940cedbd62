"""Offline, really trained torchvision detection models for demos and tests.

The detection counterpart of `standins.digits` and `standins.segmentation`: the segmentation canvases (scikit-learn
digits pasted onto textured backgrounds) are upsampled to SSDlite's fixed 320x320 input, each digit boxed
by the pixels it really covers. SSDlite320 MobileNetV3-Large is trained from scratch on canvases of
training digits only, with torchvision's own training loss, and scored with COCO mAP on canvases built
only from held-out digits. Faster R-CNN MobileNetV3-Large-320-FPN (the two-stage route) is trained on the same
canvases, its MobileNetV3 body starting from the SSDlite stand-in's: from scratch it learned too slowly for a test
suite (below, FASTER_RCNN).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from .. import files
from . import one_at_a_time, save_checkpoint, write_once
from .segmentation import make_canvases, split

WEIGHT = "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"
MODEL_NAME = "ssdlite320_mobilenet_v3_large"
NUM_CLASSES = 11  # background, digits 0..9 (digit d is class d + 1)
SIZE = 320
CANVAS = 128  # make_canvases' own size: its 16-40 px digits become 40-100 px, what SSDlite's anchors suit
LABELS = ["background"] + [str(d) for d in range(10)]

SEED = 0
HELD_OUT_CANVASES = 64
STEPS = 700
BATCH = 4  # at a fixed budget more, smaller steps win (measured: 600 x 4 beats 300 x 8)
LR = 3e-3
# One thread: on a shared CPU, two OpenMP threads spend most of their time waiting for each other
# (measured 5x slower per step than one thread under load).
THREADS = 1
RECIPE_VERSION = 1  # bump to invalidate caches when the recipe (data, training) changes


@dataclass(frozen=True)
class Recipe:
    """How one detection stand-in is trained (on the same canvases, upsampled to `size`)."""

    weight: str
    model_name: str
    size: int  # its input: the canvases' side, and --input-size of its builds
    steps: int
    lr: float
    version: int  # bump to invalidate its caches when the recipe changes
    start_from_ssdlite: bool = False  # the MobileNetV3 body starts from the SSDlite stand-in's, where shapes agree
    sampled_rois: int | None = None  # R-CNN: RoIs sampled per image to train the box head (torchvision's 512)
    positive_fraction: float | None = None  # R-CNN: of those, at most this share on digits (torchvision's 0.25)
    max_grad_norm: float | None = None  # gradients clipped to this norm


SSDLITE = Recipe(WEIGHT, MODEL_NAME, SIZE, STEPS, LR, RECIPE_VERSION)
# Measured 2026-11-27 (one thread, batch 4, held-out mAP; docs/tasks.md has every run): from scratch the box head's
# class scores stayed near uniform (400 steps at 224 px: mAP 0.017); from the SSDlite body, AdamW 3e-4 with half of
# the sampled RoIs on digits reached 0.231 (mAP@.5 0.457) in 400 steps, 0.306 in 600; higher rates did worse.
FASTER_RCNN = Recipe(
    "FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1",
    "fasterrcnn_mobilenet_v3_large_320_fpn",
    224,
    400,
    3e-4,
    1,
    start_from_ssdlite=True,
    sampled_rois=64,
    positive_fraction=0.5,
    max_grad_norm=10.0,
)


@dataclass(frozen=True)
class DetectionDigitsModel:
    weight: str
    checkpoint: Path  # file name carries the sha256 prefix, as torchvision's do
    data_dir: Path  # COCO-format held-out canvases, never trained on
    labels_file: Path
    held_out_map: float  # COCO mAP@[.5:.95]
    held_out_map50: float
    size: int = SIZE  # the side of its canvases: build it with --input-size size size


def _canvases(digit_indices, count: int, seed: int, size: int = SIZE):
    """Canvases at `size` and per image the placed digits as (digit index, class, x0, y0, x1, y1)."""
    images, masks, placed = make_canvases(digit_indices, count, CANVAS, seed, with_boxes=True)
    # nearest upsampling: every output pixel is exactly one canvas pixel, so the mask stays exact
    src = np.arange(size) * CANVAS // size
    images, masks = images[:, src][:, :, src], masks[:, src][:, :, src]
    all_boxes = []
    for mask, digits in zip(masks, placed):
        boxes = []
        for index, label, x0, y0, x1, y1 in digits:
            rows, cols = (src >= y0) & (src < y1), (src >= x0) & (src < x1)
            # the pixels the digit covers (alpha >= 0.5), inside its own square: digits may share a class
            ys, xs = np.nonzero((mask == label) & rows[:, None] & cols[None, :])
            if len(xs):
                boxes.append((index, label, int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1))
        all_boxes.append(boxes)
    return images, all_boxes


def make_detection_set(digit_indices, count: int, seed: int, size: int = SIZE):
    """`count` RGB images (uint8 [N,size,size,3]) of digits drawn from `digit_indices`, and per image a list
    of (class, x0, y0, x1, y1): tight pixel boxes, x1 and y1 exclusive."""
    images, boxes = _canvases(digit_indices, count, seed, size)
    return images, [[b[1:] for b in per_image] for per_image in boxes]


def held_out_set(size: int = SIZE):
    return make_detection_set(split()[1], HELD_OUT_CANVASES, seed=SEED + 1, size=size)


def coco_dict(images, boxes) -> dict:
    """The COCO ground truth of a detection set; images are named by their position."""
    annotations = []
    for i, per_image in enumerate(boxes):
        for label, x0, y0, x1, y1 in per_image:
            w, h = x1 - x0, y1 - y0
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i + 1,
                    "category_id": int(label),
                    "bbox": [x0, y0, w, h],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
    return {
        "info": {"description": "scikit-learn digits on textured canvases (exporter.standins.detection)"},
        "images": [
            {"id": i + 1, "file_name": f"{i:04d}.png", "width": int(im.shape[1]), "height": int(im.shape[0])}
            for i, im in enumerate(images)
        ],
        "annotations": annotations,
        "categories": [{"id": c, "name": LABELS[c]} for c in range(1, NUM_CLASSES)],
    }


def write_coco(root: Path, images, boxes) -> None:
    """root/annotations.json and root/images/<file_name>.png, written in a staging directory and renamed into place."""
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_path(root) as staging:
        staging.mkdir()
        coco = coco_dict(images, boxes)
        (staging / "images").mkdir()
        for image, entry in zip(images, coco["images"]):
            Image.fromarray(image, mode="RGB").save(staging / "images" / entry["file_name"])
        (staging / "annotations.json").write_text(json.dumps(coco))


def build_model(recipe: Recipe = SSDLITE) -> nn.Module:
    """The exact constructor a saved checkpoint loads into (strict)."""
    from torchvision.models import get_model

    # R-CNN resizes every image to its min_size (320 for this weight): here the canvases are taken as they are
    sizes = {"min_size": recipe.size, "max_size": recipe.size} if recipe.sampled_rois else {}
    return get_model(recipe.model_name, weights=None, weights_backbone=None, num_classes=NUM_CLASSES, **sizes)


def _start_from_ssdlite(model: nn.Module, ssdlite_state: dict) -> int:
    """Copy the SSDlite stand-in's MobileNetV3 body into an R-CNN's: SSDlite splits the same feature layers in two
    at C4 but keeps their order, so the tensors pair up in order; its reduced tail (C5 at half width) does not fit
    and stays as initialised. Returns how many tensors were copied."""
    source = [v for k, v in ssdlite_state.items() if k.startswith("backbone.features.")]
    own = model.state_dict()
    target = [k for k in own if k.startswith("backbone.body.")]
    assert len(source) == len(target), (len(source), len(target))
    copied = {k: v for k, v in zip(target, source) if own[k].shape == v.shape}
    model.load_state_dict(copied, strict=False)
    return len(copied)


def to_tensors(images: np.ndarray) -> list[torch.Tensor]:
    """uint8 [N,H,W,3] -> float [3,H,W] in [0, 1]; the model's own transform resizes and normalizes."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    return list(x)


def _targets(boxes) -> list[dict]:
    return [
        {
            "boxes": torch.tensor([b[1:] for b in per_image], dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor([b[0] for b in per_image], dtype=torch.int64),
        }
        for per_image in boxes
    ]


def detect(model: nn.Module, images: np.ndarray, batch: int = 16) -> list[dict]:
    model.eval()
    with torch.no_grad():
        return [d for i in range(0, len(images), batch) for d in model(to_tensors(images[i : i + batch]))]


def coco_map(detections: list[dict], images, boxes) -> tuple[float, float]:
    """COCO mAP@[.5:.95] and mAP@.5 in [0, 1] of `detections` (model outputs, one per image), by the detection
    task's pycocotools evaluation."""
    from ..tasks.detection import PAD, coco_map as evaluate

    labels = torch.full((len(boxes), max(1, max(map(len, boxes), default=0)), 5), PAD)
    for i, per_image in enumerate(boxes):
        if per_image:
            labels[i, : len(per_image)] = torch.tensor(per_image, dtype=torch.float32)
    result = evaluate(detections, labels, images.shape[1:3], NUM_CLASSES)
    return result["map"] / 100.0, result["map50"] / 100.0


def train(
    steps: int = STEPS, log=print, recipe: Recipe = SSDLITE, start: dict | None = None
) -> tuple[dict, float, float, dict]:
    """Train on canvases of training digits (from scratch, or the body from `start`, the SSDlite stand-in's state);
    returns (state dict, held-out mAP, mAP@.5, timing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _train(steps, log, recipe, start)
    finally:
        torch.set_num_threads(threads)


def _train(steps: int, log, recipe: Recipe, start: dict | None) -> tuple[dict, float, float, dict]:
    torch.manual_seed(SEED)
    train_idx, _ = split()
    model = build_model(recipe)
    if start is not None:
        log(f"{recipe.model_name}: {_start_from_ssdlite(model, start)} body tensors from the SSDlite stand-in")
    if recipe.sampled_rois:  # training settings only: not in the state dict
        model.roi_heads.fg_bg_sampler.batch_size_per_image = recipe.sampled_rois
        model.roi_heads.fg_bg_sampler.positive_fraction = recipe.positive_fraction
    model = model.to(memory_format=torch.channels_last)  # measured 1.25x faster on CPU
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=steps, pct_start=0.15)
    start = last_log = time.perf_counter()
    cpu_start = time.process_time()
    model.train()
    for step in range(steps):
        # fresh canvases every step: the network never sees the same picture twice
        images, boxes = make_detection_set(train_idx, BATCH, seed=1_000_000 + step, size=recipe.size)
        losses = model(to_tensors(images), _targets(boxes))  # torchvision's own training loss
        loss = sum(losses.values())
        opt.zero_grad()
        loss.backward()
        if recipe.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        opt.step()
        sched.step()
        if time.perf_counter() - last_log >= 20 or step == steps - 1:
            last_log = time.perf_counter()
            parts = ", ".join(f"{k} {v.item():.3f}" for k, v in losses.items())
            log(f"digits detection step {step + 1}/{steps}: {parts} ({last_log - start:.0f} s)")
    timing = {
        "train_seconds": round(time.perf_counter() - start, 1),
        "train_cpu_seconds": round(time.process_time() - cpu_start, 1),
    }
    # BN running statistics need no recomputing here (unlike digits): the one-cycle schedule ends with
    # many small steps, over which momentum 0.03 settles (measured: recomputing moved mAP by ~0.001)
    model.to(memory_format=torch.contiguous_format)
    images, boxes = held_out_set(recipe.size)
    score, score50 = coco_map(detect(model, images), images, boxes)
    log(
        f"digits detection held-out mAP {score:.3f}, mAP@.5 {score50:.3f} "
        f"({timing['train_seconds']:.0f} s training, {timing['train_cpu_seconds']:.0f} s CPU)"
    )
    return model.state_dict(), score, score50, timing


def _cached_info(info_file: Path, steps: int, recipe: Recipe) -> dict | None:
    if not info_file.exists():
        return None
    info = json.loads(info_file.read_text())
    same_recipe = info.get("recipe") == recipe.version and info.get("steps") == steps
    if not same_recipe or not all(Path(info[p]).exists() for p in ("checkpoint", "data_dir", "labels_file")):
        return None
    return info


def _model(info: dict) -> DetectionDigitsModel:
    return DetectionDigitsModel(
        info["weight"],
        Path(info["checkpoint"]),
        Path(info["data_dir"]),
        Path(info["labels_file"]),
        info["map"],
        info["map50"],
        info.get("size", SIZE),
    )


def prepare(cache_dir: Path, log=print, steps: int | None = None, recipe: Recipe = SSDLITE) -> DetectionDigitsModel:
    """Train once and cache; later calls return the cached model."""
    cache_dir = Path(cache_dir).resolve()  # the record holds absolute paths, valid from any working directory
    start = None
    if recipe.start_from_ssdlite:
        start = torch.load(prepare(cache_dir, log).checkpoint, map_location="cpu", weights_only=True)
    info_file = cache_dir / f"digits_detection_{recipe.model_name}.json"
    with one_at_a_time(info_file):
        return _prepare(cache_dir, info_file, log, steps or recipe.steps, recipe, start)


def _prepare(
    cache_dir: Path, info_file: Path, log, steps: int, recipe: Recipe, start: dict | None
) -> DetectionDigitsModel:
    info = _cached_info(info_file, steps, recipe)
    if info is not None:
        return _model(info)
    cache_dir.mkdir(parents=True, exist_ok=True)
    state, score, score50, timing = train(steps, log=log, recipe=recipe, start=start)
    # the held-out canvases depend on the data recipe and the size only: stand-ins of one size share them
    suffix = f"v{RECIPE_VERSION}" if recipe.size == SIZE else f"{recipe.size}_v{RECIPE_VERSION}"
    data_dir = write_once(
        cache_dir / f"digits_detection_val_{suffix}", lambda root: write_coco(root, *held_out_set(recipe.size))
    )
    labels_file = cache_dir / "digits_detection_labels.txt"
    files.write_text(labels_file, "".join(f"{label}\n" for label in LABELS))
    info = {
        "recipe": recipe.version,
        "steps": steps,
        "weight": recipe.weight,
        "checkpoint": str(save_checkpoint(state, cache_dir, recipe.model_name)),
        "data_dir": str(data_dir),
        "labels_file": str(labels_file),
        "map": score,
        "map50": score50,
        "size": recipe.size,
        **timing,
    }
    files.write_text(info_file, json.dumps(info, indent=2))
    return _model(info)
