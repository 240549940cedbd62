"""Segmentation on the device side, fast: hand-written build directories around a tiny ONNX 1x1 conv whose
output is per-pixel logits (N x C x H x W), through device_validate.py, `exporter bundle` and the
reference apps. The same for an old classification manifest (no "task"), which must read as before."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from exporter import files
from exporter.device import device_validate
from exporter.release import manifest
from exporter.release.bundle import BUNDLE_VERSION, make_bundle

from .helpers import ROOT, run_without_torch
from .fake_manifest import complete, verdict
from .test_bundle import APP_READS, _has

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

APPS = ROOT / "apps"
LABELS = ["__background__", "road", "car", "person", "sky"]
H, W = 12, 20  # not square: a swapped H and W shows
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
SEGMENTATION_THRESHOLDS = {
    "pixel_agreement": 0.99,
    "miou_vs_eager": 0.98,
    "psnr_db": 40.0,
    "cosine": 0.999,
    "max_abs_error": 0.05,
    "miou_drop": 1.0,
}
CLASSIFICATION_THRESHOLDS = {
    "top1_agreement": 0.99,
    "top5_agreement": 1.0,
    "psnr_db": 40.0,
    "cosine": 0.999,
    "max_abs_error": 0.05,
    "accuracy_drop": 1.0,
}

# Every file and JSON key each reference app reads for the task, beside what tests/test_bundle.py
# checks for classification. A key path is dotted; "[]" is any element of a list.
TASK_READS = {
    "android": {
        "sources": [
            "android/app/src/main/java/org/example/bundleclassifier/BundleClassifier.kt",
            "android/app/src/main/java/org/example/bundleclassifier/Preprocess.kt",
        ],
        "bundle.json": ["task.name", "task.input_size", "task.output.layout", "artifacts[].format", "artifacts[].file"],
        "preprocessing.json": ["resize_size", "crop_size", "mean", "std"],
    },
    "ios": {
        "sources": ["ios/Sources/ExporterBundle/BundleClassifier.swift"],
        "bundle.json": [
            "task.name",
            "task.input_size",
            "task.output.name",
            "task.output.layout",
            "artifacts[].input.name",
            "artifacts[].input.type",
        ],
        "preprocessing.json": ["resize_size", "crop_size", "interpolation"],
    },
    "jetson": {
        # --golden hands artifacts[] records to the bundled device_validate.py, run on real bundles elsewhere
        "sources": ["jetson/app.py"],
        "bundle.json": ["task.name", "task.input_size", "artifacts[].name", "device_kit.validator"],
        "preprocessing.json": ["resize_size", "crop_size", "interpolation", "mean", "std", "dtype"],
    },
}

# Per target, the artifacts of a hand-written build: (format, precision, file, input of a Core ML package).
TARGET_ARTIFACTS = {
    "jetson": [("onnx", "fp32", "tiny_onnx_fp32.onnx", None)],
    "android": [
        ("executorch", "fp32", "tiny_executorch_fp32.pte", None),
        ("litert", "fp32", "tiny_litert_fp32.tflite", None),
    ],
    "ios": [("coreml", "fp16", "tiny_coreml_fp16.mlpackage", {"name": "image", "type": "image"})],
}


def _onnx_model(path: Path, weight: np.ndarray, bias: np.ndarray, pooled: bool) -> None:
    """input (N x 3 x H x W) -> 1x1 conv -> logits: N x C x H x W, or N x C after global average pooling."""
    from onnx import TensorProto, helper, numpy_helper

    classes = len(bias)
    nodes = [helper.make_node("Conv", ["input", "weight", "bias"], ["pixels" if pooled else "logits"])]
    output_shape = ["N", classes, H, W]
    if pooled:
        nodes += [
            helper.make_node("GlobalAveragePool", ["pixels"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["logits"]),
        ]
        output_shape = ["N", classes]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, H, W])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, output_shape)],
        initializer=[numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def _eager(weight: np.ndarray, bias: np.ndarray, inputs: np.ndarray, pooled: bool) -> np.ndarray:
    logits = np.einsum("oc,nchw->nohw", weight[:, :, 0, 0], inputs) + bias[None, :, None, None]
    return (logits.mean((2, 3)) if pooled else logits).astype(np.float32)


def _task(name: str) -> dict:
    classes = len(LABELS)
    if name == "segmentation":
        return {
            "name": name,
            "input_size": [H, W],
            "num_classes": classes,
            "output": {"name": "logits", "layout": "NCHW", "shape": [1, classes, H, W]},
        }
    return {
        "name": name,
        "input_size": [H, W],
        "num_classes": classes,
        "output": {"name": "logits", "layout": "NC", "shape": [1, classes]},
    }


def _preprocessing(task: str | None) -> dict:
    spec = {
        "interpolation": "bilinear",
        "antialias": True,
        "mean": MEAN,
        "std": STD,
        "layout": "NCHW",
        "dtype": "float32",
        "range": "RGB scaled to [0, 1] before normalization",
    }
    if task == "segmentation":
        return {
            **spec,
            "resize_size": [H, W],
            "crop_size": None,
            "task": task,
            "input_size": [H, W],
            "output": _task(task)["output"],
        }
    return {**spec, "resize_size": [H + 4], "crop_size": [H, W]}


# what the build measured on its own run (the device run is judged on its own)
FIDELITY = {
    False: {
        "samples": 4,
        "psnr_db": 90.0,
        "cosine": 1.0,
        "max_abs_error": 0.0,
        "top1_agreement": 1.0,
        "top5_agreement": 1.0,
    },
    True: {
        "samples": 4,
        "pixels": 4 * H * W,
        "psnr_db": 90.0,
        "cosine": 1.0,
        "max_abs_error": 0.0,
        "pixel_agreement": 1.0,
        "miou_vs_eager": 1.0,
    },
}


def make_build(
    out: Path, task: str | None = "segmentation", target: str = "jetson", perturb: float = 0.0, labeled: bool = True
) -> Path:
    """A finished build directory as the pipeline writes it; task None is a manifest from before tasks.
    perturb adds noise of that scale to the artifact's weights (the eager reference keeps the true ones)."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    pooled = task != "segmentation"
    weight = rng.normal(0, 1, (len(LABELS), 3, 1, 1)).astype(np.float32)
    bias = rng.normal(0, 0.1, len(LABELS)).astype(np.float32)
    inputs = rng.normal(0, 1, (4, 3, H, W)).astype(np.float32)
    eager = _eager(weight, bias, inputs, pooled)

    golden = out / "golden"
    golden.mkdir()
    np.save(golden / "inputs.npy", inputs)
    np.save(golden / "eager_logits.npy", eager)
    if task == "segmentation":
        np.save(golden / "eager_masks.npy", eager.argmax(1).astype(np.uint8))
        if labeled:
            truth = eager.argmax(1).astype(np.uint8)
            truth[:, 0, :] = 255  # an ignored row, as a ground truth has
            np.save(golden / "masks.npy", truth)
    elif labeled:
        (golden / "labels.json").write_text(json.dumps(eager.argmax(1).tolist()) + "\n")

    artifacts = []
    for fmt, precision, name, model_input in TARGET_ARTIFACTS[target]:
        if fmt == "onnx":
            noisy = weight + rng.normal(0, perturb, weight.shape).astype(np.float32) if perturb else weight
            _onnx_model(out / name, noisy, bias, pooled)
        elif fmt == "coreml":
            (out / name).mkdir()
            (out / name / "Manifest.json").write_text("{}\n")
        else:
            (out / name).write_bytes(b"not a real program: the apps are checked for what they read")
        entry = {
            "name": f"{fmt}_{precision}",
            "format": fmt,
            "precision": precision,
            "path": name,
            "sha256": files.sha256(out / name),
            "size_bytes": files.size(out / name),
            **verdict(fmt),
            "thresholds": SEGMENTATION_THRESHOLDS if task == "segmentation" else CLASSIFICATION_THRESHOLDS,
            "accuracy": None,
            "details": {"opset": 18},
        }
        if entry["status"] == "passed":
            entry["fidelity"] = FIDELITY[task == "segmentation"]
        if model_input:
            entry["details"]["input"] = model_input
        if fmt == "litert":  # its interpreter's tensors, as formats/litert.py records them
            logits = [1, len(LABELS)] + ([H, W] if task == "segmentation" else [])
            entry["details"]["io"] = {
                "inputs": [{"name": "serving_default_args_0", "shape": [1, 3, H, W], "dtype": "float32"}],
                "outputs": [{"name": "serving_default_output_0", "shape": logits, "dtype": "float32"}],
            }
        artifacts.append(entry)

    doc = {
        "schema_version": manifest.SCHEMA_VERSION,
        "exporter_version": "0.0.test",
        "created": "2026-01-01T00:00:00+00:00",
        "status": "passed",
        "weight": {"name": "Tiny_Weights.TEST", "model": "tiny", "num_classes": len(LABELS)},
        "preprocessing": _preprocessing(task),
        "labels": {"count": len(LABELS)},
        "target": {
            "name": target,
            "artifacts": [{"format": f, "precision": p, "options": {}} for f, p, _, _ in TARGET_ARTIFACTS[target]],
        },
        "tools": {
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
            "executorch": "1.5.1",
            "torch": "2.14.1",
            "coremltools": "9.0",
            "ai-edge-litert": "2.3.0",
        },
        "data": {"kind": "synthetic"},
        "eager": {"accuracy": None},
        "artifacts": artifacts,
    }
    doc = complete({**doc, "task": _task(task or "classification")})
    if task is None:  # as device_validate may still meet it in a bundle made before tasks
        del doc["task"]
    if target == "jetson":
        from exporter.release.jetson_kit import device_kit

        doc["jetson"] = device_kit(out, doc, (3, H, W))
    (out / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (out / "preprocessing.json").write_text(json.dumps(doc["preprocessing"], indent=2) + "\n")
    (out / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out


def _device_validate(directory: Path):
    return run_without_torch(directory / "device_validate.py", directory, "--runtime", "onnxruntime")


def _one_error_line(result, *needles):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# device_validate.py


def test_segmentation_metrics_on_known_masks():
    ref = np.zeros((1, 3, 2, 4))
    ref[0, 0, 0, :] = ref[0, 1, 1, :2] = ref[0, 2, 1, 2:] = 1  # eager: class 0 on top, 1 and 2 below
    out = ref.copy()
    out[0, :, 1, 3] = [0, 1, 0]  # one pixel of class 2 read as class 1
    metrics = device_validate.segmentation_fidelity(ref, out)
    assert metrics["samples"] == 1 and metrics["pixel_agreement"] == 7 / 8
    # IoU: class 0 4/4, class 1 2/3, class 2 1/2
    assert metrics["miou_vs_eager"] == pytest.approx((1 + 2 / 3 + 1 / 2) / 3)
    assert metrics["max_abs_error"] == 1.0
    assert metrics["psnr_db"] == pytest.approx(20 * np.log10(1 / np.sqrt(2 / 24)))
    assert metrics["cosine"] == pytest.approx(7 / 8)
    # a class neither mask has does not count towards mIoU
    assert device_validate.segmentation_fidelity(ref, ref)["miou_vs_eager"] == 1.0


def test_faithful_segmentation_artifact_passes(tmp_path):
    build = make_build(tmp_path / "build")
    result = _device_validate(build)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith(
        "PASSED onnx_fp32 (onnxruntime, 4 golden inputs): pixel agreement 1.0000, mIoU vs eager 1.0000"
    )
    (checked,) = device_validate.validate(build, "onnxruntime")
    assert checked["task"] == "segmentation" and checked["fidelity"]["psnr_db"] > 80
    assert checked["thresholds"] == {k: v for k, v in SEGMENTATION_THRESHOLDS.items() if k != "miou_drop"}


def test_perturbed_segmentation_artifact_fails(tmp_path):
    build = make_build(tmp_path / "build", perturb=0.5)
    result = _device_validate(build)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("FAILED onnx_fp32")
    for key in ("pixel_agreement", "miou_vs_eager", "psnr_db", "max_abs_error"):
        assert f"; {key} " in line, line
    (checked,) = device_validate.validate(build, "onnxruntime")
    assert 0.2 < checked["fidelity"]["pixel_agreement"] < 0.99


def test_segmentation_threshold_breaks_alone(tmp_path):
    """A near-faithful artifact passes until one segmentation threshold is set above what it reaches."""
    build = make_build(tmp_path / "build", perturb=1e-3)
    assert _device_validate(build).returncode == 0
    doc = json.loads((build / "manifest.json").read_text())
    doc["artifacts"][0]["thresholds"]["psnr_db"] = 500.0
    (build / "manifest.json").write_text(json.dumps(doc))
    result = _device_validate(build)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.count("; ") == 1 and "; psnr_db " in result.stdout and "(needs >= 500)" in result.stdout


@pytest.mark.parametrize(
    "golden, needles",
    [
        (lambda g: np.zeros((4, len(LABELS)), np.float32), ["do not pair up for segmentation", "(4, 5)"]),
        (lambda g: g[:3], ["do not pair up", "(3, 5, 12, 20)"]),
        (
            lambda g: g.transpose(0, 1, 3, 2),
            ["eager_logits.npy has shape (4, 5, 20, 12)", "task.output.shape is [1, 5, 12, 20]"],
        ),
    ],
    ids=["classification-shaped", "fewer-than-inputs", "h-w-swapped"],
)
def test_bad_golden_shapes_are_one_clear_line(tmp_path, golden, needles):
    build = make_build(tmp_path / "build")
    path = build / "golden" / "eager_logits.npy"
    np.save(path, golden(np.load(path)))
    _one_error_line(_device_validate(build), *needles)


def test_model_that_does_not_fit_the_golden_logits_is_one_clear_line(tmp_path):
    """Golden files and manifest agree on 6 classes; the ONNX outputs 5."""
    build = make_build(tmp_path / "build")
    path = build / "golden" / "eager_logits.npy"
    golden = np.load(path)
    np.save(path, np.concatenate([golden, golden[:, :1]], axis=1))
    doc = json.loads((build / "manifest.json").read_text())
    doc["task"]["output"]["shape"] = [1, 6, H, W]
    (build / "manifest.json").write_text(json.dumps(doc))
    _one_error_line(_device_validate(build), "(4, 6, 12, 20)", "tiny_onnx_fp32.onnx outputs (1, 5, 12, 20)")


def test_unknown_task_and_mismatched_layout_are_refused(tmp_path):
    build = make_build(tmp_path / "build")
    doc = json.loads((build / "manifest.json").read_text())
    doc["task"]["output"]["layout"] = "NC"
    (build / "manifest.json").write_text(json.dumps(doc))
    _one_error_line(_device_validate(build), "segmentation", "layout NC")
    doc["task"] = {"name": "keypoints"}
    (build / "manifest.json").write_text(json.dumps(doc))
    _one_error_line(_device_validate(build), "'keypoints'")


@pytest.mark.parametrize("task", [None, "classification"])
def test_classification_reads_as_before(tmp_path, task):
    """No "task" (a manifest from before tasks) or an explicit classification task: top-1 and the old line."""
    build = make_build(tmp_path / "build", task=task)
    result = _device_validate(build)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.fullmatch(
        r"PASSED onnx_fp32 \(onnxruntime, 4 golden inputs\): top1 1\.000, psnr [\d.]+ dB, "
        r"cosine [\d.]+, max abs [^;\s]+; note: too few items to resolve top1_agreement 0\.99 \(4 images\): "
        r"one miss each is let through\n",
        result.stdout,
    ), result.stdout
    np.save(build / "golden" / "eager_logits.npy", np.zeros((4, 11), np.float32))
    _one_error_line(_device_validate(build), "shape")


def test_classification_perturbed_still_fails_on_top1(tmp_path):
    result = _device_validate(make_build(tmp_path / "build", task="classification", perturb=2.0))
    assert result.returncode == 1 and result.stdout.startswith("FAILED onnx_fp32"), result.stdout + result.stderr
    assert "top1_agreement" in result.stdout and "accuracy_drop" not in result.stdout


# bundles


def test_segmentation_bundle_carries_task_and_golden_masks(tmp_path):
    build = make_build(tmp_path / "build")
    info = json.loads((make_bundle(build) / "bundle.json").read_text())
    doc = json.loads((build / "manifest.json").read_text())
    assert info["bundle_version"] == BUNDLE_VERSION == 1
    assert info["task"] == doc["task"]
    assert info["golden"] == {
        "inputs": "golden/inputs.npy",
        "eager_logits": "golden/eager_logits.npy",
        "eager_masks": "golden/eager_masks.npy",
        "masks": "golden/masks.npy",
    }
    listed = {f["path"] for f in info["files"]}
    assert set(info["golden"].values()) | {"device_validate.py", "build_engine.sh"} <= listed
    assert info["artifacts"][0]["thresholds"] == SEGMENTATION_THRESHOLDS
    # the bundled validator runs inside the bundle
    result = _device_validate(build / "bundle" / "jetson")
    assert result.returncode == 0 and result.stdout.startswith("PASSED onnx_fp32"), result.stdout + result.stderr


def test_unlabeled_segmentation_bundle_has_no_ground_truth(tmp_path):
    info = json.loads((make_bundle(make_build(tmp_path / "build", labeled=False)) / "bundle.json").read_text())
    assert set(info["golden"]) == {"inputs", "eager_logits", "eager_masks"}


def test_kit_builds_engines_at_the_segmentation_input_size(tmp_path):
    script = (make_build(tmp_path / "build") / "build_engine.sh").read_text()
    assert f"--minShapes=input:1x3x{H}x{W} --optShapes=input:1x3x{H}x{W} --maxShapes=input:1x3x{H}x{W}" in script


# the reference apps


@pytest.mark.parametrize("app", sorted(TASK_READS))
@pytest.mark.parametrize("task", ["segmentation", "classification"])
def test_every_task_key_an_app_reads_is_in_a_bundle(tmp_path, app, task):
    reads = TASK_READS[app]
    directory = make_bundle(make_build(tmp_path / "build", task=task, target=app))
    sources = "\n".join((APPS / path).read_text() for path in reads["sources"])
    info = json.loads((directory / "bundle.json").read_text())
    spec = json.loads((directory / info["preprocessing"]).read_text())
    for name, doc in (("bundle.json", info), ("preprocessing.json", spec)):
        for path in reads[name]:
            assert all(f'"{key.removesuffix("[]")}"' in sources for key in path.split(".")), (
                f"{app} does not read {path}"
            )
            assert _has(doc, path), f"{app} reads {name}: {path}, which the bundle lacks"
    for path in [
        info["labels"],
        info["preprocessing"],
        *info["golden"].values(),
        *(a["file"] for a in info["artifacts"]),
    ]:
        assert (directory / path).exists(), path
    quoted = set(re.findall(r'"([\w./-]+\.(?:json|txt|npy|png))"', sources))
    assert quoted <= {"bundle.json"}, (
        f"{app} hard-codes {quoted - {'bundle.json'}}; it should take names from bundle.json"
    )
    # both tasks are handled, and a task the app does not know is refused rather than misread
    assert '"segmentation"' in sources and '"classification"' in sources


@pytest.mark.parametrize("app", sorted(APP_READS))
def test_classification_reads_hold_on_a_bundle_with_a_classification_task(tmp_path, app):
    """test_bundle.py's check of what the apps read, on a hand-written build that has a task."""
    reads = APP_READS[app]
    directory = make_bundle(make_build(tmp_path / "build", task="classification", target=app))
    info = json.loads((directory / "bundle.json").read_text())
    assert info["task"] == _task("classification")
    spec = json.loads((directory / info["preprocessing"]).read_text())
    for name, doc in (("bundle.json", info), ("preprocessing.json", spec)):
        assert all(_has(doc, path) for path in reads[name]), name


def _jetson_app():
    spec = importlib.util.spec_from_file_location("jetson_app", APPS / "jetson" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _app(*args):
    return run_without_torch(APPS / "jetson" / "app.py", *args)


def _photo(path: Path, width: int = 37, height: int = 23) -> Path:
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def test_jetson_app_golden_on_segmentation(tmp_path):
    directory = make_bundle(make_build(tmp_path / "build"))
    result = _app(directory, "--golden")
    assert result.returncode == 0, result.stdout + result.stderr
    model, line = result.stdout.splitlines()
    assert model == "model: tiny_onnx_fp32.onnx (ONNX Runtime)"
    assert line.startswith(
        "PASSED onnx_fp32 (onnxruntime, 4 golden inputs): pixel agreement 1.0000, mIoU vs eager 1.0000"
    )
    perturbed = make_bundle(make_build(tmp_path / "perturbed", perturb=0.5))
    result = _app(perturbed, "--golden")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        r"^FAILED onnx_fp32 .*; pixel_agreement 0\.\d+ \(\d+ of \d+ pixels of another class; 0\.99 allows",
        result.stdout,
        re.M,
    ), result.stdout


def test_jetson_app_writes_an_overlay_of_the_image_size(tmp_path):
    directory = make_bundle(make_build(tmp_path / "build"))
    photo = _photo(tmp_path / "photo.jpg")
    target = tmp_path / "out" / "overlay.png"
    result = _app(directory, photo, "--overlay", target)
    assert result.returncode == 0, result.stdout + result.stderr
    model, path, *classes, written = result.stdout.splitlines()
    assert model == "model: tiny_onnx_fp32.onnx (ONNX Runtime)" and path == str(photo)
    assert written == f"  overlay: {target}"
    fractions = [(float(line.split()[0].rstrip("%")), line.split(maxsplit=1)[1]) for line in classes]
    assert {label for _, label in fractions} <= set(LABELS) and fractions == sorted(fractions, key=lambda f: -f[0])
    assert sum(f for f, _ in fractions) == pytest.approx(100, abs=0.01 * len(fractions))
    with Image.open(target) as overlay:
        assert overlay.format == "PNG" and overlay.size == (37, 23) and overlay.mode == "RGB"
    # several images: --overlay is a directory
    second = _photo(tmp_path / "second.png", 8, 50)
    result = _app(directory, photo, second, "--overlay", tmp_path / "many")
    assert result.returncode == 0, result.stdout + result.stderr
    with Image.open(tmp_path / "many" / "second.png") as overlay:
        assert overlay.size == (8, 50)


def test_jetson_app_fractions_match_the_model(tmp_path):
    app = _jetson_app()
    directory = make_bundle(make_build(tmp_path / "build"))
    info, labels, spec = app.load_bundle(directory)
    with Image.open(_photo(tmp_path / "photo.png")) as image:
        x = app.preprocess(image, spec)
    _, _, run = app.load_runner(directory, app.preferred_artifact(directory, info))
    mask, fractions = app.segment(run(x)[0], labels)
    assert mask.shape == (H, W)
    expected = np.bincount(mask.ravel(), minlength=len(LABELS)) / mask.size
    assert dict(fractions) == {LABELS[i]: expected[i] for i in range(len(LABELS)) if expected[i]}


def test_overlay_blends_palette_colours_and_leaves_background():
    app = _jetson_app()
    assert app.palette(21)[:4].tolist() == [[0, 0, 0], [128, 0, 0], [0, 128, 0], [128, 128, 0]]
    assert app.palette(21)[15].tolist() == [192, 128, 128]  # Pascal VOC's person
    image = Image.new("RGB", (4, 2), (100, 50, 200))
    mask = np.array([[0, 1, 2, 3], [3, 3, 0, 0]])
    pixels = np.asarray(app.overlay(image, mask, LABELS))
    assert pixels[0, 0].tolist() == [100, 50, 200]  # background: the image itself
    assert pixels[0, 1].tolist() == [114, 25, 100]  # half the image, half dark red
    assert pixels[1, 0].tolist() == [114, 89, 100]  # olive
    # a mask smaller than the image is scaled by nearest neighbour
    big = np.asarray(app.overlay(Image.new("RGB", (8, 4), (100, 50, 200)), mask, LABELS))
    assert (big[:2, :2] == pixels[0, 0]).all() and (big[2:, 2:4] == pixels[1, 1]).all()


def test_jetson_app_preprocessing_is_the_segmentation_transform(tmp_path):
    """An exact resize to the input size with the PIL filter, [0, 1], normalize: torchvision's v2 transforms
    given the PIL image (resizing a uint8 tensor instead differs by one level in about 1% of the values)."""
    import torch
    from torchvision.transforms import InterpolationMode, v2

    app = _jetson_app()
    spec = _preprocessing("segmentation")
    transform = v2.Compose(
        [
            v2.Resize([H, W], InterpolationMode.BILINEAR, antialias=True),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )
    rng = np.random.default_rng(0)
    for width, height in [(300, 200), (20, 12), (7, 99)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        np.testing.assert_allclose(app.preprocess(image, spec), transform(image).numpy()[None], rtol=0, atol=1e-6)


def test_jetson_app_classifies_and_refuses_overlay_for_a_classifier(tmp_path):
    directory = make_bundle(make_build(tmp_path / "build", task="classification"))
    photo = _photo(tmp_path / "photo.png")
    result = _app(directory, photo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == 7  # model, image, top-5
    assert (
        _app(directory, "--golden")
        .stdout.splitlines()[-1]
        .startswith("PASSED onnx_fp32 (onnxruntime, 4 golden inputs): top1 1.000")
    )
    _one_error_line(_app(directory, photo, "--overlay", tmp_path / "o.png"), "--overlay", "classification")
    assert not (tmp_path / "o.png").exists()
