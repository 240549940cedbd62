"""Object detection (single-stage: SSD, SSDlite, RetinaNet, FCOS): the graph returns the raw heads; decoding
and NMS are shared numpy.

torch.export cannot take torchvision's batched NMS, and ExecuTorch / XNNPACK have no NMS kernel, so every
format gets backbone (+ FPN) + head, returning one array per image of (anchors, 4 box values [+ 1 FCOS
centerness] + C class logits), the per-level outputs concatenated as torchvision's heads do.
exporter/device/detection_decode.py turns it into boxes for eager and for every artifact alike, and ships in the
bundle with the anchors; its parameters (`Detection.params`) are read from the model object. Fidelity is
judged on the raw heads (PSNR, cosine) and on the decoded boxes (matched to eager's by IoU >= 0.5 and
class); labeled metrics are COCO mAP from pycocotools. Two-stage detectors (Faster R-CNN) take another graph and
route, with the same metrics: tasks/region_detection.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, UnidentifiedImageError
from torch import nn

from ..device import detection_decode
from ..data import Inputs, split
from ..errors import UsageError
from .base import Task, logit_fidelity

MATCH_SCORE = 0.3  # detections compared against eager's: those an app would show
PAD = -1.0  # class of padding rows in the (N, K, 5) label tensor
DECODE_CODE = "detection_decode.py"  # written into every detection build, beside the manifest


SINGLE_STAGE = ("ssd", "retinanet", "fcos")  # model name prefixes: torchvision's SSD, RetinaNet and FCOS classes


class RawHeads(nn.Module):
    """Backbone + head on an already resized and normalized image: (1, anchors, 4 + classes), FCOS
    (1, anchors, 4 + 1 centerness + classes)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.backbone, self.head = model.backbone, model.head
        self.__dict__["detector"] = model  # for --detections graph (detections_in_graph.py); not a submodule

    def forward(self, x):
        features = list(self.backbone(x).values())
        heads = self.head(features)  # each (1, anchors of all levels, k)
        parts = (
            ["bbox_regression", "bbox_ctrness", "cls_logits"]
            if "bbox_ctrness" in heads
            else ["bbox_regression", "cls_logits"]
        )
        return torch.cat([heads[k] for k in parts], dim=-1)


@lru_cache(maxsize=None)
def _reference_model(model_name: str, num_classes: int) -> nn.Module:
    from torchvision.models import get_model

    return get_model(model_name, weights=None, weights_backbone=None, num_classes=num_classes).eval()


def _anchors(model: nn.Module, size: tuple[int, int]) -> tuple[np.ndarray, list[int]]:
    """The model's anchors (FCOS: the points, as boxes one stride wide) for an input of `size`, and how many
    of them each feature level has, in order."""
    from torchvision.models.detection.image_list import ImageList

    x = torch.zeros(1, 3, *size)
    with torch.no_grad():
        features = list(model.backbone(x).values())
        anchors = model.anchor_generator(ImageList(x, [tuple(size)]), features)[0].numpy().astype(np.float32)
    per_location = model.anchor_generator.num_anchors_per_location()
    levels = [int(f.shape[-2] * f.shape[-1] * a) for f, a in zip(features, per_location)]
    assert sum(levels) == len(anchors), (levels, anchors.shape)
    return anchors, levels


def decode_params(model: nn.Module, levels: list[int]) -> dict:
    """What detection_decode.decode needs, read from a torchvision SSD, RetinaNet or FCOS model object: its
    kind, thresholds, top-k, detections per image and box coder (and the anchors per level, which
    RetinaNet's and FCOS's per-level top-k needs)."""
    from torchvision.models.detection.fcos import FCOS
    from torchvision.models.detection.retinanet import RetinaNet
    from torchvision.models.detection.ssd import SSD

    kind = next(
        (k for cls, k in ((SSD, "ssd"), (RetinaNet, "retinanet"), (FCOS, "fcos")) if isinstance(model, cls)), None
    )
    if kind is None:
        raise UsageError(
            f"{type(model).__name__} is not a single-stage detector the decode knows (SSD, RetinaNet, FCOS)"
        )
    coder = model.box_coder
    params = {
        "kind": kind,
        "score_thresh": float(model.score_thresh),
        "nms_thresh": float(model.nms_thresh),
        "topk_candidates": int(model.topk_candidates),
        "detections_per_img": int(model.detections_per_img),
    }
    if kind == "fcos":  # BoxLinearCoder: distances from the point, no weights, no clip
        params.update(box_coder_weights=None, bbox_xform_clip=None, normalize_by_size=bool(coder.normalize_by_size))
    else:  # BoxCoder
        params.update(box_coder_weights=[float(w) for w in coder.weights], bbox_xform_clip=float(coder.bbox_xform_clip))
    if kind != "ssd":
        params["levels"] = list(levels)
    return params


def _gt_coco(labels: torch.Tensor, size) -> dict:
    h, w = size
    images, annotations = [], []
    for i, rows in enumerate(labels.tolist()):
        images.append({"id": i, "width": w, "height": h})
        for c, x0, y0, x1, y1 in rows:
            if c != PAD:
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": i,
                        "category_id": int(c),
                        "iscrowd": 0,
                        "bbox": [x0, y0, x1 - x0, y1 - y0],
                        "area": (x1 - x0) * (y1 - y0),
                    }
                )
    return {"images": images, "annotations": annotations}


def coco_map(detections: list[dict], labels: torch.Tensor, size, num_classes: int) -> dict:
    """COCO mAP@[.5:.95] and mAP@.5 (in points) of decoded detections against padded label boxes."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = _gt_coco(labels, size)
    if not gt["annotations"]:
        return {"map": None, "map50": None}
    gt.update(info={}, licenses=[], categories=[{"id": c} for c in range(1, num_classes)])
    results = [
        {
            "image_id": i,
            "category_id": int(label),
            "score": float(score),
            "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])],
        }
        for i, d in enumerate(detections)
        for b, score, label in zip(d["boxes"], d["scores"], d["labels"])
    ]
    if not results:
        return {"map": 0.0, "map50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = gt
        coco.createIndex()
        evaluator = COCOeval(coco, coco.loadRes(results), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = [max(0.0, float(s)) for s in evaluator.stats[:2]]  # -1 means "no such boxes": 0 detected
    return {"map": 100.0 * stats[0], "map50": 100.0 * stats[1]}


@dataclass(frozen=True)
class Detection(Task):
    anchors: np.ndarray | None = field(default=None, compare=False, repr=False)
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    decoding: dict | None = field(default=None, compare=False, repr=False)  # decode_params of the model

    name = "detection"
    agreement = "matched_recall"
    drop = "map_drop_points"

    @classmethod
    def unsupported_model(cls, model_name: str) -> str | None:
        if not model_name.startswith(SINGLE_STAGE):
            extra = "masks" if model_name.startswith("maskrcnn") else "keypoints"
            return (
                f"{model_name} cannot be exported yet: its {extra} have no output layout, golden files or metric "
                "here; its boxes would take Faster R-CNN's route (the TorchScript-based ONNX exporter, Jetson "
                f"only), which traces it and whose graph ONNX Runtime runs as eager does (measured, {extra} "
                "included), but the graph would drop what the weight is for (docs/tasks.md)"
            )
        return None

    decodes_in_graph = False  # its graph ends in torchvision's post-processing (--detections graph)

    @classmethod
    def for_decode(cls, decode):
        if decode == "host":
            return cls
        return next(sub for sub in Detection.__subclasses__() if sub.decodes_in_graph)

    @classmethod
    def input_size_of(cls, weights, model_name, requested):
        transform = _reference_model(model_name, 2).transform
        if transform.fixed_size:  # SSD: resized to one size, which its anchors are made for
            size = tuple(transform.fixed_size)
            if requested is not None and tuple(requested) != size:
                raise UsageError(f"--input-size: this detector's anchors are fixed for {size[0]}x{size[1]}")
            return size
        # RetinaNet, FCOS: torchvision resizes the short side to min_size (long side at most max_size) and pads
        # to a multiple of size_divisible; one graph takes one size: --input-size, by default a min_size square
        step = transform.size_divisible
        if requested is None:
            return transform.min_size[0], transform.min_size[0]
        size = tuple(int(v) for v in requested)
        if any(v <= 0 or v % step for v in size):
            raise UsageError(
                f"--input-size: {model_name} takes sides that are multiples of {step} "
                f"(torchvision pads to them), not {size[0]}x{size[1]}"
            )
        return size

    @classmethod
    def bind(cls, weights, model_name, num_classes, input_size=None):
        size = cls.input_size_of(weights, model_name, input_size)
        # anchors depend on the architecture and the input size only, not on the weights
        reference = _reference_model(model_name, num_classes)
        anchors, levels = _anchors(reference, size)
        return cls(
            num_classes,
            size,
            anchors,
            tuple(reference.transform.image_mean),
            tuple(reference.transform.image_std),
            decode_params(reference, levels),
        )

    @classmethod
    def num_classes_in(cls, state, model_name, default):
        # the classification head's last conv gives anchors per location x classes: SSD's first level
        # (module_list.0.*), RetinaNet's and FCOS's shared cls_logits
        prefix = (
            "head.classification_head.module_list.0."
            if model_name.startswith("ssd")
            else "head.classification_head.cls_logits."
        )
        convs = [v for k, v in state.items() if k.startswith(prefix) and isinstance(v, torch.Tensor) and v.ndim == 4]
        per_location = _reference_model(model_name, 2).anchor_generator.num_anchors_per_location()[0]
        if convs and convs[-1].shape[0] % per_location == 0:
            return int(convs[-1].shape[0] // per_location)
        return default

    @classmethod
    def construct(cls, model_name, num_classes, state, arch=None):
        from torchvision.models import get_model

        return get_model(model_name, weights=None, weights_backbone=None, num_classes=num_classes, **(arch or {}))

    @classmethod
    def graph(cls, model):
        return RawHeads(model).eval()

    @property
    def params(self) -> dict:
        """detection_decode's parameters (read from the model when bound) and the score compared against eager."""
        return {**detection_decode.DEFAULTS, **(self.decoding or {}), "match_score": MATCH_SCORE}

    def preprocessing(self, weights):
        return {
            "task": self.name,
            "input_size": list(self.input_size),
            "resize_size": list(self.input_size),  # exactly, aspect ratio not kept (SSD's transform does the same)
            "crop_size": None,
            "interpolation": "bilinear",
            "antialias": True,
            "mean": list(self.mean),
            "std": list(self.std),
            "layout": "NCHW",
            "dtype": "float32",
            "range": "RGB scaled to [0, 1] before normalization",
            "output": self.output(),
            "boxes": "xyxy in pixels of the input_size image; scale by the original size / input_size",
        }

    def transform(self, weights):
        from torchvision.transforms import v2

        # the image is resized before it becomes a tensor, as an app resizes its bitmap
        return v2.Compose(
            [
                v2.Resize(list(self.input_size)),
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(self.mean, self.std),
            ]
        )

    def output(self):
        count = 0 if self.anchors is None else len(self.anchors)
        kind = self.params["kind"]
        meaning = {
            "ssd": "per anchor: 4 box deltas (dx, dy, dw, dh, scaled by box_coder_weights) then class logits "
            "(softmax, class 0 = background)",
            "retinanet": "per anchor, levels in order (decode.levels anchors each): 4 box deltas (dx, dy, dw, dh, "
            "scaled by box_coder_weights) then class logits (sigmoid each)",
            "fcos": "per point, levels in order (decode.levels points each; anchors.npy holds each point as a box one "
            "stride wide): 4 distances (left, top, right, bottom) from its centre in units of that box's "
            "size, 1 centerness logit, then class logits; score = sqrt(sigmoid(class) * sigmoid(centerness))",
        }[kind]
        return {
            "name": self.output_name,
            "layout": "NAK",
            "shape": [1, count, (5 if kind == "fcos" else 4) + self.num_classes],
            "meaning": f"{meaning}; decode with detection_decode.py and anchors.npy",
        }

    def describe(self):
        code = self.device_files()[DECODE_CODE].encode("utf-8")
        anchors = None if self.anchors is None else "golden/anchors.npy"
        return {
            **super().describe(),
            "decode": {
                **self.params,
                "anchors": anchors,
                "code": DECODE_CODE,
                "code_sha256": hashlib.sha256(code).hexdigest(),
            },
        }

    def device_files(self):
        return {**super().device_files(), DECODE_CODE: Path(detection_decode.__file__).read_text(encoding="utf-8")}

    # --- data: DIR/annotations.json (COCO) and the images it names ---
    def load_data(self, root, transform, calib_size, val_size, seed, class_names=None):
        root = Path(root)
        records = self._records(root)
        calib_idx, val_idx = split(len(records), calib_size, val_size, seed)
        calibration = [self._read(records[i], transform) for i in calib_idx]
        validation = [self._read(records[i], transform) for i in val_idx]
        return Inputs(
            [x[None] for x, _ in calibration],
            torch.stack([x for x, _ in validation]),
            self._pad([b for _, b in validation]),
            None,
            calibration_labels=self._pad([b for _, b in calibration]) if calibration else None,
            description={
                "source": str(root.resolve()),
                "labeled": True,
                "format": "COCO annotations.json",
                "images": len(records),
                "calibration": len(calib_idx),
                "validation": len(val_idx),
                "seed": seed,
            },
        )

    def _records(self, root: Path) -> list[tuple[Path, tuple[int, int], list]]:
        path = root / "annotations.json"
        if not path.is_file():
            raise UsageError(f"--data {root} has no annotations.json (detection expects COCO format)")
        try:
            coco = json.loads(path.read_text())
            categories = {c["id"] for c in coco["categories"]}
            images = {im["id"]: im for im in coco["images"]}
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path} is not COCO format: {type(e).__name__}: {e}") from None
        boxes = {i: [] for i in images}
        for a in coco.get("annotations", []):
            image = images.get(a.get("image_id"))
            if image is None:
                raise UsageError(f"{path}: annotation {a.get('id')} names unknown image {a.get('image_id')}")
            c = a.get("category_id")
            if c not in categories or not 1 <= c < self.num_classes:
                raise UsageError(
                    f"{path}: annotation {a.get('id')} has unknown category {c} "
                    f"(the model has classes 1..{self.num_classes - 1})"
                )
            x, y, w, h = a["bbox"]
            if x < 0 or y < 0 or w <= 0 or h <= 0 or x + w > image["width"] or y + h > image["height"]:
                raise UsageError(
                    f"{path}: annotation {a.get('id')} box {a['bbox']} lies outside its image "
                    f"{image['file_name']} ({image['width']}x{image['height']})"
                )
            boxes[image["id"]].append((c, x, y, x + w, y + h))
        records = []
        for i, image in sorted(images.items()):
            file = next(
                (p for p in (root / image["file_name"], root / "images" / image["file_name"]) if p.is_file()), None
            )
            if file is None:
                raise UsageError(
                    f"{path}: image {image['file_name']} is missing (looked in {root} and {root / 'images'})"
                )
            records.append((file, (image["width"], image["height"]), boxes[i]))
        if not records:
            raise UsageError(f"{path} lists no images")
        return records

    def _read(self, record, transform) -> tuple[torch.Tensor, list]:
        file, size, boxes = record
        try:
            with Image.open(file) as im:
                rgb = im.convert("RGB")
        except (UnidentifiedImageError, OSError) as e:
            raise UsageError(f"cannot read image {file}: {e}") from None
        if rgb.size != size:
            raise UsageError(f"image {file} is {rgb.size[0]}x{rgb.size[1]}, annotations.json says {size[0]}x{size[1]}")
        h, w = self.input_size
        sx, sy = w / size[0], h / size[1]
        return transform(rgb), [(c, x0 * sx, y0 * sy, x1 * sx, y1 * sy) for c, x0, y0, x1, y1 in boxes]

    @staticmethod
    def _pad(per_image: list[list]) -> torch.Tensor:
        most = max((len(b) for b in per_image), default=0)
        rows = [list(b) + [(PAD, 0, 0, 0, 0)] * (most - len(b)) for b in per_image]
        return torch.tensor(rows, dtype=torch.float32).reshape(len(per_image), most, 5)

    # --- metrics ---
    def heads(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows (N, anchors * K) as the graph returned them: (N, anchors, K)."""
        return rows.reshape(len(rows), len(self.anchors), -1)

    def aligned(self, reference: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """`outputs` with each image's rows in the order of eager's rows they match (detection_decode.aligned): a
        graph ending in final detections may list two with rounding-equal scores either way round."""
        rows = [
            detection_decode.aligned(r, o, self.params)
            for r, o in zip(self.heads(reference).numpy(), self.heads(outputs).numpy())
        ]
        return torch.from_numpy(np.stack(rows)).reshape(outputs.shape).to(outputs.dtype) if rows else outputs

    def decode(self, rows: torch.Tensor) -> list[dict]:
        return [
            detection_decode.decode(head, self.anchors, self.input_size, self.params)
            for head in self.heads(rows).numpy()
        ]

    def fidelity(self, reference, outputs):
        matches = [
            detection_decode.match(r, o, MATCH_SCORE) for r, o in zip(self.decode(reference), self.decode(outputs))
        ]
        total = lambda key: sum(m[key] for m in matches)  # noqa: E731
        ious = [v for m in matches for v in m["ious"]]
        errors = [v for m in matches for v in m["score_errors"]]
        return {
            **logit_fidelity(reference, self.aligned(reference, outputs)),
            "matched_recall": total("matched") / total("reference") if total("reference") else 1.0,
            "matched_precision": total("matched") / total("candidate") if total("candidate") else 1.0,
            "mean_match_iou": float(np.mean(ious)) if ious else None,
            "max_score_error": float(np.max(errors)) if errors else None,
            "count_agreement": float(np.mean([m["reference"] == m["candidate"] for m in matches])),
            "eager_detections": total("reference"),
            "artifact_detections": total("candidate"),
        }

    def labeled(self, outputs, labels):
        return coco_map(self.decode(outputs), labels, self.input_size, self.num_classes)

    def vs_eager(self, eager, artifact):
        drop = None if eager["map"] is None or artifact["map"] is None else eager["map"] - artifact["map"]
        return {
            "eager_map": eager["map"],
            "eager_map50": eager["map50"],
            "map": artifact["map"],
            "map50": artifact["map50"],
            "map_drop_points": drop,
        }

    def golden_rows(self, reference, count):
        # the images with the most boxes an app would show: matched recall and precision are counted in boxes
        shown = torch.tensor([int((d["scores"] >= MATCH_SCORE).sum()) for d in self.decode(reference)])
        return sorted(torch.argsort(-shown, stable=True)[:count].tolist())

    def golden(self, inputs, reference, labels):
        detections = [{k: v[d["scores"] >= MATCH_SCORE].tolist() for k, v in d.items()} for d in self.decode(reference)]
        files = {
            "inputs.npy": inputs.numpy().astype(np.float32),
            "eager_logits.npy": self.heads(reference).numpy().astype(np.float32),
            "eager_detections.json": detections,
        }
        if self.anchors is not None:
            files["anchors.npy"] = self.anchors
        if labels is not None:
            files["boxes.json"] = [[row for row in rows if row[0] != PAD] for rows in labels.tolist()]
        return files

    def departure(self, reference, outputs):
        # boxes an app would show that have no partner on the other side (missed or extra), then the raw heads
        matches = [
            detection_decode.match(r, o, MATCH_SCORE) for r, o in zip(self.decode(reference), self.decode(outputs))
        ]
        unmatched = torch.tensor(
            [m["reference"] + m["candidate"] - 2 * m["matched"] for m in matches], dtype=torch.float64
        )
        return {
            "unmatched_boxes": unmatched,
            "head_rmse": super().departure(reference, self.aligned(reference, outputs))["logit_rmse"],
        }

    def preview(self, image, eager_row, artifact_row, preprocessing, labels=None):
        """input | eager boxes | artifact boxes (scores >= MATCH_SCORE)."""
        mean, std = torch.tensor(self.mean)[:, None, None], torch.tensor(self.std)[:, None, None]
        rgb = Image.fromarray(((image * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy(), "RGB")
        panels = [rgb]
        for row in (eager_row, artifact_row):
            d = self.decode(row[None])[0]
            panel = rgb.copy()
            draw = ImageDraw.Draw(panel)
            for box, score, label in zip(d["boxes"], d["scores"], d["labels"]):
                if score >= MATCH_SCORE and np.isfinite(box).all():
                    draw.rectangle([float(v) for v in box], outline=(255, 40, 40), width=2)
                    name = labels[label] if labels and 0 <= label < len(labels) else label
                    draw.text((float(box[0]) + 2, float(box[1]) + 1), f"{name} {score:.2f}", fill=(255, 255, 0))
            panels.append(panel)
        h, w = self.input_size
        sheet = Image.new("RGB", (3 * w + 8, h), "white")
        for i, panel in enumerate(panels):
            sheet.paste(panel, (i * (w + 4), 0))
        return sheet
