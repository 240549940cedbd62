"""A manifest built by hand, with no build behind it: every field the engine fills in, with the values a small
Linux build writes (values as plain JSON records, which a typed field must accept and write back the same)."""

from __future__ import annotations

from exporter.results import ArtifactResult, EagerBaseline, EmulatedRow, Manifest, Recommendation, SizeRow, threshold

CHECKPOINT = {"path": "/nowhere/tiny-0123abcd.pth", "sha256": "ab" * 32, "source": "checkpoint", "verified": True}
CONDITIONS = {
    "load_before": [0.1, 0.2, 0.3],
    "rounds_p50_ms": {"artifact": [1.0, 1.1], "eager": [2.0, 2.1]},
    "max_round_spread": 1.5,
    "threads": 1,
    "max_spread": 2.0,
    "reliable": False,
    "reasons": ["load average 3.1 on 2 cores"],
}
MEMORY = {"available": True, "peak_rss_increase_bytes": 1234567, "model_bytes": 100, "dtype": "float32"}
PROFILE = {"available": False, "reason": "no profiler for this format"}
GOLDEN_CHECK = {"passed": True, "cases": 8, "error": None}


def manifest() -> Manifest:
    passed = ArtifactResult(
        name="onnx_fp32",
        format="onnx",
        precision="fp32",
        path="model_fp32.onnx",
        sha256="cd" * 32,
        size_bytes=4096,
        status="passed",
        details={"opset": 18},
        thresholds={"top1_agreement": 1.0, "psnr_db": 30},
        fidelity={"top1_agreement": 1.0, "psnr_db": float("inf"), "max_abs_diff": 0.0},
        accuracy={"top1": 0.9, "accuracy_drop": 0.0},
        latency_ms={"p50": 1.05, "p90": 1.2, "mean": 1.1},
        eager_latency_ms={"p50": 2.05},
        speedup_vs_eager=1.95,
        export_s=0.5,
        artifact_reused_from_cache=False,
        validation_reused_from_cache=True,
        outlier_inputs=[3],
        latency_conditions=CONDITIONS,
        memory=MEMORY,
        profile=PROFILE,
        input={"dtype": "float32", "layout": "nchw"},
        bundled_program={
            **{"path": "model_fp32.bpte", "sha256": "12" * 32, "size_bytes": 5000, "program_sha256": "cd" * 32},
            **{"method": "forward", "cases": 8, "rtol": 1e-05, "atol": 7.5e-05},
            "tolerances": {"max_abs_gap": 7.6e-06, "output_scale": 7.5, "rule": "atol = max(2 * gap, 1e-05 * scale)"},
            "verified": {"x86_64": GOLDEN_CHECK, "cortex-a76": {**GOLDEN_CHECK, "seconds": 1.5}},
        },
        aarch64=[
            EmulatedRow(
                cpu="cortex-a76",
                why="a phone's big core",
                seconds=2.5,
                runtime={"onnxruntime": "1.20"},
                status="passed",
                fidelity={"top1_agreement": 1.0, "psnr_db": 80.0},
                accuracy=None,
                vs_x86={"max_abs_diff": 1e-6},
                bundled_program=GOLDEN_CHECK,
                instructions={
                    **{"per_inference": 1000, "warmup": 1500, "load": 30000, "spread": 0.002, "runs": 3},
                    **{"unit": "emulated aarch64 instructions per inference", "qemu": "9.2.0"},
                    **{"eager_per_inference": 2000, "ratio_to_eager": 2.0, "marker_cost": 12},
                },
            )
        ],
        sizes=[SizeRow(size=[16, 16], images=4, status="passed", fidelity={"psnr_db": 60.0}, accuracy=None)],
    )
    failed = ArtifactResult(
        name="onnx_int8",
        format="onnx",
        precision="int8",
        path="model_int8.onnx",
        sha256="ef" * 32,
        size_bytes=1024,
        status="failed",
        reasons=[threshold("top1_agreement", "top1_agreement 0.75 (needs >= 0.97)", 0.75, 0.97)],
        thresholds={"top1_agreement": 0.97},
        fidelity={"top1_agreement": 0.75, "psnr_db": 21.5},
        memory={"available": False, "reason": "not measured"},
        profile={"available": False, "reason": "not measured"},
    )
    return Manifest(
        schema_version=4,
        exporter_version="0.0.test",
        exporter_commit="0" * 40,
        created="2026-01-01T00:00:00+00:00",
        command=["exporter", "build", "Tiny_Weights.TEST"],
        status="failed",
        weight={"name": "Tiny_Weights.TEST", "model": "tiny", "num_classes": 2, "meta": {}},
        task={"name": "classification", "input_size": [8, 8], "num_classes": 2},
        checkpoint=CHECKPOINT,
        preprocessing={"task": "classification", "input_size": [8, 8], "mean": [0.5] * 3, "std": [0.5] * 3},
        labels={"file": "labels.txt", "count": 2, "from_file": None},
        target={"name": "android", "profile": "targets/android.toml"},
        tools={"torch": "2.14.1", "onnx": None},
        host={
            "platform": "Linux",
            "machine": "x86_64",
            "cpu": "Test CPU",
            "cores": 2,
            "threads": 1,
            "python": "3.11.7",
        },
        data={"source": "synthetic", "labeled": False, "calibration": 8, "validation": 8},
        eager={
            "accuracy": None,
            "reference": {"kind": "float eager", "weight": "Tiny_Weights.TEST", "checkpoint": None},
            "latency": EagerBaseline(
                {"p50": 2.0},
                [2.0, 2.1],
                1.05,
                {"reliable": True, "threads": 1},
                {"rounds": 12, "artifacts": 2, "p50_range_ms": [2.0, 2.3], "round_spread": 1.15},
            ),
        },
        artifacts=[passed, failed],
        timings_s={"export onnx_fp32": 0.5},
        cache={"root": "/nowhere/cache", "events": ["onnx_fp32: validation results reused from the cache"], "hits": 1},
        recommended=Recommendation("onnx_fp32", "x86 latency", "onnx_int8", "the fastest that passed"),
    )
