"""--input-size-range (exporter.engine.validate_sizes): which artifacts take a dynamic height and width, and the bad
ranges refused before anything is written. The builds that use it: tests/test_segmentation.py."""

from __future__ import annotations

import pytest

from exporter.engine import profiles
from exporter.engine.plan import make
from exporter.engine.request import Overrides
from exporter.engine.validate_sizes import bounds_of, checked_sizes
from exporter.formats import FORMATS

from .helpers import assert_clean_refusal, run_cli

LRASPP = "LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1"


def test_only_formats_that_take_a_dynamic_size_are_exported_with_one():
    for target in ("android", "ios", "jetson"):
        profile = profiles.with_overrides(profiles.load(target), Overrides(size_range=(64, 320)))
        plan = make(profile, "segmentation")
        assert plan.size_range == (64, 320) and plan.describe()["input"]["size_range"] == [64, 320]
        for spec in plan.artifacts:
            takes = FORMATS[spec.format].fixed_size is None
            assert bounds_of(spec) == ((64, 320) if takes else None), spec
            assert takes == (spec.format in ("onnx", "executorch"))
    assert checked_sizes((64, 320)) == [(64, 64), (320, 320), (64, 320)]
    assert checked_sizes((128, 128)) == [(128, 128)]


@pytest.mark.parametrize(
    "weight, extra, needle",
    [
        ("ResNet18_Weights.IMAGENET1K_V1", [], "only segmentation graphs take a dynamic height and width"),
        (LRASPP, ["--input-size", "128", "128"], None),  # the range 16..256 below
        (LRASPP, ["--input-size", "512", "512"], "leaves out the input size 512x512"),
    ],
)
def test_a_range_the_graph_cannot_take_is_refused_in_one_line(tmp_path, weight, extra, needle):
    out = tmp_path / "out"
    low = "16" if needle is None else "64"
    result = run_cli(
        "build", weight, "--target", "jetson", "--offline", "--out", out, "--input-size-range", low, "256", *extra
    )
    assert_clean_refusal(result, out, needle or "below this model's smallest side, 32 px")


@pytest.mark.parametrize("bounds", [("64", "5000"), ("300", "200"), ("0", "64")])
def test_bounds_past_4096_or_reversed_are_refused_in_one_line(tmp_path, bounds):
    out = tmp_path / "out"
    result = run_cli("build", LRASPP, "--target", "jetson", "--offline", "--out", out, "--input-size-range", *bounds)
    assert_clean_refusal(result, out, "size_range: expected [MIN, MAX], whole numbers with 1 <= MIN <= MAX <= 4096")
