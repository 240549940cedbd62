"""Release properties: the build cache, byte-identical rebuilds, and a build killed half way."""

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter import files
from exporter.build import BuildRequest, target_profile
from exporter.engine.cache import BuildCache
from exporter.engine.record import BuildRecord
from exporter.progress import Progress

from .helpers import BYTES_ONLY, FAST, build_args, run_cli

WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, *args):
        if name.split(".")[0] in ("torch", "torchvision"):
            raise ImportError("the warm re-run imported " + name)
sys.meta_path.insert(0, NoTorch())
from exporter.cli import main
main()
"""


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_warm_rerun_reuses_artifacts_and_validation_and_rebuilds_a_corrupt_entry(tmp_path, digits_model):
    env = {"EXPORTER_CACHE": str(tmp_path / "cache")}
    cold, warm, repaired = tmp_path / "cold", tmp_path / "warm", tmp_path / "repaired"
    assert run_cli(*build_args(digits_model, cold, "--format", "torchscript_lite"), env=env).exit_code == 0
    shutil.rmtree(tmp_path / "cache" / "builds")  # so that the per-artifact cache answers
    assert run_cli(*build_args(digits_model, warm, "--format", "torchscript_lite"), env=env).exit_code == 0
    first, second = _manifest(cold), _manifest(warm)
    assert not first["cache"]["events"]
    assert second["cache"]["events"] == [
        "eager reference reused from the cache",
        "torchscript_lite_fp32: artifact reused from the cache",
        "torchscript_lite_fp32: validation results reused from the cache",
        "torchscript_lite_fp32: memory and profile reused from the cache",
    ]
    (a,), (b,) = first["artifacts"], second["artifacts"]
    assert a["sha256"] == b["sha256"] == files.sha256(warm / b["path"])
    assert a["fidelity"] == b["fidelity"] and b["validation_reused_from_cache"]
    assert "cache: torchscript_lite_fp32: artifact reused" in (warm / "report.md").read_text()

    shutil.rmtree(tmp_path / "cache" / "builds")
    (stored,) = (tmp_path / "cache" / "artifacts").glob("*/*/artifact")
    stored.write_bytes(stored.read_bytes()[:1000])  # a truncated cache entry
    (repaired / "golden").mkdir(parents=True)
    (repaired / "golden" / "eager_masks.npy").write_text("")  # an earlier build's, which --force must not leave behind
    assert (
        run_cli(*build_args(digits_model, repaired, "--format", "torchscript_lite", "--force"), env=env).exit_code == 0
    )
    assert not (repaired / "golden" / "eager_masks.npy").exists()
    third = _manifest(repaired)
    assert any(e.startswith("corrupt cache entry") for e in third["cache"]["events"])
    rebuilt = third["artifacts"][0]
    assert rebuilt["status"] == "passed" and files.sha256(repaired / rebuilt["path"]) == rebuilt["sha256"]

    # the class names are written into artifacts (Core ML's) and previews: other labels, no artifact reused
    shutil.rmtree(tmp_path / "cache" / "builds")
    labels = tmp_path / "labels.txt"
    labels.write_text(digits_model.labels_file.read_text().replace("digit", "Ziffer"))
    relabeled = tmp_path / "relabeled"
    assert (
        run_cli(
            *build_args(digits_model, relabeled, "--format", "torchscript_lite", "--labels", labels), env=env
        ).exit_code
        == 0
    )
    assert _manifest(relabeled)["cache"]["events"] == ["eager reference reused from the cache"]  # labels: not its

    nocache = tmp_path / "nocache"
    assert (
        run_cli(*build_args(digits_model, nocache, "--format", "torchscript_lite", "--no-cache"), env=env).exit_code
        == 0
    )
    assert _manifest(nocache)["cache"] == {"root": None, "events": []}


def _disk_full(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_full_cache_disk_costs_the_cache_not_the_artifact(tmp_path, digits_model, monkeypatch):
    """RegNetY-128GF's .ptl, written whole, was reported "export failed: No space left on device": its copy
    into the build cache had filled the disk. A store that finds the disk full is given up; the artifact is
    validated and kept, and the manifest says what was not cached. Any other error still stops the store."""
    cache_root = tmp_path / "cache"
    copy = files.copy

    def full_under_the_cache(source, target):
        if cache_root in Path(target).parents:
            raise _disk_full(target)
        copy(source, target)

    monkeypatch.setattr(files, "copy", full_under_the_cache)
    out = tmp_path / "build"
    result = run_cli(
        *build_args(digits_model, out, "--format", "torchscript_lite"), env={"EXPORTER_CACHE": str(cache_root)}
    )
    assert result.exit_code == 0, result.output
    doc = _manifest(out)
    (artifact,) = doc["artifacts"]
    assert artifact["status"] == "passed" and files.sha256(out / artifact["path"]) == artifact["sha256"]
    assert f"{Path(artifact['path']).name} not cached: No space left on device ({cache_root})" in doc["cache"]["events"]
    assert not (cache_root / "artifacts").exists() or not list((cache_root / "artifacts").rglob("artifact"))
    assert not [p for p in cache_root.rglob("*.partial")]  # no half-written entry left behind

    def denied(source, target):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target))

    monkeypatch.setattr(files, "copy", denied)
    with pytest.raises(PermissionError):  # not a full disk: the store stops as before
        BuildCache(tmp_path / "other").store_artifact("ab" * 32, out / artifact["path"], {})


def _fills_the_disk_after(calls: int):
    """shutil.copyfile that copies `calls` files, then writes a few bytes of the next and finds the disk full."""
    copyfile, done = shutil.copyfile, []

    def copy(source, target, **kwargs):
        if len(done) == calls:
            Path(target).write_bytes(b"half")
            raise _disk_full(target)
        done.append(target)
        return copyfile(source, target, **kwargs)

    return copy


def test_a_core_ml_package_is_not_cached_on_a_full_disk_and_leaves_nothing(tmp_path, monkeypatch):
    """A folder artifact (.mlpackage) is copied by copytree, which gathers its files' errors into one
    shutil.Error without an errno."""
    package = tmp_path / "model.mlpackage"
    (package / "Data").mkdir(parents=True)
    (package / "Manifest.json").write_text("{}")
    (package / "Data" / "weights.bin").write_bytes(b"w" * 1000)
    cache = BuildCache(tmp_path / "cache")
    monkeypatch.setattr(shutil, "copyfile", _fills_the_disk_after(1))
    cache.store_artifact("cd" * 32, package, {})
    assert cache.events == [f"model.mlpackage not cached: No space left on device ({tmp_path / 'cache'})"]
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert cache.fetch_artifact("cd" * 32, tmp_path / "restored") is None


def test_a_whole_build_not_recorded_for_a_full_disk_says_so(tmp_path, android_build, monkeypatch, capsys):
    out, _ = android_build
    docs = [_manifest(out)]
    for artifact in docs[0]["artifacts"]:  # as if timed on a quiet host: a busy one's build is not recorded anyway
        artifact.pop("latency_conditions", None)
        (artifact.get("profile") or {}).pop("conditions", None)
    request = BuildRequest(docs[0]["weight"]["name"], out=tmp_path / "unused", cache_dir=tmp_path / "cache")
    record = BuildRecord(tmp_path / "cache", request, [target_profile(request, "android")])

    monkeypatch.setattr(shutil, "copyfile", _fills_the_disk_after(2))
    record.store(out, docs, Progress())
    assert record.cache.fetch_json("builds", record.key) is None
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # neither the blobs stored nor a partial
    assert (
        f"– this build, for an unchanged re-run, not cached: No space left on device ({tmp_path / 'cache'})"
        in capsys.readouterr().err
    )


def _tree(directory):
    return {p.relative_to(directory).as_posix(): files.sha256(p) for p in directory.rglob("*") if p.is_file()}


def test_unchanged_rerun_is_restored_whole_without_torch_and_any_input_change_is_seen(
    tmp_path, digits_model, monkeypatch
):
    cache, data, labels = tmp_path / "cache", tmp_path / "data", tmp_path / "labels.txt"
    shutil.copytree(digits_model.data_dir, data)
    shutil.copy(digits_model.labels_file, labels)
    env = {**os.environ, "EXPORTER_CACHE": str(cache)}
    cold, warm = tmp_path / "cold", tmp_path / "warm"

    def args(out):
        return [
            str(a)
            for a in [
                "build",
                digits_model.weight,
                "--checkpoint",
                digits_model.checkpoint,
                "--data",
                data,
                "--labels",
                labels,
                "--out",
                out,
                "--quiet",
                *FAST,
                "--format",
                "torchscript_lite",
            ]
        ]

    assert run_cli(*args(cold), env={"EXPORTER_CACHE": str(cache)}).exit_code == 0
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args(warm)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    first, second = _manifest(cold), _manifest(warm)
    assert second["cache"]["events"][0].startswith("whole build reused from the cache")
    assert second["artifacts"] == first["artifacts"]
    rendered = {"manifest.json", "report.md", "report.html"}
    assert {k: v for k, v in _tree(warm).items() if k not in rendered} == {
        k: v for k, v in _tree(cold).items() if k not in rendered
    }
    assert "whole build reused" in (warm / "report.md").read_text()

    again = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args(warm)], capture_output=True, text=True, env=env)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].startswith("error: --out"), again.stderr

    request = BuildRequest(
        digits_model.weight,
        out=tmp_path / "probe",
        checkpoint=digits_model.checkpoint,
        data=data,
        labels=labels,
        calib_size=64,
        val_size=120,
        warmup=2,
        iterations=10,
        formats=["torchscript_lite"],
        cache_dir=cache,
    )
    plans = [target_profile(request, "android")]

    def restored():
        shutil.rmtree(request.out, ignore_errors=True)
        return BuildRecord(cache, request, plans).restore(Progress(quiet=True)) is not None

    assert restored()
    (data / "zz").mkdir()  # an empty class folder: the classes (sorted folder names) are others
    assert not restored()
    (data / "zz").rmdir()
    assert restored()
    image = next(p for p in sorted(data.rglob("*")) if p.is_file())
    original = image.read_bytes()
    image.write_bytes(original + b"\0")
    assert not restored()  # one changed data file
    image.write_bytes(original)
    assert restored()  # same bytes, new mtime: hashed again and found equal
    labels.write_text(labels.read_text().replace("digit 3", "three"))
    assert not restored()
    shutil.copy(digits_model.labels_file, labels)
    assert restored()
    assert not BuildRecord(cache, dataclasses.replace(request, verify=False), plans).restore(Progress(quiet=True))
    # recorded with --out, asked without: restored into the default exports/WEIGHT/TARGET
    monkeypatch.chdir(tmp_path)
    default = BuildRecord(cache, dataclasses.replace(request, out=None), plans).restore(Progress(quiet=True))
    assert default and (tmp_path / "exports" / digits_model.weight / "android" / "manifest.json").is_file()
    # an unfinished build (a killed one's manifest) is not made "passed" by validating what it lists
    unfinished = shutil.copytree(cold, tmp_path / "unfinished")
    doc = _manifest(unfinished)
    (unfinished / "manifest.json").write_text(json.dumps(dict(doc, status="building")))
    refused = run_cli("validate", unfinished)
    assert refused.exit_code == 2 and "unfinished build" in refused.stderr, refused.output
    blob = max((cache / "blobs").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    blob.write_bytes(blob.read_bytes()[:100])
    assert not restored()  # a damaged stored file is never restored


def test_clean_builds_are_byte_identical(tmp_path, digits_model):
    # fresh processes, as two CI runs would be: TorchScript numbers its mangled names per process
    shas = []
    for name in ("one", "two"):
        out = tmp_path / name
        args = build_args(
            digits_model,
            out,
            "--target",
            "android",
            "--target",
            "jetson",
            "--no-cache",
            "--format",
            "torchscript_lite",
            "--format",
            "executorch:fp32",
            "--format",
            "onnx:fp32",
            "--format",
            "onnx:int8",
            *BYTES_ONLY,
        )
        proc = subprocess.run([sys.executable, "-m", "exporter.cli", *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        shas.append({a["name"]: a["sha256"] for t in ("android", "jetson") for a in _manifest(out / t)["artifacts"]})
    assert len(shas[0]) == 4 and shas[0] == shas[1]


def test_killed_build_leaves_only_complete_artifacts_and_a_rerun_completes(tmp_path, digits_model):
    out = tmp_path / "killed"
    formats = ("--format", "executorch:fp32", "--format", "executorch:int8")
    args = [str(a) for a in build_args(digits_model, out, *formats, "--no-cache")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", *args],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 600
    # kill it while the int8 program is being lowered, once the fp32 one is listed
    while time.time() < deadline and not (out.joinpath("manifest.json").is_file() and _manifest(out)["artifacts"]):
        time.sleep(0.2)
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    doc = _manifest(out)
    assert doc["status"] == "building"
    assert [a["name"] for a in doc["artifacts"]] == ["executorch_fp32"]
    assert files.sha256(out / doc["artifacts"][0]["path"]) == doc["artifacts"][0]["sha256"]
    assert [p.name for p in out.glob("*.pte")] == [
        doc["artifacts"][0]["path"]
    ]  # nothing half-written under a final name

    rerun = run_cli(*build_args(digits_model, out, *formats, "--force"))
    assert rerun.exit_code == 0, rerun.output
    assert {a["name"]: a["status"] for a in _manifest(out)["artifacts"]} == {
        "executorch_fp32": "passed",
        "executorch_int8": "passed",
    }
    assert not list(out.glob(".*partial"))


def test_a_build_whose_code_changed_while_it_ran_is_not_recorded(tmp_path, android_build, monkeypatch):
    from exporter.engine import record as build_record

    out, _ = android_build
    docs = [_manifest(out)]
    request = BuildRequest(docs[0]["weight"]["name"], out=tmp_path / "unused", cache_dir=tmp_path / "cache")
    plans = [target_profile(request, "android")]
    changed = BuildRecord(tmp_path / "cache", request, plans)
    monkeypatch.setattr(build_record.cache, "source_digest", lambda: "edited while building")
    changed.store(out, docs)
    assert changed.cache.fetch_json("builds", changed.key) is None
    monkeypatch.undo()
    unchanged = BuildRecord(tmp_path / "cache", request, plans)
    unchanged.store(out, docs)
    assert unchanged.cache.fetch_json("builds", unchanged.key)["docs"] == docs
