"""TensorRT engine (.engine) built from the ONNX of the same precision, on this host's GPU.

An engine only runs on the GPU model and TensorRT version that built it, so a Jetson builds its own
from the shipped ONNX (build_engine.sh); this format builds one only where `tensorrt` and a CUDA GPU
are present. TensorRT 11 networks are always strongly typed and it has no precision flags: the fp16
and Q/DQ graphs carry their types. TensorRT 10 parses them weakly typed with BuilderFlag.FP16, or
BuilderFlag.INT8 (explicit quantization from the Q/DQ nodes, no calibrator).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import files
from ..errors import UsageError
from ..precision import Precision
from . import RuntimeUnavailable
from . import onnx as onnx_format
from .interface import Format

DEFAULT_WORKSPACE_MB = 1024
TIMING_CACHE = "tensorrt_timing.cache"  # beside the engines: later builds on the same GPU reuse the tactic timings


def _major(trt) -> int:
    return int(trt.__version__.split(".")[0])


def _unavailable(dla_core) -> str | None:
    try:
        import tensorrt as trt
    except ImportError:
        return "the tensorrt package is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if dla_core is not None:
        cores = trt.Builder(trt.Logger(trt.Logger.ERROR)).num_DLA_cores
        if dla_core >= cores:
            return f"DLA core {dla_core} requested, this device has {cores} DLA core(s)"
    return None


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _configure(trt, builder, network, precision: str, sizes, workspace_mb: int, dla_core) -> tuple:
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    flags = []
    if precision == Precision.FP32:
        # fp32 means fp32: TF32 (on by default) rounds conv/matmul inputs to 10-bit mantissas
        config.clear_flag(trt.BuilderFlag.TF32)
    elif _major(trt) < 11:
        flags.append("FP16" if precision == Precision.FP16 else "INT8")
    if dla_core is not None:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = dla_core
        flags.append("GPU_FALLBACK")
    for flag in flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    profile = builder.create_optimization_profile()
    chw = tuple(network.get_input(0).shape)[1:]
    profile.set_shape(onnx_format.INPUT, *[(n, *chw) for n in sizes])
    config.add_optimization_profile(profile)
    return config, flags


def _build(
    trt, onnx_path: Path, precision: str, sizes, workspace_mb: int, dla_core, cache_path: Path
) -> tuple[bytes, dict]:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = _major(trt) >= 11
    creation = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(creation)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise RuntimeError("ONNX parser: " + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config, flags = _configure(trt, builder, network, precision, sizes, workspace_mb, dla_core)
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    if not config.set_timing_cache(cache, False):  # a cache from another GPU or TensorRT version is refused
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT could not build the engine (its log above says why)")
    with files.atomic_path(cache_path) as tmp:
        tmp.write_bytes(bytes(cache.serialize()))
    return bytes(serialized), {
        "typing": "strong" if strongly_typed else "weak",
        "builder_flags": flags,
        "tf32": precision != Precision.FP32,
        "timing_cache": cache_path.name,
    }


class TensorRTFormat(Format):
    """A TensorRT engine built from the ONNX export of the same precision, where a CUDA GPU and tensorrt are:
    preflight (the ONNX options and the engine's), export and load."""

    name, suffix = "tensorrt", ".engine"
    precisions = (Precision.FP32, Precision.FP16, Precision.INT8)
    options = ("opset", "batch", "workspace_mb", "dla_core", "require_engine", "exporter")

    def preflight(
        self,
        precision,
        opset=onnx_format.DEFAULT_OPSET,
        batch=onnx_format.DEFAULT_BATCH,
        workspace_mb=DEFAULT_WORKSPACE_MB,
        dla_core=None,
        require_engine=False,
        exporter="dynamo",
    ) -> None:
        onnx_format.FORMAT.preflight(precision, opset, batch, exporter=exporter)
        _check_int("workspace_mb", workspace_mb, 1)
        if dla_core is not None:
            _check_int("dla_core", dla_core, 0)
        reason = _unavailable(dla_core)
        if reason and require_engine:
            raise UsageError(f"--require-engine: no TensorRT engine can be built on this host: {reason}")
        if reason:
            raise RuntimeUnavailable(reason)

    def export(
        self,
        model,
        example,
        precision,
        calib,
        path: Path,
        meta: dict,
        opset=onnx_format.DEFAULT_OPSET,
        batch=onnx_format.DEFAULT_BATCH,
        workspace_mb=DEFAULT_WORKSPACE_MB,
        dla_core=None,
        require_engine=False,
        exporter="dynamo",
    ) -> dict:
        reason = _unavailable(dla_core)  # require_engine was settled by preflight
        if reason:
            raise RuntimeUnavailable(reason)
        import tensorrt as trt

        sizes = onnx_format.batch_profile(batch)
        onnx_path = path.with_name(path.name + ".onnx")
        try:
            onnx_details = onnx_format.FORMAT.export(
                model, example, precision, calib, onnx_path, meta, opset=opset, batch=batch, exporter=exporter
            )
            engine, build = _build(trt, onnx_path, precision, sizes, workspace_mb, dla_core, path.parent / TIMING_CACHE)
        finally:
            for temporary in (onnx_path, *files.companions(onnx_path)):  # with its external data, if it has any
                temporary.unlink(missing_ok=True)
        path.write_bytes(engine)
        major, minor = torch.cuda.get_device_capability()
        return {
            "tensorrt": trt.__version__,
            "gpu": torch.cuda.get_device_name(),
            "compute_capability": f"{major}.{minor}",
            "batch_profile": list(sizes),
            "workspace_mb": workspace_mb,
            "dla_core": dla_core,
            **build,
            "onnx": {k: onnx_details[k] for k in ("opset", "graph", "ops")},
            "portable": False,
        }

    def load(self, path: Path, threads: int):
        reason = _unavailable(None)
        if reason:
            raise RuntimeUnavailable(reason)
        import tensorrt as trt

        engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(Path(path).read_bytes())
        if engine is None:
            raise RuntimeError(
                f"TensorRT {trt.__version__} cannot deserialize {path} (built by another version or GPU?)"
            )
        context = engine.create_execution_context()
        smallest = engine.get_tensor_profile_shape(onnx_format.INPUT, 0)[0][0]

        def run(x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            # validation feeds batch 1; a profile starting above it gets the sample repeated, first rows kept
            dtype = torch.uint8 if x.dtype == torch.uint8 else torch.float32  # a uint8-nhwc engine takes the pixels
            x = torch.cat([x, x[:1].expand(max(0, smallest - n), *x.shape[1:])]).to("cuda", dtype).contiguous()
            context.set_input_shape(onnx_format.INPUT, tuple(x.shape))
            out = torch.empty(tuple(context.get_tensor_shape(onnx_format.OUTPUT)), dtype=torch.float32, device="cuda")
            context.set_tensor_address(onnx_format.INPUT, x.data_ptr())
            context.set_tensor_address(onnx_format.OUTPUT, out.data_ptr())
            stream = torch.cuda.current_stream()
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
            stream.synchronize()
            return out[:n].cpu()

        return run


FORMAT = TensorRTFormat()
