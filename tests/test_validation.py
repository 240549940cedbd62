"""The metric formulas, checked against values worked out by hand."""

import dataclasses
import math

import pytest
import torch

from exporter import validation
from exporter.results import ArtifactResult, Kind, Reason
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


def test_an_error_on_an_all_zero_reference_is_minus_infinity_db():
    zeros = torch.zeros(4, 10)
    assert classification.fidelity(zeros, zeros + 1e-6)["psnr_db"] == -math.inf
    assert classification.fidelity(zeros, zeros.clone())["psnr_db"] == math.inf


def test_one_validation_input_cannot_show_a_degenerate_reference_and_says_so():
    task = classification.Classification(10, (8, 8))
    reason = validation.blind_spot(task, torch.randn(1, 10), {"psnr_db": 30.0})
    assert reason and "on 1 validation input" in reason and "degenerate" not in reason


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
    assert len(reasons) == 1 and reasons[0].text.startswith("top1_agreement 0.95")
    assert (reasons[0].kind, reasons[0].metric, reasons[0].value, reasons[0].limit) == (
        Kind.THRESHOLD,
        "top1_agreement",
        0.95,
        0.97,
    )
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
    eager, artifact = (
        task.labeled(_pixel_logits(eager_masks, 3), labels),
        task.labeled(_pixel_logits(artifact_masks, 3), labels),
    )
    assert eager["pixel_acc"] == pytest.approx(100.0) and eager["miou"] == pytest.approx(100.0)
    assert artifact["pixel_acc"] == pytest.approx(100.0)  # the flipped pixel is ignored in the labels
    worse = task.labeled(_pixel_logits(torch.tensor([[[0, 1, 1], [1, 2, 2]]]), 3), labels)
    assert worse["pixel_acc"] == pytest.approx(80.0)
    drop = task.vs_eager(eager, worse)
    assert drop["miou_drop_points"] == pytest.approx(100.0 - 100.0 * (1 / 2 + 2 / 3 + 1) / 3)
    metrics = task.quality(
        _pixel_logits(artifact_masks, 3),
        _pixel_logits(eager_masks, 3),
        None,
        None,
        {"pixel_agreement": 0.9, "psnr_db": 10.0},
    )
    assert metrics["reasons"] and metrics["reasons"][0].text.startswith("pixel_agreement 0.833")
    assert metrics["reasons"][0].metric == "pixel_agreement"


def test_a_constant_reference_cannot_pass_anything():
    """ViT's zero-initialised head: every logit 0, so any artifact 'matches' it at infinite dB."""
    task = classification.Classification(num_classes=10, input_size=(8, 8))
    zeros = torch.zeros(8, 10)
    reason = validation.blind_spot(task, zeros, {"top1_agreement": 1.0, "psnr_db": 60.0})
    assert reason and "degenerate eager reference" in reason
    metrics, _ = validation.evaluate(
        validation.EagerReference(task, None, torch.zeros(8, 3, 8, 8), zeros, warmup=0, iterations=1),
        lambda x: torch.zeros(1, 10),
        {"top1_agreement": 1.0, "psnr_db": 60.0},
        timed=False,
    )
    assert metrics["status"] == "failed" and metrics["reasons"] == [Reason(Kind.DEGENERATE_REFERENCE, reason)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_outputs_that_are_not_finite_fail_saying_so_and_the_manifest_still_writes(bad):
    """An fp16 graph that overflows gives inf or NaN: a NaN compares false with every limit, so thresholds alone
    passed it, and JSON could not hold its PSNR, after the whole build had run (an inf crashed the PSNR)."""
    import json

    import jsonschema

    from exporter.release import manifest
    from exporter.tasks import OpticalFlow

    reference = torch.randn(8, 10, generator=torch.Generator().manual_seed(0)) * 5
    outputs = reference.clone()
    outputs[3, reference[3].argmin()] = bad
    task = classification.Classification(num_classes=10, input_size=(8, 8))
    metrics = validation.judge(task, outputs, reference, None, None, {"top1_agreement": 0.5, "psnr_db": 30.0})
    assert metrics["status"] == "failed" and metrics["reasons"][0].text.startswith("outputs not finite: 1 of 80 values")
    assert metrics["reasons"][0].kind is Kind.NON_FINITE
    assert metrics["fidelity"]["psnr_db"] is None and metrics["fidelity"]["cosine"] is None
    fidelity = json.loads(manifest.dumps(metrics))["fidelity"]
    jsonschema.validate(fidelity, {"$defs": manifest.schema()["$defs"], "$ref": "#/$defs/fidelity"})
    flow = OpticalFlow(2, (4, 4))
    reference = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    outputs = reference.clone()
    outputs[0, :3] = bad
    metrics = validation.judge(
        flow,
        outputs,
        reference,
        reference,
        {"epe": 0.0, "fl_all": 0.0},
        {"flow_agreement": 0.5, "epe_vs_eager": 1.0, "epe_increase": 1.0},
    )
    assert metrics["status"] == "failed" and metrics["fidelity"]["epe_vs_eager"] is None, metrics
    assert breaches({"fidelity": {"psnr_db": float("nan")}}, {"psnr_db": 30.0}) == [
        Reason(Kind.THRESHOLD, "psnr_db nan (needs >= 30)", metric="psnr_db", value=None, limit=30.0)
    ]


def test_a_near_constant_reference_is_caught_at_the_thresholds_it_cannot_resolve():
    """Outputs that vary by 1e-4 of their size: a 30 dB int8 threshold cannot tell an input-blind artifact
    from a good one; a 100 dB one can."""
    task = classification.Classification(num_classes=10, input_size=(8, 8))
    base = torch.linspace(-3, 3, 10)
    reference = base + 1e-4 * torch.randn(16, 10, generator=torch.Generator().manual_seed(0))
    assert validation.blind_spot(task, reference, {"psnr_db": 30.0}) is not None
    assert validation.blind_spot(task, reference, {"psnr_db": 100.0}) is None
    assert validation.blind_spot(task, reference, {"accuracy_drop": 1.0}) is None  # no fidelity threshold to fool
    # thresholds set to pass anything (as a byte-reproducibility test does) flag only a reference that barely varies
    varied = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
    assert validation.blind_spot(task, varied, {"top1_agreement": 0.0, "psnr_db": 0.0}) is None
    assert validation.blind_spot(task, reference, {"top1_agreement": 0.0, "psnr_db": 0.0}) is not None


def test_a_trained_reference_is_judgeable(digits_model):
    """The trained digits model's eager logits on its held-out images: a constant artifact breaks every
    target's thresholds, so the check never flags a real model."""
    from exporter import weights

    loaded = weights.load(digits_model.weight, digits_model.checkpoint, verify=False)
    task = weights.bind_task(loaded.weights, loaded.num_classes)
    images = task.load_data(digits_model.data_dir, task.transform(loaded.weights), 0, 32, 0).validation
    reference = validation.run_all(loaded.eager, images)
    for thresholds in (
        {"top1_agreement": 1.0, "psnr_db": 60.0},
        {"top1_agreement": 0.97, "psnr_db": 30.0},
        {"psnr_db": 20.0},
    ):
        assert validation.blind_spot(task, reference, thresholds) is None, thresholds


def test_a_build_on_a_zero_initialised_head_fails_saying_why(tmp_path):
    """As ViT ships its head (all zeros) with random weights: the build must not report a pass at inf dB."""
    from torchvision.models import get_model

    from tests.helpers import run_cli

    model = get_model("mobilenet_v3_small", weights=None, num_classes=10)
    torch.nn.init.zeros_(model.classifier[-1].weight)
    torch.nn.init.zeros_(model.classifier[-1].bias)
    checkpoint = tmp_path / "zero_head.pth"
    torch.save(model.state_dict(), checkpoint)
    out = tmp_path / "build"
    result = run_cli(
        "build",
        "MobileNet_V3_Small_Weights.IMAGENET1K_V1",
        "--checkpoint",
        checkpoint,
        "--no-verify",
        "--target",
        "jetson",
        "--format",
        "onnx:fp32",
        "--calib-size",
        "4",
        "--val-size",
        "8",
        "--warmup",
        "1",
        "--iterations",
        "2",
        "--out",
        out,
        "--quiet",
        "--no-cache",
    )
    assert result.exit_code == 1, result.output
    import json

    (entry,) = json.loads((out / "manifest.json").read_text())["artifacts"]
    assert entry["status"] == "failed" and entry["fidelity"]["psnr_db"] == "inf"  # a perfect match, on nothing
    assert any(
        r["kind"] == "degenerate_reference" and "degenerate eager reference" in r["text"] for r in entry["reasons"]
    ), entry["reasons"]


def test_a_few_inputs_past_the_calibration_ranges_are_named_and_the_rest_judged(digits_model):
    """Inputs made to break a static int8 artifact: three held-out digits at 8x contrast drive the trained model's
    logits far past those of the calibration digits, and an artifact whose output range was set on those (clipped
    and rounded to 8 bits, as a static int8 output is) fails PSNR on them alone. The report names those three and
    says the rest meet the thresholds; the same squared error spread over every input names none."""
    from exporter import weights
    from exporter.release.report import outliers_summary

    loaded = weights.load(digits_model.weight, digits_model.checkpoint, verify=False)
    task = weights.bind_task(loaded.weights, loaded.num_classes)
    inputs = task.load_data(digits_model.data_dir, task.transform(loaded.weights), 32, 64, 0)
    images = inputs.validation.clone()
    bright = [5, 23, 41]
    images[bright] *= 8
    reference = validation.run_all(loaded.eager, images)
    calibrated = validation.run_all(loaded.eager, torch.cat(inputs.calibration))
    low, high = calibrated.min().item(), calibrated.max().item()
    assert reference[bright].abs().max() > 2 * max(-low, high)  # the premise: past the calibration's range
    step = (high - low) / 255
    outputs = ((reference.clamp(low, high) - low) / step).round() * step + low
    thresholds = {"top1_agreement": 0.97, "psnr_db": 30.0}
    judged = validation.judge(task, outputs, reference, None, None, thresholds)
    assert judged["status"] == "failed" and any(r.metric == "psnr_db" for r in judged["reasons"])
    outliers, clipped = judged["outlier_inputs"], ((reference < low) | (reference > high)).any(1)
    assert set(bright) <= set(outliers["rows"]) and all(
        clipped[r] for r in outliers["rows"]
    )  # others: clipped a little
    assert outliers["of"] == 64 and outliers["error_share"] > 0.9 and outliers["thresholds_met_without"]
    assert outliers["fidelity_without"]["samples"] == 64 - len(outliers["rows"])
    assert outliers["rms_over_median"]["max"] > validation.OUTLIER_RATIO and outliers["peak_over_median"] > 2
    failed = ArtifactResult("executorch_int8", "executorch", "int8", thresholds=thresholds, outlier_inputs=outliers)
    line = outliers_summary(failed)
    count = len(outliers["rows"])
    assert line.startswith(f"{count} of 64 validation inputs carry") and f"the other {64 - count} meet the" in line
    assert "calibration" in line  # eager's outputs on them peak far past the median input's: the likely cause named
    dynamic = dataclasses.replace(failed, details={"quantization": {"after": {"ranges": "dynamic"}}})
    assert "calibration" not in outliers_summary(dynamic)  # ranges chosen per inference clip nothing

    spread = reference + torch.randn(reference.shape, generator=torch.Generator().manual_seed(0)) * (
        (outputs - reference).pow(2).mean().sqrt()
    )
    judged = validation.judge(task, spread, reference, None, None, thresholds)
    assert judged["status"] == "failed" and "outlier_inputs" not in judged
    passed = validation.judge(task, reference.clone(), reference, None, None, thresholds)
    assert passed["status"] == "passed" and "outlier_inputs" not in passed

    exact_but_two = reference.clone()
    exact_but_two[[7, 30]] += 5.0  # most inputs exact: the median error is 0, and the two are still named
    judged = validation.judge(task, exact_but_two, reference, None, None, {"psnr_db": 80.0})
    assert (
        judged["status"] == "failed"
        and sorted(judged["outlier_inputs"]["rows"]) == [7, 30]
        and judged["outlier_inputs"]["thresholds_met_without"]
    )
    flipped, labels = reference.clone(), reference.argmax(1)
    for row in (7, 30):
        flipped[row, (labels[row] + 1) % reference.shape[1]] = reference[row].max() + 1
    judged = validation.judge(task, flipped, reference, labels, task.labeled(reference, labels), {"accuracy_drop": 0.5})
    assert judged["status"] == "failed" and "outlier_inputs" not in judged  # only labels judged: not a fidelity failure
