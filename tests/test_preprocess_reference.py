"""device/preprocess.py, the numpy reference of the app's resize (and crop) a build ships: the same bytes as
torchvision's transform, measured on photograph-like images of several sizes and both orientations."""

import numpy as np
import pytest
import torch

from exporter.device import preprocess
from exporter.tasks import Classification, Detection, Segmentation
from exporter.tasks.image_input import as_bytes

from .test_image_input import _photo

SIZES = [(347, 261), (261, 347), (640, 480), (300, 200), (1000, 750), (200, 301)]  # W x H: landscape and portrait


def _tasks():
    from torchvision.models import get_weight

    return [
        ("ResNet18 (bilinear, 256 then 224)", Classification(1000, (224, 224)), "ResNet18_Weights.IMAGENET1K_V1"),
        ("EfficientNet-B0 (bicubic)", Classification(1000, (224, 224)), "EfficientNet_B0_Weights.IMAGENET1K_V1"),
        ("ViT-B/16 (bilinear, 224 crop)", Classification(1000, (224, 224)), "ViT_B_16_Weights.IMAGENET1K_V1"),
        (
            "LR-ASPP (520 x 520, no crop)",
            Segmentation(21, (520, 520)),
            "LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1",
        ),
        ("SSDlite (320 x 320)", Detection(91, (320, 320)), "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"),
    ], get_weight


@pytest.mark.parametrize("which", range(5))
def test_the_reference_makes_torchvisions_bytes(which):
    """0 grey levels apart on every pixel: the app that runs the reference feeds what the build validated."""
    tasks, get_weight = _tasks()
    _, task, name = tasks[which]
    weights = get_weight(name)
    pre, transform = task.preprocessing(weights), task.transform(weights)
    for seed, size in enumerate(SIZES):
        photo = _photo(seed, size)
        expected = transform(photo)
        pixels = preprocess.resize_and_crop(np.asarray(photo), pre)
        torchvision_bytes = as_bytes(expected[None], pre["mean"], pre["std"])[0].numpy()
        assert pixels.dtype == np.uint8 and pixels.shape == torchvision_bytes.shape
        assert np.array_equal(pixels, torchvision_bytes), (size, np.abs(pixels.astype(int) - torchvision_bytes).max())
        normalized = torch.from_numpy(preprocess.normalized(pixels, pre))
        assert torch.allclose(normalized[0], expected, rtol=0, atol=1e-6)


def test_the_resize_alone_matches_pil_on_noise_at_any_pair_of_sizes():
    """Noise is where rounding shows: random sizes up and down on each axis, bilinear and bicubic."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for _ in range(40):
        w_in, h_in, w_out, h_out = (int(v) for v in rng.integers(16, 400, 4))
        rgb = rng.integers(0, 256, (h_in, w_in, 3), dtype=np.uint8)
        for name, mode in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
            pil = np.asarray(Image.fromarray(rgb).resize((w_out, h_out), mode))
            assert np.array_equal(preprocess.resize(rgb, h_out, w_out, name), pil), (w_in, h_in, w_out, h_out, name)


def test_what_the_reference_does_not_take_is_said():
    rgb = np.zeros((10, 10, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="this reference has bilinear, bicubic"):
        preprocess.resize(rgb, 5, 5, "nearest")
    with pytest.raises(ValueError, match="smaller than the 20x20 crop"):
        preprocess.center_crop(rgb, 20, 20)
