"""The numeric precision an artifact is made in, one member each (torch-free, imports nothing of ours).

A `StrEnum`: a member is its string wherever one was used before (`Precision.INT8 == "int8"`, a dict key, an
f-string, JSON), so manifests, cache keys and target profiles read the same. A format declares the members it makes
(`Format.precisions`)."""

from __future__ import annotations

from enum import StrEnum


class Precision(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"  # half-precision weights and activations (ONNX/TensorRT fp16 graphs, Core ML's compute precision)
    INT8 = "int8"  # int8 weights and activations (PT2E or Q/DQ static quantization, or a torchvision int8 weight)
    # int8 weights, each activation quantized per inference from its own range: no calibration images (PT2E,
    # XNNPACKQuantizer is_dynamic: the layers XNNPACK has a dynamic int8 kernel for; the rest in float)
    INT8_DYNAMIC = "int8_dynamic"


# What an fp16 program for an Arm CPU (ExecuTorch/LiteRT through XNNPACK) asks of the core, as a bundle says it.
FP16_ARITHMETIC_NEEDED = (
    "Armv8.2-A FP16 arithmetic (Cortex-A55, A75, A76 and later) for its gain; a core without it (Cortex-A53, "
    "A57, A72) runs it at more instructions than the fp32 program where counted (the aarch64 rows)"
)
