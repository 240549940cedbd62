"""An ill-conditioned reference (issue 61, item 1): when an artifact fails fidelity, every build checks whether eager
itself, rounded to the artifact's precision, breaks the same thresholds on the same inputs, and if so says that
the failure is the checkpoint's, not the export's (a reason of kind ILL_CONDITIONED_REFERENCE)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from torch import nn

from exporter import validation
from exporter.engine import conditioning
from exporter.results import ArtifactResult, Kind
from exporter.tasks import classification

from .helpers import build_args, run_cli

THRESHOLDS = {"top1_agreement": 0.9, "psnr_db": 60.0}


class Cancelling(nn.Module):
    """logits = W (x + big) - W big: exactly W x, but float32 rounds x away under `big` (float64 keeps it)."""

    def __init__(self, big: float):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 10)
        self.big = big

    def forward(self, x):
        return self.linear(x.flatten(1) + self.big) - self.linear.weight.sum(1) * self.big


def _setup(big: float):
    task = classification.Classification(num_classes=10, input_size=(4, 4))
    model = Cancelling(big).eval()
    inputs = torch.randn(16, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    reference = validation.run_all(model, inputs)
    return task, model, inputs, reference


def _session(task, model, inputs, reference):
    """What conditioning.note_ill_conditioned reads of a build's session."""
    return SimpleNamespace(
        task=task,
        loaded=SimpleNamespace(eager=model),
        inputs=SimpleNamespace(validation=inputs, calibration=[x[None] for x in inputs[:4]]),
        reference=reference,
    )


def _validated(task, model, inputs, reference, runner, precision="fp32") -> ArtifactResult:
    """An artifact's entry as the pipeline has it after validation, the conditioning check included."""
    context = validation.EagerReference(task, model, inputs, reference)
    metrics, _ = validation.evaluate(context, runner, THRESHOLDS, timed=False)
    entry = ArtifactResult("a", "f", precision, thresholds=dict(THRESHOLDS))
    entry.update(metrics)
    conditioning.note_ill_conditioned(_session(task, model, inputs, reference), entry)
    return entry


def _exact(model):
    """A correct float runtime that happens to compute exactly (float64, then rounded to float32 once)."""
    double = Cancelling(model.big).double().eval()
    double.load_state_dict(model.state_dict())
    return lambda x: double(x.double()).float()


def test_an_ill_conditioned_reference_is_named_when_the_artifact_fails():
    task, model, inputs, reference = _setup(big=1e6)
    entry = _validated(task, model, inputs, reference, _exact(model))
    assert entry.status == "failed"
    assert entry.fidelity["psnr_db"] < THRESHOLDS["psnr_db"], entry.fidelity  # the export is right...
    kinds = [r.kind for r in entry.reasons]
    assert kinds[0] is Kind.THRESHOLD and kinds[-1] is Kind.ILL_CONDITIONED_REFERENCE, entry.reasons
    text = entry.reasons[-1].text
    assert "eager computed in float64 instead of float32" in text and "psnr_db" in text
    assert "the checkpoint's" in text and "not the export's" in text
    json.loads(json.dumps([r.to_json() for r in entry.reasons]))  # a reason like the others in the manifest


def test_a_bad_artifact_on_a_well_conditioned_reference_is_not_excused():
    task, model, inputs, reference = _setup(big=0.0)
    noise = torch.Generator().manual_seed(2)
    entry = _validated(task, model, inputs, reference, lambda x: model(x) + torch.randn(1, 10, generator=noise))
    assert entry.status == "failed" and entry.reasons, entry
    assert Kind.ILL_CONDITIONED_REFERENCE not in {r.kind for r in entry.reasons}, entry.reasons
    # eager in float64 is that close to eager in float32 on these inputs: nothing to excuse
    floor = conditioning.outputs(model, inputs, "fp32").reshape(len(inputs), -1)
    assert task.fidelity(reference, floor)["psnr_db"] > THRESHOLDS["psnr_db"]


def test_an_artifact_far_worse_than_its_ill_conditioned_reference_is_not_excused():
    """The floor breaks psnr_db too, but the artifact sits far below it: more than any rounding explains."""
    task, model, inputs, reference = _setup(big=1e6)
    entry = _validated(task, model, inputs, reference, lambda x: -model(x))
    assert entry.status == "failed"
    assert Kind.ILL_CONDITIONED_REFERENCE not in {r.kind for r in entry.reasons}, entry.reasons


def test_a_passing_artifact_costs_nothing(monkeypatch):
    task, model, inputs, reference = _setup(big=1e6)
    monkeypatch.setattr(conditioning, "outputs", lambda *a, **k: pytest_fail("a floor computed for a pass"))
    entry = _validated(task, model, inputs, reference, model)  # eager itself: bit-identical
    assert entry.status == "passed" and entry.reasons == []


def test_a_non_finite_artifact_is_not_excused(monkeypatch):
    task, model, inputs, reference = _setup(big=1e6)
    monkeypatch.setattr(conditioning, "outputs", lambda *a, **k: pytest_fail("a floor computed for NaN outputs"))
    entry = _validated(task, model, inputs, reference, lambda x: model(x) * float("nan"))
    assert [r.kind for r in entry.reasons][0] is Kind.NON_FINITE
    assert Kind.ILL_CONDITIONED_REFERENCE not in {r.kind for r in entry.reasons}


def test_the_int8_floor_is_the_dynamic_one_or_the_static_one():
    """An int8 artifact is judged against both int8 floors (coverage.conditioning's): a model whose one outlier
    channel crushes every other under a per-tensor range breaks them, and the reason says which rounding."""
    task = classification.Classification(num_classes=10, input_size=(4, 4))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
    with torch.no_grad():  # one hidden unit 1000x larger, the next layer's weight for it 1000x smaller
        model[1].weight[0] *= 1000
        model[1].bias[0] = 1000 * model[1].bias[0].abs() + 1000
        model[3].weight[:, 0] /= 1000
    inputs = torch.randn(16, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    reference = validation.run_all(model, inputs)
    floor = conditioning.outputs(model, inputs, "int8").reshape(len(inputs), -1)
    context = validation.EagerReference(task, model, inputs, reference)
    metrics, _ = validation.evaluate(context, lambda x: conditioning.outputs(model, x, "int8"), THRESHOLDS, timed=False)
    assert task.fidelity(reference, floor)["psnr_db"] < THRESHOLDS["psnr_db"]
    entry = ArtifactResult("a", "f", "int8", thresholds=dict(THRESHOLDS))
    entry.update(metrics)
    conditioning.note_ill_conditioned(_session(task, model, inputs, reference), entry)
    assert entry.reasons[-1].kind is Kind.ILL_CONDITIONED_REFERENCE, entry.reasons
    assert "every layer's output to int8" in entry.reasons[-1].text


def pytest_fail(message):
    raise AssertionError(message)


def _cancelling_checkpoint(model, path, big: float):
    """The digits stand-in computing the same function with a cancellation float32 cannot carry: one unit of
    its classifier's hidden layer shifted by `big` (past Hardswish's bend, where it is the identity) and the
    shift taken back out of the logits' bias. Eager in float32 loses what float64 keeps."""
    state = torch.load(model.checkpoint, map_location="cpu", weights_only=True)
    state["classifier.0.bias"][0] += big
    state["classifier.3.bias"] -= state["classifier.3.weight"][:, 0] * big
    torch.save(state, path)
    return path


def test_a_build_says_when_its_checkpoint_is_ill_conditioned(digits_model, tmp_path):
    """End to end: the fp32 .pte of a checkpoint whose float32 eager is far from its float64 self fails psnr_db,
    and the manifest's reasons say that eager in float64 breaks it too."""
    checkpoint = _cancelling_checkpoint(digits_model, tmp_path / "cancelling.pth", big=1e7)
    out = tmp_path / "out"
    args = build_args(digits_model, out, "--target", "android", "--format", "executorch:fp32", "--no-verify")
    args[args.index("--checkpoint") + 1] = checkpoint
    result = run_cli(*args)
    assert result.exit_code == 1, result.output
    entry = json.loads((out / "manifest.json").read_text())["artifacts"][0]
    kinds = [r["kind"] for r in entry["reasons"]]
    assert "threshold" in kinds and kinds[-1] == Kind.ILL_CONDITIONED_REFERENCE.value, entry["reasons"]
    assert "float64" in entry["reasons"][-1]["text"], entry["reasons"]
