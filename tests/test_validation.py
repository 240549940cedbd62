"""The metric formulas, checked against values worked out by hand."""

import math

import pytest
import torch

from exporter import validation
from exporter.tasks import Segmentation, classification
from exporter.tasks.segmentation import confusion, miou
from exporter.thresholds import breaches


def test_identical_outputs_are_perfect():
    ref = torch.randn(50, 10, generator=torch.Generator().manual_seed(0))
    f = classification.fidelity(ref, ref.clone())
    assert f["top1_agreement"] == 1.0 and f["top5_agreement"] == 1.0
    assert f["psnr_db"] == math.inf and f["max_abs_error"] == 0.0
    assert f["cosine"] == pytest.approx(1.0)


def test_psnr_matches_definition():
    ref = torch.tensor([[4.0, -2.0, 1.0, 0.0]])
    out = ref + torch.tensor([[0.1, -0.1, 0.1, -0.1]])
    # RMSE = 0.1, max|ref| = 4  ->  20 log10(40)
    assert classification.fidelity(ref, out)["psnr_db"] == pytest.approx(20 * math.log10(40))


def test_agreement_counts_flipped_predictions():
    ref = torch.eye(6) * 5
    out = ref.clone()
    out[0] = torch.tensor([0.0, 6, 0, 0, 0, 0])  # top-1 flips, eager class still in top-5
    out[1] = torch.tensor([0.0, -1, -1, -1, -1, -1])  # eager class (1) is last: outside top-5
    f = classification.fidelity(ref, out)
    assert f["top1_agreement"] == pytest.approx(4 / 6)
    assert f["top5_agreement"] == pytest.approx(5 / 6)


def test_accuracy_and_drop():
    logits = torch.tensor([[3.0, 1, 0], [0, 3, 1], [0, 1, 3], [3, 0, 1]])
    labels = torch.tensor([0, 1, 2, 2])
    acc = classification.accuracy(logits, labels)
    assert acc["acc1"] == pytest.approx(75.0)
    drop = classification.accuracy_vs_eager({"acc1": 80.0, "acc5": 100.0}, acc)
    assert drop["drop_points"] == pytest.approx(5.0)


def test_breaches_respect_direction_and_missing_metrics():
    metrics = {"fidelity": {"top1_agreement": 0.95, "psnr_db": 45.0}, "accuracy": None}
    reasons = breaches(metrics, {"top1_agreement": 0.97, "psnr_db": 30.0, "accuracy_drop": 1.0})
    assert len(reasons) == 1 and reasons[0].startswith("top1_agreement 0.95")
    assert breaches({"accuracy": {"drop_points": 1.5}}, {"accuracy_drop": 1.0})


def test_latency_is_measured_for_every_runner():
    slow = lambda x: (torch.mm(x, x), x)[1]  # noqa: E731
    fast = lambda x: x  # noqa: E731
    x = torch.randn(256, 256)
    result = validation.measure_latency({"slow": slow, "fast": fast}, x, warmup=1, iterations=20)
    assert result["slow"]["iterations"] == result["fast"]["iterations"] == 20
    assert result["fast"]["p50"] < result["slow"]["p50"]
    for r in result.values():
        assert r["p50"] <= r["p90"] <= r["p99"]


def _pixel_logits(masks: torch.Tensor, classes: int) -> torch.Tensor:
    """One flattened row of per-pixel logits per image whose argmax is `masks`."""
    return torch.nn.functional.one_hot(masks.long(), classes).permute(0, 3, 1, 2).float().reshape(len(masks), -1)


def test_miou_by_hand():
    target = torch.tensor([0, 0, 1, 1, 2, 255])
    pred = torch.tensor([0, 1, 1, 1, 0, 2])  # the ignored pixel does not count
    conf = confusion(pred, target, 3)
    assert conf.sum() == 5 and conf[0, 0] == 1 and conf[0, 1] == 1 and conf[2, 0] == 1
    # IoU: class 0 = 1/3, class 1 = 2/3, class 2 = 0/1
    assert miou(conf) == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)
    # a class absent from both target and prediction does not count
    assert miou(confusion(torch.tensor([0, 1]), torch.tensor([0, 1]), 5)) == 1.0


def test_segmentation_fidelity_and_labeled_metrics():
    task = Segmentation(num_classes=3, input_size=(2, 3))
    eager_masks = torch.tensor([[[0, 0, 1], [1, 2, 2]]])
    artifact_masks = torch.tensor([[[0, 0, 1], [1, 2, 1]]])  # one pixel of six flips 2 -> 1
    f = task.fidelity(_pixel_logits(eager_masks, 3), _pixel_logits(artifact_masks, 3))
    assert f["pixel_agreement"] == pytest.approx(5 / 6)
    assert f["miou_vs_eager"] == pytest.approx((1 + 2 / 3 + 1 / 2) / 3)
    labels = torch.tensor([[0, 0, 1, 1, 2, 255]])
    eager, artifact = task.labeled(_pixel_logits(eager_masks, 3), labels), task.labeled(_pixel_logits(artifact_masks, 3), labels)
    assert eager["pixel_acc"] == pytest.approx(100.0) and eager["miou"] == pytest.approx(100.0)
    assert artifact["pixel_acc"] == pytest.approx(100.0)  # the flipped pixel is ignored in the labels
    worse = task.labeled(_pixel_logits(torch.tensor([[[0, 1, 1], [1, 2, 2]]]), 3), labels)
    assert worse["pixel_acc"] == pytest.approx(80.0)
    drop = task.vs_eager(eager, worse)
    assert drop["miou_drop_points"] == pytest.approx(100.0 - 100.0 * (1 / 2 + 2 / 3 + 1) / 3)
    metrics = task.quality(_pixel_logits(artifact_masks, 3), _pixel_logits(eager_masks, 3), None, None,
                           {"pixel_agreement": 0.9, "psnr_db": 10.0})
    assert metrics["reasons"] and metrics["reasons"][0].startswith("pixel_agreement 0.833")
