"""Reference Jetson app for an exporter bundle: classify images, or check the golden inputs.

    python app.py BUNDLE_DIR IMAGE...     top-5 classes per image
    python app.py BUNDLE_DIR --golden     golden inputs against the golden eager logits (top-1 agreement)

Runs the first ONNX artifact bundle.json lists (its order is the preferred one) as a TensorRT engine
when tensorrt and cuda-python are installed and build_engine.sh has built the engine, else in ONNX
Runtime. Needs numpy and pillow; never torch. Exit codes: 0 done (--golden: every top-1 agrees),
1 a golden top-1 disagrees, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

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


def load_bundle(directory: Path) -> tuple[dict, list[str], dict]:
    info = json.loads((directory / "bundle.json").read_text(encoding="utf-8"))
    labels = (directory / info["labels"]).read_text(encoding="utf-8").splitlines()
    spec = json.loads((directory / info["preprocessing"]).read_text(encoding="utf-8"))
    return info, labels, spec


def _resized_size(width: int, height: int, resize: list[int]) -> tuple[int, int]:
    """torchvision's resize: one number sets the shorter side (the longer one is truncated), two are (h, w)."""
    if len(resize) == 2:
        return resize[1], resize[0]
    short, long = sorted((width, height))
    new_short, new_long = resize[0], int(resize[0] * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def preprocess(image: Image.Image, spec: dict) -> np.ndarray:
    """What the weight's transforms() does to a PIL image: resize, center crop, [0, 1], normalize; NCHW float32."""
    image = image.convert("RGB")
    size = _resized_size(*image.size, spec["resize_size"])
    if size != image.size:
        image = image.resize(size, FILTERS[spec["interpolation"]])
    crop_h, crop_w = spec["crop_size"] * 2 if len(spec["crop_size"]) == 1 else spec["crop_size"]
    top = int(round((image.height - crop_h) / 2.0))
    left = int(round((image.width - crop_w) / 2.0))
    image = image.crop((left, top, left + crop_w, top + crop_h))
    x = np.asarray(image, dtype=np.float32) / np.float32(255)
    x = (x - np.asarray(spec["mean"], dtype=np.float32)) / np.asarray(spec["std"], dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.dtype(spec["dtype"]))


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


def load_runner(directory: Path, info: dict):
    """(description, run): the bundle's preferred ONNX artifact, as an engine where one can run."""
    artifact = next((a for a in info["artifacts"] if a["format"] == "onnx"), None)
    if artifact is None:
        raise ValueError(f"{directory} lists no ONNX artifact; is it a jetson bundle?")
    engine = artifact.get("engine")
    if engine and (directory / engine["file"]).is_file():
        try:
            run = _tensorrt(directory / engine["file"], engine["batch_profile"][0])
            return f"{engine['file']} (TensorRT)", run
        except ImportError:
            pass  # no tensorrt / cuda-python on this host: ONNX Runtime below
    return f"{artifact['file']} (ONNX Runtime)", _onnx_runtime(directory / artifact["file"])


def top5(logits: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    shifted = np.exp(logits - logits.max())
    probabilities = shifted / shifted.sum()
    return [(labels[i], float(probabilities[i])) for i in np.argsort(-logits)[:5]]


def golden(directory: Path, info: dict, run) -> int:
    inputs = np.load(directory / info["golden"]["inputs"])
    reference = np.load(directory / info["golden"]["eager_logits"])
    outputs = np.concatenate([run(np.ascontiguousarray(x[None])) for x in inputs])
    agree = outputs.argmax(1) == reference.argmax(1)
    print(f"golden top-1 agreement: {int(agree.sum())}/{len(agree)}")
    return 0 if agree.all() else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="a jetson bundle directory (exporter bundle OUT_DIR)")
    parser.add_argument("images", nargs="*", type=Path)
    parser.add_argument("--golden", action="store_true", help="check the golden inputs instead of classifying images")
    args = parser.parse_args(argv)
    if not args.golden and not args.images:
        parser.error("give IMAGE files or --golden")
    try:
        info, labels, spec = load_bundle(args.bundle)
        description, run = load_runner(args.bundle, info)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.bundle} is not a usable bundle: {e}", file=sys.stderr)
        return 2
    print(f"model: {description}")
    if args.golden:
        return golden(args.bundle, info, run)
    for path in args.images:
        try:
            with Image.open(path) as image:
                x = preprocess(image, spec)
        except OSError as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 2
        print(path)
        for label, probability in top5(run(x)[0], labels):
            print(f"  {probability:7.2%}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
