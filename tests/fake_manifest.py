"""Manifests for tests that fake a finished build without running one: the keys a test cares about, completed with
the rest of what the pipeline writes, and checked against the manifest schema (as `exporter validate` and
`exporter bundle` check what they read)."""

import copy

import jsonschema

from exporter.release import manifest


def complete(doc: dict) -> dict:
    """`doc` with every required key it lacks filled in as a small Linux build would have it; `doc`'s own keys win
    (a nested table is completed key by key). Raises jsonschema's ValidationError if the result is not a manifest."""
    artifacts = doc.get("artifacts", [])
    target = doc.get("target", {}).get("name", "android")
    num_classes = doc.get("weight", {}).get("num_classes", 2)
    task = doc.get("task") or {
        "name": "classification",
        "input_size": [8, 8],
        "num_classes": num_classes,
        "output": {"name": "logits", "layout": "NC", "shape": [1, num_classes]},
    }
    base = {
        "schema_version": manifest.SCHEMA_VERSION,
        "exporter_version": "0.0.test",
        "created": "2026-01-01T00:00:00+00:00",
        "status": "failed" if any(a["status"] == "failed" for a in artifacts) else "passed",
        "weight": {"name": "Tiny_Weights.TEST", "model": "tiny", "num_classes": num_classes, "meta": {}},
        "task": task,
        "checkpoint": {"path": "/nowhere/tiny.pth", "sha256": "0" * 64, "source": "checkpoint", "verified": False},
        "preprocessing": {
            "task": task["name"],
            "input_size": task["input_size"],
            "resize_size": task["input_size"][:1],
            "crop_size": task["input_size"],
            "mean": [0.5] * 3,
            "std": [0.5] * 3,
        },
        "labels": {"file": "labels.txt", "count": num_classes},
        "target": {
            "name": target,
            "profile": f"targets/{target}.toml",
            "artifacts": [{"format": a["format"], "precision": a["precision"]} for a in artifacts],
            "thresholds": {"fp32": {"top1_agreement": 1.0}, "int8": {"top1_agreement": 0.97}},
            "data": {"calib_size": 8, "val_size": 8, "seed": 0},
            "latency": {"threads": 1, "warmup": 1, "iterations": 1, "max_spread": 2.0},
        },
        "tools": {"torch": "2.14.1", "torchvision": "0.29.1"},
        "host": {"platform": "Linux", "cpu": "Test CPU", "cores": 2, "threads": 1},
        "data": {"source": "synthetic", "labeled": False, "calibration": 8, "validation": 8},
        "eager": {"accuracy": None},
        "artifacts": artifacts,
        "timings_s": {},
    }
    merged = copy.deepcopy(base)
    for key, value in doc.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    jsonschema.validate(merged, manifest.schema())
    return merged


def verdict(fmt: str) -> dict:
    """An artifact's status keys as a build on Linux writes them: Core ML is not run here."""
    if fmt == "coreml":
        return {
            "status": "unavailable",
            "reasons": [
                {"kind": "unavailable_here", "text": "not validated: Core ML predict needs macOS; this host is linux"}
            ],
            "fidelity": None,
            "latency_ms": None,
        }
    return {"status": "passed", "reasons": [], "latency_ms": None}
