"""aarch64 rows in a build (`--arch aarch64`): every .pte, .tflite and .ptl is judged per emulated CPU against the same
eager reference and thresholds, compared with its own x86 outputs, and fails the artifact when one CPU does.

The runner is faked here (the artifact's own x86 outputs, or a perturbed copy, stand in for qemu's), so these
tests check the build's judging and reporting; tests/test_aarch64.py runs the real runner (opt-in)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from exporter import aarch64
from exporter.aarch64.counting import Counts, Failed
from exporter.aarch64.counter import Counter
from exporter.aarch64.layout import Runner
from exporter.engine import count_on_arm
from exporter.errors import UsageError
from exporter.formats import FORMATS
from exporter.release import manifest
from exporter.results import revived, texts

from .helpers import INT8_SLACK, build_args, run_cli


class FakeArm:
    """aarch64.prepare/run stand-ins: each artifact's outputs on this host, changed by `perturb` for one CPU."""

    def __init__(self, key: str, perturb: dict | None = None, broken: dict | None = None):
        self.key, self.perturb, self.broken, self.calls, self.runs = key, perturb or {}, broken or {}, [], []
        self.before_run = lambda: None

    def prepare(self, cache_dir=None, progress=None, offline=None, root=None):
        return Runner(
            cache_dir or aarch64.cache_root(),
            {"key": self.key, "qemu": "fake", "seconds": 0.0, "size_bytes": 0, "packages": {}},
        )

    def run(self, runner, artifacts, inputs, cpus, threads=1, timeout=1800, bundled=None):
        import torch

        from exporter.formats import bundled_program

        self.before_run()
        results = []
        self.runs.append(({Path(a).name for a in artifacts}, tuple(cpus)))
        for artifact in (a.resolve() for a in artifacts):
            fmt = {".pte": "executorch", ".ptl": "torchscript_lite", ".onnx": "onnx", ".tflite": "litert"}[
                artifact.suffix
            ]
            forward = FORMATS[fmt].format().load(artifact, threads)
            with torch.no_grad():
                outputs = np.concatenate(
                    [forward(torch.from_numpy(inputs[i : i + 1])).float().numpy() for i in range(len(inputs))]
                )
            self.calls.append((artifact.name, tuple(cpus), len(inputs)))
            for cpu in cpus:
                if (artifact.suffix, cpu) in self.broken:
                    results.append(
                        aarch64.Result(artifact, cpu, seconds=1.0, error=self.broken[(artifact.suffix, cpu)])
                    )
                    continue
                changed = self.perturb.get((artifact.suffix, cpu), lambda a: a)(outputs.copy())
                info = {"runtime": "fake"}
                if (bundled or {}).get(artifact):  # the real verifier, here: passes as on x86 unless perturbed
                    bpte, rtol, atol = bundled[artifact]
                    info["bundled"] = (
                        bundled_program.verify(bpte, rtol, atol)
                        if np.array_equal(changed, outputs)
                        else {"passed": False, "cases": 8, "error": "perturbed"}
                    )
                results.append(aarch64.Result(artifact, cpu, outputs=[changed], seconds=1.0, info=info))
        return results


def _no_counter(progress=None, **kwargs):
    raise UsageError("no counting qemu in this test")


def _build(monkeypatch, tmp_path, digits_model, fake, *cpus, counter=_no_counter, extra=()):
    monkeypatch.setattr(aarch64, "prepare", fake.prepare)
    monkeypatch.setattr(aarch64, "run", fake.run)
    # the check before the build finds nothing to say: what the counter stand-in gives is decided after the rows
    monkeypatch.setattr(
        count_on_arm, "counting_qemu", SimpleNamespace(prepare=counter, unavailable=lambda *a, **k: None)
    )
    out = tmp_path / "build"
    args = [a for cpu in cpus for a in ("--cpu", cpu)]
    # judged as the suite's android build is (INT8_SLACK), which the first test compares its verdict with
    result = run_cli(
        *build_args(digits_model, out, "--target", "android", "--arch", "aarch64", *args, *INT8_SLACK, *extra)
    )
    assert result.exit_code in (0, 1), (result.output, result.exception)
    return result, json.loads((out / "manifest.json").read_text()), out


def test_every_pte_and_ptl_gets_a_row_per_cpu_judged_like_x86(monkeypatch, tmp_path, digits_model, android_build):
    fake = FakeArm("fake-identical")
    written = []  # the manifest on disk as each CPU's process starts
    fake.before_run = lambda: written.append(json.loads((tmp_path / "build" / "manifest.json").read_text()))
    result, doc, out = _build(monkeypatch, tmp_path, digits_model, fake, "cortex-a53", "cortex-a76")
    # while the second CPU runs, the manifest already holds the first one's rows and names the CPU still to run
    assert [w["aarch64"]["pending_cpus"] for w in written] == [["cortex-a53", "cortex-a76"], ["cortex-a76"]]
    assert all([r["cpu"] for r in a["aarch64"]] == ["cortex-a53"] for a in written[1]["artifacts"] if a.get("path"))
    assert "pending_cpus" not in doc["aarch64"]
    _, baseline = android_build
    assert result.exit_code == baseline.exit_code  # outputs identical to x86: the verdict is x86's
    jsonschema.validate(doc, manifest.schema())
    assert doc["target"]["validate"] == {
        "arch": ["x86_64", "aarch64"],
        "cpus": ["cortex-a53", "cortex-a76"],
        "count": True,
        "reference_cpu": "cortex-a76",
    }
    run = [a for a in doc["artifacts"] if a.get("path")]
    assert {a["format"] for a in run} == {"executorch", "litert", "torchscript_lite"}
    # one emulated process per CPU runs every artifact
    assert fake.runs == [({a["path"] for a in run}, (cpu,)) for cpu in ("cortex-a53", "cortex-a76")], fake.runs
    assert all(n == doc["data"]["validation"] for _, _, n in fake.calls)
    for entry in run:
        assert [r["cpu"] for r in entry["aarch64"]] == ["cortex-a53", "cortex-a76"]
        for row in entry["aarch64"]:
            assert row["emulated"] and row["latency_ms"] is None and "dotprod" in row["why"]
            assert row["vs_x86"] == {"max_abs_diff": 0.0, "bit_identical": True, "rows_differing": 0}
            assert row["status"] == entry["status"] or entry["status"] == "failed"
            assert row["fidelity"]["top1_agreement"] == entry["fidelity"]["top1_agreement"]
    for entry in (a for a in run if a["format"] == "executorch"):  # each .pte's golden program, verified everywhere
        golden = entry["bundled_program"]
        assert (out / golden["path"]).is_file() and golden["cases"] == 8 and golden["atol"] > 0
        assert set(golden["verified"]) == {"x86_64", "cortex-a53", "cortex-a76"}
        assert all(v["passed"] for v in golden["verified"].values()), golden["verified"]
    assert doc["aarch64"]["runner"]["key"] == "fake-identical" and doc["aarch64"]["seconds"] >= 0
    report = (out / "report.md").read_text()
    assert "cortex-a76" in report and "emulated" in report
    again = run_cli("validate", out, "--quiet")  # re-validation judges the rows again (from the row cache here)
    assert again.exit_code == result.exit_code, again.output
    revalidated = json.loads((out / "manifest.json").read_text())
    assert [[r["cpu"] for r in a["aarch64"]] for a in revalidated["artifacts"] if a.get("path")] == [
        ["cortex-a53", "cortex-a76"]
    ] * len(run)
    assert all(
        set(a["bundled_program"]["verified"]) == {"x86_64", "cortex-a53", "cortex-a76"}
        for a in revalidated["artifacts"]
        if a["format"] == "executorch"
    )
    assert run_cli("bundle", out, "--allow-failed").exit_code == 0
    bundled = json.loads((out / "bundle" / "android" / "bundle.json").read_text())["artifacts"]
    assert bundled and all(
        [r["cpu"] for r in a["aarch64"]] == ["cortex-a53", "cortex-a76"] and all(r["emulated"] for r in a["aarch64"])
        for a in bundled
    )


def test_an_artifact_that_departs_from_eager_on_one_cpu_fails(monkeypatch, tmp_path, digits_model):
    rng = np.random.default_rng(0)

    def noisy(logits):  # the kind of wrong a bad int8 kernel makes: scrambled scores on some images
        rows = rng.choice(len(logits), size=len(logits) // 3, replace=False)
        logits[rows] = rng.permutation(logits[rows], axis=1)
        return logits

    fake = FakeArm(
        "fake-perturbed",
        perturb={(".pte", "neoverse-n2"): noisy},
        broken={
            (suffix, "cortex-a53"): "RuntimeError: illegal instruction (cortex-a53)" for suffix in (".ptl", ".tflite")
        },
    )
    result, doc, _ = _build(monkeypatch, tmp_path, digits_model, fake, "cortex-a53", "neoverse-n2")
    assert result.exit_code == 1 and doc["status"] == "failed"
    for entry in (a for a in doc["artifacts"] if a.get("path")):
        rows = {r["cpu"]: r for r in entry["aarch64"]}
        assert entry["status"] == "failed"
        if entry["format"] == "executorch":
            assert rows["neoverse-n2"]["status"] == "failed" and not rows["neoverse-n2"]["vs_x86"]["bit_identical"]
            assert rows["neoverse-n2"]["vs_x86"]["rows_differing"] > 0
            assert any(r.cpu == "neoverse-n2" and r.metric == "top1_agreement" for r in revived(entry["reasons"]))
            assert any(r.startswith("aarch64 neoverse-n2 (emulated): top1_agreement") for r in texts(entry["reasons"]))
            assert not entry["bundled_program"]["verified"]["neoverse-n2"]["passed"]
            assert entry["bundled_program"]["verified"]["cortex-a53"]["passed"]
        else:
            assert rows["cortex-a53"]["status"] == "failed" and rows["cortex-a53"]["fidelity"] is None
            assert any(
                "could not run on aarch64: RuntimeError: illegal instruction" in r for r in texts(entry["reasons"])
            )


def test_arch_and_cpu_are_checked_before_anything_is_written(tmp_path, digits_model):
    from .helpers import assert_clean_refusal

    out = tmp_path / "build"
    result = run_cli(*build_args(digits_model, out, "--target", "android", "--cpu", "max"))
    assert_clean_refusal(result, out, "--cpu max is refused")
    result = run_cli(*build_args(digits_model, out, "--target", "android", "--cpu", "cortex-x9"))
    assert_clean_refusal(result, out, "unknown aarch64 CPU 'cortex-x9'")


@pytest.mark.parametrize(
    "outputs,x86,expected",
    [
        ([[1.0, 2.0]], [[1.0, 2.0]], {"max_abs_diff": 0.0, "bit_identical": True, "rows_differing": 0}),
        (
            [[1.0, 2.5], [0.0, 0.0]],
            [[1.0, 2.0], [0.0, 0.0]],
            {"max_abs_diff": 0.5, "bit_identical": False, "rows_differing": 1},
        ),
    ],
)
def test_distance_to_x86(outputs, x86, expected):
    import torch

    from exporter.engine.validate_on_arm import versus_x86

    assert versus_x86(torch.tensor(outputs), torch.tensor(x86)) == expected
    assert versus_x86(torch.tensor(outputs), None) is None


def test_counts_join_each_row_with_eager_beside_and_ship_this_ranks_by_them(monkeypatch, tmp_path, digits_model):
    """The counting itself is faked (tests/test_counting.py counts for real): a count per artifact that orders them
    against their x86 latency, so the pick shows which measure decided; eager counts more than any artifact, and
    fails on cortex-a53 (its rows there have no ratio, the others are counted)."""
    fake, batches = FakeArm("fake-counts"), []

    def count_many(runner, counter, items, inputs, cpu, warmup=1, runs=3):
        batches.append((cpu, inputs.shape, len(items)))
        results = []
        for what in items:
            name = what.name if isinstance(what, Path) else "eager"
            if name == "eager" and cpu == "cortex-a53":
                results.append(Failed(name, cpu, "torch.export refused it"))
                continue
            per = 10_000_000 if name == "eager" else 1_000_000 + Path(what).stat().st_size // 100
            results.append(Counts(name, cpu, per, 0.0, [per] * runs, [per + 7] * warmup, 5, 4600, "qemu 10 (fake)"))
        return results

    monkeypatch.setattr(count_on_arm.counting, "count_many", count_many)
    result, doc, _ = _build(
        monkeypatch,
        tmp_path,
        digits_model,
        fake,
        "cortex-a53",
        "cortex-a76",
        counter=lambda progress=None, **kwargs: Counter(tmp_path, {"key": "fake", "qemu_version": "qemu 10 (fake)"}),
    )
    jsonschema.validate(doc, manifest.schema())
    summary = doc["aarch64"]["instructions"]
    assert summary.get("reference_cpu") == "cortex-a76", summary
    assert summary["eager"] == {"cortex-a76": 10_000_000}
    assert summary["failed"] == {"eager on cortex-a53": "torch.export refused it"}
    run = [a for a in doc["artifacts"] if a.get("aarch64")]
    # one emulated process per core, eager and every artifact with a row in it, on one input
    assert batches == [(cpu, (1, 3, 224, 224), len(run) + 1) for cpu in ("cortex-a53", "cortex-a76")], batches
    for a in run:
        for row in a["aarch64"]:
            counts = row["instructions"]
            assert (
                counts["per_inference"] == 1_000_000 + a["size_bytes"] // 100
                and counts["warmup"] == counts["per_inference"] + 7
            )
            if row["cpu"] == "cortex-a53":
                assert counts["eager_per_inference"] is None and counts["ratio_to_eager"] is None
            else:
                assert counts["ratio_to_eager"] == round(10_000_000 / counts["per_inference"], 3)
            assert "not time" in counts["unit"]
    passed = [a for a in run if a["status"] == "passed"]
    smallest = min(passed, key=lambda a: a["size_bytes"])
    line = (tmp_path / "build" / "report.md").read_text()
    assert (
        f"`{smallest['name']}`" in line and "emulated instructions per inference on cortex-a76, ranked by count" in line
    )
    assert "Instructions: emulated aarch64 instructions" in line and "instructions / inference" in line
    assert "instructions / inference" in (tmp_path / "build" / "report.html").read_text()
    # the app bundle carries each row's counts, as the manifest has them
    assert run_cli("bundle", tmp_path / "build").exit_code == 0
    listed = json.loads((tmp_path / "build" / "bundle" / "android" / "bundle.json").read_text())["artifacts"]
    by_path = {a["path"]: a for a in run}
    bundled = [a for a in listed if a.get("aarch64")]
    assert bundled and all(
        row["instructions"] == by_path[a["file"]]["aarch64"][i]["instructions"]
        for a in bundled
        for i, row in enumerate(a["aarch64"])
    ), bundled


def test_a_build_without_a_counting_qemu_says_why_and_ranks_by_x86_latency(monkeypatch, tmp_path, digits_model):
    result, doc, out = _build(monkeypatch, tmp_path, digits_model, FakeArm("fake-no-counter"), "cortex-a76")
    assert doc["aarch64"]["instructions"]["unavailable"] == "no counting qemu in this test"
    assert not any(row.get("instructions") for a in doc["artifacts"] for row in a.get("aarch64", []))
    report = (out / "report.md").read_text()
    assert "Instruction counts: unavailable (no counting qemu in this test)" in report
    assert "ranked by count" not in report


def test_no_count_validates_on_arm_without_asking_for_a_counting_qemu(monkeypatch, tmp_path, digits_model):
    def never(progress=None, **kwargs):
        raise AssertionError("--no-count asked for the counting qemu")

    result, doc, out = _build(
        monkeypatch, tmp_path, digits_model, FakeArm("fake-no-count"), "cortex-a76", counter=never, extra=["--no-count"]
    )
    validate = doc["target"]["validate"]
    assert validate["cpus"] == ["cortex-a76"] and validate["count"] is False, validate
    assert "instructions" not in doc["aarch64"] and all(
        row["status"] for a in doc["artifacts"] for row in a.get("aarch64", [])
    )
    assert not any(row.get("instructions") for a in doc["artifacts"] for row in a.get("aarch64", []))
    assert "Instruction counts" not in (out / "report.md").read_text()


def test_final_detections_that_trade_places_are_compared_with_their_partners():
    """Two detections with rounding-equal scores, listed the other way round on x86: the same detections, so no
    distance; a real change of a box still shows."""
    import torch

    from exporter.engine.validate_on_arm import _paired, versus_x86
    from exporter.tasks.detections_in_graph import DetectionsInGraph

    task = DetectionsInGraph(11, (64, 64), None, decoding={"kind": "final", "detections_per_img": 3})
    arm = torch.tensor([[1, 1, 20, 20, 0.9, 3, 30, 30, 50, 50, 0.9, 5] + [0] * 6], dtype=torch.float32)
    x86 = torch.tensor([[30, 30, 50, 50, 0.9, 5, 1, 1, 20, 20, 0.9, 3] + [0] * 6], dtype=torch.float32)
    assert versus_x86(arm, _paired(task, arm, x86))["bit_identical"]
    moved = x86.clone()
    moved[0, 0] = 31.0
    assert versus_x86(arm, _paired(task, arm, moved))["max_abs_diff"] == 1.0
