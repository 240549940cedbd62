"""Random checkpoints for the sweep (exporter.coverage.randomize): batch norms settled on synthetic images,
heads rescaled until the reference varies, and the input size each graph is built at."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from exporter import coverage
from exporter.coverage import randomize, sweep


def test_random_checkpoints_mean_something():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    nn.init.zeros_(model[4].weight)  # as torchvision zero-initialises ViT's head
    assert randomize._reinit_zero_layers(model) == ["4"]
    images = torch.randn(8, 3, 8, 8) * 3 + 2
    assert randomize._settle(model, images) == 1
    bn = model[1]
    assert bn.momentum is None and not bn.training and bn.num_batches_tracked.item() == 2
    with torch.no_grad():
        expected = model[0](images).mean((0, 2, 3))
    assert torch.allclose(bn.running_mean, expected, atol=1e-4)  # the cumulative mean over both passes
    assert randomize._spread(model, images)["relative_std"] > 0.01
    assert not randomize._near_constant(model, images)
    calls = []
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LayerNorm(6)).train()  # no BatchNorm (a ViT): no pass to make
    plain.register_forward_hook(lambda *_: calls.append(1))
    assert randomize._settle(plain, images) == 0 and not calls and not plain.training


def test_a_random_head_that_gives_every_input_the_same_output_is_rescaled_until_it_varies():
    """RetinaNet v1's head: convs initialised with std 0.01 and no normalisation between them shrink the signal
    at each layer, so a random model outputs its prior bias for every image (a degenerate reference)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()]
    head = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), *layers, nn.Conv2d(16, 9, 3, padding=1)
    )
    for m in head.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.constant_(m.bias, 0)
    nn.init.constant_(head[-1].bias, -4.6)  # the focal-loss prior
    images = torch.randn(8, 3, 12, 12)
    randomize._settle(head, images)
    assert randomize._near_constant(head, images)
    assert randomize._unit_variance(head, images) == [n for n, m in head.named_modules() if isinstance(m, nn.Conv2d)]
    randomize._settle(head, images)
    assert not randomize._near_constant(head, images)
    assert randomize._spread(head, images)["relative_std"] > 0.1


def test_the_sweeps_input_size_goes_to_the_graphs_that_take_one():
    size = (128, 128)
    assert randomize.accepted_input_size("LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1", size) == size
    assert randomize.accepted_input_size("FCOS_ResNet50_FPN_Weights.COCO_V1", size) == size
    assert randomize.accepted_input_size("SSD300_VGG16_Weights.COCO_V1", size) is None  # SSD: its anchors' size
    assert randomize.accepted_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", size) is None
    # video frames: never larger than the weight's own (R3D-18: 112), never under its minimum (MViT-V2-S: 224)
    assert randomize.accepted_input_size("R3D_18_Weights.KINETICS400_V1", size) is None
    assert randomize.accepted_input_size("R3D_18_Weights.KINETICS400_V1", (64, 64)) == (64, 64)
    assert randomize.accepted_input_size("MViT_V2_S_Weights.KINETICS400_V1", size) is None
    assert randomize.built_input_size("R3D_18_Weights.KINETICS400_V1", size) == [112, 112]
    assert randomize.built_input_size("MViT_V2_S_Weights.KINETICS400_V1", size) == [224, 224]
    assert randomize.built_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", size) == [224, 224]
    # --classifier-size: a classifier whose graph takes that square; ViT's position embedding takes only its crop,
    # Inception v3 nothing under 75x75
    assert randomize.accepted_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", size, 96) == (96, 96)
    assert randomize.accepted_input_size("GoogLeNet_QuantizedWeights.IMAGENET1K_FBGEMM_V1", None, 96) == (96, 96)
    assert randomize.accepted_input_size("LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1", size, 96) == size
    assert randomize.built_input_size("ViT_B_16_Weights.IMAGENET1K_V1", None, 96) == [224, 224]
    assert randomize.built_input_size("Inception_V3_Weights.IMAGENET1K_V1", None, 64) == [299, 299]
    # a size equal to the crop is the crop: the model trained (and cached) at it serves
    assert randomize.accepted_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", None, 224) is None
    # only a classifier's row depends on the classifier size, and only its row says it
    settings = sweep.Settings(classifier_size=96)
    assert (
        "classifier_size" not in settings.key_parts("segmentation")
        and settings.key_parts("quantization")["classifier_size"] == 96
    )
    assert sweep.Settings().key_parts("classification") == settings.key_parts("segmentation")
    runner = sweep.Sweep(settings, [], Path("x.json"), Path("x.md"), "test")
    found = coverage.select.candidates(("lraspp_mobilenet_v3_large", "mobilenet_v3_small"), one_per_builder=True)
    assert {c.model: runner._resized(c, runner._input_size(c)) for c in found} == {
        "lraspp_mobilenet_v3_large": {},
        "mobilenet_v3_small": {"classifier_size": [96, 96]},
    }


def test_a_random_checkpoint_settled_at_one_size_is_not_served_at_another(tmp_path):
    """Batch norms are settled on images of the size the graph is built at: --builds keeps one checkpoint per size."""
    weight = "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    small, own = randomize.make(weight, tmp_path, (96, 96)), randomize.make(weight, tmp_path, None)
    assert small["checkpoint"] != own["checkpoint"]
    assert randomize.make(weight, tmp_path, (96, 96))["checkpoint"] == small["checkpoint"]  # kept, not made again
    first, second = (torch.load(info["checkpoint"], weights_only=True) for info in (small, own))
    assert any(not torch.equal(first[k], second[k]) for k in first if k.endswith("running_var"))
