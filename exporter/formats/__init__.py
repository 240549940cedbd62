"""Export formats: the registry. Each format is one module exposing one object, `FORMAT`, that implements
the interface declared in formats/interface.py (`Format`: name, suffix, precisions, options, export(), load(),
and the optional hooks preflight, proxies, proxies_version, per_inference_ranges, memory and profile, each with
its default there). The engine calls a format only through that object, got from `FORMATS[name].format()`.

A new format is its module and one line in FORMATS below; the engine's calls on formats stay as they are.

A torchvision int8 weight (already quantized in eager mode) is exported only by formats whose
FormatSpec has no `no_quantized_eager` reason; the others are reported `unavailable` with it.

`options` come from the target profile's [[artifacts]] `options` table. export() or load() may
raise RuntimeUnavailable (no GPU, no macOS): the artifact is then reported `unavailable`, not
`failed`. No format knows about validation, targets or the CLI. This module imports no torch and
no format module (FormatSpec.format() does, when asked).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from ..errors import MissingExtraError
from .interface import Format


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
    runs_on_aarch64: bool = False  # the aarch64 runner (exporter.aarch64) has its runtime
    # where alone its runtime runs, when that is neither this host nor the aarch64 runner: nothing of it is run
    # or measured here (it is validated through proxies, if the format has them)
    runs_only_on: str | None = None
    app_runtime: str = ""  # what an app links to run the file ("Ship for <target>" names it)
    # what the file takes under every input format, when the format has its own image input (Core ML's image type,
    # the weight's preprocessing inside); None: the build's input format (float32-nchw or uint8-nhwc)
    own_image_input: str | None = None
    # why its artifact keeps the fixed input size when a segmentation target asks for a dynamic one ([input]
    # size_range), measured; None: it takes `size_range="MIN:MAX"` as an export option
    fixed_size: str | None = "its export takes one input size"

    def installed(self) -> bool:
        # find_spec, not an import: coremltools and executorch take seconds to import, and a
        # build whose artifacts all come from the cache never needs them
        try:
            return all(importlib.util.find_spec(package) is not None for package in self.requires)
        except (ImportError, ValueError):
            return False

    def format(self) -> Format:
        """The format's object (its module's FORMAT), importing the module; MissingExtraError without its extra."""
        if not self.installed():
            raise MissingExtraError(f"format '{self.name}'", self.extra)
        return importlib.import_module(self.module).FORMAT


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
            runs_on_aarch64=True,
            app_runtime="the ExecuTorch runtime (XNNPACK backend)",
            fixed_size=None,  # a bilinear resize of dynamic size runs outside XNNPACK, on a portable kernel
        ),
        FormatSpec(
            "torchscript_lite",
            "exporter.formats.torchscript_lite",
            "android",
            (),
            runs_on_aarch64=True,
            app_runtime="PyTorch Mobile's lite interpreter (end-of-life)",
            fixed_size="PyTorch Mobile is end-of-life: its dynamic sizes are not offered",
        ),
        FormatSpec(
            "litert",
            "exporter.formats.litert",
            "litert",
            ("litert_torch", "ai_edge_litert"),
            "litert-torch converts a torch.export graph, and its int8 comes from PT2E quantization of the float "
            "model; build the float weight (meta['unquantized']) for an int8 .tflite",
            runs_on_aarch64=True,
            app_runtime="LiteRT (TensorFlow Lite, XNNPACK delegate)",
            fixed_size="litert-torch 0.10 converts a dynamic height and width but fixes every inner shape at the "
            "traced size: the .tflite fails to allocate at any other (measured)",
        ),
        FormatSpec(
            "onnx",
            "exporter.formats.onnx",
            "jetson",
            ("onnx", "onnxruntime", "onnxscript"),
            "the ONNX exporter (dynamo) traces with torch.export, which does not take eager-mode quantized "
            "modules; build the float weight (meta['unquantized']) for an int8 Q/DQ ONNX",
            runs_on_aarch64=True,
            app_runtime="ONNX Runtime",
            fixed_size=None,
        ),
        FormatSpec(
            "tensorrt",
            "exporter.formats.tensorrt",
            "jetson",
            (),
            "TensorRT engines are built from the ONNX export, which cannot take it",
            runs_only_on="a TensorRT engine is built for one GPU and runs only there",
            app_runtime="TensorRT (the engine built on the device from the ONNX file)",
            fixed_size="its engine's optimization profile covers the batch only",
        ),
        FormatSpec(
            "coreml",
            "exporter.formats.coreml",
            "ios",
            ("coremltools",),
            "Core ML converts a torch.export graph, which does not take eager-mode quantized modules; "
            "build the float weight (meta['unquantized']) and compress it in Core ML",
            runs_only_on="Core ML runs only on Apple's runtime (macOS/iOS)",
            app_runtime="Core ML",
            own_image_input="Core ML's own: an RGB image (its image type; the scaling and the weight's mean/std "
            "inside), or with option input=tensor the float32-nchw tensor (details.input says which)",
            fixed_size="Core ML cannot predict on Linux, so a flexible-size package could not be validated here",
        ),
    )
}
