"""Release properties: the build cache, byte-identical rebuilds, and a build killed half way."""

import json
import os
import signal
import subprocess
import sys
import time

from exporter import files

from .conftest import build_args, run_cli


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_warm_rerun_reuses_artifacts_and_validation_and_rebuilds_a_corrupt_entry(tmp_path, digits_model):
    env = {"EXPORTER_CACHE": str(tmp_path / "cache")}
    cold, warm, repaired = tmp_path / "cold", tmp_path / "warm", tmp_path / "repaired"
    assert run_cli(*build_args(digits_model, cold, "--format", "torchscript_lite"), env=env).exit_code == 0
    assert run_cli(*build_args(digits_model, warm, "--format", "torchscript_lite"), env=env).exit_code == 0
    first, second = _manifest(cold), _manifest(warm)
    assert not first["cache"]["events"]
    assert second["cache"]["events"] == [
        "eager reference reused from the cache",
        "torchscript_lite_fp32: artifact reused from the cache",
        "torchscript_lite_fp32: validation results reused from the cache",
    ]
    (a,), (b,) = first["artifacts"], second["artifacts"]
    assert a["sha256"] == b["sha256"] == files.sha256(warm / b["path"])
    assert a["fidelity"] == b["fidelity"] and b["validation_reused_from_cache"]
    assert "cache: torchscript_lite_fp32: artifact reused" in (warm / "report.md").read_text()

    (stored,) = (tmp_path / "cache" / "artifacts").glob("*/*/artifact")
    stored.write_bytes(stored.read_bytes()[:1000])  # a truncated cache entry
    assert run_cli(*build_args(digits_model, repaired, "--format", "torchscript_lite"), env=env).exit_code == 0
    third = _manifest(repaired)
    assert any(e.startswith("corrupt cache entry") for e in third["cache"]["events"])
    rebuilt = third["artifacts"][0]
    assert rebuilt["status"] == "passed" and files.sha256(repaired / rebuilt["path"]) == rebuilt["sha256"]

    nocache = tmp_path / "nocache"
    assert run_cli(*build_args(digits_model, nocache, "--format", "torchscript_lite", "--no-cache"), env=env).exit_code == 0
    assert _manifest(nocache)["cache"] == {"root": None, "events": []}


def test_clean_builds_are_byte_identical(tmp_path, digits_model):
    # fresh processes, as two CI runs would be: TorchScript numbers its mangled names per process
    shas = []
    for name in ("one", "two"):
        out = tmp_path / name
        args = build_args(digits_model, out, "--target", "android", "--target", "jetson", "--no-cache",
                          "--format", "torchscript_lite", "--format", "executorch:fp32",
                          "--format", "onnx:fp32", "--format", "onnx:int8")
        proc = subprocess.run([sys.executable, "-m", "exporter.cli", *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        shas.append({a["name"]: a["sha256"] for t in ("android", "jetson") for a in _manifest(out / t)["artifacts"]})
    assert len(shas[0]) == 4 and shas[0] == shas[1]


def test_killed_build_leaves_only_complete_artifacts_and_a_rerun_completes(tmp_path, digits_model):
    out = tmp_path / "killed"
    formats = ("--format", "executorch:fp32", "--format", "executorch:int8")
    args = [str(a) for a in build_args(digits_model, out, *formats, "--no-cache")]
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    assert [p.name for p in out.glob("*.pte")] == [doc["artifacts"][0]["path"]]  # nothing half-written under a final name

    rerun = run_cli(*build_args(digits_model, out, *formats, "--force"))
    assert rerun.exit_code == 0, rerun.output
    assert {a["name"]: a["status"] for a in _manifest(out)["artifacts"]} == {
        "executorch_fp32": "passed", "executorch_int8": "passed"}
    assert not list(out.glob(".*partial"))
