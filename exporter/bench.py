"""`make bench`: eager vs every CPU runtime, side by side in one run, same thread count.

Random weights are fine here: this measures latency only (fidelity is the tests' job). Each model runs at
its weight's own input size and preprocessing: classifiers 224x224, LR-ASPP 520x520, SSDlite 320x320.
SSDlite's graph is its raw heads; the numpy post-processing (decode + NMS) is timed apart, on the heads of
the trained digits stand-in (random heads put every class of every anchor above the score threshold: a
worst case, also reported), and beside it the stand-in's ONNX file with the decode inside (`--detections graph`),
timed on the same canvases. The `uint8` rows are the fp32 `.pte` and ONNX file taking image bytes
(`--input-format uint8-nhwc`: the cast, scaling and mean/std inside the graph), fed the same image as bytes.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import bench_counts, data, formats, hostload, validation
from .device import detection_decode
from .release import manifest
from .quant import SETTINGS, Calibration
from .tasks import Detection
from .weights import bind_task, builder_kwargs, resolve, task_class

# model -> the weight whose task, class count, input size and preprocessing it is benchmarked with
MODELS = {
    "mobilenet_v3_large": "MobileNet_V3_Large_Weights.IMAGENET1K_V2",
    "resnet18": "ResNet18_Weights.IMAGENET1K_V1",
    "resnet50": "ResNet50_Weights.IMAGENET1K_V2",
    "convnext_tiny": "ConvNeXt_Tiny_Weights.IMAGENET1K_V1",
    "inception_v3": "Inception_V3_Weights.IMAGENET1K_V1",
    "lraspp_mobilenet_v3_large": "LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1",
    "deeplabv3_mobilenet_v3_large": "DeepLabV3_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1",
    "ssdlite320_mobilenet_v3_large": "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1",
}
# where the tests cache the trained digits stand-ins (tests/conftest.py): EXPORTER_TEST_CACHE or .cache/digits
STAND_IN_CACHE = Path(os.environ.get("EXPORTER_TEST_CACHE", ".cache/digits"))
# (row label, format, precision, int8 budget): "plain" is PTQ with no fallback; "budget" keeps layers in
# float until BUDGET_PSNR_DB holds on held-out calibration images, to show what fallback costs in speed
RUNTIMES = [
    ("pte fp32", "executorch", "fp32", None),
    ("pte int8 plain", "executorch", "int8", "plain"),
    ("pte int8 budget", "executorch", "int8", "budget"),
    ("ptl fp32", "torchscript_lite", "fp32", None),
    ("tflite fp32", "litert", "fp32", None),
    ("tflite int8 plain", "litert", "int8", "plain"),
    ("tflite int8 budget", "litert", "int8", "budget"),
    ("onnx fp32 (ORT)", "onnx", "fp32", None),
    ("onnx int8 plain (ORT)", "onnx", "int8", "plain"),
    ("onnx int8 budget (ORT)", "onnx", "int8", "budget"),
]
# The fp32 ONNX file again, in a session without ONNX Runtime's NCHWc layout transform: its blocked-layout
# kernels exist for x86 only, and the aarch64 wheel (the Jetson's) runs the same file without them (its optimised
# graph has no NCHWc node), so this is the graph ONNX Runtime runs on ARM, timed on this host.
ORT_AS_ON_ARM = "onnx fp32 (ORT, no NCHWc)"
# (row label, format, the float row it is compared with): the fp32 file again, taking uint8 N x H x W x 3
UINT8_RUNTIMES = [
    ("pte fp32 uint8", "executorch", "pte fp32"),
    ("onnx fp32 uint8 (ORT)", "onnx", "onnx fp32 (ORT)"),
]
UNREWRITTEN = "pte fp32 (no rewrites)"  # timed where formats.rewrites changed the .pte fp32
# (name, a, b): how many times faster a is than b (p50 of b over p50 of a), compared with the baseline run
RATIOS = [
    ("pte fp32 / eager", "pte fp32", "eager"),
    ("pte fp32 vs ORT fp32", "pte fp32", "onnx fp32 (ORT)"),
    ("pte fp32 vs ORT no NCHWc", "pte fp32", ORT_AS_ON_ARM),
    ("pte rewrites gain", "pte fp32", UNREWRITTEN),
    ("pte int8 plain vs pte fp32", "pte int8 plain", "pte fp32"),
    ("pte int8 budget vs plain", "pte int8 budget", "pte int8 plain"),
    ("pte fp32 vs tflite fp32", "pte fp32", "tflite fp32"),
    ("pte int8 plain vs tflite int8 plain", "pte int8 plain", "tflite int8 plain"),
    ("pte int8 budget vs tflite int8 budget", "pte int8 budget", "tflite int8 budget"),
    ("onnx int8 budget vs plain", "onnx int8 budget (ORT)", "onnx int8 plain (ORT)"),
    ("ptl / eager", "ptl fp32", "eager"),
    *((f"{label} vs float", label, float_row) for label, _, float_row in UINT8_RUNTIMES),
]
PROFILED = ("pte fp32", "onnx fp32 (ORT)")  # top operators of each, per model
BASELINE = Path("docs/bench-baseline.json")  # the previous committed run, compared by ratio
REGRESSION = 0.8  # a ratio below this share of the baseline's is shown as a possible regression
BUDGET_PSNR_DB = 35.0
CALIBRATION_IMAGES = 32


def _available(fmt: str):
    try:
        return formats.FORMATS[fmt].format() if fmt in formats.FORMATS else None
    except Exception:
        return None


def bench_model(
    name: str,
    threads: int,
    warmup: int,
    iterations: int,
    workdir: Path,
    log,
    arm: bench_counts.ArmCounter | None = None,
) -> dict:
    torch.manual_seed(0)
    weights = resolve(MODELS[name])
    task = bind_task(weights)
    model = type(task).graph(type(task).construct(name, task.num_classes, {}, builder_kwargs(weights)).eval())
    inputs = data.synthetic(task.transform(weights), CALIBRATION_IMAGES, 1, seed=0)
    _settle_batchnorm(model, inputs.calibration)
    example = inputs.example
    calibrations = {
        "plain": Calibration(
            inputs.calibration, None, {"psnr_db": BUDGET_PSNR_DB}, {**SETTINGS, "fallback": False}, task=task
        ),
        "budget": Calibration(inputs.calibration, None, {"psnr_db": BUDGET_PSNR_DB}, dict(SETTINGS), task=task),
    }
    meta = {
        "weight": MODELS[name],
        "model": name,
        "labels": [str(i) for i in range(task.num_classes)],
        "task": task.describe(),
        "preprocessing": task.preprocessing(weights),
    }
    # the same eager model in channels-last memory format (input converted once, outside the timing)
    channels_last = copy.deepcopy(model).to(memory_format=torch.channels_last)
    example_cl = example.contiguous(memory_format=torch.channels_last)
    runners = {"eager": model, "eager NHWC": lambda _x: channels_last(example_cl)}
    build_s, quantization, memory, paths, rewrites = {}, {}, {}, {}, {}
    for label, fmt, precision, budget in RUNTIMES:
        format_ = _available(fmt)
        if format_ is None:
            continue
        path = workdir / f"{name}_{fmt}_{precision}_{budget}{format_.suffix}"
        start = time.perf_counter()
        details = format_.export(model, example, precision, calibrations.get(budget, inputs.calibration), path, meta)
        build_s[label] = round(time.perf_counter() - start, 1)
        paths[label] = (format_, path)
        if details.get("rewrites"):
            rewrites[label] = details["rewrites"]
            log(f"  {name}: {label}: rewritten before lowering: {_rewrites_line(details['rewrites'])}")
        if "quantization" in details:
            q = details["quantization"]
            quantization[label] = {
                "float_layers": len(q["float_layers"]),
                "layers": q["layers"],
                "seconds": q["seconds"],
                "check_psnr_db": q["after"]["psnr_db"],
                "ranges": q["after"]["ranges"],
                **({"float_kinds": q["float_kinds"]} if q.get("float_kinds") else {}),
            }
            log(
                f"  {name}: {label}: {len(q['float_layers'])} of {q['layers']} layers in float{_kinds_line(q)}, "
                f"check PSNR {q['before']['psnr_db']} -> {q['after']['psnr_db']} dB"
            )
        runners[label] = format_.load(path, threads)
        torch.set_num_threads(threads)
        if format_.memory is not None:  # a fresh process per artifact (docs/validation.md#ram-and-where-the-time-goes)
            try:
                memory[label] = format_.memory(path, tuple(example.shape), threads)["peak_rss_increase_bytes"]
            except Exception as e:  # a column left empty, never a failed benchmark
                log(f"  {name}: {label}: memory not measured: {type(e).__name__}: {e}")
        outside = (details.get("delegation") or {}).get("ops_outside_delegate")
        log(f"  {name}: built {label} in {build_s[label]} s" + (f"; outside delegate: {outside}" if outside else ""))
    if "pte fp32" in rewrites:  # the same graph lowered without the rewrites, to show what they buy
        format_, _ = paths["pte fp32"]
        path = workdir / f"{name}_executorch_fp32_plain{format_.suffix}"
        format_.export(model, example, "fp32", inputs.calibration, path, meta, rewrites=False)
        runners[UNREWRITTEN] = format_.load(path, threads)
    if "onnx fp32 (ORT)" in paths:
        format_, path = paths["onnx fp32 (ORT)"]
        runners[ORT_AS_ON_ARM] = format_.load(path, threads, nchwc=False)
    fed = _uint8_rows(name, model, task, example, meta, threads, workdir, runners, build_s, log)
    timing, conditions = validation.measure_latency_on_host(
        runners, example, warmup, iterations, rounds=10, examples=fed
    )
    conditions = hostload.judged(conditions, threads)  # what the host did while timing; busy: unreliable
    if not conditions["reliable"]:
        log(f"  {name}: host busy while timing, numbers unreliable: {hostload.summary(conditions)}")
    profiles = {}
    for label in PROFILED:  # after the timed rounds, in sessions of their own
        if label in paths:
            format_, path = paths[label]
            try:
                profiles[label] = format_.profile(path, example, 5, threads)
            except Exception as e:
                log(f"  {name}: {label}: not profiled: {type(e).__name__}: {e}")
            torch.set_num_threads(threads)
    if arm is not None:  # after every timed round: qemu never runs beside a timing
        images = torch.cat([example, *inputs.calibration[:2]]).numpy()
        counted = {label: path for label, (_, path) in paths.items()}
        instructions = arm.count(name, model, counted, images)
    result = {
        "input": list(task.input_size),
        "latency_ms": timing,
        "latency_conditions": conditions,
        "build_s": build_s,
        "quantization": quantization,
        "memory_bytes": memory,
        "profiles": profiles,
        "rewrites": rewrites,
        **({"instructions": instructions} if arm is not None else {}),
    }
    if isinstance(task, Detection):
        with torch.no_grad():
            random_heads = model(example)[0].numpy()
        stand_in = _stand_in(name, weights, log)
        result["postprocess_ms"] = {
            "trained stand-in": _time_decode(stand_in.heads, stand_in.task, 5),
            "random heads (worst case)": _time_decode([random_heads], task, 20),
        }
        result["decode_in_graph_ms"] = _time_decode_in_graph(stand_in, threads, workdir, log)
    return result


def _uint8_rows(name, model, task, example, meta, threads, workdir, runners, build_s, log) -> dict:
    """UINT8_RUNTIMES: the fp32 files again behind the graph's own scaling and normalisation, added to `runners`;
    returns each one's input, the example as the bytes an app's bitmap holds (none where the task takes no bytes)."""
    from .tasks.image_input import ImageBytesInput, as_bytes

    if task.image_bytes_refusal:
        return {}
    mean, std = meta["preprocessing"]["mean"], meta["preprocessing"]["std"]
    pixels = as_bytes(example, mean, std)
    wrapped = ImageBytesInput(model, mean, std).eval()
    fed = {}
    for label, fmt, _ in UINT8_RUNTIMES:
        format_ = _available(fmt)
        if format_ is None:
            continue
        path = workdir / f"{name}_{fmt}_fp32_uint8{format_.suffix}"
        start = time.perf_counter()
        format_.export(wrapped, pixels, "fp32", [], path, meta)
        build_s[label] = round(time.perf_counter() - start, 1)
        runners[label], fed[label] = format_.load(path, threads), pixels
        torch.set_num_threads(threads)
        log(f"  {name}: built {label} in {build_s[label]} s")
    return fed


def _settle_batchnorm(model: torch.nn.Module, images: list, batch: int = 8) -> None:
    """Batch-norm statistics measured on the images, as training would leave them. At initialisation they are
    mean 0, variance 1 whatever the activations are, and a deep random network's activations then grow or
    vanish layer by layer, which int8 cannot represent: the int8 rows would time a degenerate graph."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a plain average over the batches
    model.train()
    with torch.no_grad():
        for start in range(0, len(images), batch):
            model(torch.cat(images[start : start + batch]))
    model.eval()


@dataclass
class StandIn:
    """The trained digits SSDlite, its task, 16 held-out canvases as it takes them, and its raw heads on them."""

    model: torch.nn.Module
    task: Detection
    images: list
    heads: list


def _stand_in(name: str, weights, log) -> StandIn:
    """The trained digits SSDlite on its held-out canvases (trained once, ~5 min, if not cached)."""
    from PIL import Image

    from .standins import detection as digits_detection

    stand_in = digits_detection.prepare(STAND_IN_CACHE, log=log)
    state = torch.load(stand_in.checkpoint, map_location="cpu", weights_only=True)
    task = bind_task(weights, task_class(weights).num_classes_in(state, name, 0))
    model = type(task).construct(name, task.num_classes, state, builder_kwargs(weights))
    model.load_state_dict(state)
    graph, transform = type(task).graph(model.eval()), task.transform(weights)
    images = [
        transform(Image.open(f).convert("RGB"))[None] for f in sorted((stand_in.data_dir / "images").glob("*.png"))
    ]
    with torch.no_grad():
        heads = [graph(x)[0].numpy() for x in images[:16]]
    return StandIn(model.eval(), task, images[:16], heads)


def _time_decode_in_graph(stand_in: StandIn, threads: int, workdir: Path, log) -> dict:
    """The stand-in's fp32 ONNX file ending in raw heads, then the numpy decode, against its ONNX file with the
    decode inside (tasks/detections_in_graph.py), each run per canvas in ONNX Runtime with the same threads."""
    from .tasks.detections_in_graph import DetectionsInGraph

    format_ = _available("onnx")
    if format_ is None:
        return {}
    task, meta = stand_in.task, {"task": stand_in.task.describe()}
    heads_path, graph_path = workdir / "stand_in_heads.onnx", workdir / "stand_in_decode_in_graph.onnx"
    format_.export(type(task).graph(stand_in.model), stand_in.images[0], "fp32", [], heads_path, meta)
    format_.export(
        DetectionsInGraph.graph(stand_in.model),
        stand_in.images[0],
        "fp32",
        [],
        graph_path,
        meta,
        **DetectionsInGraph.format_options()["onnx"],
    )
    heads_run, graph_run = format_.load(heads_path, threads), format_.load(graph_path, threads)
    torch.set_num_threads(threads)

    def heads_then_decode(x):
        head = heads_run(x)
        head = head[0] if isinstance(head, (list, tuple)) else head
        return detection_decode.decode(np.asarray(head)[0], task.anchors, task.input_size, task.params)

    samples = {"onnx heads + numpy decode": [], "onnx decode in graph": []}
    runs = dict(zip(samples, (heads_then_decode, graph_run)))
    with torch.no_grad():
        for run in runs.values():  # warm-up
            run(stand_in.images[0])
        for _ in range(5):
            for label, run in runs.items():
                for x in stand_in.images:
                    start = time.perf_counter()
                    run(x)
                    samples[label].append((time.perf_counter() - start) * 1e3)
    log(
        "  decode in graph (stand-in, p50 ms): "
        + ", ".join(f"{k} {validation.percentiles(v)['p50']:.2f}" for k, v in samples.items())
    )
    return {label: validation.percentiles(v) for label, v in samples.items()}


def _time_decode(heads: list, task: Detection, repeats: int) -> dict:
    samples = []
    for head in heads:
        for _ in range(repeats):
            start = time.perf_counter()
            detection_decode.decode(head, task.anchors, task.input_size, task.params)
            samples.append((time.perf_counter() - start) * 1e3)
    return validation.percentiles(samples)


def _host_lines(results: dict) -> list[str]:
    """Per model, what the host did while it was timed (exporter.hostload), and why a busy run is unreliable."""
    lines = ["", "host while timing (1-min load, CPU other processes took, steal, worst p90/p50):", ""]
    for model, r in results.items():
        c = r.get("latency_conditions")
        if not c:
            continue
        share = "—" if c.get("other_cpu_share") is None else f"{c['other_cpu_share']:.0%}"
        steal = "—" if c.get("steal_s") is None else f"{c['steal_s']:.2f} s"
        worst = max((v for v in (c.get("spread") or {}).values() if v is not None), default=None)
        verdict = "reliable" if c["reliable"] else f"**unreliable**: {hostload.summary(c)}"
        lines.append(
            f"- {model}: load {c.get('load_avg_1m')}, others {share} over {c['window_s']:.1f} s, steal {steal}, "
            f"p90/p50 up to {worst if worst is None else f'{worst:.2f}'}; {verdict}"
        )
    return lines


def ratios(result: dict) -> dict[str, float]:
    """RATIOS of one model's run: how many times faster a is than b."""
    lat = {k: v["p50"] for k, v in result["latency_ms"].items()}
    return {name: round(lat[b] / lat[a], 3) for name, a, b in RATIOS if a in lat and b in lat}


def _kinds_line(q: dict) -> str:
    return f" and every {', '.join(q['float_kinds'])}" if q.get("float_kinds") else ""


COUNTED_REWRITES = {  # formats.rewrites that report how many times they applied
    "padded_avg_pools_as_pad": "padded average pool(s) as a zero pad and a pool",
    "single_tensor_cats_dropped": "one-tensor cat(s) dropped",
    "adaptive_pools_as_pools": "adaptive pool(s) as plain pools",
    "means_keeping_dims": "spatial mean(s) keeping their dims",
    "chunks_as_slices": "chunk(s) or split(s) as slices",
    "attention_as_matmuls": "attention(s) as matmuls and a softmax",
    "matmuls_as_bmm": "batched matmul(s) as one bmm",
    "constants_folded": "tensor(s) computed once at export",
    "nearest_upsamples_as_deconvs": "nearest upsampling(s) as depthwise transposed convolutions",
}


def _rewrites_line(rewrites: dict) -> str:
    lines = [
        f"{r['module']} ({'x'.join(map(str, r['kernel']))} dilation {r['dilation'][0]} on "
        f"{'x'.join(map(str, r['input']))}) -> {len(r['parts'])} part(s) "
        f"{', '.join('x'.join(map(str, k)) for k in r['parts'])}"
        for r in rewrites.get("padding_taps_dropped", [])
    ]
    splits: dict[str, int] = {}
    for r in rewrites.get("large_depthwise_split", []):
        how = f"{'x'.join(map(str, r['kernel']))} depthwise -> {' + '.join('x'.join(map(str, k)) for k in r['parts'])}"
        splits[how] = splits.get(how, 0) + 1
    lines += [f"{count} {how}" for how, count in splits.items()]
    lines += [
        f"{m or 'the model'}: input transform as one multiply-add"
        for m in rewrites.get("input_transform_as_affine", [])
    ]
    lines += [f"{rewrites[name]} {what}" for name, what in COUNTED_REWRITES.items() if rewrites.get(name)]
    return "; ".join(lines)


def table(results: dict) -> str:
    labels = ["eager", "eager NHWC"] + [label for label, *_ in RUNTIMES] + [ORT_AS_ON_ARM, UNREWRITTEN]
    lines = [
        "| model | "
        + " | ".join(f"{label} p50 ms" for label in labels)
        + " | "
        + " | ".join(n for n, *_ in RATIOS)
        + " |",
        "|---|" + "---|" * (len(labels) + len(RATIOS)),
    ]
    for model, r in results.items():
        lat = {k: v["p50"] for k, v in r["latency_ms"].items()}
        cells = [f"{lat[label]:.2f}" if label in lat else "—" for label in labels]
        ratio = ratios(r)
        busy = "" if (r.get("latency_conditions") or {}).get("reliable", True) else " (busy host: unreliable)"
        lines.append(
            f"| {model} {'x'.join(map(str, r['input']))}{busy} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{ratio[n]:.2f}×" if n in ratio else "—" for n, *_ in RATIOS)
            + " |"
        )
    lines += ["", "top operators (share of operator time, ms per run; profiled after the timed rounds):", ""]
    for model, r in results.items():
        for label, profile in (r.get("profiles") or {}).items():
            if profile.get("available", True) and profile.get("ops"):
                lines.append(
                    f"- {model} {label}: "
                    + ", ".join(
                        f"{o['op']} {o['share']:.0%} ({o['ms']:.2f} ms ×{o['count']})" for o in profile["ops"][:4]
                    )
                )
    for model, r in results.items():
        for label, rewrite in (r.get("rewrites") or {}).items():
            lines.append(f"- {model} {label} rewritten before lowering: {_rewrites_line(rewrite)}")
    lines += bench_counts.table(results, [label for label, *_ in RUNTIMES])
    lines += _host_lines(results)
    lines += [
        "",
        f"int8 budget: output PSNR >= {BUDGET_PSNR_DB:g} dB (+{SETTINGS['psnr_margin_db']:g} margin) on held-out "
        f"calibration images; layers kept in float, build seconds (quantization seconds):",
        "",
    ]
    for model, r in results.items():
        for label, q in r.get("quantization", {}).items():
            lines.append(
                f"- {model} {label}: {q['float_layers']} of {q['layers']} layers in float{_kinds_line(q)}, check PSNR "
                f"{q['check_psnr_db']} dB ({q['ranges']} ranges), build {r['build_s'][label]} s ({q['seconds']} s)"
            )
    if any(r.get("memory_bytes") for r in results.values()):
        lines += [
            "",
            "RAM each artifact needs (peak resident memory of a fresh process loading and running it, minus "
            "the runtime's own after import), MB:",
            "",
        ]
        for model, r in results.items():
            if r.get("memory_bytes"):
                lines.append(
                    f"- {model}: " + ", ".join(f"{label} {b / 1e6:.1f}" for label, b in r["memory_bytes"].items())
                )
    for model, r in results.items():
        if "postprocess_ms" in r:
            post = {k: v["p50"] for k, v in r["postprocess_ms"].items()}
            trained = post["trained stand-in"]
            total = ", ".join(f"{label} {v['p50'] + trained:.2f}" for label, v in r["latency_ms"].items())
            lines += [
                "",
                f"{model} post-processing (numpy decode + NMS, one thread), p50 ms: "
                + ", ".join(f"{k} {v:.2f}" for k, v in post.items()),
                f"{model} raw heads + post-processing (trained stand-in's), p50 ms: {total}",
            ]
        if r.get("decode_in_graph_ms"):
            lines.append(
                f"{model} trained stand-in in ONNX Runtime, per canvas, p50 ms: "
                + ", ".join(f"{k} {v['p50']:.2f}" for k, v in r["decode_in_graph_ms"].items())
            )
    return "\n".join(lines)


def against_baseline(results: dict, baseline: dict | None) -> str:
    """Each model's RATIOS now and in the baseline run (ratios only: single cells move between runs)."""
    if not baseline:
        return ""
    then = baseline["results"]
    lines = [
        "",
        f"against the baseline run of {baseline.get('date', '?')} ({baseline.get('host', {}).get('cpu', '?')}, "
        f"{baseline.get('threads', '?')} threads): ratio then → now, marked with a warning sign"
        f" where now is below {REGRESSION:.0%} of then",
        "",
    ]
    for model, r in results.items():
        if model not in then:
            lines.append(f"- {model}: not in the baseline")
            continue
        old, new = ratios(then[model]), ratios(r)
        cells = [
            f"{n} {old[n]:.2f}× → {new[n]:.2f}×" + (" ⚠ fell" if new[n] < REGRESSION * old[n] else "")
            for n, *_ in RATIOS
            if n in old and n in new
        ]
        lines.append(f"- {model}: " + "; ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help=f"any of {', '.join(MODELS)}")
    parser.add_argument("--threads", type=int, default=hostload.usable_cores())
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("exports/bench"))
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="a previous bench.json to compare ratios with")
    parser.add_argument(
        "--arm-cpus",
        default=",".join(bench_counts.profile_cpus()),
        help="emulated cores to count instructions on (the android and jetson profiles' by default); none: skip",
    )
    parser.add_argument("--save-baseline", action="store_true", help="make this run the baseline (then commit it)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    host = manifest.host(args.threads)
    print(f"host: {host['cpu']}, {host['cores']} cores, {args.threads} threads for every runtime; batch 1")
    cpus = [] if args.arm_cpus in ("", "none") else args.arm_cpus.split(",")
    arm = bench_counts.ArmCounter(cpus, print) if cpus else None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = bench_model(name, args.threads, args.warmup, args.iterations, Path(tmp), print, arm)
    baseline = json.loads(args.baseline.read_text()) if args.baseline.is_file() else None
    text = table(results) + against_baseline(results, baseline)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "host": host,
        "threads": args.threads,
        "tools": manifest.tool_versions(),
        "results": results,
    }
    (args.out / "bench.json").write_text(json.dumps(run, indent=2))
    if args.save_baseline:
        args.baseline.write_text(json.dumps(run, indent=2) + "\n")
        print(f"baseline written: {args.baseline}")
    (args.out / "bench.md").write_text(text + "\n")
    print(f"written: {args.out / 'bench.md'}")


if __name__ == "__main__":
    main()
