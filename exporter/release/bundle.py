"""App bundles: per target, a directory and a zip an app or device project can drop in.

OUT/bundle/<target>/ holds the artifacts SELECTION picks from the build, labels.txt,
preprocessing.json, the golden files (inputs, eager logits; for segmentation the eager masks; for
detection the anchors and eager's decoded boxes), the build's manifest.json, any device kit files the
build wrote (Jetson: build_engine.sh, device_validate.py), for detection the build's detection_decode.py
(what turns the raw heads into boxes, on every target; checked against its sha256) and bundle.json,
which lists every file with its sha256, the model's task (classification, segmentation or detection:
its input size, output layout and, for detection, the decode parameters and where the anchors and
decode code are) and, per artifact, its validation results and the runtime it needs. An artifact
with a `bundled_program` in the manifest (a `.pte`'s ExecuTorch golden program, `.bpte`) brings it along,
checked against its sha256, and bundle.json lists it under that artifact with its rtol/atol and verifications.
OUT/bundle/<target>.zip holds the same files, built byte for byte reproducibly.
"""

from __future__ import annotations

import json
import shutil
import stat
import zipfile
from pathlib import Path

from .. import files
from . import manifest
from ..errors import UsageError
from ..precision import FP16_ARITHMETIC_NEEDED, NEEDS_FP16_ARITHMETIC, Precision
from ..results import ArtifactResult, Manifest, Status, jsonable, texts

# Bumped only when an existing reader would misread a bundle it used to read. "task" is additive: a
# classification bundle reads as before, a bundle without "task" is classification, and apps decide
# segmentation from task.name, not from this number. An artifact's "bundled_program" (and its .bpte file) is
# additive too: a reader that does not know it reads the bundle as before.
BUNDLE_VERSION = 1

# Per target, the artifacts a bundle carries, keyed by (format, precision) and listed in the order
# an app should try them; the value is the artifact's role in bundle.json.
SELECTION = {
    "android": {
        ("executorch", Precision.INT8): "primary",
        ("executorch", Precision.INT8_DYNAMIC): "alternative",
        ("executorch", Precision.FP16): "alternative",  # on cores with FP16 arithmetic (record["cpu_needs"])
        ("executorch", Precision.FP32): "fallback",
        ("litert", Precision.INT8): "alternative",
        ("litert", Precision.INT8_DYNAMIC): "alternative",
        ("litert", Precision.FP16): "alternative",  # fp16 arithmetic where the core has it, fp32 elsewhere
        # no w8a16: int16 kernels are the interpreter's reference ones, ~20x fp32's instructions on an Arm CPU
        # (docs/precisions.md); a build makes it on request, for NPU delegates that take int16 activations
        ("litert", Precision.FP32): "alternative",
        ("torchscript_lite", Precision.FP32): "alternative",  # PyTorch Mobile: end-of-life, last
    },
    "ios": {
        ("coreml", Precision.FP16): "primary",
        ("coreml", Precision.FP32): "fallback",
        ("executorch", Precision.INT8): "alternative",
        ("executorch", Precision.FP16): "alternative",
        ("executorch", Precision.FP32): "alternative",
    },
    "jetson": {
        ("onnx", Precision.FP16): "primary",
        ("onnx", Precision.FP32): "fallback",
        ("onnx", Precision.INT8): "alternative",
    },
}

# What a device needs to run each format: versions of the tools that wrote it (the manifest's
# tools{}) and facts from the artifact's details (dotted paths).
RUNTIME = {
    "executorch": (("executorch",), {"delegate": "delegation.delegate"}),
    "torchscript_lite": (("torch",), {}),
    # the interpreter's input and output tensors (name, shape, dtype): float32 for both precisions (formats/litert.py)
    "litert": (("ai-edge-litert",), {"io": "io"}),
    "coreml": (("coremltools",), {"minimum_deployment_target": "deployment_target", "spec_version": "spec_version"}),
    "onnx": (("onnx", "onnxruntime"), {"opset": "opset"}),
}

SIDE_FILES = ("labels.txt", "preprocessing.json", "manifest.json")
# bundle.json "golden" key -> file; whichever the build wrote (masks: segmentation; anchors and
# detections: detection; labels.json, masks.npy and boxes.json only for labeled data)
GOLDEN = {
    "inputs": "golden/inputs.npy",
    "inputs_uint8": "golden/inputs_uint8.npy",  # the same images as uint8-nhwc artifacts take them
    "eager_logits": "golden/eager_logits.npy",
    "labels": "golden/labels.json",
    "eager_masks": "golden/eager_masks.npy",
    "masks": "golden/masks.npy",
    "anchors": "golden/anchors.npy",
    "eager_detections": "golden/eager_detections.json",
    "boxes": "golden/boxes.json",
}
FLOAT_INPUT = {"format": "float32-nchw", "dtype": "float32", "layout": "NCHW"}
FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can store: entries carry no build time


def _read_build(out: Path) -> tuple[dict, Manifest]:
    """The build's manifest as its JSON file holds it (what the checks of its files read) and as its values."""
    record = manifest.read_build(out)  # every key read below is there, of its type
    check_target(record["target"]["name"])
    return record, Manifest.from_json(record)


def check_target(name: str) -> None:
    """A bundle is made for the targets it has a selection for (build --bundle checks before it builds)."""
    if name not in SELECTION:
        raise UsageError(f"no bundle selection for target {name!r}; bundles exist for {', '.join(SELECTION)}")


def _selected(doc: Manifest, allow_failed: bool) -> list[tuple[str, ArtifactResult]]:
    roles = SELECTION[doc.target["name"]]
    matching = [(roles[key], a) for key in roles for a in doc.artifacts if (a.format, a.precision) == key]
    failed = [a for _, a in matching if a.status is Status.FAILED]
    if failed and not allow_failed:
        names = "; ".join(f"{a.name} ({_reasons(a)})" for a in failed)
        raise UsageError(f"artifacts failed: {names}; pass --allow-failed to bundle the rest anyway")
    chosen = [(role, a) for role, a in matching if a.path is not None]  # a failed export has no file
    if not chosen:
        raise UsageError(
            f"{doc.target['name']} build has none of the artifacts a bundle carries: "
            f"{'; '.join(_why_missing(doc, key) for key in roles)}"
        )
    return chosen


def _why_missing(doc: Manifest, key: tuple[str, str]) -> str:
    """Why the build has no file for the (format, precision) a bundle wants: not built, or its status and reasons."""
    entries = [a for a in doc.artifacts if (a.format, a.precision) == key]
    if not entries:
        return f"{key[0]}:{key[1]} is not in the build"
    return "; ".join(f"{a.name} {a.status.value}, no file ({_reasons(a)})" for a in entries)


def _reasons(entry: ArtifactResult) -> str:
    """An artifact's reasons on one line (an exception's message may run over several)."""
    return " ".join(", ".join(texts(entry.reasons)).split()) or "no reason recorded"


def _inside(root: Path, relative: str) -> Path:
    """`root / relative`, refused unless it stays inside root (no absolute paths, no `..`): a path into the bundle
    (a file of the build is read through files.build_file)."""
    return root / files.relative_path(relative, "the bundle directory")


def _copy(out: Path, stage: Path, relative: str, sha256: str | None = None) -> None:
    source, target = files.build_file(out, relative, folder_ok=True), _inside(stage, relative)
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True)  # links are refused when listed, never followed
    else:
        files.copy(source, target)  # with its companions (an ONNX graph's external data)
        shutil.copymode(source, target)
    # checked on the copy, so what is bundled is what was validated
    if sha256 is not None and files.sha256(target) != sha256:
        raise UsageError(f"{source} does not match the sha256 in its manifest (changed or truncated)")


def _dig(details: dict, dotted: str):
    for key in dotted.split("."):
        details = details.get(key) if isinstance(details, dict) else None
    return details


def _runtime(doc: Manifest, entry: ArtifactResult) -> dict:
    tools, facts = RUNTIME[entry.format]
    needs = {tool: doc.tools.get(tool) for tool in tools}
    needs.update({key: _dig(entry.details or {}, path) for key, path in facts.items()})
    return needs


def _artifact(doc: Manifest, role: str, entry: ArtifactResult) -> dict:
    record = {
        "name": entry.name,
        "role": role,
        "file": entry.path,
        "format": entry.format,
        "precision": entry.precision,
        "status": entry.status,
        "reasons": entry.reasons,
        "sha256": entry.sha256,
        "size_bytes": entry.size_bytes,
        "thresholds": entry.thresholds,
        "fidelity": entry.fidelity,
        "golden_fidelity": entry.golden_fidelity,  # what device_validate.py holds a device's run to
        "accuracy": entry.accuracy,
        "runtime": _runtime(doc, entry),
    }
    needs = list(entry.details.get("cpu_needs") or [])
    if needs:  # what an app checks on the device before it loads the file (apps/android: /proc/cpuinfo)
        record["cpu_needs"] = needs
    if NEEDS_FP16_ARITHMETIC in needs:
        record["cpu_needs_why"] = FP16_ARITHMETIC_NEEDED
    # what the app feeds it: Core ML's own input (details), else the build's input format (absent in manifests
    # older than it: float32-nchw)
    record["input"] = entry.details["input"] if entry.format == "coreml" else entry.input or FLOAT_INPUT
    golden_program = entry.bundled_program
    if golden_program:
        # ExecuTorch's own golden program: the .pte with the golden inputs and its outputs, which the
        # runtime's verifier checks within rtol/atol (docs/validation.md); verified: where the build ran it
        record["bundled_program"] = {
            "file": golden_program.path,
            "sha256": golden_program.sha256,
            "rtol": golden_program.rtol,
            "atol": golden_program.atol,
            "verified": golden_program.verified,
        }
    memory = entry.memory.to_json() if entry.memory else {}
    if memory.get("available"):  # how much RAM the app needs for it (measured on the build host, docs/validation.md)
        record["memory"] = {
            k: memory[k]
            for k in (
                "peak_rss_increase_bytes",
                "planned_bytes",
                "constants_bytes",
                "runtime_baseline_rss_bytes",
                "peak_rss_bytes",
            )
            if k in memory
        }
    if entry.aarch64:  # the same artifact judged on emulated aarch64 CPUs (no latency: emulated), with its
        # instruction counts there where they were made (labelled: not time)
        record["aarch64"] = [
            {
                k: getattr(row, k)
                for k in ("cpu", "status", "reasons", "fidelity", "vs_x86", "emulated", "instructions")
                if k != "instructions" or row.instructions
            }
            for row in entry.aarch64
        ]
    engine = next((e for e in (doc.jetson or {}).get("engines", []) if e["onnx"] == entry.path), None)
    if engine:
        # built on the device by build_engine.sh: engines do not carry across GPUs or TensorRT versions
        record["engine"] = {
            "file": engine["engine"],
            "batch_profile": engine["options"]["batch"],
            "tensorrt_major": sorted(int(m) for m in engine["trtexec"]),
        }
    return jsonable(record)


def _listing(stage: Path) -> list[dict]:
    listed = []
    for path in sorted(stage.rglob("*")):
        arcname = path.relative_to(stage).as_posix()
        if path.is_symlink():
            raise UsageError(f"{arcname} is a symbolic link; bundles hold regular files only")
        if path.is_file():
            _inside(stage, arcname)
            listed.append({"path": arcname, "sha256": files.file_sha256(path), "size_bytes": path.stat().st_size})
    return listed


def _write_zip(stage: Path, path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for arcname in sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()):
            source = _inside(stage, arcname)
            info = zipfile.ZipInfo(arcname, date_time=FIXED_TIME)
            info.create_system = 3  # unix, so the mode below is honoured on extraction
            executable = source.stat().st_mode & stat.S_IXUSR
            info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            info.file_size = source.stat().st_size  # decides zip64 up front for large artifacts
            with open(source, "rb") as src, zf.open(info, "w") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


def _describe(doc: Manifest, chosen: list[tuple[str, ArtifactResult]], golden: dict, listed: list[dict]) -> dict:
    return {
        "bundle_version": BUNDLE_VERSION,
        "target": doc.target["name"],
        "weight": {"name": doc.weight.name, "model": doc.weight.model, "num_classes": doc.weight.num_classes},
        "task": doc.task,
        "build": {
            "exporter_version": doc.exporter_version,
            "created": doc.created,
            "validated": doc.validated,
            "status": doc.status.value,
            "manifest": "manifest.json",
        },
        "labels": "labels.txt",
        "preprocessing": "preprocessing.json",
        "golden": golden,
        "data": doc.data,
        "eager": jsonable(doc.eager),
        "artifacts": [_artifact(doc, role, entry) for role, entry in chosen],
        # jetson: what finishes and checks the build on the device (the app's --golden runs the validator)
        "device_kit": {k: doc.jetson[k] for k in ("validator", "build_script")} if doc.jetson is not None else None,
        "files": listed,
    }


def _plan(out: Path, allow_failed: bool) -> tuple[Manifest, list[tuple[str, ArtifactResult]], dict]:
    """Everything that can be refused before a file is copied."""
    record, doc = _read_build(out)
    manifest.check_artifacts(out, record)  # every one, not only those bundled: none is left unchecked unsaid
    chosen = _selected(doc, allow_failed)
    manifest.check_side_files(out, record)
    golden = {key: path for key, path in GOLDEN.items() if files.build_file(out, path, missing_ok=True)}
    task = doc.task
    if task["name"] == "detection":
        decode = task.get("decode") or {}
        if "anchors" not in decode or not decode.get("code"):
            raise UsageError(
                f"{out / 'manifest.json'} has a detection task without decode anchors and code; run the build again"
            )
        if not files.build_file(out, decode["code"], missing_ok=True):
            raise UsageError(
                f"{out / decode['code']} is missing: a detection bundle needs the build's decode; run the build again"
            )
        if decode["anchors"] and not files.build_file(out, decode["anchors"], missing_ok=True):  # None: decoded inside
            raise UsageError(
                f"{out / decode['anchors']} is missing: a detection bundle needs its anchors; run the build again"
            )
    return doc, chosen, golden


def make_bundles(out_dir, allow_failed: bool = False) -> list[Path]:
    """Bundle one build directory, or every target of a several-target build (OUT/<target>/) into
    OUT/bundle/. All targets are checked before any is written; each bundle is written whole or not
    at all (a file that fails its sha256 while being copied stops at that target)."""
    out = Path(out_dir)
    builds = manifest.target_folders(out)
    if (out / "manifest.json").is_file() or not builds:
        return [make_bundle(out, allow_failed)]
    for build in builds:
        _plan(build, allow_failed)
    return [make_bundle(build, allow_failed, dest=out / "bundle") for build in builds]


def make_bundle(out_dir, allow_failed: bool = False, dest=None) -> Path:
    """Write DEST/<target>/ and DEST/<target>.zip (DEST defaults to OUT/bundle); returns the directory."""
    out = Path(out_dir)
    doc, chosen, golden = _plan(out, allow_failed)
    dest = Path(dest) if dest is not None else out / "bundle"
    fresh = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    target = doc.target["name"]
    try:
        with files.atomic_path(dest / target) as stage, files.atomic_path(dest / f"{target}.zip") as zip_tmp:
            stage.mkdir()
            for _, entry in chosen:
                _copy(out, stage, entry.path, entry.sha256)
                if entry.bundled_program:  # beside its .pte, as in the build directory
                    _copy(out, stage, entry.bundled_program.path, entry.bundled_program.sha256)
            for name, sha256 in (doc.jetson or {}).get("sha256", {}).items():
                _copy(out, stage, name, sha256)
            for name in (*SIDE_FILES, *golden.values()):
                _copy(out, stage, name)
            reference = (doc.preprocessing or {}).get("reference")  # numpy: the app's resize (and crop)
            if reference:
                _copy(out, stage, reference["file"])
            decode = (doc.task or {}).get("decode")
            if decode:  # detection: the apps find both where task.decode says
                if decode["anchors"] and not _inside(stage, decode["anchors"]).exists():
                    _copy(out, stage, decode["anchors"])
                if not _inside(stage, decode["code"]).exists():
                    _copy(out, stage, decode["code"], decode.get("code_sha256"))
            described = _describe(doc, chosen, golden, _listing(stage))
            (stage / "bundle.json").write_text(
                json.dumps(described, indent=2, allow_nan=False) + "\n", encoding="utf-8"
            )
            _write_zip(stage, zip_tmp)
    except BaseException:
        if fresh:  # a refused bundle leaves nothing behind
            shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest / target


def zip_path(bundle_dir: Path) -> Path:
    return Path(bundle_dir).with_name(Path(bundle_dir).name + ".zip")


def extract_bundle(zip_file, dest) -> Path:
    """Unpack a bundle zip into DEST (new or empty), refusing entries that would land outside it
    and files that do not match bundle.json."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} exists and is not an empty directory")
    try:
        zf = zipfile.ZipFile(zip_file)
    except (OSError, zipfile.BadZipFile) as e:
        raise UsageError(f"cannot open {zip_file}: {e}") from None
    with zf:
        for info in zf.infolist():
            _inside(dest, info.filename.rstrip("/"))
            if stat.S_ISLNK(info.external_attr >> 16):
                raise UsageError(f"{zip_file}: entry {info.filename!r} is a symbolic link")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            dest.rmdir()
        with files.atomic_path(dest) as stage:
            zf.extractall(stage)
            for info in zf.infolist():  # extractall drops the modes (build_engine.sh is executable)
                mode = (info.external_attr >> 16) & 0o777
                if info.create_system == 3 and mode and not info.is_dir():
                    (stage / info.filename).chmod(mode)
            _check_listing(stage, zip_file)
    return dest


def _check_listing(root: Path, source) -> None:
    try:
        listed = json.loads((root / "bundle.json").read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, RecursionError) as e:  # RecursionError: JSON nested past Python's reach
        raise UsageError(f"{source} has no readable bundle.json: {e}") from None
    for item in listed:
        path = _inside(root, item["path"])
        if not path.is_file() or files.file_sha256(path) != item["sha256"]:
            raise UsageError(f"{source}: {item['path']} is missing or does not match its sha256 in bundle.json")
