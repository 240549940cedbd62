"""What the bench builds, times and compares: the models, the runtime rows, the ratios between rows."""

from __future__ import annotations

from pathlib import Path

from ..precision import Precision

# model -> the weight whose task, class count, input size and preprocessing it is benchmarked with
MODELS = {
    "mobilenet_v3_large": "MobileNet_V3_Large_Weights.IMAGENET1K_V2",
    "resnet18": "ResNet18_Weights.IMAGENET1K_V1",
    "resnet50": "ResNet50_Weights.IMAGENET1K_V2",
    "convnext_tiny": "ConvNeXt_Tiny_Weights.IMAGENET1K_V1",
    "inception_v3": "Inception_V3_Weights.IMAGENET1K_V1",
    "lraspp_mobilenet_v3_large": "LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1",
    "deeplabv3_mobilenet_v3_large": "DeepLabV3_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1",
    "ssdlite320_mobilenet_v3_large": "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1",
}
# where the tests cache the trained digits stand-ins (tests/conftest.py): EXPORTER_TEST_CACHE or .cache/digits
# (row label, format, precision, int8 budget): "plain" is PTQ with no fallback; "budget" keeps layers in
# float until BUDGET_PSNR_DB holds on held-out calibration images, to show what fallback costs in speed
RUNTIMES = [
    ("pte fp32", "executorch", Precision.FP32, None),
    ("pte fp16", "executorch", Precision.FP16, None),
    ("pte int8 dynamic", "executorch", Precision.INT8_DYNAMIC, None),
    ("pte int8 plain", "executorch", Precision.INT8, "plain"),
    ("pte int8 budget", "executorch", Precision.INT8, "budget"),
    ("ptl fp32", "torchscript_lite", Precision.FP32, None),
    ("tflite fp32", "litert", Precision.FP32, None),
    ("tflite fp16", "litert", Precision.FP16, None),
    ("tflite int8 dynamic", "litert", Precision.INT8_DYNAMIC, None),
    ("tflite w8a16", "litert", Precision.W8A16, "plain"),  # calibrated ranges, no budget search
    ("tflite int8 plain", "litert", Precision.INT8, "plain"),
    ("tflite int8 budget", "litert", Precision.INT8, "budget"),
    ("onnx fp32 (ORT)", "onnx", Precision.FP32, None),
    ("onnx int8 plain (ORT)", "onnx", Precision.INT8, "plain"),
    ("onnx int8 budget (ORT)", "onnx", Precision.INT8, "budget"),
]
# The fp32 ONNX file again, in a session without ONNX Runtime's NCHWc layout transform: its blocked-layout
# kernels exist for x86 only, and the aarch64 wheel (the Jetson's) runs the same file without them (its optimised
# graph has no NCHWc node), so this is the graph ONNX Runtime runs on ARM, timed on this host.
ORT_AS_ON_ARM = "onnx fp32 (ORT, no NCHWc)"
# ONNX Runtime raced with its own int8 recipe (its quantization docs: quant_pre_process, then quantize_static to QDQ
# with uint8 activations and per-channel int8 weights, calibrated on the same images), not our TensorRT-style Q/DQ
# (int8 activations), which its CPU kernels do not accelerate: the peer at its best (a bench row, not a product file)
ORT_OWN_INT8 = "onnx int8 (ORT quantize_static)"
# (row label, format, the float row it is compared with): the fp32 file again, taking uint8 N x H x W x 3
UINT8_RUNTIMES = [
    ("pte fp32 uint8", "executorch", "pte fp32"),
    ("onnx fp32 uint8 (ORT)", "onnx", "onnx fp32 (ORT)"),
]
UNREWRITTEN = "pte fp32 (no rewrites)"  # timed where formats.rewrites changed the .pte fp32
# (name, a, b): how many times faster a is than b (p50 of b over p50 of a), compared with the baseline run
RATIOS = [
    ("pte fp32 / eager", "pte fp32", "eager"),
    ("pte fp32 vs ORT fp32", "pte fp32", "onnx fp32 (ORT)"),
    ("pte fp32 vs ORT no NCHWc", "pte fp32", ORT_AS_ON_ARM),
    ("pte rewrites gain", "pte fp32", UNREWRITTEN),
    ("pte int8 plain vs pte fp32", "pte int8 plain", "pte fp32"),
    ("pte int8 budget vs plain", "pte int8 budget", "pte int8 plain"),
    ("pte fp32 vs tflite fp32", "pte fp32", "tflite fp32"),
    ("pte int8 plain vs tflite int8 plain", "pte int8 plain", "tflite int8 plain"),
    ("pte int8 budget vs tflite int8 budget", "pte int8 budget", "tflite int8 budget"),
    ("onnx int8 budget vs plain", "onnx int8 budget (ORT)", "onnx int8 plain (ORT)"),
    ("ptl / eager", "ptl fp32", "eager"),
    *((f"{label} vs float", label, float_row) for label, _, float_row in UINT8_RUNTIMES),
]
PROFILED = ("pte fp32", "onnx fp32 (ORT)")  # top operators of each, per model
BASELINE = Path("docs/bench-baseline.json")  # the previous committed run, compared by ratio
REGRESSION = 0.8  # a ratio below this share of the baseline's is shown as a possible regression
BUDGET_PSNR_DB = 35.0
CALIBRATION_IMAGES = 32
