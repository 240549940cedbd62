"""The segmentation digits' canvases and VOC writer (the training itself is exercised by whoever prepares it)."""

import numpy as np
import pytest
from PIL import Image

from exporter.standins import segmentation as ds


@pytest.fixture(scope="module")
def canvases():
    _, held_out = ds.split()
    return held_out, ds.make_canvases(held_out, 12, 64, seed=3, with_boxes=True)


def test_split_is_fixed_and_disjoint():
    train, held_out = ds.split()
    assert len(train) + len(held_out) == 1797 and not set(train) & set(held_out)
    assert np.array_equal(held_out, ds.split()[1])


def test_canvases_are_deterministic_and_shaped():
    a = ds.make_canvases(ds.split()[0], 4, 64, seed=7)
    b = ds.make_canvases(ds.split()[0], 4, 64, seed=7)
    images, masks = a
    assert images.shape == (4, 64, 64, 3) and images.dtype == np.uint8
    assert masks.shape == (4, 64, 64) and masks.dtype == np.uint8
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_masks_agree_with_boxes(canvases):
    held_out, (images, masks, boxes) = canvases
    targets = ds._digits()[1]
    for mask, placed in zip(masks, boxes):
        assert 1 <= len(placed) <= 3
        outside = np.ones(mask.shape, bool)
        for index, label, x0, y0, x1, y1 in placed:
            assert index in held_out  # held-out canvases are built from held-out digits only
            assert label == targets[index] + 1
            region = mask[y0:y1, x0:x1]
            assert (region == label).any()
            assert set(np.unique(region)) <= {0, label, ds.IGNORE}
            outside[y0:y1, x0:x1] = False
        assert (mask[outside] == 0).all()


def test_voc_writer_layout(tmp_path, canvases):
    _, (images, masks, _) = canvases
    root = tmp_path / "val"
    ds.write_voc(root, images[:4], masks[:4])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val"]  # no staging left behind
    stems = sorted(p.stem for p in (root / "images").glob("*.png"))
    assert stems == sorted(p.stem for p in (root / "masks").glob("*.png")) and len(stems) == 4
    modes = []
    for i, stem in enumerate(stems):
        image = Image.open(root / "images" / f"{stem}.png")
        mask = Image.open(root / "masks" / f"{stem}.png")
        modes.append(mask.mode)
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), images[i])
        assert np.array_equal(np.asarray(mask), masks[i])  # class indices (and 255) survive either mode
    assert set(modes) == {"P", "L"}
    ds.write_voc(root, images[:2], masks[:2])  # rewriting replaces the set
    assert len(list((root / "masks").glob("*.png"))) == 2


def test_miou_and_pixel_accuracy():
    target = np.array([[0, 0, 1, 1], [0, 255, 2, 2]])
    assert ds.mask_scores(target, target) == (1.0, 1.0)
    pred = np.array([[0, 0, 1, 2], [0, 7, 2, 2]])  # the ignored pixel's prediction does not count
    # class 0: 3/3, class 1: 1/2, class 2: 2/3
    assert ds.mask_scores(pred, target) == pytest.approx(((1 + 0.5 + 2 / 3) / 3, 6 / 7))
