"""`make bench`: eager vs every CPU runtime, side by side in one run, same thread count.

Random weights are fine here: this measures latency only (fidelity is the tests' job).
Usage: python -m exporter.bench [--models m1,m2] [--threads N] [--iterations N] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import warnings
import tempfile
import time
from pathlib import Path

import torch
from torchvision.models import get_model

from . import formats, manifest, validation

MODELS = ("mobilenet_v3_large", "resnet18", "resnet50")
# (row label, format, precision)
RUNTIMES = [
    ("pte fp32", "executorch", "fp32"),
    ("pte int8", "executorch", "int8"),
    ("ptl fp32", "torchscript_lite", "fp32"),
    ("onnx fp32 (ORT)", "onnx", "fp32"),
    ("onnx int8 Q/DQ (ORT)", "onnx", "int8"),
]


def _available(fmt: str):
    try:
        return formats.FORMATS[fmt].load_module() if fmt in formats.FORMATS else None
    except Exception:
        return None


def bench_model(name: str, threads: int, warmup: int, iterations: int, workdir: Path, log) -> dict:
    torch.manual_seed(0)
    model = get_model(name, weights=None).eval()
    example = torch.randn(1, 3, 224, 224)
    calib = [torch.randn(1, 3, 224, 224) for _ in range(8)]
    meta = {"weight": name, "model": name, "labels": [], "preprocessing": {}}
    # the same eager model in channels-last memory format (input converted once, outside the timing)
    channels_last = copy.deepcopy(model).to(memory_format=torch.channels_last)
    example_cl = example.contiguous(memory_format=torch.channels_last)
    runners = {"eager": model, "eager NHWC": lambda _x: channels_last(example_cl)}
    build_s = {}
    for label, fmt, precision in RUNTIMES:
        module = _available(fmt)
        if module is None:
            continue
        path = workdir / f"{name}_{fmt}_{precision}{module.SUFFIX}"
        start = time.perf_counter()
        details = module.export(model, example, precision, calib, path, meta)
        build_s[label] = round(time.perf_counter() - start, 1)
        runners[label] = module.load(path, threads)
        torch.set_num_threads(threads)
        outside = (details.get("delegation") or {}).get("ops_outside_delegate")
        log(f"  {name}: built {label} in {build_s[label]} s" + (f"; outside delegate: {outside}" if outside else ""))
    timing = validation.measure_latency(runners, example, warmup, iterations, rounds=10)
    return {"latency_ms": timing, "build_s": build_s}


def table(results: dict) -> str:
    labels = ["eager", "eager NHWC"] + [label for label, _, _ in RUNTIMES]
    lines = ["| model | " + " | ".join(f"{label} p50 ms" for label in labels) + " | pte fp32 / eager | pte int8 vs pte fp32 | ptl / eager |",
             "|---|" + "---|" * (len(labels) + 3)]
    for model, r in results.items():
        lat = {k: v["p50"] for k, v in r["latency_ms"].items()}
        cells = [f"{lat[label]:.2f}" if label in lat else "—" for label in labels]

        def ratio(a, b):
            return f"{lat[b] / lat[a]:.2f}×" if a in lat and b in lat else "—"

        lines.append(f"| {model} | " + " | ".join(cells) + f" | {ratio('pte fp32', 'eager')} | {ratio('pte int8', 'pte fp32')} | {ratio('ptl fp32', 'eager')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("exports/bench"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    host = manifest.host(args.threads)
    print(f"host: {host['cpu']}, {host['cores']} cores, {args.threads} threads for every runtime; batch 1, 224x224")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = bench_model(name, args.threads, args.warmup, args.iterations, Path(tmp), print)
    text = table(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps({"host": host, "tools": manifest.tool_versions(), "results": results}, indent=2))
    (args.out / "bench.md").write_text(text + "\n")
    print(f"written: {args.out / 'bench.md'}")


if __name__ == "__main__":
    main()
