"""How well a random reference can judge each precision (exporter.coverage.conditioning): eager itself
rounded to fp16, int8 (dynamic and static ranges) and float64, and a quantized weight against its float model."""

from __future__ import annotations

import torch
from torch import nn

from exporter.coverage import outcome
from exporter.results import Kind

from .helpers import QUANTIZED_WEIGHT


def _task(num_classes: int):
    from exporter.tasks import Classification

    return Classification(num_classes=num_classes, input_size=(4, 4))


THRESHOLDS = {
    "fp32": {"top1_agreement": 1.0, "psnr_db": 60.0},
    "fp16": {"top1_agreement": 0.99, "psnr_db": 40.0},
    "int8": {"top1_agreement": 0.97, "psnr_db": 30.0},
}


def test_the_precision_floor_tells_a_fragile_reference_from_a_sound_one():
    """Two linear classifiers on the same inputs: one whose top-1 wins by a wide margin, one whose two leading
    logits differ by far less than 8-bit rounding moves them. Rounded to 8 bits, eager keeps the first's top-1
    and loses the second's; float16 and float64 keep both."""
    from exporter.coverage import conditioning

    torch.manual_seed(0)
    unit = nn.functional.normalize(torch.randn(48), dim=0)
    features = torch.randn(16, 48)
    sign = torch.tensor([1.0, -1.0]).repeat(8)
    features = features - (features @ unit)[:, None] * unit + 4 * sign[:, None] * unit  # ±4 along `unit`
    images = features.view(16, 3, 4, 4)

    def classifier(rows: list[torch.Tensor]) -> nn.Module:
        model = nn.Sequential(nn.Flatten(), nn.Linear(48, len(rows)))
        with torch.no_grad():
            model[1].weight.copy_(torch.stack(rows))
            model[1].bias.zero_()
        return model.eval()

    other = torch.randn(48)
    models = {
        "sound": classifier([unit, -unit, 0.05 * other]),  # top-1 wins by 8 on every image
        "fragile": classifier([unit, unit + 1e-5 * other, -unit]),
    }  # classes 0 and 1 tie on half of them
    floors = {}
    for name, model in models.items():
        with torch.no_grad():
            reference = model(images)
        floors[name] = conditioning.floor(_task(3), model, images, reference, THRESHOLDS)
    assert set(floors["sound"]) == {"fp32", "fp16", "int8", "margins"}
    assert all(not floors["sound"][p]["reasons"] for p in conditioning.PRECISIONS), floors["sound"]
    assert not floors["fragile"]["fp32"]["reasons"]
    assert "top1_agreement" in outcome.broken_keys(floors["fragile"]["int8"]["reasons"]), floors["fragile"]["int8"]
    assert floors["fragile"]["int8"]["fidelity"]["top1_agreement"] < 0.97
    # every top-1 the 8-bit rounding flipped sat on a near-tie by the rule's measure; the sound model has none
    fragile, sound = floors["fragile"], floors["sound"]
    with torch.no_grad():
        flipped = (
            (conditioning.outputs(models["fragile"], images, "int8").argmax(1) != models["fragile"](images).argmax(1))
            .nonzero()
            .flatten()
            .tolist()
        )
    assert flipped and len(fragile["margins"]) == len(fragile["int8"]["rms"]) == 16
    assert all(fragile["margins"][i] < outcome.NEAR_TIE * fragile["int8"]["rms"][i] for i in flipped)
    assert not any(m < outcome.NEAR_TIE * e for m, e in zip(sound["margins"], sound["int8"]["rms"]))
    # with labels (the trained tier) the floor is judged on them too: the flips the rounding made cost acc@1
    labeled = dict(THRESHOLDS, int8=dict(THRESHOLDS["int8"], accuracy_drop=1.0))
    for name, model in models.items():
        with torch.no_grad():
            reference = model(images)
        floors[name] = conditioning.floor(_task(3), model, images, reference, labeled, labels=reference.argmax(1))
    assert floors["fragile"]["labeled"] and floors["fragile"]["int8"]["accuracy"]["drop_points"] > 1.0
    assert "accuracy_drop" in outcome.broken_keys(floors["fragile"]["int8"]["reasons"])
    assert floors["sound"]["int8"]["accuracy"]["drop_points"] == 0 and not floors["sound"]["int8"]["reasons"]


def _outlier_images(calib: int, val: int, outlier: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Calibration images of unit scale; validation images of which half carry one pixel `outlier` times larger."""
    torch.manual_seed(1)
    calibration = [torch.randn(1, 3, 4, 4) for _ in range(calib)]
    images = torch.randn(val, 3, 4, 4)
    images[::2, 0, 0, 0] = outlier
    return calibration, images


def test_the_static_int8_floor_clips_what_calibration_never_saw():
    """A static int8 runtime fixes each tensor's range from calibration images; an input whose outlier lies far
    outside it clips. The dynamic floor (each tensor's own max) cannot show that; the static one must."""
    from exporter.coverage import conditioning

    calibration, images = _outlier_images(64, 8, 40.0)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.Identity(), nn.Linear(32, 10)).eval()
    with torch.no_grad():
        reference = model(images)
    floors = conditioning.floor(_task(10), model, images, reference, THRESHOLDS, calibration)
    assert set(floors) == {"fp32", "fp16", "int8", "int8_static", "margins"}
    dynamic, static = floors["int8"]["fidelity"]["psnr_db"], floors["int8_static"]["fidelity"]["psnr_db"]
    assert dynamic >= 30 and static < dynamic - 10, (dynamic, static)
    assert "psnr_db" in outcome.broken_keys(floors["int8_static"]["reasons"])
    # the same images without the outliers: calibration covers them, and the static floor is as good as 8 bits allow
    _, plain = _outlier_images(64, 8, 0.0)
    with torch.no_grad():
        reference = model(plain)
    assert not conditioning.floor(_task(10), model, plain, reference, THRESHOLDS, calibration)["int8_static"]["reasons"]


def test_the_static_int8_floor_gives_a_module_called_twice_a_range_per_call():
    """ResNet's blocks call one ReLU twice. A graph quantizer observes each call on its own; one range for both
    calls would round the small one to nothing and blame the random model for it."""
    from exporter.coverage import conditioning

    class TwoScales(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU()
            self.big = nn.Linear(48, 10)
            self.small = nn.Linear(48, 10)

        def forward(self, x):
            x = x.flatten(1)
            return self.relu(self.small(x)) + self.relu(1000 * self.big(x)) / 1000

    torch.manual_seed(3)
    model = TwoScales().eval()
    calibration, images = _outlier_images(64, 8, 0.0)
    with torch.no_grad():
        reference = model(images)
    static = conditioning.floor(_task(10), model, images, reference, THRESHOLDS, calibration)["int8_static"]
    assert static["fidelity"]["psnr_db"] >= 30, static


def test_a_quantized_weight_is_judged_as_it_is_against_its_float_model(quantized_digits):
    """The row that tells a quantized weight's own loss: its eager int8 model against its float model on the
    build's images, labeled metrics included (the digits' held-out labels)."""
    from exporter import data, weights
    from exporter.coverage import conditioning

    loaded = weights.load(
        QUANTIZED_WEIGHT,
        quantized_digits.checkpoint,
        verify=False,
        offline=True,
        float_checkpoint=quantized_digits.float_checkpoint,
    )
    task = loaded.task_class.bind(loaded.weights, loaded.model_name, loaded.num_classes, None)
    inputs = data.from_imagefolder(quantized_digits.data_dir, task.transform(loaded.weights), 0, 64, 0, num_classes=10)
    with torch.no_grad():
        reference = torch.cat([loaded.eager(x[None]) for x in inputs.validation])
    tight = conditioning.weight_row(
        task, loaded.model, inputs.validation, reference, inputs.labels, {"accuracy_drop": -100.0, "psnr_db": 200.0}
    )
    assert {(r.kind, r.metric) for r in tight["reasons"]} == {
        (Kind.THRESHOLD, "accuracy_drop"),
        (Kind.THRESHOLD, "psnr_db"),
    }
    assert 15 < tight["fidelity"]["psnr_db"] < 80  # int8 against float: close, not equal
    loose = conditioning.weight_row(
        task, loaded.model, inputs.validation, reference, inputs.labels, {"accuracy_drop": 100.0, "psnr_db": 0.0}
    )
    assert loose["reasons"] == []
