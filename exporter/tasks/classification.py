"""Image classification: one row of class logits per image; agreement of the top-1 class, acc@1."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .. import data
from ..errors import UsageError
from .base import Task, logit_fidelity


def _class_heads(model_name: str, classes: int) -> list[tuple[str, int]]:
    """(state-dict key, dim) of every tensor whose size follows num_classes: the last Linear of most classifiers,
    SqueezeNet's final 1x1 conv, GoogLeNet's and Inception's auxiliary heads. Found by building the model twice
    on the meta device (no memory, no init cost; on the CPU for builders that compute with tensors, RegNet) with
    two class counts and comparing shapes."""
    import warnings

    from torchvision.models import get_model

    def shapes(n):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with torch.device("meta"):
                    return get_model(model_name, weights=None, num_classes=n).state_dict()
            except NotImplementedError:
                return get_model(model_name, weights=None, num_classes=n).state_dict()

    a, b = shapes(classes), shapes(classes + 1)
    heads = []
    for key, tensor in a.items():
        other = b.get(key)
        if other is not None and tensor.shape != other.shape:
            heads.append((key, next(i for i, (x, y) in enumerate(zip(tensor.shape, other.shape)) if x != y)))
    return heads


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    k = min(5, logits.shape[1])
    top = logits.topk(k, 1).indices
    return {
        "acc1": 100.0 * (top[:, 0] == labels).double().mean().item(),
        "acc5": 100.0 * (top == labels[:, None]).any(1).double().mean().item(),
    }


def fidelity(reference: torch.Tensor, output: torch.Tensor) -> dict:
    ref, out = reference.double(), output.double()
    k = min(5, ref.shape[1])
    ref_top1 = ref.argmax(1)
    return {
        **logit_fidelity(ref, out),
        "top1_agreement": (out.argmax(1) == ref_top1).double().mean().item(),
        # the eager top-1 class is among the artifact's top-5
        "top5_agreement": (out.topk(k, 1).indices == ref_top1[:, None]).any(1).double().mean().item(),
    }


def accuracy_vs_eager(eager: dict, artifact: dict) -> dict:
    return {
        "eager_acc1": eager["acc1"],
        "eager_acc5": eager["acc5"],
        "acc1": artifact["acc1"],
        "acc5": artifact["acc5"],
        "drop_points": eager["acc1"] - artifact["acc1"],
    }


class Classification(Task):
    name = "classification"
    agreement = "top1_agreement"
    drop = "drop_points"

    @classmethod
    def input_size_of(cls, weights, model_name, requested):
        crop = weights.transforms().crop_size
        size = (crop[0], crop[-1])
        if requested is None or tuple(requested) == size:
            return size
        least = tuple(weights.meta.get("min_size") or (1, 1))
        if least == size:  # ViT, MaxViT, Swin: position embeddings or attention windows laid out for this size
            raise UsageError(f"--input-size: {model_name} takes only its weights' crop, {size[0]}x{size[1]}")
        h, w = (int(v) for v in requested)
        if h != w:
            raise UsageError(
                f"--input-size: a classifier's crop is square ({h}x{w} asked; its weights' is {size[0]}x{size[1]})"
            )
        if h < least[0]:
            raise UsageError(f"--input-size: {model_name} takes at least {least[0]}x{least[1]}")
        return h, w

    @classmethod
    def num_classes_in(cls, state, model_name, default):
        for key, dim in _class_heads(model_name, default):
            tensor = state.get(key)
            packed = state.get(key.removesuffix(".weight") + "._packed_params._packed_params")  # int8 (weight, bias)
            if tensor is None and key.endswith(".weight") and isinstance(packed, tuple):
                tensor = packed[0]
            if isinstance(tensor, torch.Tensor) and tensor.ndim > dim:
                return int(tensor.shape[dim])
        return default

    @classmethod
    def construct(cls, model_name, num_classes, state, arch=None):
        from torchvision.models import get_model

        return get_model(model_name, weights=None, num_classes=num_classes, **(arch or {}))

    def preprocessing(self, weights):
        t = weights.transforms()
        scale = self.input_size[0] / t.crop_size[0]  # --input-size: the resize in proportion to the crop
        return {
            "task": self.name,
            "input_size": list(self.input_size),
            "resize_size": [round(s * scale) for s in t.resize_size],
            "crop_size": [self.input_size[0]] * len(t.crop_size),
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
        t = weights.transforms()
        if self.input_size[0] == t.crop_size[0]:
            return t
        from torchvision.transforms._presets import ImageClassification

        p = self.preprocessing(weights)
        return ImageClassification(
            crop_size=p["crop_size"][0],
            resize_size=p["resize_size"][0],
            mean=t.mean,
            std=t.std,
            interpolation=t.interpolation,
            antialias=t.antialias,
        )

    def load_data(self, root, transform, calib_size, val_size, seed, class_names=None):
        return data.from_imagefolder(Path(root), transform, calib_size, val_size, seed, self.num_classes, class_names)

    def output(self):
        return {
            "name": self.output_name,
            "layout": "NC",
            "shape": [1, self.num_classes],
            "meaning": "class logits, before softmax",
        }

    def fidelity(self, reference, outputs):
        return fidelity(reference, outputs)

    def labeled(self, outputs, labels):
        return accuracy(outputs, labels)

    def vs_eager(self, eager, artifact):
        return accuracy_vs_eager(eager, artifact)

    def golden_rows(self, reference, count):
        # the closest calls (smallest top-1 minus top-2 logit): a device's numerics flip those first, where
        # confidently classified images would agree with eager under almost any error
        top2 = reference.topk(min(2, reference.shape[1]), 1).values
        margins = top2[:, 0] - top2[:, -1]
        return sorted(torch.argsort(margins, stable=True)[:count].tolist())

    def golden(self, inputs, reference, labels):
        files = {
            "inputs.npy": inputs.numpy().astype(np.float32),
            "eager_logits.npy": reference.numpy().astype(np.float32),
        }
        if labels is not None:
            files["labels.json"] = labels.tolist()
        return files

    def departure(self, reference, outputs):
        # a flipped call first, then how much the gap between eager's two best classes moved, then the logits
        ref, out = reference.double(), outputs.double()
        top = ref.topk(min(2, ref.shape[1]), 1).indices
        first, second = top[:, :1], top[:, -1:]
        gap = lambda x: (x.gather(1, first) - x.gather(1, second))[:, 0]  # noqa: E731
        return {
            "top1_flipped": (out.argmax(1) != first[:, 0]).double(),
            "margin_change": (gap(out) - gap(ref)).abs(),
            **super().departure(reference, outputs),
        }

    def preview(self, image, eager_row, artifact_row, preprocessing, labels=None):
        """input | eager's five most likely classes, eager's probability (grey) over the artifact's (blue, red
        where the artifact's top-1 is another class), under the logit margin of eager's top-1 over its runner-up
        in both."""
        from PIL import Image, ImageDraw, ImageFont

        mean, std = (
            torch.tensor(preprocessing["mean"])[:, None, None],
            torch.tensor(preprocessing["std"])[:, None, None],
        )
        rgb = Image.fromarray(((image * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy(), "RGB")
        eager, artifact = eager_row.double().softmax(0), artifact_row.double().softmax(0)
        classes = eager.topk(min(5, len(eager))).indices.tolist()
        flipped = int(artifact.argmax()) != classes[0]
        if flipped and int(artifact.argmax()) not in classes:
            classes.append(int(artifact.argmax()))
        h, w = rgb.height, max(rgb.width, 240)
        panel = Image.new("RGB", (w, h), "white")
        draw = ImageDraw.Draw(panel)
        row = h / (len(classes) + 1)  # the first row holds the margins
        font = ImageFont.load_default(size=max(8, min(14, int(row * 0.3))))
        named = lambda c: labels[c] if labels and c < len(labels) else f"class {c}"  # noqa: E731
        runner_up = classes[1 % len(classes)]
        gap = lambda logits: float(logits[classes[0]] - logits[runner_up])  # noqa: E731
        draw.text((4, 2), f"logit margin over {named(runner_up)}:", font=font, fill=(87, 96, 106))
        draw.text(
            (4, 2 + row * 0.45),
            f"eager {gap(eager_row):.3g}, artifact {gap(artifact_row):.3g}",
            font=font,
            fill=(207, 34, 46) if flipped else (31, 35, 40),
        )
        for i, c in enumerate(classes, start=1):
            y = i * row
            name = named(c)
            mine = c == int(artifact.argmax())
            draw.text(
                (4, y + 1),
                f"{name}{'  <- artifact top-1' if mine and flipped else ''}",
                font=font,
                fill=(207, 34, 46) if mine and flipped else (31, 35, 40),
            )
            bar = (w - 60) * 1.0
            top = y + row * 0.42
            for j, (p, colour) in enumerate(
                ((eager[c], (140, 149, 159)), (artifact[c], (207, 34, 46) if flipped else (9, 105, 218)))
            ):
                y0, p = top + j * row * 0.26, float(p)
                length = bar * p if math.isfinite(p) else 0.0  # an artifact that returned NaN: no bar, "nan%"
                draw.rectangle([4, y0, 4 + max(1.0, length), y0 + row * 0.2], fill=colour)
                draw.text((8 + length + 2, y0 - 2), f"{p:.1%}", font=font, fill=(87, 96, 106))
        sheet = Image.new("RGB", (rgb.width + 4 + w, h), "white")
        sheet.paste(rgb, (0, 0))
        sheet.paste(panel, (rgb.width + 4, 0))
        return sheet
