"""RAM and per-operator time per artifact (exporter/engine/memory_profile.py): the digits android build's .pte
fp32/int8 and .ptl, and a small ONNX file in ONNX Runtime. Guarantees, not this host's numbers."""

from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from exporter.engine import memory_profile
from exporter.release import manifest
from exporter.results import ArtifactResult, Status


@pytest.fixture(scope="module")
def doc(android_build):
    out, result = android_build
    assert result.exit_code == 0, result.output
    return json.loads((out / "manifest.json").read_text())


def _entries(doc) -> dict:
    return {a["name"]: a for a in doc["artifacts"]}


def _activation_bound(doc) -> int:
    """float32 bytes of the input, the output and every layer's output of the graph: what a plan without any
    reuse would need; a memory plan is at most that."""
    import torchvision

    model = getattr(torchvision.models, doc["weight"]["model"])(num_classes=doc["weight"]["num_classes"]).eval()
    x = torch.zeros(1, 3, *doc["task"]["input_size"])
    sizes = [x.numel() * 4]
    hooks = [
        m.register_forward_hook(lambda _m, _i, o: sizes.append(o.numel() * 4))
        for m in model.modules()
        if not list(m.children())
    ]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return sum(sizes)


def test_manifest_records_memory_for_every_artifact(doc):
    jsonschema.validate(doc, manifest.schema())
    entries = _entries(doc)
    assert set(entries) == {"executorch_fp32", "executorch_int8", "litert_fp32", "litert_int8", "torchscript_lite_fp32"}
    for a in entries.values():
        memory = a["memory"]
        assert memory["available"], memory
        # the model's own share: loading and running it takes memory beyond the runtime's baseline
        assert memory["peak_rss_increase_bytes"] > 0, memory
        assert (
            memory["peak_rss_bytes"] >= memory["runtime_baseline_rss_bytes"] + memory["peak_rss_increase_bytes"] - 2**20
        )
    bound = _activation_bound(doc)
    for name in ("executorch_fp32", "executorch_int8"):
        memory = entries[name]["memory"]
        assert 0 < memory["planned_bytes"] <= bound, (memory["planned_bytes"], bound)
        # the plan holds at least the input the method is given (1 x 3 x H x W float32)
        assert memory["planned_bytes"] >= 3 * 4 * doc["task"]["input_size"][0] * doc["task"]["input_size"][1]
    fp32, int8 = entries["executorch_fp32"]["memory"], entries["executorch_int8"]["memory"]
    assert int8["constants_bytes"] < fp32["constants_bytes"] / 2
    # the fp32 weights are in the file: constants within the file's size, and most of it
    assert (
        0.8 * entries["executorch_fp32"]["size_bytes"]
        < fp32["constants_bytes"]
        <= entries["executorch_fp32"]["size_bytes"]
    )


def test_profiles_name_the_programs_own_kernels(doc):
    entries = _entries(doc)
    for a in entries.values():
        profile = a["profile"]
        if a["format"] == "litert":  # ai-edge-litert's Python API has no per-operator profiler
            assert profile == {"available": False, "reason": "litert has no profiler here"}
            continue
        assert profile["available"], profile
        assert 1 <= profile["runs"] <= memory_profile.PROFILE_RUNS and isinstance(
            profile["conditions"]["reliable"], bool
        )
        listed = sum(o["ms"] for o in profile["ops"])
        assert 0 < listed <= profile["ops_ms"] + 1e-3 <= profile["wall_ms"] + 2e-3, profile
        assert all(o["count"] > 0 for o in profile["ops"])
        shares = [o["share"] for o in profile["ops"]]
        assert shares == sorted(shares, reverse=True) and sum(shares) + profile["others_share"] == pytest.approx(
            1, abs=0.01
        )
    # XNNPACK's own operators: float kernels in the fp32 program, and in the int8 one the int8 kernels of the ranges
    # its budget search chose (the stand-in is trained on the host running the suite: which ranges meet the budget
    # varies with it, and the kernels must follow that choice)
    fp32_ops = [o["op"] for o in entries["executorch_fp32"]["profile"]["ops"]]
    assert any(op.startswith("Convolution (NHWC, F32)") for op in fp32_ops), fp32_ops
    _assert_int8_kernels(entries["executorch_int8"])
    ptl_ops = [o["op"] for o in entries["torchscript_lite_fp32"]["profile"]["ops"]]
    assert all(op.startswith("aten::") for op in ptl_ops) and any("conv" in op for op in ptl_ops), ptl_ops


def _assert_int8_kernels(int8: dict) -> None:
    """The int8 program's profile names the kernels of the ranges its search chose: static ranges run XNNPACK's
    QC8 convolutions (and float ones only for layers the search kept in float); ranges chosen per inference run
    its dynamically quantized kernels (QD8/QDU8 activations, QC8 weights)."""
    ops = [o["op"] for o in int8["profile"]["ops"]]
    quantization = int8["details"]["quantization"]
    if quantization["after"]["ranges"] == "dynamic":
        assert any(("QD8" in op or "QDU8" in op) and "QC8W" in op for op in ops), ops
        return
    assert any(op.startswith("Convolution (NHWC, QC8)") for op in ops), ops
    if not quantization["float_layers"]:
        assert not any("F32) " in op and op.startswith("Convolution") for op in ops), ops


def test_reports_and_bundle_show_it(android_build, doc, tmp_path):
    from exporter.release import bundle

    out, _ = android_build
    text = (out / "report.md").read_text()
    assert "RAM MB" in text and text.count("top ops by time: ") == 3 and "planned memory" in text
    page = (out / "report.html").read_text()
    top_int8_op = _entries(doc)["executorch_int8"]["profile"]["ops"][0]["op"]
    assert "RAM and where the time goes" in page and top_int8_op in page
    bundle_dir = bundle.make_bundle(out, dest=tmp_path / "bundle")
    listed = {a["name"]: a for a in json.loads((bundle_dir / "bundle.json").read_text())["artifacts"]}
    for name, a in _entries(doc).items():
        if name in listed:
            assert listed[name]["memory"]["peak_rss_increase_bytes"] == a["memory"]["peak_rss_increase_bytes"]


def test_onnx_runtime_memory_and_profile(tmp_path):
    """A small convolutional net exported to ONNX: its constants are its parameters, and the profile
    names operators of the graph ONNX Runtime really ran (its optimized graph, saved alongside)."""
    import onnx
    import onnxruntime as ort

    from exporter.formats import onnx as onnx_format

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    ).eval()
    example = torch.randn(1, 3, 64, 64)
    path = tmp_path / "tiny.onnx"
    onnx_format.FORMAT.export(model, example, "fp32", None, path, {})
    memory = onnx_format.FORMAT.memory(path, tuple(example.shape), 1)
    parameters = sum(p.numel() * 4 for p in model.parameters())
    assert parameters <= memory["constants_bytes"] <= parameters + 1024  # plus a few shape constants
    assert memory["peak_rss_increase_bytes"] > 0 and memory["peak_rss_bytes"] > memory["runtime_baseline_rss_bytes"]

    start = time.perf_counter()
    profile = onnx_format.FORMAT.profile(path, example, 5, 1)
    elapsed_ms = (time.perf_counter() - start) * 1000
    assert profile["available"] and profile["runs"] == 5
    assert sum(o["ms"] for o in profile["ops"]) <= profile["ops_ms"] + 1e-3 <= profile["wall_ms"] + 2e-3
    assert profile["wall_ms"] * profile["runs"] <= elapsed_ms
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ran = {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert {o["op"] for o in profile["ops"]} <= ran, (profile["ops"], ran)


def test_an_artifact_not_built_here_says_why_it_is_not_measured(tmp_path, digits_model):
    from .helpers import build_args, run_cli

    out = tmp_path / "build"
    result = run_cli(*build_args(digits_model, out, "--target", "jetson", "--format", "tensorrt"))
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(doc, manifest.schema())
    for a in doc["artifacts"]:
        assert a["status"] == "unavailable"
        assert a["memory"] == a["profile"] == {"available": False, "reason": a["memory"]["reason"]}
        assert "TensorRT" in a["memory"]["reason"]
    assert "memory not measured (" in (out / "report.md").read_text()


def test_the_lite_interpreter_profile_stops_adding_runs_once_its_trace_is_large(tmp_path, monkeypatch):
    """EfficientNet-B6's .ptl made 30,000 operator calls a run, and torch's profiler kept ~2.7 GB of trace per
    run: ten profiled runs filled the build host's 22 GB. Each run has its own profiler and, once the calls
    recorded reach PROFILE_CALLS, no further run is profiled; the record says how many runs it holds."""
    from exporter.formats import torchscript_lite

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, groups=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    ).eval()
    example = torch.randn(1, 3, 16, 16)
    path = tmp_path / "tiny.ptl"
    torchscript_lite.FORMAT.export(model, example, "fp32", None, path, {})
    whole = torchscript_lite.FORMAT.profile(path, example, 5, 1)
    assert whole["runs"] == 5 and {o["op"] for o in whole["ops"]} >= {"aten::addmm"}
    monkeypatch.setattr(torchscript_lite, "PROFILE_CALLS", 1)  # the first run is over it: no second
    capped = torchscript_lite.FORMAT.profile(path, example, 5, 1)
    assert capped["runs"] == 1 and "aten::addmm" in {o["op"] for o in capped["ops"]}
    counts = {o["op"]: o["count"] for o in whole["ops"]}
    assert all(o["count"] == counts[o["op"]] for o in capped["ops"] if o["op"] in counts)  # per run, either way


def test_a_slow_artifact_is_profiled_fewer_times_and_a_profile_from_a_busy_host_is_flagged_and_not_kept(
    tmp_path, monkeypatch
):
    """RegNetY-128GF's .pte (13.6 s a run) spent ~15 min of a sweep build in ten profiled runs, each timed at
    88 s while the test suite had the host: the manifest said nothing of it, and the cache kept it."""
    from types import SimpleNamespace

    from exporter import hostload
    from exporter.formats import onnx as onnx_format
    from exporter.progress import Progress
    from exporter.release.report import profile_line

    timed = [ArtifactResult("a", "onnx", "fp32", latency_ms={"p50": p50}) for p50 in (3.2, 2500.0, 4000.0, 13622.9)]
    assert [memory_profile.profile_runs(entry) for entry in timed] == [
        10,
        4,
        2,
        1,
    ]
    untimed = ArtifactResult("a", "onnx", "fp32")
    assert memory_profile.profile_runs(untimed) == memory_profile.PROFILE_RUNS  # no latency measured: the default
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    ).eval()
    example = torch.randn(1, 3, 32, 32)
    onnx_format.FORMAT.export(model, example, "fp32", None, tmp_path / "tiny.onnx", {})

    class Cache:
        def __init__(self):
            self.stored, self.events = [], []

        def fetch_json(self, kind, digest):
            return None

        def store_json(self, kind, digest, record):
            self.stored.append(record)

    profiles = []
    for busy in ([], ["load 9.0 on 2 cores, 1 threads timed"]):
        monkeypatch.setattr(hostload, "judge", lambda *args, reasons=busy, **kwargs: (not reasons, reasons))
        inputs = SimpleNamespace(validation=example)
        session = SimpleNamespace(
            latency={"threads": 1},
            inputs=inputs,
            fed_to=lambda format_name: inputs,
            cache=Cache(),
            digests={"tools": "test"},
            out=tmp_path,
            progress=Progress(quiet=True),
            prefix="",
        )
        entry = ArtifactResult(
            "onnx_fp32",
            "onnx",
            "fp32",
            path="tiny.onnx",
            sha256="0" * 64,
            status=Status.PASSED,
            fidelity={"psnr_db": 90.0},
            latency_ms={"p50": 4000.0},
        )
        memory_profile.measure(session, entry)
        profile = entry.profile
        assert profile.available and profile.runs == 2, profile
        assert profile.conditions["reliable"] == (not busy) and profile.conditions["reasons"] == busy
        assert len(session.cache.stored) == (0 if busy else 1)  # measured again by the next build, as latency is
        profiles.append(profile_line(profile))
    assert "busy host" not in profiles[0] and "profiled on a busy host (load 9.0 on 2 cores" in profiles[1]
    # nor is a whole build whose profile was taken on a busy host kept for replay (exporter/engine/record.py)
    from exporter.engine.record import _unsettled_timing

    def built(profile) -> SimpleNamespace:  # what the record reads of a typed manifest
        artifact = SimpleNamespace(latency_conditions=None, profile=profile)
        return SimpleNamespace(eager=SimpleNamespace(latency=None), artifacts=[artifact])

    assert not _unsettled_timing([built(dataclasses.replace(profile, conditions={"reliable": True}))])
    assert _unsettled_timing([built(profile)])
