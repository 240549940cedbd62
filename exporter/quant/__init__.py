"""The one int8 step every format goes through: calibration ranges, layer sensitivity, and float
fallback until the accuracy budget holds on held-out calibration images.

Formats ask a backend here for a quantized graph (`pt2e.Pt2eBackend` for ExecuTorch, `onnx_qdq.OnnxQdqBackend`
for Q/DQ ONNX) and run it through `quantize_with_budget`; the report it returns goes into the
manifest as the artifact's `details.quantization`."""

from .calibration import ONNX_CALIBRATIONS, SETTINGS, Calibration


def quantize_with_budget(*args, **kwargs):
    from .search import quantize_with_budget as search  # torch is imported only when quantizing

    return search(*args, **kwargs)


__all__ = ["Calibration", "ONNX_CALIBRATIONS", "SETTINGS", "quantize_with_budget"]
