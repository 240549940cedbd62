"""Several targets in one build share one model load, one calibration set and one eager run."""

import json

from .conftest import FAST, run_cli


def test_two_targets_share_one_eager_reference(tmp_path, digits_model):
    out = tmp_path / "multi"
    result = run_cli(
        "build", digits_model.weight, "--checkpoint", digits_model.checkpoint, "--data", digits_model.data_dir,
        "--out", out, "--target", "android", "--target", "jetson",
        "--format", "torchscript_lite", "--format", "onnx:fp32", "--quiet", *FAST,
    )
    assert result.exit_code == 0, result.output
    android, jetson = (json.loads((out / t / "manifest.json").read_text()) for t in ("android", "jetson"))
    assert [a["name"] for a in android["artifacts"]] == ["torchscript_lite_fp32"]
    assert [a["name"] for a in jetson["artifacts"]] == ["onnx_fp32"]
    # one eager run: the same timing entry and the same reference accuracy in both manifests
    assert android["timings_s"]["eager reference"] == jetson["timings_s"]["eager reference"]
    assert android["eager"] == jetson["eager"] and android["data"] == jetson["data"]
    assert not any(k.startswith("jetson: ") for k in android["timings_s"])
    page = (out / "report.html").read_text()
    assert "android/torchscript_lite_fp32" in page and "jetson/onnx_fp32" in page


def test_all_expands_to_every_target(tmp_path, digits_model):
    from exporter.build import expand_targets

    assert expand_targets(["all"]) == ["android", "ios", "jetson"]
    result = run_cli("build", digits_model.weight, "--checkpoint", digits_model.checkpoint, "--out", tmp_path / "o",
                     "--target", "all", "--format", "executorch:int4")
    assert result.exit_code == 2 and "matches nothing in target" in result.stderr
