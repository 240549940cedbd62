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
    # int8 weights, int16 activations with ranges fixed on the calibration images (LiteRT's static_wi8_ai16: the
    # interpreter's builtin int16 kernels, not XNNPACK's)
    W8A16 = "w8a16"


# the precisions whose activation ranges are fixed on calibration images: their export is given them
CALIBRATED = frozenset({Precision.INT8, Precision.W8A16})


# A CPU feature an artifact declares it needs (its details' "cpu_needs"), as formats write it and the aarch64 rows
# and bundles read it: an fp16 .pte computes in half precision whatever the core (an fp16 .tflite needs nothing:
# XNNPACK computes it in fp32 on a core without FP16 arithmetic).
NEEDS_FP16_ARITHMETIC = "fp16_arithmetic"
# ... as a bundle says it
FP16_ARITHMETIC_NEEDED = (
    "Armv8.2-A FP16 arithmetic (Cortex-A55, A75, A76 and later) for its gain; a core without it (Cortex-A53, "
    "A57, A72) runs it at more instructions than the fp32 program where counted (the aarch64 rows)"
)
