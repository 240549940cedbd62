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
