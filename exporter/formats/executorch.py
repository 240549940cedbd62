"""ExecuTorch program (.pte) lowered to the XNNPACK delegate: fp32, fp16 (float32 input and output), int8 (PT2E static,
through exporter.quant) or dynamic int8 (activations quantized per inference, no calibration)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..precision import NEEDS_FP16_ARITHMETIC, Precision
from . import dynamic_size
from .half import half_described, half_graph
from .interface import Format
from .memory import native_stderr_silenced as _native_stderr_silenced  # the runtime's C++ logging goes to fd 2


class _TorchaoEnumNotice(logging.Filter):
    """torchao, imported by ExecuTorch's quantizer, registers an Enum the way torch 2.14 deprecates, and torch
    logs that on every import: a notice for torchao's authors, noise in a user's build output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "register_constant() on Enum subclasses" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())


def _delegation(edge_program) -> dict:
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(edge_program.graph_module)
    outside = sorted(
        {b.op_type: b.non_delegated for b in info.delegation_by_operator.values() if b.non_delegated}.items()
    )
    return {
        "delegate": "XnnpackBackend",
        "delegated_nodes": info.num_delegated_nodes,
        "non_delegated_nodes": info.num_non_delegated_nodes,
        "delegated_subgraphs": info.num_delegated_subgraphs,
        "ops_outside_delegate": dict(outside),
        # what matters for speed: outside ops that touch real tensors, not scalar constant casts
        "ops_outside_on_tensors": _outside_on_tensors(edge_program.graph_module),
    }


def _outside_on_tensors(graph_module) -> dict:
    counts: dict[str, int] = {}
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target.__name__ in ("getitem", "executorch_call_delegate"):
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.numel() <= 1:
            continue
        parts = getattr(node.target, "__name__", str(node.target)).split(".")  # "aten.mean.dim" -> "mean"
        name = parts[1] if len(parts) >= 3 else parts[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def _db(value) -> str:
    return "no score" if value is None else f"{value} dB"


def _lower(model, example, precision, calib, path: Path, rewrites: bool, sides=None) -> dict:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from ..quant import quantize_with_budget
    from ..quant.fold import fold_constants
    from ..quant.pt2e import Pt2eBackend
    from .rewrites import (
        adaptive_pools_as_pools,
        attention_as_matmuls,
        chunks_as_slices,
        drop_padding_taps,
        half_activations_as_arithmetic,
        input_transform_as_affine,
        matmuls_as_bmm,
        means_keeping_dims,
        nearest_upsamples_as_deconvs,
        padded_avg_pools_as_pad,
        single_tensor_cats,
        split_large_depthwise,
    )

    details = {"dynamic_size": dynamic_size.described(sides)} if sides else {}
    dims = (dynamic_size.input_dims(example, sides),) if sides else None
    # torch.export keeps the example's memory format as the program's input dim order: a channels-last example
    # gave a .pte that ran on contiguous inputs (as the runner feeds them) with wrong outputs (0.08 off on a toy)
    example = example.contiguous()
    model, trimmed = drop_padding_taps(model, example) if rewrites else (model, [])
    model, affine = input_transform_as_affine(model) if rewrites else (model, [])
    model, split = split_large_depthwise(model) if rewrites else (model, [])
    model, half_activations = half_activations_as_arithmetic(model) if precision == Precision.FP16 else (model, [])
    if precision == Precision.FP16:
        model, details["batchnorm_folding_fp32"] = half_graph(model)
        details["graph"] = half_described(details["batchnorm_folding_fp32"])
        details["cpu_needs"] = [NEEDS_FP16_ARITHMETIC]  # XNNPACK runs a half graph in fp16 on any core
    with torch.no_grad():
        exported = torch.export.export(model, (example,), dynamic_shapes=dims)
        folded = upsamples = 0
        if rewrites:  # computed once, not on every call (Swin's attention masks): exported again when any is
            module, folded = fold_constants(exported.module())
            module, upsamples = nearest_upsamples_as_deconvs(module)
            exported = torch.export.export(module, (example,)) if folded or upsamples else exported
    exported, pools = padded_avg_pools_as_pad(exported) if rewrites else (exported, 0)
    exported, adaptive = adaptive_pools_as_pools(exported) if rewrites else (exported, 0)
    exported, means = means_keeping_dims(exported) if rewrites else (exported, 0)
    exported, chunks = chunks_as_slices(exported) if rewrites else (exported, 0)
    if precision == Precision.INT8:  # quantized from the rewritten graph: a pad before a pool shares its input's int8
        backend = Pt2eBackend(model, example, exported)
        quantized, details["quantization"] = quantize_with_budget(model, backend, calib)
        with torch.no_grad():
            exported = torch.export.export(quantized, (example,), dynamic_shapes=dims)
    if precision == Precision.INT8_DYNAMIC:
        quantized, details["dynamic_quantization"] = _dynamic_int8(model, example, exported)
        with torch.no_grad():
            exported = torch.export.export(quantized, (example,), dynamic_shapes=dims)
    exported, cats = single_tensor_cats(exported) if rewrites else (exported, 0)
    # after quantization: the attention computes in float either way, and the quantizer has no pattern for it
    exported, attention = attention_as_matmuls(exported) if rewrites else (exported, 0)
    exported, matmuls = matmuls_as_bmm(exported) if rewrites else (exported, 0)
    done = {
        "padding_taps_dropped": trimmed,
        "input_transform_as_affine": affine,
        "large_depthwise_split": split,
        "half_activations_as_arithmetic": half_activations,
        "padded_avg_pools_as_pad": pools,
        "adaptive_pools_as_pools": adaptive,
        "means_keeping_dims": means,
        "chunks_as_slices": chunks,
        "single_tensor_cats_dropped": cats,
        "attention_as_matmuls": attention,
        "matmuls_as_bmm": matmuls,
        "constants_folded": folded,
        "nearest_upsamples_as_deconvs": upsamples,
    }
    if any(done.values()):
        details["rewrites"] = {name: what for name, what in done.items() if what}
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    details["delegation"] = _delegation(edge.exported_program())
    program = edge.to_executorch()
    path.write_bytes(program.buffer)
    return details


def _dynamic_int8(model, example, exported) -> tuple[torch.nn.Module, dict]:
    """int8 weights, activations quantized per inference (no calibration): the layers XNNPACK has a dynamic int8
    kernel for (linears and convolutions, never a depthwise one), every other op in float."""
    from ..quant.pt2e import DYNAMIC, Pt2eBackend

    backend = Pt2eBackend(model, example, exported)
    quantized = backend.quantize([], [example], DYNAMIC)
    in_float = backend.float_closure([], DYNAMIC)
    return quantized, {
        "method": backend.describe(DYNAMIC),
        "calibration": "none: each activation's range is taken per inference",
        "layers": len(backend.layers()),
        "int8_layers": len(backend.layers()) - len(in_float),
        "float_layers": in_float,
    }


def runtime_version() -> str:
    from importlib.metadata import version

    return version("executorch")


def _program_memory(path: Path) -> dict:
    """What the program itself says it needs: its execution plan's planned (non-constant) buffers, and its
    constant data (named data, where XNNPACK keeps its weights, plus the program's constant buffers)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(Path(path).read_bytes())
    program = pte.program
    plan = program.execution_plan[0]
    named = pte.named_data.buffers if pte.named_data is not None else []
    return {
        # buffer 0 is reserved by the format (always 0 bytes); the rest is one arena per memory id
        "planned_bytes": int(sum(plan.non_const_buffer_sizes)),
        "planned_buffers": [int(size) for size in plan.non_const_buffer_sizes[1:]],
        "planned_note": "the program's memory plan: inputs, outputs and the activations of ops outside the "
        "delegate; a delegate (XNNPACK) allocates its own workspace when the method loads, "
        "which shows in the peak RSS, not here",
        "constants_bytes": int(sum(len(b) for b in named) + sum(len(c.storage) for c in program.constant_buffer)),
        "delegate_blobs_bytes": int(sum(len(d.data) for d in program.backend_delegate_data)),
    }


_RSS_IMPORTS = "import torch\nfrom executorch.extension.pybindings import portable_lib"
_RSS_LOAD = """\
if portable_lib._threadpool_get_thread_count() != threads:
    portable_lib._unsafe_reset_threadpool(threads)
module = portable_lib._load_for_executorch(path)
tensor = torch.from_numpy(x)"""


_CONTAINERS = {"Method::execute", "Method::init", "Program::load_method", "DELEGATE_CALL", "OPERATOR_CALL"}


# XNNPACK's profiler names every int8 elementwise op it runs as a 256-entry lookup table "Invalid Unary Op": that
# path of its unary operator never records which op it is (XNNPACK's own string table, seen in
# libexecutorch_backend_xnnpack.so of ExecuTorch 1.5.1; float ops and the int8 ones with kernels of their own, clamp,
# leaky ReLU and convert, are named). Which ops they are is read back from the program's XNNPACK graph.
XNNPACK_UNNAMED = "Invalid Unary Op"
# XNNPACK graph nodes (ExecuTorch's serialization/schema.fbs) that are unary elementwise ops with no int8 kernel
_LOOKUP_TABLE_NODES = {
    "XNNSigmoid", "XNNFloor", "XNNSquareRoot", "XNNCeiling", "XNNHardswish", "XNNNegate", "XNNSquare", "XNNELU",
    "XNNAbs", "XNNReciprocalSquareRoot", "XNNLog", "XNNGelu", "XNNTanh", "XNNExp", "XNNSin", "XNNCos",
}  # fmt: skip
_ONE_BYTE = {"xnn_datatype_qint8", "xnn_datatype_quint8"}


def _xnnpack_graphs(path: Path) -> list[dict]:
    """The XNNPACK graphs of a .pte as JSON (flatc with ExecuTorch's own schema): nodes, values."""
    import json
    import re
    import tempfile

    from executorch.backends.xnnpack import serialization
    from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import XNNHeader
    from executorch.exir._serialize._flatbuffer import _flatc_decompile
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(Path(path).read_bytes()).program
    schema = Path(next(iter(serialization.__path__))) / "schema.fbs"
    graphs = []
    with tempfile.TemporaryDirectory() as work:
        for plan in program.execution_plan:
            for i, delegate in enumerate(d for d in plan.delegates if d.id == "XnnpackBackend"):
                blob = program.backend_delegate_data[delegate.processed.index].data
                header = XNNHeader.from_bytes(blob[: XNNHeader.EXPECTED_LENGTH])
                graph = Path(work) / f"graph{i}.bin"
                graph.write_bytes(blob[header.flatbuffer_offset : header.flatbuffer_offset + header.flatbuffer_size])
                _flatc_decompile(work, str(schema), str(graph))
                text = graph.with_suffix(".json").read_text()  # flatc writes unbounded clamps as bare inf
                graphs.append(json.loads(re.sub(r"(?<=[\s:\[,])(-?inf|nan)(?=\s*[,\]}])", r'"\1"', text)))
    return graphs


def _lookup_table_name(path: Path) -> str:
    """XNNPACK_UNNAMED, said with the ops it stands for in this program when its graph can be read."""
    import subprocess

    try:
        kinds = _lookup_table_kinds(path)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):  # no flatc here, or a graph of another schema
        kinds = set()
    named = " or ".join(sorted(kinds)) or "an int8 elementwise op"
    return f"{named} (int8 lookup table; XNNPACK profiler name: {XNNPACK_UNNAMED})"


def _lookup_table_kinds(path: Path) -> set[str]:
    """The program's unary nodes with no int8 kernel of their own that run on int8 data, either as they are or (as
    ExecuTorch writes them) a float node between a Convert from int8 and one back, which XNNPACK fuses into one
    int8 op."""
    kinds = set()
    for graph in _xnnpack_graphs(path):
        int8 = set()
        for value in graph["xvalues"]:
            tensor = value["xvalue_union"].get("tensor_value", value["xvalue_union"])
            if tensor["datatype"] in _ONE_BYTE:
                int8.add(tensor["id_out"])
        for node in graph["xnodes"]:  # a Convert's float side carries int8 data
            ends = node["xnode_union"]
            if node["xnode_union_type"] == "XNNConvert" and int8 & {ends["input_id"], ends["output_id"]}:
                int8 |= {ends["input_id"], ends["output_id"]}
        for node in graph["xnodes"]:
            ends = node["xnode_union"]
            if node["xnode_union_type"] in _LOOKUP_TABLE_NODES and {ends["input_id"], ends["output_id"]} <= int8:
                kinds.add(node["xnode_union_type"].removeprefix("XNN"))
    return kinds


class ExecuTorchFormat(Format):
    """An ExecuTorch program lowered to XNNPACK: export, load, the per-inference remake of an int8 program, memory
    (its own plan and a fresh process's peak RSS) and profile (ETDump)."""

    name, suffix, options = "executorch", ".pte", ("size_range",)
    precisions = (Precision.FP32, Precision.FP16, Precision.INT8, Precision.INT8_DYNAMIC)

    def export(
        self, model, example, precision, calib, path: Path, meta: dict, rewrites: bool = True, size_range=None
    ) -> dict:
        """rewrites=False lowers the graph as it is (make bench times both, to show what formats.rewrites buys).
        size_range="MIN:MAX": a program for any height and width in it (segmentation); the rewrites read the example's
        size (the padding a dilated tap reads, an adaptive pool's window), so they are left out, and XNNPACK leaves a
        bilinear resize of dynamic size to ExecuTorch's portable kernel (details.delegation lists it outside).
        An int8 program is scored on the search's check images once lowered (details.quantization.program). When
        ranges chosen per inference met the budget in the graph and the program misses it by more than a rounding,
        ExecuTorch's lowering changed the numbers: the program is made again from a search with static ranges only,
        and the better of the two programs on the check images is kept."""
        import dataclasses

        from ..quant.pt2e import Pt2eBackend
        from ..quant.search import better, lowered_quality, lowering_broke

        sides = dynamic_size.bounds(size_range)
        rewrites = rewrites and not sides
        details = _lower(model, example, precision, calib, path, rewrites, sides)
        report = details.get("quantization")
        if report is None:
            return details
        report["program"] = program = lowered_quality(model, lambda: self.load(path), calib)
        graph = report.get("after") or {}
        if graph.get("ranges") not in Pt2eBackend.fallback_range_methods or not lowering_broke(graph, program):
            return details
        calib.log(
            f"  int8 .pte: its graph met the budget ({_db(graph['psnr_db'])}) and the lowered program missed "
            f"it ({_db(program['psnr_db'])}): made again with static ranges"
        )
        first = path.read_bytes()
        static = dataclasses.replace(calib, settings={**calib.settings, "dynamic_ranges": False})
        remade = _lower(model, example, precision, static, path, rewrites, sides)
        remade_report = remade["quantization"]
        remade_report["program"] = lowered_quality(model, lambda: self.load(path), calib)
        keep_remade = better(remade_report["program"], program)
        fault = {
            "ranges": graph["ranges"],
            "graph": graph,
            "program": program,
            "static_program": remade_report["program"],
            "kept": "static" if keep_remade else graph["ranges"],
            "note": f"ExecuTorch lowered the int8 graph with {graph['ranges']} ranges to a program that missed the "
            "budget its graph met; a program was made again from a search with static ranges only, and the "
            "better of the two on the check images is the artifact",
        }
        if not keep_remade:
            path.write_bytes(first)
            report["lowering_fault"] = fault
            return details
        remade_report.update(
            lowering_fault=fault,
            dynamic_ranges=calib.settings.get("dynamic_ranges", True),
            seconds=round(remade_report["seconds"] + report["seconds"], 1),
        )
        return remade

    def load(self, path: Path, threads: int | None = None):
        """threads=None: the runtime's pool as it is (scoring, not timing)."""
        from executorch.extension.pybindings import portable_lib
        from executorch.runtime import Runtime

        with _native_stderr_silenced():
            # ExecuTorch sizes its pool from cpuinfo, which can disagree with torch's thread count
            # (NOTES' ResNet18 .pte "slower than eager" matches a 1-thread pool against 2-thread eager).
            # Resizing frees the pool under methods already loaded (they crash), so resize only on change.
            if threads is not None and portable_lib._threadpool_get_thread_count() != threads:
                portable_lib._unsafe_reset_threadpool(threads)
            method = Runtime.get().load_program(Path(path)).load_method("forward")
        return lambda x: method.execute([x.contiguous()])[0]

    def per_inference_ranges(self, calib, details: dict):
        """The calibration that makes this int8 program again with ranges chosen per inference, or None: when its ranges
        were calibrated on images and ranges per inference are allowed (not when they were lowered wrong). For inputs
        the calibration images did not cover (EfficientNet-V2-M trained on the digits: squeeze-and-excitation gates
        that 6 validation digits drive 150x past their calibrated ranges)."""
        import dataclasses

        from ..quant.calibration import STATIC_RANGES
        from ..quant.pt2e import Pt2eBackend

        report = details.get("quantization") or {}
        ranges = (report.get("after") or {}).get("ranges")
        if (
            not report.get("fallback")
            or not report.get("dynamic_ranges")
            or report.get("lowering_fault")
            or ranges in Pt2eBackend.fallback_range_methods
        ):
            return None
        return dataclasses.replace(calib, settings={**calib.settings, STATIC_RANGES: False})

    def memory(self, path: Path, input_shape, threads: int, dtype: str = "float32") -> dict:
        from . import memory as shared

        return {
            **_program_memory(path),
            **shared.peak_rss(
                _RSS_IMPORTS, _RSS_LOAD, "module.forward([tensor])", path, input_shape, threads, dtype=dtype
            ),
        }

    def profile(self, path: Path, example, runs: int, threads: int) -> dict:
        """Operators by time from ExecuTorch's own event tracer (ETDump, read with devtools' Inspector): XNNPACK's
        per-operator events inside the delegate, the portable kernels outside it. A module of its own, loaded
        with ETDump on; the first run is a warm-up and left out."""
        import re
        import tempfile

        from executorch.devtools import Inspector
        from executorch.extension.pybindings import portable_lib

        from . import memory as shared

        with _native_stderr_silenced():
            if portable_lib._threadpool_get_thread_count() != threads:
                portable_lib._unsafe_reset_threadpool(threads)
            module = portable_lib._load_for_executorch(str(path), enable_etdump=True, debug_buffer_size=0)
            if not module.has_etdump():
                return {
                    "available": False,
                    "reason": "this ExecuTorch runtime was built without the event tracer (ETDump)",
                }
            for _ in range(runs + 1):
                module.forward([example.contiguous()])
            with tempfile.TemporaryDirectory() as work:
                etdump = Path(work) / "profile.etdp"
                module.write_etdump_result_to_file(str(etdump), str(Path(work) / "debug.bin"))
                inspector = Inspector(etdump_path=str(etdump))
        totals: dict[str, list] = {}
        wall = 0.0
        for block in inspector.event_blocks:
            if block.name != "Execute":
                continue
            for event in block.events:
                if event.perf_data is None:
                    continue
                times = list(event.perf_data.raw)[1:]  # ms per run, the warm-up dropped
                if event.name == "Method::execute":
                    wall += sum(times)
                    continue
                if event.name in _CONTAINERS:
                    continue
                if event.is_delegated_op:
                    op = re.sub(r"\s+#\d+$", "", event.name)  # XNNPACK's "Convolution (NHWC, F32) IGEMM #3"
                else:
                    op = f"{event.name.removeprefix('native_call_').removesuffix('.out')} (portable, outside the delegate)"
                total = totals.setdefault(op, [0.0, 0])
                total[0] += sum(times)
                total[1] += len(times)
        if not totals:
            return {"available": False, "reason": "ETDump recorded no operator events"}
        if XNNPACK_UNNAMED in totals:
            totals[_lookup_table_name(path)] = totals.pop(XNNPACK_UNNAMED)
        return shared.top_ops(
            {op: (ms, n) for op, (ms, n) in totals.items()},
            wall,
            runs,
            "ExecuTorch ETDump (executorch.devtools.Inspector)",
        )


FORMAT = ExecuTorchFormat()
