"""ExecuTorch program (.pte) lowered to the XNNPACK delegate, fp32 or int8 (PT2E static)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

NAME = "executorch"
SUFFIX = ".pte"
OPTIONS = ()
PRECISIONS = ("fp32", "int8")


def _quantize(exported, calib):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(exported.module(), quantizer)
    with torch.no_grad():
        for x in calib:
            prepared(x)
    return convert_pt2e(prepared)


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
    }


def export(model, example, precision, calib, path: Path, meta: dict) -> dict:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad():
        exported = torch.export.export(model, (example,))
        if precision == "int8":
            exported = torch.export.export(_quantize(exported, calib), (example,))
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    details = {"delegation": _delegation(edge.exported_program())}
    program = edge.to_executorch()
    path.write_bytes(program.buffer)
    return details


def runtime_version() -> str:
    from importlib.metadata import version

    return version("executorch")


@contextlib.contextmanager
def _native_stderr_silenced():
    """The runtime's C++ logging (cpuinfo probing, threadpool resets) writes straight to fd 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def load(path: Path, threads: int):
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch.runtime import Runtime

    with _native_stderr_silenced():
        _unsafe_reset_threadpool(threads)
        method = Runtime.get().load_program(Path(path)).load_method("forward")
    return lambda x: method.execute([x.contiguous()])[0]
