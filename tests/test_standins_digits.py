"""The digits training recipe the trained tier and the stand-ins use (exporter.standins.digits): runs that
did not learn tried again (lower rate, shrunk classifier, identity residual blocks), cached models and their
tries, and training on until the training images are learned. Training itself is replaced where it would
take minutes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn


def test_a_digits_run_that_did_not_learn_is_run_again_at_a_lower_learning_rate(monkeypatch):
    """SqueezeNet 1.1's trained tier collapsed at the recipe's learning rate (held-out acc@1 7 %: the ReLU on its
    logits died); a collapsed run is tried again, from the same start, at a tenth of it."""
    from exporter.standins import digits

    x, y = torch.randn(6, 3, 8, 8), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda weight, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    rates, accuracies = [], iter([0.07, 0.95])
    monkeypatch.setattr(digits, "_fit", lambda model, x, y, idx, epochs, lr, log: rates.append(lr))
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: next(accuracies))
    _state, accuracy, _data = digits.train("SqueezeNet1_1_Weights.IMAGENET1K_V1", 1, log=lambda _m: None)
    assert accuracy == 0.95 and rates == [2e-3, 2e-3 * digits.RETRY_LR_FACTOR]
    rates.clear()
    accuracies = iter([0.9])
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: next(accuracies))
    assert digits.train("SqueezeNet1_1_Weights.IMAGENET1K_V1", 1, log=lambda _m: None)[1] == 0.9 and rates == [2e-3]


def test_a_digits_run_that_did_not_learn_at_either_rate_is_run_again_with_its_classifier_shrunk(monkeypatch):
    """EfficientNet-B6 (27 % held out) and V2-M (13 and 11 %) learned at neither learning rate: their heads start
    10x ImageNet's scale at 10 classes. The last try shrinks the classifier; the first two keep their start."""
    from exporter.standins import digits

    weight = "EfficientNet_B0_Weights.IMAGENET1K_V1"
    torch.manual_seed(digits.SEED)
    initial = digits._model(weight).classifier[1].weight.abs().max().item()
    x, y = torch.randn(6, 3, 32, 32), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda w, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    tries, accuracies = [], iter([0.27, 0.11, 0.92])

    def fit(model, x, y, idx, epochs, lr, log):
        tries.append((lr, round(model.classifier[1].weight.abs().max().item() / initial, 4)))

    monkeypatch.setattr(digits, "_fit", fit)
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: next(accuracies))
    assert digits.train(weight, 1, log=lambda _m: None)[1] == 0.92
    assert tries == [(2e-3, 1.0), (2e-3 * digits.RETRY_LR_FACTOR, 1.0), (2e-3, 0.1)]

    tries.clear()
    accuracies = iter([0.27, 0.11, 0.2, 0.25])  # none learns: the best try is kept, not the last
    state, accuracy, _data = digits.train(weight, 1, log=lambda _m: None)
    assert accuracy == 0.27 and state["classifier.1.weight"].abs().max().item() == pytest.approx(initial)
    assert len(tries) == len(digits.ATTEMPTS) == 4


def test_the_last_try_starts_every_residual_block_as_the_identity():
    """EfficientNet-V2-L learned under none of the first three tries; the fourth zeroes the last batch norm of each
    residual branch, so each block passes its input through unchanged at the start."""
    from exporter.standins import digits

    for weight, block in (
        ("EfficientNet_V2_S_Weights.IMAGENET1K_V1", "MBConv"),
        ("MobileNet_V2_Weights.IMAGENET1K_V1", "InvertedResidual"),
        ("MNASNet0_5_Weights.IMAGENET1K_V1", "_InvertedResidual"),
        ("ResNet50_Weights.IMAGENET1K_V1", "Bottleneck"),
    ):
        model = digits._model(weight).eval()
        inputs = {}
        residual = [
            m
            for m in model.modules()
            if type(m).__name__ == block
            and getattr(m, "use_res_connect", getattr(m, "apply_residual", True))
            and getattr(m, "downsample", None) is None
        ]
        hooks = [m.register_forward_hook(lambda m, args, out: inputs.__setitem__(m, (args[0], out))) for m in residual]
        assert digits.zero_residual_branches(model) >= len(residual) > 0, weight
        with torch.no_grad():
            model(torch.rand(2, 3, 64, 64))
        for h in hooks:
            h.remove()
        for module, (x, out) in inputs.items():  # ResNet's blocks add, then ReLU: their inputs are already >= 0
            torch.testing.assert_close(out, x, rtol=0, atol=0, msg=f"{weight}: {type(module).__name__}")
    assert digits.zero_residual_branches(digits._model("VGG11_Weights.IMAGENET1K_V1")) == 0


def test_a_cached_model_that_did_not_learn_goes_on_with_the_tries_added_since(tmp_path, monkeypatch):
    """A model trained when the recipe had three tries is not trained again from the first: the fourth is made, and
    the cached model stays the answer if the new try is worse."""
    from exporter.standins import digits

    weight = "ResNet18_Weights.IMAGENET1K_V1"
    cached = digits._model(weight).state_dict()
    checkpoint = tmp_path / "resnet18_digits.pth"
    torch.save(cached, checkpoint)
    info_file = tmp_path / "digits_resnet18.json"
    info = {
        "recipe": digits.RECIPE_VERSION,
        "epochs": 4,
        "builder_kwargs": {},
        "checkpoint": str(checkpoint),
        "accuracy": 0.11,
        "recipe_tries": 3,
    }
    info_file.write_text(json.dumps(info))
    earlier = digits._earlier_tries(info_file, 4, {})
    assert earlier[0] == 3 and earlier[2] == 0.11
    x, y = torch.randn(6, 3, 32, 32), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda w, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    tries = []
    monkeypatch.setattr(digits, "_fit", lambda model, x, y, idx, epochs, lr, log: tries.append(lr))
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: 0.09)
    state, accuracy, _data = digits.train(weight, 4, log=lambda _m: None, earlier=earlier)
    assert tries == [digits.ATTEMPTS[3].lr] and accuracy == 0.11 and state is earlier[1]
    for changed in (
        {"accuracy": 0.5},
        {"recipe_tries": 4},
        {"epochs": 8},
        {"builder_kwargs": {"x": 1}},
        {"until": 0.95, "epochs_trained": 16},
    ):
        info_file.write_text(json.dumps({**info, **changed}))
        assert digits._earlier_tries(info_file, 4, {}) is None, changed


@pytest.mark.parametrize("weight", ["EfficientNet_B4_Weights.IMAGENET1K_V1", "SqueezeNet1_1_Weights.IMAGENET1K_V1"])
def test_a_shrunk_classifier_starts_near_chance_and_can_still_learn(weight):
    """EfficientNet-B4's head (a Linear) starts far from chance at 10 classes; shrunk, the first loss is near
    chance's, ln 10. SqueezeNet's is a convolution under a ReLU: shrunk, not zeroed, its output still moves."""
    from exporter.standins import digits

    torch.manual_seed(0)
    model, x, y = digits._model(weight).train(), torch.randn(8, 3, 64, 64), torch.arange(8)
    torch.manual_seed(1)
    with torch.no_grad():
        start = nn.functional.cross_entropy(model(x), y).item()
    digits.shrink_classifier(model)
    torch.manual_seed(1)
    loss = nn.functional.cross_entropy(model(x), y)
    assert start > 2 * math.log(10) or weight.startswith("Squeeze")
    assert abs(loss.item() - math.log(10)) < 0.5
    loss.backward()
    head = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
    assert head.weight.grad.abs().sum() > 0


def test_a_cached_digits_model_that_did_not_learn_before_the_last_try_existed_is_trained_again(tmp_path):
    from exporter.standins import digits

    info_file = tmp_path / "digits_efficientnet_v2_m_64px.json"
    info = {"recipe": digits.RECIPE_VERSION, "epochs": 4, "checkpoint": str(info_file), "accuracy": 0.11}
    info_file.write_text(json.dumps(info))
    assert digits._cached_info(info_file, 4, "checkpoint") is None
    info_file.write_text(json.dumps(dict(info, recipe_tries=len(digits.ATTEMPTS))))
    assert (
        digits._cached_info(info_file, 4, "checkpoint") is not None
    )  # the recipe had every try: do not train it again
    info_file.write_text(json.dumps(dict(info, accuracy=0.97)))
    assert digits._cached_info(info_file, 4, "checkpoint") is not None  # learned before: keeps its checkpoint


def test_inception_v3_trains_at_96_px_and_keeps_its_auxiliary_head():
    """Inception v3's auxiliary head, run by every training-mode forward, cannot take a 96-px input (its 5x5
    pooling gets a 4x4 map): the trained tier's Inception v3 failed before its first step. Training leaves the
    head out and the model keeps it, so the checkpoint loads into the model a build makes."""
    from exporter.standins import digits

    weight = "Inception_V3_Weights.IMAGENET1K_V1"
    torch.manual_seed(0)
    model, x, y = digits._model(weight), torch.randn(8, 3, 96, 96), torch.arange(8) % 10
    with pytest.raises(RuntimeError):
        model.train()(x)  # what the trained tier hit
    head = model.AuxLogits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    digits._fit(model, x, y, list(range(8)), 1, 2e-3, log=lambda _m: None)
    state = model.state_dict()
    assert model.AuxLogits is head and set(state) == set(before)
    assert not torch.equal(state["fc.weight"], before["fc.weight"])  # it did train
    digits._model(weight).load_state_dict(state)


def test_an_undertrained_digits_model_is_trained_on_until_its_training_images_are_learned(monkeypatch, tmp_path):
    """The trained tier's SqueezeNet (51 and 78 % held out after 4 epochs) and EfficientNet-B1 (87 %) gave int8
    verdicts about their training: the model goes on, in warm restarts as long as all training so far, while its
    acc@1 on its own training images is under the target, up to a cap; only the training images decide."""
    from exporter.standins import digits

    weight = "SqueezeNet1_1_Weights.IMAGENET1K_V1"
    checkpoint = tmp_path / "start.pth"
    torch.save(digits._model(weight).state_dict(), checkpoint)
    x, y = torch.randn(6, 3, 8, 8), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda w, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    fits, seen = [], []

    def accuracy(model, x, y, idx):
        seen.append(list(idx))
        return scores.pop(0) if idx == [0, 1, 2] else 0.5

    monkeypatch.setattr(digits, "_fit", lambda model, x, y, idx, epochs, lr, log: fits.append((epochs, lr)))
    monkeypatch.setattr(digits, "_accuracy", accuracy)
    scores = [0.78, 0.9, 0.97]
    state, reached = digits.train_further(weight, checkpoint, 4, 0.95, 16, log=lambda _m: None)
    assert state is not None and reached == {"epochs": 16, "train_accuracy": 0.97, "accuracy": 0.5}
    assert fits == [(4, 2e-3 * digits.RETRY_LR_FACTOR), (8, 2e-3 * digits.RETRY_LR_FACTOR)]
    assert [3, 4, 5] not in seen[:-1]  # the held-out digits are read once, to report, never to decide

    fits.clear()
    scores = [0.5, 0.5, 0.5]
    assert digits.train_further(weight, checkpoint, 4, 0.95, 8, log=lambda _m: None)[1]["epochs"] == 8  # the cap
    assert fits == [(4, 2e-3 * digits.RETRY_LR_FACTOR)]

    fits.clear()
    scores = [0.99]
    state, reached = digits.train_further(weight, checkpoint, 4, 0.95, 16, log=lambda _m: None)
    assert state is None and reached["epochs"] == 4 and fits == []  # learned already: the cached model stands

    # a model trained on serves callers training until the same accuracy, not the plain 4-epoch recipe
    info_file = tmp_path / "digits_squeezenet1_1.json"
    info = {"recipe": digits.RECIPE_VERSION, "epochs": 4, "checkpoint": str(checkpoint), "data_dir": str(tmp_path)}
    info_file.write_text(json.dumps(dict(info, until=0.95, epochs_trained=16)))
    assert digits._cached_info(info_file, 4, "checkpoint", until=0.95) is not None
    assert digits._cached_info(info_file, 4, "checkpoint") is None
    info_file.write_text(json.dumps(dict(info, until=0.95, epochs_trained=4)))
    assert digits._cached_info(info_file, 4, "checkpoint") is not None
    # a model trained before the builder took the weight's arguments (GoogLeNet's transform_input) is another model
    assert digits._cached_info(info_file, 4, "checkpoint", arch={}) is not None
    assert digits._cached_info(info_file, 4, "checkpoint", arch={"transform_input": True}) is None
    info_file.write_text(json.dumps(dict(info, epochs_trained=4, builder_kwargs={"transform_input": True})))
    assert digits._cached_info(info_file, 4, "checkpoint", arch={"transform_input": True}) is not None
    assert digits._cached_info(info_file, 4, "checkpoint", arch={}) is None


def test_a_model_with_auxiliary_heads_trains_on_its_main_logits():
    """GoogLeNet's trained row failed before training began: in training mode it returns its logits with its two
    auxiliary heads' (GoogLeNetOutputs), which the loss cannot take. The loss takes the main logits."""
    from torchvision.models import GoogLeNetOutputs

    from exporter.standins import digits

    class WithAuxiliary(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.aux = nn.Linear(12, 10), nn.Linear(12, 10)

        def forward(self, x):
            logits = self.head(x.flatten(1))
            return GoogLeNetOutputs(logits, self.aux(x.flatten(1)), None) if self.training else logits

    torch.manual_seed(0)
    model, x, y = WithAuxiliary(), torch.randn(64, 3, 2, 2), torch.arange(64) % 10
    head, aux = model.head.weight.detach().clone(), model.aux.weight.detach().clone()
    digits._fit(model, x, y, list(range(64)), 2, 1e-2, lambda _m: None)
    assert not torch.equal(model.head.weight, head) and torch.equal(model.aux.weight, aux)
