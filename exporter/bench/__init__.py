"""`make bench`: eager vs every CPU runtime, side by side in one run, same thread count.

Random weights are fine here: this measures latency only (fidelity is the tests' job). Each model runs at
its weight's own input size and preprocessing: classifiers 224x224, LR-ASPP 520x520, SSDlite 320x320.
SSDlite's graph is its raw heads; the numpy post-processing (decode + NMS) is timed apart, on the heads of
the trained digits stand-in (random heads put every class of every anchor above the score threshold: a
worst case, also reported), and beside it the stand-in's ONNX file with the decode inside (`--detections graph`),
timed on the same canvases. The `uint8` rows are the fp32 `.pte` and ONNX file taking image bytes
(`--input-format uint8-nhwc`: the cast, scaling and mean/std inside the graph), fed the same image as bytes.
Usage: python -m exporter.bench [--models m1,m2] [--threads N] [--iterations N] [--out DIR]
"""

from .report import against_baseline, ratios, table
from .rows import ORT_AS_ON_ARM, RATIOS, RUNTIMES

__all__ = ["against_baseline", "ratios", "table", "ORT_AS_ON_ARM", "RATIOS", "RUNTIMES"]
