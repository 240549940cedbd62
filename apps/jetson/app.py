"""Reference Jetson app for an exporter bundle: classify, segment or detect, or check the golden inputs.

    python app.py BUNDLE_DIR IMAGE...                   classification: top-5 classes per image
    python app.py BUNDLE_DIR IMAGE... [--overlay PNG]   segmentation: pixel fraction per class, and
                                                        the mask in colour over the image
                                                        detection: label, score and box per object,
                                                        and the boxes drawn over the image
    python app.py BUNDLE_DIR --golden                   golden inputs against eager's golden outputs

The task (classification, segmentation or detection) comes from bundle.json; a bundle without one is a
classifier. Detection decodes the model's raw heads with the bundle's own detection_decode.py, anchors
and decode parameters (bundle.json task.decode). Runs the first ONNX artifact bundle.json lists (its
order is the preferred one) as a TensorRT engine when tensorrt and cuda-python are installed and
build_engine.sh has built the engine, else in ONNX Runtime. Needs numpy and pillow; never torch.
--golden runs the golden inputs through this app's own runner and judges its outputs with the bundle's
device_validate.py, by the same rule and numbers as the device kit.
Exit codes: 0 done (--golden: the artifact holds its thresholds on the golden inputs), 1 the golden
check fails, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# torchvision InterpolationMode values -> the PIL filters torchvision uses for PIL images
# (module-level constants: older Pillows on JetPack lack Image.Resampling)
FILTERS = {
    "nearest": Image.NEAREST,
    "nearest-exact": Image.NEAREST,
    "bilinear": Image.BILINEAR,
    "bicubic": Image.BICUBIC,
    "box": Image.BOX,
    "hamming": Image.HAMMING,
    "lanczos": Image.LANCZOS,
}
CLASSIFICATION, SEGMENTATION, DETECTION = "classification", "segmentation", "detection"
TASKS = (CLASSIFICATION, SEGMENTATION, DETECTION)
# task.decode keys that name files, not decode parameters (the rest, the detector's kind included, go to
# detection_decode.decode; match_score is the app's display threshold)
DECODE_FILES = ("anchors", "code", "code_sha256")
BACKGROUND = ("__background__", "background")  # class names an overlay leaves unpainted (torchvision's first)
OVERLAY_ALPHA = 0.5


def load_bundle(directory: Path) -> tuple[dict, list[str], dict]:
    info = json.loads((directory / "bundle.json").read_text(encoding="utf-8"))
    labels = (directory / info["labels"]).read_text(encoding="utf-8").splitlines()
    spec = json.loads((directory / info["preprocessing"]).read_text(encoding="utf-8"))
    return info, labels, spec


def task_of(info: dict) -> dict:
    task = info.get("task") or {"name": CLASSIFICATION}
    if task["name"] not in TASKS:
        raise ValueError(f"task {task['name']!r} is not one this app runs ({', '.join(TASKS)})")
    return task


def _resized_size(width: int, height: int, resize: list[int]) -> tuple[int, int]:
    """torchvision's resize: one number sets the shorter side (the longer one is truncated), two are (h, w)."""
    if len(resize) == 2:
        return resize[1], resize[0]
    short, long = sorted((width, height))
    new_short, new_long = resize[0], int(resize[0] * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def preprocess(image: Image.Image, spec: dict) -> np.ndarray:
    """What the weight's transforms() does to a PIL image: resize, center crop (none for segmentation,
    whose resize is to the exact input size), [0, 1], normalize; NCHW float32. A uint8-nhwc bundle's artifacts take
    the cropped RGB bytes as they are (NHWC uint8): the rest is inside their graph."""
    image = image.convert("RGB")
    size = _resized_size(*image.size, spec["resize_size"])
    if size != image.size:
        image = image.resize(size, FILTERS[spec["interpolation"]])
    if spec["crop_size"]:
        crop_h, crop_w = spec["crop_size"] * 2 if len(spec["crop_size"]) == 1 else spec["crop_size"]
        top = int(round((image.height - crop_h) / 2.0))
        left = int(round((image.width - crop_w) / 2.0))
        image = image.crop((left, top, left + crop_w, top + crop_h))
    if spec.get("input_format") == "uint8-nhwc":
        return np.ascontiguousarray(np.asarray(image, dtype=np.uint8)[None])
    x = np.asarray(image, dtype=np.float32) / np.float32(255)
    x = (x - np.asarray(spec["mean"], dtype=np.float32)) / np.asarray(spec["std"], dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.dtype(spec["dtype"]))


def spatial(x: np.ndarray, spec: dict) -> list[int]:
    """(H, W) of an input as preprocess() made it."""
    return list(x.shape[1:3] if spec.get("input_format") == "uint8-nhwc" else x.shape[2:])


def _onnx_runtime(path: Path):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=ort.get_available_providers())
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def _tensorrt(path: Path, min_batch: int):
    import tensorrt as trt

    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        from cuda import cudart

    def check(result):
        if int(result[0]) != 0:
            raise RuntimeError(f"CUDA error {result[0]}")
        return result[1] if len(result) > 1 else None

    logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(logger).deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise RuntimeError(f"{path.name} does not load in TensorRT {trt.__version__}; rebuild it with build_engine.sh")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    (input_name,) = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    (output_name,) = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    to_device, to_host = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost

    def run(x: np.ndarray) -> np.ndarray:
        # an engine takes only batches inside its profile: feed the smallest, keep the first row
        x = np.ascontiguousarray(np.repeat(x, min_batch, axis=0))
        context.set_input_shape(input_name, x.shape)
        out = np.empty(tuple(context.get_tensor_shape(output_name)), dtype=np.float32)
        pointers = [check(cudart.cudaMalloc(a.nbytes)) for a in (x, out)]
        try:
            check(cudart.cudaMemcpy(pointers[0], x.ctypes.data, x.nbytes, to_device))
            context.set_tensor_address(input_name, int(pointers[0]))
            context.set_tensor_address(output_name, int(pointers[1]))
            if not context.execute_async_v3(0):
                raise RuntimeError("TensorRT execution failed")
            check(cudart.cudaDeviceSynchronize())
            check(cudart.cudaMemcpy(out.ctypes.data, pointers[1], out.nbytes, to_host))
        finally:
            for pointer in pointers:
                cudart.cudaFree(pointer)
        return out[:1]

    return run


def preferred_artifact(directory: Path, info: dict) -> dict:
    artifact = next((a for a in info["artifacts"] if a["format"] == "onnx"), None)
    if artifact is None:
        raise ValueError(f"{directory} lists no ONNX artifact; is it a jetson bundle?")
    return artifact


def load_runner(directory: Path, artifact: dict):
    """(description, runtime, run): the ONNX artifact, as an engine where one can run."""
    engine = artifact.get("engine")
    if engine and (directory / engine["file"]).is_file():
        try:
            run = _tensorrt(directory / engine["file"], engine["batch_profile"][0])
            return f"{engine['file']} (TensorRT)", "tensorrt", run
        except ImportError:
            pass  # no tensorrt / cuda-python on this host: ONNX Runtime below
    return f"{artifact['file']} (ONNX Runtime)", "onnxruntime", _onnx_runtime(directory / artifact["file"])


def shipped_module(directory: Path, file: str):
    """A numpy-only module the bundle ships (detection_decode.py, device_validate.py), loaded from it."""
    path = directory / file
    if not path.is_file():
        raise ValueError(f"{file} is missing from {directory}")
    spec = importlib.util.spec_from_file_location(Path(file).stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (SyntaxError, ImportError) as e:
        raise ValueError(f"{file} does not load: {e}") from None
    return module


def top5(logits: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    shifted = np.exp(logits - logits.max())
    probabilities = shifted / shifted.sum()
    return [(labels[i], float(probabilities[i])) for i in np.argsort(-logits)[:5]]


def palette(count: int) -> np.ndarray:
    """Pascal VOC's colours: the bits of the class index, three at a time, fill red, green and blue
    from their top bit down (1 dark red, 2 green, 3 olive, ..., 15 pink)."""
    colours = np.zeros((count, 3), dtype=np.uint8)
    for index in range(count):
        value, bit = index, 7
        while value:
            for channel in range(3):
                colours[index, channel] |= ((value >> channel) & 1) << bit
            value, bit = value >> 3, bit - 1
    return colours


def overlay(image: Image.Image, mask: np.ndarray, labels: list[str]) -> Image.Image:
    """The mask in palette colours blended over the image, at the image's size (the mask is scaled
    to it, nearest neighbour, pixel centre to pixel centre); background pixels keep the image."""
    image = image.convert("RGB")
    rows = ((np.arange(image.height) + 0.5) * mask.shape[0] / image.height).astype(np.intp)
    cols = ((np.arange(image.width) + 0.5) * mask.shape[1] / image.width).astype(np.intp)
    scaled = mask[rows[:, None], cols[None, :]]
    painted = np.array([label not in BACKGROUND for label in labels])[scaled][..., None]
    pixels = np.asarray(image, dtype=np.float32)
    blended = (1 - OVERLAY_ALPHA) * pixels + OVERLAY_ALPHA * palette(len(labels))[scaled]
    return Image.fromarray(np.where(painted, blended, pixels).round().astype(np.uint8))


def segment(logits: np.ndarray, labels: list[str]) -> tuple[np.ndarray, list[tuple[str, float]]]:
    """(mask H x W, (label, fraction of pixels) for every class present, most pixels first) from C x H x W logits."""
    if logits.ndim != 3 or logits.shape[0] != len(labels):
        raise ValueError(
            f"model outputs {logits.shape} per image; a segmentation bundle with {len(labels)} labels "
            f"needs {len(labels)} x H x W"
        )
    mask = logits.argmax(0)
    counts = np.bincount(mask.ravel(), minlength=len(labels))
    return mask, [(labels[i], counts[i] / mask.size) for i in np.argsort(-counts, kind="stable") if counts[i]]


class Detector:
    """Raw detector heads (anchors x (4 box values [+ centerness] + C class logits)), or final rows (a two-stage
    graph, or the decode inside the graph: task.decode.anchors is null), -> boxes, with the bundle's own detection_decode.py, anchors and
    task.decode parameters, as the build decoded eager's and every artifact's outputs."""

    def __init__(self, directory: Path, task: dict):
        decode = task["decode"]
        self.code = shipped_module(directory, decode["code"])
        self.anchors = None if decode["anchors"] is None else np.load(directory / decode["anchors"])
        self.params = {key: value for key, value in decode.items() if key not in DECODE_FILES}
        self.match_score = decode["match_score"]
        self.input_size = tuple(task["input_size"])  # (h, w): boxes come out in these pixels

    def check(self, head: np.ndarray, classes: int) -> None:
        """A model output the bundle's decode cannot read (another model's, or labels.txt of another class count)."""
        if self.anchors is None:  # final detections, the decode inside the graph
            rows, width, what = head.shape[0], 6, "x0, y0, x1, y1, score, label per detection"
        else:
            box = 5 if self.params["kind"] == "fcos" else 4
            rows, width = len(self.anchors), box + classes
            what = f"{len(self.anchors)} anchors x ({box} box values + {classes} class logits, labels.txt)"
        if head.shape != (rows, width):
            raise ValueError(f"model outputs {head.shape} per image; the bundle says {what}")

    def __call__(self, head: np.ndarray) -> dict:
        if self.anchors is not None and len(head) != len(self.anchors):
            raise ValueError(f"model outputs {head.shape} per image; the bundle has {len(self.anchors)} anchors")
        return self.code.decode(head, self.anchors, self.input_size, self.params)

    def shown(self, head: np.ndarray, width: int, height: int) -> list[tuple[int, float, list[float]]]:
        """(class index, score, [x0, y0, x1, y1] in pixels of a width x height image) of each object scoring
        at least match_score, best first."""
        found = self(head)
        scale = np.array([width, height, width, height], dtype=np.float64) / np.array(self.input_size[::-1] * 2)
        return [
            (int(label), float(score), (box * scale).tolist())
            for box, score, label in zip(found["boxes"].astype(np.float64), found["scores"], found["labels"])
            if score >= self.match_score
        ]


def draw_boxes(image: Image.Image, found: list[tuple[int, float, list[float]]], labels: list[str]) -> Image.Image:
    """The boxes over the image, each in its class's palette colour, named and scored at its top left."""
    image = image.convert("RGB")
    draw = ImageDraw.Draw(image)
    colours = palette(len(labels))
    width = max(2, round(max(image.size) / 320))
    for label, score, (x0, y0, x1, y1) in found:
        colour = tuple(int(v) for v in colours[label])
        draw.rectangle([x0, y0, x1, y1], outline=colour, width=width)
        draw.text(
            (x0 + width + 1, y0 + width),
            f"{labels[label]} {score:.2f}",
            fill=(255, 255, 255),
            stroke_width=1,
            stroke_fill=colour,
        )
    return image


def golden(directory: Path, info: dict, artifact: dict, runtime: str, run) -> int:
    """The golden inputs through `run`, judged by the bundle's device_validate.py as the device kit judges them."""
    validator = (info.get("device_kit") or {}).get("validator")
    if validator is None:
        raise ValueError("bundle.json names no device_kit.validator; bundle the build with this exporter")
    kit = shipped_module(directory, validator)
    try:
        reference = kit.read_golden(directory)
    except kit.BadInput as e:
        raise ValueError(str(e)) from None
    # the golden inputs as the artifact takes them (a uint8-nhwc one: golden/inputs_uint8.npy)
    inputs = reference.fed(artifact) if hasattr(reference, "fed") else reference.inputs
    outputs = [run(np.ascontiguousarray(x[None]))[0] for x in inputs]
    if outputs[0].shape != reference.logits.shape[1:]:
        raise ValueError(
            f"the model outputs {outputs[0].shape} per input, the golden eager logits are {reference.logits.shape[1:]}"
        )
    result = kit.judge(reference, artifact, outputs, runtime)
    print(kit.summary(result))
    return 0 if result["status"] == "passed" else 1


def _overlay_paths(target: Path | None, images: list[Path]) -> list[Path | None]:
    """--overlay is the PNG itself for one image, a directory of IMAGE_STEM.png for several."""
    if target is None:
        return [None] * len(images)
    if len(images) == 1:
        return [target]
    stems = [image.stem for image in images]
    if len(set(stems)) < len(stems):
        raise ValueError("two IMAGEs share a file name stem; their overlays would overwrite each other")
    return [target / f"{stem}.png" for stem in stems]


def _print_classes(path: Path, x: np.ndarray, run, labels: list[str]) -> None:
    print(path)
    for label, probability in top5(run(x)[0], labels):
        print(f"  {probability:7.2%}  {label}")


def _print_segments(path: Path, image: Image.Image, x: np.ndarray, run, labels: list[str], target: Path | None) -> None:
    mask, fractions = segment(run(x)[0], labels)
    print(path)
    for label, fraction in fractions:
        print(f"  {fraction:7.2%}  {label}")
    if target is not None:
        _save(overlay(image, mask, labels), target)


def _save(image: Image.Image, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        image.save(target, format="PNG")
    except OSError as e:
        raise ValueError(f"cannot write {target}: {e}") from None
    print(f"  overlay: {target}")


def _print_detections(
    path: Path, image: Image.Image, x: np.ndarray, run, labels: list[str], detector: Detector, target: Path | None
) -> None:
    head = run(x)[0]
    detector.check(head, len(labels))
    found = detector.shown(head, image.width, image.height)
    print(path)
    for label, score, box in found:
        print(f"  {score:7.2%}  {labels[label]}  [{', '.join(f'{v:.1f}' for v in box)}]")
    if not found:
        print(f"  nothing scores >= {detector.match_score:g}")
    if target is not None:
        _save(draw_boxes(image, found, labels), target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="a jetson bundle directory (exporter bundle OUT_DIR)")
    parser.add_argument("images", nargs="*", type=Path)
    parser.add_argument("--golden", action="store_true", help="check the golden inputs instead of running on images")
    parser.add_argument(
        "--overlay",
        type=Path,
        metavar="PNG",
        help="segmentation: write the mask over the image here, detection: the boxes (a directory when several IMAGEs)",
    )
    args = parser.parse_args(argv)
    if not args.golden and not args.images:
        parser.error("give IMAGE files or --golden")
    try:
        info, labels, spec = load_bundle(args.bundle)
        task = task_of(info)
        artifact = preferred_artifact(args.bundle, info)
        detector = Detector(args.bundle, task) if task["name"] == DETECTION else None
        description, runtime, run = load_runner(args.bundle, artifact)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.bundle} is not a usable bundle: {e}", file=sys.stderr)
        return 2
    try:
        if args.overlay is not None and task["name"] == CLASSIFICATION:
            raise ValueError(
                f"--overlay draws a segmentation mask or detected boxes; {args.bundle} is a {task['name']} bundle"
            )
        overlays = _overlay_paths(args.overlay, args.images)
        print(f"model: {description}")
        if args.golden:
            return golden(args.bundle, info, artifact, runtime, run)
        for path, target in zip(args.images, overlays):
            try:
                with Image.open(path) as image:
                    image.load()
            except OSError as e:
                raise ValueError(f"cannot read {path}: {e}") from None
            x = preprocess(image, spec)
            size = task.get("input_size")
            if size is not None and spatial(x, spec) != list(size):
                made = "x".join(str(s) for s in spatial(x, spec))
                raise ValueError(f"preprocessing.json makes a {made} input; the model takes {size[0]}x{size[1]}")
            if task["name"] == DETECTION:
                _print_detections(path, image, x, run, labels, detector, target)
            elif task["name"] == SEGMENTATION:
                _print_segments(path, image, x, run, labels, target)
            else:
                _print_classes(path, x, run, labels)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
