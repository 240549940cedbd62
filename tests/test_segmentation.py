"""Semantic segmentation on every target, on really trained LR-ASPP and DeepLabV3 MobileNetV3-Large models
(digits pasted onto textured canvases, exporter.standins.segmentation): every artifact built, validated on
masks and logits against eager, labeled mIoU against held-out masks, bundled, and checked on the device kit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from exporter.standins import segmentation as digits_segmentation
from exporter.thresholds import breaches

from .helpers import CACHE, assert_clean_refusal, assert_device_reproduces_the_build, assert_preview, run_cli

pytestmark = pytest.mark.slow

LRASPP, DEEPLAB = digits_segmentation.WEIGHTS
FAST = ["--calib-size", "32", "--val-size", "16", "--warmup", "1", "--iterations", "5"]
SIZE_RANGE = ("64", "192")  # any height and width in it, for the formats that take one (ONNX, .pte)
CHECKED_SIZES = [[64, 64], [192, 192], [64, 192]]


@pytest.fixture(scope="session")
def lraspp() -> digits_segmentation.SegmentationDigitsModel:
    return digits_segmentation.prepare(CACHE, LRASPP)


@pytest.fixture(scope="session")
def deeplab() -> digits_segmentation.SegmentationDigitsModel:
    return digits_segmentation.prepare(CACHE, DEEPLAB)


def seg_args(model, out, *extra):
    side = str(model.size)
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
        side,
        side,
        "--out",
        out,
        "--quiet",
        *FAST,
        *extra,
    ]


def _build_all(tmp_path_factory, model, name):
    out = tmp_path_factory.mktemp(name) / "build"
    result = run_cli(*seg_args(model, out, "--target", "all", "--bundle", "--input-size-range", *SIZE_RANGE))
    docs = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/manifest.json")}
    return out, result, docs


@pytest.fixture(scope="module")
def lraspp_all(tmp_path_factory, lraspp):
    return _build_all(tmp_path_factory, lraspp, "lraspp")


@pytest.fixture(scope="module")
def deeplab_android(tmp_path_factory, deeplab):
    """Android only in the suite (every target takes CI minutes; `--target all` was run by hand)."""
    out = tmp_path_factory.mktemp("deeplab") / "build"
    result = run_cli(*seg_args(deeplab, out, "--target", "android"))
    return out, result, json.loads((out / "manifest.json").read_text())


def test_trained_models_are_real(lraspp, deeplab):
    # agreement only means something if the masks do: the models must find digits and tell some apart on
    # held-out canvases (one that paints everything background scores about 0.09: its IoU over 11 classes)
    for model in (lraspp, deeplab):
        assert model.held_out_miou > 0.12 and model.held_out_pixel_acc > 0.9, model


def _check_build(out, result, docs, model, single=None):
    """`single`: the directory of a one-target build (else OUT/<target>/)."""
    if single is None:
        assert set(docs) == {"android", "ios", "jetson"}, result.output
    for target, doc in docs.items():
        build = single or out / target
        assert doc["task"] == {
            "name": "segmentation",
            "input_size": [model.size, model.size],
            "num_classes": 11,
            "output": doc["task"]["output"],
        }
        assert doc["task"]["output"]["layout"] == "NCHW" and doc["task"]["output"]["shape"] == [
            1,
            11,
            model.size,
            model.size,
        ]
        pre = json.loads((build / "preprocessing.json").read_text())
        assert (
            pre["task"] == "segmentation" and pre["input_size"] == [model.size, model.size] and pre["crop_size"] is None
        )
        eager = doc["eager"]["accuracy"]
        assert eager["miou"] > 0 and eager["pixel_acc"] > 0, eager  # labeled metrics measured on held-out canvases
        for a in doc["artifacts"]:
            if a["status"] == "unavailable":  # engines without a GPU; Core ML cannot predict on Linux
                assert a["reasons"], a
                if a["format"] == "coreml":
                    proxies = a["proxy"].values()
                    assert proxies and all(
                        (p["status"] == "passed") == (breaches(p, a["thresholds"]) == []) for p in proxies
                    )
                continue
            # the verdict follows the target's segmentation thresholds, and only them
            assert set(a["thresholds"]) <= {
                "pixel_agreement",
                "miou_vs_eager",
                "psnr_db",
                "cosine",
                "max_abs_error",
                "miou_drop",
            }
            assert (a["status"] == "passed") == (breaches(a, a["thresholds"]) == []), a
            assert a["fidelity"]["pixel_agreement"] is not None and a["accuracy"]["miou_drop_points"] is not None
            assert_preview(build, a, model.size)
            if a["precision"] == "fp32":  # fp32 matches eager to fp32 rounding: a guarantee, not a host number
                assert a["status"] == "passed", a
                assert a["fidelity"]["pixel_agreement"] >= 0.999 and a["fidelity"]["psnr_db"] >= 60
        golden = build / "golden"
        logits, masks = np.load(golden / "eager_logits.npy"), np.load(golden / "eager_masks.npy")
        assert logits.shape[1:] == (11, model.size, model.size) and (logits.argmax(1) == masks).all()
        assert np.load(golden / "masks.npy").shape == masks.shape
        assert "data:image/png;base64," in (build / "report.html").read_text()
        assert "mIoU" in (build / "report.md").read_text()
    android = {a["name"]: a for a in docs["android"]["artifacts"]}
    for name in ("executorch_fp32", "executorch_int8"):
        delegation = android[name]["details"]["delegation"]
        if "dynamic_size" not in android[name]["details"]:  # a fixed size: the whole graph in XNNPACK
            assert delegation["delegated_subgraphs"] == 1 and delegation["ops_outside_on_tensors"] == {}, delegation
            continue
        # a dynamic size: only the two bilinear resizes (and the arithmetic of their output size) outside XNNPACK
        outside = delegation["ops_outside_on_tensors"]
        assert delegation["delegated_subgraphs"] == 2 and outside["upsample_bilinear2d"] == 2, delegation
        assert set(outside) <= {"upsample_bilinear2d", "sym_size", "add", "floordiv"}, delegation
    if "jetson" in docs:
        jetson = {a["name"]: a for a in docs["jetson"]["artifacts"]}
        assert all(jetson[f"tensorrt_{p}"]["status"] == "unavailable" for p in ("fp32", "fp16", "int8"))
    int8 = android["executorch_int8"]["details"]["quantization"]
    assert int8["budget"] and "agreement" in int8["after"]


def test_lraspp_builds_validates_and_bundles_on_every_target(lraspp_all, lraspp):
    out, result, docs = lraspp_all
    _check_build(out, result, docs, lraspp)
    assert_dynamic_sizes(docs, out)
    # exits non-zero exactly when an artifact broke its target's thresholds
    assert result.exit_code == (0 if all(d["status"] == "passed" for d in docs.values()) else 1), result.output


def assert_dynamic_sizes(docs: dict, out) -> None:
    """--input-size-range: every ONNX file and .pte takes any height and width in it and is judged at three more sizes,
    each verdict following the thresholds (fp32: passed, eager's masks to rounding at every size); every other
    artifact made keeps the fixed size and says why. A dynamic .pte's golden program holds its build-size cases."""
    for target, doc in docs.items():
        assert doc["target"]["input"]["size_range"] == [64, 192]
        for a in doc["artifacts"]:
            if a["format"] == "executorch" and a["status"] == "passed":
                assert a["bundled_program"]["verified"]["x86_64"]["passed"], a
            if a["format"] not in ("onnx", "executorch"):
                notes = [r["text"] for r in a["reasons"] if r["kind"] == "note"]
                made = not {r["kind"] for r in a["reasons"]} & {"not_made", "not_offered"}
                assert not made or any(n.startswith("keeps the fixed 128x128 input: ") for n in notes), a
                continue
            assert a["details"]["dynamic_size"] == {"height": [64, 192], "width": [64, 192]}
            assert a["input"]["size_range"] == [64, 192]
            assert [row["size"] for row in a["sizes"]] == CHECKED_SIZES
            for row in a["sizes"]:
                assert (row["status"] == "passed") == (breaches(row, a["thresholds"]) == []), row
                assert row["images"] > 0 and row["accuracy"]["miou_drop_points"] is not None
                if a["precision"] == "fp32":
                    assert row["status"] == "passed" and row["fidelity"]["pixel_agreement"] >= 0.999, row
            failed_at = [row["size"] for row in a["sizes"] if row["status"] == "failed"]
            assert not failed_at or a["status"] == "failed", a
            assert "also validated at 64x64" in (out / target / "report.md").read_text()


def test_deeplabv3_builds_and_validates_on_android(deeplab_android, deeplab):
    out, result, doc = deeplab_android
    _check_build(out.parent, result, {"android": doc}, deeplab, out)
    assert result.exit_code == (0 if doc["status"] == "passed" else 1), result.output


def test_jetson_bundle_checks_segmentation_on_the_device_kit(lraspp_all):
    out, result, docs = lraspp_all
    if docs["jetson"]["status"] != "passed":
        pytest.skip("no bundle: an artifact failed its thresholds (asserted consistent elsewhere)")
    bundle = out / "bundle" / "jetson"
    spec = json.loads((bundle / "bundle.json").read_text())
    assert spec["task"]["name"] == "segmentation"
    checked = subprocess.run(
        [sys.executable, bundle / "device_validate.py", bundle, "--runtime", "onnxruntime"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "pixel" in checked.stdout
    assert_device_reproduces_the_build(bundle)


def test_a_perturbed_artifact_fails_on_masks(tmp_path, lraspp_all):
    """Validation sees a broken artifact: the ONNX fp32 graph with its logits' channel order changed
    re-validated by `exporter validate` fails pixel agreement and mIoU against eager."""
    import onnx

    out, _, docs = lraspp_all
    build = tmp_path / "jetson"
    shutil.copytree(out / "jetson", build)
    doc = json.loads((build / "manifest.json").read_text())
    entry = next(a for a in doc["artifacts"] if a["name"] == "onnx_fp32")
    graph = onnx.load(build / entry["path"])
    last = graph.graph.output[0].name
    perm = onnx.helper.make_tensor("perm_indices", onnx.TensorProto.INT64, [11], [1, 0, *range(2, 11)])
    graph.graph.initializer.append(perm)
    for node in graph.graph.node:
        for i, name in enumerate(node.output):
            if name == last:
                node.output[i] = "unpermuted"
    graph.graph.node.append(onnx.helper.make_node("Gather", ["unpermuted", "perm_indices"], [last], axis=1))
    onnx.save(graph, build / entry["path"])
    from exporter import files

    entry["sha256"] = files.sha256(build / entry["path"])
    (build / "manifest.json").write_text(json.dumps(doc))
    result = run_cli("validate", build, "--quiet")
    assert result.exit_code == 1, result.output
    after = next(a for a in json.loads((build / "manifest.json").read_text())["artifacts"] if a["name"] == "onnx_fp32")
    assert after["status"] == "failed" and any(r.get("metric") == "pixel_agreement" for r in after["reasons"])


# --- bad input: one line, exit 2, nothing written ---


def _voc(tmp_path, lraspp, count=4):
    root = tmp_path / "voc"
    shutil.copytree(
        lraspp.data_dir, root, ignore=lambda d, names: sorted(names)[count:] if d.endswith(("images", "masks")) else []
    )
    return root


def _refused(tmp_path, lraspp, data, *needles):
    out = tmp_path / "out"
    side = str(lraspp.size)
    result = run_cli(
        "build",
        lraspp.weight,
        "--checkpoint",
        lraspp.checkpoint,
        "--data",
        data,
        "--input-size",
        side,
        side,
        "--target",
        "android",
        "--out",
        out,
        "--quiet",
        "--no-cache",
    )
    assert_clean_refusal(result, out, *needles)


def test_missing_mask_is_refused(tmp_path, lraspp):
    root = _voc(tmp_path, lraspp)
    victim = sorted((root / "masks").iterdir())[0]
    victim.unlink()
    _refused(tmp_path, lraspp, root, "has no mask", victim.name)


def test_mask_size_mismatch_is_refused(tmp_path, lraspp):
    root = _voc(tmp_path, lraspp)
    victim = sorted((root / "masks").iterdir())[0]
    Image.new("L", (7, 5)).save(victim)
    _refused(tmp_path, lraspp, root, "is 7x5 but its image is")


def test_class_index_out_of_range_is_refused(tmp_path, lraspp):
    root = _voc(tmp_path, lraspp)
    victim = sorted((root / "masks").iterdir())[0]
    with Image.open(victim) as im:
        mask = np.array(im)
    mask[0, 0] = 42
    Image.fromarray(mask, "L").save(victim)
    _refused(tmp_path, lraspp, root, "class index 42", "11 classes")


def test_classification_folder_is_refused_for_segmentation(tmp_path, lraspp, digits_model):
    _refused(tmp_path, lraspp, digits_model.data_dir, "not VOC-style")


def test_task_mismatches_are_refused(tmp_path, lraspp, digits_model):
    out = tmp_path / "out"
    result = run_cli(*seg_args(lraspp, out, "--target", "android", "--threshold", "int8.accuracy_drop=1", "--no-cache"))
    assert_clean_refusal(result, out, "accuracy_drop does not apply to segmentation")
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        digits_model.checkpoint,
        "--input-size",
        "64",
        "48",
        "--out",
        out,
        "--quiet",
    )
    assert_clean_refusal(result, out, "a classifier's crop is square")
    result = run_cli("build", "MaskRCNN_ResNet50_FPN_Weights.COCO_V1", "--out", out, "--quiet")
    assert_clean_refusal(result, out, "its masks have no output layout")


def test_a_uint8_input_segmenter_passes_as_onnx(tmp_path, lraspp):
    """The trained LR-ASPP stand-in taking an app's bytes (its preprocessing inside the graph) at any size in a range:
    the same masks as eager on torchvision's transform of the same images, within the fp32 thresholds, at each size."""
    from .test_image_input import assert_uint8_build_passes

    out = tmp_path / "build"
    result = run_cli(
        *seg_args(
            lraspp,
            out,
            *("--target", "jetson", "--format", "onnx:fp32", "--input-format", "uint8-nhwc"),
            *("--input-size-range", *SIZE_RANGE),
        )
    )
    assert_uint8_build_passes(out, result, {"onnx_fp32"})
    # the bytes at every size too: N x H x W x 3 with H and W dynamic
    (artifact,) = json.loads((out / "manifest.json").read_text())["artifacts"]
    assert [row["size"] for row in artifact["sizes"]] == CHECKED_SIZES
    assert all(row["status"] == "passed" for row in artifact["sizes"]), artifact["sizes"]
