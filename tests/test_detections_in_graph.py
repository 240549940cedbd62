"""--detections graph for single-stage detectors (exporter.tasks.detections_in_graph): the graph ends in the detector's
own post-processing, so its rows are torchvision's detections; the ONNX file records NonMaxSuppression and returns the
same boxes. Checked on the trained SSDlite stand-in and on RetinaNet and FCOS (per-level top-k, another box coder),
which no build here trains: their rows are compared with torchvision's own forward on the same images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exporter.device import detection_decode
from exporter.standins import detection as digits_detection
from exporter.tasks.detections_in_graph import SingleStageDetections

from .helpers import CACHE

pytestmark = pytest.mark.slow


def _trained_ssdlite():
    from torchvision.models import get_model

    model = digits_detection.prepare(CACHE)
    detector = get_model(
        digits_detection.MODEL_NAME, weights=None, weights_backbone=None, num_classes=digits_detection.NUM_CLASSES
    )
    detector.load_state_dict(torch.load(model.checkpoint, weights_only=True))
    images = sorted((model.data_dir / "images").iterdir())[:3]
    return detector.eval(), images, (digits_detection.SIZE, digits_detection.SIZE)


def _random(name, size):
    from torchvision.models import get_model

    torch.manual_seed(0)
    detector = get_model(name, weights=None, weights_backbone=None, num_classes=5).eval()
    detector.score_thresh = 0.0  # an untrained head scores near 0: keep every candidate, so NMS has work to do
    detector.transform.min_size, detector.transform.max_size = (min(size),), max(size)  # no resize in its forward
    return detector, None, size


def _pixels(files, size):
    from PIL import Image

    if files is None:
        return torch.rand(2, 3, *size)
    return torch.stack(
        [
            torch.from_numpy(
                np.asarray(Image.open(f).convert("RGB").resize(size[::-1]), dtype=np.float32) / 255
            ).permute(2, 0, 1)
            for f in files
        ]
    )


@pytest.mark.parametrize(
    "make",
    [
        _trained_ssdlite,
        lambda: _random("retinanet_resnet50_fpn", (160, 224)),
        lambda: _random("fcos_resnet50_fpn", (224, 160)),
    ],
    ids=["ssdlite-trained", "retinanet", "fcos"],
)
def test_the_rows_are_torchvisions_detections_and_the_onnx_file_returns_them(make, tmp_path):
    detector, files, size = make()
    pixels = _pixels(files, size)
    mean, std = (torch.tensor(v)[:, None, None] for v in (detector.transform.image_mean, detector.transform.image_std))
    graph = SingleStageDetections(detector).eval()
    with torch.no_grad():
        rows = graph((pixels - mean) / std)
        own = detector(list(pixels))  # torchvision's own forward: its transform, heads, postprocess_detections
    for image_rows, d in zip(rows, own):
        expected = torch.cat([d["boxes"], d["scores"][:, None], d["labels"][:, None].float()], 1)
        assert len(expected) > 0
        assert torch.equal(image_rows[: len(expected)], expected) and not image_rows[len(expected) :].any()

    import onnx
    import onnxruntime as ort

    path = tmp_path / "graph.onnx"
    x = ((pixels - mean) / std)[:1]
    torch.onnx.export(graph, (x,), str(path), dynamo=False, opset_version=17, input_names=["image"])
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    ops |= {n.op_type for node in onnx.load(str(path)).graph.node for a in node.attribute for n in a.g.node}
    assert "NonMaxSuppression" in ops
    session = ort.InferenceSession(str(path))
    got = session.run(None, {"image": x.numpy()})[0][0]
    reference, candidate = (detection_decode.decode(r, None, size, {"kind": "final"}) for r in (rows[0].numpy(), got))
    match = detection_decode.match(reference, candidate, 0.0)
    # every detection found again (same label, IoU >= 0.5) with its score to float rounding
    assert match["matched"] == match["reference"] == match["candidate"] > 0, match
    assert max(match["score_errors"]) < 1e-3


def test_a_real_detection_labelled_zero_is_kept_and_the_padding_dropped():
    """RetinaNet and FCOS may label a box 0 (torchvision's COCO weights name class 0 `__background__` but score it
    like any other): a final row is a detection by its score, never 0 since it passed the score threshold."""
    rows = np.zeros((4, 6), dtype=np.float32)
    rows[0] = (1, 2, 30, 40, 0.9, 0)
    rows[1] = (5, 6, 7, 8, 0.02, 3)
    decoded = detection_decode.decode(rows, None, (64, 64), {"kind": "final"})
    assert decoded["labels"].tolist() == [0, 3] and np.allclose(decoded["scores"], [0.9, 0.02])
