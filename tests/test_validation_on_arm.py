"""On ARM kernels, for real (opt-in: EXPORTER_TEST_AARCH64=1; `.ci/run` sets it): a build with `--arch aarch64`
judges the digits classifier's .pte fp32, fp16 and int8, its .tflite int8 and its ONNX int8 on two named emulated CPUs, and the
.bpte golden programs verify there. The runner lives outside the clone (~/.cache/exporter/aarch64, or
$EXPORTER_TEST_AARCH64_CACHE), so a second run on the same machine reuses it; on a fresh machine conftest.py
starts setting it up in the background when the session starts, and this file runs late in the suite.
"""

from __future__ import annotations

import json

import pytest

from exporter import aarch64

from .helpers import ARM_CACHE as RUNNER_CACHE, ARM_E2E as E2E
from .test_bundled_program import golden_program  # noqa: F401, F811  (a fixture)

E2E_CPUS = ["cortex-a53", "cortex-a76"]


@pytest.fixture(scope="module")
def arm_runner():
    """The runner the background set-up made (waits for it: prepare takes the set-up's lock)."""
    return aarch64.prepare(RUNNER_CACHE, offline=False)


@pytest.mark.slow
@pytest.mark.skipif(not E2E, reason="set EXPORTER_TEST_AARCH64=1: sets up the aarch64 runner (minutes, ~1.5 GB) once")
def test_a_build_with_arch_aarch64_judges_the_digits_artifacts_on_two_arm_cores(
    arm_runner, android_build, tmp_path, digits_model, monkeypatch
):
    from .helpers import INT8_SLACK, build_args, run_cli

    _, baseline = android_build  # its .pte files come back from the suite's cache (not keyed on the validation size)
    assert baseline.exit_code == 0, baseline.output
    monkeypatch.setenv("EXPORTER_AARCH64_CACHE", str(arm_runner.path.parent))
    out = tmp_path / "build"
    result = run_cli(
        *build_args(
            digits_model,
            out,
            "--target",
            "android",
            "--target",
            "jetson",
            "--format",
            "executorch",
            "--format",
            "executorch:fp16",
            "--format",
            "litert",
            "--format",
            "litert:fp16",
            "--format",
            "onnx:int8",
            *INT8_SLACK,
            # a third of the suite's validation digits (the first 40 of the same 120): emulation runs every input,
            # about 0.45 s a digit for the fp32 .pte under qemu
            *("--val-size", "40"),
            *(a for cpu in E2E_CPUS for a in ("--cpu", cpu)),
        )
    )
    assert result.exit_code == 0, (result.output, result.exception)
    entries, docs = {}, {}
    for target in ("android", "jetson"):
        doc = docs[target] = json.loads((out / target / "manifest.json").read_text())
        assert doc["aarch64"]["runner"]["key"] == arm_runner.info["key"]
        # set up (or found) once, before anything is written: one step, not one more per target
        assert [step for step in doc["timings_s"] if "aarch64 runner" in step] == ["aarch64 runner"], doc["timings_s"]
        entries.update({e["path"]: e for e in doc["artifacts"] if e.get("path")})
    assert sorted(entries) == [
        "mobilenet_v3_small_executorch_fp16.pte",
        "mobilenet_v3_small_executorch_fp32.pte",
        "mobilenet_v3_small_executorch_int8.pte",
        "mobilenet_v3_small_litert_fp16.tflite",
        "mobilenet_v3_small_litert_fp32.tflite",
        "mobilenet_v3_small_litert_int8.tflite",
        "mobilenet_v3_small_onnx_int8.onnx",
    ], sorted(entries)
    for path in (
        "mobilenet_v3_small_executorch_fp32.pte",
        "mobilenet_v3_small_executorch_int8.pte",
        "mobilenet_v3_small_litert_fp32.tflite",
        "mobilenet_v3_small_litert_int8.tflite",
    ):
        assert entries[path].get("artifact_reused_from_cache"), path  # exported once, whatever the validation size
    for path, entry in entries.items():
        rows = {r["cpu"]: r for r in entry["aarch64"]}
        if path.endswith(".pte"):  # its golden program, verified by ExecuTorch on x86 and on each CPU
            assert set(entry["bundled_program"]["verified"]) == {"x86_64", *E2E_CPUS}, path
        assert list(rows) == E2E_CPUS and entry["status"] == "passed", (path, entry["reasons"])
        for cpu, row in rows.items():
            where = (path, cpu)
            assert row["status"] == "passed" and row["latency_ms"] is None, where
            if "fp32" in path or row["vs_x86"]["bit_identical"]:  # the same numbers: the same top-1
                assert row["fidelity"]["top1_agreement"] == entry["fidelity"]["top1_agreement"], where
            # ONNX Runtime's int8 kernels differ between x86 and ARM (1.29 max abs here): a digit at a near-tie of the
            # stand-in (trained on the host) may flip either way; each row is held to the thresholds, as asserted above
            if path.endswith(".pte"):
                assert row["runtime"]["delegate"] == "XnnpackBackend", where
                assert {k: row["bundled_program"][k] for k in ("passed", "cases", "error")} == {
                    "passed": True,
                    "cases": 8,
                    "error": None,
                }, where
            if path.endswith(".tflite"):  # the x86 runtime's release, its XNNPACK delegate applied
                assert row["runtime"]["version"] == doc["tools"]["ai-edge-litert"], where
                assert row["runtime"]["delegate_nodes"] > 0, where
            # the distance to x86 is recorded, not held to bit-identity: x86's own int8 kernels differ by ISA (AVX2,
            # AVX-512, VNNI), and SSDlite's int8 .pte already differs on ARM (measured); the verdict is the contract's
            assert row["vs_x86"] is not None and row["vs_x86"]["max_abs_diff"] >= 0, where
            if "fp32" in path:  # float kernels differ in summation order only: 1e-5 measured
                assert row["vs_x86"]["max_abs_diff"] <= 1e-3, (where, row["vs_x86"])
    # instruction counts on each core, eager's beside them; int8 costs fewer instructions than fp32 in one engine
    for target, doc in docs.items():
        counted = doc["aarch64"]["instructions"]
        assert "unavailable" not in counted and not counted["failed"], counted
        assert set(counted["eager"]) == set(E2E_CPUS) and counted["reference_cpu"] == "cortex-a76", counted
    for path, entry in entries.items():
        for row in entry["aarch64"]:
            counts = row["instructions"]
            assert counts["per_inference"] > 0 and counts["spread"] < 1e-3 and "not time" in counts["unit"], (
                path,
                counts,
            )
            assert counts["ratio_to_eager"] == round(counts["eager_per_inference"] / counts["per_inference"], 3)
    a76 = {
        p: {r["cpu"]: r for r in e["aarch64"]}["cortex-a76"]["instructions"]["per_inference"]
        for p, e in entries.items()
    }
    assert a76["mobilenet_v3_small_executorch_int8.pte"] < a76["mobilenet_v3_small_executorch_fp32.pte"], a76
    # fp16: computed in half precision on the core with FP16 arithmetic, fewer instructions than fp32 there; the
    # Armv8.0 core has none, and its row says so
    assert a76["mobilenet_v3_small_executorch_fp16.pte"] < a76["mobilenet_v3_small_executorch_fp32.pte"], a76
    fp16 = {r["cpu"]: r for r in entries["mobilenet_v3_small_executorch_fp16.pte"]["aarch64"]}
    assert "FP16 arithmetic" in fp16["cortex-a53"]["lacks"] and "lacks" not in fp16["cortex-a76"], fp16
    assert "`executorch_fp16` on cortex-a53: FP16 arithmetic" in (out / "android" / "report.md").read_text()
    # the fp16 .tflite asks XNNPACK for fp16 arithmetic, a hint: taken on the core that has it (fewer instructions
    # than the fp32 .tflite), ignored on the one without (the fp32 kernels: the same count to a few instructions in
    # ten million, measured 38,056,830 against 38,056,845), where the fp16 .pte pays for emulating it
    a53 = {
        p: {r["cpu"]: r for r in e["aarch64"]}["cortex-a53"]["instructions"]["per_inference"]
        for p, e in entries.items()
    }
    tflite16, tflite32 = "mobilenet_v3_small_litert_fp16.tflite", "mobilenet_v3_small_litert_fp32.tflite"
    assert a76[tflite16] < a76[tflite32], a76
    assert (
        abs(a53[tflite16] / a53[tflite32] - 1)
        < 0.01
        < a53["mobilenet_v3_small_executorch_fp16.pte"] / a53["mobilenet_v3_small_executorch_fp32.pte"] - 1
    ), a53
    assert "ranked by count" in (out / "android" / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not E2E, reason="set EXPORTER_TEST_AARCH64=1: sets up the aarch64 runner (minutes, ~1.5 GB) once")
def test_a_bpte_that_departs_is_refused_inside_the_aarch64_runner(arm_runner, golden_program):  # noqa: F811
    from exporter.aarch64.execute import verify_bundled

    runner, g = arm_runner, golden_program
    # (a good one passes on both CPUs in the build above; this one departs beyond its tolerance on one element)
    bad = verify_bundled(runner, g["bad"], E2E_CPUS[:1], g["tol"]["rtol"], g["tol"]["atol"])
    assert bad[0]["passed"] is False and bad[0]["error"].startswith("case 3 of 8"), bad


@pytest.mark.slow
@pytest.mark.skipif(not E2E, reason="set EXPORTER_TEST_AARCH64=1: sets up the aarch64 runner (minutes, ~1.5 GB) once")
def test_the_coverage_sweep_validates_on_an_arm_core_too(arm_runner, tmp_path):
    """`exporter coverage --cpu NAME`: every runnable artifact of each row judged on the emulated core as well, in a
    table of its own (coverage-aarch64), the runner set up by the sweep and found by its offline builds."""
    from .helpers import run_cli

    out = tmp_path / "table"
    result = run_cli(
        "coverage",
        "--target",
        "jetson",
        "--format",
        "onnx:fp32",
        "--models",
        "mobilenet_v3_small",
        "--one-per-builder",
        "--cpu",
        "cortex-a76",
        "--out",
        out,
        env={"EXPORTER_CACHE": str(tmp_path / "cache"), "EXPORTER_AARCH64_CACHE": str(arm_runner.path.parent)},
    )
    assert result.exit_code == 0, (result.output, result.exception)
    assert "aarch64 onnx_fp32 on cortex-a76 (emulated)" in result.stderr
    assert "instruction counts" not in result.stderr  # a sweep judges; it does not count (a minute per model and CPU)
    doc = json.loads((out / "coverage-aarch64.json").read_text())
    (row,) = doc["rows"]
    (cell,) = row["cells"]
    assert cell["outcome"] == "passed" and cell["aarch64"] == {"cortex-a76": "passed"}, cell
    md = (out / "coverage-aarch64.md").read_text()
    assert "✅ on cortex-a76" in md and "also validated on emulated aarch64 (cortex-a76)" in md
    assert not (out / "coverage.json").exists()
