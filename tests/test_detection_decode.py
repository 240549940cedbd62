"""The shared detection post-processing: the same boxes as torchvision's SSD, matching, COCO mAP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exporter import weights
from exporter.device import detection_decode
from exporter.tasks.detection import PAD, coco_map

SSDLITE = "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"


@pytest.fixture(scope="module")
def ssdlite():
    from torchvision.models import get_model

    model = get_model("ssdlite320_mobilenet_v3_large", weights=None, weights_backbone=None, num_classes=11).eval()
    return model, weights.bind_task(weights.resolve(SSDLITE), 11)


def test_bound_task_has_the_fixed_input_and_anchors(ssdlite):
    _, task = ssdlite
    assert task.input_size == (320, 320) and task.anchors.shape == (3234, 4)
    assert task.output()["shape"] == [1, 3234, 15] and task.mean == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_reproduces_torchvision_postprocessing(ssdlite, seed):
    """Varied heads (random weights give near-tied scores, which would prove nothing)."""
    model, task = ssdlite
    g = torch.Generator().manual_seed(seed)
    head = torch.cat([torch.randn(1, 3234, 4, generator=g), 4 * torch.randn(1, 3234, 11, generator=g)], -1)
    ours = detection_decode.decode(head[0].numpy(), task.anchors, (320, 320))
    theirs = model.postprocess_detections(
        {"bbox_regression": head[..., :4], "cls_logits": head[..., 4:]}, [torch.from_numpy(task.anchors)], [(320, 320)]
    )[0]
    theirs = {k: v.numpy() for k, v in theirs.items()}
    assert len(ours["boxes"]) == len(theirs["boxes"]) > 0
    ours, theirs = _ordered(ours), _ordered(theirs)  # tied scores may come in either order (the sort differs by CPU)
    assert (ours["labels"] == theirs["labels"]).all()
    np.testing.assert_allclose(ours["scores"], theirs["scores"], atol=1e-6)
    np.testing.assert_allclose(ours["boxes"], theirs["boxes"], atol=1e-3)


def _ordered(detections: dict) -> dict:
    """Detections by score (rounded past float32's noise), then label, then box."""
    boxes = np.round(detections["boxes"].astype(np.float64), 2)
    order = np.lexsort((*boxes.T[::-1], detections["labels"], -np.round(detections["scores"].astype(np.float64), 5)))
    return {k: v[order] for k, v in detections.items()}


def test_match_pairs_boxes_by_class_and_iou():
    ref = {
        "boxes": np.array([[0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]], float),
        "scores": np.array([0.9, 0.8, 0.1]),
        "labels": np.array([1, 2, 3]),
    }
    cand = {
        "boxes": np.array([[1, 0, 11, 10], [20, 20, 30, 30], [70, 70, 80, 80]], float),
        "scores": np.array([0.85, 0.7, 0.9]),
        "labels": np.array([1, 1, 4]),
    }
    m = detection_decode.match(ref, cand, min_score=0.3)
    # the low-score reference box is not compared; box 2 has the wrong class; the third candidate is extra
    assert (m["reference"], m["candidate"], m["matched"]) == (2, 3, 1)
    assert m["ious"][0] == pytest.approx(90 / 110) and m["score_errors"][0] == pytest.approx(0.05)


def test_boxes_clipped_flat_against_the_image_edge_match_their_twins_and_only_them():
    """A random RetinaNet's head (LSUV-scaled, 128x128) clips a third of its boxes to zero width or height at
    the image edge; eager in float64 and float32 gave the same boxes and matched only 65 % of them."""
    flat = np.array([[128, 10, 128, 50], [0, 0, 40, 0], [128, 60, 128, 61], [5, 5, 5, 5]], float)
    ref = {"boxes": flat, "scores": np.full(4, 0.5), "labels": np.ones(4, int)}
    m = detection_decode.match(ref, {**ref, "boxes": flat + 1e-5}, min_score=0.3)
    assert m["matched"] == 4 and min(m["ious"]) > 0.95
    elsewhere = flat.copy()
    elsewhere[:, [1, 3]] += 200  # the same segments further along the edge
    assert detection_decode.match(ref, {**ref, "boxes": elsewhere}, min_score=0.3)["matched"] == 0
    half = flat.copy()
    half[0] = [128, 30, 128, 70]  # overlaps the first segment over 20 of 60 px
    m = detection_decode.match(ref, {**ref, "boxes": half}, min_score=0.3)
    assert m["matched"] == 3 and 0.3 < detection_decode._match_iou(flat[:1], half[:1])[0, 0] < 0.35


def test_coco_map_of_perfect_and_missing_detections():
    labels = torch.tensor(
        [[[1, 10, 10, 50, 50], [2, 60, 60, 100, 120]], [[3, 5, 5, 40, 40], [PAD, 0, 0, 0, 0]]], dtype=torch.float32
    )
    perfect = [
        {"boxes": np.array(rows)[:, 1:], "scores": np.ones(len(rows)), "labels": np.array(rows)[:, 0].astype(int)}
        for rows in ([r for r in image if r[0] != PAD] for image in labels.tolist())
    ]
    assert coco_map(perfect, labels, (320, 320), 11) == {"map": pytest.approx(100.0), "map50": pytest.approx(100.0)}
    half = [perfect[0], {k: v[:0] for k, v in perfect[1].items()}]  # the second image's box not found
    assert coco_map(half, labels, (320, 320), 11)["map"] < 100.0


def test_nms_matches_torchvision_and_its_limit_keeps_the_best_prefix():
    from torchvision.ops import nms

    rng = np.random.default_rng(3)
    corners = rng.uniform(0, 300, (400, 2)).astype(np.float32)
    boxes = np.concatenate([corners, corners + rng.uniform(0, 60, (400, 2)).astype(np.float32)], 1)
    boxes[:20, 2:] = boxes[:20, :2]  # zero area: never suppresses, never suppressed
    boxes[20:40] = boxes[40:60]  # exact duplicates
    scores = rng.uniform(0, 1, 400).astype(np.float32)
    everything = detection_decode.nms(boxes, scores, 0.55)
    np.testing.assert_array_equal(everything, nms(torch.from_numpy(boxes), torch.from_numpy(scores), 0.55).numpy())
    assert len(everything) > 50
    np.testing.assert_array_equal(detection_decode.nms(boxes, scores, 0.55, limit=50), everything[:50])


def test_nms_with_labels_suppresses_only_within_a_class():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [1, 0, 11, 10]], np.float32)
    scores = np.array([0.9, 0.8, 0.7], np.float32)
    assert detection_decode.nms(boxes, scores, 0.5).tolist() == [0]
    assert detection_decode.nms(boxes, scores, 0.5, labels=np.array([1, 2, 1])).tolist() == [0, 1]
    assert detection_decode.nms(boxes, scores, 0.5, limit=0).tolist() == []


def test_nms_suppresses_an_iou_exactly_at_the_threshold_as_torchvision_does():
    """IoU 11/20 rounds to float32 0.55000001, above the double 0.55: torchvision suppresses it. Compared in
    float32 (numpy's default for a Python float against a float32 array), it would be kept."""
    from torchvision.ops import nms

    boxes = np.array([[0, 0, 20, 1], [0, 0, 11, 1]], np.float32)
    scores = np.array([0.9, 0.8], np.float32)
    theirs = nms(torch.from_numpy(boxes), torch.from_numpy(scores), 0.55).tolist()
    assert theirs == [0]
    assert detection_decode.nms(boxes, scores, 0.55).tolist() == theirs
    assert detection_decode.nms(boxes, scores, 0.55, labels=np.array([3, 3])).tolist() == theirs
