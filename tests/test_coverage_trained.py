"""The sweep's trained tier (`exporter coverage --weights digits`, exporter.coverage.trained): classifiers
trained on the digits, built and judged on held-out labels."""

from __future__ import annotations

import json
import shutil

from .helpers import CACHE, run_cli


def test_the_trained_tier_judges_int8_on_labeled_digits(quantized_digits, tmp_path):
    """--weights digits: the classifier trained on the digits (the stand-ins' own training, cached, handed to the
    sweep's cache as the sweep would have left it) gets its int8 .pte judged on held-out labels; a task with no
    digits recipe is skipped, saying why; the table goes to its own file."""
    cache = tmp_path / "cache"
    (cache / "digits").mkdir(parents=True)
    shutil.copy(CACHE / "digits_shufflenet_v2_x0_5.json", cache / "digits")
    result = run_cli(
        "coverage",
        "--weights",
        "digits",
        "--models",
        "shufflenet_v2_x0_5,lraspp_mobilenet_v3_large",
        "--one-per-builder",
        "--target",
        "android",
        "--format",
        "executorch:int8",
        "--out",
        tmp_path / "out",
        env={"EXPORTER_CACHE": str(cache)},
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "coverage-digits.json").read_text())
    assert not (tmp_path / "out" / "coverage.json").exists()
    rows = {r["model"]: r for r in doc["rows"]}
    assert rows["lraspp_mobilenet_v3_large"]["outcome"] == "skipped"
    assert "no digits recipe for segmentation" in rows["lraspp_mobilenet_v3_large"]["reason"]
    row = rows["shufflenet_v2_x0_5"]
    assert row["checkpoint"]["recipe"] == "digits" and row["checkpoint"]["held_out_acc1"] > 90
    assert row["checkpoint"]["until_train_acc1"] == 95 and row["checkpoint"]["epochs_trained"] >= 4  # checked, said
    (cell,) = row["cells"]
    accuracy = cell["accuracy"]
    assert accuracy["eager_acc1"] > 90, accuracy  # a trained reference, judged on real labels
    # which range method won and whether the budget held on the check images: what a row is read for later
    q = cell["quantization"]
    assert q["ranges"] in ("histogram", "dynamic") and isinstance(q["meets_budget"], bool), q
    # judged on the labels, the verdict follows them: a pass within the budget, or a failure whose kind says whose it
    # is (the stand-in is trained on the host: one trained on an AMD EPYC without AVX-512 lost 3 of 172 digits at
    # int8, and eager rounded to int8 lost as much: "ill-conditioned reference")
    assert (cell["outcome"] == "passed") == (accuracy["drop_points"] <= 1.0 and not cell["reasons"]), cell
    if cell["outcome"] != "passed":
        assert cell["kind"] in ("validation", "ill-conditioned reference") and row["floor"], cell
    text = (tmp_path / "out" / "coverage-digits.md").read_text()
    assert "trained from scratch on scikit-learn's digits" in text and f"acc@1 {accuracy['acc1']:.1f}" in text


def test_the_trained_tier_trains_and_builds_a_classifier_at_the_size_asked(tmp_path):
    """--weights digits --classifier-size N: the architecture is trained on digits preprocessed at N x N (the resize
    scaled with the crop, as the build scales it), built at that size and judged on held-out labels at it; the row
    and the table name the size."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    result = run_cli(
        "coverage",
        "--weights",
        "digits",
        "--classifier-size",
        "64",
        "--models",
        "shufflenet_v2_x0_5",
        "--one-per-builder",
        "--target",
        "jetson",
        "--format",
        "onnx:fp32",
        "--out",
        out,
        env={"EXPORTER_CACHE": str(cache)},
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads((out / "coverage-digits.json").read_text())["rows"]
    assert row["input_size"] == row["classifier_size"] == [64, 64]
    assert row["checkpoint"]["held_out_acc1"] > 80  # learned at 64 px, not a model of 224 px run small
    assert json.loads((cache / "digits" / "digits_shufflenet_v2_x0_5_64px.json").read_text())["checkpoint"].endswith(
        ".pth"
    )  # cached apart from the model trained at the weight's crop
    (cell,) = row["cells"]
    assert cell["accuracy"]["eager_acc1"] > 80 and cell["outcome"] == "passed", cell
    text = (out / "coverage-digits.md").read_text()
    assert "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V1 (64×64)" in text and "or at the size their row names" in text
