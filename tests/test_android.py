"""End to end: the android target on a really trained model, through the CLI."""

import json
import re
import shutil

import jsonschema
import pytest

from exporter import files
from exporter.release import manifest

from .helpers import build_args, run_cli


@pytest.fixture(scope="module")
def doc(android_build):
    out, result = android_build
    assert result.exit_code == 0, result.output + str(result.exception)
    return json.loads((out / "manifest.json").read_text())


def test_manifest_matches_schema(doc):
    jsonschema.validate(doc, manifest.schema())


def test_every_artifact_passed_and_is_what_the_manifest_says(android_build, doc):
    out, _ = android_build
    by_name = {a["name"]: a for a in doc["artifacts"]}
    assert set(by_name) == {"executorch_fp32", "executorch_int8", "litert_fp32", "litert_int8", "torchscript_lite_fp32"}
    for a in doc["artifacts"]:
        assert a["status"] == "passed", a["reasons"]
        path = out / a["path"]
        assert files.sha256(path) == a["sha256"] and path.stat().st_size == a["size_bytes"]
        assert a["latency_ms"]["p50"] <= a["latency_ms"]["p90"] <= a["latency_ms"]["p99"]
        assert a["speedup_vs_eager"] == pytest.approx(a["eager_latency_ms"]["p50"] / a["latency_ms"]["p50"])
    assert not list(out.glob(".*partial*"))


def test_float_artifacts_are_made_before_the_int8_search_and_listed_in_the_targets_order(doc):
    exports = dict.fromkeys(step.split()[1] for step in doc["timings_s"] if step.startswith("export "))
    assert list(exports) == [
        "executorch_fp32",
        "litert_fp32",
        "torchscript_lite_fp32",
        "executorch_int8",
        "litert_int8",
    ]
    assert [a["name"] for a in doc["artifacts"]] == [
        spec["format"] + "_" + spec["precision"] for spec in doc["target"]["artifacts"]
    ]


def test_fidelity_and_accuracy_on_trained_model(doc):
    eager = doc["eager"]["accuracy"]
    assert eager["acc1"] >= 95.0  # the digits model really learned
    by_name = {a["name"]: a for a in doc["artifacts"]}
    fp32 = by_name["executorch_fp32"]["fidelity"]
    assert fp32["top1_agreement"] == 1.0 and fp32["psnr_db"] >= 60
    int8 = by_name["executorch_int8"]
    assert int8["fidelity"]["top1_agreement"] >= 0.97 and 30 <= int8["fidelity"]["psnr_db"] < 80
    assert int8["accuracy"]["drop_points"] <= 1.0
    # int8 must really be smaller: weights went from 4 bytes to 1
    assert int8["size_bytes"] < 0.5 * by_name["executorch_fp32"]["size_bytes"]


def test_delegation_is_recorded(doc):
    for a in doc["artifacts"]:
        if a["format"] == "executorch":
            d = a["details"]["delegation"]
            assert d["delegated_nodes"] > 50 and d["delegated_subgraphs"] >= 1
            assert isinstance(d["ops_outside_delegate"], dict)
            # every op on real tensors runs inside XNNPACK; only scalar constant casts stay outside
            assert d["ops_outside_on_tensors"] == {}


def test_lite_interpreter_route_says_whether_xnnpack_rewrite_ran(doc):
    lite = next(a for a in doc["artifacts"] if a["format"] == "torchscript_lite")
    rewrite = lite["details"]["xnnpack_rewrite"]
    assert rewrite in ("applied", "unavailable")
    if rewrite == "unavailable":
        assert "XNNPACK" in lite["details"]["xnnpack_rewrite_reason"]


def test_manifest_records_provenance(doc, digits_model):
    assert doc["weight"]["name"] == "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    assert doc["checkpoint"]["sha256"] == files.sha256(digits_model.checkpoint)
    assert doc["tools"]["torch"].startswith("2.14.1") and doc["tools"]["executorch"] == "1.5.1"
    assert doc["host"]["threads"] >= 1 and doc["command"]
    assert doc["exporter_commit"] is None or len(doc["exporter_commit"].split("-")[0]) == 40
    assert doc["data"]["labeled"] and doc["data"]["validation"] == 120 and doc["data"]["calibration"] == 64


def test_report_and_side_files(android_build, doc):
    out, _ = android_build
    report = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    for a in doc["artifacts"]:
        assert a["name"] in report and a["name"] in page
    # a latency chart, an accuracy-vs-size chart, and a sensitivity chart per int8 artifact whose budget search
    # measured its layers (how many did depends on the stand-in, trained on this host)
    charts = re.findall(r'<svg role="img" aria-label="([^"]*)"', page)
    int8 = {a["name"] for a in doc["artifacts"] if a["precision"] == "int8"}
    assert sorted(c for c in charts if not c.startswith("int8 layer sensitivity of ")) == [
        "acc@1 vs size",
        "latency p50",
    ]
    assert {c.removeprefix("int8 layer sensitivity of ") for c in charts if c.startswith("int8 ")} <= int8, charts
    assert page.count("<svg") == len(charts) and "http" not in page.split("<body>")[0]  # self-contained
    assert (out / "labels.txt").read_text().splitlines()[7] == "digit 7"
    assert json.loads((out / "preprocessing.json").read_text())["crop_size"] == [224]
    import numpy as np

    assert np.load(out / "golden" / "inputs.npy").shape == (8, 3, 224, 224)
    assert np.load(out / "golden" / "eager_logits.npy").shape == (8, 10)


def test_impossible_threshold_fails_with_exit_1(tmp_path, digits_model):
    out = tmp_path / "strict"
    result = run_cli(*build_args(digits_model, out, "--format", "torchscript_lite", "--threshold", "fp32.psnr_db=1000"))
    assert result.exit_code == 1, result.output
    doc = json.loads((out / "manifest.json").read_text())
    (lite,) = doc["artifacts"]
    assert lite["status"] == "failed" and lite["reasons"][0]["metric"] == "psnr_db"
    assert doc["status"] == "failed"
    assert (out / lite["path"]).exists()  # everything is still written


def test_validate_reruns_and_detects_tampering(tmp_path, android_build, doc):
    out = tmp_path / "copy"
    shutil.copytree(android_build[0], out)
    result = run_cli("validate", out, "--quiet", "--threshold", "int8.psnr_db=200")
    assert result.exit_code == 1
    again = json.loads((out / "manifest.json").read_text())
    statuses = {a["name"]: a["status"] for a in again["artifacts"]}
    assert statuses == {
        "executorch_fp32": "passed",
        "executorch_int8": "failed",
        "litert_fp32": "passed",
        "litert_int8": "failed",
        "torchscript_lite_fp32": "passed",
    }
    result = run_cli("validate", out, "--quiet", "--threshold", "fp16.psnr_db=1")
    assert result.exit_code == 2 and "android builds no fp16 artifact" in result.stderr, result.output
    assert json.loads((out / "manifest.json").read_text()) == again

    pte = out / doc["artifacts"][0]["path"]
    pte.write_bytes(pte.read_bytes()[:-100])
    result = run_cli("validate", out, "--quiet")
    assert result.exit_code == 2 and "does not match the sha256" in result.stderr


def test_named_weight_through_torch_hub_cache(tmp_path, torch_home, digits_model):
    out = tmp_path / "hub"
    args = [
        "build",
        "mobilenet_v3_small",
        "--data",
        digits_model.data_dir,
        "--out",
        out,
        "--quiet",
        "--format",
        "torchscript_lite",
        "--no-verify",
        "--calib-size",
        "8",
        "--val-size",
        "60",
        "--warmup",
        "1",
        "--iterations",
        "5",
    ]
    result = run_cli(*args, env={"TORCH_HOME": str(torch_home)})
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["checkpoint"]["source"] == "torch-hub-cache" and doc["checkpoint"]["verified"] is False
    assert doc["labels"]["count"] == 10 and doc["eager"]["accuracy"]["acc1"] >= 95


def test_without_data_validates_on_synthetic_inputs(tmp_path, digits_model):
    out = tmp_path / "nodata"
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        digits_model.checkpoint,
        "--out",
        out,
        "--format",
        "torchscript_lite",
        "--val-size",
        "16",
        "--calib-size",
        "4",
        "--iterations",
        "5",
        "--json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["data"]["source"] == "synthetic" and doc["eager"]["accuracy"] is None
    assert doc["artifacts"][0]["accuracy"] is None and doc["artifacts"][0]["fidelity"]["samples"] == 16
    assert "not measured" in (out / "report.md").read_text()


def test_ops_left_outside_the_delegate_are_named_by_their_aten_op():
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from exporter.formats.executorch import _outside_on_tensors

    class SplitThenMean(torch.nn.Module):  # XNNPACK 1.5.1 takes neither split_with_sizes nor mean.dim
        def forward(self, x):
            a, b = x.split([2, 2], dim=1)
            return torch.cat([b, a], 1).mean(dim=(2, 3))

    edge = to_edge_transform_and_lower(
        torch.export.export(SplitThenMean(), (torch.randn(1, 4, 8, 8),)), partitioner=[XnnpackPartitioner()]
    )
    assert _outside_on_tensors(edge.exported_program().graph_module) == {"split_with_sizes_copy": 1, "mean": 1}


def _traces_differently():
    """A graph that differs from one trace to the next (as ViT-B/16's nn.MultiheadAttention did)."""
    import torch

    class Model(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Model.calls += 1
            return x * 2 if Model.calls % 2 else (x + x)

    return Model().eval()


def test_a_ptl_whose_trace_check_fails_is_traced_unchecked_and_says_so(tmp_path):
    """torch.jit.trace's own sanity check compares two traces; where they differ (ViT-B/16) the model is traced
    once without it and the manifest says why: the build's validation against eager is the check that counts."""
    import torch

    from exporter.formats import torchscript_lite

    example = torch.randn(1, 3, 4, 4)
    details = torchscript_lite.FORMAT.export(_traces_differently(), example, "fp32", None, tmp_path / "m.ptl", {})
    assert details["trace_check"].startswith("Tracing failed sanity checks! ERROR: Graphs differed across invocations!")
    out = torchscript_lite.FORMAT.load(tmp_path / "m.ptl", 1)(example)
    assert torch.allclose(torch.as_tensor(out), example * 2)
