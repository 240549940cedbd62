"""Layer sensitivity (exporter.quant.sensitivity): the layers ranked by what each costs alone in int8, proven
on a copy of the trained digits model with one deliberately fragile layer."""

from __future__ import annotations

import torch

from exporter.standins import digits


def test_sensitivity_ranks_the_fragile_layer_first(digits_model, fragile_checkpoint):
    from exporter import data, weights
    from exporter.quant.sensitivity import layer_sensitivity, quantizable_layers

    loaded = weights.load(digits_model.weight, fragile_checkpoint, verify=False)
    inputs = data.from_imagefolder(digits_model.data_dir, loaded.weights.transforms(), 24, 8, 0, 10)
    images = torch.cat(inputs.calibration)
    with torch.no_grad():
        reference = loaded.model(images[16:])
    sensitivity = layer_sensitivity(loaded.model, quantizable_layers(loaded.model), images[:16], images[16:], reference)
    # by construction: a 1000x channel in a per-tensor int8 range zeroes every other channel of that input
    assert sensitivity.ranking()[0] == digits.FRAGILE_LAYER
    assert sensitivity.output_psnr_db[digits.FRAGILE_LAYER] < 20
