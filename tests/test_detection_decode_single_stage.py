"""RetinaNet and FCOS through the shared numpy decode: the exported raw heads, decoded, give the boxes,
scores and labels torchvision's own forward gives (its postprocess_detections is the spec).

Random weights (weights=None) at 128x128, so that the whole file runs in seconds. torchvision initialises
the classification head's bias to -log(99), so that every score starts at 0.01, below score_thresh: the
untrained model detects nothing. The tests zero that bias (scores then spread around 0.5) and scale up
the box regression head (so that the boxes move well away from their anchors and a wrong box coder shows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exporter import weights
from exporter.device import detection_decode
from exporter.errors import UsageError
from exporter.tasks.detection import RawHeads, _anchors, decode_params

SIZE = (128, 128)
NUM_CLASSES = 5
WEIGHT = {
    "retinanet_resnet50_fpn": "RetinaNet_ResNet50_FPN_Weights.COCO_V1",
    "retinanet_resnet50_fpn_v2": "RetinaNet_ResNet50_FPN_V2_Weights.COCO_V1",
    "fcos_resnet50_fpn": "FCOS_ResNet50_FPN_Weights.COCO_V1",
}


class Detector:
    """A random model that detects, torchvision's detections on a few images, and our raw heads of them."""

    def __init__(self, name: str):
        from torchvision.models import get_model

        self.name, self.fcos = name, name.startswith("fcos")
        torch.manual_seed(0)
        model = get_model(name, weights=None, weights_backbone=None, num_classes=NUM_CLASSES).eval()
        with torch.no_grad():
            model.head.classification_head.cls_logits.bias.zero_()
            model.head.regression_head.bbox_reg.weight.mul_(8.0)
        # images already at the input size: torchvision's transform neither resizes them (scale 1) nor pads
        model.transform.min_size, model.transform.max_size = (SIZE[0],), max(SIZE)
        self.model = model
        self.images = [torch.rand(3, *SIZE, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        with torch.no_grad():
            batch, _ = model.transform(self.images)
            assert tuple(batch.tensors.shape[-2:]) == SIZE
            self.heads = RawHeads(model)(batch.tensors).numpy()  # what every exported artifact returns
        self.anchors, self.levels = _anchors(model, SIZE)

    def torchvision(self) -> list[dict]:
        with torch.no_grad():
            return [{k: v.numpy() for k, v in d.items()} for d in self.model(self.images)]

    def ours(self, params: dict | None = None) -> list[dict]:
        params = params or decode_params(self.model, self.levels)
        return [detection_decode.decode(head, self.anchors, SIZE, params) for head in self.heads]


def canonical(d: dict) -> dict:
    """Detections best first, equal scores ordered by label then box. Sigmoid maps nearby logits to the same
    float32, so among a few thousand candidates some scores tie exactly, and torchvision's order of tied
    detections is not defined (batched_nms ends in an unstable sort)."""
    order = np.lexsort((*d["boxes"].T[::-1], d["labels"], -d["scores"]))
    return {k: v[order] for k, v in d.items()}


def differences(ours: list[dict], theirs: list[dict]) -> list[str]:
    """What differs between two images' worth of detections (empty when the same to 1e-4 px, 1e-5 score)."""
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        a, b = canonical(a), canonical(b)
        if len(a["boxes"]) != len(b["boxes"]):
            found.append(f"image {i}: {len(a['boxes'])} detections, torchvision {len(b['boxes'])}")
        elif not (a["labels"] == b["labels"]).all():
            found.append(f"image {i}: labels differ")
        elif not np.allclose(a["scores"], b["scores"], rtol=0, atol=1e-5):
            found.append(f"image {i}: scores differ by {np.abs(a['scores'] - b['scores']).max()}")
        elif not np.allclose(a["boxes"], b["boxes"], rtol=0, atol=1e-4):
            found.append(f"image {i}: boxes differ by {np.abs(a['boxes'] - b['boxes']).max()} px")
    return found


@pytest.fixture(scope="module", params=["retinanet_resnet50_fpn", "fcos_resnet50_fpn"])
def detector(request):
    return Detector(request.param)


def test_heads_are_the_anchors_times_box_values_plus_classes(detector):
    fcos = detector.fcos
    per_location = 1 if fcos else 9  # FCOS: one point per location; RetinaNet: 3 sizes x 3 aspect ratios
    assert detector.levels == [per_location * (SIZE[0] // s) ** 2 for s in (8, 16, 32, 64, 128)]
    assert detector.heads.shape == (2, sum(detector.levels), (5 if fcos else 4) + NUM_CLASSES)
    assert detector.anchors.shape == (sum(detector.levels), 4)


@pytest.mark.parametrize(
    "settings",
    [{}, {"topk_candidates": 40, "detections_per_img": 25, "score_thresh": 0.3, "nms_thresh": 0.4}],
    ids=["defaults", "tight"],
)
def test_decode_reproduces_torchvision_forward(detector, settings):
    """Same boxes, scores and labels as the model's own eval forward, with its defaults and with other values
    set on the model object (the decode reads them from there: decode_params)."""
    defaults = {k: getattr(detector.model, k) for k in settings}
    for k, v in settings.items():
        setattr(detector.model, k, v)
    try:
        theirs, params = detector.torchvision(), decode_params(detector.model, detector.levels)
    finally:
        for k, v in defaults.items():
            setattr(detector.model, k, v)
    assert {k: params[k] for k in settings} == settings
    ours = detector.ours(params)
    assert all(len(d["boxes"]) >= 10 for d in theirs), [len(d["boxes"]) for d in theirs]  # real detections
    assert differences(ours, theirs) == []
    if settings:
        assert all(len(d["boxes"]) == settings["detections_per_img"] for d in theirs)  # the limit bit
    else:
        assert len({int(label) for d in theirs for label in d["labels"]}) > 1  # several classes
        # most boxes moved off their anchors (the regression head is not negligible)
        on_an_anchor = np.concatenate(
            [np.isclose(d["boxes"][:, None], detector.anchors[None], atol=0.5).all(-1).any(-1) for d in theirs]
        )
        assert on_an_anchor.mean() < 0.5, on_an_anchor.mean()


def wrong_params(params: dict) -> dict[str, dict]:
    """Decodes that must not reproduce torchvision: each one parameter (or the kind) changed."""
    wrong = {
        "kind": {**params, "kind": "fcos" if params["kind"] == "retinanet" else "retinanet"},
        "one level": {**params, "levels": [sum(params["levels"])], "topk_candidates": 40},
        "nms_thresh": {**params, "nms_thresh": params["nms_thresh"] + 0.2},
    }
    if params["kind"] == "retinanet":
        wrong["box_coder_weights"] = {**params, "box_coder_weights": [10.0, 10.0, 5.0, 5.0]}
        wrong["bbox_xform_clip"] = {**params, "bbox_xform_clip": 0.1}
    else:
        wrong["normalize_by_size"] = {**params, "normalize_by_size": False}
    return wrong


def test_a_wrong_decode_is_caught(detector):
    params = decode_params(detector.model, detector.levels)
    theirs = detector.torchvision()
    for what, p in wrong_params(params).items():
        if what == "one level":  # per-level top-k matters once top-k bites: compare at 40 per level
            model_topk = detector.model.topk_candidates
            detector.model.topk_candidates = 40
            try:
                reference = detector.torchvision()
            finally:
                detector.model.topk_candidates = model_topk
            assert differences(detector.ours({**params, "topk_candidates": 40}), reference) == []
            assert differences(detector.ours(p), reference), what
            continue
        try:
            ours = detector.ours(p)
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # a head layout the wrong kind cannot even read: caught too
        assert differences(ours, theirs), what


def test_bound_task_carries_the_models_decode(detector):
    """The task a build binds: anchors, levels and parameters from the model, the decode through it."""
    task = weights.bind_task(weights.resolve(WEIGHT[detector.name]), NUM_CLASSES, SIZE)
    np.testing.assert_array_equal(task.anchors, detector.anchors)
    params = task.params
    assert params["levels"] == detector.levels and params["kind"] == decode_params(detector.model, [])["kind"]
    assert task.output()["shape"] == [1, *detector.heads.shape[1:]]
    assert differences(task.decode(torch.from_numpy(detector.heads.reshape(2, -1))), detector.torchvision()) == []


def test_retinanet_v2_is_accepted_and_input_sizes_follow_torchvision():
    v2 = weights.bind_task(weights.resolve(WEIGHT["retinanet_resnet50_fpn_v2"]), 91, (160, 224))
    assert v2.params["kind"] == "retinanet" and v2.params["box_coder_weights"] == [1.0, 1.0, 1.0, 1.0]
    assert v2.input_size == (160, 224) and sum(v2.params["levels"]) == len(v2.anchors) == 9 * sum(
        -(-160 // s) * -(-224 // s) for s in (8, 16, 32, 64, 128)
    )
    fcos = weights.task_class(weights.resolve(WEIGHT["fcos_resnet50_fpn"]))
    assert fcos.input_size_of(None, "fcos_resnet50_fpn", None) == (800, 800)  # min_size, square
    with pytest.raises(UsageError, match="multiples of 32"):
        fcos.input_size_of(None, "fcos_resnet50_fpn", (100, 128))


def test_faster_rcnn_takes_its_own_route_and_mask_rcnn_is_refused():
    from exporter.tasks.detection import Detection
    from exporter.tasks.region_detection import RegionDetection

    assert (
        Detection.unsupported_model("retinanet_resnet50_fpn") is None
        and Detection.unsupported_model("fcos_resnet50_fpn") is None
    )
    assert Detection.for_model("retinanet_resnet50_fpn") is Detection
    assert Detection.for_model("fasterrcnn_resnet50_fpn") is RegionDetection
    assert RegionDetection.unsupported_model("fasterrcnn_resnet50_fpn") is None
    assert "cannot be exported yet: its masks" in Detection.unsupported_model("maskrcnn_resnet50_fpn")
    assert "cannot be exported yet: its keypoints" in Detection.unsupported_model("keypointrcnn_resnet50_fpn")


def test_a_checkpoint_resolves_constructs_and_exports_raw_heads(tmp_path):
    """What `exporter build RetinaNet_ResNet50_FPN_Weights.COCO_V1 --checkpoint X --input-size 128 128` does
    before exporting: the class count read from the checkpoint, the model built and loaded, the graph
    returning the heads the bound task describes."""
    from torchvision.models import get_model

    path = tmp_path / "retinanet_random.pth"
    torch.manual_seed(1)
    torch.save(
        get_model("retinanet_resnet50_fpn", weights=None, weights_backbone=None, num_classes=7).state_dict(), path
    )
    loaded = weights.load(WEIGHT["retinanet_resnet50_fpn"], checkpoint=path, verify=False, offline=True)
    assert loaded.num_classes == 7 and isinstance(loaded.model, RawHeads)
    task = loaded.task_class.bind(loaded.weights, loaded.model_name, loaded.num_classes, SIZE)
    with torch.no_grad():
        out = loaded.model(torch.zeros(1, 3, *SIZE))
    assert list(out.shape) == task.output()["shape"] == [1, 3069, 4 + 7]
