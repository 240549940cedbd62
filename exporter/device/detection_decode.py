"""Detection post-processing in numpy: raw SSD heads -> boxes, scores, labels.

The exported graphs stop at the raw heads (torch.export cannot take torchvision's batched NMS, and the
mobile runtimes have no NMS kernel), so this one file does what torchvision's SSD.postprocess_detections
does, for eager and for every artifact alike. It needs only numpy and ships in bundles and the Jetson kit
beside anchors.npy; bundle.json carries `params` (DEFAULTS' keys).

A graph's output is one array per image, (anchors, 4 + classes): the box deltas (dx, dy, dw, dh) against
each anchor, scaled by the box coder weights, then the class logits (class 0 = background).
"""

from __future__ import annotations

import math

import numpy as np

DEFAULTS = {
    "box_coder_weights": [10.0, 10.0, 5.0, 5.0],
    "score_thresh": 0.001,
    "nms_thresh": 0.55,
    "topk_candidates": 300,
    "detections_per_img": 300,
    "bbox_xform_clip": math.log(1000.0 / 16),
}


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def decode_boxes(deltas: np.ndarray, anchors: np.ndarray, weights, clip: float) -> np.ndarray:
    """(A, 4) deltas against (A, 4) xyxy anchors -> (A, 4) xyxy boxes."""
    widths, heights = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    ctr_x, ctr_y = anchors[:, 0] + 0.5 * widths, anchors[:, 1] + 0.5 * heights
    wx, wy, ww, wh = weights
    dx, dy = deltas[:, 0] / wx, deltas[:, 1] / wy
    dw, dh = np.minimum(deltas[:, 2] / ww, clip), np.minimum(deltas[:, 3] / wh, clip)
    x, y = dx * widths + ctr_x, dy * heights + ctr_y
    w, h = np.exp(dw) * widths, np.exp(dh) * heights
    return np.stack([x - 0.5 * w, y - 0.5 * h, x + 0.5 * w, y + 0.5 * h], axis=1)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, 4) x (M, 4) xyxy -> (N, M) IoU."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, limit: int | None = None,
        labels: np.ndarray | None = None) -> np.ndarray:
    """Greedy NMS: indices kept, highest score first. With `labels`, a box suppresses only boxes of its own
    label. Stops once `limit` are kept (the rest could only come after them), which bounds the cost when
    thousands of low scores pass the score threshold."""
    if limit is not None and limit <= 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-scores, kind="stable")
    x0, y0, x1, y1 = (boxes[order, i] for i in range(4))
    area = (x1 - x0) * (y1 - y0)
    label = labels[order] if labels is not None else None
    alive, keep = np.arange(order.size), []
    while alive.size:
        best, rest = alive[0], alive[1:]
        keep.append(order[best])
        if not rest.size or len(keep) == limit:
            break
        w = (np.minimum(x1[best], x1[rest]) - np.maximum(x0[best], x0[rest])).clip(0, None)
        h = (np.minimum(y1[best], y1[rest]) - np.maximum(y0[best], y0[rest])).clip(0, None)
        inter = w * h
        union = area[best] + area[rest] - inter
        iou = np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
        survives = iou.astype(np.float64) <= threshold  # in double, as torchvision compares
        if label is not None:
            survives |= label[rest] != label[best]
        alive = rest[survives]
    return np.asarray(keep, dtype=np.int64)


def decode(head: np.ndarray, anchors: np.ndarray, image_size, params: dict | None = None) -> dict:
    """One image's raw head (A, 4 + C) -> {"boxes" (K, 4) xyxy in input pixels, "scores" (K,), "labels" (K,)},
    best first, as torchvision's SSD post-processing (per-class threshold and top-k, class-wise NMS)."""
    p = {**DEFAULTS, **(params or {})}
    head = np.asarray(head, dtype=np.float32).reshape(len(anchors), -1)
    boxes = decode_boxes(head[:, :4], anchors, p["box_coder_weights"], p["bbox_xform_clip"])
    h, w = image_size
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
    scores = softmax(head[:, 4:])
    kept_boxes, kept_scores, kept_labels = [], [], []
    for label in range(1, scores.shape[1]):
        score = scores[:, label]
        index = np.nonzero(score > p["score_thresh"])[0]
        index = index[np.argsort(-score[index], kind="stable")[: p["topk_candidates"]]]
        kept_boxes.append(boxes[index])
        kept_scores.append(score[index])
        kept_labels.append(np.full(index.size, label, dtype=np.int64))
    boxes, scores, labels = np.concatenate(kept_boxes), np.concatenate(kept_scores), np.concatenate(kept_labels)
    keep = nms(boxes, scores, p["nms_thresh"], p["detections_per_img"], labels)  # class-wise, in one pass
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]}


def match(reference: dict, candidate: dict, min_score: float, iou: float = 0.5) -> dict:
    """Greedy one-to-one matching of `candidate` detections to `reference` ones (same class, IoU >= iou),
    both restricted to scores >= min_score: counts, IoUs and score errors of the matches."""
    ref = {k: v[reference["scores"] >= min_score] for k, v in reference.items()}
    cand = {k: v[candidate["scores"] >= min_score] for k, v in candidate.items()}
    ious = box_iou(ref["boxes"], cand["boxes"]) if len(ref["boxes"]) and len(cand["boxes"]) else np.zeros((len(ref["boxes"]), len(cand["boxes"])))
    ious = np.where(ref["labels"][:, None] == cand["labels"][None, :], ious, 0.0)
    matched_ious, score_errors, taken = [], [], set()
    for r in np.argsort(-ref["scores"], kind="stable"):
        options = [(ious[r, c], c) for c in range(ious.shape[1]) if c not in taken and ious[r, c] >= iou]
        if options:
            best_iou, c = max(options)
            taken.add(c)
            matched_ious.append(best_iou)
            score_errors.append(abs(float(ref["scores"][r]) - float(cand["scores"][c])))
    return {"reference": len(ref["boxes"]), "candidate": len(cand["boxes"]), "matched": len(matched_ious),
            "ious": matched_ious, "score_errors": score_errors}
