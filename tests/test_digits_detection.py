"""The detection digits data (exporter.standins.detection), without training: exact tight boxes inside the
image, COCO files consistent with the images, a held-out set built only from held-out digits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from exporter.standins import detection as digits_detection
from exporter.standins.segmentation import make_canvases, split

SIZE, CANVAS = digits_detection.SIZE, digits_detection.CANVAS


def _up(v: int) -> int:
    """The first image pixel showing canvas pixel `v`."""
    return math.ceil(v * SIZE / CANVAS)


def test_boxes_are_exactly_the_pixels_the_digits_cover():
    train_idx = split()[0]
    images, boxes = digits_detection.make_detection_set(train_idx, 8, seed=3)
    small, masks, placed = make_canvases(train_idx, 8, CANVAS, seed=3, with_boxes=True)
    assert images.shape == (8, SIZE, SIZE, 3) and images.dtype == np.uint8
    narrower = 0
    for image, per_image, canvas, mask, digits in zip(images, boxes, small, masks, placed):
        assert np.array_equal(image[::5, ::5], canvas[::2, ::2])  # 2.5x nearest upsampling
        assert len(per_image) == len(digits) >= 1
        for (label, x0, y0, x1, y1), (_, placed_label, sx0, sy0, sx1, sy1) in zip(per_image, digits):
            assert label == placed_label and 1 <= label < digits_detection.NUM_CLASSES
            assert 0 <= x0 < x1 <= SIZE and 0 <= y0 < y1 <= SIZE
            # the digit's pixels (alpha >= 0.5) in its square of the canvas, scaled: tight, not the square
            ys, xs = np.nonzero(mask[sy0:sy1, sx0:sx1] == label)
            expected = (_up(sx0 + xs.min()), _up(sy0 + ys.min()), _up(sx0 + xs.max() + 1), _up(sy0 + ys.max() + 1))
            assert (x0, y0, x1, y1) == expected
            narrower += x1 - x0 < _up(sx1) - _up(sx0)
    assert narrower > 0  # the sklearn digits rarely fill their square's width


def test_held_out_canvases_use_only_held_out_digits():
    train_idx, held_idx = split()
    assert not set(train_idx) & set(held_idx)
    images, boxes = digits_detection.held_out_set()
    assert 48 <= len(images) <= 64
    again, placed = digits_detection._canvases(held_idx, len(images), seed=digits_detection.SEED + 1)
    assert np.array_equal(images, again)
    used = {d[0] for per_image in placed for d in per_image}
    assert used <= set(held_idx)
    assert {b[0] for per_image in boxes for b in per_image} == set(range(1, 11))  # every digit is there


def test_coco_files_are_consistent(tmp_path):
    coco_api = pytest.importorskip("pycocotools.coco")
    images, boxes = digits_detection.make_detection_set(split()[1], 5, seed=11)
    root = tmp_path / "val"
    (root / "stale").mkdir(parents=True)
    digits_detection.write_coco(root, images, boxes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val"]  # replaced whole, no staging left behind
    assert sorted(p.name for p in root.iterdir()) == ["annotations.json", "images"]

    doc = json.loads((root / "annotations.json").read_text())
    assert [(c["id"], c["name"]) for c in doc["categories"]] == [(d + 1, str(d)) for d in range(10)]
    assert len({a["id"] for a in doc["annotations"]}) == len(doc["annotations"]) == sum(map(len, boxes))
    for entry, image, per_image in zip(doc["images"], images, boxes):
        assert (entry["width"], entry["height"]) == (SIZE, SIZE)
        png = Image.open(root / "images" / entry["file_name"])
        assert png.mode == "RGB" and np.array_equal(np.asarray(png), image)
        annotations = [a for a in doc["annotations"] if a["image_id"] == entry["id"]]
        assert [(a["category_id"], *a["bbox"]) for a in annotations] == [
            (c, x0, y0, x1 - x0, y1 - y0) for c, x0, y0, x1, y1 in per_image
        ]
        assert all(a["area"] == a["bbox"][2] * a["bbox"][3] and a["iscrowd"] == 0 for a in annotations)
    assert len(list((root / "images").iterdir())) == len(images)

    coco = coco_api.COCO(str(root / "annotations.json"))
    assert len(coco.getImgIds()) == len(images) and len(coco.getCatIds()) == 10


def test_map_of_the_ground_truth_is_perfect():
    pytest.importorskip("pycocotools")
    images, boxes = digits_detection.make_detection_set(split()[1], 4, seed=5)
    perfect = [
        {
            "boxes": torch.tensor([b[1:] for b in per_image], dtype=torch.float32),
            "scores": torch.ones(len(per_image)),
            "labels": torch.tensor([b[0] for b in per_image]),
        }
        for per_image in boxes
    ]
    assert digits_detection.coco_map(perfect, images, boxes) == pytest.approx((1.0, 1.0))
    shifted = [dict(d, boxes=d["boxes"] + 8) for d in perfect]
    assert digits_detection.coco_map(shifted, images, boxes)[0] < 1.0
