"""Video classifiers: R3D-18 really trained on clips of moving digits, built for Jetson (ONNX) and Android
(TorchScript lite; the .pte refused with what stops it), validated per clip against eager and the labels."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from exporter import weights
from exporter.errors import UsageError
from exporter.standins import digit_clips
from tests.helpers import CACHE, assert_clean_refusal, assert_device_reproduces_the_build, run_cli

SMALL = ["--calib-size", "16", "--val-size", "48", "--warmup", "1", "--iterations", "3"]


@pytest.fixture(scope="session")
def clips_model() -> digit_clips.DigitClipsModel:
    return digit_clips.prepare(CACHE)


@pytest.fixture(scope="session")
def video_build(tmp_path_factory, clips_model):
    out = tmp_path_factory.mktemp("video") / "build"
    h, w = clips_model.input_size
    result = run_cli(
        "build",
        clips_model.weight,
        "--checkpoint",
        clips_model.checkpoint,
        "--data",
        clips_model.data_dir,
        "--labels",
        clips_model.labels_file,
        "--input-size",
        h,
        w,
        "--target",
        "jetson",
        "--target",
        "android",
        "--target",
        "ios",
        "--format",
        "onnx:fp32",
        "--format",
        "onnx:int8",
        "--format",
        "torchscript_lite:fp32",
        "--format",
        "executorch:fp32",
        "--format",
        "coreml:fp32",
        "--out",
        out,
        "--quiet",
        *SMALL,
    )
    return out, result


def _manifest(out, target):
    return json.loads((out / target / "manifest.json").read_text())


def test_a_trained_video_classifier_builds_for_jetson_and_android(video_build, clips_model):
    out, result = video_build
    assert result.exit_code == 0, (result.output, result.exception)
    assert clips_model.held_out_accuracy > 0.8  # a model with real margins: agreement means something
    jetson, android = _manifest(out, "jetson"), _manifest(out, "android")
    assert jetson["status"] == android["status"] == "passed"
    assert jetson["task"]["name"] == "video" and jetson["task"]["frames"] == 16
    assert jetson["preprocessing"]["layout"] == "NCTHW"
    artifacts = {a["name"]: a for doc in (jetson, android) for a in doc["artifacts"]}
    for name in ("onnx_fp32", "onnx_int8", "torchscript_lite_fp32"):
        entry = artifacts[name]
        assert entry["status"] == "passed", (name, entry["reasons"])
        accuracy = entry["accuracy"]
        assert accuracy["eager_acc1"] > 80 and accuracy["drop_points"] <= 1.0, (name, accuracy)
    assert artifacts["onnx_fp32"]["fidelity"]["top1_agreement"] == 1.0
    assert artifacts["torchscript_lite_fp32"]["fidelity"]["psnr_db"] >= 60
    # the .pte is not attempted: what stops it was measured, and the build still passes on what it can ship
    pte = artifacts["executorch_fp32"]
    assert pte["status"] == "unavailable" and pte["path"] is None
    assert pte["reasons"][0]["kind"] == "not_made", pte["reasons"]
    assert pte["reasons"][0]["text"].startswith("cannot take a video graph: XNNPACK has no 3-D convolution")
    # the device kit checks clips as the build did
    assert_device_reproduces_the_build(out / "jetson")
    # Core ML converts it (a clip goes in as a tensor: an image input is one frame; coremltools has no
    # adaptive_avg_pool3d, written as a mean) and cannot predict off macOS
    (coreml,) = [a for a in _manifest(out, "ios")["artifacts"] if a["format"] == "coreml"]
    assert coreml["status"] == "unavailable" and coreml["path"], coreml["reasons"]
    assert coreml["details"]["input"]["shape"] == [1, 3, 16, 16, 16]
    assert coreml["details"]["rewrites"] == {"adaptive_avg_pool3d_as_mean": ["avgpool"]}


def test_video_input_that_cannot_work_is_refused_in_one_line(tmp_path, clips_model):
    images = tmp_path / "images" / "0"
    images.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(images / "a.png")  # an ImageFolder: images, no clips
    out = tmp_path / "out"
    result = run_cli(
        "build",
        clips_model.weight,
        "--checkpoint",
        clips_model.checkpoint,
        "--data",
        tmp_path / "images",
        "--input-size",
        "16",
        "16",
        "--target",
        "jetson",
        "--format",
        "onnx:fp32",
        "--out",
        out,
        "--quiet",
    )
    assert_clean_refusal(result, out, "no clips in class folders")
    with pytest.raises(UsageError, match="mvit_v2_s takes frames of at least 224x224"):
        weights.bind_task(weights.resolve("mvit_v2_s"), input_size=(112, 112))


class _PatchClassifier(torch.nn.Module):
    """Swin3D's shape in miniature: a Conv3d patch embedding (a 5-D weight), LayerNorm, a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Conv3d(3, 8, (2, 4, 4), (2, 4, 4))
        self.norm, self.head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.norm(self.embed(x).flatten(2).transpose(1, 2)).mean(1))


def _mini_mvit_v2(classes: int) -> torch.nn.Module:
    """MViT-V2's attention in miniature: relative positions, keys and values pooled more than queries."""
    from torchvision.models.video import mvit

    blocks = [
        mvit.MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4]),
        mvit.MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 2, 2]),
    ]
    return mvit.MViT(
        spatial_size=(32, 32),
        temporal_size=4,
        block_setting=blocks,
        residual_pool=True,
        residual_with_cls_embed=False,
        rel_pos_embed=True,
        proj_after_attn=True,
        num_classes=classes,
        patch_embed_kernel=(3, 7, 7),
        patch_embed_stride=(2, 4, 4),
        patch_embed_padding=(1, 3, 3),
    ).eval()


def test_mvit_v2s_relative_positions_convert_to_core_ml_within_rank_5(tmp_path, monkeypatch):
    """MViT-V2's relative positions reshape to rank 6 and broadcast at rank 8, past Core ML's 5 (MViT-V2-S was ❌
    in every Core ML variant): rewritten at rank 5 they compute what torchvision's do, and the package converts."""
    import contextlib

    from exporter.formats import coreml, rewrites

    from .test_formats_segmentation import CLASSES, _meta

    torch.manual_seed(0)
    model, clip = _mini_mvit_v2(CLASSES), torch.randn(1, 3, 4, 32, 32)
    with torch.no_grad():
        reference = model(clip)
        with rewrites.rel_pos_within_rank5(model) as rewritten:
            torch.testing.assert_close(model(clip), reference, rtol=1e-5, atol=1e-5)
    with rewrites.rel_pos_within_rank5(_PatchClassifier()) as untouched:  # a model without them: as it is
        assert rewritten and not untouched
    details = coreml.FORMAT.export(model, clip, "fp32", None, tmp_path / "m.mlpackage", _meta("NC", 32))
    assert details["rewrites"] == {"relative_positions_within_rank5": True}
    monkeypatch.setattr(coreml, "rel_pos_within_rank5", lambda _m: contextlib.nullcontext(False))
    with pytest.raises(ValueError, match="rank <= 5"):
        coreml.FORMAT.export(model, clip, "fp32", None, tmp_path / "raw.mlpackage", _meta("NC", 32))


def test_a_clip_models_fp16_package_gets_its_proxies(tmp_path):
    """Off macOS an fp16 package is judged by stand-ins; channels-last (for 4-D convolutions) stopped Swin3D-T's
    whole iOS build ("required rank 4 tensor to use channels_last format")."""
    from exporter.formats import coreml

    from .test_formats_segmentation import _meta

    torch.manual_seed(0)
    model = _PatchClassifier().eval()
    clips = torch.randn(2, 3, 4, 16, 16)
    path = tmp_path / "clip.mlpackage"
    details = coreml.FORMAT.export(model, clips[:1], "fp16", None, path, _meta("NC", 16))
    assert details["input"]["shape"] == [1, 3, 4, 16, 16]
    runners = coreml.FORMAT.proxies(path, model)
    assert set(runners) == {"weights", "fp16"}
    with torch.no_grad():
        for run in runners.values():
            torch.testing.assert_close(run(clips), model(clips), atol=1e-2, rtol=1e-2)
