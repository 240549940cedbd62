"""Explicit Q/DQ int8 ONNX as TensorRT takes it, through ONNX Runtime's static quantizer.

TensorRT's rules: symmetric signed int8 with zero point 0, per-channel weights on the output-channel axis,
Q/DQ on the inputs of the layers it fuses (Conv, Gemm, and MatMul with a weight: a Linear on a 3-D input, as in
every transformer block, exports as MatMul + Add), bias left float for TensorRT. A layer kept in float gets no
Q/DQ on its weights or its input, even where the tensor it reads also feeds a quantized layer. A MatMul of two
activations (attention scores) stays float.

Activation ranges: "mse" picks each layer input's clipping range by least squared error, the
objective of PT2E's HistogramObserver, measured on the eager model (a Conv's input in the ONNX graph
is the same tensor as its module's input) and handed to ONNX Runtime as range overrides.
"percentile" and "minmax" are ONNX Runtime's own calibrators. "auto" (the default) tries all three
and the search keeps whichever does best on the held-out calibration images: no one method won on
every model measured. ONNX Runtime's "entropy" calibrator is not offered:
quantize_static runs it with 128 histogram bins and 128 quantized bins, which leaves one candidate
threshold, the maximum (the scales came out identical to MinMax on the digits model)."""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch

from .calibration import ONNX_CALIBRATIONS
from .search import CandidateFailed
from .sensitivity import activation_scales

QUANTIZED_OPS = ("Conv", "Gemm", "MatMul")
DATA_MOVEMENT = {
    "Reshape",
    "Transpose",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Concat",
    "Slice",
    "Gather",
    "Shape",
    "Constant",
    "Identity",
    "Split",
    "Expand",
    "Cast",
    "QuantizeLinear",
    "DequantizeLinear",
    "Pad",
}


class QdqCandidate:
    """A quantized ONNX file and an ONNX Runtime session on it (the candidate is the artifact itself)."""

    def __init__(self, path: Path, input_name: str):
        import onnxruntime as ort

        self.path, self.input_name = path, input_name
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException

        try:
            return torch.from_numpy(self.session.run(None, {self.input_name: x.contiguous().numpy()})[0])
        except (Fail, RuntimeException) as error:
            raise CandidateFailed(f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}") from error


class OnnxQdqBackend:
    op_fallbacks = ()  # Q/DQ goes on layer inputs only: adds and the other elementwise ops are float already
    settings = ("onnx_calibration",)

    def __init__(
        self,
        model: torch.nn.Module,
        fp32_path: Path,
        input_name: str,
        method: str = "auto",
        workdir: Path | None = None,
        external_data: bool = False,
    ):
        import onnx

        if method not in ONNX_CALIBRATIONS:
            raise ValueError(f"unknown ONNX calibration {method!r}; choose from {', '.join(ONNX_CALIBRATIONS)}")
        self.model, self.fp32_path, self.input_name = model, Path(fp32_path), input_name
        # a graph with its tensors in external data (over 2 GiB): so are the calibration copy and every candidate
        self.external_data = external_data
        self.range_methods = ("mse", "minmax", "percentile") if method == "auto" else (method,)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="qdq-"))
        self._attempts = 0
        self._files: dict[tuple, Path] = {}  # (float layers, method) -> its quantized file: made once
        self._overrides: dict | None = None
        graph = onnx.load(str(fp32_path), load_external_data=False).graph
        initializers = {i.name: i for i in graph.initializer}
        # the dynamo exporter names each Conv/Gemm weight after its parameter ("features.0.0.weight"), which
        # ties an ONNX node to the module path the sensitivity analysis and the ranges use; a MatMul's weight is
        # the Linear's transposed weight under a generated name, found by its values
        # layer -> its nodes (name, input tensor): a module called more than once (a detector's head on every FPN
        # level, Faster R-CNN's RPN head) is one node per call, all on the same weight
        self._nodes: dict[str, list[tuple[str, str]]] = {}
        self._unmapped: list[str] = []  # nodes that are no layer's: left float
        linears = _linear_weights(model)
        modules = dict(model.named_modules())
        for node in graph.node:
            weight = node.input[1] if len(node.input) > 1 else None
            if node.op_type in ("Conv", "Gemm") and weight in initializers:
                layer = weight.removesuffix(".weight")
                if layer in modules:
                    self._nodes.setdefault(layer, []).append((node.name, node.input[0]))
                else:  # a weight the exporter made (a BatchNorm it folded, onnx::Conv_<n>): no module to rank it by
                    self._unmapped.append(node.name)
            elif node.op_type == "MatMul":
                layer = _linear_of(initializers.get(weight), linears, self.fp32_path.parent)
                if layer is None:
                    self._unmapped.append(node.name)
                else:
                    self._nodes.setdefault(layer, []).append((node.name, node.input[0]))

    def layers(self) -> list[str]:
        return list(self._nodes)

    def float_closure(self, float_layers: list[str]) -> list[str]:
        return list(float_layers)

    def float_ops(self, float_layers: list[str]) -> dict[str, int]:
        """ONNX ops, by type, without Q/DQ on their inputs: everything but the Conv/Gemm/MatMul layers quantized
        (TensorRT may still fuse some of them, e.g. a Relu, into an int8 kernel)."""
        import onnx

        excluded = self._node_names(float_layers)
        quantized = self._node_names(self._nodes) - excluded
        counts: dict[str, int] = {}
        for node in onnx.load(str(self.fp32_path), load_external_data=False).graph.node:
            if node.op_type in DATA_MOVEMENT or node.name in quantized:
                continue
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def _node_names(self, layers) -> set[str]:
        return {node for name in layers for node, _ in self._nodes[name]}

    @staticmethod
    def describe(method: str) -> str:
        return (
            f"{method} activation ranges, symmetric int8 activations, per-channel symmetric weights, "
            "Q/DQ on Conv/Gemm inputs (ONNX Runtime quantize_static)"
        )

    def _range_overrides(self, method: str, range_images: list[torch.Tensor]) -> dict:
        if method != "mse":
            return {}
        if self._overrides is None:
            scales = activation_scales(self.model, self.layers(), torch.cat(range_images))
            self._overrides = {}
            for layer, nodes in self._nodes.items():
                if layer in scales:
                    limit = np.float32(scales[layer].item() * 127)
                    for _, tensor in nodes:
                        self._overrides[tensor] = [{"rmin": -limit, "rmax": limit}]
        return self._overrides

    def quantize(self, float_layers: list[str], range_images: list[torch.Tensor], method: str) -> QdqCandidate:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        input_name = self.input_name
        key = (tuple(float_layers), method)
        if key in self._files:
            return QdqCandidate(self._files[key], input_name)

        class Batches(CalibrationDataReader):
            """The range images, a window at a time (CalibStridedMinMax calls set_range for each)."""

            def __init__(self):
                self.set_range(0, len(range_images))

            def __len__(self):
                return len(range_images)

            def set_range(self, start_index: int, end_index: int):
                self.batches = iter(range_images[start_index:end_index])

            def get_next(self):
                x = next(self.batches, None)
                return None if x is None else {input_name: np.ascontiguousarray(x.numpy())}

        self._attempts += 1
        path = self.workdir / f"attempt{self._attempts}.onnx"
        excluded = self._node_names(float_layers) | set(self._unmapped)
        # Q/DQ on the inputs only: ONNX Runtime also quantizes each Conv/Gemm output by default, which
        # put the logits through int8 and kept an outlier tensor quantized after its consumer went float
        extra = {
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OPS),
            "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},  # a (in, out) weight: out is axis 1
            "TensorQuantOverrides": self._range_overrides(method, range_images),
            # one image's tensors at a time: the percentile calibrator otherwise holds every calibrated
            # tensor of every image at once (MViT-V2-S, 8 clips of 16x224²: past 14 GB); its histograms
            # and min/max ranges merge across the windows
            "CalibStridedMinMax": 1,
            "QuantizeBias": False,
        }  # TensorRT takes a float bias and fuses it; an int32 one it refused
        if method == "percentile":
            extra["CalibTensorRangeSymmetric"] = True
        with _quiet_quantizer():
            quantize_static(
                str(self.fp32_path),
                str(path),
                Batches(),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=list(QUANTIZED_OPS),
                nodes_to_exclude=sorted(excluded),
                extra_options=extra,
                calibrate_method=CalibrationMethod.Percentile if method == "percentile" else CalibrationMethod.MinMax,
                use_external_data_format=self.external_data,
            )
        _float_inputs_for(path, excluded)
        self._files[key] = path
        return QdqCandidate(path, input_name)


def _float_inputs_for(path: Path, nodes: set[str]) -> None:
    """Give the excluded `nodes` their float inputs back. ONNX Runtime leaves an excluded node's input quantized
    when the same tensor also feeds a quantized one (a ResNet block's conv1 and its downsample, Inception's
    branches): the layer kept in float then still reads int8, and the fallback cannot fix a range problem
    (measured on a toy with an outlier channel feeding two convs: 12.0 dB with one kept "float", 48.3 dB with
    its input float). The Q/DQ pairs left without a consumer are removed."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    changed = False
    for node in graph.node:
        if node.name not in nodes:
            continue
        for i, tensor in enumerate(node.input):
            dq = producer.get(tensor)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[i] = q.input[0]
                changed = True
    if not changed:
        return
    while True:  # drop Q/DQ nodes nothing reads any more (a DQ first, then the Q that fed only it)
        used = {t for node in graph.node for t in node.input} | {o.name for o in graph.output}
        dead = [
            n for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.output[0] not in used
        ]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    onnx.save(model, str(path))


def _linear_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Each Linear layer's weight as a MatMul holds it: transposed, (in, out)."""
    return {name: m.weight.detach().numpy().T for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _linear_of(initializer, linears: dict[str, np.ndarray], base_dir: Path) -> str | None:
    if initializer is None or len(initializer.dims) != 2:
        return None
    from onnx import numpy_helper

    shapes = {w.shape for w in linears.values()}
    if tuple(initializer.dims) not in shapes:
        return None
    values = numpy_helper.to_array(initializer, base_dir=str(base_dir))  # external data is read from base_dir
    for name, weight in linears.items():
        if weight.shape == values.shape and np.array_equal(weight, values):
            return name
    return None


@contextlib.contextmanager
def _quiet_quantizer():
    """ONNX Runtime's calibrators print their histogram settings to stdout (which carries the manifest
    under --json) and warn on the root logger about pre-processing we deliberately skip."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)
