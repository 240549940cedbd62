"""int8 that holds its budget, through whole builds (`exporter build`): plain PTQ, then the most sensitive layers
back in float until the budget holds on held-out calibration images. Proven on the trained digits model and on a
copy of it with one deliberately fragile layer (same function in eager, hostile to a per-tensor int8 range), for
each int8 format the search serves: the .pte, the .tflite (LiteRT's own quantizer) and ONNX."""

from __future__ import annotations

import json

import pytest

from exporter import files
from exporter.standins import digits

from .helpers import FAST, build_args, run_cli

INT8 = [
    "--target",
    "android",
    "--target",
    "jetson",
    "--format",
    "executorch:int8",
    "--format",
    "litert:int8",
    "--format",
    "onnx:int8",
]


STRICT = [
    "--threshold",
    "int8.top1_agreement=0.99",
    "--threshold",
    "int8.psnr_db=30",
    "--threshold",
    "int8.accuracy_drop=0.5",
]


def _int8_artifacts(out):
    docs = [json.loads((out / target / "manifest.json").read_text()) for target in ("android", "jetson")]
    return {a["name"]: a for doc in docs for a in doc["artifacts"]}


def _fragile_args(model, checkpoint, out, *extra):
    args = build_args(model, out, *INT8, *extra)
    args[args.index("--checkpoint") + 1] = checkpoint
    return args


@pytest.fixture(scope="module")
def digits_int8(tmp_path_factory, digits_model):
    out = tmp_path_factory.mktemp("digits_int8") / "build"
    result = run_cli(*build_args(digits_model, out, *INT8, *STRICT))
    return out, result


@pytest.mark.slow
def test_digits_int8_meets_the_strict_budget_on_its_check_images_and_is_judged_on_the_rest(digits_int8):
    """What the budget guarantees: met on the held-out check images (the search floats layers until it is), then
    judged on the validation digits like any artifact. Whether those 120 digits also hold a 0.5-point drop depends
    on the stand-in, which is trained on the host (one trained on an AMD EPYC without AVX-512 lost 1 and 2 of them):
    the verdict must be honest, not a pass."""
    out, result = digits_int8
    artifacts = _int8_artifacts(out)
    failed = [name for name, a in artifacts.items() if a["status"] == "failed"]
    assert result.exit_code == (1 if failed else 0), result.output
    for name in ("executorch_int8", "litert_int8", "onnx_int8"):
        a = artifacts[name]
        assert (a["status"] == "passed") == (a["reasons"] == []), (name, a["reasons"])
        assert set(r.get("metric") for r in a["reasons"]) <= {"accuracy_drop", "top1_agreement"}, a["reasons"]
        assert a["fidelity"]["top1_agreement"] >= 0.97 and a["fidelity"]["psnr_db"] >= 30
        q = a["details"]["quantization"]
        assert q["meets_budget"] and q["check_images"] > 0 and q["check_labeled"]
        assert q["after"]["drop"] <= 0.5 and q["after"]["agreement"] >= 0.99  # on the check images
        assert q["int8_layers"] + len(q["float_layers"]) == q["layers"] > 50
        assert q["budget"]["psnr_db"] == 30 + q["psnr_margin_db"]
    page = (out / "report.html").read_text()
    assert "int8: budget and layer sensitivity" in page


@pytest.fixture(scope="module")
def fragile_builds(tmp_path_factory, digits_model, fragile_checkpoint):
    root = tmp_path_factory.mktemp("fragile_builds")
    plain = run_cli(*_fragile_args(digits_model, fragile_checkpoint, root / "plain", "--no-fallback"))
    # static ranges only: the layer search is what this build tests (ranges chosen per inference: the next one)
    budgeted = run_cli(
        *_fragile_args(digits_model, fragile_checkpoint, root / "budgeted", "--quant-budget", "dynamic_ranges=false")
    )
    args = build_args(digits_model, root / "dynamic", "--target", "android", "--format", "executorch:int8")
    args[args.index("--checkpoint") + 1] = fragile_checkpoint
    dynamic = run_cli(*args)
    return (root / "plain", plain), (root / "budgeted", budgeted), (root / "dynamic", dynamic)


@pytest.mark.slow
def test_plain_ptq_breaks_on_the_fragile_layer(fragile_builds):
    (out, result), *_ = fragile_builds
    assert result.exit_code == 1, result.output
    for name, a in _int8_artifacts(out).items():
        assert a["status"] == "failed" and any(r.get("metric") == "psnr_db" for r in a["reasons"]), name
        q = a["details"]["quantization"]
        assert q["float_layers"] == [] and not q["meets_budget"] and "--no-fallback" in q["note"]


@pytest.mark.slow
def test_budgeted_build_keeps_the_fragile_layer_in_float_and_recovers(fragile_builds):
    """The fragile layer (plain PTQ: under 10 dB, about chance) is found and kept float, and the artifact is back
    near eager; its last point of accuracy on 120 digits is the host-trained stand-in's (see the test above)."""
    _, (out, result), _ = fragile_builds
    artifacts = _int8_artifacts(out)
    failed = [name for name, a in artifacts.items() if a["status"] == "failed"]
    assert result.exit_code == (1 if failed else 0), result.output
    for name, a in artifacts.items():
        assert (a["status"] == "passed") == (a["reasons"] == []), (name, a["reasons"])
        assert all(r.get("metric") == "accuracy_drop" for r in a["reasons"]), (name, a["reasons"])
        assert a["fidelity"]["psnr_db"] >= 30 and a["accuracy"]["drop_points"] <= 3, (name, a["accuracy"])
        q = a["details"]["quantization"]
        kept = [f["name"] for f in q["float_layers"]]
        assert digits.FRAGILE_LAYER in kept, (name, kept)
        assert not q["before"]["meets_budget"] and q["after"]["meets_budget"]
        assert q["after"]["psnr_db"] >= q["budget"]["psnr_db"] > q["before"]["psnr_db"]
        assert len(kept) <= q["max_float_fraction"] * q["layers"]
        if name == "executorch_int8":  # the float layers stay inside the XNNPACK delegate
            assert a["details"]["delegation"]["ops_outside_on_tensors"] == {}
    notes = (out / "android" / "report.md").read_text()
    kept_line = next(line for line in notes.splitlines() if line.startswith("- `executorch_int8`: int8 budget met"))
    assert digits.FRAGILE_LAYER in kept_line.split("kept in float: ")[1]
    assert (out / "report.html").read_text().count('aria-label="int8 layer sensitivity') == 3


@pytest.mark.slow
def test_ranges_chosen_per_inference_are_tried_on_the_fragile_model_before_any_layer_goes_float(fragile_builds):
    """The same fragile model, .pte, default settings: static ranges miss (one channel 1000x the others sets the
    tensor's range), and ranges chosen per inference are tried before any layer goes float. What must hold is
    the verdict and the accounting, not which fallback won on this host: every layer XNNPACK's dynamic patterns
    leave float (its depthwise convs) is a float layer, within the cap if kept."""
    *_, (out, result) = fragile_builds
    a = json.loads((out / "manifest.json").read_text())["artifacts"][0]
    assert a["name"] == "executorch_int8" and result.exit_code == (1 if a["status"] == "failed" else 0), result.output
    assert all(r.get("metric") == "accuracy_drop" for r in a["reasons"]), a["reasons"]
    q = a["details"]["quantization"]
    assert not q["before"]["meets_budget"] and q["before"]["ranges"] == "histogram"
    tried = q["steps"][1]
    assert tried["ranges"] == "dynamic" and tried["float_layers"] > 0, q["steps"]  # its depthwise convs at least
    cap = q["max_float_fraction"] * q["layers"]
    assert tried.get("over_cap", False) == (tried["float_layers"] > cap)
    assert q["int8_layers"] == q["layers"] - len(q["float_layers"]) and len(q["float_layers"]) <= cap
    if q["after"]["ranges"] == "dynamic":
        assert q["after"]["float_layers"] == len(q["float_layers"]) and "dynamic" in q["calibration_method"]
    assert a["fidelity"]["psnr_db"] >= 30 and a["details"]["delegation"]["ops_outside_on_tensors"] == {}


@pytest.mark.slow
def test_a_second_trained_architecture_gets_an_honest_verdict_and_report(tmp_path, quantized_digits):
    """ShuffleNetV2 (channel shuffles, splits, no squeeze-excite), trained on the digits: an architecture
    the search was not built on. Nothing guarantees it passes; what must hold is that the verdict follows
    the thresholds, the exit code follows the verdicts, and the report says what the search did (its
    PT2E check on the reference graph has read lower than the .pte measures: 30 vs 36 dB on one host)."""
    from exporter.results import jsonable
    from exporter.thresholds import breaches

    out = tmp_path / "shufflenet"
    weight = "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V1"
    args = [
        "build",
        weight,
        "--checkpoint",
        quantized_digits.float_checkpoint,
        "--data",
        quantized_digits.data_dir,
        "--labels",
        quantized_digits.labels_file,
        "--out",
        out,
        "--quiet",
        *FAST,
        *INT8,
    ]
    result = run_cli(*args)
    artifacts = _int8_artifacts(out)
    assert result.exit_code == (1 if any(a["status"] == "failed" for a in artifacts.values()) else 0), result.output
    for name, a in artifacts.items():
        q = a["details"]["quantization"]
        # a failed artifact may also carry the build's finding on eager (eager rounded to int8 breaks the same
        # thresholds: the checkpoint's fault, tests/test_ill_conditioned.py); the verdict is the thresholds'
        broken = [r for r in a["reasons"] if r["kind"] == "threshold"]
        findings = {r["kind"] for r in a["reasons"]} - {"threshold"}
        assert broken == jsonable(breaches(a, a["thresholds"])) and findings <= {"ill_conditioned_reference"}
        assert a["status"] == ("failed" if broken else "passed") and (broken or not findings)
        assert q["meets_budget"] == q["after"]["meets_budget"] and (q["meets_budget"] or "budget not met" in q["note"])
        asked = [f for f in q["float_layers"] if "why" not in f]
        assert q["layers"] > 20 and len(asked) <= q["max_float_fraction"] * q["layers"]
        assert q["int8_layers"] == q["layers"] - len(q["float_layers"])


@pytest.mark.slow
def test_json_stdout_stays_a_manifest_through_onnx_calibration(tmp_path, digits_model):
    # ONNX Runtime's percentile calibrator prints to stdout, which carries the manifest under --json
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        digits_model.checkpoint,
        "--out",
        tmp_path / "out",
        "--target",
        "jetson",
        "--format",
        "onnx:int8",
        "--calib-size",
        "16",
        "--val-size",
        "16",
        "--iterations",
        "3",
        "--quant-budget",
        "onnx_calibration=percentile",
        "--json",
    )
    doc = json.loads(result.stdout)
    (entry,) = doc["artifacts"]
    q = entry["details"]["quantization"]
    assert q["calibration_method"].startswith("percentile") and q["onnx_calibration"] == "percentile"
    assert "dynamic_ranges" not in q  # a .pte setting


@pytest.mark.slow
def test_calibrated_ranges_that_fail_validation_are_made_again_per_inference(tmp_path, monkeypatch, digits_model):
    """Validation inputs the calibration images did not cover (here the validation digits at 4x contrast; found on
    EfficientNet-V2-M trained on the digits, where 6 of 172 validation digits drove squeeze-and-excitation gates 150x
    past their calibrated ranges): the static .pte meets its budget on the check images and fails validation, so the
    build makes it again with ranges chosen per inference, judges it on the same inputs, and keeps it if it passes;
    when the remade one fails too, the first is put back. The manifest keeps both verdicts either way."""
    import dataclasses

    from exporter import data
    from exporter.formats import executorch

    load = data.load_inputs
    monkeypatch.setattr(
        data,
        "load_inputs",
        lambda *args: (lambda inputs: dataclasses.replace(inputs, validation=inputs.validation * 4))(load(*args)),
    )
    # judged on PSNR only: at 4x contrast the stand-in's top-1 is near chance (a fresh clone's: eager acc@1 12.5 %),
    # so its logits are near ties and top-1 agreement says little. The clipping shows in PSNR: 9-12 dB with static
    # ranges, about 40 dB per inference; 20 dB sits far from both, so neither verdict hangs on the host's training
    args = (
        "--target",
        "android",
        "--format",
        "executorch:int8",
        "--val-size",
        "40",
        "--threshold",
        "int8.psnr_db=20",
        "--threshold",
        "int8.top1_agreement=0",
        "--threshold",
        "int8.accuracy_drop=100",
    )

    out = tmp_path / "kept"
    result = run_cli(*build_args(digits_model, out, *args))
    assert result.exit_code == 0, result.output
    [a] = json.loads((out / "manifest.json").read_text())["artifacts"]
    first = a["details"]["validation_retry"]["first"]
    assert first["ranges"] == "histogram" and first["status"] == "failed", first
    assert any(r.get("metric") == "psnr_db" for r in first["reasons"]), first["reasons"]
    q = a["details"]["quantization"]
    assert a["status"] == "passed" and q["after"]["ranges"] == "dynamic" and q["static_ranges"] is False
    assert {s["ranges"] for s in q["steps"]} == {"dynamic"}  # started from them: static ranges not searched again
    assert files.sha256(out / a["path"]) == a["sha256"]  # the file on disk is the one judged
    assert sorted(p.name for p in out.glob("*.pte")) == [a["path"]]  # no staged copy left
    assert "made again with ranges chosen per inference" in (out / "report.md").read_text()

    # the remade artifact fails too (plain static PTQ, no margin: the same clipping): the first is put back
    hook = executorch.FORMAT.per_inference_ranges
    monkeypatch.setattr(
        executorch.FORMAT,
        "per_inference_ranges",
        lambda calib, details: dataclasses.replace(
            hook(calib, details),
            settings={**calib.settings, "dynamic_ranges": False, "fallback": False, "psnr_margin_db": 0.0},
        ),
    )
    out = tmp_path / "restored"
    result = run_cli(*build_args(digits_model, out, *args, "--iterations", "9"))  # not the first build's replay
    assert result.exit_code == 1, result.output
    [b] = json.loads((out / "manifest.json").read_text())["artifacts"]
    retry = b["details"]["validation_retry"]
    assert retry["kept"] == "calibrated ranges" and retry["per_inference"]["status"] == "failed"
    assert b["status"] == "failed" and b["reasons"] == first["reasons"] and b["fidelity"] == first["fidelity"]
    q = b["details"]["quantization"]
    assert q["meets_budget"] and q["after"]["ranges"] == "histogram"
    assert files.sha256(out / b["path"]) == b["sha256"] and sorted(p.name for p in out.glob("*.pte")) == [b["path"]]
    assert (out / b["preview"]).is_file()
