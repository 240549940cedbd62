"""LiteRT (TensorFlow Lite) flatbuffer (.tflite) from litert-torch, run by ai-edge-litert's interpreter (XNNPACK
delegate, as on Android), fp32 or int8 (PT2E static, through exporter.quant's shared budget search); fp16, dynamic
int8 and w8a16 are the fp32 file rewritten by ai-edge-quantizer's recipes (RECIPES; docs/precisions.md).

fp32: `litert_torch.convert(model, (example,))`, which exports with torch.export and lowers to TFLite ops.

int8: the same budget search as the .pte's (exporter.quant: plain PTQ, sensitivity, float fallback, held-out check
images), with `quant.pt2e.Pt2eBackend` given LiteRT's own PT2E quantizer (`LITERT`: litert_torch's PT2EQuantizer,
its symmetric config with per-channel weights and histogram activation ranges). convert_pt2e keeps float weights and
their quantize ops (`fold_quantize=False`, as litert-torch needs: a folded graph failed to convert in its users'
reports) and the converter, told the graph is static PT2E (`QuantConfig(pt2e_quantizer=...)`), turns its
quantize/dequantize pairs into int8 TFLite kernels. LiteRT's quantizer has no ranges chosen per inference here (its
dynamic mode is weight-only, a different kernel family), so the search has no such fallback for this format.

**The int8 file takes and returns float32** (`details.io`). The converter writes an int8 file whose input and
output tensors are int8 (the PT2E graph's first quantize and last dequantize folded into the interface, scale and
zero point in the tensors' quantization). The export puts them back inside the file: one QUANTIZE op from a float
input and one DEQUANTIZE op to a float output (the same scale and zero point, computed by the interpreter, inside
the XNNPACK delegate). Why: an app then feeds every artifact of a build, the `.pte` fp32 and int8 and the `.tflite`
fp32 and int8, the same float tensor after the same preprocessing and reads float logits back, so switching runtime
or precision changes no app code and the bundle's input spec is one for all; the numbers are the same as with int8
I/O (the input is quantized with the same parameters either way, by the app or by the op); and what is validated
against eager is the file the app runs, not the file plus quantization code every app would have to write. int8 I/O
pays only on accelerators that take integer models only (Edge TPU, some NPU delegates), which are not this target's;
the runner below still feeds and dequantizes an int8 interface correctly should a file have one.

No per-operator profile: ai-edge-litert 2.3.0's Python API exposes no profiler (its interpreter has no profiler
hook; per-operator times come from the C++ benchmark_model tool's --enable_op_profiling, not in the wheel), so the
format defines no `profile` and the manifest says it has none. RAM: the peak resident set of a fresh process running
the file (formats/memory.py)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from ..precision import Precision
from ..quant.pt2e import Pt2eQuantizer
from .interface import Format
from .memory import native_stderr_silenced as _native_stderr_silenced  # the runtime logs to fd 2

# the integer type of the interface tensors the quantizer writes
INTERFACE_TYPE = {Precision.INT8: "int8", Precision.W8A16: "int16"}
# how the int8 file's interface was written (details.io.interface)
FLOAT_INTERFACE = (
    "no int8 input or output: the converter's int8 interface tensors (io_rewritten) put back inside the file (a "
    "QUANTIZE op after the input, a DEQUANTIZE op before the output, with the converter's scale and zero point), "
    "so an app feeds the same tensor (float32, or uint8 pixels) as to every other artifact of the build"
)


class LiteRTQuantizer(Pt2eQuantizer):
    """litert_torch's PT2EQuantizer for exporter.quant's PT2E backend: static int8, per-channel weights."""

    name = "PT2EQuantizer (litert_torch)"
    dynamic_ranges = False  # LiteRT's dynamic mode quantizes weights only (DRQ kernels): not the search's fallback
    fold_quantize = False  # the converter reads float weights and their quantize ops

    def quantizer_class(self) -> type:
        from litert_torch.quantize.pt2e_quantizer import PT2EQuantizer

        return PT2EQuantizer

    def config(self, dynamic: bool = False):
        from litert_torch.quantize.pt2e_quantizer import get_symmetric_quantization_config

        return get_symmetric_quantization_config(is_per_channel=True, is_dynamic=False)

    def propagate_annotation(self, model) -> None:
        from litert_torch.quantize.pt2e_quantizer_utils import propagate_annotation

        propagate_annotation(model)


LITERT = LiteRTQuantizer()


@contextlib.contextmanager
def _quiet_converter():
    """litert-torch prints a progress line per conversion step (rich, on stdout) unless told otherwise by its
    environment variable; set for the conversion only."""
    key = "LITERT_TORCH_SHOW_PROGRESS"
    before = os.environ.get(key)
    os.environ[key] = "n"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _import_converter():
    """litert_torch, imported with native stderr silenced: its libraries log absl and oneDNN notices at import."""
    with _native_stderr_silenced():
        import litert_torch
        import litert_torch.quantize.pt2e_quantizer  # noqa: F401  (its native dependencies load here too)
    return litert_torch


class ConverterRefused(RuntimeError):
    """The converter has no lowering for an operator of the graph; the message names it first."""


# where the converter's error names the ATen operator it stopped at: its "Lowering not found: aten.x.default", or
# torch.fx's "While executing %node : ... target=torch.ops.aten.x.default" under an error that does not
_OPERATOR = re.compile(r"Lowering not found: (\S+)|target=torch\.ops\.([\w.]+)")


def refusal(error: Exception) -> Exception:
    """The converter's error with the operator it could not take in its first line (a build's reason keeps the first
    line only: "Only 1D FFT on the last dimension is currently supported" alone does not say which op), or the error
    as it was where it names none."""
    text = str(error)
    found = _OPERATOR.search(text)
    if found is None:
        return error
    operator = (found.group(1) or found.group(2)).removeprefix("torch.ops.").rstrip(".")
    first = (text.strip().splitlines() or [""])[0]
    return ConverterRefused(
        f"unsupported op {operator}: the LiteRT converter cannot take it ({type(error).__name__}: {first})"
    )


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def runtime_version() -> str:
    return _version("ai-edge-litert")


def float_interface(content: bytes) -> tuple[bytes, dict]:
    """The model with every int8 (or int16) input and output of its main subgraph made float32: a QUANTIZE op from a
    new float input into the integer tensor the input was, and a DEQUANTIZE op from the integer tensor the output
    was into a new float output (the tensors' own scale and zero point). Returns the model and what was
    rewritten."""
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model_from_bytearray(bytearray(content))
    graph = model.subgraphs[0]
    changed: dict[int, int] = {}  # old interface tensor -> the new float one
    ops_first, ops_last = [], []
    replaced: dict[str, list] = {"inputs": [], "outputs": []}  # the int8 interface the converter wrote
    integer = {schema.TensorType.INT8: "int8", schema.TensorType.INT16: "int16"}
    kinds: set[str] = set()
    for role, indices in (("input", graph.inputs), ("output", graph.outputs)):
        for position, index in enumerate(indices):
            tensor = graph.tensors[index]
            if tensor.type not in integer:
                continue
            kind = integer[tensor.type]
            kinds.add(kind)
            quantization = tensor.quantization
            replaced[f"{role}s"].append(
                {
                    "name": (tensor.name or b"").decode(errors="replace"),
                    "scale": [float(v) for v in (quantization.scale if quantization is not None else [])],
                    "zero_point": [int(v) for v in (quantization.zeroPoint if quantization is not None else [])],
                }
            )
            floating = schema.TensorT()
            floating.shape, floating.shapeSignature = tensor.shape, tensor.shapeSignature
            floating.type, floating.buffer, floating.name = schema.TensorType.FLOAT32, 0, tensor.name
            tensor.name = (tensor.name or b"") + b"_" + kind.encode()
            graph.tensors.append(floating)
            new = len(graph.tensors) - 1
            changed[index] = new
            indices[position] = new
            op = schema.OperatorT()
            if role == "input":
                op.opcodeIndex = _opcode(model, schema.BuiltinOperator.QUANTIZE)
                op.inputs, op.outputs = [new], [index]
                ops_first.append(op)
            else:
                op.opcodeIndex = _opcode(model, schema.BuiltinOperator.DEQUANTIZE)
                op.inputs, op.outputs = [index], [new]
                ops_last.append(op)
    if not changed:
        return content, {}
    graph.operators = ops_first + list(graph.operators) + ops_last
    for signature in model.signatureDefs or []:
        if signature.subgraphIndex != 0:
            continue
        for entry in list(signature.inputs or []) + list(signature.outputs or []):
            entry.tensorIndex = changed.get(entry.tensorIndex, entry.tensorIndex)
    (kind,) = kinds  # one integer type per file: int8 from the converter, int16 from the w8a16 recipe
    rewritten = {
        f"{kind}_interface": replaced,
        "note": f"the converter's {kind} input/output tensors (scale and zero point above) made float32 by a "
        "QUANTIZE op after the input and a DEQUANTIZE op before the output, inside the file",
    }
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model)), rewritten


def _opcode(model, builtin: int) -> int:
    """The index of the model's operator code for `builtin`, added when the model has none."""
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.tools import flatbuffer_utils

    for index, code in enumerate(model.operatorCodes):
        if flatbuffer_utils.get_builtin_code_from_operator_code(code) == builtin:
            return index
    code = schema.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, min(builtin, 127), 2
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


# ai-edge-quantizer's recipe for each precision made from the fp32 file (its weights, and for w8a16 its activations,
# rewritten in the flatbuffer)
RECIPES = {
    Precision.FP16: "float_casting",  # weights stored as float16, dequantized where the runtime loads them
    Precision.INT8_DYNAMIC: "dynamic_wi8_afp32",  # int8 weights per channel, activations quantized per inference
    Precision.W8A16: "static_wi8_ai16",  # int8 weights, int16 activations with ranges from calibration images
}
# tflite::optimize's "reduced_precision_support" model metadata: XNNPACK's delegate then computes in fp16 where the
# core has FP16 arithmetic (XNN_FLAG_HINT_FP16_INFERENCE: a hint; in fp32 elsewhere, x86 included)
FP16_HINT = ("reduced_precision_support", "fp16accfp16")
FP16_ARITHMETIC = (
    "float16 weights; float16 arithmetic inside XNNPACK where the core has FP16 arithmetic (the file's "
    f"{FP16_HINT[0]} metadata, {FP16_HINT[1]!r}), float32 arithmetic on the others (x86 included)"
)


@contextlib.contextmanager
def _quiet_quantizer():
    """ai-edge-quantizer draws tqdm bars on sys.stderr for graphs over 100 tensors (calibration and its
    transformations take no switch), and its native code logs to fd 2: neither belongs in a build's output."""
    with contextlib.redirect_stderr(io.StringIO()), _native_stderr_silenced(), warnings.catch_warnings():
        # its calibration keeps every tensor, and the interpreter warns that this is for debugging
        warnings.filterwarnings("ignore", "Enabling `experimental_preserve_all_tensors`", UserWarning)
        yield


def _quantizer(content: bytes, precision: Precision):
    from ai_edge_quantizer import qtyping, quantizer, recipe

    if precision != Precision.FP16:
        return quantizer.Quantizer(content, getattr(recipe, RECIPES[precision])())
    made = quantizer.Quantizer(content)
    made.update_quantization_recipe(
        regex=".*",
        operation_name=qtyping.TFLOperationName.ALL_SUPPORTED,
        algorithm_key=quantizer.AlgorithmName.FLOAT_CASTING,
        op_config=qtyping.OpQuantizationConfig(
            weight_tensor_config=qtyping.TensorQuantizationConfig(num_bits=16, dtype=qtyping.TensorDataType.FLOAT),
            compute_precision=qtyping.ComputePrecision.FLOAT,
            explicit_dequantize=True,
        ),
    )
    return made


def requantized(content: bytes, precision: Precision, calib) -> tuple[bytes, dict]:
    """The fp32 file made `precision` by ai-edge-quantizer's recipe for it (RECIPES), calibrated on `calib`'s images
    where the recipe fixes activation ranges; returns the file and what was done."""
    made = _quantizer(content, precision)
    ranges, calibration = None, "none: no activation range is fixed"
    if made.need_calibration:
        if not calib:
            raise ValueError(f"litert {precision} needs calibration images")
        signatures = _interpreter(content, 1).get_signature_list()
        ((signature, io),) = signatures.items()
        (name,) = io["inputs"]
        with _quiet_quantizer():
            ranges = made.calibrate({signature: [{name: np.asarray(x)} for x in calib]}, num_threads=1)
        calibration = f"{len(calib)} images fix every activation's range (min and max)"
    with _quiet_quantizer():
        result = made.quantize(ranges, enable_progress_bar=False, enable_progress_report=False)
    return bytes(result.quantized_model), {
        "tool": f"ai-edge-quantizer {_version('ai-edge-quantizer')}",
        "recipe": RECIPES[precision],
        "calibration": calibration,
    }


def with_metadata(content: bytes, name: str, value: str) -> bytes:
    """The model with one more metadata entry (`name`: `value`, in a buffer of its own)."""
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model_from_bytearray(bytearray(content))
    buffer = schema.BufferT()
    buffer.data = list(value.encode())
    model.buffers.append(buffer)
    entry = schema.MetadataT()
    entry.name, entry.buffer = name.encode(), len(model.buffers) - 1
    model.metadata = list(model.metadata or []) + [entry]
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))


def _delegate_partitions(interpreter) -> int:
    """How many parts of the graph XNNPACK took (1: the whole graph; each op it leaves out splits it)."""
    return sum(op["op_name"] == "DELEGATE" for op in interpreter._get_ops_details())


def _interpreter(source: Path | bytes, threads: int | None):
    where = {"model_content": source} if isinstance(source, bytes) else {"model_path": str(source)}
    with _native_stderr_silenced():  # absl's notices at import, "Created TensorFlow Lite XNNPACK delegate for CPU."
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(**where, num_threads=threads)
        interpreter.allocate_tensors()
    return interpreter


def _tensor_spec(detail: dict) -> dict:
    spec = {"name": detail["name"], "shape": [int(s) for s in detail["shape"]], "dtype": np.dtype(detail["dtype"]).name}
    scale, zero_point = detail["quantization"]
    if scale:
        spec.update(scale=float(scale), zero_point=int(zero_point))
    return spec


def _io(interpreter) -> dict:
    return {
        "inputs": [_tensor_spec(d) for d in interpreter.get_input_details()],
        "outputs": [_tensor_spec(d) for d in _outputs(interpreter)],
    }


def _outputs(interpreter) -> list[dict]:
    """Output details in the signature's order (output_0, output_1, ...), which is the model's."""
    details = {d["index"]: d for d in interpreter.get_output_details()}
    signatures = interpreter._get_full_signature_list()
    if len(signatures) == 1:
        (signature,) = signatures.values()
        ordered = [details[i] for _, i in sorted(signature["outputs"].items(), key=lambda kv: _output_rank(kv[0]))]
        if len(ordered) == len(details):
            return ordered
    return list(details.values())


def _output_rank(name: str):
    tail = name.rsplit("_", 1)[-1]
    return (0, int(tail), name) if tail.isdigit() else (1, 0, name)


def _op_counts(interpreter) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in interpreter._get_ops_details():
        if op["op_name"] != "DELEGATE":
            counts[op["op_name"]] = counts.get(op["op_name"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _quantize(x: np.ndarray, detail: dict) -> np.ndarray:
    dtype = np.dtype(detail["dtype"])
    if dtype == np.float32 or x.dtype == dtype:  # float, or the uint8 pixels of a uint8-nhwc input
        return x
    scale, zero_point = detail["quantization"]
    info = np.iinfo(dtype)
    return np.clip(np.round(x / scale) + zero_point, info.min, info.max).astype(dtype)


def _dequantize(y: np.ndarray, detail: dict) -> np.ndarray:
    if np.dtype(detail["dtype"]) == np.float32:
        return y.copy()
    scale, zero_point = detail["quantization"]
    return ((y.astype(np.float32) - zero_point) * scale).astype(np.float32)


_RSS_IMPORTS = "from ai_edge_litert.interpreter import Interpreter"
_RSS_LOAD = """\
interpreter = Interpreter(model_path=path, num_threads=threads)
interpreter.allocate_tensors()
feed = interpreter.get_input_details()[0]
if feed["dtype"] not in (np.float32, x.dtype):
    scale, zero_point = feed["quantization"]
    x = np.clip(np.round(x / scale) + zero_point, -128, 127).astype(feed["dtype"])"""
_RSS_RUN = """\
interpreter.set_tensor(feed["index"], x)
interpreter.invoke()"""


class LiteRTFormat(Format):
    """The LiteRT format as the engine calls it (formats/interface.py): export, load and memory; no profile
    (ai-edge-litert has no per-operator profiler from Python: the engine says so)."""

    name, suffix = "litert", ".tflite"
    precisions = (Precision.FP32, Precision.FP16, Precision.INT8, Precision.INT8_DYNAMIC, Precision.W8A16)

    def export(self, model, example, precision, calib, path: Path, meta: dict) -> dict:
        litert_torch = _import_converter()

        example = example.contiguous()
        details: dict = {"converter": f"litert-torch {_version('litert-torch')}"}
        quant_config = None
        eager = model
        if precision == Precision.INT8:
            from litert_torch.quantize.quant_config import QuantConfig

            from ..quant import quantize_with_budget
            from ..quant.pt2e import Pt2eBackend

            backend = Pt2eBackend(model, example, quantizer=LITERT)
            model, details["quantization"] = quantize_with_budget(model, backend, calib)
            for module in model.modules():  # a PT2E graph computes as exported; the flag only makes the converter warn
                module.training = False
            quantizer = LITERT.quantizer_class()().set_global(LITERT.config())
            quant_config = QuantConfig(pt2e_quantizer=quantizer)
        elif precision not in self.precisions:
            raise ValueError(f"litert takes {' or '.join(self.precisions)}, not {precision}")
        # the converter's native code logs to fd 2 ("Estimated count of arithmetic ops"); an error still raises
        try:
            with _quiet_converter(), _native_stderr_silenced(), torch.no_grad():
                content = bytes(litert_torch.convert(model, (example,), quant_config=quant_config).model_content())
        except Exception as e:
            refused = refusal(e)
            if refused is e:
                raise
            raise refused from e
        if precision in RECIPES:
            content, details["recipe"] = requantized(content, precision, calib)
        if precision == Precision.FP16:
            content = with_metadata(content, *FP16_HINT)
            details["recipe"]["arithmetic"] = FP16_ARITHMETIC
        if precision in INTERFACE_TYPE:
            content, details["io_rewritten"] = float_interface(content)
        interpreter = _interpreter(content, 1)
        details["io"] = _io(interpreter)
        if precision in INTERFACE_TYPE:
            details["io"]["interface"] = FLOAT_INTERFACE.replace("int8", INTERFACE_TYPE[precision])
        if precision in RECIPES:
            details["recipe"]["delegate_partitions"] = _delegate_partitions(interpreter)
        details["ops"] = _op_counts(interpreter)
        path.write_bytes(content)
        if precision == Precision.INT8:
            # the search scored PT2E graphs in eager; the converter lowers the chosen one and can change its numbers:
            # the file itself is scored on the same check images (as the .pte's program is)
            from ..quant.search import lowered_quality

            details["quantization"]["program"] = lowered_quality(eager, lambda: self.load(path), calib)
        return details

    def load(self, path: Path, threads: int | None = None):
        """The file in ai-edge-litert's interpreter (XNNPACK delegate) with `threads` (None: the runtime's default).
        Inputs are batch-1 as exported (validation feeds one image at a time); a batch of N is run one exported
        batch at a time. An int8 interface is fed quantized and read dequantized with its tensors' parameters."""
        interpreter = _interpreter(Path(path), threads)
        (feed,) = interpreter.get_input_details()
        (fetch, *_) = _outputs(interpreter)
        shape = tuple(int(s) for s in feed["shape"])

        def run_batch(x: np.ndarray) -> torch.Tensor:
            interpreter.set_tensor(feed["index"], _quantize(x, feed))
            interpreter.invoke()
            return torch.from_numpy(_dequantize(interpreter.get_tensor(fetch["index"]), fetch))

        def run(x: torch.Tensor) -> torch.Tensor:
            array = (x.detach() if x.dtype == torch.uint8 else x.detach().float()).contiguous().numpy()
            if array.shape == shape:
                return run_batch(array)
            if array.shape[1:] != shape[1:] or array.shape[0] % shape[0]:
                raise ValueError(f"the .tflite takes {list(shape)}, not {list(array.shape)}")
            return torch.cat([run_batch(array[i : i + shape[0]]) for i in range(0, array.shape[0], shape[0])])

        return run

    def memory(self, path: Path, input_shape, threads: int, dtype: str = "float32") -> dict:
        """Peak resident memory of a fresh process running the .tflite in ai-edge-litert's interpreter (its arena and
        XNNPACK's packed weights show there; the interpreter reports no memory plan of its own from Python)."""
        from . import memory as shared

        return shared.peak_rss(_RSS_IMPORTS, _RSS_LOAD, _RSS_RUN, path, input_shape, threads, dtype=dtype)


FORMAT = LiteRTFormat()
