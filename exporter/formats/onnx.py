"""ONNX for TensorRT and ONNX Runtime: fp32, strongly typed fp16, and explicit Q/DQ int8.

Every variant keeps an fp32 input "input" (N x C x H x W, N dynamic; H and W too within `size_range=MIN:MAX`, a
segmentation target's [input] size_range) and fp32 output "logits", so the same runner, golden files and trtexec
shapes serve all three.

A graph whose tensors pass protobuf's 2 GiB (ViT-H/14, RegNetY-128GF in fp32) cannot be one file: its tensors go
to `<file>.data` beside it (ONNX external data, read by ONNX Runtime and TensorRT from the graph's directory),
which exporter.files keeps with the file. `external_data=always` does that for any size.

`exporter=torchscript` takes the TorchScript-based exporter (torch.onnx.export(dynamo=False), deprecated since
PyTorch 2.9) instead of the dynamo one: it records the ops torchvision marks for ONNX (RoiAlign,
NonMaxSuppression, a top-k of a data-dependent count) where torch.export stops on data-dependent sizes (Faster
R-CNN's region proposals), and writes a graph for one input size at batch 1.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from .. import files
from ..errors import UsageError
from ..precision import Precision
from ..quant import quantize_with_budget
from ..quant.onnx_qdq import OnnxQdqBackend
from . import dynamic_size
from .half import fold_batchnorms, half_described, half_graph
from .interface import Format

DEFAULT_OPSET = 18
DEFAULT_BATCH = "1:1:1"
EXTERNAL_DATA = ("auto", "always")  # auto: only a graph that cannot be one file (protobuf's 2 GiB)
TWO_GIB = 2**31  # protobuf's limit on one serialized message
EXPORTERS = ("dynamo", "torchscript")
INPUT, OUTPUT = "input", "logits"


def opset_range() -> tuple[int, int]:
    """Opsets the installed dynamo exporter really writes: below its torchlib opset it silently keeps that one."""
    from torch.onnx import _constants
    from torch.onnx._internal.exporter import _constants as exporter_constants

    return exporter_constants.TORCHLIB_OPSET, _constants.ONNX_MAX_OPSET


def check_opset(opset) -> int:
    low, high = opset_range()
    if isinstance(opset, bool) or not isinstance(opset, int) or not low <= opset <= high:
        raise UsageError(
            f"opset {opset!r} is not supported by torch {torch.__version__}'s ONNX exporter (use {low}..{high})"
        )
    return opset


def batch_profile(batch) -> tuple[int, int, int]:
    """MIN:OPT:MAX, e.g. "1:4:8"; a single N means N:N:N."""
    parts = str(batch).split(":")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) == 1:
        sizes = sizes * 3
    if len(sizes) != 3 or not 1 <= sizes[0] <= sizes[1] <= sizes[2]:
        raise UsageError(f"batch {batch!r}: expected MIN:OPT:MAX with 1 <= MIN <= OPT <= MAX")
    return sizes


def check_external_data(value) -> bool:
    """Whether every graph keeps its tensors in external data (`always`) or only one over 2 GiB (`auto`)."""
    if value not in EXTERNAL_DATA:
        raise UsageError(f"external_data {value!r}: expected {' or '.join(EXTERNAL_DATA)}")
    return value == "always"


def check_exporter(exporter, batch) -> str:
    if exporter not in EXPORTERS:
        raise UsageError(f"exporter {exporter!r}: expected {' or '.join(EXPORTERS)}")
    if exporter == "torchscript" and batch_profile(batch) != (1, 1, 1):
        raise UsageError(f"batch {batch!r}: the TorchScript-based exporter writes a graph for batch 1 only (batch=1)")
    return exporter


def size_bounds(size_range, exporter: str = "dynamo") -> tuple[int, int] | None:
    """`MIN:MAX`, the sides of a graph with a dynamic height and width, or None (one size)."""
    sides = dynamic_size.bounds(size_range)
    if sides and exporter != "dynamo":
        raise UsageError(f"size_range {size_range!r}: a dynamic height and width needs exporter=dynamo")
    return sides


def _input_dims(example: torch.Tensor, bounds: tuple[int, int] | None) -> dict:
    """The input's dynamic dims: the batch, and within `bounds` its height and width."""
    return {0: "batch", **dynamic_size.input_dims(example, bounds)}


def _export_graph(
    model, example, opset: int, path: Path, external: bool = False, exporter: str = "dynamo", bounds=None
) -> None:
    if exporter == "torchscript":
        _export_traced(model, example, opset, path, external)
        return
    # traced at batch 2: torch.export specialises a size-1 dim, and a batch-1 trace bakes batch 1 into
    # nn.MultiheadAttention's reshapes (ViT's graph then fails at batch 8); a CNN's file is byte-identical either way
    traced = example if example.shape[0] > 1 else torch.cat([example, example])
    with torch.no_grad():
        program = torch.onnx.export(
            model,
            (traced,),
            dynamo=True,
            opset_version=opset,
            dynamic_shapes=(_input_dims(example, bounds),),
            input_names=[INPUT],
            output_names=[OUTPUT],
            verbose=False,
            # onnxscript's optimizer: BatchNorm folded into Conv, shape arithmetic folded away (MobileNetV3-Small:
            # 354 -> 122 nodes; PSNR vs eager in ONNX Runtime 139.5 -> 135.4 dB, both at fp32 rounding level)
            optimize=True,
        )
    _drop_stack_traces(program.model)
    program.save(str(path), external_data=external or None)  # None: external only past 2 GiB


def _export_traced(model, example, opset: int, path: Path, external: bool) -> None:
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notice and the tracer's on shapes it keeps dynamic
        torch.onnx.export(
            model,
            (example[:1],),
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=[INPUT],
            output_names=[OUTPUT],
            do_constant_folding=True,
        )
    if external:
        _resave(path, path, True)


def _resave(source: Path, path: Path, external: bool) -> None:
    """`source` (and its external data) as `path`: external data is found by the file name written inside the
    graph, so a renamed copy is saved again, its tensors in `<path>.data` when asked or when they pass 2 GiB."""
    import onnx

    proto = onnx.load(str(source))
    external = external or sum(_tensor_bytes(t) for t in proto.graph.initializer) > TWO_GIB
    onnx.save_model(proto, str(path), save_as_external_data=external, location=f"{path.name}.data")


def _tensor_bytes(tensor) -> int:
    """An initializer's size from its type and shape, without reading external data."""
    from onnx import helper

    return int(np.prod(tensor.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _op_types(graph) -> set[str]:
    """Every op type in the graph, those inside If/Loop branches included (Faster R-CNN's NonMaxSuppression)."""
    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attribute in node.attribute:
            for branch in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                found |= _op_types(branch)
    return found


def _drop_stack_traces(model) -> None:
    """torch.onnx records each node's Python stack (absolute paths of the exporter and the venv, line numbers):
    the file would change with the checkout's path and any edit to the code that called the export."""
    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in graph.all_nodes() if hasattr(graph, "all_nodes") else graph:
            node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)


def _quantize(model, example, opset: int, calibration, path: Path, external: bool, exporter: str, bounds=None) -> dict:
    """The fp32 graph through the budgeted Q/DQ search; the chosen candidate becomes `path`."""
    if exporter == "torchscript":
        # this exporter names a Conv's weight after its parameter only where it did not fold a BatchNorm into it
        # (onnx::Conv_<n>), and the search finds each layer's module by that name: folded here first instead
        model, _ = fold_batchnorms(model, by_parts=True)
    with tempfile.TemporaryDirectory(prefix=".qdq-", suffix=".partial", dir=path.parent) as work:
        fp32 = Path(work) / "fp32.onnx"
        _export_graph(model, example, opset, fp32, external, exporter, bounds)
        backend = OnnxQdqBackend(
            model,
            fp32,
            INPUT,
            calibration.settings["onnx_calibration"],
            Path(work),
            external_data=bool(files.companions(fp32)),
        )
        candidate, report = quantize_with_budget(model, backend, calibration)
        if files.companions(candidate.path):
            _resave(candidate.path, path, external)
        else:
            shutil.copyfile(candidate.path, path)
    return report


def _check_batch_axis(path: Path, example: torch.Tensor, sizes: tuple[int, int, int]) -> dict:
    """Run the graph at the profile's largest batch: the dynamic axis must give each row's batch-1 result."""
    session = _session(path, 1)
    single = session.run(None, {INPUT: example.numpy()})[0]
    try:
        batched = session.run(None, {INPUT: np.repeat(example.numpy(), sizes[2], axis=0)})[0]
    except Exception as e:
        raise RuntimeError(
            f"the graph runs at batch 1 but not at batch {sizes[2]} (batch profile "
            f"{':'.join(map(str, sizes))}): a reshape keeps the traced batch; "
            f"--option batch=1 exports it for batch 1 ({str(e).strip().splitlines()[0][-160:]})"
        ) from None
    if batched.shape[0] != sizes[2]:
        raise RuntimeError(f"batch {sizes[2]} gave output shape {batched.shape}")
    return {"batch": sizes[2], "max_abs_diff_vs_batch1": float(np.abs(batched - single).max())}


_CRASHES: dict[tuple, str | None] = {}
_PROBE = "import sys, onnxruntime as ort; ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])"


def nchwc_crash(path: Path) -> str | None:
    """Why ONNX Runtime's NchwcTransformer cannot be used on this file, or None. On some graphs it kills the
    process that makes the session (ONNX Runtime 1.32 on x86: a segfault on ViT's fp16 graph, where a LayerNorm
    then a batch/sequence transpose feed a MatMul), so a child process makes one first; kept per file."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _CRASHES:
        import onnxruntime as ort

        child = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True)
        _CRASHES[key] = (
            None
            if child.returncode >= 0
            else (
                f"ONNX Runtime {ort.__version__} dies (signal {-child.returncode}) making a session of this graph with "
                f"its NchwcTransformer (an x86-only layout pass; the aarch64 wheel has none): sessions here run without it"
            )
        )
    return _CRASHES[key]


def _disabled_optimizers(path: Path, nchwc: bool = True) -> list[str]:
    return [] if nchwc and not nchwc_crash(path) else ["NchwcTransformer"]


def _session(path: Path, threads: int, nchwc: bool = True):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # NCHWc: ONNX Runtime's blocked layout, with kernels for x86 only (the aarch64 wheel does not apply it)
    return ort.InferenceSession(
        str(path), options, providers=["CPUExecutionProvider"], disabled_optimizers=_disabled_optimizers(path, nchwc)
    )


_RSS_IMPORTS = "import onnxruntime as ort"
_RSS_LOAD = """\
options = ort.SessionOptions()
options.intra_op_num_threads = threads
options.inter_op_num_threads = 1
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"], disabled_optimizers={disabled!r})"""


class OnnxFormat(Format):
    """An ONNX graph run by ONNX Runtime: preflight (opset, batch, external data, exporter, size range), export,
    load, memory (its initializers and a fresh process's peak RSS) and profile (ONNX Runtime's profiler)."""

    name, suffix = "onnx", ".onnx"
    precisions = (Precision.FP32, Precision.FP16, Precision.INT8)
    options = ("opset", "batch", "external_data", "exporter", "size_range")

    def preflight(
        self,
        precision,
        opset=DEFAULT_OPSET,
        batch=DEFAULT_BATCH,
        external_data="auto",
        exporter="dynamo",
        size_range=None,
    ) -> None:
        check_opset(opset)
        batch_profile(batch)
        check_external_data(external_data)
        check_exporter(exporter, batch)
        size_bounds(size_range, exporter)

    def export(
        self,
        model,
        example,
        precision,
        calib,
        path: Path,
        meta: dict,
        opset=DEFAULT_OPSET,
        batch=DEFAULT_BATCH,
        external_data="auto",
        exporter="dynamo",
        size_range=None,
    ) -> dict:
        import onnx

        opset, sizes, external = check_opset(opset), batch_profile(batch), check_external_data(external_data)
        exporter = check_exporter(exporter, batch)
        bounds = size_bounds(size_range, exporter)
        if precision == Precision.FP16:
            half, folding = half_graph(model)
            _export_graph(half, example, opset, path, external, exporter, bounds)
        elif precision == Precision.INT8:
            quantization = _quantize(model, example, opset, calib, path, external, exporter, bounds)
        else:
            _export_graph(model, example, opset, path, external, exporter, bounds)
        proto = onnx.load(str(path), load_external_data=False)
        onnx.checker.check_model(
            str(path), full_check=True
        )  # by path: a proto over 2 GiB cannot be serialized to check
        written = {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")}
        if written != {opset}:
            raise RuntimeError(f"asked for opset {opset}, the file has {sorted(written)}")
        ops = sorted(_op_types(proto.graph))
        details = {
            "opset": opset,
            "input": INPUT,
            "output": OUTPUT,
            "exporter": exporter,
            "dynamic_batch": exporter == "dynamo",
            "batch_profile": list(sizes),
            "batch_check": _check_batch_axis(path, example, sizes),
            **({"dynamic_size": dynamic_size.described(bounds)} if bounds else {}),
            "ops": ops,
            "nodes": len(proto.graph.node),
            "graph": half_described(folding)
            if precision == Precision.FP16
            else {
                Precision.FP32: "float32",
                Precision.INT8: "explicit Q/DQ, symmetric int8, per-channel weights",
            }[precision],
        }
        if data := files.companions(path):
            # the tensors, beside the graph under this name (written inside it): ship and copy the two together
            details["external_data"] = {"file": data[0].name, "bytes": data[0].stat().st_size}
        if precision == Precision.FP16:
            details["batchnorm_folding_fp32"] = folding
        if crash := nchwc_crash(path):
            details["onnxruntime_nchwc"] = crash
        if precision == Precision.INT8:
            details["quantized_nodes"] = sum(n.op_type == "QuantizeLinear" for n in proto.graph.node)
            details["quantization"] = quantization
        return details

    def load(self, path: Path, threads: int, nchwc: bool = True):
        """nchwc=False: without the x86-only NCHWc layout pass, ONNX Runtime as on ARM (the bench's column)."""
        session = _session(path, threads, nchwc)
        return lambda x: torch.from_numpy(session.run(None, {INPUT: x.contiguous().numpy()})[0])

    def memory(self, path: Path, input_shape, threads: int, dtype: str = "float32") -> dict:
        """Constant size (the graph's initializers) and the peak resident memory of a fresh process running the
        file in ONNX Runtime (CPU provider; no torch in that process)."""
        import onnx

        from . import memory as shared

        proto = onnx.load(str(path), load_external_data=False)
        constants = sum(_tensor_bytes(t) for t in proto.graph.initializer)
        return {
            "constants_bytes": int(constants),
            **shared.peak_rss(
                _RSS_IMPORTS,
                _RSS_LOAD.format(disabled=_disabled_optimizers(path)),
                f"session.run(None, {{{INPUT!r}: x}})",
                path,
                input_shape,
                threads,
                dtype=dtype,
            ),
        }

    def profile(self, path: Path, example, runs: int, threads: int) -> dict:
        """Operators by kernel time from ONNX Runtime's own profiler, in a session of its own (profiling on); the
        first run is a warm-up and left out."""
        import json

        import onnxruntime as ort

        from . import memory as shared

        with tempfile.TemporaryDirectory() as work:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(work) / "ort")
            session = ort.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"], disabled_optimizers=_disabled_optimizers(path)
            )
            feed = {INPUT: example.contiguous().numpy()}
            for _ in range(runs + 1):
                session.run(None, feed)
            events = json.loads(Path(session.end_profiling()).read_text())
        model_runs = sorted(
            (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
        )[1:]
        if not model_runs:
            return {"available": False, "reason": "ONNX Runtime's profile has no model runs"}
        start = model_runs[0]["ts"]
        totals: dict[str, list] = {}
        for event in events:
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time") and event["ts"] >= start:
                total = totals.setdefault(event.get("args", {}).get("op_name", "?"), [0.0, 0])
                total[0] += event["dur"] / 1000  # µs
                total[1] += 1
        wall = sum(e["dur"] for e in model_runs) / 1000
        return shared.top_ops(
            {op: (ms, n) for op, (ms, n) in totals.items()},
            wall,
            runs,
            "ONNX Runtime profiler (kernel time per op type)",
        )


FORMAT = OnnxFormat()
