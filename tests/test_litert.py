"""LiteRT (.tflite): fp32 agrees with eager as the android profile asks, int8 comes out of the shared budget search
and meets its budget on real digits, a missing extra is one line. One build of both artifacts, at 64 px."""

from __future__ import annotations

import json
import tomllib

import pytest

from .helpers import ROOT, assert_clean_refusal, build_args, hide_module, run_cli

pytest.importorskip("litert_torch")
pytest.importorskip("ai_edge_litert")

SIZE = ["--input-size", "64", "64"]


@pytest.fixture(scope="module")
def litert_build(tmp_path_factory, digits_model):
    out = tmp_path_factory.mktemp("litert") / "build"
    result = run_cli(
        *build_args(digits_model, out, "--target", "android", "--format", "litert:fp32", "--format", "litert:int8"),
        *SIZE,
    )
    return out, result


@pytest.fixture(scope="module")
def entries(litert_build) -> dict:
    out, result = litert_build
    assert result.exit_code == 0, (result.output, result.exception)
    doc = json.loads((out / "manifest.json").read_text())
    return {entry["name"]: entry for entry in doc["artifacts"]}


def _thresholds(precision: str) -> dict:
    return tomllib.loads((ROOT / "targets" / "android.toml").read_text())["thresholds"][precision]


def test_fp32_tflite_agrees_with_eager(litert_build, entries):
    fp32 = entries["litert_fp32"]
    assert fp32["status"] == "passed", fp32["reasons"]
    assert fp32["path"].endswith(".tflite") and (litert_build[0] / fp32["path"]).is_file()
    wanted = _thresholds("fp32")
    assert fp32["fidelity"]["top1_agreement"] >= wanted["top1_agreement"]
    assert fp32["fidelity"]["psnr_db"] >= wanted["psnr_db"]
    io = fp32["details"]["io"]
    assert io["inputs"][0]["shape"] == [1, 3, 64, 64] and io["inputs"][0]["dtype"] == "float32"


def test_int8_tflite_meets_its_budget_through_the_shared_search(entries):
    int8 = entries["litert_int8"]
    assert int8["status"] == "passed", int8["reasons"]
    report = int8["details"]["quantization"]
    assert report["meets_budget"] and "PT2EQuantizer (litert_torch)" in report["calibration_method"]
    assert report["steps"] and report["int8_layers"] > 0
    assert "dynamic_ranges" not in report  # LiteRT's search has no ranges chosen per inference
    wanted = _thresholds("int8")
    assert int8["fidelity"]["top1_agreement"] >= wanted["top1_agreement"]
    assert int8["fidelity"]["psnr_db"] >= wanted["psnr_db"]
    # the app feeds it the same float tensor as every other artifact, and reads float outputs
    io = int8["details"]["io"]
    assert io["inputs"][0]["dtype"] == io["outputs"][0]["dtype"] == "float32"
    assert "QUANTIZE" in int8["details"]["ops"] and "CONV_2D" in int8["details"]["ops"]


def test_missing_extra_is_one_line(tmp_path, digits_model, monkeypatch):
    hide_module(monkeypatch, "litert_torch")
    out = tmp_path / "no-extra"
    result = run_cli(*build_args(digits_model, out, "--target", "android", "--format", "litert:fp32"), *SIZE)
    assert_clean_refusal(result, out, "pip install 'exporter[litert]'")
