"""LiteRT (.tflite) in the android build: fp32 agrees with eager as the profile asks, int8 comes out of the shared
budget search and meets its budget on the trained digits, and a missing extra is one line. The artifacts are the
suite's android build (`android_build`, which every file of its group checks): no build of their own."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch

from .helpers import ROOT, assert_clean_refusal, build_args, hide_module, run_cli

pytest.importorskip("litert_torch")
pytest.importorskip("ai_edge_litert")


@pytest.fixture(scope="module")
def entries(android_build) -> dict:
    out, result = android_build
    assert result.exit_code == 0, (result.output, result.exception)
    doc = json.loads((out / "manifest.json").read_text())
    return {entry["name"]: entry for entry in doc["artifacts"]}


def _thresholds(precision: str) -> dict:
    return tomllib.loads((ROOT / "targets" / "android.toml").read_text())["thresholds"][precision]


def test_fp32_tflite_agrees_with_eager(android_build, entries):
    fp32 = entries["litert_fp32"]
    assert fp32["status"] == "passed", fp32["reasons"]
    assert fp32["path"].endswith(".tflite") and (android_build[0] / fp32["path"]).is_file()
    wanted = _thresholds("fp32")
    assert fp32["fidelity"]["top1_agreement"] >= wanted["top1_agreement"]
    assert fp32["fidelity"]["psnr_db"] >= wanted["psnr_db"]
    (feed,) = fp32["details"]["io"]["inputs"]
    assert feed["dtype"] == "float32" and feed["shape"][:2] == [1, 3]
    assert fp32["memory"]["available"] and fp32["memory"]["peak_rss_increase_bytes"] > 0


def test_int8_tflite_meets_its_budget_through_the_shared_search(entries):
    int8 = entries["litert_int8"]
    assert int8["status"] == "passed", int8["reasons"]
    report = int8["details"]["quantization"]
    assert report["meets_budget"] and "PT2EQuantizer (litert_torch)" in report["calibration_method"]
    assert report["steps"] and report["int8_layers"] > 0
    assert "dynamic_ranges" not in report  # LiteRT's search has no ranges chosen per inference
    assert report["program"]["meets_budget"]  # the converted file, scored on the check images as its graph was
    # the budget holds on the search's check images (above); the 120 validation digits are judged at the android
    # build's slack (tests/helpers.py INT8_SLACK: training differs by host), the other thresholds as the profile has them
    wanted = _thresholds("int8")
    assert int8["fidelity"]["top1_agreement"] >= wanted["top1_agreement"]
    assert int8["fidelity"]["psnr_db"] >= wanted["psnr_db"]
    assert int8["accuracy"]["drop_points"] <= int8["thresholds"]["accuracy_drop"]
    # the app feeds it the same float tensor as every other artifact of the build, and reads float outputs
    io = int8["details"]["io"]
    assert io["inputs"][0]["dtype"] == io["outputs"][0]["dtype"] == "float32"
    assert "QUANTIZE" in int8["details"]["ops"] and "CONV_2D" in int8["details"]["ops"]
    assert int8["size_bytes"] < 0.5 * entries["litert_fp32"]["size_bytes"]


def test_missing_extra_is_one_line(tmp_path, digits_model, monkeypatch):
    hide_module(monkeypatch, "litert_torch")
    out = tmp_path / "no-extra"
    result = run_cli(*build_args(digits_model, out, "--target", "android", "--format", "litert:fp32"))
    assert_clean_refusal(result, out, "pip install 'exporter[litert]'")


def test_format_option_builds_the_tflite_alone(tmp_path, digits_model, android_build):
    """`--format litert:fp32` makes that artifact alone (from the suite's cache, as the android build made it)."""
    out = tmp_path / "alone"
    result = run_cli(*build_args(digits_model, out, "--format", "litert:fp32"))
    assert result.exit_code == 0, (result.output, result.exception)
    (entry,) = json.loads((out / "manifest.json").read_text())["artifacts"]
    assert entry["name"] == "litert_fp32" and entry["status"] == "passed"


class _Bicubic(torch.nn.Module):  # the converter has no lowering for antialiased bicubic resizing
    def forward(self, x):
        return torch.nn.functional.interpolate(x, scale_factor=2, mode="bicubic", antialias=True)


class _Fft(torch.nn.Module):  # its error ("Only 1D FFT ...") names no op; torch.fx's context does
    def forward(self, x):
        return torch.fft.rfft2(x).abs()


@pytest.mark.parametrize("model,operator", [(_Bicubic(), "aten._upsample_bicubic2d_aa"), (_Fft(), "aten._fft_r2c")])
def test_a_graph_the_converter_refuses_names_the_op_and_is_classified(model, operator, tmp_path):
    from exporter.coverage.outcome import classify
    from exporter.formats import litert

    with pytest.raises(litert.ConverterRefused) as refused:
        litert.FORMAT.export(model.eval(), torch.randn(1, 3, 8, 8), "fp32", None, tmp_path / "m.tflite", {})
    first_line = str(refused.value).splitlines()[0]
    assert first_line.startswith(f"unsupported op {operator}") and classify(first_line) == "unsupported op"
    assert not (tmp_path / "m.tflite").exists()
    unnamed = AssertionError("Number of input tokens (1) does not match output tokens (0)")
    assert litert.refusal(unnamed) is unnamed  # an error that names no op is kept as the converter raised it
