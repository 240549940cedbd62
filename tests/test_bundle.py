"""App bundles (`exporter bundle`) and the reference apps that consume them, on the trained digits model."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from PIL import Image

from exporter.release import manifest
from exporter.release.bundle import extract_bundle, make_bundle
from exporter.errors import UsageError

from .helpers import ROOT, build_args, run_cli, run_without_torch
from .fake_manifest import complete

slow = pytest.mark.slow  # the tests on real builds; those on fake manifests (below the fixtures) are fast

APPS = ROOT / "apps"

# Every file and JSON key each reference app reads. A key path is dotted; "[]" is any element of a list.
APP_READS = {
    "android": {
        "sources": [
            "android/app/src/main/java/org/example/bundleclassifier/BundleClassifier.kt",
            "android/app/src/main/java/org/example/bundleclassifier/Preprocess.kt",
            "android/app/build.gradle.kts",
        ],
        "bundle.json": [
            "labels",
            "preprocessing",
            "artifacts[].format",
            "artifacts[].file",
            "artifacts[].name",
            "artifacts[].status",
            "artifacts[].runtime.executorch",
            "artifacts[].runtime.ai-edge-litert",
            "artifacts[].runtime.io.inputs[].shape",
            "artifacts[].runtime.io.inputs[].dtype",
            "artifacts[].runtime.io.inputs[].name",
            "artifacts[].runtime.io.outputs[].dtype",
            "artifacts[].runtime.io.outputs[].name",
            "artifacts[].input.dtype",
        ],
        "preprocessing.json": ["resize_size", "crop_size", "interpolation", "mean", "std"],
    },
    "ios": {
        "sources": ["ios/Sources/ExporterBundle/BundleClassifier.swift"],
        "bundle.json": [
            "labels",
            "preprocessing",
            "artifacts[].format",
            "artifacts[].file",
            "artifacts[].name",
            "artifacts[].status",
            "artifacts[].input.name",
            "artifacts[].input.type",
        ],
        "preprocessing.json": ["resize_size", "crop_size", "interpolation"],
    },
    "jetson": {
        # --golden hands artifacts[] records to the bundled device_validate.py, run on real bundles elsewhere
        "sources": ["jetson/app.py"],
        "bundle.json": [
            "labels",
            "preprocessing",
            "artifacts[].format",
            "artifacts[].file",
            "artifacts[].name",
            "artifacts[].engine.file",
            "artifacts[].engine.batch_profile",
            "device_kit.validator",
        ],
        "preprocessing.json": ["resize_size", "crop_size", "interpolation", "mean", "std", "dtype"],
    },
}


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(directory) -> dict:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(result, *needles):
    """Exit 2 with one line on stderr and no traceback."""
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def _bundled(result, out, target):
    assert result.exit_code == 0, (result.output, result.exception)
    directory, archive = out / "bundle" / target, out / "bundle" / f"{target}.zip"
    assert result.stdout.splitlines() == [f"bundle: {directory}", f"zip: {archive}"]
    return directory, archive


@pytest.fixture(scope="module")
def android(android_build, tmp_path_factory):
    source, result = android_build
    assert result.exit_code == 0, result.output
    out = tmp_path_factory.mktemp("bundle") / "build"
    shutil.copytree(source, out)
    directory, archive = _bundled(run_cli("bundle", out), out, "android")
    return out, directory, archive, json.loads((directory / "bundle.json").read_text())


@pytest.fixture(scope="module")
def jetson(tmp_path_factory, digits_model):
    pytest.importorskip("onnxruntime")
    out = tmp_path_factory.mktemp("jetson_bundle") / "build"
    result = run_cli(*build_args(digits_model, out, "--target", "jetson", "--format", "onnx:fp32"))
    assert result.exit_code == 0, result.output
    directory, _ = _bundled(run_cli("bundle", out), out, "jetson")
    return out, directory


@pytest.fixture(scope="module")
def ios(tmp_path_factory, digits_model):
    pytest.importorskip("coremltools")
    out = tmp_path_factory.mktemp("ios_bundle") / "build"
    result = run_cli(*build_args(digits_model, out, "--target", "ios", "--format", "coreml:fp32"))
    assert result.exit_code == 0, result.output  # Core ML is `unavailable` off macOS, which is not a failure
    directory, _ = _bundled(run_cli("bundle", out), out, "ios")
    return out, directory


@slow
def test_bundle_holds_the_files_bundle_json_lists(android):
    out, directory, _, info = android
    doc = json.loads((out / "manifest.json").read_text())
    assert info["bundle_version"] == 1 and info["target"] == "android"
    assert info["weight"]["name"] == doc["weight"]["name"]
    listed = {f["path"]: f for f in info["files"]}
    assert set(listed) == set(_files(directory)) - {"bundle.json"}
    for path, item in listed.items():
        assert _sha256(directory / path) == item["sha256"] and (directory / path).stat().st_size == item["size_bytes"]
    assert {"labels.txt", "preprocessing.json", "manifest.json", "golden/inputs.npy", "golden/eager_logits.npy"} <= set(
        listed
    )
    assert (directory / "labels.txt").read_bytes() == (out / "labels.txt").read_bytes()
    assert (directory / "preprocessing.json").read_bytes() == (out / "preprocessing.json").read_bytes()


@slow
def test_android_selection_validation_results_and_runtime(android):
    out, directory, _, info = android
    doc = json.loads((out / "manifest.json").read_text())
    entries = {a["name"]: a for a in doc["artifacts"]}
    assert [(a["format"], a["precision"], a["role"]) for a in info["artifacts"]] == [
        ("executorch", "int8", "primary"),
        ("executorch", "fp32", "fallback"),
        ("litert", "int8", "alternative"),
        ("litert", "fp32", "alternative"),
        ("torchscript_lite", "fp32", "alternative"),
    ]
    for artifact in info["artifacts"]:
        entry = entries[artifact["name"]]
        assert artifact["file"] == entry["path"] and _sha256(directory / artifact["file"]) == entry["sha256"]
        assert (artifact["status"], artifact["fidelity"], artifact["accuracy"]) == (
            entry["status"],
            entry["fidelity"],
            entry["accuracy"],
        )
    assert info["artifacts"][0]["runtime"] == {"executorch": doc["tools"]["executorch"], "delegate": "XnnpackBackend"}
    assert info["artifacts"][4]["runtime"] == {"torch": doc["tools"]["torch"]}
    for litert in info["artifacts"][2:4]:  # what an app feeds the .tflite and reads back, and the runtime it needs
        io = entries[litert["name"]]["details"]["io"]
        assert litert["runtime"] == {"ai-edge-litert": doc["tools"]["ai-edge-litert"], "io": io}
        assert [t["dtype"] for t in io["inputs"] + io["outputs"]] == ["float32", "float32"]
        assert io["inputs"][0]["shape"] == [1, 3, *doc["task"]["input_size"]]
    assert info["eager"] == doc["eager"] and info["eager"]["accuracy"] is not None


@slow
def test_zip_holds_exactly_the_directory(android):
    _, directory, archive, _ = android
    with zipfile.ZipFile(archive) as zf:
        assert zf.namelist() == sorted(zf.namelist())
        assert {name: zf.read(name) for name in zf.namelist()} == _files(directory)
        assert {info.date_time for info in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}


@slow
def test_bundling_twice_gives_byte_identical_zips(android, tmp_path):
    out, directory, archive, _ = android
    again = make_bundle(out, dest=tmp_path / "again")
    assert (tmp_path / "again" / "android.zip").read_bytes() == archive.read_bytes()
    assert _files(again) == _files(directory)
    make_bundle(out, dest=tmp_path / "again")  # over an existing bundle
    assert (tmp_path / "again" / "android.zip").read_bytes() == archive.read_bytes()
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["android", "android.zip"]


@slow
def test_failed_build_is_refused_unless_allowed(android, tmp_path):
    out = tmp_path / "build"
    shutil.copytree(android[0], out, ignore=shutil.ignore_patterns("bundle"))
    validated = run_cli("validate", out, "--quiet", "--threshold", "fp32.psnr_db=1000")
    assert validated.exit_code == 1, validated.output
    _refused(run_cli("bundle", out), "executorch_fp32", "--allow-failed")
    assert not (out / "bundle").exists()
    directory, _ = _bundled(run_cli("bundle", out, "--allow-failed"), out, "android")
    statuses = {a["name"]: a["status"] for a in json.loads((directory / "bundle.json").read_text())["artifacts"]}
    assert statuses["executorch_fp32"] == "failed" and statuses["executorch_int8"] == "passed"


@slow
def test_several_target_build_gets_one_bundle_per_target(android, jetson, tmp_path):
    base = tmp_path / "several"  # the layout of `exporter build --target android --target jetson --out base`
    shutil.copytree(android[0], base / "android", ignore=shutil.ignore_patterns("bundle"))
    shutil.copytree(jetson[0], base / "jetson", ignore=shutil.ignore_patterns("bundle"))
    result = run_cli("bundle", base)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        line
        for t in ("android", "jetson")
        for line in (f"bundle: {base / 'bundle' / t}", f"zip: {base / 'bundle' / t}.zip")
    ]
    assert (base / "bundle" / "android.zip").read_bytes() == android[2].read_bytes()
    assert json.loads((base / "bundle" / "jetson" / "bundle.json").read_text())["target"] == "jetson"
    # a failed target refuses the lot, before android (which passes and comes first) is written
    shutil.rmtree(base / "bundle")
    assert run_cli("validate", base / "jetson", "--quiet", "--threshold", "fp32.psnr_db=1000").exit_code == 1
    _refused(run_cli("bundle", base), "onnx_fp32", "--allow-failed")
    assert not (base / "bundle").exists()


@slow
@pytest.mark.parametrize("damage", ["append", "truncate"])
def test_tampered_artifact_is_refused(android, tmp_path, damage):
    out, _, _, info = android
    copy = tmp_path / "build"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("bundle"))
    victim = copy / info["artifacts"][0]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data + b"\0" if damage == "append" else data[: len(data) // 2])
    _refused(run_cli("bundle", copy), victim.name, "sha256")
    assert not (copy / "bundle").exists()


@slow
def test_extract_round_trips_and_refuses_escaping_entries(android, tmp_path):
    _, directory, archive, _ = android
    assert _files(extract_bundle(archive, tmp_path / "unpacked")) == _files(directory)
    for name in ("../evil", "/abs/evil", "golden/../../evil"):
        bad = tmp_path / "bad.zip"
        with zipfile.ZipFile(bad, "w") as zf:
            zf.writestr("bundle.json", "{}")
            zf.writestr(name, b"x")
        with pytest.raises(UsageError, match="would leave the bundle directory"):
            extract_bundle(bad, tmp_path / "dest")
        assert not (tmp_path / "dest").exists() and not (tmp_path / "evil").exists()


def _has(doc, path: str) -> bool:
    head, _, rest = path.partition(".")
    if head.endswith("[]"):
        items = doc.get(head[:-2]) if isinstance(doc, dict) else None
        return isinstance(items, list) and any(_has(item, rest) for item in items)
    if not isinstance(doc, dict) or head not in doc:
        return False
    return not rest or _has(doc[head], rest)


@slow
@pytest.mark.parametrize("app", sorted(APP_READS))
def test_every_file_and_key_an_app_reads_is_in_a_fresh_bundle(app, request):
    reads = APP_READS[app]
    directory = request.getfixturevalue(app)[1]
    sources = "\n".join((APPS / path).read_text() for path in reads["sources"])
    info = json.loads((directory / "bundle.json").read_text())
    assert '"bundle.json"' in sources
    for name in ("bundle.json", "preprocessing.json"):
        doc = info if name == "bundle.json" else json.loads((directory / info["preprocessing"]).read_text())
        for path in reads[name]:
            assert all(f'"{key.removesuffix("[]")}"' in sources for key in path.split(".")), (
                f"{app} does not read {path}"
            )
            assert _has(doc, path), f"{app} reads {name}: {path}, which the bundle lacks"
    # the files it opens through bundle.json's names, and nothing it names that is not there
    for path in [
        info["labels"],
        info["preprocessing"],
        *info["golden"].values(),
        *(a["file"] for a in info["artifacts"]),
    ]:
        assert (directory / path).exists(), path
    quoted = set(re.findall(r'"([\w./-]+\.(?:json|txt|npy))"', sources))
    assert quoted <= {"bundle.json"}, (
        f"{app} hard-codes {quoted - {'bundle.json'}}; it should take names from bundle.json"
    )


@slow
def test_jetson_bundle_carries_the_device_kit(jetson):
    out, directory = jetson
    info = json.loads((directory / "bundle.json").read_text())
    assert [(a["format"], a["precision"]) for a in info["artifacts"]] == [("onnx", "fp32")]
    onnx = info["artifacts"][0]
    doc = json.loads((out / "manifest.json").read_text())
    assert onnx["runtime"] == {"onnx": doc["tools"]["onnx"], "onnxruntime": doc["tools"]["onnxruntime"], "opset": 18}
    assert onnx["engine"] == {
        "file": "mobilenet_v3_small_tensorrt_fp32.engine",
        "batch_profile": [1, 1, 8],
        "tensorrt_major": [10, 11],
    }
    for name in ("build_engine.sh", "device_validate.py"):
        assert (directory / name).read_bytes() == (out / name).read_bytes()
    assert (directory / "build_engine.sh").stat().st_mode & 0o100
    # the bundled validator finds everything it needs inside the bundle
    checked = subprocess.run(
        [sys.executable, directory / "device_validate.py", directory, "--runtime", "onnxruntime"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0 and checked.stdout.startswith("PASSED onnx_fp32"), checked.stdout + checked.stderr


def _app(*args):
    return run_without_torch(APPS / "jetson" / "app.py", *args)


@slow
def test_jetson_app_reproduces_golden_top1(jetson):
    _, directory = jetson
    result = _app(directory, "--golden")
    count = len(np.load(directory / "golden" / "inputs.npy"))
    assert result.returncode == 0, result.stdout + result.stderr
    model, line = result.stdout.splitlines()
    assert model == "model: mobilenet_v3_small_onnx_fp32.onnx (ONNX Runtime)"
    assert line.startswith(f"PASSED onnx_fp32 (onnxruntime, {count} golden inputs): top1 1.000"), line


@slow
def test_jetson_app_classifies_an_image(jetson, digits_model, tmp_path):
    _, directory = jetson
    image = next(p for p in sorted(digits_model.data_dir.rglob("*")) if p.is_file())
    result = _app(directory, image)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    labels = set((directory / "labels.txt").read_text().splitlines())
    assert lines[1] == str(image) and len(lines) == 7
    assert all(line.split(maxsplit=1)[1] in labels for line in lines[2:])


@slow
def test_jetson_app_preprocessing_is_the_weights_transforms(digits_model):
    from torchvision.models import get_weight

    from exporter.weights import preprocessing_spec

    module_spec = importlib.util.spec_from_file_location("jetson_app", APPS / "jetson" / "app.py")
    app = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(app)

    weights = get_weight(digits_model.weight)
    spec = json.loads(json.dumps(preprocessing_spec(weights)))
    rng = np.random.default_rng(0)
    for width, height in [(300, 200), (200, 300), (256, 256), (224, 224), (257, 999), (641, 480)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        expected = weights.transforms()(image).numpy()[None]
        np.testing.assert_array_equal(app.preprocess(image, spec), expected)


# --- fast: fake manifests, no model built ---


def _entry(fmt, precision, status="passed", reasons=(), path=None, data=b""):
    return {
        "name": f"{fmt}_{precision}",
        "format": fmt,
        "precision": precision,
        "path": path,
        "sha256": hashlib.sha256(data).hexdigest() if path else None,
        "size_bytes": len(data) if path else None,
        "status": status,
        "reasons": list(reasons),
        "details": {},
        "thresholds": {"top1_agreement": 1.0},
        "fidelity": None,
        "accuracy": None,
        "latency_ms": None,
        "eager_latency_ms": None,
        "speedup_vs_eager": None,
    }


def _fake_build(out, artifacts=(), target="android", **files_):
    """A build directory with a schema-valid manifest (and `files_`, name -> bytes, beside it)."""
    doc = complete(
        {
            "artifacts": list(artifacts),
            "target": {"name": target, "validate": {"arch": ["x86_64"], "cpus": []}},
            "tools": {"torch": "2.0.0", "torchvision": "0.20.0", "executorch": "1.0.0"},
        }
    )
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    for name, data in files_.items():
        (out / name).write_bytes(data)
    return out


def _manifest_refused(result, path, *needles):
    """Refused in one line naming the manifest, which is left as it was, with no bundle written."""
    before = path.read_bytes()
    _refused(result, str(path), *needles)
    assert path.read_bytes() == before and not (path.parent / "bundle").exists()


WRONG_SHAPES = {  # what is done to a good manifest -> what the one line says
    "a list": (lambda doc: [1, 2], "is not a build manifest: it holds list, not an object"),
    "schema version only": (lambda doc: {"schema_version": manifest.SCHEMA_VERSION}, "is a required property"),
    "schema version 2": (lambda doc: dict(doc, schema_version=2), "schema_version 2 (this exporter reads 4"),
    # schema 3 wrote each reason as a sentence; 4 as an object with its kind: a schema-3 build is built again
    "schema version 3": (
        lambda doc: dict(doc, schema_version=3),
        "schema_version 3 (this exporter reads 4: build it again)",
    ),
    "a reason without its kind": (
        lambda doc: dict(doc, artifacts=[dict(doc["artifacts"][0], reasons=["top1_agreement 0.5 (needs >= 1)"])]),
        "artifacts[0] (executorch_fp32).reasons[0]",  # an artifact is named beside its index
    ),
    "no target": (
        lambda doc: {k: v for k, v in doc.items() if k != "target"},
        "top level: 'target' is a required property",
    ),
    "target not an object": (lambda doc: dict(doc, target="android"), "target: 'android' is not of type 'object'"),
    "artifacts not a list": (
        lambda doc: dict(doc, artifacts={"executorch_fp32": {}}),
        "artifacts: {'executorch_fp32': {}} is not of type 'array'",
    ),
    "artifact without format": (
        lambda doc: dict(doc, artifacts=[{k: v for k, v in doc["artifacts"][0].items() if k != "format"}]),
        "artifacts[0] (executorch_fp32): 'format' is a required property",
    ),
    "no task (as before tasks)": (
        lambda doc: {k: v for k, v in doc.items() if k != "task"},
        "top level: 'task' is a required property",
    ),
    "null task": (lambda doc: dict(doc, task=None), "task: None is not of type 'object'"),
}


@pytest.mark.parametrize("command", ["validate", "bundle"])
@pytest.mark.parametrize("shape", sorted(WRONG_SHAPES))
def test_wrong_shape_manifest_is_refused_in_one_line(tmp_path, command, shape):
    out = _fake_build(
        tmp_path / "build", [_entry("executorch", "fp32", path="tiny.pte", data=b"pte")], **{"tiny.pte": b"pte"}
    )
    path = out / "manifest.json"
    good = json.loads(path.read_text())
    manifest.read_build(out)  # the fake itself is one the commands read
    damage, needle = WRONG_SHAPES[shape]
    path.write_text(json.dumps(damage(good)))
    _manifest_refused(run_cli(command, out, *(["--quiet"] if command == "validate" else [])), path, needle)


def test_broken_missing_and_unfinished_manifests_keep_their_messages(tmp_path):
    out = _fake_build(
        tmp_path / "build", [_entry("executorch", "fp32", path="tiny.pte", data=b"pte")], **{"tiny.pte": b"pte"}
    )
    path = out / "manifest.json"
    good = path.read_text()
    for command in ("validate", "bundle"):
        path.write_text(json.dumps(dict(json.loads(good), status="building", target=None)))
        _refused(run_cli(command, out), f"{out} is an unfinished build (status 'building'); run the build again")
        path.write_text('{"schema_version": 3,')
        _refused(run_cli(command, out), f"cannot read {path}: ")
        path.unlink()
        _refused(run_cli(command, out), f"{out} has no manifest.json; is it an exporter build directory?")
        path.mkdir()  # a folder where the manifest should be (bundle ended in IsADirectoryError)
        _refused(run_cli(command, out), f"{out} has no manifest.json; is it an exporter build directory?")
        path.rmdir()
        assert not (out / "bundle").exists()


def test_validate_on_a_several_target_folder_names_its_targets(tmp_path):
    base = tmp_path / "several"  # the layout of `exporter build --target android --target ios --out base`
    for target in ("android", "ios"):
        _fake_build(base / target, target=target)
    _refused(
        run_cli("validate", base),
        f"{base} is a several-target build: give one target's folder ({base / 'android'}, {base / 'ios'})",
    )
    assert sorted(p.name for p in base.iterdir()) == ["android", "ios"]
    # a folder with no build in it, nor below, is told so as before
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    _refused(run_cli("validate", tmp_path / "empty"), "has no manifest.json; is it an exporter build directory?")


def test_bundle_with_no_selected_file_says_why_each_is_missing(tmp_path):
    failed = _entry(
        "executorch",
        "int8",
        "failed",
        [{"kind": "export_failed", "text": "export failed: RuntimeError: quantize\n  at op 3"}],
    )
    unavailable = _entry(
        "torchscript_lite",
        "fp32",
        "unavailable",
        [{"kind": "unavailable_here", "text": "not built on this host: no lite interpreter"}],
    )
    out = _fake_build(
        tmp_path / "build",
        [failed, unavailable, _entry("onnx", "fp32", path="tiny.onnx", data=b"onnx")],
        **{"tiny.onnx": b"onnx"},
    )  # onnx is no android bundle's
    _refused(
        run_cli("bundle", out), "executorch_int8 (export failed: RuntimeError: quantize at op 3)", "--allow-failed"
    )
    _refused(
        run_cli("bundle", out, "--allow-failed"),
        "android build has none of the artifacts a bundle carries: ",
        "executorch_int8 failed, no file (export failed: RuntimeError: quantize at op 3)",
        "executorch:fp32 is not in the build",
        "torchscript_lite_fp32 unavailable, no file (not built on this host: no lite interpreter)",
    )
    assert not (out / "bundle").exists()
    # with one selected file there, the shape check lets the rest of bundle through
    good = _fake_build(
        tmp_path / "good",
        [failed, _entry("executorch", "fp32", path="tiny.pte", data=b"pte")],
        **{"tiny.pte": b"pte", "labels.txt": b"zero\none\n", "preprocessing.json": b"{}\n"},
    )
    (good / "golden").mkdir()
    for name in ("inputs.npy", "eager_logits.npy"):
        np.save(good / "golden" / name, np.zeros((1, 2), np.float32))
    directory, _ = _bundled(run_cli("bundle", good, "--allow-failed"), good, "android")
    assert [a["name"] for a in json.loads((directory / "bundle.json").read_text())["artifacts"]] == ["executorch_fp32"]
