"""`make bench`: eager vs every CPU runtime, side by side in one run, same thread count.

Random weights are fine here: this measures latency only (fidelity is the tests' job). Classifiers run
at 224x224, LR-ASPP (segmentation) at 520x520, the size its weights' transforms resize to.
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

from . import data, formats, manifest, validation
from .quant import SETTINGS, Calibration
from .tasks import Classification, Segmentation

# model -> (task, input side)
MODELS = {"mobilenet_v3_large": (Classification, 224), "resnet18": (Classification, 224), "resnet50": (Classification, 224),
          "lraspp_mobilenet_v3_large": (Segmentation, 520)}
# (row label, format, precision, int8 budget): "plain" is PTQ with no fallback; "budget" keeps layers in
# float until BUDGET_PSNR_DB holds on held-out calibration images, to show what fallback costs in speed
RUNTIMES = [
    ("pte fp32", "executorch", "fp32", None),
    ("pte int8 plain", "executorch", "int8", "plain"),
    ("pte int8 budget", "executorch", "int8", "budget"),
    ("ptl fp32", "torchscript_lite", "fp32", None),
    ("onnx fp32 (ORT)", "onnx", "fp32", None),
    ("onnx int8 plain (ORT)", "onnx", "int8", "plain"),
    ("onnx int8 budget (ORT)", "onnx", "int8", "budget"),
]
BUDGET_PSNR_DB = 35.0
CALIBRATION_IMAGES = 32


def _available(fmt: str):
    try:
        return formats.FORMATS[fmt].load_module() if fmt in formats.FORMATS else None
    except Exception:
        return None


def bench_model(name: str, threads: int, warmup: int, iterations: int, workdir: Path, log) -> dict:
    torch.manual_seed(0)
    task_class, side = MODELS[name]
    task = task_class(21 if task_class is Segmentation else 1000, (side, side))
    options = {"weights_backbone": None} if task_class is Segmentation else {}
    model = task_class.graph(get_model(name, weights=None, num_classes=task.num_classes, **options).eval())
    inputs = data.synthetic(_preprocess(side), CALIBRATION_IMAGES, 1, seed=0)
    example = inputs.example
    calibrations = {
        "plain": Calibration(inputs.calibration, None, {"psnr_db": BUDGET_PSNR_DB}, {**SETTINGS, "fallback": False}, task=task),
        "budget": Calibration(inputs.calibration, None, {"psnr_db": BUDGET_PSNR_DB}, dict(SETTINGS), task=task),
    }
    meta = {"weight": name, "model": name, "labels": [str(i) for i in range(task.num_classes)], "task": task.describe(),
            "preprocessing": {"input_size": [side, side], "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}
    # the same eager model in channels-last memory format (input converted once, outside the timing)
    channels_last = copy.deepcopy(model).to(memory_format=torch.channels_last)
    example_cl = example.contiguous(memory_format=torch.channels_last)
    runners = {"eager": model, "eager NHWC": lambda _x: channels_last(example_cl)}
    build_s, quantization = {}, {}
    for label, fmt, precision, budget in RUNTIMES:
        module = _available(fmt)
        if module is None:
            continue
        path = workdir / f"{name}_{fmt}_{precision}_{budget}{module.SUFFIX}"
        start = time.perf_counter()
        details = module.export(model, example, precision, calibrations.get(budget, inputs.calibration), path, meta)
        build_s[label] = round(time.perf_counter() - start, 1)
        if "quantization" in details:
            q = details["quantization"]
            quantization[label] = {"float_layers": len(q["float_layers"]), "layers": q["layers"], "seconds": q["seconds"],
                                   "check_psnr_db": q["after"]["psnr_db"], "ranges": q["after"]["ranges"]}
            log(f"  {name}: {label}: {len(q['float_layers'])} of {q['layers']} layers in float, "
                f"check PSNR {q['before']['psnr_db']} -> {q['after']['psnr_db']} dB")
        runners[label] = module.load(path, threads)
        torch.set_num_threads(threads)
        outside = (details.get("delegation") or {}).get("ops_outside_delegate")
        log(f"  {name}: built {label} in {build_s[label]} s" + (f"; outside delegate: {outside}" if outside else ""))
    timing = validation.measure_latency(runners, example, warmup, iterations, rounds=10)
    return {"input": [side, side], "latency_ms": timing, "build_s": build_s, "quantization": quantization}


def _preprocess(side: int):
    """ImageNet-style normalization of a synthetic image resized to side x side."""
    from torchvision.transforms import v2

    return v2.Compose([v2.PILToTensor(), v2.Resize([side, side]), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def table(results: dict) -> str:
    labels = ["eager", "eager NHWC"] + [label for label, *_ in RUNTIMES]
    ratios = ("pte fp32 / eager", "pte int8 plain vs pte fp32", "pte int8 budget vs plain", "onnx int8 budget vs plain", "ptl / eager")
    lines = ["| model | " + " | ".join(f"{label} p50 ms" for label in labels) + " | " + " | ".join(ratios) + " |",
             "|---|" + "---|" * (len(labels) + len(ratios))]
    for model, r in results.items():
        lat = {k: v["p50"] for k, v in r["latency_ms"].items()}
        cells = [f"{lat[label]:.2f}" if label in lat else "—" for label in labels]

        def ratio(a, b):
            return f"{lat[b] / lat[a]:.2f}×" if a in lat and b in lat else "—"

        lines.append(f"| {model} {'x'.join(map(str, r['input']))} | " + " | ".join(cells) + f" | {ratio('pte fp32', 'eager')} | {ratio('pte int8 plain', 'pte fp32')}"
                     f" | {ratio('pte int8 budget', 'pte int8 plain')} | {ratio('onnx int8 budget (ORT)', 'onnx int8 plain (ORT)')}"
                     f" | {ratio('ptl fp32', 'eager')} |")
    lines += ["", f"int8 budget: output PSNR >= {BUDGET_PSNR_DB:g} dB (+{SETTINGS['psnr_margin_db']:g} margin) on held-out "
              f"calibration images; layers kept in float, build seconds (quantization seconds):", ""]
    for model, r in results.items():
        for label, q in r.get("quantization", {}).items():
            lines.append(f"- {model} {label}: {q['float_layers']} of {q['layers']} layers in float, check PSNR "
                         f"{q['check_psnr_db']} dB ({q['ranges']} ranges), build {r['build_s'][label]} s ({q['seconds']} s)")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help=f"any of {', '.join(MODELS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("exports/bench"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    host = manifest.host(args.threads)
    print(f"host: {host['cpu']}, {host['cores']} cores, {args.threads} threads for every runtime; batch 1")
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
