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
from ..results import Kind, Manifest, jsonable, kinds

SCHEMA_VERSION = 4  # 4: each reason an object with its kind ({"kind", "text", ...}), no longer a sentence
SCHEMA_FILE = Path(__file__).parent / "schema" / "manifest.schema.json"
# a build directory's own files and folders, beside its artifacts (removed first on --force)
BUILD_FILES = ("manifest.json", "report.md", "report.html", "labels.txt", "preprocessing.json")
BUILD_FOLDERS = ("golden", "previews")
GOLDEN_FILES = ("golden/inputs.npy", "golden/eager_logits.npy")  # every task's build writes them
# why an artifact may have no file: never made, by design or by its export; any other has one to check
NO_FILE = frozenset({Kind.NOT_MADE, Kind.NOT_OFFERED, Kind.UNAVAILABLE_HERE, Kind.EXPORT_FAILED, Kind.DISK_FULL})
MAX_DEPTH = 64  # a manifest nests about 10 deep; far deeper is none of ours, and would exhaust Python's recursion


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
    files.build_file(out, path.name)  # not a link out of the folder
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise UsageError(f"cannot read {path}: its JSON is nested deeper than Python reads") from None
    except (OSError, ValueError) as e:  # ValueError: broken JSON or not UTF-8
        raise UsageError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path} is not a build manifest: it holds {type(doc).__name__}, not an object")
    if _deeper_than(doc, MAX_DEPTH):
        raise UsageError(f"{path} is not a build manifest: it nests deeper than {MAX_DEPTH} levels")
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


def _deeper_than(value, limit: int) -> bool:
    """Whether JSON `value` nests lists and objects more than `limit` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def schema_problem(doc: dict) -> str | None:
    """Where and how `doc` departs from the manifest schema (the most relevant departure), or None. An artifact is
    named beside its index; a value that breaks a pattern is told what the pattern means (its description)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema()).iter_errors(doc))
    if error is None:
        return None
    where = _where(doc, list(error.absolute_path))
    # a path that is no relative path fails `null or relative_path` as a whole: its pattern says more
    error = next((e for e in error.context if e.validator in ("pattern", "minLength")), error)
    message = error.message
    if error.validator in ("pattern", "minLength") and "description" in error.schema:
        message = f"{error.instance!r} {error.schema['description']}"
    return f"{where}: {message[:200]}"


def _where(doc: dict, path: list) -> str:
    """A place in the manifest as text (`artifacts[0] (onnx_fp32).path`): an artifact named beside its index."""
    where = ""
    for i, key in enumerate(path):
        where += f"[{key}]" if isinstance(key, int) else f".{key}"
        if i == 1 and path[0] == "artifacts" and isinstance(doc["artifacts"][key], dict):
            where += f" ({doc['artifacts'][key].get('name')})"
    return where.lstrip(".") or "top level"


def check_build_files(out_dir, doc: dict) -> None:
    """Every file of the build folder that the manifest record `doc` names or promises, checked before any is opened
    (files.build_file: inside the folder, a regular file): each artifact's file, golden program and preview, or for
    an artifact without a file, a status and reason that say why none was made (an artifact that claims more
    could not be checked); labels.txt holding the manifest's count of labels, preprocessing.json, golden/'s inputs
    and eager outputs and the preprocessing reference; the decode and the Jetson kit's files, where named, are
    checked when present (bundle says what it misses). The first that fails is a UsageError naming it."""
    check_artifacts(out_dir, doc)
    check_side_files(out_dir, doc)


def check_artifacts(out_dir, doc: dict) -> None:
    """Each artifact's files (check_build_files), or why it has none."""
    for entry in doc["artifacts"]:
        _check_artifact(Path(out_dir), entry)


def check_side_files(out_dir, doc: dict) -> None:
    """The files beside the artifacts (check_build_files)."""
    out = Path(out_dir)
    for folder in BUILD_FOLDERS:  # validate writes into them: not through a link out of the build
        files.build_file(out, folder, missing_ok=True, folder_ok=True)
    labels = files.build_file(out, doc["labels"]["file"], "labels: ")
    try:
        count = len(labels.read_text(encoding="utf-8").splitlines())
    except (OSError, ValueError) as e:  # ValueError: not UTF-8
        raise UsageError(f"cannot read {labels}: {e}") from None
    if count != doc["labels"]["count"]:
        raise UsageError(f"{labels} has {count} labels, the manifest says {doc['labels']['count']}")
    for name in ("preprocessing.json", *GOLDEN_FILES):
        files.build_file(out, name)
    reference = (doc.get("preprocessing") or {}).get("reference")
    if reference:
        files.build_file(out, reference["file"], "preprocessing reference: ")
    decode = (doc.get("task") or {}).get("decode") or {}
    for name in (decode.get("code"), decode.get("anchors")):
        if name is not None:
            files.build_file(out, name, "detection decode: ", missing_ok=True)
    for name in (doc.get("jetson") or {}).get("sha256", {}):
        files.build_file(out, name, "device kit: ", missing_ok=True)


def _check_artifact(out: Path, entry: dict) -> None:
    what = f"artifact {entry['name']}: "
    if entry.get("path") is None:
        if entry["status"] == "passed" or not kinds(entry["reasons"]) & NO_FILE:
            raise UsageError(
                f"{what}no file, and no reason why none was made (status {entry['status']}): it cannot be checked; "
                "run the build again"
            )
        return
    files.build_file(out, entry["path"], what, folder_ok=True)
    if entry.get("bundled_program"):
        files.build_file(out, entry["bundled_program"]["path"], what)
    if entry.get("preview") is not None:
        files.build_file(out, entry["preview"], what, missing_ok=True)


def schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())
