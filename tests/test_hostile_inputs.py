"""Hostile or mistaken inputs to `validate`, `bundle` and `build` (issue 77): each is one line on stderr naming the
problem, exit 2, no traceback, and the build folder exactly as it was. Every artifact is checked again or says why
it has no file; no path a manifest names is read outside its build folder, or read at all when it is no regular
file. Fabricated build folders (tests/fake_manifest.py); only the full-disk build runs a model (a randomly
initialised MobileNetV3-Small on synthetic images, which fails before any export: its numbers are never judged)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import stat
from pathlib import Path

import numpy as np
import pytest

from exporter import files
from exporter.device import device_validate
from exporter.errors import UsageError
from exporter.formats import FORMATS
from exporter.release import manifest

from .fake_manifest import complete
from .helpers import run_cli

ARTIFACT = "tiny.pte"
COMMANDS = ["validate", "bundle"]


def _artifact(name="executorch_fp32", path=ARTIFACT, data=b"pte", status="passed", reasons=()):
    fmt, precision = name.rsplit("_", 1)
    return {
        "name": name,
        "format": fmt,
        "precision": precision,
        "path": path,
        "sha256": hashlib.sha256(data).hexdigest() if path is not None else None,
        "size_bytes": len(data) if path is not None else None,
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


def _build(out: Path, artifacts=None) -> Path:
    """A finished android build as `validate` and `bundle` read it: a schema-valid manifest, its artifact, labels,
    preprocessing and golden files."""
    artifacts = [_artifact()] if artifacts is None else artifacts
    doc = complete(
        {
            "artifacts": artifacts,
            "target": {"name": "android", "validate": {"arch": ["x86_64"], "cpus": []}},
            "tools": {"torch": "2.0.0", "torchvision": "0.20.0", "executorch": "1.0.0"},
        }
    )
    out.mkdir(parents=True)
    for entry in artifacts:
        if entry["path"]:
            (out / entry["path"]).write_bytes(b"pte")
    (out / "labels.txt").write_text("zero\none\n")
    (out / "preprocessing.json").write_text("{}\n")
    (out / "golden").mkdir()
    for name in ("inputs.npy", "eager_logits.npy"):
        np.save(out / "golden" / name, np.zeros((1, 2), np.float32))
    (out / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out


def _with_artifact(out: Path, **fields) -> None:
    """Rewrite the manifest's first artifact with `fields`, past the schema (as a hand-edited manifest is)."""
    doc = json.loads((out / "manifest.json").read_text())
    doc["artifacts"][0].update(fields)
    (out / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")


def _state(folder: Path) -> dict:
    """Every entry under `folder` by relative path: a file's bytes, a link's target, a FIFO or a folder as such (never
    opened, so a FIFO cannot hang it)."""
    state = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        rel = path.relative_to(folder).as_posix()
        if stat.S_ISLNK(mode):
            state[rel] = ("link", os.readlink(path))
        elif stat.S_ISREG(mode):
            state[rel] = path.read_bytes()
        else:
            state[rel] = stat.S_IFMT(mode)
    return state


@contextlib.contextmanager
def _no_hang(seconds: int = 60):
    """Fail the test instead of hanging it: an open() on a FIFO nobody writes blocks until a signal interrupts it."""

    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: a FIFO or device was opened")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _refused(folder: Path, command: str, *needles: str, code: int = 2) -> str:
    """`exporter COMMAND folder` exits `code` with one line on stderr holding every needle, no traceback, and leaves
    the folder's files and bytes as they were (no golden/, preview, report or bundle rewritten)."""
    before = _state(folder)
    with _no_hang():
        result = run_cli(command, folder, *(["--quiet"] if command == "validate" else []))
    assert result.exit_code == code, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert _state(folder) == before
    return lines[0]


# --- item 2: every artifact checked again, or saying why it has no file ---


@pytest.mark.parametrize("command", COMMANDS)
def test_an_artifact_with_an_empty_path_is_refused_not_passed(tmp_path, command):
    out = _build(tmp_path / "build")
    _with_artifact(out, path="")
    _refused(out, command, "artifacts[0] (executorch_fp32).path: ''", "must name a file inside the build folder")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "status, reasons",
    [("failed", []), ("unavailable", [{"kind": "note", "text": "said for the reader"}])],
    ids=["failed-without-reason", "unavailable-with-a-note-only"],
)
def test_an_artifact_without_a_file_or_a_reason_for_none_is_refused(tmp_path, command, status, reasons):
    out = _build(tmp_path / "build", [_artifact(), _artifact("litert_fp32", path=None, status=status, reasons=reasons)])
    _refused(
        out, command, f"artifact litert_fp32: no file, and no reason why none was made (status {status})", "checked"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_an_artifact_whose_file_is_gone_is_refused(tmp_path, command):
    out = _build(tmp_path / "build")
    (out / ARTIFACT).unlink()
    _refused(out, command, f"artifact executorch_fp32: {out / ARTIFACT} is missing from the build")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "side_file", ["labels.txt", "preprocessing.json", "golden/inputs.npy", "golden/eager_logits.npy"]
)
def test_a_side_file_the_manifest_promises_is_refused_when_gone(tmp_path, command, side_file):
    out = _build(tmp_path / "build")
    (out / side_file).unlink()
    _refused(out, command, f"{out / side_file} is missing from the build")


@pytest.mark.parametrize("command", COMMANDS)
def test_labels_that_are_not_the_manifests_count_or_not_text_are_refused(tmp_path, command):
    out = _build(tmp_path / "build")
    (out / "labels.txt").write_text("zero\n")
    _refused(out, command, f"{out / 'labels.txt'} has 1 labels, the manifest says 2")
    (out / "labels.txt").write_bytes(b"\xff\xfe\x00zero\n")
    _refused(out, command, f"cannot read {out / 'labels.txt'}", "utf-8")


NO_FILE_BY_DESIGN = [  # what a Linux android or jetson build writes for an artifact it never had a file for
    ("tensorrt_fp32", "unavailable", "unavailable_here", "not built on this host: TensorRT needs a CUDA GPU"),
    ("torchscript_lite_fp32", "unavailable", "not_made", "cannot take a detection graph: by design"),
    ("litert_int8", "failed", "export_failed", "export failed: RuntimeError: quantize"),
    ("litert_fp32", "failed", "disk_full", "export failed: No space left on device"),
    ("onnx_fp16", "failed", "not_offered", "onnx does not offer fp16"),
]


def test_an_artifact_without_a_file_by_design_keeps_its_status(tmp_path):
    """Told apart from a file that is missing: it is not refused, and validate leaves its status and reasons."""
    honest = [
        _artifact(name, path=None, status=status, reasons=[{"kind": kind, "text": text}])
        for name, status, kind, text in NO_FILE_BY_DESIGN
    ]
    out = _build(tmp_path / "build", [_artifact(), *honest])
    doc = manifest.read(out)
    from exporter.engine import pipeline

    pipeline._check_before_validating(out, doc)  # what validate refuses before it writes: none of these
    assert [(a.name, a.status.value, a.reasons[0].kind.value) for a in doc.artifacts[1:]] == [
        (name, status, kind) for name, status, kind, _ in NO_FILE_BY_DESIGN
    ]
    # bundle carries the file it has and is not refused for those it never had; the failed ones it names, as ever
    _refused(out, "bundle", "artifacts failed: litert_int8 (export failed: RuntimeError: quantize)", "--allow-failed")
    result = run_cli("bundle", out, "--allow-failed")
    assert result.exit_code == 0, result.output
    listed = json.loads((out / "bundle" / "android" / "bundle.json").read_text())["artifacts"]
    assert [a["name"] for a in listed] == ["executorch_fp32"]


# --- item 3: nothing read outside the build folder, nothing that is not a regular file ---


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("key", ["path", "preview"])
@pytest.mark.parametrize("path", ["../outside.pte", "/etc/passwd", "golden/../../outside.pte", "a\\..\\b"])
def test_a_manifest_path_leaving_the_build_is_refused_by_the_schema(tmp_path, command, key, path):
    out = _build(tmp_path / "build")
    (tmp_path / "outside.pte").write_bytes(b"pte")
    _with_artifact(out, **{key: path})
    _refused(out, command, f"artifacts[0] (executorch_fp32).{key}: {path!r} must name a file inside the build folder")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("linked", [ARTIFACT, "labels.txt", "preprocessing.json", "golden/inputs.npy", "golden"])
def test_a_symlink_leaving_the_build_is_refused(tmp_path, command, linked):
    """The link's target is a FIFO: had anything opened it, the command would hang (_no_hang fails the test)."""
    out = _build(tmp_path / "build")
    outside = tmp_path / "outside"
    outside.mkdir()
    if linked == "golden":
        (out / "golden").rename(outside / "golden")
        target = outside / "golden"
    else:
        target = outside / "secret"
        os.mkfifo(target)
        (out / linked).unlink()
    (out / linked).symlink_to(target)
    _refused(out, command, f"{out / linked}", f"leads outside the build folder {out} (to {target})")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("victim", [ARTIFACT, "labels.txt", "golden/eager_logits.npy"])
def test_a_fifo_in_the_build_is_refused_without_hanging(tmp_path, command, victim):
    out = _build(tmp_path / "build")
    (out / victim).unlink()
    os.mkfifo(out / victim)
    _refused(out, command, f"{out / victim} is a named pipe (FIFO), not a regular file")


def test_bundle_over_a_fifo_is_one_line_and_writes_no_bundle(tmp_path):
    """The case that ended in shutil's SpecialFileError (exit 3): the artifact a bundle copies is a FIFO."""
    out = _build(tmp_path / "build")
    (out / ARTIFACT).unlink()
    os.mkfifo(out / ARTIFACT)
    _refused(out, "bundle", f"artifact executorch_fp32: {out / ARTIFACT} is a named pipe (FIFO)")
    assert not (out / "bundle").exists()


def _cases(tmp_path: Path) -> tuple[Path, dict]:
    """A folder of every kind of entry a manifest could name, and the relative path of each -> None (accepted) or
    the words its refusal says."""
    root = tmp_path / "build"
    (root / "sub").mkdir(parents=True)
    (root / "model.pte").write_bytes(b"x")
    (root / "sub" / "inner.npy").write_bytes(b"x")
    (root / "inside_link").symlink_to(root / "model.pte")
    (root / "graph.onnx").write_bytes(b"x")
    (root / "graph.onnx.data").symlink_to(tmp_path / "secret")
    (tmp_path / "secret").write_bytes(b"secret")
    (root / "out_link").symlink_to(tmp_path / "secret")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "loop").symlink_to(root / "loop")
    os.mkfifo(root / "fifo")
    cases = {
        "model.pte": None,
        "sub/inner.npy": None,
        "./model.pte": None,
        "inside_link": None,
        "graph.onnx": "leads outside the build folder",  # its external data is a link out
        "out_link": "leads outside the build folder",
        "dangling": "cannot be read",
        "loop": "cannot be read",
        "fifo": "named pipe (FIFO), not a regular file",
        "sub": "is a folder, not a regular file",
        "missing.pte": "is missing from the build",
        "": "names no file",
        ".": "names no file",
        "../build/model.pte": "would leave",
        "/etc/passwd": "would leave",
        "sub\\inner.npy": "would leave",
        "c:model.pte": "would leave",
    }
    with contextlib.suppress(PermissionError):  # a character device (/dev/null's numbers), where mknod is allowed
        os.mknod(root / "device", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        cases["device"] = "character device, not a regular file"
    return root, cases


def test_one_check_guards_every_path_a_manifest_names_and_the_device_script_mirrors_it(tmp_path):
    """exporter/files.py build_file, and device_validate.py's own (it runs on a device without the exporter): the
    same paths accepted, the same refused, before anything opens them."""
    root, cases = _cases(tmp_path)
    with _no_hang():
        for relative, refusal in cases.items():
            for check, error in (
                (files.build_file, UsageError),
                (device_validate.build_file, device_validate.BadInput),
            ):
                if refusal is None:
                    assert check(root, relative) == root / relative, relative
                    continue
                with pytest.raises(error) as caught:
                    check(root, relative)
                if check is files.build_file:  # the device script's words are its own; its verdicts are the same
                    assert refusal in str(caught.value), (relative, str(caught.value))
    assert files.build_file(root, "missing.pte", missing_ok=True) is None
    assert device_validate.build_file(root, "missing.pte", missing_ok=True) is None


def test_a_folder_artifact_is_read_only_when_it_holds_regular_files_alone(tmp_path):
    root = tmp_path / "build"
    package = root / "model.mlpackage" / "Data"
    package.mkdir(parents=True)
    (package / "weights.bin").write_bytes(b"w")
    assert files.build_file(root, "model.mlpackage", folder_ok=True) == root / "model.mlpackage"
    (package / "inside").symlink_to(package / "weights.bin")
    assert files.build_file(root, "model.mlpackage", folder_ok=True) == root / "model.mlpackage"
    (package / "escape").symlink_to(tmp_path)
    with pytest.raises(UsageError, match="escape leads outside the build folder"):
        files.build_file(root, "model.mlpackage", folder_ok=True)
    (package / "escape").unlink()
    (package / "loop").symlink_to(package)
    with pytest.raises(UsageError, match="loop is a folder, not a regular file"):
        files.build_file(root, "model.mlpackage", folder_ok=True)


def test_a_symlinked_manifest_is_refused(tmp_path):
    out = _build(tmp_path / "build")
    (out / "manifest.json").rename(tmp_path / "manifest.json")
    (out / "manifest.json").symlink_to(tmp_path / "manifest.json")
    for command in COMMANDS:
        _refused(out, command, f"{out / 'manifest.json'} leads outside the build folder")


# --- item 4: one line for bad input or environment, never a traceback ---


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("where", ["artifact", "target"])
def test_a_format_name_that_does_not_exist_is_refused_before_anything_is_written(tmp_path, command, where):
    out = _build(tmp_path / "build")
    doc = json.loads((out / "manifest.json").read_text())
    (doc["artifacts"][0] if where == "artifact" else doc["target"]["artifacts"][0])["format"] = "executorch2"
    (out / "manifest.json").write_text(json.dumps(doc))
    named = "artifacts[0] (executorch_fp32).format" if where == "artifact" else "target.artifacts[0].format"
    _refused(out, command, f"{named}: 'executorch2' is not one of ['executorch'")


def test_the_schema_knows_every_format_and_no_other():
    assert manifest.schema()["$defs"]["format"]["enum"] == list(FORMATS)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "depth, needle",
    [(100_000, "its JSON is nested deeper than Python reads"), (500, "it nests deeper than 64 levels")],
    ids=["past-the-json-reader", "past-the-manifest-limit"],
)
def test_deeply_nested_json_in_a_manifest_is_one_line(tmp_path, command, depth, needle):
    """500 levels read, and would have exhausted Python's recursion when validate wrote the manifest back."""
    out = _build(tmp_path / "build")
    text = (out / "manifest.json").read_text().rstrip().removesuffix("}")
    (out / "manifest.json").write_text(f'{text}, "deep": {"[" * depth}{"]" * depth}}}')
    _refused(out, command, needle)


@pytest.fixture(scope="module")
def random_mobilenet(tmp_path_factory) -> tuple[Path, Path]:
    """A MobileNetV3-Small checkpoint of random weights (10 classes) and its labels: enough to start a build."""
    import torch
    import torchvision

    folder = tmp_path_factory.mktemp("random_mobilenet")
    torch.manual_seed(0)
    torch.save(torchvision.models.mobilenet_v3_small(num_classes=10).state_dict(), folder / "random.pth")
    (folder / "labels.txt").write_text("".join(f"class {i}\n" for i in range(10)))
    return folder / "random.pth", folder / "labels.txt"


def _small_build(checkpoint: Path, labels: Path, out: Path, *extra: str) -> list:
    """`exporter build` of the random MobileNetV3-Small: one .ptl, 64 px, 8 synthetic validation images."""
    return [
        "build", "MobileNet_V3_Small_Weights.IMAGENET1K_V1", "--checkpoint", checkpoint, "--labels", labels,
        "--out", out, "--format", "torchscript_lite:fp32", "--input-size", "64", "64", "--val-size", "8",
        "--calib-size", "0", "--warmup", "0", "--iterations", "1", "--quiet", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("place", ["under-a-regular-file", "read-only-file-system"])
def test_a_cache_folder_that_refuses_writes_is_one_line_before_anything_is_written(tmp_path, random_mobilenet, place):
    """Really refused, as root too (permission bits stop nothing for root): a cache path through a regular file, and
    one in /proc, which makes no file for anyone. Both ended in a traceback when the eager reference was stored."""
    checkpoint, labels = random_mobilenet
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "cache" if place == "under-a-regular-file" else Path("/proc/exporter-test-cache")
    out = tmp_path / "out"
    result = run_cli(*_small_build(checkpoint, labels, out), env={"EXPORTER_CACHE": str(cache)})
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    assert lines[0].startswith(f"error: the exporter's cache {cache} ($EXPORTER_CACHE or ~/.cache/exporter) is not")
    assert "--no-cache" in lines[0]
    assert not out.exists() and not cache.exists()


def _fail_writes(monkeypatch, code: int, when):
    """Every write through the lowest writer (files.atomic_path: the build's files, golden/, artifacts, bundles'
    zips) whose final path satisfies `when` raises OSError `code`, as a full disk or a read-only folder does."""
    real = files.atomic_path

    @contextlib.contextmanager
    def failing(final):
        if when(Path(final)):
            raise OSError(code, os.strerror(code), str(final))
        with real(final) as tmp:
            yield tmp

    monkeypatch.setattr(files, "atomic_path", failing)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES], ids=["disk-full", "permission"])
def test_bundle_on_a_full_disk_or_without_permission_is_one_line_and_leaves_no_bundle(tmp_path, monkeypatch, code):
    out = _build(tmp_path / "build")
    _fail_writes(monkeypatch, code, when=lambda path: path.suffix == ".zip")
    _refused(out, "bundle", os.strerror(code), str(out / "bundle" / "android.zip"))
    assert not (out / "bundle").exists()


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "over-a-kept-file-with-force"])
def test_a_full_disk_under_out_leaves_no_half_manifest(tmp_path, monkeypatch, random_mobilenet, existing):
    """The disk fills once the build has written its "building" manifest (at golden/): one line, exit 2, and --out
    holds no build at all; with --force over a folder, what was there before the build stays."""
    checkpoint, labels = random_mobilenet
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before = _state(out) if existing else None
    written = []

    def disk_full_at_golden(path: Path) -> bool:
        written.append(path)
        return path.parent.name == "golden"

    _fail_writes(monkeypatch, errno.ENOSPC, when=disk_full_at_golden)
    result = run_cli(*_small_build(checkpoint, labels, out, "--no-cache", *(["--force"] if existing else [])))
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.output and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: No space left on device: {out / 'golden'}")
    assert f"{out} holds no build" in lines[0]
    assert out / "manifest.json" in written  # the disk filled after the manifest was first written
    assert (_state(out) if out.exists() else None) == before
