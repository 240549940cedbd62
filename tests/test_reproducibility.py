"""Reproducible artifacts beyond test_release's: the ExecuTorch int8 program (PT2E calibration,
XNNPACK) and every Core ML package of the ios target, built twice in fresh processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest

from .helpers import BYTES_ONLY, ROOT, build_args

pytest.importorskip("executorch")
ct = pytest.importorskip("coremltools")

IOS_ARTIFACTS = {
    a.get("name") or f"{a['format']}_{a['precision']}"
    for a in tomllib.loads((ROOT / "targets" / "ios.toml").read_text())["artifacts"]
    if a["format"] == "coreml" or (a["format"], a["precision"]) == ("executorch", "int8")
}


def _file_hashes(path: Path) -> dict[str, str]:
    """sha256 of every file of an artifact: the file itself, or each file inside a directory."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.relative_to(path.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_int8_pte_and_core_ml_packages_are_byte_identical(tmp_path, digits_model):
    # Both builds at once: exporting is mostly single-threaded Python, so on two cores this takes
    # about as long as one build. They run with 1 and 2 threads, as a laptop and a CI runner
    # would: int8 calibration once gave a different .pte per thread count. Bytes are under test,
    # not accuracy (BYTES_ONLY).
    procs = {}
    for name, threads in (("one", 1), ("two", 2)):
        args = build_args(
            digits_model,
            tmp_path / name / "build",
            "--target",
            "ios",
            "--no-cache",
            "--threads",
            threads,
            "--format",
            "executorch:int8",
            "--format",
            "coreml",
            *BYTES_ONLY,
        )
        env = dict(os.environ, EXPORTER_CACHE=str(tmp_path / name / "cache"))
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "exporter.cli", *map(str, args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    builds = {}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        out = tmp_path / name / "build"
        doc = json.loads((out / "manifest.json").read_text())
        builds[name] = {a["name"]: (a, _file_hashes(out / a["path"])) for a in doc["artifacts"]}

    one, two = builds["one"], builds["two"]
    assert set(one) == set(two) == IOS_ARTIFACTS and len(IOS_ARTIFACTS) == 7
    for name, (artifact, hashes) in one.items():
        assert hashes == two[name][1], name
        assert artifact["sha256"] == two[name][0]["sha256"], name
        if artifact["format"] == "coreml":
            _assert_valid_package(tmp_path / "one" / "build" / artifact["path"])


def _assert_valid_package(path: Path) -> None:
    """What export rewrites to make a package reproducible leaves a package Core ML accepts."""
    from coremltools.libmodelpackage import ModelPackage

    assert ModelPackage.isValid(str(path))
    manifest = json.loads((path / "Manifest.json").read_text())
    for identifier in (*manifest["itemInfoEntries"], manifest["rootModelIdentifier"]):
        assert str(uuid.UUID(identifier)) == identifier
    assert Path(ModelPackage(str(path)).getRootModel().path()).name == "model.mlmodel"
    user = ct.models.MLModel(str(path), skip_model_load=True).user_defined_metadata
    assert "com.github.apple.coremltools.conversion_date" not in user
    assert user["exporter.compression"] in ("none", "w8", "palettize")
