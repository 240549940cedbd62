"""An offline, really trained torchvision model for demos and tests.

No weights can be downloaded on our build machines, and a randomly initialised
network has near-constant logits that make agreement checks meaningless. So we
train a small torchvision architecture on scikit-learn's digits (real labeled
images that ship inside the scikit-learn wheel) and save it under the file name
torchvision expects for the named weight, with a genuine sha256 prefix.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from .. import files
from . import one_at_a_time, save_checkpoint, weight_stem, write_once

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
    epochs: int = EPOCHS  # trained in all (more than asked when trained until an accuracy)


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
    with torch.no_grad(), _auxiliary_heads_off(model):
        for x in batches:
            model(x)
    model.eval()


def _dataset(weight: str, size: int | None = None):
    """Every digit preprocessed with the weight's own transforms (at size x size, scaled as a build at that
    --input-size scales them), and the fixed train/held-out split."""
    from torchvision.models import get_weight

    from ..weights import bind_task

    w = get_weight(weight)
    preprocess = bind_task(w, 10, (size, size) if size else None).transform(w)
    images, targets = _digit_images()
    x = torch.stack([preprocess(im.convert("RGB")) for im in images])
    train_idx, held_idx = _split(len(images))
    return x, torch.as_tensor(targets), train_idx, held_idx, (images, targets)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, indices) -> float:
    with torch.no_grad():
        pred = torch.cat([model(x[b]).argmax(1) for b in torch.as_tensor(indices).split(64)])
    return (pred == y[indices]).float().mean().item()


DID_NOT_LEARN = 0.3  # held-out acc@1 below 3x chance: the run collapsed (SqueezeNet 1.1: its logits' ReLU died)
RETRY_LR_FACTOR = 0.1


class Attempt(NamedTuple):
    lr: float  # peak learning rate
    shrunk: bool = False  # shrink_classifier
    residuals_zeroed: bool = False  # zero_residual_branches


# The tries, each from the same seed, until one learns. A new try goes last, so that every model an earlier one
# trained keeps its start and its cached checkpoint (a cached model that learned under none goes on with the new).
ATTEMPTS = (
    Attempt(2e-3),
    Attempt(2e-3 * RETRY_LR_FACTOR),
    Attempt(2e-3, shrunk=True),
    Attempt(2e-3, shrunk=True, residuals_zeroed=True),
)


def train(
    weight: str = WEIGHT,
    epochs: int = EPOCHS,
    log=print,
    size: int | None = None,
    earlier: tuple[int, dict, float] | None = None,
) -> tuple[dict, float, list]:
    """Train `weight`'s architecture from scratch on the digits; returns (state dict, held-out accuracy, data).
    A run that did not learn is run again from the same start: at a tenth of the learning rate, then with its
    classifier shrunk, then with its residual branches started at zero too. If none learns, the best of them is
    returned. `earlier`: (tries made, the best one's state, its accuracy), none of which learned: the next tries."""
    x, y, train_idx, held_idx, (images, targets) = _dataset(weight, size)
    tried, best = (0, None) if earlier is None else (earlier[0], earlier[1:])
    for attempt in ATTEMPTS[tried:]:
        torch.manual_seed(SEED)
        model = _model(weight)
        if attempt.shrunk:
            shrink_classifier(model)
        if attempt.residuals_zeroed and not zero_residual_branches(model):
            log("digits: no residual block whose branch can start at zero: that try is not made")
            continue
        _fit(model, x, y, train_idx, epochs, attempt.lr, log)
        accuracy = _accuracy(model, x, y, held_idx)
        how = "".join(
            (
                ", classifier shrunk" if attempt.shrunk else "",
                ", residual branches zeroed" if attempt.residuals_zeroed else "",
            )
        )
        log(f"digits held-out accuracy: {accuracy:.3%} (learning rate {attempt.lr:g}{how})")
        if best is None or accuracy > best[1]:
            best = (model.state_dict(), accuracy)
        if accuracy >= DID_NOT_LEARN:
            break
        log(f"digits: the run did not learn (held-out acc@1 under {DID_NOT_LEARN:.0%})")
    return best[0], best[1], (images, targets, held_idx)


def shrink_classifier(model: nn.Module, num_classes: int = 10) -> None:
    """Scale the last layer that makes the class scores by sqrt(num_classes / 1000). torchvision initialises
    EfficientNet's and MNASNet's heads with a range of 1/sqrt(out_features): at 10 classes that is 10x ImageNet's,
    and EfficientNet-B4..B7 start with a loss of 6-9 (chance is ln 10 = 2.3). AdamW moves a weight by about its
    learning rate a step at most, so in the recipe's 188 steps such a head stays too large: B6 ended at 27 % held
    out, V2-M at 13 and 11 %. Scaled, this head starts at its ImageNet scale; other heads, whose initial range does
    not depend on the classes, start 10x under it. Scaled, not zeroed: SqueezeNet's head is a convolution under a
    ReLU, which a zero start would never let learn."""
    heads = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear)
        and m.out_features == num_classes
        or isinstance(m, nn.Conv2d)
        and m.out_channels == num_classes
    ]
    with torch.no_grad():
        for p in (heads[-1].weight, heads[-1].bias):
            if p is not None:
                p.mul_((num_classes / 1000) ** 0.5)


def zero_residual_branches(model: nn.Module) -> int:
    """Start every residual block as the identity: the last batch norm of the branch it adds to its input scaled
    to 0 (as torchvision's zero_init_residual does for ResNets), so that a deep stack starts shallow. EfficientNet-V2-L
    (79 blocks) at 48 px learned under none of the other tries (7-10 % held out after 4 epochs, the training loss
    near or over chance's); with this its first epoch ended at a loss of 0.63. Blocks: ResNet's, and those that say
    they add their input (use_res_connect or apply_residual: MobileNetV2/V3, MNASNet, EfficientNet and V2), whose
    only batch norms are their branch's. Returns how many were zeroed."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    zeroed = 0
    for module in model.modules():
        if isinstance(module, (BasicBlock, Bottleneck)):
            last = module.bn3 if isinstance(module, Bottleneck) else module.bn2  # not the shortcut's (downsample)
        elif getattr(module, "use_res_connect", False) or getattr(module, "apply_residual", False):
            last = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)][-1]
        else:
            continue
        nn.init.zeros_(last.weight)
        zeroed += 1
    return zeroed


def _arch(weight: str) -> dict:
    """The weight's builder arguments (exporter.weights.builder_kwargs) as its record stores them (JSON)."""
    from torchvision.models import get_weight

    from ..weights import builder_kwargs

    return json.loads(json.dumps(builder_kwargs(get_weight(weight))))


def _model(weight: str) -> nn.Module:
    from torchvision.models import get_model, get_weight

    from ..weights import builder_kwargs, model_name_of

    w = get_weight(weight)
    return get_model(model_name_of(w), weights=None, num_classes=10, **builder_kwargs(w))


def train_further(
    weight: str, checkpoint: Path, epochs: int, until: float, max_epochs: int, log=print, size: int | None = None
) -> tuple[dict | None, dict]:
    """Go on training a digits model that has had `epochs` while its acc@1 on its own training images is under
    `until`: warm restarts at the retry learning rate, each as long as all training so far, up to `max_epochs` in
    all. Only the training images decide, never the held-out ones. Returns the new state (None: it already
    reached `until`) and {"epochs", "train_accuracy", "accuracy"} (the last on the held-out digits)."""
    x, y, train_idx, held_idx, _data = _dataset(weight, size)
    model = _model(weight)
    model.load_state_dict(torch.load(checkpoint, weights_only=True))
    model.eval()
    fitted, changed = _accuracy(model, x, y, train_idx), False
    while fitted < until and 2 * epochs <= max_epochs:
        log(
            f"digits: acc@1 {fitted:.1%} on the training images after {epochs} epochs (under {until:.0%}): "
            f"{epochs} more at learning rate {2e-3 * RETRY_LR_FACTOR:g}"
        )
        _fit(model, x, y, train_idx, epochs, 2e-3 * RETRY_LR_FACTOR, log)
        epochs, changed = 2 * epochs, True
        fitted = _accuracy(model, x, y, train_idx)
    held_out = _accuracy(model, x, y, held_idx)
    log(f"digits: {epochs} epochs, acc@1 {fitted:.1%} on the training images, {held_out:.1%} held out")
    return (model.state_dict() if changed else None), {"epochs": epochs, "train_accuracy": fitted, "accuracy": held_out}


def _fit(model: nn.Module, x, y, train_idx, epochs: int, lr: float, log) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ((len(train_idx) + 31) // 32)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    gen = torch.Generator().manual_seed(SEED)
    for epoch in range(epochs):
        model.train()
        start = time.perf_counter()
        perm = torch.as_tensor(train_idx)[torch.randperm(len(train_idx), generator=gen)]
        for b in perm.split(32):
            with _auxiliary_heads_off(model):
                loss = nn.functional.cross_entropy(_logits(model(x[b])), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        log(f"digits epoch {epoch + 1}/{epochs}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    train_batches = torch.as_tensor(train_idx).split(64)
    _recompute_batchnorm_stats(model, (x[b] for b in train_batches))


AUXILIARY_HEADS = ("AuxLogits", "aux1", "aux2")  # Inception v3's, GoogLeNet's


@contextlib.contextmanager
def _auxiliary_heads_off(model: nn.Module):
    """Training-mode forwards without GoogLeNet's and Inception v3's auxiliary heads (their forward skips a head
    that is None). The loss leaves them out and eval mode never runs them, but they would still run, and Inception
    v3's is made for 299 px: at 96 px its 5x5 pooling gets a 4x4 map, at 200 px its 5x5 convolution a 2x2 one.
    They stay in the model (its state dict, what a build loads), as initialised."""
    heads = {
        name: getattr(model, name) for name in AUXILIARY_HEADS if isinstance(getattr(model, name, None), nn.Module)
    }
    for name in heads:
        setattr(model, name, None)
    try:
        yield
    finally:
        for name, head in heads.items():
            setattr(model, name, head)


def _logits(output):
    """The class scores of a training-mode forward: GoogLeNet and Inception v3 return them with their auxiliary
    heads' (a named tuple); the auxiliary heads are left out of the loss, and eval mode never runs them."""
    return output.logits if hasattr(output, "logits") else output


def _write_held_out(cache_dir: Path, images, targets, held_idx) -> tuple[Path, Path]:
    def write(data_dir: Path) -> None:
        with files.atomic_path(data_dir) as staging:
            write_imagefolder(staging, images, targets, held_idx)

    data_dir = write_once(cache_dir / "digits_val", write)
    labels_file = cache_dir / "labels.txt"
    files.write_text(labels_file, "".join(f"digit {d}\n" for d in range(10)))
    return data_dir, labels_file


def _cached_info(
    info_file: Path, epochs: int, *paths: str, until: float | None = None, arch: dict | None = None
) -> dict | None:
    """The cached record, if it was made by the same recipe (and, given `arch`, the same builder arguments). A model
    trained on past `epochs` serves only a caller that trains until the same accuracy (one that has not yet been
    checked against it is, by prepare)."""
    if not info_file.exists():
        return None
    info = json.loads(info_file.read_text())
    if info.get("epochs_trained", epochs) != epochs and info.get("until") != until:
        return None
    if not _same_recipe(info, epochs, arch) or not all(Path(info[p]).exists() for p in paths):
        return None
    if _tries_left(info):
        return None  # did not learn when the recipe had fewer tries
    return info


def _same_recipe(info: dict, epochs: int, arch: dict | None) -> bool:
    return (
        info.get("recipe") == RECIPE_VERSION
        and info.get("epochs", EPOCHS) == epochs
        and (arch is None or info.get("builder_kwargs", {}) == arch)
    )


def _tries_left(info: dict) -> bool:
    return info.get("accuracy", 1.0) < DID_NOT_LEARN and info.get("recipe_tries", 2) < len(ATTEMPTS)


def _earlier_tries(info_file: Path, epochs: int, arch: dict) -> tuple[int, dict, float] | None:
    """A cached model of this recipe that learned under none of the tries the recipe had then: (their number, its
    state, its held-out accuracy), for train to go on with the tries added since. Not one trained further
    (train_further): its state and accuracy are not those of a try, so the tries are all made again."""
    if not info_file.exists():
        return None
    info = json.loads(info_file.read_text())
    if not _same_recipe(info, epochs, arch) or not _tries_left(info) or not Path(info["checkpoint"]).exists():
        return None
    if info.get("epochs_trained", epochs) != epochs:
        return None
    return info.get("recipe_tries", 2), torch.load(info["checkpoint"], weights_only=True), info["accuracy"]


def prepare(
    cache_dir: Path,
    log=print,
    weight: str = WEIGHT,
    epochs: int = EPOCHS,
    until: float | None = None,
    max_epochs: int | None = None,
    size: int | None = None,
) -> DigitsModel:
    """Train once and cache; later calls return the cached model. With `until`, the model is trained further
    (train_further) until that acc@1 on its training images or `max_epochs`; a cached model is checked once.
    `size`: trained on size x size inputs instead of the weight's crop (a model of its own, cached apart)."""
    from torchvision.models import get_weight

    from ..weights import model_name_of

    cache_dir = Path(cache_dir).resolve()  # the record holds absolute paths, valid from any working directory
    model_name = model_name_of(get_weight(weight))
    info_file = cache_dir / (
        ("digits" if weight == WEIGHT and not size else f"digits_{model_name}") + _at(size) + ".json"
    )
    with one_at_a_time(info_file):
        return _prepare(cache_dir, info_file, log, weight, epochs, until, max_epochs, size)


def _at(size: int | None) -> str:
    """The suffix of the files of a model trained at size x size (none at the weight's own crop)."""
    return f"_{size}px" if size else ""


def _prepare(
    cache_dir: Path,
    info_file: Path,
    log,
    weight: str,
    epochs: int,
    until: float | None,
    max_epochs: int | None,
    size: int | None,
) -> DigitsModel:
    arch = _arch(weight)
    info = _cached_info(info_file, epochs, "checkpoint", "data_dir", until=until, arch=arch)
    if info is None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        earlier = _earlier_tries(info_file, epochs, arch)
        state, accuracy, (images, targets, held_idx) = train(weight, epochs, log=log, size=size, earlier=earlier)
        checkpoint = save_checkpoint(state, cache_dir, weight_stem(weight) + _at(size))
        data_dir, labels_file = _write_held_out(cache_dir, images, targets, held_idx)
        info = {
            "recipe": RECIPE_VERSION,
            "epochs": epochs,
            "builder_kwargs": arch,
            "checkpoint": str(checkpoint),
            "data_dir": str(data_dir),
            "labels_file": str(labels_file),
            "accuracy": accuracy,
            "recipe_tries": len(ATTEMPTS),
        }
        files.write_text(info_file, json.dumps(info, indent=2))
    if until is not None and (info.get("until"), info.get("max_epochs")) != (until, max_epochs or epochs):
        state, reached = train_further(
            weight, Path(info["checkpoint"]), info.get("epochs_trained", epochs), until, max_epochs or epochs, log, size
        )
        if state is not None:
            info["checkpoint"] = str(save_checkpoint(state, cache_dir, weight_stem(weight) + _at(size)))
        info.update(
            until=until,
            max_epochs=max_epochs or epochs,
            epochs_trained=reached["epochs"],
            train_accuracy=reached["train_accuracy"],
            accuracy=reached["accuracy"],
        )
        files.write_text(info_file, json.dumps(info, indent=2))
    return DigitsModel(
        weight,
        Path(info["checkpoint"]),
        Path(info["data_dir"]),
        Path(info["labels_file"]),
        info["accuracy"],
        info.get("epochs_trained", epochs),
    )


@dataclass(frozen=True)
class QuantizedDigitsModel:
    """A digits model quantized the way torchvision's int8 weights were made, standing in for one."""

    weight: str  # the quantized weight, e.g. MobileNet_V3_Large_QuantizedWeights.IMAGENET1K_QNNPACK_V1
    checkpoint: Path  # the converted int8 state dict
    float_checkpoint: Path  # the trained float model it came from (the weight's meta["unquantized"])
    data_dir: Path
    labels_file: Path
    float_accuracy: float
    quantized_accuracy: float
    epochs: int = EPOCHS  # the float model's


def quantize_eager(model: nn.Module, batches, backend: str) -> nn.Module:
    """torchvision's eager-mode post-training quantization: fuse, the backend's qconfig, calibrate, convert."""
    torch.backends.quantized.engine = backend
    model.eval()
    model.fuse_model(is_qat=False)
    model.qconfig = torch.ao.quantization.get_default_qconfig(backend)
    torch.ao.quantization.prepare(model, inplace=True)
    with torch.no_grad():
        for x in batches:
            model(x)
    return torch.ao.quantization.convert(model, inplace=True)


def quantize_digits(
    weight: str, float_checkpoint: Path, calib_images: int = 256, size: int | None = None
) -> tuple[nn.Module, float]:
    """The trained float digits model of a quantized weight's architecture, quantized as torchvision made
    its int8 weights (calibrated on training images); returns it and its held-out accuracy."""
    from torchvision.models import get_weight

    x, y, train_idx, held_idx, _ = _dataset(weight, size)
    model = _model(weight)  # quantizable, float
    model.load_state_dict(torch.load(float_checkpoint, weights_only=True))
    calib = torch.as_tensor(train_idx[:calib_images]).split(32)
    model = quantize_eager(model, (x[b] for b in calib), get_weight(weight).meta["backend"])
    return model, _accuracy(model, x, y, held_idx)


def prepare_quantized(
    cache_dir: Path,
    weight: str,
    epochs: int = EPOCHS,
    log=print,
    until: float | None = None,
    max_epochs: int | None = None,
    size: int | None = None,
) -> QuantizedDigitsModel:
    """Train the float model of a torchvision quantized weight on the digits and quantize it; cached."""
    from torchvision.models import get_weight

    from ..weights import model_name_of

    cache_dir = Path(cache_dir).resolve()
    quantized = get_weight(weight)
    model_name = model_name_of(quantized)
    info_file = cache_dir / f"digits_{model_name}{_at(size)}.json"
    with one_at_a_time(info_file):
        return _prepare_quantized(cache_dir, info_file, quantized, epochs, log, until, max_epochs, size)


def _prepare_quantized(
    cache_dir: Path,
    info_file: Path,
    quantized,
    epochs: int,
    log,
    until: float | None,
    max_epochs: int | None,
    size: int | None,
) -> QuantizedDigitsModel:
    from ..weights import canonical_name, model_name_of

    model_name, weight = model_name_of(quantized), canonical_name(quantized)
    floating = prepare(cache_dir, log, canonical_name(quantized.meta["unquantized"]), epochs, until, max_epochs, size)
    info = _cached_info(info_file, epochs, "checkpoint", "float_checkpoint", "data_dir")
    if info is None or info["float_checkpoint"] != str(floating.checkpoint):
        model, accuracy = quantize_digits(weight, floating.checkpoint, size=size)
        log(f"digits {model_name} ({quantized.meta['backend']}) held-out accuracy: {accuracy:.3%}")
        info = {
            "recipe": RECIPE_VERSION,
            "epochs": epochs,
            "checkpoint": str(save_checkpoint(model.state_dict(), cache_dir, weight_stem(weight) + _at(size))),
            "float_checkpoint": str(floating.checkpoint),
            "data_dir": str(floating.data_dir),
            "labels_file": str(floating.labels_file),
            "float_accuracy": floating.held_out_accuracy,
            "quantized_accuracy": accuracy,
        }
        files.write_text(info_file, json.dumps(info, indent=2))
    return QuantizedDigitsModel(
        weight,
        Path(info["checkpoint"]),
        Path(info["float_checkpoint"]),
        Path(info["data_dir"]),
        Path(info["labels_file"]),
        info["float_accuracy"],
        info["quantized_accuracy"],
        floating.epochs,
    )


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
