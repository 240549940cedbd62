"""An offline, really trained torchvision model for demos and tests.

No weights can be downloaded on our build machines, and a randomly initialised
network has near-constant logits that make agreement checks meaningless. So we
train a small torchvision architecture on scikit-learn's digits (real labeled
images that ship inside the scikit-learn wheel) and save it under the file name
torchvision expects for the named weight, with a genuine sha256 prefix.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

WEIGHT = "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
HELD_OUT = 300
SEED = 0
EPOCHS = 4
RECIPE_VERSION = 1  # bump to invalidate caches when the recipe changes


@dataclass(frozen=True)
class DigitsModel:
    weight: str
    checkpoint: Path  # file name carries the sha256 prefix, as torchvision's do
    data_dir: Path  # ImageFolder of the held-out images (never trained on)
    labels_file: Path
    held_out_accuracy: float


def _digit_images():
    from sklearn.datasets import load_digits

    digits = load_digits()
    # 0..16 grey levels; white digit on black like the original scans
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    return [Image.fromarray(p, mode="L") for p in pixels], digits.target.astype(int)


def _split(n: int):
    order = np.random.default_rng(SEED).permutation(n)
    return order[HELD_OUT:], order[:HELD_OUT]


def write_imagefolder(root: Path, images, targets, indices) -> None:
    for i in indices:
        folder = root / str(int(targets[i]))
        folder.mkdir(parents=True, exist_ok=True)
        images[i].save(folder / f"{i:04d}.png")


def _recompute_batchnorm_stats(model: nn.Module, batches) -> None:
    # torchvision's MobileNetV3 uses BN momentum 0.01: after a short training run the
    # running statistics lag far behind and eval mode collapses to one class. An exact
    # average over the training set fixes it.
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x)
    model.eval()


def train(epochs: int = EPOCHS, log=print) -> tuple[dict, float, list]:
    from torchvision.models import get_model, get_weight

    from .weights import model_name_of

    torch.manual_seed(SEED)
    weights = get_weight(WEIGHT)
    preprocess = weights.transforms()
    images, targets = _digit_images()
    x = torch.stack([preprocess(im.convert("RGB")) for im in images])
    y = torch.as_tensor(targets)
    train_idx, held_idx = _split(len(images))

    model = get_model(model_name_of(weights), weights=None, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    steps = epochs * ((len(train_idx) + 31) // 32)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)
    gen = torch.Generator().manual_seed(SEED)
    for epoch in range(epochs):
        model.train()
        start = time.perf_counter()
        perm = torch.as_tensor(train_idx)[torch.randperm(len(train_idx), generator=gen)]
        for b in perm.split(32):
            loss = nn.functional.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        log(f"digits epoch {epoch + 1}/{epochs}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")

    train_batches = torch.as_tensor(train_idx).split(64)
    _recompute_batchnorm_stats(model, (x[b] for b in train_batches))
    with torch.no_grad():
        pred = torch.cat([model(x[b]).argmax(1) for b in torch.as_tensor(held_idx).split(64)])
    accuracy = (pred == y[held_idx]).float().mean().item()
    log(f"digits held-out accuracy: {accuracy:.3%}")
    return model.state_dict(), accuracy, (images, targets, held_idx)


def prepare(cache_dir: Path, log=print) -> DigitsModel:
    """Train once and cache; later calls return the cached model."""
    from torchvision.models import get_weight

    cache_dir = Path(cache_dir).resolve()  # the record holds absolute paths, valid from any working directory
    info_file = cache_dir / "digits.json"
    if info_file.exists():
        info = json.loads(info_file.read_text())
        if info.get("recipe") == RECIPE_VERSION and Path(info["checkpoint"]).exists():
            return DigitsModel(
                WEIGHT, Path(info["checkpoint"]), Path(info["data_dir"]), Path(info["labels_file"]), info["accuracy"]
            )
    cache_dir.mkdir(parents=True, exist_ok=True)
    state, accuracy, (images, targets, held_idx) = train(log=log)
    tmp = cache_dir / "digits.pth.tmp"
    torch.save(state, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    stem = Path(get_weight(WEIGHT).url).name.split("-")[0]
    checkpoint = cache_dir / f"{stem}_digits-{digest[:8]}.pth"
    tmp.replace(checkpoint)
    data_dir = cache_dir / "digits_val"
    if not data_dir.exists():
        staging = cache_dir / "digits_val.tmp"
        write_imagefolder(staging, images, targets, held_idx)
        staging.replace(data_dir)
    labels_file = cache_dir / "labels.txt"
    labels_file.write_text("".join(f"digit {d}\n" for d in range(10)))
    info = {
        "recipe": RECIPE_VERSION,
        "checkpoint": str(checkpoint),
        "data_dir": str(data_dir),
        "labels_file": str(labels_file),
        "accuracy": accuracy,
    }
    info_file.write_text(json.dumps(info, indent=2))
    return DigitsModel(WEIGHT, checkpoint, data_dir, labels_file, accuracy)


FRAGILE_LAYER = "features.2.block.1.0"  # the depthwise conv whose input carries the inflated channel


def fragile_checkpoint(model: DigitsModel, out_dir: Path, factor: float = 1000.0, channel: int = 0) -> Path:
    """The digits model with one channel of the tensor entering FRAGILE_LAYER scaled up `factor`-fold
    (BatchNorm before a ReLU) and that layer's filter for it scaled down to compensate: eager computes
    the same function, but a per-tensor int8 range for that input now crushes every other channel.
    A stand-in for the outlier channels real networks have, built to break plain PTQ."""
    state = torch.load(model.checkpoint, map_location="cpu", weights_only=True)
    bn = "features.2.block.0.1"
    state[f"{bn}.weight"][channel] *= factor
    state[f"{bn}.bias"][channel] *= factor
    state[f"{FRAGILE_LAYER}.weight"][channel] /= factor
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"mobilenet_v3_small_digits_fragile{int(factor)}.pth"  # no hash prefix: nothing to verify
    torch.save(state, path)
    return path
