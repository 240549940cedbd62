"""One model through the bench: every runtime built from the same random-weight model, timed side by side in one
process with the same thread count, then profiled, counted on ARM cores and, for a detector, its post-processing timed.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..precision import Precision
from .. import data, formats, hostload, validation
from ..device import detection_decode
from ..quant import SETTINGS, Calibration
from ..tasks import Detection
from ..weights import bind_task, builder_kwargs, resolve, task_class
from . import counts
from .report import kinds_line, rewrites_line
from .rows import (
    BUDGET_PSNR_DB,
    CALIBRATION_IMAGES,
    MODELS,
    ORT_AS_ON_ARM,
    ORT_OWN_INT8,
    PROFILED,
    RUNTIMES,
    UINT8_RUNTIMES,
    UNREWRITTEN,
)

# where the tests cache the trained digits stand-ins (tests/conftest.py): EXPORTER_TEST_CACHE or .cache/digits
STAND_IN_CACHE = Path(os.environ.get("EXPORTER_TEST_CACHE", ".cache/digits"))


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
    arm: counts.ArmCounter | None = None,
) -> dict:
    """One model's results: each runtime's latency, build seconds, quantization, memory, top operators, rewrites,
    ARM instruction counts (with `arm`) and, for a detector, its post-processing."""
    torch.manual_seed(0)
    weights = resolve(MODELS[name])
    task = bind_task(weights)
    model = type(task).graph(type(task).construct(name, task.num_classes, {}, builder_kwargs(weights)).eval())
    inputs = data.synthetic(task.transform(weights), CALIBRATION_IMAGES, 1, seed=0)
    _settle_batchnorm(model, inputs.calibration)
    example = inputs.example
    calibrations = _calibrations(inputs.calibration, task)
    meta = _meta(name, task, weights)
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
        details = format_.export(model, example, precision, calibrations.get(budget), path, meta)
        build_s[label] = round(time.perf_counter() - start, 1)
        paths[label] = (format_, path)
        if details.get("rewrites"):
            rewrites[label] = details["rewrites"]
            log(f"  {name}: {label}: rewritten before lowering: {rewrites_line(details['rewrites'])}")
        if "quantization" in details:
            quantization[label] = _quantization_row(details["quantization"])
            log(f"  {name}: {label}: {_quantization_line(details['quantization'])}")
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
        format_.export(model, example, Precision.FP32, None, path, meta, rewrites=False)
        runners[UNREWRITTEN] = format_.load(path, threads)
    if "onnx fp32 (ORT)" in paths:
        format_, path = paths["onnx fp32 (ORT)"]
        runners[ORT_AS_ON_ARM] = format_.load(path, threads, nchwc=False)
        start = time.perf_counter()
        own = _ort_own_int8(path, inputs.calibration, workdir / f"{name}_onnx_int8_ort_own.onnx")
        build_s[ORT_OWN_INT8] = round(time.perf_counter() - start, 1)
        paths[ORT_OWN_INT8], runners[ORT_OWN_INT8] = (format_, own), format_.load(own, threads)
        torch.set_num_threads(threads)
    fed = _uint8_rows(name, model, task, example, meta, threads, workdir, runners, build_s, log)
    timing, conditions = validation.measure_latency_on_host(
        runners, example, warmup, iterations, rounds=10, examples=fed
    )
    conditions = hostload.judged(conditions, threads)  # what the host did while timing; busy: unreliable
    if not conditions["reliable"]:
        log(f"  {name}: host busy while timing, numbers unreliable: {hostload.summary(conditions)}")
    result = {
        "input": list(task.input_size),
        "latency_ms": timing,
        "latency_conditions": conditions,
        "build_s": build_s,
        "quantization": quantization,
        "memory_bytes": memory,
        "profiles": _profiles(name, paths, example, threads, log),  # after the timed rounds
        "rewrites": rewrites,
        "size_bytes": {label: path.stat().st_size for label, (_, path) in paths.items() if path.is_file()},
        # the images the ARM columns count on; random weights: how much each file's arithmetic rounds, not accuracy
        "psnr_db": _psnr_vs_eager(
            model, {label: runners[label] for label in paths}, [example, *inputs.calibration[:2]]
        ),
    }
    if arm is not None:  # after every timed round: qemu never runs beside a timing
        images = torch.cat([example, *inputs.calibration[:2]]).numpy()
        result["instructions"] = arm.count(name, model, {label: path for label, (_, path) in paths.items()}, images)
    if isinstance(task, Detection):
        result |= _detection_timings(name, model, example, task, weights, threads, workdir, log)
    return result


def _ort_own_int8(fp32: Path, images: list, out: Path) -> Path:
    """ORT_OWN_INT8: the fp32 ONNX file quantized as ONNX Runtime's documentation does it (quant_pre_process, then
    quantize_static: QDQ, uint8 activations, per-channel int8 weights), calibrated on `images`."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from ..formats.onnx import INPUT

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{INPUT: x.contiguous().numpy()} for x in images])

        def get_next(self):
            return next(self.feeds, None)

    prepared = out.with_name(f"{out.stem}_prepared.onnx")
    quant_pre_process(str(fp32), str(prepared))
    quantize_static(
        str(prepared),
        str(out),
        Feeds(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return out


def _flat(output) -> torch.Tensor:
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return torch.cat([_flat(o) for o in output])
    return torch.as_tensor(output).detach().float().flatten()


def _psnr_vs_eager(model, runners: dict, images: list) -> dict[str, float]:
    """Each runner's PSNR against eager on `images`, one at a time (where a runner returns only a graph's first
    output, on that output)."""
    with torch.no_grad():
        reference = [_flat(model(x)) for x in images]
    found = {}
    for label, run in runners.items():
        try:
            outputs = [_flat(run(x)) for x in images]
        except Exception:  # a runner that cannot take this input here: no PSNR, never a failed benchmark
            continue
        if any(o.numel() > r.numel() for o, r in zip(outputs, reference)):
            continue
        out, ref = torch.cat(outputs), torch.cat([r[: o.numel()] for o, r in zip(outputs, reference)])
        noise = float((out - ref).pow(2).mean())
        found[label] = round(10 * float(np.log10(float(ref.pow(2).mean()) / noise)), 1) if noise else float("inf")
    return found


def _calibrations(images: list, task) -> dict[str, Calibration]:
    """The int8 rows' calibration: "plain" is PTQ with no fallback, "budget" keeps layers in float to hold the PSNR."""
    return {
        "plain": Calibration(images, None, {"psnr_db": BUDGET_PSNR_DB}, {**SETTINGS, "fallback": False}, task=task),
        "budget": Calibration(images, None, {"psnr_db": BUDGET_PSNR_DB}, dict(SETTINGS), task=task),
    }


def _meta(name: str, task, weights) -> dict:
    """What a format writes into the artifact beside the graph."""
    return {
        "weight": MODELS[name],
        "model": name,
        "labels": [str(i) for i in range(task.num_classes)],
        "task": task.describe(),
        "preprocessing": task.preprocessing(weights),
    }


def _quantization_row(q: dict) -> dict:
    """The report's summary of one int8 export's quantization details."""
    return {
        "float_layers": len(q["float_layers"]),
        "layers": q["layers"],
        "seconds": q["seconds"],
        "check_psnr_db": q["after"]["psnr_db"],
        "ranges": q["after"]["ranges"],
        **({"float_kinds": q["float_kinds"]} if q.get("float_kinds") else {}),
    }


def _quantization_line(q: dict) -> str:
    return (
        f"{len(q['float_layers'])} of {q['layers']} layers in float{kinds_line(q)}, "
        f"check PSNR {q['before']['psnr_db']} -> {q['after']['psnr_db']} dB"
    )


def _profiles(name: str, paths: dict, example: torch.Tensor, threads: int, log) -> dict:
    """PROFILED rows' top operators, each in a session of its own."""
    profiles = {}
    for label in PROFILED:
        if label in paths:
            format_, path = paths[label]
            try:
                profiles[label] = format_.profile(path, example, 5, threads)
            except Exception as e:
                log(f"  {name}: {label}: not profiled: {type(e).__name__}: {e}")
            torch.set_num_threads(threads)
    return profiles


def _detection_timings(name, model, example, task, weights, threads: int, workdir: Path, log) -> dict:
    """A detector's numpy post-processing on the trained stand-in's heads and on random heads (the worst case),
    and the stand-in's decode inside its ONNX graph."""
    with torch.no_grad():
        random_heads = model(example)[0].numpy()
    stand_in = _stand_in(name, weights, log)
    return {
        "postprocess_ms": {
            "trained stand-in": _time_decode(stand_in.heads, stand_in.task, 5),
            "random heads (worst case)": _time_decode([random_heads], task, 20),
        },
        "decode_in_graph_ms": _time_decode_in_graph(stand_in, threads, workdir, log),
    }


def _uint8_rows(name, model, task, example, meta, threads, workdir, runners, build_s, log) -> dict:
    """UINT8_RUNTIMES: the fp32 files again behind the graph's own scaling and normalisation, added to `runners`;
    returns each one's input, the example as the bytes an app's bitmap holds (none where the task takes no bytes)."""
    from ..tasks.image_input import ImageBytesInput, as_bytes

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
        format_.export(wrapped, pixels, Precision.FP32, None, path, meta)
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

    from ..standins import detection as digits_detection

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
    from ..tasks.detections_in_graph import DetectionsInGraph

    format_ = _available("onnx")
    if format_ is None:
        return {}
    task, meta = stand_in.task, {"task": stand_in.task.describe()}
    heads_path, graph_path = workdir / "stand_in_heads.onnx", workdir / "stand_in_decode_in_graph.onnx"
    format_.export(type(task).graph(stand_in.model), stand_in.images[0], Precision.FP32, None, heads_path, meta)
    format_.export(
        DetectionsInGraph.graph(stand_in.model),
        stand_in.images[0],
        Precision.FP32,
        None,
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
