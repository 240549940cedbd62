"""Non-finite numbers (issue 61, item 7): a NaN or infinite eager reference is refused before anything is exported,
an artifact whose outputs are not finite fails with a reason of kind NON_FINITE, and the manifest writer writes
whatever a metric holds (NaN as null, infinities as "inf"/"-inf")."""

from __future__ import annotations

import json
import math

import pytest
import torch

from exporter import validation
from exporter.release import manifest
from exporter.results import Kind
from exporter.tasks import classification

from .helpers import assert_clean_refusal, run_cli

THRESHOLDS = {"top1_agreement": 0.5, "psnr_db": 30.0}


def _nan_checkpoint(model, path):
    """The digits stand-in with one weight tensor (its first convolution's) all NaN."""
    state = torch.load(model.checkpoint, map_location="cpu", weights_only=True)
    name = next(k for k, v in state.items() if v.is_floating_point() and v.dim() > 1)
    state[name] = torch.full_like(state[name], float("nan"))
    torch.save(state, path)
    return path


def test_a_nan_checkpoint_is_refused_before_anything_is_exported(digits_model, tmp_path):
    """It ended in exit 3 and a traceback at the manifest write (ValueError: Out of range float values are not
    JSON compliant: nan), after the export; now exit 2, one line naming the checkpoint and the inputs, and --out
    left as it was."""
    checkpoint = _nan_checkpoint(digits_model, tmp_path / "nan.pth")
    out = tmp_path / "out"
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        checkpoint,
        "--no-verify",
        "--target",
        "android",
        "--format",
        "executorch:fp32",
        "--val-size",
        "8",
        "--calib-size",
        "8",
        "--out",
        out,
        "--quiet",
    )
    assert_clean_refusal(result, out, f"checkpoint {checkpoint}", "NaN or infinite on 8 of 8 validation inputs")
    assert not out.exists()


def test_non_finite_inputs_counts_the_inputs_with_any_non_finite_output():
    outputs = torch.zeros(5, 3)
    assert validation.non_finite_inputs(outputs) == 0
    outputs[1, 0], outputs[1, 2], outputs[4, 1] = float("nan"), float("inf"), -float("inf")
    assert validation.non_finite_inputs(outputs) == 2
    assert validation.non_finite_inputs(outputs.reshape(5, 3, 1, 1)) == 2  # one row per input, whatever the shape


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_artifact_with_non_finite_outputs_fails_with_kind_non_finite(bad):
    """A runner whose outputs are not finite, through the whole contract (validation.evaluate): failed, and the
    first reason says so with its kind; no metric holds a NaN, and the manifest writes."""
    task = classification.Classification(num_classes=10, input_size=(4, 4))
    inputs = torch.randn(8, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))

    def eager(x):
        return x.flatten(1) @ weight

    def artifact(x):
        y = eager(x)
        y[0, 3] = bad
        return y

    reference = validation.run_all(eager, inputs)
    context = validation.EagerReference(task, eager, inputs, reference)
    metrics, outputs = validation.evaluate(context, artifact, THRESHOLDS, timed=False)
    assert not torch.isfinite(outputs).all()
    assert metrics["status"] == "failed"
    assert metrics["reasons"][0].kind is Kind.NON_FINITE, metrics["reasons"]
    assert "8 of 8 inputs" in metrics["reasons"][0].text
    text = manifest.dumps({"artifacts": [metrics]})
    assert json.loads(text)["artifacts"][0]["reasons"][0]["kind"] == "non_finite"


def test_the_manifest_writer_writes_nan_as_null_and_infinities_as_text():
    doc = {
        "fidelity": {"psnr_db": float("nan"), "cosine": 0.5},
        "golden_fidelity": {"psnr_db": float("inf"), "max_abs_error": -float("inf")},
        "rows": [float("nan"), 1.0, (float("inf"),)],
    }
    text = manifest.dumps(doc)
    assert "NaN" not in text and "Infinity" not in text  # strict JSON: every reader takes it
    back = json.loads(text)
    assert back["fidelity"] == {"psnr_db": None, "cosine": 0.5}
    assert back["golden_fidelity"] == {"psnr_db": "inf", "max_abs_error": "-inf"}
    assert back["rows"] == [None, 1.0, ["inf"]]
    assert math.isnan(doc["fidelity"]["psnr_db"])  # the document itself is left as it was
