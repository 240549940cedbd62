"""Single-stage detectors with torchvision's own post-processing inside the graph (`--detections graph`).

The graph runs backbone, head, the anchors and the detector's own `postprocess_detections` (box decoding, clip,
score threshold, top-k, per-class NMS, `detections_per_img`) and returns final detections, padded to a fixed
count: what an app shows, with no decode to re-implement. NMS keeps a data-dependent count, which torch.export
(so ExecuTorch, LiteRT and Core ML's converter) cannot take; the TorchScript-based ONNX exporter records it as ONNX
`NonMaxSuppression` (an op TensorRT's ONNX parser takes; not run here, no GPU), at batch 1, as Faster R-CNN's route
does (region_detection.py). Other formats keep the raw heads and the shared decode (a build with `--detections host`).
"""

from __future__ import annotations

import torch
from torch import nn

from .detection import Detection
from .region_detection import EXPORT_ROUTE, FinalRows

EXPORT_STOPS = (
    "torch.export cannot take NMS's data-dependent number of boxes, and an exact NMS of fixed size would compare "
    "every candidate box with every other"
)
KEEPS_HEADS = {  # why a format's artifact cannot end in final detections (the pipeline asks; formats never see it)
    "executorch": EXPORT_STOPS,
    "litert": EXPORT_STOPS,
    "torchscript_lite": "its NMS is torchvision's own kernel, which PyTorch's Android lite runtime does not ship",
    "coreml": "a pipeline ending in Core ML's NMS is not built: Core ML cannot run a prediction on Linux, so its "
    "detections could not be held to torchvision's here, and its NMS suppresses each box under its best class only, "
    "where torchvision keeps every class of a box above the score threshold",
}


def padded(detections: list[dict], rows: int, dtype) -> torch.Tensor:
    """torchvision's per-image detections as one (N, rows, 6) tensor, zero rows after the last."""
    out = []
    for d in detections:
        found = torch.cat([d["boxes"], d["scores"][:, None], d["labels"][:, None].to(dtype)], 1)
        out.append(torch.cat([found, found.new_zeros(rows - found.shape[0], 6)]))
    return torch.stack(out)


class SingleStageDetections(nn.Module):
    """SSD, RetinaNet or FCOS on an already resized and normalized image, ending in the model's own
    `postprocess_detections`: (N, detections_per_img, 6)."""

    # fp16 graphs compute these in half; the decode, thresholds, top-k and NMS stay float (where rounding
    # reorders boxes, and torchvision's CPU nms, run while the graph is traced, has no Half kernel)
    half_modules = ("backbone", "head")

    def __init__(self, model: nn.Module):
        from torchvision.models.detection.ssd import SSD

        super().__init__()
        self.backbone, self.head = model.backbone, model.head
        self.__dict__["detector"] = model  # its anchor generator, box coder and post-processing; not a submodule
        self.rows = int(model.detections_per_img)
        self.per_level = not isinstance(model, SSD)

    def forward(self, x):
        from torchvision.models.detection.image_list import ImageList

        detector = self.detector
        sizes = [(int(x.shape[-2]), int(x.shape[-1]))] * int(x.shape[0])
        images = ImageList(x, sizes)
        features = list(self.backbone(x).values())
        heads = self.head(features)
        anchors = detector.anchor_generator(images, features)
        if self.per_level:  # RetinaNet, FCOS: the heads and anchors split per pyramid level, as their forward does
            locations = [f.shape[-2] * f.shape[-1] for f in features]
            per_location = heads["cls_logits"].shape[1] // sum(locations)
            levels = [n * per_location for n in locations]
            heads = {k: list(v.split(levels, dim=1)) for k, v in heads.items()}
            anchors = [list(a.split(levels)) for a in anchors]
        detections = detector.postprocess_detections(heads, anchors, sizes)
        return padded(detections, self.rows, x.dtype)


def _detector(model: nn.Module) -> nn.Module:
    """The torchvision detector behind `model` (itself, or the one a RawHeads graph was made from)."""
    return model.__dict__.get("detector", model)


class DetectionsInGraph(FinalRows, Detection):
    """Detection whose graph ends in final detections (decode kind "final"); metrics, data and golden files are
    Detection's."""

    decodes_in_graph = True

    @classmethod
    def takes(cls, model_name: str) -> bool:
        return False  # chosen by --detections graph (Detection.for_decode), never by the model's name

    @classmethod
    def format_refusal(cls, format_name: str, precision: str | None = None) -> str | None:
        return None if format_name in ("onnx", "tensorrt") else KEEPS_HEADS.get(format_name, EXPORT_STOPS)

    @classmethod
    def format_options(cls) -> dict[str, dict]:
        return {"onnx": dict(EXPORT_ROUTE), "tensorrt": dict(EXPORT_ROUTE)}

    @classmethod
    def bind(cls, weights, model_name, num_classes, input_size=None):
        host = Detection.bind(weights, model_name, num_classes, input_size)
        return cls(host.num_classes, host.input_size, None, host.mean, host.std, final_params(host.decoding))

    @classmethod
    def graph(cls, model):
        return SingleStageDetections(_detector(model)).eval()

    @classmethod
    def for_decode(cls, decode):
        return cls if decode == "graph" else Detection


def final_params(params: dict) -> dict:
    """The host decode's parameters as the manifest states them for a graph that applies them itself."""
    return {**params, "kind": "final", "graph_of": params["kind"]}
