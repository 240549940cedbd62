"""int8's inputs: the calibration images split into range images and held-out check images
(exporter.quant.calibration), and the budget a target's thresholds and --quant-budget make of it."""

from __future__ import annotations

import pytest
import torch

from exporter.engine import profiles
from exporter.engine.plan import make as make_plan
from exporter.engine.request import Overrides
from exporter.errors import UsageError
from exporter.quant import SETTINGS, Calibration

from .helpers import assert_clean_refusal, build_args, run_cli


def test_calibration_split_holds_out_disjoint_interleaved_images():
    images = [torch.full((1, 3, 2, 2), float(i)) for i in range(10)]
    labels = torch.arange(10) % 3
    ranges, check, check_labels = Calibration(images, labels).split()
    seen = sorted(int(x[0, 0, 0, 0]) for x in ranges + check)
    assert seen == list(range(10)) and len(check) == 5  # every image once, half held out
    assert [int(x[0, 0, 0, 0]) for x in check] == [1, 3, 5, 7, 9]
    assert check_labels.tolist() == [labels[i].item() for i in (1, 3, 5, 7, 9)]
    # another fraction holds out that share, not the nearest 1/k of it; a small one still holds one image out
    for fraction, held in ((0.75, 96), (0.05, 6), (0.004, 1)):
        images = [torch.full((1,), float(i)) for i in range(128)]
        ranges, check, _ = Calibration(images, None, settings={**SETTINGS, "check_fraction": fraction}).split()
        assert len(check) == held and len(ranges) == 128 - held, (fraction, len(check))
        assert len({float(x) for x in check} | {float(x) for x in ranges}) == 128


def test_budget_follows_int8_thresholds_unless_overridden():
    profile = profiles.with_overrides(
        profiles.load("jetson"),
        Overrides(
            thresholds=("int8.psnr_db=33",),
            quant_budget=("top1_agreement=0.995", "max_float_fraction=0.1", "dynamic_ranges=False"),
            fallback=False,
        ),
    )
    plan = make_plan(profile, "classification")
    budget, settings = plan.quant_budget, plan.quant_settings
    assert budget["psnr_db"] == 33 and budget["top1_agreement"] == 0.995
    assert settings["max_float_fraction"] == 0.1 and settings["fallback"] is False
    assert (
        settings["dynamic_ranges"] is False
        and make_plan(profiles.load("android"), "classification").quant_settings["dynamic_ranges"] is True
    )
    with pytest.raises(UsageError, match="unknown key"):
        profiles.check({**profile, "quantization": {"bogus": 1}}, "test")
    with pytest.raises(UsageError, match="onnx_calibration"):
        profiles.check({**profile, "quantization": {"onnx_calibration": "entropy"}}, "test")


@pytest.mark.parametrize(
    "budget, message",
    [
        ("psnr=30", "unknown key 'psnr'"),
        ("psnr_db=high", "not a number"),
        ("max_float_fraction=2", "fraction"),
        ("fallback=1", "unknown key"),
        ("dynamic_ranges=maybe", "true or false"),
    ],
)
def test_bad_quant_budget_exits_2_and_writes_nothing(digits_model, tmp_path, budget, message):
    out = tmp_path / "out"
    assert_clean_refusal(run_cli(*build_args(digits_model, out, "--quant-budget", budget)), out, message)
