"""The build manifest: one versioned schema, written atomically."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .. import files
from ..errors import UsageError
from ..results import Manifest, jsonable

SCHEMA_VERSION = 4  # 4: each reason an object with its kind ({"kind", "text", ...}), no longer a sentence
SCHEMA_FILE = Path(__file__).parent / "schema" / "manifest.schema.json"
# a build directory's own files and folders, beside its artifacts (removed first on --force)
BUILD_FILES = ("manifest.json", "report.md", "report.html", "labels.txt", "preprocessing.json")
BUILD_FOLDERS = ("golden", "previews")


def clear_build_files(out: Path) -> None:
    """What an earlier build left in `out` that this one writes anew: a stale golden/labels.json (from a build
    with --data, replaced by one without) would otherwise be bundled beside a manifest that says synthetic."""
    import shutil

    for name in BUILD_FILES:
        (out / name).unlink(missing_ok=True)
    for name in BUILD_FOLDERS:
        shutil.rmtree(out / name, ignore_errors=True)
    for staging in out.glob(".*.partial"):  # left by a killed build
        shutil.rmtree(staging, ignore_errors=True)


TOOLS = (
    "exporter",
    "torch",
    "torchvision",
    "executorch",
    "torchao",
    "coremltools",
    "onnx",
    "onnxruntime",
    "tensorrt",
    "litert-torch",
    "ai-edge-litert",
)


def tool_versions() -> dict:
    found = {}
    for name in TOOLS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def exporter_commit() -> str | None:
    """The git commit exporter runs from (with "-dirty" for local changes), when it is a checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host(threads: int) -> dict:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
    }


def _jsonable(value):
    """The manifest as JSON holds it: Reason values as their records, statuses as strings, infinities as text."""
    return _finite(jsonable(value))


def _finite(value):
    """Numbers JSON cannot hold, written so that the manifest always writes: an infinity as the text "inf" or
    "-inf" (a PSNR of identical outputs), NaN as null (not measured: what a NaN metric means, as the contract
    already records it; validation._measured). An artifact with non-finite outputs also fails with a reason of
    kind NON_FINITE, and a NaN reference is refused before any export, so a null here never hides a verdict."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def record(manifest: Manifest) -> dict:
    """The manifest as its JSON file holds it (what a build returns and the whole-build record stores)."""
    return jsonable(manifest)


def dumps(manifest: Manifest | dict) -> str:
    return json.dumps(_jsonable(manifest), indent=2, allow_nan=False) + "\n"


def write(out_dir: Path, manifest: Manifest | dict) -> Path:
    path = Path(out_dir) / "manifest.json"
    files.write_text(path, dumps(manifest))
    return path


def target_folders(out_dir) -> list[Path]:
    """A several-target build's folders (OUT/<target>/manifest.json); none for one target's own folder."""
    out = Path(out_dir)
    return sorted(p.parent for p in out.glob("*/manifest.json") if p.is_file()) if out.is_dir() else []


def read_build(out_dir) -> dict:
    """The manifest of the build directory `out_dir`, for `exporter validate` and `exporter bundle`: refused with
    one UsageError line unless it is there, is JSON, is this exporter's schema version, is finished and matches
    the schema. A several-target build's OUT (a folder per target, no OUT/manifest.json) is told apart from a
    folder that is no build at all."""
    out = Path(out_dir)
    path = out / "manifest.json"
    if not path.is_file():
        targets = target_folders(out)
        if targets:
            raise UsageError(
                f"{out} is a several-target build: give one target's folder ({', '.join(str(t) for t in targets)})"
            )
        raise UsageError(f"{out} has no manifest.json; is it an exporter build directory?")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: broken JSON or not UTF-8
        raise UsageError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path} is not a build manifest: it holds {type(doc).__name__}, not an object")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(
            f"{path}: schema_version {doc.get('schema_version')} (this exporter reads {SCHEMA_VERSION}: build it again)"
        )
    if doc.get("status") == "building":  # killed part way: it lists the artifacts done by then
        raise UsageError(f"{out} is an unfinished build (status 'building'); run the build again")
    problem = schema_problem(doc)
    if problem:
        raise UsageError(f"{path} does not match the manifest schema: {problem}")
    return doc


def read(out_dir) -> Manifest:
    """The build's manifest (read_build's checks) as the engine holds it, for `exporter validate`."""
    doc = read_build(out_dir)
    try:
        return Manifest.from_json(doc)
    except (TypeError, ValueError) as e:  # a field the schema requires, missing where the schema does not look
        raise UsageError(f"{Path(out_dir) / 'manifest.json'} does not match the manifest schema: {e}") from None


def schema_problem(doc: dict) -> str | None:
    """Where and how `doc` departs from the manifest schema (the most relevant departure), or None."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema()).iter_errors(doc))
    if error is None:
        return None
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in error.absolute_path).lstrip(".") or "top level"
    return f"{where}: {error.message[:200]}"


def schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())
