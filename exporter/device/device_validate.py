"""On-device check of an exporter Jetson build: golden inputs through each ONNX (as a TensorRT engine,
or in ONNX Runtime when tensorrt is missing) against the golden eager outputs (logits per image for
classification, per pixel for segmentation, raw SSD heads or a Faster R-CNN's final rows for detection, the
flow of each pixel for optical flow).

Standalone on purpose: needs numpy plus tensorrt (and cuda-python) or onnxruntime, never torch or the
exporter package. Copied into the build directory, so on the device:

    python3 device_validate.py BUILD_DIR [--runtime auto|tensorrt|onnxruntime]

Detection also needs detection_decode.py beside this script (the kit and bundles ship it there) and
the anchors the manifest's task.decode names: eager's and the artifact's heads are decoded alike and
their boxes matched.

Exit codes: 0 every artifact within its thresholds; 1 a threshold broken; 2 bad input (corrupted ONNX,
golden files that do not fit the model, no runtime, missing anchors or decode code), with one line on
stderr. The metrics are those of exporter/validation.py. accuracy_drop, miou_drop, map_drop and epe_increase are not
checked: a handful of golden images cannot resolve a 1-point change, and they carry no labels here.

The build judged its thresholds on its whole validation set; 8 golden inputs cannot resolve them (one
flipped image of 8 is 0.875 < 0.97). So a fraction of items (images, pixels, boxes) is judged in whole
items: it may miss as many as its threshold allows on this many items, rounded up, or as many as the
build's own run of the artifact missed on these same inputs (the manifest's golden_fidelity), when the
build passed it. Every other key takes the weaker of its threshold and that run's value.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import stat
import sys
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import NamedTuple

import numpy as np

INPUT, OUTPUT = "input", "logits"
DECODER = "detection_decode.py"  # beside this script
EAGER_DETECTIONS = "golden/eager_detections.json"
DECODE_KEYS = (
    "box_coder_weights",
    "score_thresh",
    "nms_thresh",
    "topk_candidates",
    "detections_per_img",
    "bbox_xform_clip",
    "match_score",
    "anchors",
)


class Task(NamedTuple):
    """What a manifest's "task" means here: the output layout and the thresholds a device run can check."""

    name: str
    layouts: tuple[str, ...]  # the first is the usual one
    min_keys: tuple[str, ...]
    max_keys: tuple[str, ...]


TASKS = {
    "classification": Task(
        "classification", ("NC",), ("top1_agreement", "top5_agreement", "psnr_db", "cosine"), ("max_abs_error",)
    ),
    "video": Task("video", ("NC",), ("top1_agreement", "top5_agreement", "psnr_db", "cosine"), ("max_abs_error",)),
    "segmentation": Task(
        "segmentation", ("NCHW",), ("pixel_agreement", "miou_vs_eager", "psnr_db", "cosine"), ("max_abs_error",)
    ),
    "detection": Task(
        "detection", ("NAK", "NDK"), ("matched_recall", "matched_precision", "psnr_db", "cosine"), ("max_abs_error",)
    ),
    "optical_flow": Task(
        "optical_flow", ("NCHW",), ("flow_agreement", "psnr_db", "cosine"), ("max_abs_error", "epe_vs_eager")
    ),
}


class Items(NamedTuple):
    """What a fraction of agreeing items counts: the fidelity key with the count, the items, a miss."""

    count: str
    noun: str
    missed: str


ITEMS = {
    "top1_agreement": Items("samples", "images", "images with another top-1"),
    "top5_agreement": Items("samples", "images", "images without eager's top-1 in the top-5"),
    "pixel_agreement": Items("pixels", "pixels", "pixels of another class"),
    "matched_recall": Items("eager_detections", "eager boxes", "eager boxes unmatched"),
    "matched_precision": Items("artifact_detections", "artifact boxes", "artifact boxes unmatched"),
    "flow_agreement": Items("pixels", "pixels", "pixels more than 1 px from eager's flow"),
}


class BadInput(Exception):
    """Exit 2: the build directory, its files or this host cannot be validated at all."""


def build_file(directory: Path, relative, missing_ok: bool = False) -> Path | None:
    """`directory / relative` for a path manifest.json names (or a fixed one of the build), checked before anything
    opens it: a relative path without `..` that leads, through any links, to a regular file inside `directory`
    (and its ONNX external data likewise); no FIFO or device, which would hang the read. A missing one is None
    with `missing_ok`; anything else is BadInput naming it. The exporter's own check (exporter/files.py
    build_file) says the same: this script imports no exporter."""
    pure = PurePosixPath(relative) if isinstance(relative, str) else None
    if (
        pure is None
        or not pure.parts
        or pure.is_absolute()
        or ".." in pure.parts
        or any(c in relative for c in "\\:\0")
    ):
        raise BadInput(f"path {relative!r} in manifest.json does not name a file inside {directory}")
    path = Path(directory) / pure
    if not os.path.lexists(path):
        if missing_ok:
            return None
        raise BadInput(f"{path} is missing from the build")
    for part in (path, path.with_name(path.name + ".data")):
        if part is path or os.path.lexists(part):
            _check_inside(Path(directory), part)
    return path


def _check_inside(directory: Path, path: Path) -> None:
    try:
        real = path.resolve(strict=True)
        mode = real.stat().st_mode
        inside = real.is_relative_to(directory.resolve(strict=True))
    except (OSError, RuntimeError) as e:  # a dangling link, a loop of links
        raise BadInput(f"{path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if not inside:
        raise BadInput(f"{path} leads outside the build folder {directory} (to {real})")
    if not stat.S_ISREG(mode):
        raise BadInput(f"{path} is not a regular file")


def _psnr(peak: float, rmse: float) -> float:
    if not math.isfinite(rmse):  # outputs with NaN or infinity: not measurable, and a breach of any threshold
        return math.nan
    if rmse == 0:
        return math.inf
    return -math.inf if peak == 0 else 20 * math.log10(peak / rmse)  # an all-zero reference: as the build


def fidelity(ref: np.ndarray, out: np.ndarray) -> dict:
    """Classification: (N, C) logits."""
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    diff = out - ref
    rmse = float(np.sqrt(np.mean(diff**2)))
    peak = float(np.abs(ref).max())
    k = min(5, ref.shape[1])
    ref_top1 = ref.argmax(1)
    top_k = np.argsort(-out, axis=1)[:, :k]
    norms = np.maximum(np.linalg.norm(ref, axis=1) * np.linalg.norm(out, axis=1), 1e-8)
    return {
        "samples": int(ref.shape[0]),
        "top1_agreement": float(np.mean(out.argmax(1) == ref_top1)),
        "top5_agreement": float(np.mean((top_k == ref_top1[:, None]).any(1))),
        "psnr_db": _psnr(peak, rmse),
        "cosine": float(np.mean(np.sum(ref * out, axis=1) / norms)),
        "max_abs_error": float(np.abs(diff).max()),
    }


def segmentation_fidelity(ref: np.ndarray, out) -> dict:
    """Segmentation: (N, C, H, W) per-pixel logits against the artifact's, an array of that shape or a
    list of C x H x W, taken one image at a time (they can be large).

    pixel_agreement: fraction of all pixels whose argmax class is eager's. miou_vs_eager: IoU of the
    artifact's mask with eager's per class, intersections and unions summed over the images, averaged
    over the classes present in either. psnr_db and max_abs_error over every logit; cosine per image
    (its logits flattened), averaged, as for classification."""
    classes = ref.shape[1]
    intersection, ref_area, out_area = (np.zeros(classes, dtype=np.int64) for _ in range(3))
    squared = peak = worst = 0.0
    agreeing, cosines = 0, []
    for r, o in zip(ref, out):
        r, o = r.astype(np.float64), o.astype(np.float64)
        diff = o - r
        squared += float(np.sum(diff**2))
        peak, worst = max(peak, float(np.abs(r).max())), max(worst, float(np.abs(diff).max()))
        cosines.append(float(np.sum(r * o) / max(float(np.linalg.norm(r) * np.linalg.norm(o)), 1e-8)))
        ref_mask, out_mask = r.argmax(0).ravel(), o.argmax(0).ravel()
        same = ref_mask == out_mask
        agreeing += int(same.sum())
        intersection += np.bincount(ref_mask[same], minlength=classes)
        ref_area += np.bincount(ref_mask, minlength=classes)
        out_area += np.bincount(out_mask, minlength=classes)
    union = ref_area + out_area - intersection
    present = union > 0
    return {
        "samples": int(ref.shape[0]),
        "pixels": int(ref.shape[0] * ref.shape[2] * ref.shape[3]),
        "pixel_agreement": agreeing / (ref.shape[0] * ref.shape[2] * ref.shape[3]),
        "miou_vs_eager": float(np.mean(intersection[present] / union[present])),
        "psnr_db": _psnr(peak, math.sqrt(squared / ref.size)),
        "cosine": float(np.mean(cosines)),
        "max_abs_error": worst,
    }


def flow_fidelity(ref: np.ndarray, out) -> dict:
    """Optical flow: (N, 2, H, W) flow against the artifact's. flow_agreement: the fraction of pixels whose flow
    is within 1 px (end-point distance) of eager's; epe_vs_eager: that distance, averaged over the pixels; the
    rest as for classification, over every value."""
    ref, out = ref.astype(np.float64), np.stack(out).astype(np.float64)
    metrics = fidelity(ref.reshape(len(ref), -1), out.reshape(len(out), -1))
    distance = np.sqrt(np.sum((out - ref) ** 2, axis=1))
    return {key: metrics[key] for key in ("samples", "psnr_db", "cosine", "max_abs_error")} | {
        "pixels": int(distance.size),
        "flow_agreement": float(np.mean(distance < 1.0)),
        "epe_vs_eager": float(np.mean(distance)),
    }


class Decoding(NamedTuple):
    """What turns a detection head into boxes: detection_decode.py, the anchors, the input size (h, w) and
    task.decode's parameters."""

    code: ModuleType
    anchors: np.ndarray | None  # None: the graph's rows are final detections (decode kind "final")
    image_size: tuple[int, int]
    params: dict

    def __call__(self, head: np.ndarray) -> dict:
        return self.code.decode(head, self.anchors, self.image_size, self.params)


def detection_fidelity(ref: np.ndarray, out, decoding: Decoding, eager: list[dict] | None = None) -> dict:
    """Detection: (N, anchors, 4 + C) raw heads. psnr_db, cosine (per image, its head flattened) and
    max_abs_error of the heads, as for the other tasks; then both decoded and the artifact's boxes
    matched to eager's (same class, IoU >= 0.5, both at scores >= match_score): matched_recall is the
    fraction of eager's boxes matched, matched_precision that of the artifact's, mean_match_iou and
    max_score_error over the matches. `eager` is eager's decoded heads when already at hand."""
    ref, out = np.asarray(ref, dtype=np.float64), np.asarray(out, dtype=np.float64)
    out = np.stack([decoding.code.aligned(r, o, decoding.params) for r, o in zip(ref, out)]) if len(out) else out
    flat_ref, flat_out = ref.reshape(len(ref), -1), out.reshape(len(out), -1)
    diff = flat_out - flat_ref
    norms = np.maximum(np.linalg.norm(flat_ref, axis=1) * np.linalg.norm(flat_out, axis=1), 1e-8)
    eager = eager if eager is not None else [decoding(r) for r in ref]
    matches = [decoding.code.match(e, decoding(o), decoding.params["match_score"]) for e, o in zip(eager, out)]
    reference, candidate, matched = (sum(m[key] for m in matches) for key in ("reference", "candidate", "matched"))
    ious = [v for m in matches for v in m["ious"]]
    errors = [v for m in matches for v in m["score_errors"]]
    return {
        "samples": int(ref.shape[0]),
        "psnr_db": _psnr(float(np.abs(ref).max()), float(np.sqrt(np.mean(diff**2)))),
        "cosine": float(np.mean(np.sum(flat_ref * flat_out, axis=1) / norms)),
        "max_abs_error": float(np.abs(diff).max()),
        "matched_recall": matched / reference if reference else 1.0,
        "matched_precision": matched / candidate if candidate else 1.0,
        "mean_match_iou": float(np.mean(ious)) if ious else None,
        "max_score_error": float(np.max(errors)) if errors else None,
        "eager_detections": reference,
        "artifact_detections": candidate,
    }


def _missed(fraction: float, items: int) -> int:
    return round((1 - fraction) * items)


def breaches(
    metrics: dict, thresholds: dict, task: Task = TASKS["classification"], host: dict | None = None
) -> list[str]:
    """The thresholds `metrics` break, judged as the module docstring says; `host` is the build's own
    fidelity on the same golden inputs (None for a build that did not record it)."""
    host = host or {}
    reasons = []
    for key, limit in thresholds.items():
        value = metrics[key]
        if key in ITEMS:
            count, _, misses = ITEMS[key]
            items, missed = metrics[count], _missed(value, metrics[count])
            allowed = math.ceil(items * (1 - limit) - 1e-9)
            own = _missed(float(host[key]), host[count]) if key in host and count in host else 0
            if missed > max(allowed, own):
                own_run = f", the build's own run {own}" if own else ""
                reasons.append(
                    f"{key} {value:.4g} ({missed} of {items} {misses}; {limit:g} allows {allowed} of {items}{own_run})"
                )
        elif key in task.min_keys:
            floor = min(limit, float(host[key])) if key in host else limit
            if not value >= floor:  # NaN breaks it too
                reasons.append(f"{key} {value:.4g} (needs >= {floor:g})")
        elif key in task.max_keys:
            ceiling = max(limit, float(host[key])) if key in host else limit
            if not value <= ceiling:
                reasons.append(f"{key} {value:.4g} (needs <= {ceiling:g})")
    return reasons


def unresolved(metrics: dict, thresholds: dict) -> list[str]:
    """A note naming the fractions whose golden items are too few to resolve their threshold (rounding up
    to a whole item lets one miss through where the threshold alone would allow none); said, not hidden."""
    few = [
        f"{key} {limit:g} ({metrics[ITEMS[key].count]} {ITEMS[key].noun})"
        for key, limit in thresholds.items()
        if key in ITEMS and 0 < metrics[ITEMS[key].count] * (1 - limit) < 1
    ]
    return [f"note: too few items to resolve {', '.join(few)}: one miss each is let through"] if few else []


def _sha256(path: Path) -> str:
    """As the manifest hashes an artifact (exporter.files.sha256): a graph with its ONNX external data beside it
    (`<file>.data`, written for graphs over 2 GiB) over the hashes of both."""
    data = path.with_name(path.name + ".data")
    if not data.is_file():
        return _file_sha256(path)
    return hashlib.sha256(f"\0{_file_sha256(path)}\n.data\0{_file_sha256(data)}\n".encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _task(doc: dict) -> tuple[Task, dict]:
    """The manifest's task (a manifest written before tasks existed is classification) and its raw entry."""
    entry = doc.get("task") or {"name": "classification"}
    task = TASKS.get(entry.get("name"))
    if task is None:
        raise BadInput(
            f"manifest.json task {entry.get('name')!r} is not one this validator checks ({', '.join(TASKS)})"
        )
    layout = (entry.get("output") or {}).get("layout", task.layouts[0])
    if layout not in task.layouts:
        raise BadInput(
            f"manifest.json says a {task.name} model with output layout {layout}; {task.name} outputs "
            f"{' or '.join(task.layouts)}"
        )
    if task.name == "detection":
        missing = [k for k in DECODE_KEYS if k not in (entry.get("decode") or {})]
        if missing:
            raise BadInput(f"manifest.json task {task.name!r} lacks task.decode {', '.join(missing)}: build it again")
    return task, entry


def _read_build(directory: Path) -> tuple[dict, Task, str, np.ndarray, np.ndarray]:
    try:
        doc = json.loads(build_file(directory, "manifest.json").read_text())
        inputs = np.load(build_file(directory, "golden/inputs.npy"))
        logits = np.load(build_file(directory, "golden/eager_logits.npy"))
    except (OSError, ValueError, RecursionError) as e:
        raise BadInput(f"{directory} is not a readable exporter build: {e}") from None
    task, entry = _task(doc)
    frames = entry.get("frames")  # clips: N x 3 x T x H x W
    if inputs.ndim != (5 if frames else 4) or logits.ndim != len(task.layouts[0]) or len(inputs) != len(logits):
        raise BadInput(
            f"golden files do not pair up for {task.name} (inputs N x C x {'T x ' if frames else ''}H x W, "
            f"eager logits {' x '.join(task.layouts[0])}): inputs {inputs.shape}, eager logits {logits.shape}"
        )
    size = entry.get("input_size")
    if (size is not None and list(inputs.shape[-2:]) != list(size)) or (frames and inputs.shape[2] != frames):
        raise BadInput(
            f"golden inputs.npy has shape {inputs.shape} but manifest.json task.input_size is {list(size)}"
            + (f" and task.frames {frames}" if frames else "")
        )
    shape = (entry.get("output") or {}).get("shape")
    if shape is not None and list(logits.shape[1:]) != list(shape[1:]):
        raise BadInput(
            f"golden eager_logits.npy has shape {logits.shape} but manifest.json task.output.shape is {list(shape)} per input"
        )
    output = (entry.get("output") or {}).get("name", OUTPUT)
    return doc, task, output, inputs.astype(np.float32), logits


def _decode_code():
    """detection_decode.py from this script's directory, loaded without the exporter package."""
    path = Path(__file__).resolve().parent / DECODER
    if not path.is_file():
        raise BadInput(
            f"{DECODER} is missing beside {Path(__file__).name} in {path.parent}; "
            "detection builds and bundles ship it there"
        )
    spec = importlib.util.spec_from_file_location("detection_decode", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # whatever a damaged file raises
        raise BadInput(f"{path} does not load: {type(e).__name__}: {e}") from None
    return module


def _decoding(directory: Path, entry: dict, logits: np.ndarray, image_size) -> Decoding:
    decode = entry["decode"]
    params = {k: v for k, v in decode.items() if k not in ("anchors", "code", "code_sha256")}
    if decode["anchors"] is None:  # the graph decoded its detections itself: rows to read, no anchors
        return Decoding(_decode_code(), None, tuple(int(v) for v in image_size), params)
    path = build_file(directory, decode["anchors"], missing_ok=True)
    if path is None:
        raise BadInput(
            f"{decode['anchors']} is missing from {directory}: detection needs the anchors manifest.json "
            "task.decode.anchors names"
        )
    try:
        anchors = np.load(path)
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot read the anchors {path} (manifest.json task.decode.anchors): {e}") from None
    if anchors.shape != (logits.shape[1], 4):
        raise BadInput(
            f"{decode['anchors']} has shape {anchors.shape} but golden eager_logits.npy has "
            f"{logits.shape[1]} anchors per image: ({logits.shape[1]}, 4) expected"
        )
    return Decoding(_decode_code(), anchors.astype(np.float32), tuple(int(v) for v in image_size), params)


def _check_golden_detections(directory: Path, decoding: Decoding, eager: list[dict]) -> None:
    """Decoding eager's golden heads here must give the boxes the build wrote: otherwise the anchors, the
    parameters or the decode code are not the build's, and every comparison below would be off."""
    path = build_file(directory, EAGER_DETECTIONS, missing_ok=True)
    if path is None:
        return
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
        written = [
            {
                "boxes": np.asarray(d["boxes"], dtype=np.float64).reshape(-1, 4),
                "scores": np.asarray(d["scores"], dtype=np.float64),
                "labels": np.asarray(d["labels"], dtype=np.int64),
            }
            for d in written
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"cannot read {EAGER_DETECTIONS}: {type(e).__name__}: {e}") from None
    if len(written) != len(eager):
        raise BadInput(f"{EAGER_DETECTIONS} has {len(written)} images, golden eager_logits.npy {len(eager)}")
    for i, (w, e) in enumerate(zip(written, eager)):
        shown = e["scores"] >= decoding.params["match_score"]
        e = {k: v[shown] for k, v in e.items()}
        # every box on each side has its twin on the other (same class; box and score equal but for rounding)
        twins = (
            (np.abs(w["boxes"][:, None] - e["boxes"][None]).max(-1, initial=0) <= 1e-3)
            & (np.abs(w["scores"][:, None] - e["scores"][None]) <= 1e-4)
            & (w["labels"][:, None] == e["labels"][None])
        )
        if len(w["boxes"]) != len(e["boxes"]) or not (twins.any(1).all() and twins.any(0).all()):
            raise BadInput(
                f"decoding golden eager_logits.npy does not give {EAGER_DETECTIONS} (image {i}: "
                f"{int(twins.any(1).sum())} of its {len(w['boxes'])} boxes reproduced, {len(e['boxes'])} "
                f"decoded): the anchors, task.decode or {DECODER} are not the build's"
            )


def _ort_runner(path: Path, output: str, threads: int | None = None):
    try:
        import onnxruntime as ort
    except ImportError:
        raise BadInput("neither tensorrt nor onnxruntime is installed") from None
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types for unreadable models
        raise BadInput(f"corrupted ONNX {path.name}: {(str(e).strip().splitlines() or [''])[0][:200]}") from None
    names = [o.name for o in session.get_outputs()]
    if output not in names:
        raise BadInput(f"{path.name} has no output {output!r} (it has {', '.join(names)})")
    return lambda x: session.run([output], {INPUT: x})[0]


def _cuda():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        from cuda import cudart
    return cudart


def _check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if rest else None


def _build_engine(trt, logger, onnx_path: Path, precision: str, batch) -> bytes:
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if major >= 11 else 0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise BadInput(f"corrupted ONNX {onnx_path.name}: {parser.get_error(0)}")
    config = builder.create_builder_config()
    if precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)
    elif major < 11:
        config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    chw = tuple(network.get_input(0).shape)[1:]
    profile.set_shape(INPUT, *[(n, *chw) for n in batch])
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path.name}")
    return bytes(serialized)


def _trt_runner(onnx_path: Path, engine_path: Path, precision: str, batch, output: str):
    import tensorrt as trt

    cudart = _cuda()
    logger = trt.Logger(trt.Logger.WARNING)
    if not engine_path.is_file():
        engine_path.write_bytes(_build_engine(trt, logger, onnx_path, precision, batch))
    engine = trt.Runtime(logger).deserialize_cuda_engine(engine_path.read_bytes())
    if engine is None:
        raise BadInput(
            f"{engine_path.name} does not load in TensorRT {trt.__version__}; delete it and run again to rebuild"
        )
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    if output not in names:
        raise BadInput(f"{engine_path.name} has no output {output!r} (its tensors: {', '.join(names)})")

    def run(x: np.ndarray) -> np.ndarray:
        context.set_input_shape(INPUT, x.shape)
        out = np.empty(tuple(context.get_tensor_shape(output)), dtype=np.float32)
        pointers = [_check(cudart.cudaMalloc(a.nbytes)) for a in (x, out)]
        try:
            _check(
                cudart.cudaMemcpy(pointers[0], x.ctypes.data, x.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice)
            )
            context.set_tensor_address(INPUT, int(pointers[0]))
            context.set_tensor_address(output, int(pointers[1]))
            if not context.execute_async_v3(0):
                raise RuntimeError("TensorRT execution failed")
            _check(cudart.cudaDeviceSynchronize())
            _check(
                cudart.cudaMemcpy(
                    out.ctypes.data, pointers[1], out.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
                )
            )
        finally:
            for p in pointers:
                cudart.cudaFree(p)
        return out

    return run


def _pick_runtime(runtime: str) -> str:
    if runtime == "onnxruntime":
        return runtime
    try:
        import tensorrt  # noqa: F401

        _cuda()
        return "tensorrt"
    except ImportError:
        if runtime == "tensorrt":
            raise BadInput("--runtime tensorrt needs the tensorrt and cuda-python packages") from None
        return "onnxruntime"


class Golden(NamedTuple):
    """A build's (or bundle's) golden inputs and eager's outputs for them, checked to fit its manifest."""

    doc: dict
    task: Task
    output: str
    inputs: np.ndarray
    logits: np.ndarray
    decoding: Decoding | None  # detection: what turns heads into boxes
    eager: list[dict] | None  # detection: eager's golden heads decoded
    pixels: np.ndarray | None = None  # the same inputs as uint8-nhwc artifacts take them (golden/inputs_uint8.npy)

    def fed(self, entry: dict) -> np.ndarray:
        """The golden inputs as the artifact `entry` (its manifest or bundle.json record) takes them."""
        if (entry.get("input") or {}).get("format") != "uint8-nhwc":
            return self.inputs
        if (
            self.pixels is None
            or self.pixels.shape[:1] + self.pixels.shape[1:3] != self.inputs.shape[:1] + self.inputs.shape[2:]
        ):
            raise BadInput(
                f"{entry['name']} takes uint8-nhwc: golden/inputs_uint8.npy is missing or not the golden inputs"
            )
        return self.pixels


def read_golden(directory) -> Golden:
    directory = Path(directory)
    doc, task, output, inputs, logits = _read_build(directory)
    decoding = eager = None
    if task.name == "detection":
        decoding = _decoding(directory, doc["task"], logits, inputs.shape[2:])
        eager = [decoding(r) for r in logits]
        _check_golden_detections(directory, decoding, eager)
    bytes_path = build_file(directory, "golden/inputs_uint8.npy", missing_ok=True)
    pixels = np.load(bytes_path) if bytes_path is not None else None
    return Golden(doc, task, output, inputs, logits, decoding, eager, pixels)


def judge(golden: Golden, entry: dict, outputs, runtime: str) -> dict:
    """One artifact's outputs for the golden inputs, however they were run, against eager's and the
    artifact's thresholds (entry: its manifest or bundle.json record)."""
    task = golden.task
    if task.name == "segmentation":
        metrics = segmentation_fidelity(golden.logits, outputs)
    elif task.name == "detection":
        metrics = detection_fidelity(golden.logits, np.stack(outputs), golden.decoding, golden.eager)
    elif task.name == "optical_flow":
        metrics = flow_fidelity(golden.logits, outputs)
    else:
        metrics = fidelity(golden.logits, np.stack(outputs))
    # the others (accuracy_drop, miou_drop, map_drop) need labeled data
    thresholds = {k: v for k, v in entry.get("thresholds", {}).items() if k in task.min_keys + task.max_keys}
    # a run the build failed vouches for nothing: then the thresholds alone
    host = entry.get("golden_fidelity") if entry.get("status") == "passed" else None
    reasons = breaches(metrics, thresholds, task, host)
    return {
        "name": entry["name"],
        "path": entry.get("path", entry.get("file")),
        "runtime": runtime,
        "task": task.name,
        "fidelity": metrics,
        "thresholds": thresholds,
        "reasons": reasons,
        "notes": unresolved(metrics, thresholds),
        "status": "failed" if reasons else "passed",
    }


def validate(directory, runtime: str = "auto", threads: int | None = None) -> list[dict]:
    """`threads`: ONNX Runtime's (default: its own choice, every core). Its int8 outputs depend on it: measured
    on a Q/DQ R3D-18, 1 and 2 threads differ by up to 0.027 in a logit (47.65 against 47.49 dB), so only the
    build's thread count (manifest.json: host.threads) reproduces its golden_fidelity to float rounding."""
    directory = Path(directory)
    golden = read_golden(directory)
    runtime = _pick_runtime(runtime)
    engines = {e["precision"]: e for e in golden.doc.get("jetson", {}).get("engines", [])}
    results = []
    for entry in (a for a in golden.doc["artifacts"] if a["format"] == "onnx" and a.get("path")):
        path = build_file(directory, entry["path"], missing_ok=True)
        if path is None or _sha256(path) != entry["sha256"]:
            raise BadInput(f"corrupted ONNX {entry['path']}: missing or not matching its sha256 in manifest.json")
        kit = engines.get(entry["precision"], {})
        batch = kit.get("options", {}).get("batch", [1, 1, 1])
        if runtime == "tensorrt":
            name = kit.get("engine", path.stem + ".engine")
            engine = build_file(directory, name, missing_ok=True) or directory / name  # built here when missing
            run = _trt_runner(path, engine, entry["precision"], batch, golden.output)
        else:
            run = _ort_runner(path, golden.output, threads)
        outputs = []
        for i, x in enumerate(golden.fed(entry)):
            try:  # the engine only takes batches inside its profile: feed MIN copies, keep the first row
                out = np.asarray(run(np.ascontiguousarray(np.repeat(x[None], batch[0], axis=0))))
            except Exception as e:  # the runtime fails on this input (as the build's validation reports it)
                first = (str(e).strip().splitlines() or [""])[0][:300]
                results.append(
                    {
                        "name": entry["name"],
                        "path": entry["path"],
                        "runtime": runtime,
                        "fidelity": None,
                        "reasons": [f"does not run on golden input {i}: {type(e).__name__}: {first}"],
                        "status": "failed",
                    }
                )
                break
            if out.shape[1:] != golden.logits.shape[1:]:
                raise BadInput(
                    f"golden eager_logits.npy has shape {golden.logits.shape} but {entry['path']} outputs {out.shape}"
                )
            outputs.append(out[0])
        else:
            results.append(judge(golden, entry, outputs, runtime))
    if not results:
        raise BadInput(f"{directory} lists no ONNX artifact to validate")
    return results


def summary(result: dict) -> str:
    f = result["fidelity"]
    if f is None:  # it did not run
        return f"{result['status'].upper()} {result['name']} ({result['runtime']}): " + "; ".join(result["reasons"])
    if result.get("task") == "segmentation":
        agreement = f"pixel agreement {f['pixel_agreement']:.4f}, mIoU vs eager {f['miou_vs_eager']:.4f}"
    elif result.get("task") == "detection":
        iou = "n/a" if f["mean_match_iou"] is None else f"{f['mean_match_iou']:.3f}"
        agreement = (
            f"matched recall {f['matched_recall']:.4f}, precision {f['matched_precision']:.4f}, "
            f"mean IoU {iou} ({f['eager_detections']} eager boxes)"
        )
    elif result.get("task") == "optical_flow":
        agreement = f"within 1 px of eager {f['flow_agreement']:.4f}, EPE vs eager {f['epe_vs_eager']:.3g} px"
    else:
        agreement = f"top1 {f['top1_agreement']:.3f}"
    line = (
        f"{result['status'].upper()} {result['name']} ({result['runtime']}, {f['samples']} golden inputs): "
        f"{agreement}, psnr {f['psnr_db']:.1f} dB, cosine {f['cosine']:.6f}, max abs {f['max_abs_error']:.3g}"
    )
    return line + "".join(f"; {text}" for text in (*result["reasons"], *result.get("notes", [])))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=Path(__file__).resolve().parent, type=Path)
    parser.add_argument("--runtime", choices=("auto", "tensorrt", "onnxruntime"), default="auto")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="ONNX Runtime's threads (default: its own, every core); the build's (manifest host.threads) "
        "reproduce its numbers exactly",
    )
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be 1 or more")
    try:
        results = validate(args.directory, args.runtime, args.threads)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for result in results:
        print(summary(result))
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
