"""Export formats. Each is one module with the same small interface:

    NAME, SUFFIX, PRECISIONS, OPTIONS (option names it accepts)
    export(model, example, precision, calib, path, meta, **options) -> dict  # writes `path`, returns details
    load(path, threads) -> Runner                                             # Runner(x: Tensor) -> Tensor

`meta` describes the weight: {"weight", "model", "labels", "preprocessing", "exporter_version"}.

Optional:
    proxies(path, model) -> dict[str, Runner]   # stand-ins measured when the runtime is unavailable; a
                                                # runner with a `shared_key` is the same for every artifact
                                                # of one model (eager in fp16): measured once per build
    preflight(precision, **options) -> None     # raise UsageError / RuntimeUnavailable before any work
    memory(path, input_shape, threads) -> dict  # RAM: planned/constant bytes, peak RSS of a fresh process (formats/memory.py)
    profile(path, example, runs, threads) -> dict  # top operators by time from the runtime's own profiler

A torchvision int8 weight (already quantized in eager mode) is exported only by formats whose
FormatSpec has no `no_quantized_eager` reason; the others are reported `unavailable` with it.

`options` come from the target profile's [[artifacts]] `options` table. Either function may
raise RuntimeUnavailable (no GPU, no macOS): the artifact is then reported `unavailable`, not
`failed`. No format knows about validation, targets or the CLI.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from ..errors import MissingExtraError

if TYPE_CHECKING:  # the registry itself needs no torch
    import torch

    Runner = Callable[[torch.Tensor], torch.Tensor]


class RuntimeUnavailable(Exception):
    """The artifact exists but cannot be run on this host (the reason is the message)."""


@dataclass(frozen=True)
class FormatSpec:
    name: str
    module: str
    extra: str
    requires: tuple[str, ...]
    # why the format cannot take a model already quantized in eager mode (torchvision's int8
    # weights), checked before any export; None when it can
    no_quantized_eager: str | None = None

    def installed(self) -> bool:
        # find_spec, not an import: coremltools and executorch take seconds to import, and a
        # build whose artifacts all come from the cache never needs them
        try:
            return all(importlib.util.find_spec(package) is not None for package in self.requires)
        except (ImportError, ValueError):
            return False

    def load_module(self) -> ModuleType:
        if not self.installed():
            raise MissingExtraError(f"format '{self.name}'", self.extra)
        return importlib.import_module(self.module)


FORMATS = {
    spec.name: spec
    for spec in (
        FormatSpec(
            "executorch",
            "exporter.formats.executorch",
            "android",
            ("executorch",),
            "ExecuTorch lowers a torch.export graph, and its int8 comes from PT2E quantization of the "
            "float model; build the float weight (meta['unquantized']) for an int8 .pte",
        ),
        FormatSpec("torchscript_lite", "exporter.formats.torchscript_lite", "android", ()),
        FormatSpec(
            "onnx",
            "exporter.formats.onnx",
            "jetson",
            ("onnx", "onnxruntime", "onnxscript"),
            "the ONNX exporter (dynamo) traces with torch.export, which does not take eager-mode quantized "
            "modules; build the float weight (meta['unquantized']) for an int8 Q/DQ ONNX",
        ),
        FormatSpec(
            "tensorrt",
            "exporter.formats.tensorrt",
            "jetson",
            (),
            "TensorRT engines are built from the ONNX export, which cannot take it",
        ),
        FormatSpec(
            "coreml",
            "exporter.formats.coreml",
            "ios",
            ("coremltools",),
            "Core ML converts a torch.export graph, which does not take eager-mode quantized modules; "
            "build the float weight (meta['unquantized']) and compress it in Core ML",
        ),
    )
}
