"""Faster R-CNN on its own route (exporter.tasks.region_detection): the TorchScript-based ONNX exporter at batch 1,
the final detections made inside the graph, validated against eager on a Faster R-CNN MobileNetV3-Large-320-FPN
trained on digit canvases (exporter.standins.detection.FASTER_RCNN), checked again by the Jetson device kit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest

from exporter.device import detection_decode
from exporter.standins import detection as digits_detection
from exporter.thresholds import breaches

from .helpers import CACHE, assert_clean_refusal, assert_device_reproduces_the_build, run_cli

pytestmark = pytest.mark.slow

FAST = ["--calib-size", "16", "--val-size", "24", "--warmup", "1", "--iterations", "5"]


def test_final_rows_drop_only_the_padding():
    rows = np.zeros((5, 6), dtype=np.float32)
    rows[0] = (1, 2, 30, 40, 0.9, 3)
    rows[1] = (5, 6, 7, 8, 0.02, 10)  # a real detection, however low its score
    decoded = detection_decode.decode(rows, None, (64, 64), {"kind": "final"})
    assert decoded["labels"].tolist() == [3, 10]
    assert np.allclose(decoded["boxes"], rows[:2, :4]) and np.allclose(decoded["scores"], [0.9, 0.02])
    assert len(detection_decode.decode(np.zeros((5, 6)), None, (64, 64), {"kind": "final"})["boxes"]) == 0


@pytest.fixture(scope="session")
def faster_rcnn() -> digits_detection.DetectionDigitsModel:
    return digits_detection.prepare(CACHE, recipe=digits_detection.FASTER_RCNN)


def args(model, out, *extra):
    return [
        "build",
        model.weight,
        "--checkpoint",
        model.checkpoint,
        "--data",
        model.data_dir,
        "--labels",
        model.labels_file,
        "--input-size",
        model.size,
        model.size,
        "--out",
        out,
        "--quiet",
        *FAST,
        *extra,
    ]


@pytest.fixture(scope="module")
def jetson(tmp_path_factory, faster_rcnn):
    out = tmp_path_factory.mktemp("frcnn") / "build"
    result = run_cli(*args(faster_rcnn, out, "--target", "jetson"))
    return out, json.loads((out / "manifest.json").read_text()), result


def test_trained_two_stage_detector_is_real(faster_rcnn):
    assert faster_rcnn.held_out_map50 >= 0.3, faster_rcnn


def test_faster_rcnn_onnx_matches_eager_and_the_device_kit_agrees(jetson, tmp_path):
    out, doc, result = jetson
    task = doc["task"]
    assert task["output"]["layout"] == "NDK" and task["output"]["shape"] == [1, 100, 6]
    assert task["decode"]["kind"] == "final" and task["decode"]["anchors"] is None
    assert doc["eager"]["accuracy"]["map50"] > 0
    made = {a["name"]: a for a in doc["artifacts"]}
    for artifact, agreement in ((made["onnx_fp32"], 0.99), (made["onnx_fp16"], 0.95)):
        assert artifact["details"]["exporter"] == "torchscript" and artifact["details"]["batch_profile"] == [1, 1, 1]
        assert {"RoiAlign", "NonMaxSuppression"} <= set(artifact["details"]["ops"])
        fidelity = artifact["fidelity"]
        assert fidelity["eager_detections"] > 0
        assert artifact["status"] == "passed", artifact["reasons"]
        assert (artifact["status"] == "passed") == (breaches(artifact, artifact["thresholds"]) == [])
        assert fidelity["matched_recall"] >= agreement and fidelity["matched_precision"] >= agreement, fidelity
        assert abs(artifact["accuracy"]["map_drop_points"]) <= 1.0, artifact["accuracy"]
    # fp16: the backbone in half, the proposal and box steps (nms) in float
    assert made["onnx_fp16"]["details"]["graph"] == "float16 in backbone.body, backbone.fpn, float32 elsewhere"
    assert made["onnx_fp16"]["details"]["batchnorm_folding_fp32"]["backbone.body"]["folded"] > 0
    # the exit code follows the verdicts; int8 is judged honestly below, not required to pass: on this stand-in at 8
    # check images its recall sits at the 0.85 threshold (0.864 with int32 biases, 0.818 with float ones, the
    # range method picked on the check images flipping with them), and final detections move discontinuously
    failed = [a["name"] for a in doc["artifacts"] if a["status"] == "failed"]
    assert result.exit_code == (1 if failed else 0) and set(failed) <= {"onnx_int8"}, (failed, result.output)
    assert not (out / "golden" / "anchors.npy").exists()
    # int8: every Conv and Gemm of the graph found by the search (its BatchNorms folded before export keep the
    # parameters' names), Q/DQ on them, judged by the budget and the int8 thresholds like any other model
    int8 = made["onnx_int8"]
    quantization = int8["details"]["quantization"]
    graph = onnx.load(str(out / int8["path"])).graph
    producers = {o: n.op_type for n in graph.node for o in n.output}
    layers = [n for n in graph.node if n.op_type in ("Conv", "Gemm")]
    in_float = {n.input[1].removesuffix(".weight") for n in layers if producers.get(n.input[1]) != "DequantizeLinear"}
    assert len(layers) > 70 and in_float == {f["name"] for f in quantization["float_layers"]}, in_float
    assert quantization["layers"] == quantization["int8_layers"] + len(in_float)
    assert (int8["status"] == "passed") == (breaches(int8, int8["thresholds"]) == []), int8
    for name in ("tensorrt_fp16", "tensorrt_int8"):
        assert made[name]["status"] == "unavailable" and "tensorrt" in made[name]["reasons"][0]["text"], made[name]
    assert "Not made for this model" not in (out / "report.md").read_text()
    # the device kit, from a copy of the build directory, without torch or the exporter
    copy = tmp_path / "kit"
    shutil.copytree(out, copy)
    checked = subprocess.run(
        [sys.executable, copy / "device_validate.py", copy, "--runtime", "onnxruntime"], capture_output=True, text=True
    )
    # the kit reproduces the build (below) and exits 1 only where an artifact fails on the golden inputs too
    device_failed = [line.split()[1] for line in checked.stdout.splitlines() if line.startswith("FAILED")]
    assert checked.returncode == (1 if device_failed else 0) and set(device_failed) <= {"onnx_int8"}, (
        checked.stdout + checked.stderr
    )
    assert "recall" in checked.stdout
    assert_device_reproduces_the_build(copy)


def test_the_graphs_rows_are_torchvisions_detections(faster_rcnn):
    """FinalDetections writes torchvision's box step so that it traces for zero proposals too: on held-out canvases
    (one at a time and two in one batch), a blank frame and a NaN frame, its rows are exactly torchvision's own
    detections, padded with zeros."""
    import torch
    from PIL import Image
    from torchvision.models.detection.image_list import ImageList

    from exporter.tasks.detection import _reference_model
    from exporter.tasks.region_detection import FinalDetections, RegionDetection

    state = torch.load(faster_rcnn.checkpoint, weights_only=True)
    name = "fasterrcnn_mobilenet_v3_large_320_fpn"
    model = _reference_model(name, RegionDetection.num_classes_in(state, name, 91))
    model.load_state_dict(state)
    graph = FinalDetections(model).eval()
    mean, std = (torch.tensor(v)[:, None, None] for v in (model.transform.image_mean, model.transform.image_std))
    files = sorted((faster_rcnn.data_dir / "images").iterdir())[:3]
    images = [
        (
            torch.from_numpy(
                np.asarray(
                    Image.open(f).convert("RGB").resize((model_size := int(faster_rcnn.size),) * 2), dtype=np.float32
                )
                / 255
            ).permute(2, 0, 1)
            - mean
        )
        / std
        for f in files
    ]
    frames = [*images, torch.zeros_like(images[0]), torch.full_like(images[0], float("nan"))]
    with torch.no_grad():
        for x in [*(f[None] for f in frames), torch.stack(images[:2])]:
            sizes = [(model_size, model_size)] * len(x)
            features = model.backbone(x)
            proposals, _ = model.rpn(ImageList(x, sizes), features)
            own, _ = model.roi_heads(features, proposals, sizes)
            for rows, d in zip(graph(x), own):
                expected = torch.cat([d["boxes"], d["scores"][:, None], d["labels"][:, None].float()], 1)
                assert torch.equal(rows[: len(expected)], expected) and not rows[len(expected) :].any()
    assert sum(int(graph(i[None])[0, :, 5].gt(0).sum()) for i in images) > 0  # real detections were compared


def test_a_frame_without_a_proposal_runs_on_every_onnx(jetson):
    """No proposal reaches the box head (the RPN scores no anchor above its threshold: a blank frame, or an int8 RPN
    on a hard image): ONNX Runtime failed on the box decoding's reshape of zero rows, {0,44} to {0,-1}. A NaN
    frame has no proposal on any model (every comparison with NaN is false), so fp32 and fp16 return only padding;
    a blank frame runs on every ONNX artifact."""
    import onnxruntime as ort

    out, doc, _ = jetson
    for artifact in doc["artifacts"]:
        if artifact["format"] != "onnx":
            continue
        session = ort.InferenceSession(str(out / artifact["path"]))
        (graph_input,) = session.get_inputs()
        frame = np.zeros(graph_input.shape, dtype=np.float32)
        assert session.run(None, {graph_input.name: frame})[0].shape == (1, 100, 6), artifact["name"]
        if artifact["precision"] != "int8":  # int8 quantizes NaN to a number
            rows = session.run(None, {graph_input.name: np.full_like(frame, np.nan)})[0]
            assert rows.shape == (1, 100, 6) and not rows.any(), artifact["name"]


def test_a_target_without_the_route_is_refused_saying_why(tmp_path):
    """Android makes nothing from a two-stage detector: refused before any file (or download), each format's reason
    in the line, rather than a build that passes with nothing to ship."""
    out = tmp_path / "android"
    result = run_cli(
        "build",
        "FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1",
        "--offline",
        "--out",
        out,
        "--target",
        "android",
        "--format",
        "executorch:fp32",
        "--format",
        "torchscript_lite:fp32",
    )
    assert_clean_refusal(
        result,
        out,
        "makes no artifact for target android",
        "torch.export stops in the region proposal step",
        "nms and roi_align",
    )


def test_options_the_route_cannot_take_are_refused(faster_rcnn, tmp_path):
    for option, message in (
        ("exporter=dynamo", "exported with exporter=torchscript only"),
        ("batch=1:1:8", "exported with batch=1:1:1 only"),
    ):
        out = tmp_path / option.split("=")[0]
        result = run_cli(*args(faster_rcnn, out, "--target", "jetson", "--format", "onnx:fp32", "--option", option))
        assert_clean_refusal(result, out, message)


def test_rows_that_trade_places_are_compared_with_their_partners():
    """Two detections whose scores differ by rounding may come out either way round: PSNR compares each eager row
    with the row it matches, not with the row at its position."""
    eager = np.zeros((4, 6), dtype=np.float32)
    eager[0], eager[1], eager[2] = (0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.9, 2), (40, 40, 50, 50, 0.5, 1)
    swapped = eager[[1, 0, 2, 3]]
    assert np.array_equal(detection_decode.aligned(eager, swapped, {"kind": "final"}), eager)
    moved = eager.copy()
    moved[2, :4] += 30  # no partner left: stays where it was
    assert np.array_equal(detection_decode.aligned(eager, moved[[1, 0, 2, 3]], {"kind": "final"}), moved)
    assert np.array_equal(detection_decode.aligned(eager, swapped, {"kind": "ssd"}), swapped)  # per anchor: as it is


def test_rows_no_app_would_show_are_not_compared():
    """The low-score tail crosses score_thresh and NMS either way under fp16 rounding: a row under match_score on
    both sides compares equal; a row shown on either side is compared as it is."""
    params = {"kind": "final", "match_score": 0.3}
    eager = np.zeros((4, 6), dtype=np.float32)
    eager[0], eager[1] = (0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.1, 2)
    tail = eager.copy()
    tail[1], tail[2] = (
        (60, 60, 90, 90, 0.2, 2),
        (27, 38, 61, 103, 0.05, 4),
    )  # another weak box, one more at the threshold
    assert np.array_equal(detection_decode.aligned(eager, tail, params), eager)
    shown = eager.copy()
    shown[2] = (27, 38, 61, 103, 0.35, 4)
    assert np.array_equal(detection_decode.aligned(eager, shown, params), shown)
    assert np.array_equal(detection_decode.aligned(eager, tail, {"kind": "final"}), tail)  # no match_score: every row


def test_a_half_part_takes_any_arguments_and_returns_float_as_its_part_does():
    """A graph's half_modules: each part computes in half behind casts, whatever it takes (positional, keyword)
    and returns (a named tuple, a dict), its BatchNorms folded first."""
    import collections

    import torch

    from exporter.formats.half import half_graph

    Pair = collections.namedtuple("Pair", "sum extra")

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

        def forward(self, x, y, *, scale):
            return Pair(self.bn(self.conv(x)) + y, {"scaled": x * scale})

    class Graph(torch.nn.Module):
        half_modules = ("body",)

        def __init__(self):
            super().__init__()
            self.body = Body()

        def forward(self, x):
            out = self.body(x, torch.ones(1, 4, 8, 8), scale=torch.tensor(2.0))
            return out.sum.sum(1) + out.extra["scaled"].sum(1)

    torch.manual_seed(0)
    graph = Graph().eval()
    graph.body.bn.running_var.uniform_(0.5, 2.0)
    mixed, details = half_graph(graph)
    x = torch.randn(2, 3, 8, 8)
    out = mixed(x)
    assert out.dtype == torch.float32 and details["body"]["batchnorms"] == 1 and details["body"]["folded"] == 1
    assert torch.allclose(out, graph(x), atol=2e-2), (out - graph(x)).abs().max()
