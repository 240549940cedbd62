"""Detection on the device side, fast: hand-written build directories around a tiny ONNX graph that maps an
input to a fixed SSD-shaped output (anchors x (4 box deltas + C class logits), with SSDlite320's real anchors),
through device_validate.py, the Jetson kit, `exporter bundle` and the reference apps."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from exporter import files, weights
from exporter.device import detection_decode, device_validate
from exporter.release import manifest
from exporter.release.bundle import make_bundle
from exporter.errors import UsageError

from .helpers import ROOT, run_without_torch
from .fake_manifest import complete, verdict
from .test_bundle import _has

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

APPS = ROOT / "apps"
SSDLITE = "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"
LABELS = ["__background__", "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SIZE = 320
IMAGES = 3
OBJECTS = 8
THRESHOLDS = {
    "matched_recall": 0.99,
    "matched_precision": 0.99,
    "psnr_db": 60.0,
    "cosine": 0.999,
    "max_abs_error": 0.05,
    "map_drop": 1.0,
}
DECODER = Path(detection_decode.__file__)

# Per target, the artifacts of a hand-written build: (format, precision, file, input of a Core ML package).
TARGET_ARTIFACTS = {
    "jetson": [("onnx", "fp32", "tiny_ssd_onnx_fp32.onnx", None)],
    "android": [("executorch", "fp32", "tiny_ssd_executorch_fp32.pte", None)],
    "ios": [("coreml", "fp16", "tiny_ssd_coreml_fp16.mlpackage", {"name": "image", "type": "image"})],
}

# Every file and JSON key each reference app reads for detection, beside what tests/test_bundle.py and
# tests/test_device_segmentation.py check. A key path is dotted; "[]" is any element of a list.
DECODE_PARAMS = [
    "task.decode.box_coder_weights",
    "task.decode.score_thresh",
    "task.decode.nms_thresh",
    "task.decode.topk_candidates",
    "task.decode.detections_per_img",
    "task.decode.bbox_xform_clip",
    "task.decode.match_score",
    "task.decode.anchors",
    "task.decode.kind",
]
DETECTION_READS = {
    "android": {
        "sources": [
            "android/app/src/main/java/org/example/bundleclassifier/BundleClassifier.kt",
            "android/app/src/main/java/org/example/bundleclassifier/Detections.kt",
            "android/app/src/main/java/org/example/bundleclassifier/Preprocess.kt",
        ],
        "bundle.json": ["task.name", "task.input_size", "task.output.layout", *DECODE_PARAMS],
        "preprocessing.json": ["resize_size", "crop_size", "mean", "std"],
    },
    "ios": {
        "sources": ["ios/Sources/ExporterBundle/BundleClassifier.swift", "ios/Sources/ExporterBundle/Detections.swift"],
        "bundle.json": ["task.name", "task.input_size", "task.output.name", "task.output.layout", *DECODE_PARAMS],
        "preprocessing.json": ["resize_size", "crop_size", "interpolation"],
    },
    "jetson": {
        # --golden hands artifacts[] records to the bundled device_validate.py, run on real bundles elsewhere
        "sources": ["jetson/app.py"],
        # hands every task.decode entry but the file names to the decode (test_jetson_app_hands_…)
        "bundle.json": [
            "task.name",
            "task.input_size",
            "task.decode.code",
            "task.decode.anchors",
            "task.decode.match_score",
            "artifacts[].name",
            "device_kit.validator",
        ],
        "preprocessing.json": ["resize_size", "crop_size", "interpolation", "mean", "std", "dtype"],
    },
}


@pytest.fixture(scope="module")
def task():
    """SSDlite320's detection task for 10 classes and background: its real anchors and decode parameters."""
    return weights.bind_task(weights.resolve(SSDLITE), len(LABELS))


def _object_anchors(anchors: np.ndarray, rng) -> np.ndarray:
    """OBJECTS anchors inside the image, 16 pixels apart at least: boxes an overlay shows apart."""
    inside = np.nonzero(
        (anchors[:, :2] >= 4).all(1)
        & (anchors[:, 2:] <= SIZE - 4).all(1)
        & ((anchors[:, 2:] - anchors[:, :2]) <= 112).all(1)
    )[0]
    grown = anchors + np.array([-8, -8, 8, 8], dtype=np.float32)
    chosen = []
    for index in rng.permutation(inside):
        if all(detection_decode.box_iou(grown[[index]], grown[[c]])[0, 0] == 0 for c in chosen):
            chosen.append(index)
        if len(chosen) == OBJECTS:
            return np.asarray(chosen)
    raise AssertionError("not enough separate anchors")


def _heads(task, rng) -> tuple[np.ndarray, np.ndarray]:
    """(weight 3 x A*K, bias A x K) of a head whose output is nearly fixed: background everywhere but at
    OBJECTS anchors, each confidently one class; the input's channel means move every value a little."""
    anchors, k = task.anchors, 4 + len(LABELS)
    bias = np.zeros((len(anchors), k), dtype=np.float32)
    bias[:, :4] = rng.normal(0, 0.3, (len(anchors), 4))
    bias[:, 4] = 10.0
    bias[:, 5:] = rng.normal(0, 1, (len(anchors), len(LABELS) - 1))
    objects = _object_anchors(anchors, rng)
    bias[objects, :4] = 0.0  # the objects' boxes are their anchors
    bias[objects, 5 + rng.integers(0, len(LABELS) - 1, len(objects))] = 15.0
    weight = rng.normal(0, 0.3, (3, len(anchors) * k)).astype(np.float32)
    return weight, bias


def _onnx_model(path: Path, weight: np.ndarray, bias: np.ndarray) -> None:
    """input (N x 3 x 320 x 320) -> channel means -> Gemm -> logits: N x A x (4 + C)."""
    from onnx import TensorProto, helper, numpy_helper

    anchors, k = bias.shape
    nodes = [
        helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["features"]),
        helper.make_node("Gemm", ["features", "weight", "bias"], ["flat"]),
        helper.make_node("Reshape", ["flat", "shape"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_ssd",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", anchors, k])],
        initializer=[
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(bias.reshape(-1), "bias"),
            numpy_helper.from_array(np.array([-1, anchors, k], dtype=np.int64), "shape"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def _eager(weight: np.ndarray, bias: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    return (inputs.mean((2, 3)) @ weight + bias.reshape(-1)).reshape(len(inputs), *bias.shape).astype(np.float32)


# what the build measured on its own run (the device run is judged on its own)
FIDELITY = {
    "samples": IMAGES,
    "psnr_db": 90.0,
    "cosine": 1.0,
    "max_abs_error": 0.0,
    "matched_recall": 1.0,
    "matched_precision": 1.0,
}


def make_build(out: Path, task, target: str = "jetson", perturb: float = 0.0, labeled: bool = True) -> Path:
    """A finished detection build directory as the pipeline writes it (task.describe(), task.golden(), the
    Jetson kit). perturb adds noise of that scale to the artifact's head; eager keeps the true one."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight, bias = _heads(task, rng)
    inputs = (rng.normal(0, 1, (IMAGES, 3, SIZE, SIZE)) + rng.uniform(-1, 1, (IMAGES, 3, 1, 1))).astype(np.float32)
    eager = _eager(weight, bias, inputs)

    labels = None
    if labeled:  # eager's two best boxes per image, as if annotated
        rows = [
            [[float(label), *map(float, box)] for box, label in zip(d["boxes"][:2], d["labels"][:2])]
            for d in (detection_decode.decode(e, task.anchors, task.input_size, task.params) for e in eager)
        ]
        labels = torch.tensor(rows, dtype=torch.float32)
    for name, text in task.device_files().items():
        (out / name).write_text(text)
    (out / "golden").mkdir()
    for name, content in task.golden(
        torch.from_numpy(inputs), torch.from_numpy(eager.reshape(IMAGES, -1)), labels
    ).items():
        if name.endswith(".json"):
            (out / "golden" / name).write_text(json.dumps(content) + "\n")
        else:
            np.save(out / "golden" / name, content)

    artifacts = []
    for fmt, precision, name, model_input in TARGET_ARTIFACTS[target]:
        if fmt == "onnx":
            noisy = bias + rng.normal(0, perturb, bias.shape).astype(np.float32) if perturb else bias
            _onnx_model(out / name, weight, noisy)
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
            "thresholds": THRESHOLDS,
            "accuracy": None,
            "details": {"opset": 18},
        }
        if entry["status"] == "passed":
            entry["fidelity"] = FIDELITY
        if model_input:
            entry["details"]["input"] = model_input
        artifacts.append(entry)

    doc = {
        "schema_version": manifest.SCHEMA_VERSION,
        "exporter_version": "0.0.test",
        "created": "2026-01-01T00:00:00+00:00",
        "status": "passed",
        "weight": {"name": "Tiny_SSD_Weights.TEST", "model": "tiny_ssd", "num_classes": len(LABELS)},
        "task": task.describe(),
        "preprocessing": task.preprocessing(None),
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
        },
        "data": {"kind": "synthetic"},
        "eager": {"accuracy": None},
        "artifacts": artifacts,
    }
    doc = complete(doc)
    if target == "jetson":
        from exporter.release.jetson_kit import device_kit

        doc["jetson"] = device_kit(out, doc, (3, SIZE, SIZE))
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


def _edit_manifest(build: Path, edit) -> None:
    doc = json.loads((build / "manifest.json").read_text())
    edit(doc)
    (build / "manifest.json").write_text(json.dumps(doc))


def _artifact_heads(build: Path) -> np.ndarray:
    session = ort.InferenceSession(str(build / TARGET_ARTIFACTS["jetson"][0][2]), providers=["CPUExecutionProvider"])
    return np.concatenate(
        [session.run(["logits"], {"input": x[None]})[0] for x in np.load(build / "golden" / "inputs.npy")]
    )


# device_validate.py


def test_faithful_detection_artifact_passes(tmp_path, task):
    build = make_build(tmp_path / "build", task)
    result = _device_validate(build)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    eager_boxes = sum(len(d["boxes"]) for d in json.loads((build / "golden" / "eager_detections.json").read_text()))
    assert eager_boxes >= IMAGES * OBJECTS // 2
    assert line.startswith(
        f"PASSED onnx_fp32 (onnxruntime, {IMAGES} golden inputs): matched recall 1.0000, precision "
        f"1.0000, mean IoU 1.000 ({eager_boxes} eager boxes), psnr "
    ), line
    (checked,) = device_validate.validate(build, "onnxruntime")
    assert checked["task"] == "detection" and checked["fidelity"]["psnr_db"] > 80
    assert checked["thresholds"] == {k: v for k, v in THRESHOLDS.items() if k != "map_drop"}


def test_perturbed_heads_fail_matched_recall(tmp_path, task):
    build = make_build(tmp_path / "build", task, perturb=3.0)
    result = _device_validate(build)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("FAILED onnx_fp32") and re.search(
        r"; matched_recall [\d.]+ \(\d+ of \d+ eager boxes unmatched; "
        r"0\.99 allows \d+ of \d+\)",
        line,
    ), line
    (checked,) = device_validate.validate(build, "onnxruntime")
    assert checked["fidelity"]["matched_recall"] < 0.9


def test_device_numbers_equal_the_tasks_on_the_same_arrays(tmp_path, task):
    """The standalone metrics are exporter.tasks.detection's: same heads in, same numbers out."""
    build = make_build(tmp_path / "build", task, perturb=1.0)
    eager = np.load(build / "golden" / "eager_logits.npy")
    heads = _artifact_heads(build)
    ours = task.fidelity(torch.from_numpy(eager.reshape(IMAGES, -1)), torch.from_numpy(heads.reshape(IMAGES, -1)))
    (checked,) = device_validate.validate(build, "onnxruntime")
    theirs = checked["fidelity"]
    assert 0 < ours["matched_recall"] < 1 and ours["max_score_error"] > 0  # a case where the numbers say something
    for key in (
        "matched_recall",
        "matched_precision",
        "mean_match_iou",
        "max_score_error",
        "eager_detections",
        "artifact_detections",
        "psnr_db",
        "cosine",
        "max_abs_error",
        "samples",
    ):
        assert theirs[key] == pytest.approx(ours[key], rel=1e-6), key


def test_a_device_is_held_to_the_builds_own_run_on_the_golden_inputs(tmp_path, task):
    """The artifact misses eager boxes on the golden inputs, more than 0.99 allows on so few. When the build's
    own run of it missed the same (the manifest's golden_fidelity, as the pipeline records it with
    task.fidelity on the golden rows), the device reproduces what the build validated: passed. Held to a
    perfect build run, the same outputs fail."""
    build = make_build(tmp_path / "build", task, perturb=1.0)
    (plain,) = device_validate.validate(build, "onnxruntime")
    assert plain["status"] == "failed" and any(r.startswith("matched_recall") for r in plain["reasons"]), plain
    eager = torch.from_numpy(np.load(build / "golden" / "eager_logits.npy").reshape(IMAGES, -1))
    own = task.fidelity(eager, torch.from_numpy(_artifact_heads(build).reshape(IMAGES, -1)))
    _edit_manifest(build, lambda doc: doc["artifacts"][0].update(golden_fidelity=own))
    result = _device_validate(build)
    assert result.returncode == 0 and result.stdout.startswith("PASSED onnx_fp32"), result.stdout + result.stderr
    # a run the build failed vouches for nothing
    _edit_manifest(build, lambda doc: doc["artifacts"][0].update(status="failed"))
    assert _device_validate(build).returncode == 1
    _edit_manifest(build, lambda doc: doc["artifacts"][0].update(status="passed"))
    perfect = task.fidelity(eager, eager)
    _edit_manifest(build, lambda doc: doc["artifacts"][0].update(golden_fidelity=perfect))
    result = _device_validate(build)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        r"; matched_recall [\d.]+ \(\d+ of \d+ eager boxes unmatched; 0\.99 allows \d+ of \d+\)", result.stdout
    )


@pytest.mark.parametrize(
    "damage, needles",
    [
        (lambda b: (b / "golden" / "anchors.npy").unlink(), ["golden/anchors.npy is missing", "task.decode.anchors"]),
        (
            lambda b: np.save(b / "golden" / "anchors.npy", np.load(b / "golden" / "anchors.npy")[:-1]),
            ["golden/anchors.npy has shape (3233, 4)", "(3234, 4) expected"],
        ),
        (lambda b: (b / "detection_decode.py").unlink(), ["detection_decode.py is missing beside device_validate.py"]),
        (
            lambda b: _edit_manifest(b, lambda d: d["task"].pop("decode")),
            ["task 'detection' lacks task.decode box_coder_weights"],
        ),
        (
            lambda b: _edit_manifest(b, lambda d: d["task"]["decode"].pop("nms_thresh")),
            ["lacks task.decode nms_thresh"],
        ),
        (
            lambda b: np.save(b / "golden" / "eager_logits.npy", np.load(b / "golden" / "eager_logits.npy")[..., :-1]),
            ["eager_logits.npy has shape (3, 3234, 14)", "task.output.shape is [1, 3234, 15]"],
        ),
    ],
    ids=["no-anchors", "anchors-shape", "no-decode-code", "no-decode-params", "one-param-missing", "head-shape"],
)
def test_missing_or_mismatched_detection_files_are_one_clear_line(tmp_path, task, damage, needles):
    build = make_build(tmp_path / "build", task)
    damage(build)
    _one_error_line(_device_validate(build), *needles)


def test_anchors_that_are_not_the_builds_are_caught(tmp_path, task):
    """Shifted anchors would shift eager's boxes and the artifact's alike: recall alone cannot see it, the golden
    eager detections can."""
    build = make_build(tmp_path / "build", task)
    np.save(build / "golden" / "anchors.npy", np.load(build / "golden" / "anchors.npy") + 6.0)
    _one_error_line(_device_validate(build), "does not give golden/eager_detections.json", "not the build's")


def test_model_that_does_not_fit_the_golden_heads_is_one_clear_line(tmp_path, task):
    build = make_build(tmp_path / "build", task)
    narrower = np.zeros((len(task.anchors), 4 + len(LABELS) - 1), np.float32)  # one class fewer than the golden heads
    _onnx_model(build / "tiny_ssd_onnx_fp32.onnx", np.zeros((3, narrower.size), np.float32), narrower)
    _edit_manifest(build, lambda d: d["artifacts"][0].update(sha256=files.sha256(build / "tiny_ssd_onnx_fp32.onnx")))
    _one_error_line(_device_validate(build), "(3, 3234, 15)", "tiny_ssd_onnx_fp32.onnx outputs (1, 3234, 14)")


def test_validate_device_reads_the_decoder_beside_it_in_the_package(tmp_path, task):
    """`exporter validate-device` runs this package's device_validate, beside this package's decode."""
    build = make_build(tmp_path / "build", task)
    (build / "detection_decode.py").unlink()
    (checked,) = device_validate.validate(build, "onnxruntime")
    assert checked["status"] == "passed"


# the Jetson kit and bundles


def test_kit_ships_the_decoder_with_its_sha256(tmp_path, task):
    build = make_build(tmp_path / "build", task)
    kit = json.loads((build / "manifest.json").read_text())["jetson"]
    assert kit["decoder"] == "detection_decode.py"
    assert (build / "detection_decode.py").read_bytes() == DECODER.read_bytes()
    assert kit["sha256"]["detection_decode.py"] == files.sha256(DECODER)
    assert set(kit["sha256"]) == {"build_engine.sh", "device_validate.py", "detection_decode.py"}


@pytest.mark.parametrize("target", sorted(TARGET_ARTIFACTS))
def test_detection_bundle_ships_the_decode_and_anchors(tmp_path, task, target):
    build = make_build(tmp_path / "build", task, target=target)
    directory = make_bundle(build)
    info = json.loads((directory / "bundle.json").read_text())
    doc = json.loads((build / "manifest.json").read_text())
    assert info["task"] == doc["task"] and info["task"]["decode"]["match_score"] == 0.3
    assert info["golden"] == {
        "inputs": "golden/inputs.npy",
        "eager_logits": "golden/eager_logits.npy",
        "anchors": "golden/anchors.npy",
        "eager_detections": "golden/eager_detections.json",
        "boxes": "golden/boxes.json",
    }
    assert (directory / info["task"]["decode"]["code"]).read_bytes() == DECODER.read_bytes()
    np.testing.assert_array_equal(np.load(directory / info["task"]["decode"]["anchors"]), task.anchors)
    listed = {f["path"]: f["sha256"] for f in info["files"]}
    assert listed["detection_decode.py"] == files.sha256(DECODER)
    assert listed["golden/anchors.npy"] == files.sha256(build / "golden" / "anchors.npy")
    assert ("device_validate.py" in listed) == (target == "jetson")
    if target == "jetson":  # the bundled validator runs inside the bundle, with the bundled decoder
        result = _device_validate(directory)
        assert result.returncode == 0 and result.stdout.startswith("PASSED onnx_fp32"), result.stdout + result.stderr


def test_unlabeled_detection_bundle_has_no_ground_truth_boxes(tmp_path, task):
    info = json.loads((make_bundle(make_build(tmp_path / "build", task, labeled=False)) / "bundle.json").read_text())
    assert set(info["golden"]) == {"inputs", "eager_logits", "anchors", "eager_detections"}


def test_bundle_ships_the_decode_the_build_validated_with(tmp_path, task):
    build = make_build(tmp_path / "build", task, target="android")
    doc = json.loads((build / "manifest.json").read_text())
    assert doc["task"]["decode"]["code_sha256"] == files.sha256(build / "detection_decode.py")
    with open(build / "detection_decode.py", "a") as f:
        f.write("# edited after the build\n")
    with pytest.raises(UsageError, match="detection_decode.py does not match the sha256 in its manifest"):
        make_bundle(build)
    (build / "detection_decode.py").unlink()
    with pytest.raises(UsageError, match="detection_decode.py is missing: a detection bundle needs the build's decode"):
        make_bundle(build)
    assert not (build / "bundle").exists()


def test_detection_build_without_anchors_is_not_bundled(tmp_path, task):
    build = make_build(tmp_path / "build", task, target="android")
    (build / "golden" / "anchors.npy").unlink()
    with pytest.raises(UsageError, match="anchors.npy is missing: a detection bundle needs its anchors"):
        make_bundle(build)
    assert not (build / "bundle").exists()


# the reference apps


@pytest.mark.parametrize("app", sorted(DETECTION_READS))
def test_every_detection_key_an_app_reads_is_in_a_bundle(tmp_path, task, app):
    reads = DETECTION_READS[app]
    directory = make_bundle(make_build(tmp_path / "build", task, target=app))
    sources = "\n".join((APPS / path).read_text() for path in reads["sources"])
    info = json.loads((directory / "bundle.json").read_text())
    spec = json.loads((directory / info["preprocessing"]).read_text())
    for name, doc in (("bundle.json", info), ("preprocessing.json", spec)):
        for path in reads[name]:
            assert all(f'"{key.removesuffix("[]")}"' in sources for key in path.split(".")), (
                f"{app} does not read {path}"
            )
            assert _has(doc, path), f"{app} reads {name}: {path}, which the bundle lacks"
    decode = info["task"]["decode"]
    for path in [decode["anchors"], decode["code"], *info["golden"].values(), *(a["file"] for a in info["artifacts"])]:
        assert (directory / path).exists(), path
    quoted = set(re.findall(r'"([\w./-]+\.(?:json|txt|npy|png|py))"', sources))
    assert quoted <= {"bundle.json"}, (
        f"{app} hard-codes {quoted - {'bundle.json'}}; it should take names from bundle.json"
    )
    assert '"detection"' in sources


def _jetson_app():
    spec = importlib.util.spec_from_file_location("jetson_app", APPS / "jetson" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _app(*args):
    return run_without_torch(APPS / "jetson" / "app.py", *args)


def _photo(path: Path, width: int = 400, height: int = 300) -> Path:
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def test_jetson_app_golden_on_detection(tmp_path, task):
    directory = make_bundle(make_build(tmp_path / "build", task))
    result = _app(directory, "--golden")
    assert result.returncode == 0, result.stdout + result.stderr
    model, line = result.stdout.splitlines()
    assert model == "model: tiny_ssd_onnx_fp32.onnx (ONNX Runtime)"
    assert line.startswith(
        f"PASSED onnx_fp32 (onnxruntime, {IMAGES} golden inputs): matched recall 1.0000, precision 1.0000"
    ), line
    perturbed = make_bundle(make_build(tmp_path / "perturbed", task, perturb=3.0))
    result = _app(perturbed, "--golden")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        r"^FAILED onnx_fp32 .*; matched_recall 0\.\d+ \(\d+ of \d+ eager boxes unmatched", result.stdout, re.M
    ), result.stdout


def test_jetson_app_hands_the_decode_every_parameter_the_build_used(tmp_path, task):
    """The detector's kind (SSD, RetinaNet, FCOS) and whatever its decode takes reach the shipped decode."""
    directory = make_bundle(make_build(tmp_path / "build", task))
    app = _jetson_app()
    info, _, _ = app.load_bundle(directory)
    detector = app.Detector(directory, app.task_of(info))
    assert detector.params == json.loads(json.dumps(task.params)) and detector.params["kind"] == "ssd"


def test_jetson_app_prints_and_draws_boxes_at_the_image_size(tmp_path, task):
    directory = make_bundle(make_build(tmp_path / "build", task))
    photo = _photo(tmp_path / "photo.jpg")
    target = tmp_path / "out" / "boxes.png"
    result = _app(directory, photo, "--overlay", target)
    assert result.returncode == 0, result.stdout + result.stderr
    model, path, *rows, written = result.stdout.splitlines()
    assert model == "model: tiny_ssd_onnx_fp32.onnx (ONNX Runtime)" and path == str(photo)
    assert written == f"  overlay: {target}"

    # the same boxes as decoding the model's heads here, scaled from 320 x 320 to the photo's 400 x 300
    app = _jetson_app()
    _, _, spec = app.load_bundle(directory)
    with Image.open(photo) as image:
        x = app.preprocess(image, spec)
    head = ort.InferenceSession(str(directory / "tiny_ssd_onnx_fp32.onnx")).run(None, {"input": x})[0][0]
    found = detection_decode.decode(head, task.anchors, (SIZE, SIZE), task.params)
    shown = found["scores"] >= 0.3
    assert OBJECTS // 2 <= shown.sum() <= OBJECTS
    scale = np.array([400 / SIZE, 300 / SIZE] * 2)
    expected = [
        f"  {score:7.2%}  {LABELS[label]}  [{', '.join(f'{v:.1f}' for v in box * scale)}]"
        for box, score, label in zip(found["boxes"][shown], found["scores"][shown], found["labels"][shown])
    ]
    assert rows == expected

    with Image.open(target) as overlay, Image.open(photo) as original:
        assert overlay.format == "PNG" and overlay.size == (400, 300) and overlay.mode == "RGB"
        pixels, before = np.asarray(overlay), np.asarray(original.convert("RGB"))
    colours = app.palette(len(LABELS))
    for box, label in zip(found["boxes"][shown] * scale, found["labels"][shown]):
        x0, y0, x1, y1 = box
        middle = int((y0 + y1) / 2)
        assert pixels[middle, int(x0) + 1].tolist() == colours[label].tolist()  # the left edge, in the class colour
        assert (pixels[middle, int(x0) + 6] == before[middle, int(x0) + 6]).all()  # inside the box: the photo
    assert (pixels != before).any(-1).mean() < 0.2


def test_jetson_app_refuses_a_detection_bundle_without_its_decode(tmp_path, task):
    directory = make_bundle(make_build(tmp_path / "build", task))
    (directory / "detection_decode.py").unlink()
    result = _app(directory, _photo(tmp_path / "photo.png"))
    _one_error_line(result, "not a usable bundle", "detection_decode.py is missing")


def test_jetson_app_preprocessing_is_the_detection_transform(task):
    """An exact resize to 320 x 320 with PIL's bilinear filter, [0, 1], normalize with 0.5: the task's transform."""
    app = _jetson_app()
    spec = task.preprocessing(None)
    transform = task.transform(None)
    rng = np.random.default_rng(0)
    for width, height in [(640, 480), (320, 320), (57, 999)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        np.testing.assert_allclose(app.preprocess(image, spec), transform(image).numpy()[None], rtol=0, atol=1e-6)


def test_detector_scales_boxes_to_the_original_image(tmp_path, task):
    app = _jetson_app()
    directory = make_bundle(make_build(tmp_path / "build", task))
    info, _, _ = app.load_bundle(directory)
    detector = app.Detector(directory, app.task_of(info))
    head = np.load(directory / "golden" / "eager_logits.npy")[0]
    for (label, score, box), (label2, score2, box2) in zip(
        detector.shown(head, 640, 160), detector.shown(head, 320, 320)
    ):
        assert (label, score) == (label2, score2)
        assert box == pytest.approx([box2[0] * 2, box2[1] / 2, box2[2] * 2, box2[3] / 2])
    with pytest.raises(ValueError, match="3234 anchors"):
        detector(head[:-1])


def test_jetson_bundle_from_a_kit_is_byte_identical_to_a_fresh_copy(tmp_path, task):
    """The kit's copy (checked against the manifest's sha256) is what the jetson bundle carries."""
    build = make_build(tmp_path / "build", task)
    copy = shutil.copytree(build, tmp_path / "copy")
    (copy / "detection_decode.py").write_text("# changed after the build\n")
    with pytest.raises(UsageError, match="detection_decode.py does not match the sha256"):
        make_bundle(copy)
    assert (make_bundle(build) / "detection_decode.py").read_bytes() == DECODER.read_bytes()


@pytest.mark.parametrize(
    "kind, anchors, good, bad",
    [
        ("final", None, (300, 6), (300, 15)),  # the decode inside the graph (or Faster R-CNN): rows of 6
        ("ssd", 7, (7, 4 + 11), (7, 5 + 11)),
        ("fcos", 7, (7, 5 + 11), (7, 4 + 11)),  # FCOS: 4 distances and a centerness before the classes
    ],
)
def test_jetson_app_reads_each_output_layout_and_refuses_another(tmp_path, kind, anchors, good, bad):
    from exporter.device import detection_decode

    shutil.copy(detection_decode.__file__, tmp_path / "detection_decode.py")
    if anchors is not None:
        np.save(tmp_path / "anchors.npy", np.zeros((anchors, 4), dtype=np.float32))
    decode = {"kind": kind, "code": "detection_decode.py", "match_score": 0.3}
    decode["anchors"] = None if anchors is None else "anchors.npy"
    detector = _jetson_app().Detector(tmp_path, {"decode": decode, "input_size": [64, 64]})
    detector.check(np.zeros(good, dtype=np.float32), 11)
    with pytest.raises(ValueError, match=r"model outputs \(\d+, \d+\) per image; the bundle says"):
        detector.check(np.zeros(bad, dtype=np.float32), 11)
