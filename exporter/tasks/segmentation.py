"""Semantic segmentation: per-pixel class logits (1, C, H, W) at the input resolution.

Fidelity is judged on the masks (argmax per pixel) and on the logits; labeled metrics are mIoU and
pixel accuracy against VOC-style masks (class index per pixel, 255 = ignore)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import nn

from ..data import IMAGE_SUFFIXES, Inputs, split
from ..errors import UsageError
from .base import Task, logit_fidelity

IGNORE = 255
# VOC's colour map, extended the same way for indices beyond 20
PALETTE = np.array(
    [
        [
            (i >> 0 & 1) << 7 | (i >> 3 & 1) << 6 | (i >> 6 & 1) << 5,
            (i >> 1 & 1) << 7 | (i >> 4 & 1) << 6 | (i >> 7 & 1) << 5,
            (i >> 2 & 1) << 7 | (i >> 5 & 1) << 6,
        ]
        for i in range(256)
    ],
    dtype=np.uint8,
)


class OutHead(nn.Module):
    """torchvision's segmentation models return {"out", "aux"}; a mobile graph returns `out` only."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def confusion(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C, C) counts, rows the target class, columns the predicted one; ignored pixels left out."""
    valid = target != IGNORE
    index = target[valid].long() * num_classes + pred[valid].long()
    return torch.bincount(index, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def miou(conf: torch.Tensor) -> float:
    """Mean IoU over the classes present in the target or the prediction, in [0, 1]."""
    conf = conf.double()
    inter = conf.diag()
    union = conf.sum(0) + conf.sum(1) - inter
    present = union > 0
    return (inter[present] / union[present]).mean().item() if present.any() else 1.0


def colourize(mask: np.ndarray) -> np.ndarray:
    return PALETTE[mask.astype(np.uint8)]


class Segmentation(Task):
    name = "segmentation"
    agreement = "pixel_agreement"
    drop = "miou_drop_points"
    dynamic_size_refusal = None
    # torchvision's segmentation backbones downsample by 8 to 32: below 32 px their deepest feature map is under a pixel
    min_side = 32

    @classmethod
    def input_size_of(cls, weights, model_name, requested):
        if requested is not None:
            return tuple(int(v) for v in requested)
        # the weights resize the short side and do not crop; a mobile graph needs one size
        side = weights.transforms().resize_size[0]
        return side, side

    @classmethod
    def num_classes_in(cls, state, model_name, default):
        heads = [k for k in state if k.startswith("classifier.") and k.endswith("weight")]
        weight = state.get(heads[-1]) if heads else None
        if isinstance(weight, torch.Tensor) and weight.ndim == 4:
            return int(weight.shape[0])
        return default

    @classmethod
    def construct(cls, model_name, num_classes, state, arch=None):
        from torchvision.models import get_model

        aux = any(k.startswith("aux_classifier.") for k in state)
        options = {**(arch or {}), **({"aux_loss": True} if aux else {})}
        return get_model(model_name, weights=None, weights_backbone=None, num_classes=num_classes, **options)

    @classmethod
    def graph(cls, model):
        return OutHead(model).eval()

    def preprocessing(self, weights):
        t = weights.transforms()
        return {
            "task": self.name,
            "input_size": list(self.input_size),
            "resize_size": list(self.input_size),  # exactly, aspect ratio not kept
            "crop_size": None,
            "interpolation": t.interpolation.value,
            "antialias": t.antialias,
            "mean": list(t.mean),
            "std": list(t.std),
            "layout": "NCHW",
            "dtype": "float32",
            "range": "RGB scaled to [0, 1] before normalization",
            "output": self.output(),
        }

    def transform(self, weights):
        from torchvision.transforms import v2

        t = weights.transforms()
        # the image is resized before it becomes a tensor, as an app resizes its bitmap
        return v2.Compose(
            [
                v2.Resize(list(self.input_size), t.interpolation, antialias=t.antialias),
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(t.mean, t.std),
            ]
        )

    def output(self):
        h, w = self.input_size
        return {
            "name": self.output_name,
            "layout": "NCHW",
            "shape": [1, self.num_classes, h, w],
            "meaning": "per-pixel class logits; argmax over C is the mask",
        }

    # --- data: DIR/images/<stem>.(jpg|png), DIR/masks/<stem>.png ---
    def _pairs(self, root: Path) -> list[tuple[Path, Path]]:
        images, masks = root / "images", root / "masks"
        if not root.is_dir():
            raise UsageError(f"--data {root} is not a directory")
        if not images.is_dir() or not masks.is_dir():
            raise UsageError(f"--data {root} is not VOC-style: segmentation expects DIR/images/ and DIR/masks/")
        pairs = []
        for image in sorted(p for p in images.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES):
            mask = masks / f"{image.stem}.png"
            if not mask.is_file():
                raise UsageError(f"--data {root}: image {image.name} has no mask masks/{image.stem}.png")
            pairs.append((image, mask))
        if not pairs:
            raise UsageError(f"--data {root} has no images in {images}")
        return pairs

    def _read_mask(self, path: Path, size: tuple[int, int]) -> torch.Tensor:
        try:
            with Image.open(path) as im:
                if im.mode not in ("P", "L"):
                    raise UsageError(
                        f"mask {path} is {im.mode}; masks hold a class index per pixel (palette or grayscale PNG)"
                    )
                if im.size != size:
                    raise UsageError(f"mask {path} is {im.size[0]}x{im.size[1]} but its image is {size[0]}x{size[1]}")
                h, w = self.input_size
                mask = np.asarray(im.resize((w, h), Image.NEAREST), dtype=np.uint8)
        except (UnidentifiedImageError, OSError) as e:
            raise UsageError(f"cannot read mask {path}: {e}") from None
        bad = np.unique(mask[(mask >= self.num_classes) & (mask != IGNORE)])
        if bad.size:
            raise UsageError(
                f"mask {path} has class index {int(bad[0])}, out of range for {self.num_classes} classes "
                f"(0..{self.num_classes - 1}, {IGNORE} = ignore)"
            )
        return torch.from_numpy(mask.copy()).reshape(-1)

    def _read_pair(self, pair, transform) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = pair
        try:
            with Image.open(image) as im:
                rgb, size = im.convert("RGB"), im.size
        except (UnidentifiedImageError, OSError) as e:
            raise UsageError(f"cannot read image {image}: {e}") from None
        return transform(rgb), self._read_mask(mask, size)

    def load_data(self, root, transform, calib_size, val_size, seed, class_names=None):
        root = Path(root)
        pairs = self._pairs(root)
        calib_idx, val_idx = split(len(pairs), calib_size, val_size, seed)
        calibration = [self._read_pair(pairs[i], transform) for i in calib_idx]
        validation = [self._read_pair(pairs[i], transform) for i in val_idx]
        return Inputs(
            [x[None] for x, _ in calibration],
            torch.stack([x for x, _ in validation]),
            torch.stack([m for _, m in validation]),
            None,
            calibration_labels=torch.stack([m for _, m in calibration]) if calibration else None,
            description={
                "source": str(root.resolve()),
                "labeled": True,
                "format": "VOC-style images/ + masks/",
                "images": len(pairs),
                "calibration": len(calib_idx),
                "validation": len(val_idx),
                "seed": seed,
            },
        )

    # --- metrics ---
    def _masks(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(len(rows), self.num_classes, -1).argmax(1)

    def fidelity(self, reference, outputs):
        eager, artifact = self._masks(reference), self._masks(outputs)
        return {
            **logit_fidelity(reference, outputs),
            "pixels": eager.numel(),
            "pixel_agreement": (eager == artifact).double().mean().item(),
            "miou_vs_eager": miou(confusion(artifact, eager, self.num_classes)),
        }

    def labeled(self, outputs, labels):
        conf = confusion(self._masks(outputs), labels, self.num_classes)
        total = conf.sum().item()
        return {"miou": 100.0 * miou(conf), "pixel_acc": 100.0 * conf.diag().sum().item() / total if total else None}

    def vs_eager(self, eager, artifact):
        return {
            "eager_miou": eager["miou"],
            "eager_pixel_acc": eager["pixel_acc"],
            "miou": artifact["miou"],
            "pixel_acc": artifact["pixel_acc"],
            "miou_drop_points": eager["miou"] - artifact["miou"],
        }

    def golden(self, inputs, reference, labels):
        h, w = self.input_size
        logits = reference.reshape(len(reference), self.num_classes, h, w)
        files = {
            "inputs.npy": inputs.numpy().astype(np.float32),
            "eager_logits.npy": logits.numpy().astype(np.float32),
            "eager_masks.npy": logits.argmax(1).numpy().astype(np.uint8),
        }
        if labels is not None:
            files["masks.npy"] = labels.reshape(len(labels), h, w).numpy().astype(np.uint8)
        return files

    def departure(self, reference, outputs):
        # the share of pixels whose class differs from eager's, then the logits
        changed = (self._masks(reference) != self._masks(outputs)).double().mean(1)
        return {"changed_pixels": changed, **super().departure(reference, outputs)}

    def preview(self, image, eager_row, artifact_row, preprocessing, labels=None):
        """input | eager mask | artifact mask, pixels where the two masks differ outlined in white."""
        h, w = self.input_size
        mean, std = (
            torch.tensor(preprocessing["mean"])[:, None, None],
            torch.tensor(preprocessing["std"])[:, None, None],
        )
        rgb = ((image * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        eager = self._masks(eager_row[None])[0].reshape(h, w).numpy()
        artifact = self._masks(artifact_row[None])[0].reshape(h, w).numpy()
        blend = lambda mask: (0.45 * rgb + 0.55 * colourize(mask)).astype(np.uint8)  # noqa: E731
        differs = blend(artifact)
        differs[eager != artifact] = 255
        gap = np.full((h, 4, 3), 255, np.uint8)
        return Image.fromarray(np.concatenate([rgb, gap, blend(eager), gap, differs], axis=1), "RGB")
