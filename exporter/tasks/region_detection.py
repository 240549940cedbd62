"""Two-stage detection (Faster R-CNN): the graph ends in the final detections, padded to a fixed count.

torch.export cannot take the region proposal step (batched_nms branches on boxes.numel() > 4000, then on
numel() == 0; MultiScaleRoIAlign takes len(rois)), so ExecuTorch, Core ML and the dynamo ONNX exporter cannot
either. The TorchScript-based ONNX exporter (torch.onnx.export(dynamo=False), deprecated since PyTorch 2.9)
records the ops torchvision marks for ONNX instead (RoiAlign, NonMaxSuppression, top-k of a data-dependent
count), for one input size at batch 1: the only route, so ONNX (and the TensorRT engine made from it) is the
only format, with those options. Everything from the proposals to the per-class NMS runs inside the graph;
its output is (1, detections_per_img, 6): x0, y0, x1, y1, score, label, best first, padded with label 0
(the decode kind "final" only drops the padding). Metrics, data and golden files are single-stage
detection's: boxes matched to eager's, COCO mAP.
"""

from __future__ import annotations

import torch
from torch import nn

from .detection import Detection, _reference_model

TWO_STAGE = ("fasterrcnn",)
EXPORT_ROUTE = {"exporter": "torchscript", "batch": "1:1:1"}
TORCH_EXPORT_STOPS = (
    "torch.export stops in the region proposal step: batched_nms branches on boxes.numel() > 4000, "
    "then on numel() == 0, and MultiScaleRoIAlign takes len(rois) (data-dependent sizes)"
)


class FinalDetections(nn.Module):
    """Backbone, RPN and box head on an already resized and normalized image: (N, rows, 6).

    The box step after the box head is torchvision's `RoIHeads.postprocess_detections` (decode, clip, drop the
    background, score threshold, small boxes, per-class NMS, top rows), written so that its traced graph holds
    when no proposal reaches it (a blank frame; an int8 RPN that scores no anchor above its threshold).
    torchvision decodes with a reshape to `(proposals, -1)` and clips with `reshape(boxes.shape)`; with zero
    proposals ONNX Runtime resolves neither ("Input shape:{0,44}, requested shape:{0,-1}"; the second after its
    ReshapeFusion pass made it {0,11,-1}, in the int8 graph). Here every reshape has a fixed width and the clip
    none; the numbers are the same (tests/test_region_detection.py compares the rows with torchvision's own)."""

    # fp16 graphs compute these in half; the proposal and box steps stay float (torchvision's CPU nms, run while
    # the graph is traced, has no Half kernel, and score thresholds and top-k are where rounding reorders boxes)
    half_modules = ("backbone.body", "backbone.fpn")

    def __init__(self, model: nn.Module):
        super().__init__()
        self.backbone, self.rpn, self.roi_heads = model.backbone, model.rpn, model.roi_heads
        self.rows = int(model.roi_heads.detections_per_img)
        self.classes = int(model.roi_heads.box_predictor.cls_score.out_features)

    def forward(self, x):
        from torchvision.models.detection.image_list import ImageList

        images = ImageList(x, [(int(x.shape[-2]), int(x.shape[-1]))] * int(x.shape[0]))
        features = self.backbone(x)
        proposals, _ = self.rpn(images, features)
        heads = self.roi_heads
        logits, codes = heads.box_predictor(heads.box_head(heads.box_roi_pool(features, proposals, images.image_sizes)))
        if len(proposals) > 1:  # the graph is exported at batch 1: no split of a count the trace would fix
            counts = [len(p) for p in proposals]
            logits, codes = logits.split(counts), codes.split(counts)
        else:
            logits, codes = [logits], [codes]
        padded = []
        for image_logits, image_codes, image_proposals, size in zip(logits, codes, proposals, images.image_sizes):
            boxes, scores, labels = self._detections(image_logits, image_codes, image_proposals, size)
            rows = torch.cat([boxes, scores[:, None], labels[:, None].to(x.dtype)], 1)
            padded.append(torch.cat([rows, rows.new_zeros(self.rows - rows.shape[0], 6)]))  # label 0: no detection
        return torch.stack(padded)

    def _detections(self, logits, codes, proposals, size):
        from torchvision.ops import boxes as box_ops

        heads, classes = self.roi_heads, self.classes
        boxes = heads.box_coder.decode_single(codes.reshape(-1, 4 * classes), proposals).reshape(-1, classes, 4)
        height, width = size
        x0, y0, x1, y1 = boxes.unbind(-1)
        boxes = torch.stack([x0.clamp(0, width), y0.clamp(0, height), x1.clamp(0, width), y1.clamp(0, height)], -1)
        scores = torch.softmax(logits, -1)
        labels = torch.arange(classes).view(1, -1).expand_as(scores)
        boxes, scores, labels = boxes[:, 1:].reshape(-1, 4), scores[:, 1:].reshape(-1), labels[:, 1:].reshape(-1)
        keep = torch.where(scores > heads.score_thresh)[0]
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
        keep = box_ops.remove_small_boxes(boxes, min_size=1e-2)
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
        keep = box_ops.batched_nms(boxes, scores, labels, heads.nms_thresh)[: self.rows]
        return boxes[keep], scores[keep], labels[keep]


class FinalRows:
    """A graph that returns final detections: (1, detections_per_img, 6), best first, padded with zeros."""

    def output(self):
        rows = self.params["detections_per_img"]
        return {
            "name": self.output_name,
            "layout": "NDK",
            "shape": [1, rows, 6],
            "meaning": "per detection, best first: x0, y0, x1, y1 (pixels of the input), score, label; rows past "
            "the last detection are zeros (score 0 is never a detection); detection_decode.py's kind 'final' "
            "drops them",
        }

    def heads(self, rows):
        return rows.reshape(len(rows), -1, 6)


class RegionDetection(FinalRows, Detection):
    @classmethod
    def takes(cls, model_name: str) -> bool:
        return model_name.startswith(TWO_STAGE)

    @classmethod
    def unsupported_model(cls, model_name: str) -> str | None:
        return None

    @classmethod
    def format_refusal(cls, format_name: str, precision: str | None = None) -> str | None:
        if format_name in ("onnx", "tensorrt"):
            return None
        if format_name == "torchscript_lite":
            return (
                "its graph calls torchvision's own nms and roi_align kernels, which PyTorch's Android lite "
                "runtime does not ship; ONNX (Jetson) is the route for two-stage detectors"
            )
        return f"{TORCH_EXPORT_STOPS}; ONNX (Jetson) is the route for two-stage detectors"

    @classmethod
    def format_options(cls) -> dict[str, dict]:
        return {"onnx": dict(EXPORT_ROUTE), "tensorrt": dict(EXPORT_ROUTE)}

    @classmethod
    def bind(cls, weights, model_name, num_classes, input_size=None):
        size = cls.input_size_of(weights, model_name, input_size)
        reference = _reference_model(model_name, num_classes)
        return cls(
            num_classes,
            size,
            None,
            tuple(reference.transform.image_mean),
            tuple(reference.transform.image_std),
            decode_params(reference),
        )

    @classmethod
    def num_classes_in(cls, state, model_name, default):
        weight = state.get("roi_heads.box_predictor.cls_score.weight")
        return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else default

    @classmethod
    def graph(cls, model):
        return FinalDetections(model).eval()

    @classmethod
    def for_decode(cls, decode):
        return cls  # its only route ends in final detections


def decode_params(model: nn.Module) -> dict:
    """What the graph does after the proposals, read from torchvision's RoIHeads (for the manifest: the rows are
    final)."""
    heads = model.roi_heads
    return {
        "kind": "final",
        "score_thresh": float(heads.score_thresh),
        "nms_thresh": float(heads.nms_thresh),
        "detections_per_img": int(heads.detections_per_img),
        "topk_candidates": None,
        "box_coder_weights": [float(w) for w in heads.box_coder.weights],
        "bbox_xform_clip": float(heads.box_coder.bbox_xform_clip),
    }
