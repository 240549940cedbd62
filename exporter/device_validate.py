"""On-device check of an exporter Jetson build: golden inputs through each ONNX (as a TensorRT engine,
or in ONNX Runtime when tensorrt is missing) against the golden eager logits.

Standalone on purpose: needs numpy plus tensorrt (and cuda-python) or onnxruntime, never torch or the
exporter package. Copied into the build directory, so on the device:

    python3 device_validate.py BUILD_DIR [--runtime auto|tensorrt|onnxruntime]

Exit codes: 0 every artifact within its thresholds; 1 a threshold broken; 2 bad input (corrupted ONNX,
golden files that do not fit the model, no runtime), with one line on stderr.
The metrics are those of exporter/validation.py. accuracy_drop is not checked: a handful of golden
images cannot resolve a 1-point accuracy change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np

INPUT, OUTPUT = "input", "logits"
MIN_KEYS = ("top1_agreement", "top5_agreement", "psnr_db", "cosine")
MAX_KEYS = ("max_abs_error",)


class BadInput(Exception):
    """Exit 2: the build directory, its files or this host cannot be validated at all."""


def fidelity(ref: np.ndarray, out: np.ndarray) -> dict:
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
        "psnr_db": math.inf if rmse == 0 else 20 * math.log10(peak / rmse),
        "cosine": float(np.mean(np.sum(ref * out, axis=1) / norms)),
        "max_abs_error": float(np.abs(diff).max()),
    }


def breaches(metrics: dict, thresholds: dict) -> list[str]:
    reasons = []
    for key, limit in thresholds.items():
        if key in MIN_KEYS and metrics[key] < limit:
            reasons.append(f"{key} {metrics[key]:.4g} (needs >= {limit:g})")
        elif key in MAX_KEYS and metrics[key] > limit:
            reasons.append(f"{key} {metrics[key]:.4g} (needs <= {limit:g})")
    return reasons


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_build(directory: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    try:
        doc = json.loads((directory / "manifest.json").read_text())
        inputs = np.load(directory / "golden" / "inputs.npy")
        logits = np.load(directory / "golden" / "eager_logits.npy")
    except (OSError, ValueError) as e:
        raise BadInput(f"{directory} is not a readable exporter build: {e}") from None
    if inputs.ndim != 4 or logits.ndim != 2 or len(inputs) != len(logits):
        raise BadInput(f"golden files do not pair up: inputs {inputs.shape}, eager logits {logits.shape}")
    return doc, inputs.astype(np.float32), logits


def _ort_runner(path: Path):
    try:
        import onnxruntime as ort
    except ImportError:
        raise BadInput("neither tensorrt nor onnxruntime is installed") from None
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types for unreadable models
        raise BadInput(f"corrupted ONNX {path.name}: {(str(e).strip().splitlines() or [''])[0][:200]}") from None
    return lambda x: session.run(None, {INPUT: x})[0]


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


def _trt_runner(onnx_path: Path, engine_path: Path, precision: str, batch):
    import tensorrt as trt

    cudart = _cuda()
    logger = trt.Logger(trt.Logger.WARNING)
    if not engine_path.is_file():
        engine_path.write_bytes(_build_engine(trt, logger, onnx_path, precision, batch))
    engine = trt.Runtime(logger).deserialize_cuda_engine(engine_path.read_bytes())
    if engine is None:
        raise BadInput(f"{engine_path.name} does not load in TensorRT {trt.__version__}; delete it and run again to rebuild")
    context = engine.create_execution_context()

    def run(x: np.ndarray) -> np.ndarray:
        context.set_input_shape(INPUT, x.shape)
        out = np.empty(tuple(context.get_tensor_shape(OUTPUT)), dtype=np.float32)
        pointers = [_check(cudart.cudaMalloc(a.nbytes)) for a in (x, out)]
        try:
            _check(cudart.cudaMemcpy(pointers[0], x.ctypes.data, x.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))
            context.set_tensor_address(INPUT, int(pointers[0]))
            context.set_tensor_address(OUTPUT, int(pointers[1]))
            if not context.execute_async_v3(0):
                raise RuntimeError("TensorRT execution failed")
            _check(cudart.cudaDeviceSynchronize())
            _check(cudart.cudaMemcpy(out.ctypes.data, pointers[1], out.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
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


def validate(directory, runtime: str = "auto") -> list[dict]:
    directory = Path(directory)
    doc, inputs, logits = _read_build(directory)
    runtime = _pick_runtime(runtime)
    engines = {e["precision"]: e for e in doc.get("jetson", {}).get("engines", [])}
    results = []
    for entry in (a for a in doc["artifacts"] if a["format"] == "onnx" and a.get("path")):
        path = directory / entry["path"]
        if not path.is_file() or _sha256(path) != entry["sha256"]:
            raise BadInput(f"corrupted ONNX {entry['path']}: missing or not matching its sha256 in manifest.json")
        kit = engines.get(entry["precision"], {})
        batch = kit.get("options", {}).get("batch", [1, 1, 1])
        if runtime == "tensorrt":
            run = _trt_runner(path, directory / kit.get("engine", path.stem + ".engine"), entry["precision"], batch)
        else:
            run = _ort_runner(path)
        outputs = []
        for x in inputs:
            # the engine only takes batches inside its profile: feed MIN copies, keep the first row
            out = np.asarray(run(np.ascontiguousarray(np.repeat(x[None], batch[0], axis=0))))
            if out.ndim != 2 or out.shape[1] != logits.shape[1]:
                raise BadInput(f"golden eager_logits.npy has shape {logits.shape} but {entry['path']} outputs {out.shape}")
            outputs.append(out[:1])
        metrics = fidelity(logits, np.concatenate(outputs))
        thresholds = {k: v for k, v in entry.get("thresholds", {}).items() if k != "accuracy_drop"}
        reasons = breaches(metrics, thresholds)
        results.append({"name": entry["name"], "path": entry["path"], "runtime": runtime, "fidelity": metrics,
                        "thresholds": thresholds, "reasons": reasons, "status": "failed" if reasons else "passed"})
    if not results:
        raise BadInput(f"{directory} lists no ONNX artifact to validate")
    return results


def summary(result: dict) -> str:
    f = result["fidelity"]
    line = (f"{result['status'].upper()} {result['name']} ({result['runtime']}, {f['samples']} golden inputs): "
            f"top1 {f['top1_agreement']:.3f}, psnr {f['psnr_db']:.1f} dB, cosine {f['cosine']:.6f}, max abs {f['max_abs_error']:.3g}")
    return line + ("" if not result["reasons"] else "; " + "; ".join(result["reasons"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=Path(__file__).resolve().parent, type=Path)
    parser.add_argument("--runtime", choices=("auto", "tensorrt", "onnxruntime"), default="auto")
    args = parser.parse_args(argv)
    try:
        results = validate(args.directory, args.runtime)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for result in results:
        print(summary(result))
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
