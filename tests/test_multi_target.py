"""Several targets in one build share one model load, one calibration set and one eager run."""

import json

from exporter.engine.profiles import PROFILE_DIR

from .helpers import FAST, run_cli


def test_two_targets_share_one_eager_reference(tmp_path, digits_model):
    out = tmp_path / "multi"
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        digits_model.checkpoint,
        "--data",
        digits_model.data_dir,
        "--out",
        out,
        "--target",
        "android",
        "--target",
        "jetson",
        "--format",
        "torchscript_lite",
        "--format",
        "onnx:fp32",
        "--quiet",
        *FAST,
    )
    assert result.exit_code == 0, result.output
    android, jetson = (json.loads((out / t / "manifest.json").read_text()) for t in ("android", "jetson"))
    assert [a["name"] for a in android["artifacts"]] == ["torchscript_lite_fp32"]
    assert [a["name"] for a in jetson["artifacts"]] == ["onnx_fp32"]
    # one eager run: the same timing entry and the same reference accuracy in both manifests
    assert android["timings_s"]["eager reference"] == jetson["timings_s"]["eager reference"]
    assert android["data"] == jetson["data"]
    # one eager baseline: the same timed runs in both; `build` is its spread over each target's own rows' rounds
    shared = [{k: v for k, v in doc["eager"].items() if k != "latency"} for doc in (android, jetson)]
    assert shared[0] == shared[1]
    baselines = [{k: v for k, v in doc["eager"]["latency"].items() if k != "build"} for doc in (android, jetson)]
    assert baselines[0] == baselines[1]
    assert not any(k.startswith("jetson: ") for k in android["timings_s"])
    page = (out / "report.html").read_text()
    assert "android/torchscript_lite_fp32" in page and "jetson/onnx_fp32" in page


def test_all_expands_to_every_target(tmp_path, digits_model):
    from exporter.build import expand_targets

    assert expand_targets(["all"]) == ["android", "ios", "jetson"]
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        digits_model.checkpoint,
        "--out",
        tmp_path / "o",
        "--target",
        "all",
        "--format",
        "executorch:int4",
    )
    assert result.exit_code == 2 and "matches nothing in target" in result.stderr


def _matrix(*args):
    result = run_cli("matrix", *args)
    return result, (json.loads(result.stdout)["include"] if result.exit_code == 0 else None)


def test_matrix_lists_each_pair_once_and_takes_all():
    result, include = _matrix(
        "--weight",
        "resnet18",
        "--weight",
        "ResNet18_Weights.IMAGENET1K_V1",
        "--target",
        "android",
        "--target",
        "android",
        "--target",
        PROFILE_DIR / "android.toml",
    )
    assert include == [{"weight": "ResNet18_Weights.IMAGENET1K_V1", "target": "android"}], result.output
    _, include = _matrix("--weight", "resnet18", "--target", "all")
    assert [job["target"] for job in include] == ["android", "ios", "jetson"]


def test_matrix_leaves_out_what_build_refuses_saying_why():
    """The jobs build would refuse with exit 2: a two-stage detector off Jetson, a torchvision int8 weight off
    Android; a weight no target takes (Mask R-CNN) refuses the matrix as it refuses a build."""
    result, include = _matrix("--weight", "fasterrcnn_mobilenet_v3_large_320_fpn")
    assert [job["target"] for job in include] == ["jetson"], result.output
    assert "left out: FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1 on android: executorch:" in result.stderr
    result, include = _matrix("--weight", "quantized_mobilenet_v3_large")
    assert [job["target"] for job in include] == ["android"], result.output
    result, _ = _matrix("--weight", "maskrcnn_resnet50_fpn", "--target", "jetson")
    assert result.exit_code == 2 and "maskrcnn_resnet50_fpn cannot be exported yet" in result.stderr
    result, _ = _matrix("--weight", "raft_small", "--target", "ios")
    assert result.exit_code == 2 and "no weight in the matrix makes an artifact" in result.stderr
