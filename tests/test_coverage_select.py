"""Which weights a sweep covers and which it refuses by design (exporter.coverage.select), asked of the exporter
without building."""

from __future__ import annotations

import json

from .helpers import run_cli


def test_a_target_the_build_refuses_is_a_refused_row_without_a_build(tmp_path):
    """As `exporter build` refuses it (Faster R-CNN makes nothing for Android): ⛔ with each format's reason, no
    build process, and the row has its own progress line."""
    out = tmp_path / "out"
    result = run_cli(
        "coverage",
        "--models",
        "fasterrcnn_mobilenet_v3_large_320_fpn",
        "--task",
        "detection",
        "--one-per-builder",
        "--target",
        "android",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads((out / "coverage.json").read_text())["rows"]
    assert row["outcome"] == "refused" and row["cells"] == [] and row["seconds"] == 0.0, row
    assert "executorch: cannot take a detection graph" in row["reason"] and "nms and roi_align" in row["reason"]
    assert "[1/1] FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1 android: ⛔ refused" in result.stderr
