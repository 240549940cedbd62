"""The Jetson target on the trained digits model: ONNX fp32/fp16/int8 built and validated here,
TensorRT engines reported unavailable without a GPU, and the device kit (build script, validator)."""

from __future__ import annotations

import json
from pathlib import Path
import shutil

import numpy as np
import pytest

from .helpers import (
    INT8_SLACK,
    assert_clean_refusal,
    assert_device_reproduces_the_build,
    build_args,
    run_cli,
    run_without_torch,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jetson_build(tmp_path_factory, digits_model):
    out = tmp_path_factory.mktemp("jetson") / "build"
    result = run_cli(*build_args(digits_model, out, "--target", "jetson", *INT8_SLACK))
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "manifest.json").read_text())


def _artifact(doc, name):
    return next(a for a in doc["artifacts"] if a["name"] == name)


def test_onnx_artifacts_pass_and_engines_are_unavailable(jetson_build):
    out, doc = jetson_build
    assert doc["status"] == "passed"
    for precision in ("fp32", "fp16", "int8"):
        onnx = _artifact(doc, f"onnx_{precision}")
        assert onnx["status"] == "passed", onnx["reasons"]
        assert (out / onnx["path"]).is_file()
        assert onnx["details"]["opset"] == 18 and onnx["details"]["batch_check"]["batch"] == 8
        engine = _artifact(doc, f"tensorrt_{precision}")
        assert engine["status"] == "unavailable" and engine["path"] is None
        assert engine["reasons"][0]["kind"] == "unavailable_here"
        assert engine["reasons"][0]["text"].startswith("not built on this host: ")
    assert _artifact(doc, "onnx_fp32")["fidelity"]["psnr_db"] >= 60


def test_onnx_files_carry_no_host_paths(jetson_build):
    """torch.onnx writes each node's Python stack into the file; kept, the bytes would depend on where the
    exporter and its venv are installed and on the line numbers of the code that called the export."""
    out, doc = jetson_build
    import exporter

    checkout = str(Path(exporter.__file__).resolve().parents[1]).encode()
    for precision in ("fp32", "fp16", "int8"):
        raw = (out / _artifact(doc, f"onnx_{precision}")["path"]).read_bytes()
        assert b"pkg.torch.onnx.stack_trace" not in raw and checkout not in raw, precision


def test_int8_qdq_keeps_labeled_accuracy(jetson_build):
    _, doc = jetson_build
    int8 = _artifact(doc, "onnx_int8")
    assert int8["details"]["quantized_nodes"] > 0
    assert int8["accuracy"]["drop_points"] <= int8["thresholds"]["accuracy_drop"]
    assert int8["fidelity"]["top1_agreement"] >= 0.97


def test_build_engine_script(jetson_build):
    out, doc = jetson_build
    script = (out / "build_engine.sh").read_text()
    trt11, trt10 = script.split("\nelse\n")
    for precision in ("fp32", "fp16", "int8"):
        assert (
            f"--onnx=mobilenet_v3_small_onnx_{precision}.onnx --saveEngine=mobilenet_v3_small_tensorrt_{precision}.engine"
            in script
        )
    assert "--minShapes=input:1x3x224x224 --optShapes=input:1x3x224x224 --maxShapes=input:8x3x224x224" in script
    assert "--fp16" in trt10 and "--int8" in trt10
    assert "--fp16" not in trt11 and "--int8" not in trt11  # TensorRT 11: the graph's types decide
    assert script.count("--noTF32") == 2 and "--useDLACore" not in script
    assert doc["jetson"]["warnings"] == []
    assert (out / "golden" / "inputs.npy").is_file() and (out / "golden" / "eager_logits.npy").is_file()


def _device_validate(directory):
    return run_without_torch(directory / "device_validate.py", directory, "--runtime", "onnxruntime")


def test_device_validate_passes_on_the_build(jetson_build):
    out, _ = jetson_build
    result = _device_validate(out)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("PASSED onnx_") for line in lines)
    assert_device_reproduces_the_build(out)


def test_device_validate_rejects_a_corrupted_onnx(jetson_build, tmp_path):
    out, doc = jetson_build
    copy = shutil.copytree(out, tmp_path / "copy")
    (copy / _artifact(doc, "onnx_fp16")["path"]).write_bytes(b"not an onnx model")
    result = _device_validate(copy)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "corrupted ONNX" in result.stderr


def test_device_validate_rejects_golden_outputs_of_the_wrong_shape(jetson_build, tmp_path):
    out, _ = jetson_build
    copy = shutil.copytree(out, tmp_path / "copy")
    np.save(copy / "golden" / "eager_logits.npy", np.zeros((8, 11), dtype=np.float32))
    result = _device_validate(copy)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "shape" in result.stderr


def test_device_validate_fails_an_artifact_its_runtime_fails_on_one_golden_input(jetson_build, monkeypatch, capsys):
    """On the device, as in the build: ONNX Runtime raising on one input fails that artifact with its error (exit 1),
    the others are still judged."""
    from exporter.device import device_validate

    out, _ = jetson_build
    real = device_validate._ort_runner

    def runner(path, output, threads=None):
        run = real(path, output, threads)
        if "int8" not in path.name:
            return run
        seen = []

        def fails_on_the_third(x):
            seen.append(x)
            if len(seen) == 3:
                raise RuntimeError(
                    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape"
                )
            return run(x)

        return fails_on_the_third

    monkeypatch.setattr(device_validate, "_ort_runner", runner)
    assert device_validate.main([str(out), "--runtime", "onnxruntime"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(line.split()[0] + " " + line.split()[1] for line in lines) == [
        "FAILED onnx_int8",
        "PASSED onnx_fp16",
        "PASSED onnx_fp32",
    ], lines
    assert (
        "FAILED onnx_int8 (onnxruntime): does not run on golden input 2: RuntimeError: [ONNXRuntimeError] : 1 : "
        "FAIL : Non-zero status code returned while running Reshape"
    ) in lines


def test_validate_device_command(jetson_build):
    out, doc = jetson_build
    result = run_cli("validate-device", out, "--runtime", "onnxruntime")
    assert result.exit_code == 0, result.output
    assert result.output.count("PASSED") == 3
    same_threads = run_cli("validate-device", out, "--runtime", "onnxruntime", "--threads", doc["host"]["threads"])
    assert same_threads.exit_code == 0 and same_threads.output.count("PASSED") == 3, same_threads.output
    assert run_cli("validate-device", out, "--threads", "0").exit_code == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--target", "jetson", "--option", "opset=11"], "opset 11 is not supported"),
        (["--target", "jetson", "--batch", "4:2:8"], "1 <= MIN <= OPT <= MAX"),
        (
            ["--target", "jetson", "--option", "external_data=sometimes"],
            "external_data 'sometimes': expected auto or always",
        ),
        (["--target", "android", "--dla-core", "0"], "dla_core apply to no format"),
        (["--target", "jetson", "--require-engine"], "--require-engine"),
    ],
)
def test_bad_requests_exit_2_and_write_nothing(digits_model, tmp_path, extra, message):
    out = tmp_path / "out"
    assert_clean_refusal(run_cli(*build_args(digits_model, out, *extra)), out, message)


def _has_gpu_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_gpu_tensorrt(), reason="this host can build engines")
def test_an_engine_this_host_cannot_build_is_shown_unavailable_with_the_reason_not_failed(digits_model, tmp_path):
    args = [
        a
        for a in build_args(
            digits_model, tmp_path / "out", "--target", "jetson", "--format", "tensorrt:fp32", "--format", "onnx:fp32"
        )
        if a != "--quiet"
    ]
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    reason = _artifact(json.loads((tmp_path / "out" / "manifest.json").read_text()), "tensorrt_fp32")["reasons"][0][
        "text"
    ]
    stderr = result.stderr.splitlines()
    (line,) = [line for line in stderr if "export tensorrt_fp32" in line]
    assert (
        line == f"– export tensorrt_fp32: unavailable on this host ({reason.removeprefix('not built on this host: ')})"
    )
    assert any(line.startswith("✓ export onnx_fp32") for line in stderr) and not any("✗" in line for line in stderr)


def test_a_step_that_cannot_run_here_says_so_whether_it_raises_or_reports_it():
    """Core ML's validation on Linux catches its RuntimeUnavailable inside the step (and measures a proxy): it
    printed ✓ as if the package had been run."""
    import io

    from rich.console import Console

    from exporter.formats import RuntimeUnavailable
    from exporter.progress import Progress

    progress, log = Progress(), io.StringIO()
    progress.console = Console(file=log, width=40)
    with pytest.raises(RuntimeUnavailable):
        with progress.step("export tensorrt_fp32", unavailable=RuntimeUnavailable):
            raise RuntimeUnavailable("no CUDA GPU [nvidia-smi found none]")
    with progress.step("validate coreml_fp16") as step:
        step.unavailable("Core ML predict needs macOS; this host is linux")
    with pytest.raises(ValueError):
        with progress.step("export onnx_fp32", unavailable=RuntimeUnavailable):
            raise ValueError("a real failure")
    with progress.step("validate onnx_fp32"):
        pass
    lines = log.getvalue().splitlines()
    assert lines[0] == "– export tensorrt_fp32: unavailable on this host (no CUDA GPU [nvidia-smi found none])"
    assert lines[1].startswith("– validate coreml_fp16 (") and lines[1].endswith(
        "): unavailable on this host (Core ML predict needs macOS; this host is linux)"
    )
    assert lines[2].startswith("✗ export onnx_fp32 (") and lines[3].startswith("✓ validate onnx_fp32 (")
    assert len(lines) == 4 and "validate coreml_fp16" in progress.timings  # whole lines, never wrapped at 40


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu_tensorrt(), reason="needs the tensorrt package and a CUDA GPU")
def test_tensorrt_engines_on_gpu(digits_model, tmp_path):
    out = tmp_path / "gpu"
    result = run_cli(*build_args(digits_model, out, "--target", "jetson", "--format", "tensorrt", "--require-engine"))
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "manifest.json").read_text())
    for entry in doc["artifacts"]:
        assert entry["status"] == "passed", entry["reasons"]
        assert entry["details"]["gpu"] and entry["details"]["compute_capability"]
    assert (out / "tensorrt_timing.cache").is_file()


def test_fp16_onnx_folds_batchnorm_in_float32_before_the_cast(tmp_path):
    """Each conv's BatchNorm is folded in float32 and the folded weight rounded to half once; folded in half
    (the ONNX optimizer on a half graph), scale and shift carry half's rounding into every weight."""
    import onnx
    import torch
    from torch import nn
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    from exporter.formats import onnx as onnx_format
    from exporter.formats.half import HalfModel

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    ).eval()
    bn = model[1]
    with torch.no_grad():
        (
            bn.running_mean.uniform_(-1, 1),
            bn.running_var.uniform_(0.01, 3),
            bn.weight.uniform_(0.5, 2),
            bn.bias.uniform_(-1, 1),
        )
    example = torch.randn(1, 3, 16, 16)
    expected = fuse_conv_bn_eval(model[0], bn).weight.detach().half().numpy()

    def conv_weight(path):
        proto = onnx.load(str(path))
        assert not any(n.op_type == "BatchNormalization" for n in proto.graph.node)
        (conv,) = [n for n in proto.graph.node if n.op_type == "Conv"]
        init = {i.name: i for i in proto.graph.initializer}
        return onnx.numpy_helper.to_array(init[conv.input[1]])

    details = onnx_format.FORMAT.export(model, example, "fp16", None, tmp_path / "folded.onnx", {})
    assert details["batchnorm_folding_fp32"] == {"batchnorms": 1, "folded": 1}
    assert np.array_equal(conv_weight(tmp_path / "folded.onnx"), expected)
    onnx_format._export_graph(HalfModel(model).eval(), example, 18, tmp_path / "half.onnx")
    assert not np.array_equal(conv_weight(tmp_path / "half.onnx"), expected)  # what the test tells apart


def test_a_transformer_onnx_graph_runs_at_every_batch_and_one_that_keeps_batch_1_is_refused(tmp_path):
    """torch's exporter, traced at batch 1, bakes batch 1 into nn.MultiheadAttention's reshapes (ViT-B/16's ONNX
    ran at batch 1 and failed at 8). Traced at batch 2 the graph runs at the profile's largest batch; a graph that
    still keeps batch 1 is refused naming the option that exports it for batch 1."""
    import torch
    from torchvision.models.vision_transformer import VisionTransformer

    from exporter.coverage.outcome import classify
    from exporter.formats import onnx as onnx_format

    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    torch.nn.init.normal_(model.heads.head.weight)
    example = torch.randn(1, 3, 32, 32)
    details = onnx_format.FORMAT.export(model, example, "fp32", None, tmp_path / "dynamic.onnx", {}, batch="1:1:8")
    assert details["batch_check"]["batch"] == 8 and details["batch_check"]["max_abs_diff_vs_batch1"] < 1e-4
    # its fp16 graph killed ONNX Runtime 1.32's x86 NchwcTransformer (segfault); the build goes on without that pass
    details = onnx_format.FORMAT.export(model, example, "fp16", None, tmp_path / "half.onnx", {}, batch="1:1:8")
    assert details["batch_check"]["batch"] == 8
    with torch.no_grad():
        assert torch.allclose(onnx_format.FORMAT.load(tmp_path / "half.onnx", 1)(example), model(example), atol=0.05)

    with torch.no_grad():  # the batch-1 trace the exporter used before
        torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            dynamic_shapes=({0: "batch"},),
            input_names=["input"],
            output_names=["logits"],
            verbose=False,
        ).save(str(tmp_path / "batch1.onnx"))
    with pytest.raises(RuntimeError, match=r"runs at batch 1 but not at batch 8 .*--option batch=1") as refused:
        onnx_format._check_batch_axis(tmp_path / "batch1.onnx", example, (1, 1, 8))
    assert classify(f"export failed: {refused.value}") == "fixed batch"


def test_a_graph_whose_session_kills_onnx_runtime_is_run_without_the_pass_that_does(tmp_path, monkeypatch):
    """A session that dies making the NCHWc layout (a crash, not an exception) is found in a child process, and
    every session of that file is then made without the NchwcTransformer, saying why."""
    import torch

    from exporter.formats import onnx as onnx_format

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(3)).eval()
    example = torch.randn(1, 3, 8, 8)
    model(example)
    path = tmp_path / "m.onnx"
    assert "onnxruntime_nchwc" not in onnx_format.FORMAT.export(model, example, "fp32", None, path, {})
    made = []
    real_session = __import__("onnxruntime").InferenceSession
    monkeypatch.setattr(
        "onnxruntime.InferenceSession",
        lambda *a, **k: made.append(k.get("disabled_optimizers")) or real_session(*a, **k),
    )
    onnx_format.FORMAT.load(path, 1)
    monkeypatch.setattr(onnx_format, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    monkeypatch.setattr(onnx_format.platform, "machine", lambda: "x86_64")  # the pass exists only on x86
    details = onnx_format.FORMAT.export(model, example, "fp32", None, path, {})
    assert "dies (signal 11)" in details["onnxruntime_nchwc"]
    onnx_format.FORMAT.load(path, 1)
    assert made[0] == [] and made[-1] == ["NchwcTransformer"]


def test_onnx_with_external_data_is_one_artifact_everywhere(digits_model, tmp_path):
    """A graph over protobuf's 2 GiB (ViT-H/14, RegNetY-128GF in fp32) is written as ONNX external data:
    `<file>.data` beside the graph. `external_data=always` gives the small digits model the same layout: the pair
    is validated, hashed, cached, bundled, restored and run on the device kit as one artifact."""
    from exporter import files

    out = tmp_path / "build"
    args = build_args(
        digits_model,
        out,
        "--target",
        "jetson",
        "--format",
        "onnx:fp32",
        "--format",
        "onnx:int8",
        "--option",
        "external_data=always",
        *INT8_SLACK,
    )
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "manifest.json").read_text())
    for precision in ("fp32", "int8"):
        entry = _artifact(doc, f"onnx_{precision}")
        graph, data = out / entry["path"], out / (entry["path"] + ".data")
        assert entry["status"] == "passed", entry["reasons"]
        assert entry["details"]["external_data"] == {"file": data.name, "bytes": data.stat().st_size}
        assert data.stat().st_size > graph.stat().st_size  # the tensors are in the .data file
        assert entry["size_bytes"] == graph.stat().st_size + data.stat().st_size
        assert entry["sha256"] == files.sha256(graph) != files.file_sha256(graph)
    assert _artifact(doc, "onnx_int8")["details"]["quantized_nodes"] > 0

    result = _device_validate(shutil.copytree(out, tmp_path / "moved"))  # found beside the graph, wherever it is
    assert result.returncode == 0 and result.stdout.count("PASSED onnx_") == 2, result.stdout + result.stderr

    assert run_cli("bundle", out).exit_code == 0
    bundled = {f["path"] for f in json.loads((out / "bundle" / "jetson" / "bundle.json").read_text())["files"]}
    assert {_artifact(doc, "onnx_fp32")["path"], _artifact(doc, "onnx_fp32")["path"] + ".data"} <= bundled

    again = run_cli(*build_args(digits_model, tmp_path / "again", *args[args.index("--target") :]))
    assert again.exit_code == 0, again.output
    restored = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert "reused from the cache" in " ".join(restored["cache"]["events"])
    for entry in restored["artifacts"]:
        assert files.sha256(tmp_path / "again" / entry["path"]) == entry["sha256"]

    data = out / (_artifact(doc, "onnx_fp32")["path"] + ".data")
    data.write_bytes(data.read_bytes()[:-4] + b"\0\0\0\0")
    tampered = run_cli("validate", out)
    assert tampered.exit_code == 2 and "does not match the sha256" in tampered.output


def test_an_artifact_its_runtime_fails_on_one_input_is_failed_with_the_error(digits_model, tmp_path, monkeypatch):
    """A runtime that raises on one validation input (ONNX Runtime on a shape only that image makes) fails that
    artifact with the runtime's error; the build goes on and exits 1, and the result is not cached (the next
    build validates again)."""
    import itertools

    from exporter.formats import onnx as onnx_format

    real = onnx_format.FORMAT.load

    def load(path, threads, **options):
        run, calls = real(path, threads, **options), itertools.count()

        def fails_on_the_fourth(x):
            if next(calls) == 3:
                raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Reshape: input {0,44} to {0,-1}\nsecond line")
            return run(x)

        return fails_on_the_fourth

    env = {"EXPORTER_CACHE": str(tmp_path / "cache")}
    monkeypatch.setattr(onnx_format.FORMAT, "load", load)
    result = run_cli(
        *build_args(digits_model, tmp_path / "build", "--target", "jetson", "--format", "onnx:fp32"), env=env
    )
    assert result.exit_code == 1 and "Traceback" not in result.output, (result.output, result.exception)
    (entry,) = [a for a in json.loads((tmp_path / "build" / "manifest.json").read_text())["artifacts"] if a.get("path")]
    assert entry["status"] == "failed" and entry["reasons"] == [
        {
            "kind": "does_not_run",
            "text": "does not run on every validation input: RuntimeError: [ONNXRuntimeError] : 1 : FAIL : Reshape: "
            "input {0,44} to {0,-1}",
        }
    ], entry
    assert (tmp_path / "build" / entry["path"]).exists() and entry["fidelity"] is None
    monkeypatch.undo()
    result = run_cli(
        *build_args(digits_model, tmp_path / "again", "--target", "jetson", "--format", "onnx:fp32"), env=env
    )
    (entry,) = [a for a in json.loads((tmp_path / "again" / "manifest.json").read_text())["artifacts"] if a.get("path")]
    assert result.exit_code == 0 and entry["status"] == "passed" and not entry.get("validation_reused_from_cache"), (
        entry
    )
    assert entry["artifact_reused_from_cache"] is True
    # `exporter validate` on that build, its runtime now refusing the file: failed, and none of the earlier numbers
    monkeypatch.setattr(
        onnx_format.FORMAT,
        "load",
        lambda path, threads, **options: (_ for _ in ()).throw(
            RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed")
        ),
    )
    result = run_cli("validate", tmp_path / "again", env=env)
    (entry,) = [a for a in json.loads((tmp_path / "again" / "manifest.json").read_text())["artifacts"] if a.get("path")]
    assert result.exit_code == 1 and entry["status"] == "failed", (result.output, entry)
    assert entry["reasons"] == [
        {
            "kind": "does_not_load",
            "text": "does not load: RuntimeError: [ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed",
        }
    ]
    assert entry["fidelity"] is entry["latency_ms"] is None and "golden_fidelity" not in entry, entry
