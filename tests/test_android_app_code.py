"""The Android app's own code, compiled (kotlinc) and run on a JVM: its resize makes torchvision's bytes, its SSD
decode makes torchvision's detections. The rest of the app (Bitmap, ExecuTorch, LiteRT) needs the Android SDK and
is not compiled here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exporter import weights
from exporter.device import detection_decode, preprocess
from exporter.tasks.image_input import as_bytes

from . import kotlin_app
from .test_image_input import _photo
from .test_preprocess_reference import SIZES, _tasks

SSDLITE = "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1"


@pytest.fixture
def app(android_app_code):
    return android_app_code


def test_the_apps_resize_and_crop_make_torchvisions_bytes(app, tmp_path):
    """Every weight's transform kind (bilinear and bicubic, crop or none) on photographs of six sizes, both
    orientations: 0 grey levels apart, and the float input equal to the exporter's reference to the bit."""
    tasks, get_weight = _tasks()
    expected = {}
    for t, (label, task, name) in enumerate(tasks):
        w = get_weight(name)
        pre, transform = task.preprocessing(w), task.transform(w)
        for seed, size in enumerate(SIZES):
            photo = _photo(seed, size)
            rgb = np.asarray(photo)
            kotlin_app.case(tmp_path, f"{t}-{seed}", "preprocess", width=size[0], height=size[1], preprocessing=pre)
            (tmp_path / f"{t}-{seed}" / "photo.rgb").write_bytes(rgb.tobytes())
            expected[f"{t}-{seed}"] = (label, pre, transform(photo))
    kotlin_app.run(app, tmp_path)
    for key, (label, pre, torchvision_input) in expected.items():
        height, width = (int(v) for v in (tmp_path / key / "shape.txt").read_text().split())
        pixels = np.frombuffer((tmp_path / key / "pixels.rgb").read_bytes(), np.uint8).reshape(height, width, 3)
        torchvision_bytes = as_bytes(torchvision_input[None], pre["mean"], pre["std"])[0].numpy()
        assert pixels.shape == torchvision_bytes.shape, (label, key)
        assert np.array_equal(pixels, torchvision_bytes), (
            label,
            key,
            np.abs(pixels.astype(int) - torchvision_bytes).max(),
        )
        floats = kotlin_app.floats(tmp_path / key / "input.f32").reshape(1, 3, height, width)
        assert np.array_equal(floats, preprocess.normalized(pixels, pre)), (label, key)
        assert torch.allclose(torch.from_numpy(floats[0].copy()), torchvision_input, rtol=0, atol=1e-6), (label, key)


def test_the_apps_resize_matches_pil_on_noise_up_and_down(app, tmp_path):
    """Noise is where rounding shows: random sizes on each axis, both filters, both pass orders."""
    from PIL import Image

    rng = np.random.default_rng(1)
    expected = {}
    for i in range(30):
        w_in, h_in, w_out, h_out = (int(v) for v in rng.integers(16, 400, 4))
        rgb = rng.integers(0, 256, (h_in, w_in, 3), dtype=np.uint8)
        for name, mode in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
            spec = {
                "resize_size": [h_out, w_out],
                "crop_size": None,
                "interpolation": name,
                "mean": [0, 0, 0],
                "std": [1, 1, 1],
            }
            key = f"{i}-{name}"
            kotlin_app.case(tmp_path, key, "preprocess", width=w_in, height=h_in, preprocessing=spec)
            (tmp_path / key / "photo.rgb").write_bytes(rgb.tobytes())
            expected[key] = np.asarray(Image.fromarray(rgb).resize((w_out, h_out), mode))
    kotlin_app.run(app, tmp_path)
    for key, pil in expected.items():
        pixels = np.frombuffer((tmp_path / key / "pixels.rgb").read_bytes(), np.uint8).reshape(pil.shape)
        assert np.array_equal(pixels, pil), (key, np.abs(pixels.astype(int) - pil).max())


def test_the_app_refuses_a_resize_it_does_not_compute(app, tmp_path):
    spec = {"resize_size": [8, 8], "crop_size": None, "interpolation": "nearest", "mean": [0] * 3, "std": [1] * 3}
    kotlin_app.case(tmp_path, "nearest", "preprocess", width=4, height=4, preprocessing=spec)
    (tmp_path / "nearest" / "photo.rgb").write_bytes(bytes(48))
    with pytest.raises(AssertionError, match="resizes with nearest; this app has bilinear and bicubic"):
        kotlin_app.run(app, tmp_path)


def test_the_app_feeds_each_artifact_what_its_input_says(app, tmp_path):
    """bundle.json's artifacts[].input decides: bytes for uint8-nhwc, floats for float32-nchw and for a bundle from
    before `input`; an input the app cannot make is refused with its name."""
    artifacts = [
        {"name": "bytes", "input": {"format": "uint8-nhwc", "dtype": "uint8", "layout": "NHWC"}},
        {"name": "floats", "input": {"format": "float32-nchw", "dtype": "float32", "layout": "NCHW"}},
        {"name": "older"},
        {"name": "halves", "input": {"dtype": "float16"}},
    ]
    assert kotlin_app.takes(app, {"artifacts": artifacts}, tmp_path) == {
        "bytes": "uint8",
        "floats": "float32",
        "older": "float32",
        "halves": "refused: halves takes float16; this app feeds uint8 or float32",
    }


# /proc/cpuinfo's Features as Linux prints them for each core (arch/arm64/kernel/cpuinfo.c's names)
A53 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"
A76 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"


@pytest.mark.parametrize(
    "cores, features",
    [([A76] * 4, ["fp16_arithmetic"]), ([A53] * 4, []), ([A53] * 4 + [A76] * 4, []), ([], [])],
    ids=["big-cores", "armv8.0", "mixed", "no-features-line"],
)
def test_the_app_keeps_off_an_artifact_that_needs_what_a_core_lacks(app, tmp_path, cores, features):
    """bundle.json's cpu_needs against /proc/cpuinfo: an fp16 .pte is kept only where every core has FP16 arithmetic
    (a thread may run on any core); an artifact that needs nothing is always kept."""
    cpuinfo = "".join(f"processor\t: {i}\nFeatures\t: {flags}\nCPU part\t: 0xd0b\n\n" for i, flags in enumerate(cores))
    artifacts = [{"name": "executorch_fp16", "cpu_needs": ["fp16_arithmetic"]}, {"name": "executorch_fp32"}]
    read = kotlin_app.servable(app, cpuinfo, {"artifacts": artifacts}, tmp_path)
    assert read == {"features": features, "kept": {"executorch_fp16": bool(features), "executorch_fp32": True}}


def _ties_ordered(boxes: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """`boxes` with each run of equal `scores` (detections in descending score) sorted by x1, y1."""
    boxes, start = boxes.copy(), 0
    for end in range(1, len(scores) + 1):
        if end == len(scores) or scores[end] != scores[start]:
            run = boxes[start:end]
            boxes[start:end] = run[np.lexsort((run[:, 1], run[:, 0]))]
            start = end
    return boxes


@pytest.mark.parametrize("seed", [0, 1])
def test_the_apps_ssd_decode_makes_torchvisions_detections(app, tmp_path, seed):
    """Varied heads on SSDlite's anchors (a random model's scores are near-tied and would prove nothing), decoded
    by the app with the parameters bundle.json carries: the same detections as torchvision's
    postprocess_detections and the exporter's numpy decode, in the same order."""
    from torchvision.models import get_model

    model = get_model("ssdlite320_mobilenet_v3_large", weights=None, weights_backbone=None, num_classes=11).eval()
    task = weights.bind_task(weights.resolve(SSDLITE), 11)
    g = torch.Generator().manual_seed(seed)
    head = torch.cat([torch.randn(1, 3234, 4, generator=g), 4 * torch.randn(1, 3234, 11, generator=g)], -1)
    directory = kotlin_app.case(tmp_path, "decode", "decode", decode=task.describe()["decode"], height=320, width=320)
    np.save(directory / "anchors.npy", task.anchors.astype(np.float32))
    np.save(directory / "head.npy", head[0].numpy())
    kotlin_app.run(app, tmp_path)
    rows = kotlin_app.floats(directory / "detections.f32").reshape(-1, 6)
    theirs = model.postprocess_detections(
        {"bbox_regression": head[..., :4], "cls_logits": head[..., 4:]}, [torch.from_numpy(task.anchors)], [(320, 320)]
    )[0]
    ours = detection_decode.decode(head[0].numpy(), task.anchors, (320, 320), task.params)
    assert len(rows) == len(theirs["scores"]) == len(ours["scores"]) == task.params["detections_per_img"]
    assert np.array_equal(rows[:, 0].astype(np.int64), theirs["labels"].numpy())
    assert np.allclose(rows[:, 1], theirs["scores"].numpy(), rtol=0, atol=1e-6)
    # rows of one label and the same float32 score (a saturated softmax ties) come in an order torch's sort leaves
    # open, and it differed between two hosts: the boxes are compared with ties put in one order on both sides
    tied = theirs["scores"].numpy()
    assert np.allclose(
        _ties_ordered(rows[:, 2:], tied), _ties_ordered(theirs["boxes"].numpy(), tied), rtol=0, atol=1e-3
    )
    assert np.array_equal(rows[:, 0].astype(np.int64), ours["labels"])
