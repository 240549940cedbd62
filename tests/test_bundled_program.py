"""ExecuTorch's own golden program (.bpte) on the trained digits model: made from a build's .pte, verified by
ExecuTorch's verifier on x86 (inside the aarch64 runner: tests/test_validation_on_arm.py), a
perturbed one refused with its reason, the tolerances derived from the measured gap, and bundles carrying it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from exporter.formats import bundled_program
from exporter.results import ArtifactResult, Kind, Reason, Status

INSIDE = Path(__file__).resolve().parent.parent / "exporter" / "aarch64" / "inside.py"
FP32 = "mobilenet_v3_small_executorch_fp32.pte"


# -- tolerances: a pure function ------------------------------------------------------------------------------


def test_bit_identical_artifact_still_gets_a_floor():
    eager = np.array([[3.0, -8.0, 0.5]], dtype=np.float32)
    tol = bundled_program.tolerances(eager.copy(), eager)
    assert tol["max_abs_gap"] == 0.0 and tol["output_scale"] == 8.0
    assert tol["atol"] == pytest.approx(bundled_program.FLOOR * 8.0) and tol["atol"] > 0
    assert tol["rtol"] == bundled_program.FLOOR
    assert "gap" in tol["rule"]


def test_a_larger_measured_gap_gives_larger_tolerances():
    rng = np.random.default_rng(0)
    eager = rng.normal(scale=5.0, size=(8, 10))
    small = bundled_program.tolerances(eager + 1e-3 * rng.normal(size=eager.shape), eager)
    large = bundled_program.tolerances(eager + 1e-1 * rng.normal(size=eager.shape), eager)
    assert large["atol"] > small["atol"] > bundled_program.FLOOR * small["output_scale"]
    assert large["rtol"] > small["rtol"]
    assert small["atol"] == pytest.approx(bundled_program.MARGIN * small["max_abs_gap"])
    # every measured element passes ExecuTorch's rule with room to spare
    artifact = eager + 1e-1 * rng.normal(size=eager.shape)
    tol = bundled_program.tolerances(artifact, eager)
    assert np.all(np.abs(artifact - eager) <= tol["atol"] + tol["rtol"] * np.abs(artifact))


def test_tolerances_take_several_outputs_and_refuse_mismatched_ones():
    a, b = np.ones((1, 4)), np.full((1, 2, 3), 100.0)
    tol = bundled_program.tolerances([a + 0.5, b], [a, b])
    assert tol["max_abs_gap"] == 0.5 and tol["output_scale"] == 100.0
    with pytest.raises(ValueError):
        bundled_program.tolerances([a], [a, b])
    with pytest.raises(ValueError):
        bundled_program.tolerances(np.ones((1, 3)), np.ones((1, 4)))
    assert bundled_program.tolerances(np.zeros(3), np.zeros(3))["atol"] > 0  # all-zero outputs: absolute floor


# -- on a real .pte of the digits build ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden_program(android_build, tmp_path_factory):
    """The fp32 .pte's .bpte as the pipeline makes it: its own outputs on golden/ inputs, tolerances from its
    distance to eager there."""
    import torch

    build, result = android_build
    assert result.exit_code == 0, result.output
    pte = build / FP32
    inputs = torch.from_numpy(np.load(build / "golden" / "inputs.npy"))
    expected = bundled_program.outputs(pte, inputs)
    tol = bundled_program.tolerances(
        [torch.cat([e[0] for e in expected])], [np.load(build / "golden" / "eager_logits.npy")]
    )
    out = tmp_path_factory.mktemp("bpte")
    details = bundled_program.write(pte, inputs, expected, tol["rtol"], tol["atol"], out / "fp32.bpte")
    # the same outputs pushed beyond atol on one element of one case: the verifier must refuse it
    bad = [tuple(t.clone() for t in e) for e in expected]
    bad[3][0][0, 2] += 10 * tol["atol"] + 10 * tol["rtol"] * abs(float(bad[3][0][0, 2]))
    bundled_program.write(pte, inputs, bad, tol["rtol"], tol["atol"], out / "bad.bpte")
    return {
        "build": build,
        "pte": pte,
        "inputs": inputs,
        "expected": expected,
        "tol": tol,
        "details": details,
        "good": out / "fp32.bpte",
        "bad": out / "bad.bpte",
    }


def test_bpte_made_from_a_pte_verifies_on_x86(golden_program):
    g = golden_program
    assert g["details"]["cases"] == len(g["inputs"]) == 8
    assert (
        g["details"]["program_sha256"]
        == json.loads((g["build"] / "manifest.json").read_text())["artifacts"][
            [a["path"] for a in json.loads((g["build"] / "manifest.json").read_text())["artifacts"]].index(FP32)
        ]["sha256"]
    )
    assert 0 < g["tol"]["atol"] < 0.01 * g["tol"]["output_scale"]  # fp32: a small measured gap, not a guess
    assert bundled_program.verify(g["good"], g["tol"]["rtol"], g["tol"]["atol"]) == {
        "passed": True,
        "cases": 8,
        "error": None,
    }


def test_bpte_holds_the_pte_the_inputs_and_the_outputs(golden_program, tmp_path):
    g = golden_program
    content = bundled_program.read(g["good"].read_bytes())
    assert content["method"] == "forward" and content["program"] == g["pte"].read_bytes()
    assert len(content["cases"]) == 8
    for i, case in enumerate(content["cases"]):
        assert np.array_equal(case["inputs"][0], g["inputs"][i : i + 1].numpy())
        assert np.array_equal(case["expected"][0], g["expected"][i][0].numpy())
    again = bundled_program.write(
        g["pte"], g["inputs"], g["expected"], g["tol"]["rtol"], g["tol"]["atol"], tmp_path / "again.bpte"
    )
    assert again["sha256"] == g["details"]["sha256"]  # byte-reproducible


def test_the_android_self_test_reads_the_bpte_as_the_exporter_does(golden_program, android_app_code, tmp_path):
    """SelfTest.kt's reader (Bpte.kt, compiled: tests/kotlin_app.py) gives the same program, inputs and outputs."""
    from . import kotlin_app

    g = golden_program
    theirs = bundled_program.read(g["good"].read_bytes())
    mine = kotlin_app.read_bpte(android_app_code, g["good"], tmp_path)
    assert (mine["version"], mine["method"], mine["program"]) == (
        theirs["version"],
        theirs["method"],
        theirs["program"],
    )
    assert len(mine["cases"]) == len(theirs["cases"]) == 8
    for a, b in zip(mine["cases"], theirs["cases"], strict=True):
        for role in ("inputs", "expected"):
            assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a[role], b[role], strict=True))


def test_expected_outputs_are_what_the_build_validated(golden_program):
    """outputs() gives, bit for bit, what the build's own runner (formats.executorch.FORMAT.load) gives."""
    import torch

    from exporter.formats import executorch

    g = golden_program
    runner = executorch.FORMAT.load(g["pte"], torch.get_num_threads())
    for i, e in enumerate(g["expected"]):
        assert torch.equal(runner(g["inputs"][i : i + 1]), e[0]), i


def test_perturbed_outputs_fail_verification_with_the_reason(golden_program):
    g = golden_program
    verdict = bundled_program.verify(g["bad"], g["tol"]["rtol"], g["tol"]["atol"])
    assert verdict["passed"] is False and verdict["cases"] == 8
    assert verdict["error"].startswith("case 3 of 8") and "1 of 10 elements outside" in verdict["error"], verdict
    # the same file within tolerances wide enough passes: it is the tolerance that decides
    assert bundled_program.verify(g["bad"], 0.0, 1e6)["passed"] is True
    assert bundled_program.verify(g["pte"], 0.0, 1.0)["passed"] is False  # a .pte is not a .bpte: refused, not raised


def test_write_refuses_cases_the_program_cannot_take(golden_program, tmp_path):
    g = golden_program
    with pytest.raises(ValueError, match="expected outputs"):
        bundled_program.write(g["pte"], g["inputs"], g["expected"][:3], 1e-5, 1e-5, tmp_path / "x.bpte")
    with pytest.raises(ValueError, match="program takes"):
        bundled_program.write(g["pte"], g["inputs"][:, :, :8], g["expected"], 1e-5, 1e-5, tmp_path / "x.bpte")
    assert not (tmp_path / "x.bpte").exists()


def test_inside_script_gives_the_same_verdicts_on_x86(golden_program):
    """inside.py --bundled, the aarch64 runner's verifier, run here with the host's packages."""
    g = golden_program
    verdicts = []
    for path in (g["good"], g["bad"]):
        done = subprocess.run(
            [
                sys.executable,
                str(INSIDE),
                "--bundled",
                str(path),
                "--rtol",
                repr(g["tol"]["rtol"]),
                "--atol",
                repr(g["tol"]["atol"]),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        verdicts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert verdicts[0]["passed"] is True and verdicts[0]["cases"] == 8 and verdicts[0]["error"] is None
    assert verdicts[1]["passed"] is False and verdicts[1]["error"].startswith("case 3 of 8"), verdicts[1]


def test_bundle_carries_the_bpte_beside_its_pte(golden_program, tmp_path):
    """A manifest entry with `bundled_program`, as the pipeline writes it, puts the .bpte in the bundle, in
    bundle.json under its artifact and in the file list; the zip stays byte-reproducible."""
    from exporter.release.bundle import make_bundle, zip_path

    g = golden_program
    build = tmp_path / "build"
    shutil.copytree(g["build"], build, ignore=shutil.ignore_patterns("bundle"))
    name = FP32.replace(".pte", bundled_program.SUFFIX)
    shutil.copyfile(g["good"], build / name)
    doc = json.loads((build / "manifest.json").read_text())
    entry = next(a for a in doc["artifacts"] if a["path"] == FP32)
    verified = {"x86": bundled_program.verify(build / name, g["tol"]["rtol"], g["tol"]["atol"])}
    entry["bundled_program"] = {**g["details"], "path": name, "tolerances": g["tol"], "verified": verified}
    (build / "manifest.json").write_text(json.dumps(doc))
    bundle = make_bundle(build)
    assert (bundle / name).read_bytes() == g["good"].read_bytes() and (bundle / FP32).is_file()
    described = json.loads((bundle / "bundle.json").read_text())
    record = next(a for a in described["artifacts"] if a["file"] == FP32)
    assert record["bundled_program"] == {
        "file": name,
        "sha256": g["details"]["sha256"],
        "rtol": g["tol"]["rtol"],
        "atol": g["tol"]["atol"],
        "verified": verified,
    }
    assert {"path": name, "sha256": g["details"]["sha256"], "size_bytes": g["details"]["size_bytes"]} in described[
        "files"
    ]
    assert all(
        ("bundled_program" in a) == a["file"].endswith(".pte") for a in described["artifacts"]
    )  # the build made the rest
    # what the Android self-test reads of it (the app is not compiled here: its keys are checked instead)
    kotlin = (
        Path(__file__).resolve().parent.parent
        / "apps/android/app/src/main/java/org/example/bundleclassifier/SelfTest.kt"
    ).read_text()
    for key in ("bundled_program", "file", "rtol", "atol"):
        assert f'"{key}"' in kotlin and key in record["bundled_program"] | {"bundled_program": 1}, key
    with zipfile.ZipFile(zip_path(bundle)) as zf:
        assert zf.read(name) == g["good"].read_bytes()
    first = zip_path(bundle).read_bytes()
    make_bundle(build)
    assert zip_path(bundle).read_bytes() == first
    # a .bpte that is not what the manifest says is refused like a tampered artifact
    (build / name).write_bytes(g["bad"].read_bytes())
    from exporter.errors import UsageError

    with pytest.raises(UsageError, match="sha256"):
        make_bundle(build)


def test_a_program_too_large_for_one_flatbuffer_gets_no_golden_program_and_says_why(tmp_path, monkeypatch):
    """A .bpte embeds the whole program in one flatbuffer (under 2 GiB): RegNetY-128GF's 2.6 GB fp32 .pte made the
    whole build fail (BuilderSizeError). Past the limit, its artifact stands without one, the reason in its details."""
    from types import SimpleNamespace

    from exporter.engine import bundled_program_step

    (tmp_path / "model.pte").write_bytes(b"x" * 64)
    entry = ArtifactResult(
        "executorch_fp32", "executorch", "fp32", path="model.pte", status=Status.PASSED, fidelity={"psnr_db": 80.0}
    )
    monkeypatch.setattr(bundled_program_step, "FLATBUFFER_LIMIT", 64)
    # nothing of the session but where the build is written is needed to decide
    bundled_program_step.add_golden_program(SimpleNamespace(out=tmp_path), entry)
    assert entry.status is Status.PASSED and entry.bundled_program is None
    assert entry.details["golden_program"].kind is Kind.NOTE  # a note: its artifact stands, the build is replayed
    assert entry.details["golden_program"].text.startswith("not made: the program is 0.00 GiB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pte"]


def test_a_golden_program_that_cannot_be_made_leaves_its_artifact_standing_and_says_why(tmp_path):
    """A program ExecuTorch cannot load to compute the expected outputs: the build goes on (before, any exception here
    failed the whole build), no .bpte is left, the reason is in the artifact's details and its verdict is unchanged."""
    from types import SimpleNamespace

    import torch

    from exporter.engine import bundled_program_step
    from exporter.progress import Progress

    (tmp_path / "model.pte").write_bytes(b"not a program")
    entry = ArtifactResult(
        "executorch_fp32",
        "executorch",
        "fp32",
        path="model.pte",
        sha256="0" * 64,
        status=Status.PASSED,
        fidelity={"psnr_db": 80.0},
    )
    inputs = SimpleNamespace(validation=torch.zeros(1, 3, 8, 8))
    session = SimpleNamespace(
        golden_rows=[0],
        inputs=inputs,
        fed_to=lambda format_name: inputs,
        digests=dict.fromkeys(("validation", "tools", "checkpoint", "reference", "task"), "d"),
        cache=SimpleNamespace(fetch_artifact=lambda digest, tmp: None),
        out=tmp_path,
        progress=Progress(quiet=True),
        prefix="",
    )
    bundled_program_step.add_golden_program(session, entry)
    assert entry.status is Status.PASSED and entry.reasons == [] and entry.bundled_program is None
    note = entry.details["golden_program"]
    assert note.kind is Kind.BUNDLED_PROGRAM_FAILED, note  # what the whole-build record reads: not replayed
    assert note.text.startswith(bundled_program_step.FAILED + "RuntimeError: "), note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pte"]


def test_a_build_whose_golden_program_failed_is_not_replayed_from_the_whole_build_record():
    """The failure may not happen again (memory, a one-off crash): like a failed export, it is not a settled outcome."""
    from exporter.engine import bundled_program_step
    from exporter.engine.record import BuildRecord

    stored = []
    record = object.__new__(BuildRecord)  # store decides before it reads anything of its own but its key
    record.key, record._key = "its key", lambda: stored.append("went on") or "another key"
    from .fake_manifest import complete, verdict

    def built(golden: Reason) -> dict:  # a manifest as a build writes it, its one .pte's golden program `golden`
        entry = {"name": "executorch_fp32", "format": "executorch", "precision": "fp32", **verdict("executorch")}
        entry |= {"path": "model.pte", "sha256": "ab" * 32, "size_bytes": 6, "thresholds": {}}
        entry |= dict.fromkeys(("fidelity", "accuracy", "eager_latency_ms", "speedup_vs_eager"))
        return complete({"artifacts": [entry | {"details": {"golden_program": golden.to_json()}}]})

    failed = Reason(Kind.BUNDLED_PROGRAM_FAILED, bundled_program_step.FAILED + "RuntimeError: out of memory")
    record.store(Path("unused"), [built(failed)])
    assert stored == []
    record.store(Path("unused"), [built(Reason(Kind.NOTE, "not made: the program is 2.37 GiB, ..."))])  # settled
    assert stored == ["went on"]
