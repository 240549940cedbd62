"""Detection post-processing in numpy: raw single-stage heads -> boxes, scores, labels.

The exported graphs stop at the raw heads (torch.export cannot take torchvision's batched NMS, and the
mobile runtimes have no NMS kernel), so this one file does what torchvision's `postprocess_detections`
does, for eager and for every artifact alike. It needs only numpy and ships in bundles and the Jetson kit
beside anchors.npy; bundle.json carries `params` (DEFAULTS' keys, plus `levels` and `normalize_by_size`
where the kind uses them).

A graph's output is one array per image, (anchors, K), and `params["kind"]` says what K holds:

- "ssd" (SSD, SSDlite): 4 box deltas (dx, dy, dw, dh) against each anchor, scaled by `box_coder_weights`,
  then C class logits. Softmax; class 0 is background; per class: score threshold and top-k; NMS per class.
- "retinanet": 4 box deltas as SSD's (weights (1, 1, 1, 1) in torchvision), then C class logits. Sigmoid;
  per pyramid level (`levels`: anchors per level, in order): score threshold and top-k over all
  (anchor, class) pairs of the level; then NMS per class across the levels. Any class may be a label.
- "fcos": 4 distances (left, top, right, bottom) from the anchor's centre, in units of its width/height
  when `normalize_by_size`; then 1 centerness logit; then C class logits. Score
  sqrt(sigmoid(class) * sigmoid(centerness)); otherwise as "retinanet".
- "final" (decoded, scored and NMS'd inside the graph: Faster R-CNN, and single-stage detectors built with
  `--detections graph`): one row per detection, best first, x0, y0, x1, y1, score, label, padded to
  `detections_per_img` rows of zeros (a detection's score is above the score threshold, so never 0; its label
  may be 0 in RetinaNet and FCOS). No anchors: the rows are only read.

Boxes are clipped to the image in every kind; at most `detections_per_img` are returned, best first.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULTS = {  # torchvision's SSDlite320; a build's params say what its model uses
    "kind": "ssd",
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


def sigmoid(logits: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x < -88: 1 / inf = 0, as it should be
        return 1 / (1 + np.exp(-logits))


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (argpartition first: a level can have 10^6 candidates)."""
    if values.size > k:
        index = np.argpartition(-values, k - 1)[:k] if k > 0 else np.zeros(0, dtype=np.int64)
    else:
        index = np.arange(values.size)
    return index[np.argsort(-values[index], kind="stable")]


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


def decode_distances(distances: np.ndarray, anchors: np.ndarray, normalize_by_size: bool) -> np.ndarray:
    """(A, 4) distances (left, top, right, bottom) from the centres of (A, 4) xyxy anchors -> xyxy boxes."""
    ctr_x, ctr_y = 0.5 * (anchors[:, 0] + anchors[:, 2]), 0.5 * (anchors[:, 1] + anchors[:, 3])
    if normalize_by_size:
        widths, heights = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
        distances = distances * np.stack([widths, heights, widths, heights], axis=1)
    return np.stack(
        [ctr_x - distances[:, 0], ctr_y - distances[:, 1], ctr_x + distances[:, 2], ctr_y + distances[:, 3]], axis=1
    )


def clip_boxes(boxes: np.ndarray, image_size) -> np.ndarray:
    h, w = image_size
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
    return boxes


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, 4) x (M, 4) xyxy -> (N, M) IoU."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


DEGENERATE_PAD = 1e-3  # pixels


def _match_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """box_iou, where two boxes of zero area (clipped flat against an image edge: a random RetinaNet head puts a
    third of its boxes there at 128x128) are compared as segments or points, each side padded by
    DEGENERATE_PAD; box_iou gives them 0, so two runtimes' identical flat boxes never matched."""
    ious = box_iou(a, b)
    flat_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1]) <= 0
    flat_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) <= 0
    if flat_a.any() and flat_b.any():
        padded = lambda x: np.concatenate([x[:, :2] - DEGENERATE_PAD, x[:, 2:] + DEGENERATE_PAD], 1)  # noqa: E731
        ious = np.where(flat_a[:, None] & flat_b[None, :], box_iou(padded(a), padded(b)), ious)
    return ious


def nms(
    boxes: np.ndarray, scores: np.ndarray, threshold: float, limit: int | None = None, labels: np.ndarray | None = None
) -> np.ndarray:
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
    """One image's raw head (A, K) -> {"boxes" (N, 4) xyxy in input pixels, "scores" (N,), "labels" (N,)},
    best first, as torchvision's `postprocess_detections` of the model `params["kind"]` names."""
    p = {**DEFAULTS, **(params or {})}
    if p["kind"] == "final":
        return _final_rows(np.asarray(head, dtype=np.float32).reshape(-1, 6))
    head = np.asarray(head, dtype=np.float32).reshape(len(anchors), -1)
    if p["kind"] == "ssd":
        boxes, scores, labels = _ssd_candidates(head, anchors, image_size, p)
    elif p["kind"] in ("retinanet", "fcos"):
        boxes, scores, labels = _per_level_candidates(head, anchors, image_size, p)
    else:
        raise ValueError(f"unknown detection decode kind {p['kind']!r} (ssd, retinanet, fcos, final)")
    keep = nms(boxes, scores, p["nms_thresh"], p["detections_per_img"], labels)  # class-wise, in one pass
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]}


def _final_rows(rows: np.ndarray) -> dict:
    """Detections the graph made itself, its padding (score 0) dropped."""
    found = rows[:, 4] > 0
    kept = rows[found]
    return {"boxes": kept[:, :4].copy(), "scores": kept[:, 4].copy(), "labels": np.rint(kept[:, 5]).astype(np.int64)}


def _ssd_candidates(head, anchors, image_size, p):
    """SSD: softmax over classes; per class except background, the scores above the threshold, top-k."""
    boxes = clip_boxes(decode_boxes(head[:, :4], anchors, p["box_coder_weights"], p["bbox_xform_clip"]), image_size)
    scores = softmax(head[:, 4:])
    kept_boxes, kept_scores, kept_labels = [], [], []
    for label in range(1, scores.shape[1]):
        score = scores[:, label]
        index = np.nonzero(score > p["score_thresh"])[0]
        index = index[np.argsort(-score[index], kind="stable")[: p["topk_candidates"]]]
        kept_boxes.append(boxes[index])
        kept_scores.append(score[index])
        kept_labels.append(np.full(index.size, label, dtype=np.int64))
    return np.concatenate(kept_boxes), np.concatenate(kept_scores), np.concatenate(kept_labels)


def _per_level_candidates(head, anchors, image_size, p):
    """RetinaNet, FCOS: sigmoid scores; per level, the (anchor, class) pairs above the threshold, top-k."""
    fcos = p["kind"] == "fcos"
    scores = sigmoid(head[:, 5:] if fcos else head[:, 4:])
    if fcos:
        scores = np.sqrt(scores * sigmoid(head[:, 4:5]))
    num_classes = scores.shape[1]
    levels = [int(n) for n in p["levels"]]
    if sum(levels) != len(anchors):
        raise ValueError(f"params levels add up to {sum(levels)} anchors, the head has {len(anchors)}")
    kept_boxes, kept_scores, kept_labels = [], [], []
    for start, stop in zip(np.cumsum([0] + levels[:-1]), np.cumsum(levels)):
        flat = scores[start:stop].ravel()  # anchor-major: index = anchor * num_classes + class
        index = np.nonzero(flat > p["score_thresh"])[0]
        index = index[top_k(flat[index], p["topk_candidates"])]
        anchor = start + index // num_classes
        if fcos:
            boxes = decode_distances(head[anchor, :4], anchors[anchor], p["normalize_by_size"])
        else:
            boxes = decode_boxes(head[anchor, :4], anchors[anchor], p["box_coder_weights"], p["bbox_xform_clip"])
        kept_boxes.append(clip_boxes(boxes, image_size))
        kept_scores.append(flat[index])
        kept_labels.append((index % num_classes).astype(np.int64))
    return np.concatenate(kept_boxes), np.concatenate(kept_scores), np.concatenate(kept_labels)


def match(reference: dict, candidate: dict, min_score: float, iou: float = 0.5) -> dict:
    """Greedy one-to-one matching of `candidate` detections to `reference` ones (same class, IoU >= iou),
    both restricted to scores >= min_score: counts, IoUs and score errors of the matches."""
    ref = {k: v[reference["scores"] >= min_score] for k, v in reference.items()}
    cand = {k: v[candidate["scores"] >= min_score] for k, v in candidate.items()}
    ious = (
        _match_iou(ref["boxes"], cand["boxes"])
        if len(ref["boxes"]) and len(cand["boxes"])
        else np.zeros((len(ref["boxes"]), len(cand["boxes"])))
    )
    ious = np.where(ref["labels"][:, None] == cand["labels"][None, :], ious, 0.0)
    matched_ious, score_errors, taken = [], [], set()
    for r in np.argsort(-ref["scores"], kind="stable"):
        options = [(ious[r, c], c) for c in range(ious.shape[1]) if c not in taken and ious[r, c] >= iou]
        if options:
            best_iou, c = max(options)
            taken.add(c)
            matched_ious.append(best_iou)
            score_errors.append(abs(float(ref["scores"][r]) - float(cand["scores"][c])))
    return {
        "reference": len(ref["boxes"]),
        "candidate": len(cand["boxes"]),
        "matched": len(matched_ious),
        "ious": matched_ious,
        "score_errors": score_errors,
    }


def aligned(reference: np.ndarray, candidate: np.ndarray, params: dict) -> np.ndarray:
    """`candidate`, one image's graph output, with its rows in the order of the `reference` rows they match, before
    the two are compared value by value (PSNR). Only kind "final" needs it: two detections whose scores differ
    by float rounding come out of the graph in either order. A reference row takes the candidate row of its
    label with the highest IoU (at least 0.5, the nearest score on ties); unmatched rows keep their order. A row
    that neither side scores at params["match_score"] or more is returned as the reference's: an app does not
    show it, and at fp16 the low-score tail crosses score_thresh and NMS either way (a box at 0.0500 in one
    graph and not in the other)."""
    if params.get("kind") != "final":
        return candidate
    ref, out = np.asarray(reference).reshape(-1, 6), np.asarray(candidate).reshape(-1, 6)
    ious = np.where(ref[:, 5, None] == out[None, :, 5], _match_iou(ref[:, :4], out[:, :4]), 0.0)
    order, free = np.full(len(ref), -1), np.ones(len(out), dtype=bool)
    for r in np.nonzero(ref[:, 4] > 0)[0]:
        options = np.nonzero(free & (ious[r] >= 0.5))[0]
        if len(options):
            c = options[np.lexsort((np.abs(out[options, 4] - ref[r, 4]), -ious[r, options]))[0]]
            order[r], free[c] = c, False
    order[order < 0] = np.nonzero(free)[0]
    out = out[order]
    unseen = (ref[:, 4] < params.get("match_score", 0.0)) & (out[:, 4] < params.get("match_score", 0.0))
    out[unseen] = ref[unseen]
    return out.reshape(np.shape(candidate))
