"""device_validate.py judges a handful of golden inputs: a fraction of items is held to the build's threshold
in whole items (rounded up), or to what the build's own run missed on the same inputs; it never re-judges a
ratio threshold on a sample too small to resolve it."""

from __future__ import annotations

import pytest

from exporter.device import device_validate
from exporter.device.device_validate import TASKS, breaches

CLASSIFICATION, DETECTION, SEGMENTATION = TASKS["classification"], TASKS["detection"], TASKS["segmentation"]


def _images(agreeing: int, total: int = 8, **extra) -> dict:
    return {
        "samples": total,
        "top1_agreement": agreeing / total,
        "top5_agreement": 1.0,
        "psnr_db": 40.0,
        "cosine": 0.999,
        "max_abs_error": 0.1,
        **extra,
    }


def _boxes(eager: int, artifact: int, matched: int, **extra) -> dict:
    return {
        "samples": 8,
        "eager_detections": eager,
        "artifact_detections": artifact,
        "matched_recall": matched / eager,
        "matched_precision": matched / artifact,
        "psnr_db": 45.0,
        "cosine": 0.999,
        "max_abs_error": 0.5,
        **extra,
    }


@pytest.mark.parametrize(
    "agreeing, threshold, broken",
    [
        (8, 1.0, False),
        (7, 1.0, True),  # fp32: exact, as the build asks
        (7, 0.97, False),  # one flip in 8 is what 3% allows, rounded up to a whole image
        (6, 0.97, True),
        (7, 0.99, False),
        (6, 0.99, True),
    ],
)
def test_top1_agreement_is_judged_in_whole_images(agreeing, threshold, broken):
    reasons = breaches(_images(agreeing), {"top1_agreement": threshold}, CLASSIFICATION)
    assert bool(reasons) == broken, reasons
    if broken:
        (reason,) = reasons
        allowed = 0 if threshold == 1.0 else 1
        assert reason == (
            f"top1_agreement {agreeing / 8:.4g} ({8 - agreeing} of 8 images with another top-1; "
            f"{threshold:g} allows {allowed} of 8)"
        )


def test_the_weaker_second_detector_seen_failing_on_its_bundle_now_passes():
    """What a seed-7 SSDlite showed: 3 eager boxes on the golden inputs, int8 found them all plus one more.
    0.75 < 0.85, yet 0.85 of 4 boxes allows one unmatched box; the build had passed 0.90 on 32 images."""
    metrics = _boxes(eager=3, artifact=4, matched=3)
    thresholds = {"matched_recall": 0.85, "matched_precision": 0.85}
    assert breaches(metrics, thresholds, DETECTION) == []
    # said, not hidden: so few boxes cannot resolve 0.85
    assert device_validate.unresolved(metrics, thresholds) == [
        "note: too few items to resolve matched_recall 0.85 (3 eager boxes), matched_precision 0.85 (4 artifact boxes): "
        "one miss each is let through"
    ]
    lost_two = _boxes(eager=3, artifact=2, matched=1)
    (reason,) = breaches(lost_two, {"matched_recall": 0.85, "matched_precision": 0.85}, DETECTION)
    assert reason == "matched_recall 0.3333 (2 of 3 eager boxes unmatched; 0.85 allows 1 of 3)"


def test_many_items_are_held_to_the_threshold_itself():
    pixels = 8 * 128 * 128  # 131072: 0.999 allows 132 (131.07 rounded up)
    for missed, broken in ((132, False), (133, True)):
        metrics = {
            "samples": 8,
            "pixels": pixels,
            "pixel_agreement": 1 - missed / pixels,
            "miou_vs_eager": 0.99,
            "psnr_db": 40.0,
            "cosine": 0.999,
            "max_abs_error": 0.1,
        }
        assert bool(breaches(metrics, {"pixel_agreement": 0.999}, SEGMENTATION)) == broken
        assert device_validate.unresolved(metrics, {"pixel_agreement": 0.999}) == []


def test_the_builds_own_run_on_the_same_inputs_is_honoured_and_no_more():
    """The golden rows happened to be hard: the build's own run already missed 2 of 8 (it passed on its whole
    validation set). A device that misses the same 2 reproduces the build; a third miss is the device's."""
    host = _images(6)
    assert breaches(_images(6), {"top1_agreement": 0.97}, CLASSIFICATION, host) == []
    (reason,) = breaches(_images(5), {"top1_agreement": 0.97}, CLASSIFICATION, host)
    assert reason.endswith("(3 of 8 images with another top-1; 0.97 allows 1 of 8, the build's own run 2)"), reason
    # a perfect build run leaves only the threshold's whole-item allowance
    assert breaches(_images(6), {"top1_agreement": 0.97}, CLASSIFICATION, _images(8))


def test_precision_counts_each_sides_own_boxes():
    host = _boxes(eager=10, artifact=12, matched=10)  # the build's run found 2 extra boxes
    device = _boxes(eager=10, artifact=13, matched=10)  # the device 3: one more than the build
    thresholds = {"matched_precision": 0.95}  # allows 1 of 13
    (reason,) = breaches(device, thresholds, DETECTION, host)
    assert "3 of 13 artifact boxes unmatched" in reason and "the build's own run 2" in reason
    assert breaches(_boxes(eager=10, artifact=12, matched=10), thresholds, DETECTION, host) == []


def test_continuous_keys_take_the_weaker_of_threshold_and_the_builds_run():
    thresholds = {"psnr_db": 30.0, "max_abs_error": 1.0}
    host = _images(8, psnr_db=28.0, max_abs_error=1.5)  # these 8 inputs were worse than the whole set
    assert breaches(_images(8, psnr_db=28.0, max_abs_error=1.5), thresholds, CLASSIFICATION, host) == []
    assert breaches(_images(8, psnr_db=27.9, max_abs_error=1.6), thresholds, CLASSIFICATION, host) == [
        "psnr_db 27.9 (needs >= 28)",
        "max_abs_error 1.6 (needs <= 1.5)",
    ]
    # a build run better than the thresholds does not tighten them
    assert breaches(_images(8, psnr_db=30.5), thresholds, CLASSIFICATION, _images(8, psnr_db=45.0)) == []
    # as the manifest writes an infinite PSNR
    assert breaches(_images(8, psnr_db=29.0), thresholds, CLASSIFICATION, {"psnr_db": "inf"}) == [
        "psnr_db 29 (needs >= 30)"
    ]


def test_the_items_each_fraction_counts_are_in_the_metrics_the_kit_computes():
    """ITEMS names, per fraction, the metrics key that counts its items: each task's fidelity carries it."""
    import numpy as np

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 3, 5, 6))
    by_task = {
        "classification": device_validate.fidelity(logits[:, :, 0, 0], logits[:, :, 0, 0]),
        "segmentation": device_validate.segmentation_fidelity(logits, logits),
    }
    for task, metrics in by_task.items():
        for key in TASKS[task].min_keys:
            if key in device_validate.ITEMS:
                assert device_validate.ITEMS[key].count in metrics, (task, key)
    assert by_task["segmentation"]["pixels"] == 4 * 5 * 6


def test_golden_rows_are_where_a_device_shows_first():
    """Classification writes its closest calls to golden/ (confident images agree under almost any error);
    detection the images with the most boxes an app would show; segmentation, with pixels to spare, the first."""
    import torch

    from exporter import weights

    classifier = weights.bind_task(weights.resolve("MobileNet_V3_Small_Weights.IMAGENET1K_V1"), 3)
    logits = torch.tensor([[9.0, 0.0, 0.0], [1.0, 0.9, 0.0], [5.0, 4.0, 0.0], [0.0, 0.0, 8.0], [2.0, 2.0, 2.0]])
    assert classifier.golden_rows(logits, 3) == [1, 2, 4]
    assert classifier.golden_rows(logits, 8) == [0, 1, 2, 3, 4]

    detector = weights.bind_task(weights.resolve("SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"), 3)
    anchors = len(detector.anchors)
    heads = torch.zeros(4, anchors, 4 + 3)
    heads[..., 4] = 10.0  # background everywhere
    for image, objects in ((1, 3), (3, 1)):  # anchors far apart: NMS keeps each
        for k in range(objects):
            heads[image, k * (anchors // 4), 4:] = torch.tensor([0.0, 10.0, 0.0])
    assert detector.golden_rows(heads.reshape(4, -1), 2) == [1, 3]

    segmenter = weights.bind_task(
        weights.resolve("LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1"), 3, (8, 8)
    )
    assert segmenter.golden_rows(torch.zeros(12, 3 * 8 * 8), 8) == list(range(8))


def test_outputs_that_are_not_finite_break_the_device_check():
    """A NaN compares false with every limit: a device whose fp16 run overflowed must not read PASSED."""
    import numpy as np

    ref = np.random.default_rng(0).normal(size=(8, 10)).astype(np.float32)
    out = ref.copy()
    out[2, 3] = np.nan
    metrics = device_validate.fidelity(ref, out)
    assert breaches(metrics, {"psnr_db": 30.0}, CLASSIFICATION) == ["psnr_db nan (needs >= 30)"]
    out[2, 3] = np.inf
    assert breaches(device_validate.fidelity(ref, out), {"psnr_db": 30.0}, CLASSIFICATION)


def test_an_all_zero_reference_is_judged_not_a_crash():
    """PSNR's peak is 0 when eager's golden outputs are all zero (a zero-initialised head): the kit reads -inf
    for an artifact that is not zero too, as the build does, and inf when it is."""
    import numpy as np

    ref = np.zeros((8, 10), dtype=np.float32)
    assert device_validate.fidelity(ref, ref)["psnr_db"] == float("inf")
    off = device_validate.fidelity(ref, ref + 0.5)
    assert off["psnr_db"] == float("-inf")
    assert breaches(off, {"psnr_db": 30.0}, CLASSIFICATION) == ["psnr_db -inf (needs >= 30)"]
