"""The precisions made on request: the .pte's fp16 (`--format executorch:fp16`: half-precision weights and arithmetic
inside the XNNPACK delegate, float32 input and output) and dynamic int8 (`executorch:int8_dynamic`: int8 weights,
activations quantized per inference, no calibration), and the .tflite's fp16, dynamic int8 and w8a16 (ai-edge-
quantizer's recipes on the fp32 file), each judged by the one contract against eager with the profile's thresholds
for its precision."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from exporter.formats import litert
from exporter.formats.executorch import FORMAT
from exporter.tasks.image_input import ImageBytesInput

from exporter.thresholds import breaches

from .helpers import build_args, run_cli


def _psnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean()))


class _Gate(nn.Module):
    """A squeeze-and-excite gate with the activation under test (MobileNetV3's Hardsigmoid, EfficientNet's SiLU)."""

    def __init__(self, channels: int, act: nn.Module, gate: nn.Module):
        super().__init__()
        self.pool, self.fc1, self.act, self.fc2, self.gate = (
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(channels, 4, 1),
            act,
            nn.Conv2d(4, channels, 1),
            gate,
        )

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


def _net(act: nn.Module, gate: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        act,
        nn.Conv2d(16, 16, 3, padding=1, groups=16),
        nn.BatchNorm2d(16),
        _Gate(16, nn.ReLU(), gate),
        nn.Conv2d(16, 24, 1),
        act,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(24, 10),
    )
    net.train()
    with torch.no_grad():  # batch norms settled on inputs like the example's, as trained ones are
        for _ in range(4):
            net(torch.randn(8, 3, 32, 32))
    return net.eval()


@pytest.mark.parametrize(
    "act, gate",
    [(nn.Hardswish(), nn.Hardsigmoid()), (nn.SiLU(), nn.Sigmoid()), (nn.ReLU(), nn.SiLU())],
    ids=["mobilenetv3-like", "efficientnet-like", "silu-gate"],
)
def test_an_fp16_program_is_one_delegated_graph_with_float32_io_close_to_eager(tmp_path, act, gate):
    """Hardsigmoid and SiLU, which ExecuTorch decomposes for half tensors into float32 arithmetic between casts
    XNNPACK does not take, stay inside the one delegate: only the input's and the output's casts are outside."""
    model, x = _net(act, gate), torch.randn(2, 3, 32, 32)
    path = tmp_path / "net.pte"
    details = FORMAT.export(model, x[:1], "fp16", None, path, {})
    delegation = details["delegation"]
    assert delegation["delegated_subgraphs"] == 1, delegation
    assert delegation["ops_outside_on_tensors"] == {"_to_dim_order_copy": 2}, delegation
    assert details["graph"] == "float16 with fp32 I/O casts"
    run = FORMAT.load(path, 1)
    out, ref = run(x[:1]), model(x[:1]).detach()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert 40 < _psnr(out, ref) < 100, _psnr(out, ref)  # fp16 rounding: close to eager, and not fp32-exact
    fp32 = tmp_path / "net32.pte"
    FORMAT.export(model, x[:1], "fp32", None, fp32, {})
    assert _psnr(FORMAT.load(fp32, 1)(x[:1]), ref) > 100


def test_an_fp16_program_takes_image_bytes_with_the_normalisation_in_float32(tmp_path):
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    model = ImageBytesInput(_net(nn.Hardswish(), nn.Hardsigmoid()), mean, std).eval()
    pixels = torch.randint(0, 256, (1, 32, 32, 3), dtype=torch.uint8)
    path = tmp_path / "bytes.pte"
    details = FORMAT.export(model, pixels, "fp16", None, path, {})
    assert details["graph"] == "float16 in model, float32 elsewhere"
    out, ref = FORMAT.load(path, 1)(pixels), model(pixels).detach()
    assert out.dtype == torch.float32 and _psnr(out, ref) > 40


@pytest.mark.parametrize("act, gate", [(nn.Hardswish(), nn.Hardsigmoid()), (nn.SiLU(), nn.Sigmoid())])
def test_a_dynamic_int8_program_needs_no_calibration_and_keeps_the_depthwise_layers_float(tmp_path, act, gate):
    model, x = _net(act, gate), torch.randn(2, 3, 32, 32)
    path = tmp_path / "net.pte"
    details = FORMAT.export(model, x[:1], "int8_dynamic", None, path, {})  # no calibration given
    assert details["delegation"]["delegated_subgraphs"] == 1 and details["delegation"]["ops_outside_on_tensors"] == {}
    q = details["dynamic_quantization"]
    assert q["float_layers"] == ["3"]  # the depthwise conv: XNNPACK has no dynamic int8 kernel for it
    assert q["int8_layers"] == q["layers"] - 1 == 5 and "per inference" in q["calibration"]
    out, ref = FORMAT.load(path, 1)(x[:1]), model(x[:1]).detach()
    assert out.dtype == torch.float32 and 35 < _psnr(out, ref) < 100, _psnr(out, ref)
    fp32 = tmp_path / "net32.pte"
    FORMAT.export(model, x[:1], "fp32", None, fp32, {})
    assert path.stat().st_size < fp32.stat().st_size


def _weight_types_and_metadata(path) -> tuple[set[str], dict[str, str]]:
    """The tensor types of every operator's constant inputs, and the model's metadata (name -> text)."""
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model_from_bytearray(bytearray(path.read_bytes()))
    names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    graph = model.subgraphs[0]
    constant = {i for i, t in enumerate(graph.tensors) if np.size(model.buffers[t.buffer].data) > 0}
    types = {names[graph.tensors[i].type] for op in graph.operators for i in op.inputs if i in constant}
    metadata = {m.name.decode(): bytes(model.buffers[m.buffer].data).decode() for m in model.metadata or []}
    return types, metadata


def test_an_fp16_tflite_stores_half_weights_and_asks_xnnpack_for_fp16_arithmetic(tmp_path):
    """float16 weights (half the bytes) and the metadata that lets XNNPACK compute in fp16 on a core with FP16
    arithmetic (and in fp32 on one without, x86 here: the file's numbers here are fp32 arithmetic on fp16 weights)."""
    model, x = _net(nn.Hardswish(), nn.Hardsigmoid()), torch.randn(2, 3, 32, 32)
    fp32, fp16 = tmp_path / "net32.tflite", tmp_path / "net16.tflite"
    litert.FORMAT.export(model, x[:1], "fp32", None, fp32, {})
    details = litert.FORMAT.export(model, x[:1], "fp16", None, fp16, {})
    assert details["recipe"]["recipe"] == "float_casting" and details["recipe"]["delegate_partitions"] == 1
    types, metadata = _weight_types_and_metadata(fp16)
    assert "FLOAT16" in types and metadata["reduced_precision_support"] == "fp16accfp16", (types, metadata)
    types32, metadata32 = _weight_types_and_metadata(fp32)
    assert "FLOAT16" not in types32 and "reduced_precision_support" not in metadata32
    ref = model(x).detach()
    out = litert.FORMAT.load(fp16, 1)(x)
    assert out.dtype == torch.float32 and 40 < _psnr(out, ref) < 110, _psnr(out, ref)  # fp16-rounded weights
    assert _psnr(litert.FORMAT.load(fp32, 1)(x), ref) > 110


@pytest.mark.parametrize("precision", ["int8_dynamic", "w8a16"])
def test_an_integer_tflite_takes_and_returns_float32_close_to_eager(tmp_path, precision):
    """dynamic int8 needs no calibration images; w8a16 ranges its int16 activations on them, and its int16 input and
    output are put back to float32 inside the file, as static int8's are."""
    model, x = _net(nn.Hardswish(), nn.Hardsigmoid()), torch.randn(4, 3, 32, 32)
    calib = [torch.randn(1, 3, 32, 32) for _ in range(8)] if precision == "w8a16" else None
    path = tmp_path / "net.tflite"
    details = litert.FORMAT.export(model, x[:1], precision, calib, path, {})
    assert details["recipe"]["recipe"] == litert.RECIPES[precision]
    assert [t["dtype"] for t in details["io"]["inputs"] + details["io"]["outputs"]] == ["float32", "float32"]
    assert ("int16_interface" in details.get("io_rewritten", {})) == (precision == "w8a16"), details
    out, ref = litert.FORMAT.load(path, 1)(x), model(x).detach()
    assert out.dtype == torch.float32 and 35 < _psnr(out, ref) < 100, _psnr(out, ref)
    if precision == "w8a16":
        with pytest.raises(ValueError, match="needs calibration images"):
            litert.FORMAT.export(model, x[:1], precision, None, tmp_path / "uncalibrated.tflite", {})


@pytest.mark.parametrize("precision", ["fp16", "int8_dynamic", "w8a16"])
def test_a_reduced_precision_tflite_takes_image_bytes(tmp_path, precision):
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    model = ImageBytesInput(_net(nn.Hardswish(), nn.Hardsigmoid()), mean, std).eval()
    pixels = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    calib = [torch.randint(0, 256, (1, 32, 32, 3), dtype=torch.uint8) for _ in range(8)]
    path = tmp_path / "bytes.tflite"
    details = litert.FORMAT.export(model, pixels[:1], precision, calib, path, {})
    assert details["io"]["inputs"][0]["dtype"] == "uint8" and details["io"]["outputs"][0]["dtype"] == "float32"
    out, ref = litert.FORMAT.load(path, 1)(pixels), model(pixels).detach()
    assert out.dtype == torch.float32 and _psnr(out, ref) > 35, _psnr(out, ref)


@pytest.mark.slow
def test_trained_digits_fp16_and_dynamic_int8_programs_are_judged_by_their_precisions_thresholds(
    tmp_path, digits_model
):
    """On labeled digits, against eager, with no calibration images (neither needs any): each artifact's verdict is
    its precision's thresholds from the profile. fp16 holds them (measured 59.7-61.0 dB, 100 % top-1); its file is
    not half of fp32's: ExecuTorch 1.5.1's XNNPACK serializer keeps convolution weights in fp32 (converted when
    XNNPACK packs them at load), the linears are stored in fp16."""
    out = tmp_path / "build"
    formats = ("executorch:fp32", "executorch:fp16", "executorch:int8_dynamic", "litert:fp16", "litert:int8_dynamic")
    result = run_cli(
        *build_args(digits_model, out, "--target", "android", "--calib-size", "0", *_each("--format", formats))
    )
    doc = json.loads((out / "manifest.json").read_text())
    by_name = {a["name"]: a for a in doc["artifacts"]}
    assert list(by_name) == [
        "executorch_fp32",
        "executorch_fp16",
        "executorch_int8_dynamic",
        "litert_fp16",
        "litert_int8_dynamic",
    ], result.output
    for a in by_name.values():  # the verdict is the thresholds' for its precision, the exit code the verdicts'
        assert a["thresholds"] == doc["target"]["thresholds"][a["precision"]]
        assert (a["status"] == "passed") == (breaches(a, a["thresholds"]) == []), a["reasons"]
    assert result.exit_code == (0 if all(a["status"] == "passed" for a in by_name.values()) else 1), result.output
    fp16 = by_name["executorch_fp16"]
    assert fp16["status"] == "passed" and fp16["thresholds"]["psnr_db"] == 40.0
    assert fp16["fidelity"]["psnr_db"] >= 40 and fp16["fidelity"]["top1_agreement"] >= 0.99
    assert fp16["details"]["delegation"]["ops_outside_on_tensors"] == {"_to_dim_order_copy": 2}
    assert fp16["details"]["rewrites"]["half_activations_as_arithmetic"]  # MobileNetV3's squeeze-excite gates
    assert 0.5 < fp16["size_bytes"] / by_name["executorch_fp32"]["size_bytes"] < 0.95
    dynamic = by_name["executorch_int8_dynamic"]
    assert dynamic["details"]["dynamic_quantization"]["int8_layers"] > 0
    assert dynamic["details"]["delegation"]["ops_outside_on_tensors"] == {}
    assert dynamic["size_bytes"] < 0.5 * by_name["executorch_fp32"]["size_bytes"]  # int8 weights where quantized
    # the .tflite's fp16: half the fp32 .pte's bytes (float16 weights, none kept in fp32 as the .pte's convolutions
    # are), fp16-rounded weights computed in fp32 here (x86 has no FP16 arithmetic: the file's hint falls back)
    tflite16 = by_name["litert_fp16"]
    assert tflite16["status"] == "passed" and tflite16["fidelity"]["psnr_db"] >= 40, tflite16["reasons"]
    assert tflite16["size_bytes"] < 0.6 * by_name["executorch_fp32"]["size_bytes"]
    assert by_name["litert_int8_dynamic"]["size_bytes"] < 0.5 * by_name["executorch_fp32"]["size_bytes"]
    report = (out / "report.md").read_text()
    assert "executorch_fp16" in report and "executorch_int8_dynamic" in report
    # the bundle lists them before fp32 (an app tries them first) and says which cores fp16 needs for its gain
    bundled = run_cli("bundle", out, *(["--allow-failed"] if result.exit_code else []))
    assert bundled.exit_code == 0, bundled.output
    records = json.loads((out / "bundle" / "android" / "bundle.json").read_text())["artifacts"]
    assert [(a["name"], a["role"]) for a in records] == [
        ("executorch_int8_dynamic", "alternative"),
        ("executorch_fp16", "alternative"),
        ("executorch_fp32", "fallback"),
        ("litert_int8_dynamic", "alternative"),
        ("litert_fp16", "alternative"),
    ]
    needs = {a["name"]: a.get("cpu_needs") for a in records}
    assert needs["executorch_fp16"] == ["fp16_arithmetic"] and needs["executorch_fp32"] is None
    assert "FP16 arithmetic" in {a["name"]: a.get("cpu_needs_why") for a in records}["executorch_fp16"]
    assert needs["litert_fp16"] is None  # XNNPACK computes it in fp32 where the core has no FP16 arithmetic


def _each(option: str, values) -> list[str]:
    return [part for value in values for part in (option, value)]
