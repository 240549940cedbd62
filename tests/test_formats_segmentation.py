"""Core ML packages for per-pixel class scores (meta["task"]["output"]["layout"] == "NCHW"): an image
input, one (1, C, H, W) multi-array output and no classifier; the proxies reproduce eager. Classifiers
keep their label/probabilities/logits outputs. Small inputs and models keep this under a minute."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torchvision
from torch import nn

from exporter.formats import coreml

ct = pytest.importorskip("coremltools")

SIZE, CLASSES = 64, 5
LABELS = [f"class{i}" for i in range(CLASSES)]


class SegmentationOutput(nn.Module):
    """What the pipeline gives formats for segmentation: torchvision's "out" alone."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def _meta(layout: str | None, size: int = SIZE) -> dict:
    pre = {
        "resize_size": [size, size],
        "crop_size": None,
        "input_size": [size, size],
        "interpolation": "bilinear",
        "antialias": True,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }
    meta = {
        "weight": "Test.WEIGHT",
        "model": "test_model",
        "labels": LABELS,
        "preprocessing": pre,
        "accuracy": {},
        "recipe": "",
        "exporter_version": "0.0.test",
    }
    if layout is not None:
        shape = [1, CLASSES, size, size] if layout == "NCHW" else [1, CLASSES]
        meta["task"] = {
            "name": "segmentation" if layout == "NCHW" else "classification",
            "input_size": [size, size],
            "num_classes": CLASSES,
            "output": {"name": "logits", "layout": layout, "shape": shape},
        }
    return meta


def _psnr(reference: torch.Tensor, output: torch.Tensor) -> float:
    rmse = (output.double() - reference.double()).pow(2).mean().sqrt().item()
    return math.inf if rmse == 0 else 20 * math.log10(reference.abs().max().item() / rmse)


@pytest.fixture(scope="module")
def segmentation_model() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=CLASSES
    )
    # BatchNorm statistics from data: at their defaults a random network's activations shrink to its
    # last biases, and any weights would reproduce "eager"
    for bn in model.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.momentum = None
            bn.reset_running_stats()
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 3, SIZE, SIZE))
    return SegmentationOutput(model).eval()


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def package(tmp_path_factory, segmentation_model, inputs):
    """One fp16 package (about 10 s to convert): it has both proxies, the weights' and fp16 eager."""
    path = tmp_path_factory.mktemp("coreml_segmentation") / "seg_fp16.mlpackage"
    return path, coreml.FORMAT.export(segmentation_model, inputs[:1], "fp16", None, path, _meta("NCHW"))


def test_segmentation_package_has_image_input_and_one_nchw_output(package):
    path, details = package
    assert details["input"] == {"name": "image", "type": "image", "color_space": "RGB", "width": SIZE, "height": SIZE}
    assert details["outputs"] == {"logits": [1, CLASSES, SIZE, SIZE]} and details["labels"] == CLASSES
    assert details["compression"]["compressed_weights"] == 0
    mlmodel = ct.models.MLModel(str(path), skip_model_load=True)
    spec = mlmodel.get_spec()
    (output,) = spec.description.output
    assert output.name == "logits" and output.type.WhichOneof("Type") == "multiArrayType"
    assert list(output.type.multiArrayType.shape) == [1, CLASSES, SIZE, SIZE]
    assert not spec.description.predictedFeatureName and not spec.description.predictedProbabilitiesName
    assert not any(op.type == "classify" for op in coreml._main_ops(spec))
    assert "argmax" in mlmodel.output_description["logits"]
    user = mlmodel.user_defined_metadata
    assert user["exporter.output"] == "logits" and user["exporter.output_layout"] == "NCHW"
    assert json.loads(user["exporter.labels"]) == LABELS
    assert user["exporter.compute_precision"] == "fp16"
    assert coreml.CONVERSION_DATE_KEY not in user


def test_segmentation_proxies_reproduce_eager(package, segmentation_model, inputs):
    with torch.no_grad():
        reference = segmentation_model(inputs)
    runners = coreml.FORMAT.proxies(package[0], segmentation_model)
    assert set(runners) == {"weights", "fp16"}
    for label, floor_db in (("weights", 50), ("fp16", 45)):  # measured 61 and 56 dB
        with torch.no_grad():
            output = torch.cat([runners[label](inputs[i : i + 1]) for i in range(len(inputs))])
        assert output.shape == reference.shape == (len(inputs), CLASSES, SIZE, SIZE)
        assert _psnr(reference, output) > floor_db, label
        assert (output.argmax(1) == reference.argmax(1)).float().mean() > 0.97, label


class TinyClassifier(nn.Sequential):
    def __init__(self):
        super().__init__(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, CLASSES),
        )


def test_classifier_package_unchanged(tmp_path):
    torch.manual_seed(0)
    model = TinyClassifier().eval()
    example = torch.rand(1, 3, SIZE, SIZE)
    meta = _meta(None)
    meta["preprocessing"].update(crop_size=[SIZE], input_size=None)
    old = coreml.FORMAT.export(model, example, "fp16", None, tmp_path / "old.mlpackage", meta)
    # the "NC" layout is what a build without meta["task"] was. (Bytes are not compared: coremltools
    # numbers constants per process, so a second conversion in one process renames them.)
    new = coreml.FORMAT.export(
        model, example, "fp16", None, tmp_path / "new.mlpackage", {**meta, "task": _meta("NC")["task"]}
    )
    assert old == new
    assert new["outputs"] == {"classLabel": "label", "classLabel_probs": "probabilities", "logits": [1, CLASSES]}
    old_spec, spec = (
        ct.models.MLModel(str(tmp_path / f"{name}.mlpackage"), skip_model_load=True).get_spec()
        for name in ("old", "new")
    )
    assert spec.description == old_spec.description
    assert [op.type for op in coreml._main_ops(spec)] == [op.type for op in coreml._main_ops(old_spec)]
    assert {o.name: o.type.WhichOneof("Type") for o in spec.description.output} == {
        "classLabel": "stringType",
        "classLabel_probs": "dictionaryType",
        "logits": "multiArrayType",
    }
    assert spec.description.predictedFeatureName == "classLabel"
    assert coreml._classify_labels(spec) == LABELS
    assert spec.description.metadata.shortDescription.startswith("test_model classifier from")
    assert not any(
        k.startswith("exporter.output") or k == "exporter.labels" for k in spec.description.metadata.userDefined
    )


def test_refuses_unknown_layout_and_mismatched_input_size(tmp_path, segmentation_model):
    meta = _meta("NCHW")
    meta["task"]["output"]["layout"] = "NHWC"
    with pytest.raises(ValueError, match="output layout 'NHWC' is not supported"):
        coreml.FORMAT.export(
            segmentation_model, torch.rand(1, 3, SIZE, SIZE), "fp16", None, tmp_path / "a.mlpackage", meta
        )
    with pytest.raises(ValueError, match=r"input_size \[96, 96\] differs from the example's \[64, 64\]"):
        coreml.FORMAT.export(
            segmentation_model,
            torch.rand(1, 3, SIZE, SIZE),
            "fp16",
            None,
            tmp_path / "b.mlpackage",
            _meta("NCHW", size=96),
        )
    assert not list(tmp_path.iterdir())
