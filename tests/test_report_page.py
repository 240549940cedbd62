"""report.html as a person reads it, from hand-made manifests and tensors (no model, no build): chart labels
that never overlap and stay in the picture, previews of the inputs where an artifact departs from eager,
and the "ship this" line."""

from __future__ import annotations

import itertools
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from exporter.release import html_report, manifest, previews, recommend, report, svg_text
from exporter.results import ArtifactResult, Latency, Manifest
from exporter.tasks.classification import Classification
from exporter.tasks.detection import Detection
from exporter.tasks.segmentation import Segmentation

from .fake_manifest import complete

PRE = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}


# --- manifests, shaped as a real build writes them (checked against the schema) ---
def _latency(p50):
    return {"p50": p50, "p90": p50 * 1.1, "p99": p50 * 1.3, "mean": p50 * 1.05, "iterations": 10}


FORMATS = ("executorch", "torchscript_lite", "litert", "onnx", "tensorrt", "coreml")  # the manifest's format names


def _artifact(name, status="passed", size=2_000_000, p50=4.0, acc1=97.0, **extra):
    precision = name.rsplit("_", 1)[-1] if name.rsplit("_", 1)[-1] in ("fp32", "fp16", "int8") else "fp32"
    fmt = next((f for f in FORMATS if name.startswith(f)), "executorch")  # a made-up name: an ExecuTorch artifact
    entry = {
        "name": name,
        "path": f"{name}.pte",
        "format": fmt,
        "precision": precision,
        "sha256": "0" * 64,
        "size_bytes": size,
        "status": status,
        "reasons": []
        if status == "passed"
        else [
            {
                "kind": "threshold",
                "text": "top1_agreement 0.91 (needs >= 0.97)",
                "metric": "top1_agreement",
                "value": 0.91,
            }
        ],
        "fidelity": {
            "samples": 12,
            "psnr_db": 41.0,
            "cosine": 0.999,
            "max_abs_error": 0.2,
            "top1_agreement": 0.99,
            "top5_agreement": 1.0,
        },
        "accuracy": {"acc1": acc1, "acc5": 99.0, "eager_acc1": 98.0, "eager_acc5": 99.0, "drop_points": 98.0 - acc1},
        "latency_ms": _latency(p50) if p50 is not None else None,
        "eager_latency_ms": _latency(9.0),
        "speedup_vs_eager": 9.0 / p50 if p50 else None,
        "thresholds": {"top1_agreement": 0.97, "psnr_db": 30.0},
    }
    if status == "unavailable":
        entry.update(
            fidelity=None,
            accuracy=None,
            latency_ms=None,
            eager_latency_ms=None,
            speedup_vs_eager=None,
            reasons=[{"kind": "unavailable_here", "text": "not validated: no Core ML runtime on Linux"}],
        )
    return {**entry, **extra}


def _record(artifacts, target="android", task="classification") -> dict:
    doc = {
        "schema_version": manifest.SCHEMA_VERSION,
        "exporter_version": "0.1.0",
        "created": "2024-05-01T12:00:00+00:00",
        "status": "failed" if any(a["status"] == "failed" for a in artifacts) else "passed",
        "weight": {"name": "ResNet18_Weights.IMAGENET1K_V1", "model": "resnet18", "num_classes": 10, "meta": {}},
        "task": {
            "name": task,
            "input_size": [8, 8],
            "num_classes": 10,
            "output": {"name": "logits", "layout": "NC", "shape": [1, 10]},
        },
        "checkpoint": {"path": "/c/resnet18.pth", "sha256": "a" * 64, "source": "checkpoint", "verified": False},
        "preprocessing": {"task": task, "input_size": [8, 8], "resize_size": [8], "crop_size": [8], **PRE},
        "labels": {"file": "labels.txt", "count": 10},
        "target": {
            "name": target,
            "profile": f"targets/{target}.toml",
            "latency": {"threads": 2},
            "thresholds": {"fp32": {"top1_agreement": 1.0}, "int8": {"top1_agreement": 0.97}},
        },
        "tools": {"torch": "2.5.0", "torchvision": "0.20.0"},
        "host": {"platform": "Linux", "cpu": "Test CPU", "cores": 2, "threads": 2},
        "data": {"source": "/data/digits", "labeled": True, "calibration": 8, "validation": 12, "seed": 0},
        "eager": {"accuracy": {"acc1": 98.0, "acc5": 99.0}},
        "artifacts": artifacts,
        "timings_s": {"eager reference": 1.0},
    }
    return complete(json.loads(manifest.dumps(doc)))  # as read back from manifest.json ("inf" for infinity)


def _doc(artifacts, target="android", task="classification") -> Manifest:
    """The manifest as the reports read it: typed, from the JSON record `_record` makes."""
    return Manifest.from_json(_record(artifacts, target, task))


# --- (a) SVG text: boxes from the SVG's own geometry ---
def _texts(svg: str):
    """(viewBox, [(box, shown text, full text)]) of every <text> in one <svg>."""
    root = ET.fromstring(svg)
    view = [float(v) for v in root.get("viewBox").split()]
    found, parents = [], {child: parent for parent in root.iter() for child in parent}
    for element in root.iter("text"):
        shown = "".join(element.itertext())
        title = parents[element].find("title") if parents[element] is not root else None
        box = svg_text.text_box(
            float(element.get("x")), float(element.get("y")), shown, element.get("text-anchor", "start")
        )
        found.append((box, shown, title.text if title is not None else shown))
    return svg_text.Box(view[0], view[1], view[0] + view[2], view[1] + view[3]), found


def _assert_clear(svg: str) -> list[str]:
    """No two text boxes of the chart intersect and each lies inside the viewBox; returns the full texts."""
    view, texts = _texts(svg)
    for box, shown, _ in texts:
        assert box.inside(view), (shown, box, view)
    for (a, sa, _), (b, sb, _) in itertools.combinations(texts, 2):
        assert not a.overlaps(b), (sa, a, sb, b)
    return [full for _, _, full in texts]


def _charts(page: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", page, flags=re.S)


def test_estimated_text_widths_cover_the_real_font():
    """The boxes the layout keeps apart are no narrower than the text a browser draws (DejaVu Sans 12px)."""
    font_file = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
    if not font_file.is_file():
        pytest.skip("no DejaVu Sans here to measure against")
    from PIL import ImageFont

    font = ImageFont.truetype(str(font_file), svg_text.FONT_PX)
    for text in [
        "android/executorch_int8",
        "WWWMMM@@%%",
        "eager (vs jetson/tensorrt_fp16)",
        "0123456789.–×…",
        "ResNet18 ~ {x} <= y ^ 2",
        "features.3.conv.0.0",
    ]:
        assert svg_text.text_width(text) >= font.getlength(text), text


def test_fit_keeps_both_ends_and_the_width():
    long = "jetson/" + "very_long_artifact_name_" * 8 + "int8"
    short = svg_text.fit(long, 150)
    assert svg_text.text_width(short) <= 150 and short.startswith("jetson/") and short.endswith("int8") and "…" in short
    assert svg_text.fit("onnx_fp32", 150) == "onnx_fp32"


@pytest.mark.parametrize("case", ["real", "identical", "long names", "corners", "crowded"])
def test_accuracy_vs_size_labels_never_overlap_and_stay_inside(case):
    if case == "real":  # one android build: fp32 and int8 ExecuTorch, TorchScript-lite at fp32's point
        artifacts = [
            _artifact("executorch_fp32", size=44_800_000, acc1=98.0),
            _artifact("executorch_int8", size=11_300_000, acc1=97.6),
            _artifact("torchscript_lite_fp32", size=44_800_000, acc1=98.0),
        ]
    elif case == "identical":  # the same size and accuracy, many times: the old chart drew them on each other
        artifacts = [_artifact(f"executorch_int8_variant_{i:02d}", size=2_000_000, acc1=97.5) for i in range(18)]
    elif case == "long names":
        artifacts = [
            _artifact("a_really_long_artifact_name_that_goes_on_" * 4 + f"{i}_int8", size=2_000_000 + i, acc1=97.5)
            for i in range(6)
        ] + [_artifact("WWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWW_fp32", size=9_000_000, acc1=90.0)]
    elif case == "corners":  # points on every edge of the plot
        artifacts = [
            _artifact(f"{n}_fp32", size=s, acc1=a)
            for n, s, a in [
                ("smallest", 1, 99.9),
                ("largest", 90_000_000, 99.9),
                ("worst", 1, 10.0),
                ("biggest_worst", 90_000_000, 10.0),
                ("middle", 45_000_000, 55.0),
            ]
        ]
    else:  # 40 points close together
        artifacts = [
            _artifact(f"m{i}_int8", size=3_000_000 + 40_000 * (i % 7), acc1=97.0 + 0.05 * (i // 7)) for i in range(40)
        ]
    doc = _doc(artifacts)
    chart = html_report.accuracy_size_chart([doc])
    full = _assert_clear(chart)
    # every artifact is labeled, by its whole name (shown, or fitted with the whole in a <title>)
    assert sorted(n for n in full if n in {a["name"] for a in artifacts}) == sorted(a["name"] for a in artifacts)


def test_the_old_merged_label_layout_would_fail_this_check():
    """The check above can fail: two labels side by side at the same baseline do overlap."""
    svg = (
        '<svg viewBox="0 0 200 50"><text x="10" y="20">executorch_int8</text>'
        '<text x="60" y="24">executorch_fp32</text></svg>'
    )
    with pytest.raises(AssertionError):
        _assert_clear(svg)
    with pytest.raises(AssertionError):  # and a label past the right edge
        _assert_clear('<svg viewBox="0 0 100 50"><text x="60" y="20">executorch_int8</text></svg>')


def _quantization() -> dict:
    """An int8 artifact's quantization record with a layer kept in float, long layer names among them."""

    def step(floats, psnr):
        return {
            "float_layers": floats,
            "ranges": "minmax",
            "agreement": 0.99,
            "drop": 0.3,
            "psnr_db": psnr,
            "meets_budget": psnr >= 32,
        }

    layers = {f"layer{i}.0.conv{i}" * (1 + i % 5): 20.0 + i for i in range(30)}
    return {
        "calibration_method": "minmax, per-channel weights",
        "layers": 60,
        "int8_layers": 59,
        "float_layers": [{"name": next(iter(layers)), "output_psnr_db": 20.0, "local_sqnr_db": 11.0}],
        "budget": {"psnr_db": 32.0, "top1_agreement": 0.97},
        "range_images": 16,
        "check_images": 16,
        "check_labeled": True,
        "fallback": True,
        "meets_budget": True,
        "psnr_margin_db": 2.0,
        "before": step(0, 28.0),
        "after": step(1, 33.0),
        "steps": [step(0, 28.0), step(1, 33.0)],
        "sensitivity": {"output_psnr_db": layers},
        "seconds": 4.2,
    }


def test_every_chart_of_a_two_target_page_keeps_its_text_clear(tmp_path):
    long = "torchscript_lite_with_an_unreasonably_long_name_for_a_chart_label_fp32"
    android = _doc(
        [
            _artifact("executorch_fp32", size=44_800_000, p50=30.1, acc1=98.0),
            _artifact(
                "executorch_int8", size=11_300_000, p50=12.2, acc1=97.6, details={"quantization": _quantization()}
            ),
            _artifact(long, size=44_800_000, p50=2500.0, acc1=98.0),
        ]
    )
    jetson = _doc(
        [
            _artifact("onnx_fp32", size=44_800_000, p50=28.0, acc1=98.0),
            _artifact("tensorrt_fp16", status="unavailable", size=22_000_000, p50=None),
        ],
        target="jetson",
    )
    page = html_report.render([android, jetson], [tmp_path, tmp_path])
    charts = _charts(page)
    assert len(charts) == 3  # latency, accuracy vs size, one int8 sensitivity
    for chart in charts:
        _assert_clear(chart)


# --- (b) previews: the inputs where an artifact departs most ---
def _classification_rows():
    torch.manual_seed(0)
    reference = 0.1 * torch.randn(12, 10)
    reference[:, 3] = 6.0  # eager's call is class 3 everywhere, class 7 the runner-up by 3
    reference[:, 7] = 3.0
    return reference


def test_previews_pick_the_departing_rows_furthest_first():
    task = Classification(10, (8, 8))
    reference = _classification_rows()
    outputs = reference.clone()
    outputs[2, 7] += 4.0  # flips to class 7, just
    outputs[5, 7] += 9.0  # flips to class 7, far
    picture, rows = previews.draw(task, torch.zeros(12, 3, 8, 8), reference, outputs, PRE)
    assert [r["row"] for r in rows] == [5, 2]
    assert rows[0]["departure"]["top1_flipped"] == 1.0 and rows[0]["departure"]["margin_change"] == pytest.approx(9.0)
    assert list(rows[0]["departure"]) == ["top1_flipped", "margin_change", "logit_rmse"]  # ranking order
    one = task.preview(torch.zeros(3, 8, 8), reference[5], outputs[5], PRE)
    assert picture.size == (one.width, 2 * (one.height + previews.TITLE) + previews.GAP)
    # a flip outranks a larger move that keeps eager's call; rows that only move are left out once one flips
    outputs[9, 3] += 50.0
    _, rows = previews.draw(task, torch.zeros(12, 3, 8, 8), reference, outputs, PRE)
    assert [r["row"] for r in rows] == [5, 2]


def test_without_a_visible_departure_the_largest_raw_ones_are_shown():
    task = Classification(10, (8, 8))
    reference = _classification_rows()
    outputs = reference.clone()
    outputs[4, 0] += 0.01  # another class's logit: margin unchanged, only RMSE
    outputs[8, 3] += 0.5  # eager's call more certain
    outputs[1, 3] -= 0.2
    _, rows = previews.draw(task, torch.zeros(12, 3, 8, 8), reference, outputs, PRE)
    assert [r["row"] for r in rows] == [8, 1, 4] and not previews.visible(rows[0])


def test_an_identical_artifact_gets_no_picture_and_nan_ranks_first():
    task = Classification(10, (8, 8))
    reference = _classification_rows()
    assert previews.draw(task, torch.zeros(12, 3, 8, 8), reference, reference.clone(), PRE) == (None, [])
    outputs = reference.clone()
    outputs[6, 3] = float("nan")
    outputs[0, 7] += 9.0
    _, rows = previews.draw(task, torch.zeros(12, 3, 8, 8), reference, outputs, PRE)
    assert [r["row"] for r in rows] == [6, 0] and rows[0]["departure"]["logit_rmse"] == float("inf")
    assert json.loads(manifest.dumps({"rows": rows}))  # NaN never reaches the manifest (allow_nan=False)


def test_segmentation_ranks_by_pixels_that_change_class():
    task = Segmentation(3, (4, 4))
    torch.manual_seed(1)
    reference = torch.randn(8, 3, 16)
    reference[:, 0] += 5.0  # class 0 everywhere
    outputs = reference.clone()
    outputs[5, 2, :4] += 10.0  # four pixels become class 2
    outputs[2, 1, 7] += 10.0  # one pixel
    outputs[3, 0] += 0.3  # larger logit error, no pixel changes
    outputs, reference = outputs.reshape(8, -1), reference.reshape(8, -1)
    picture, rows = previews.draw(task, torch.zeros(8, 3, 4, 4), reference, outputs, PRE)
    assert [r["row"] for r in rows] == [5, 2]
    assert rows[0]["departure"]["changed_pixels"] == pytest.approx(4 / 16)
    assert picture.height == 2 * (4 + previews.TITLE) + previews.GAP


def test_detection_ranks_by_unmatched_boxes():
    anchors = np.array([[4, 4, 28, 28], [36, 4, 60, 28], [4, 36, 28, 60], [36, 36, 60, 60]], dtype=np.float32)
    task = Detection(3, (64, 64), anchors)
    reference = torch.zeros(6, 4, 4 + 3)
    reference[:, :, 4] = 6.0  # background
    reference[:, 0, 5] = 12.0  # one box of class 1 at anchor 0 in every image
    outputs = reference.clone()
    outputs[5, 0, 5] = 0.0  # the box is gone ...
    outputs[5, 3, 6] = 12.0  # ... and another one appears: 2 unmatched
    outputs[2, 1, 6] = 12.0  # one extra box
    outputs[1] += 0.05  # the boxes move a little only
    picture, rows = previews.draw(
        task, torch.zeros(6, 3, 64, 64), reference.reshape(6, -1), outputs.reshape(6, -1), PRE
    )
    assert [r["row"] for r in rows] == [5, 2]
    assert [r["departure"]["unmatched_boxes"] for r in rows] == [2.0, 1.0]
    assert picture.height == 2 * (64 + previews.TITLE) + previews.GAP


class _Task(Classification):
    def preprocessing(self, weights):
        return PRE


def _session(reference, out):
    return SimpleNamespace(
        out=out,
        task=_Task(10, (8, 8)),
        inputs=SimpleNamespace(validation=torch.zeros(len(reference), 3, 8, 8)),
        reference=reference,
        loaded=SimpleNamespace(weights=None, labels=[f"digit {i}" for i in range(10)]),
    )


def test_the_build_writes_the_picture_and_the_rows(tmp_path):
    from exporter.engine.pipeline import _write_preview

    reference = _classification_rows()
    outputs = reference.clone()
    outputs[2, 7] += 4.0
    outputs[5, 7] += 9.0
    entry = ArtifactResult("executorch_int8", "executorch", "int8")
    _write_preview(_session(reference, tmp_path), entry, outputs)
    assert entry.preview == "previews/executorch_int8.png" and [r["row"] for r in entry.preview_rows] == [5, 2]
    with Image.open(tmp_path / entry.preview) as im:
        assert im.height == 2 * (8 + previews.TITLE) + previews.GAP
    # `exporter validate` again, now bit-identical: the earlier picture's keys go
    _write_preview(_session(reference, tmp_path), entry, reference.clone())
    assert entry.preview_rows == [] and entry.preview is None and "preview" not in entry.to_json()


def _png(directory: Path, name: str) -> str:
    (directory / "previews").mkdir(exist_ok=True)
    Image.new("RGB", (20, 10), "white").save(directory / "previews" / f"{name}.png")
    return f"previews/{name}.png"


def test_the_page_shows_departures_folds_raw_ones_and_collapses_identical_ones(tmp_path):
    flipped = [
        {"row": 5, "departure": {"top1_flipped": 1.0, "margin_change": 9.0, "logit_rmse": 2.1}},
        {"row": 2, "departure": {"top1_flipped": 1.0, "margin_change": 4.0, "logit_rmse": 1.2}},
    ]
    raw = [{"row": 8, "departure": {"top1_flipped": 0.0, "margin_change": 0.5, "logit_rmse": 0.16}}]
    doc = _doc(
        [
            _artifact("executorch_int8", preview=_png(tmp_path, "executorch_int8"), preview_rows=flipped),
            _artifact("executorch_fp32", preview=_png(tmp_path, "executorch_fp32"), preview_rows=raw),
            _artifact("torchscript_lite_fp32", preview_rows=[]),
            _artifact("xnnpack_fp32", preview_rows=[]),
        ]
    )
    page = html_report.render([doc], [tmp_path])
    section = page.split("Where the artifacts depart from eager")[1].split("<h2>")[0]
    assert section.count("<img") == 2
    assert "<b>executorch_int8</b>: the only 2 inputs of 12 where it departs visibly from eager" in section
    folded = section.split("<details>")[1]
    assert folded.startswith(
        "<summary><b>executorch_fp32</b>: the same top-1 class as eager on all 12 validation inputs"
    )
    assert "only raw numbers differ (furthest: input 8, top-2 margin moved 0.5, logit RMSE 0.16)" in folded
    assert section.count("Bit-identical to eager") == 1
    assert (
        "Bit-identical to eager on all 12 validation inputs, nothing to show: <b>torchscript_lite_fp32, xnnpack_fp32</b>"
        in section
    )
    assert previews.describe(flipped[0]) == "input 5: top-1 flipped, top-2 margin moved 9, logit RMSE 2.1"


def test_an_older_manifest_without_rows_still_shows_its_picture(tmp_path):
    doc = _doc([_artifact("executorch_fp32", preview=_png(tmp_path, "executorch_fp32"))])
    page = html_report.render([doc], [tmp_path])
    assert page.count("<img") == 1 and "<b>executorch_fp32</b>: input | eager&#x27;s five likeliest classes" in page


# --- (c) ship this ---
def test_ship_names_the_fastest_and_the_smallest_that_passed():
    doc = _doc(
        [
            _artifact("executorch_fp32", p50=3.0, size=44_000_000),
            _artifact("executorch_int8", p50=5.0, size=11_000_000),
            _artifact("onnx_int8", status="failed", p50=1.0, size=10_000_000),  # fastest and smallest, but failed
            _artifact("coreml_fp16", status="unavailable", p50=None, size=5_000_000),  # never validated
        ]
    )
    pick = recommend.choose(doc)
    assert pick["fastest"].name == "executorch_fp32" and pick["smallest"].name == "executorch_int8"
    text = recommend.line(doc)
    assert text.startswith(
        "Ship for android (2 passed): fastest executorch_fp32 (p50 3.00 ms); smallest executorch_int8 (11.00 MB)."
    )
    assert "onnx_int8" not in text and "Not validated on this host (runtime unavailable): coreml_fp16." in text
    # the line is on the page and in report.md
    assert "<b>Ship for android (2 passed):</b> fastest executorch_fp32" in html_report.render([doc], [])
    assert (
        "**Ship for android (2 passed):** fastest `executorch_fp32` (p50 3.00 ms); smallest `executorch_int8`"
        in report.markdown(doc)
    )


def test_an_untimed_artifact_can_be_the_smallest_but_not_the_fastest():
    doc = _doc(
        [
            _artifact("executorch_fp32", p50=3.0, size=44_000_000),
            _artifact("executorch_int8", p50=None, size=11_000_000, latency_ms=None),
        ]
    )
    pick = recommend.choose(doc)
    assert pick["fastest"].name == "executorch_fp32" and pick["smallest"].name == "executorch_int8"
    only = _doc([_artifact("executorch_int8", p50=None, size=11_000_000, latency_ms=None)])
    assert (
        recommend.line(only)
        == "Ship for android (1 passed): fastest: none was timed on this host; smallest executorch_int8 (11.00 MB)."
        " The app then needs the ExecuTorch runtime (XNNPACK backend)."
    )


def test_one_artifact_fastest_and_smallest_and_ties():
    doc = _doc(
        [
            _artifact("executorch_int8", p50=2.0, size=11_000_000),
            _artifact("executorch_fp32", p50=3.0, size=44_000_000),
            _artifact("xnnpack_int8", p50=2.0, size=12_000_000),
        ]
    )
    assert recommend.line(doc) == (
        "Ship for android: executorch_int8, the fastest (p50 2.00 ms) and the smallest (11.00 MB) of the 3 that passed."
        " The app then needs the ExecuTorch runtime (XNNPACK backend)."
    )
    alone = _doc([_artifact("onnx_fp32", p50=7.9, size=3_400_000)], target="jetson")
    assert recommend.line(alone) == (
        "Ship for jetson: onnx_fp32, the only one that passed (p50 7.90 ms, 3.40 MB). The app then needs ONNX Runtime."
    )


def test_ship_for_android_chooses_across_runtimes_and_names_the_one_the_app_needs():
    faster_tflite = _doc(
        [
            _artifact("executorch_int8", p50=2.0, size=1_700_000),
            _artifact("litert_int8", p50=1.5, size=1_900_000),
            _artifact("litert_fp32", p50=3.0, size=6_200_000),
        ]
    )
    assert recommend.line(faster_tflite) == (
        "Ship for android (3 passed): fastest litert_int8 (p50 1.50 ms); smallest executorch_int8 (1.70 MB)."
        " The app then needs LiteRT (TensorFlow Lite, XNNPACK delegate) for the fastest, the ExecuTorch runtime"
        " (XNNPACK backend) for the smallest."
    )
    one = _doc([_artifact("litert_int8", p50=1.5, size=1_600_000), _artifact("executorch_int8", p50=2.0)])
    assert recommend.line(one).endswith(
        "of the 2 that passed. The app then needs LiteRT (TensorFlow Lite, XNNPACK delegate)."
    )
    unknown = _doc([_artifact("someformat_fp32", p50=1.0)])
    unknown.artifacts[0].format = "someformat"  # a format this exporter does not know (a newer one's): no runtime
    assert (
        recommend.line(unknown) == "Ship for android: someformat_fp32, the only one that passed (p50 1.00 ms, 2.00 MB)."
    )


def _counted(name, counts: dict, psnr=41.0, lacks=None, **extra) -> dict:
    """An artifact with an aarch64 row per core of `counts` (instructions per inference), passed there."""
    rows = [
        {
            "arch": "aarch64",
            "cpu": cpu,
            "emulated": True,
            "status": "passed",
            "reasons": [],
            "fidelity": None,
            "vs_x86": None,
            "latency_ms": None,
            "instructions": {
                "per_inference": n,
                "warmup": n,
                "unit": "emulated instructions (not time)",
                "eager_per_inference": None,
                "ratio_to_eager": None,
            },
            **({"lacks": lacks} if lacks and cpu == "cortex-a53" else {}),
        }
        for cpu, n in counts.items()
    ]
    entry = _artifact(name, aarch64=rows, **extra)
    entry["precision"] = name.split("_", 1)[1]
    entry["fidelity"] = {**entry["fidelity"], "psnr_db": psnr}
    return entry


def _counted_doc(artifacts, must_run_on=()) -> Manifest:
    record = _record(artifacts)
    record["aarch64"] = {"cpus": ["cortex-a53", "cortex-a76"], "instructions": {"reference_cpu": "cortex-a76"}}
    record["target"]["validate"] = {"cpus": ["cortex-a53", "cortex-a76"], "reference_cpu": "cortex-a76"}
    if must_run_on:
        record["target"]["validate"]["must_run_on"] = list(must_run_on)
    return Manifest.from_json(record)


LACKS = "FP16 arithmetic (Armv8.2-A FEAT_FP16): cortex-a53 has none, so this fp16 program cannot compute in half"


def test_ship_by_count_says_why_each_other_artifact_was_not_picked_and_keeps_off_a_core_the_app_must_run_on():
    artifacts = [
        _counted("executorch_fp32", {"cortex-a53": 38_800_000, "cortex-a76": 28_500_000}, size=6_100_000),
        _counted("executorch_fp16", {"cortex-a53": 43_000_000, "cortex-a76": 20_500_000}, lacks=LACKS, size=4_900_000),
        _counted("litert_fp16", {"cortex-a53": 38_100_000, "cortex-a76": 22_600_000}, psnr=75.0, size=3_200_000),
        _artifact("executorch_int8", status="failed"),
        _artifact("coreml_fp16", status="unavailable", p50=None),
    ]
    doc = _counted_doc(artifacts)
    pick = recommend.choose(doc)
    # the ExecuTorch and LiteRT fp16 programs are within 1.5x of each other (a tie across runtimes): the one closer
    # to eager wins, whatever the x86 p50 (every _artifact has p50 4.0 here)
    assert pick["fastest"].name == "litert_fp16" and pick["smallest"].name == "litert_fp16"
    why = recommend.not_picked(doc)
    assert list(why) == ["executorch_fp32", "executorch_fp16", "executorch_int8", "coreml_fp16"]
    assert why["executorch_fp32"] == "1.26x the instructions of litert_fp16 on cortex-a76"
    assert why["executorch_fp16"].startswith(
        "0.91x the instructions of litert_fp16 on cortex-a76 (a tie across runtimes"
    )
    assert why["executorch_int8"] == "failed: top1_agreement 0.91 (needs >= 0.97)"
    assert why["coreml_fp16"].startswith("not validated: ")
    # an app that must run on cortex-a53: the fp16 .pte, made for what that core lacks, is not picked even alone
    alone = _counted_doc(artifacts[:2], must_run_on=["cortex-a53"])
    assert recommend.choose(alone)["fastest"].name == "executorch_fp32"
    assert recommend.not_picked(alone) == {"executorch_fp16": f"not for cortex-a53, which the app must run on: {LACKS}"}
    none = _counted_doc(artifacts[1:2], must_run_on=["cortex-a53"])
    assert recommend.line(none) == "Nothing to ship for android: none of the 1 that passed runs on cortex-a53."
    unvalidated = _counted_doc([_counted("executorch_fp32", {"cortex-a76": 1})], must_run_on=["cortex-a53"])
    assert recommend.choose(unvalidated)["excluded"] == {
        "executorch_fp32": "not validated on cortex-a53, which the app must run on"
    }
    # the manifest records the reasons, and both reports show them under "Ship for"
    doc.recommended = recommend.recommendation(doc)
    assert doc.recommended.to_json()["not_picked"] == why
    assert Manifest.from_json(json.loads(manifest.dumps(doc.to_json()))).recommended.not_picked == why
    md, page = report.markdown(doc), html_report.render([doc], [])
    assert "Not picked: `executorch_fp32`: 1.26x the instructions of litert_fp16 on cortex-a76;" in md
    assert "Not picked: executorch_fp32: 1.26x" in _plain(page)


def test_nothing_passed_says_so():
    doc = _doc(
        [
            _artifact("executorch_fp32", status="failed"),
            _artifact("executorch_int8", status="failed"),
            _artifact("coreml_fp16", status="unavailable", p50=None),
        ],
        target="ios",
    )
    pick = recommend.choose(doc)
    assert pick["fastest"] is None and pick["smallest"] is None
    assert recommend.line(doc) == (
        "Nothing to ship for ios: no artifact passed (2 failed). "
        "Not validated on this host (runtime unavailable): coreml_fp16."
    )
    page = html_report.render([doc, _doc([_artifact("onnx_fp32")], target="jetson")], [])
    assert "<b>Nothing to ship for ios:</b>" in page and "<b>Ship for jetson:</b> onnx_fp32, the only one" in page


# --- (d) at phone width, and every line of report.md on the page ---
def _every_note_doc() -> Manifest:
    """One build carrying every kind of line report.md writes: notes on each artifact, cache events, the data's note,
    the detections' decode, the eager reference, unreliable latency, aarch64 rows, wall time and thresholds."""
    delegation = {
        "delegate": "XnnpackBackend",
        "delegated_nodes": 40,
        "non_delegated_nodes": 2,
        "delegated_subgraphs": 1,
        "ops_outside_delegate": {"_to_dim_order_copy": 2},
        "ops_outside_on_tensors": {"mean": 1},
    }
    profile = {
        "available": True,
        "source": "ExecuTorch ETDump (executorch.devtools.Inspector)",
        "runs": 5,
        "wall_ms": 6.1,
        "ops_ms": 5.2,
        "others_share": 0.0,
        "ops": [{"op": "Convolution (NHWC, F32) IGEMM", "ms": 5.2, "count": 34, "share": 1.0}],
        "conditions": {"reliable": True, "reasons": []},
    }
    memory = {"available": True, "peak_rss_increase_bytes": 9_000_000, "runtime_baseline_rss_bytes": 80_000_000}
    outliers = {
        "rows": [3, 7],
        "of": 12,
        "error_share": 0.9,
        "rms_over_median": {"over": 4.0, "max": 9.5},
        "peak_over_median": 3.0,
        "fidelity_without": {
            "samples": 10,
            "psnr_db": 45.0,
            "cosine": 1.0,
            "max_abs_error": 0.1,
            "top1_agreement": 1.0,
            "top5_agreement": 1.0,
        },
        "thresholds_met_without": True,
    }
    retry = {
        "kept": "calibrated ranges",
        "note": "remade",
        "per_inference": {"status": "failed", "reasons": [{"kind": "threshold", "text": "psnr_db 20 (needs >= 30)"}]},
    }
    arch_row = {
        "arch": "aarch64",
        "cpu": "cortex-a76",
        "emulated": True,
        "status": "passed",
        "reasons": [],
        "fidelity": {
            "samples": 12,
            "psnr_db": 60.0,
            "cosine": 1.0,
            "max_abs_error": 1e-6,
            "top1_agreement": 1.0,
            "top5_agreement": 1.0,
        },
        "vs_x86": {"max_abs_diff": 1e-6, "bit_identical": False, "rows_differing": 3},
        "latency_ms": None,
        "seconds": 12.0,
    }
    doc = _record(
        [
            _artifact(
                "executorch_fp32",
                details={"delegation": delegation},
                memory=memory,
                profile=profile,
                reasons=[{"kind": "note", "text": "ran with 2 threads where 4 were asked"}],
                aarch64=[arch_row],
            ),
            _artifact(
                "executorch_int8",
                status="failed",
                outlier_inputs=outliers,
                details={"quantization": _quantization(), "validation_retry": retry},
                latency_conditions={
                    **dict.fromkeys(["window_s", "cpus", "threads", "load_avg_1m", "other_cpu_s", "steal_s"], 2.0),
                    "spread": {"eager": 1.1},
                    "max_spread": 2.0,
                    "reliable": False,
                    "reasons": ["load average 3.1 on 2 cores"],
                },
            ),
            _artifact(
                "torchscript_lite_fp32",
                details={"xnnpack_rewrite": "unavailable", "xnnpack_rewrite_reason": "no XNNPACK in this torch"},
                input={"size_range": [64, 256]},
                sizes=[{"size": [64, 64], "images": 12, "status": "passed", "fidelity": {"pixel_agreement": 0.99}}],
            ),
        ]
    )
    doc["target"]["detection"] = {"kept_host_because": "no format of android takes NMS"}
    doc["eager"]["reference"] = {"kind": "unquantized float", "weight": "W", "checkpoint": None, "note": "its float"}
    doc["cache"] = {"root": "/cache", "events": ["executorch_fp32 restored from the cache"]}
    doc["data"]["note"] = "12 of 13 images read; one was not an image"
    doc["aarch64"] = {
        "cpus": ["cortex-a76"],
        "runner": {"key": "r1"},
        "seconds": 30,
        "instructions": {"unavailable": "no plugin"},
    }
    doc["timings_s"] = {"eager reference": 1.2, "executorch_int8": 61.3}
    return Manifest.from_json(doc)


def _plain(text: str) -> str:
    """Markdown or HTML as the words a reader sees: markup and <wbr> dropped, entities read, spaces collapsed."""
    text = re.sub(r"<style>.*?</style>", "", text, flags=re.S)
    text = re.sub(r"<[^>]+>", "", text).replace("**", "").replace("`", "")
    return re.sub(r"\s+", " ", __import__("html").unescape(text)).strip()


def _missing_from_page(md: str, page: str) -> tuple[list[str], int]:
    """(what report.md says that report.html does not, how many pieces were compared): every line of report.md,
    each table cell on its own, the title as the weight's name and verdict."""
    missing, checked, text = [], 0, _plain(page)
    for line in md.splitlines():
        if not line.strip() or line.startswith("|---"):
            continue
        if line.startswith("|"):
            parts = [_plain(cell) for cell in line.strip("|").split("|")]
        elif line.startswith("# "):
            parts = [line[2:].split(" → ")[0], line.rsplit("**", 2)[-2].lower()]
        else:
            parts = [_plain(line.lstrip("#").removeprefix("- "))]
        missing += [part for part in parts if part not in text]
        checked += len(parts)
    return missing, checked


def test_every_line_of_report_md_is_on_the_page():
    doc = _every_note_doc()
    md, page = report.markdown(doc), html_report.render([doc], [])
    missing, checked = _missing_from_page(md, page)
    assert not missing and checked > 60, missing
    # the lines the issue found missing from the page are among those compared
    for needle in (
        "unoptimized lite model written",
        "Thresholds per precision",
        "sha256 aaaaaaaaaaaaaaaa",
        "Wall time",
    ):
        assert needle in _plain(md)


def test_the_comparison_finds_a_line_the_page_leaves_out():
    doc = _every_note_doc()
    page = re.sub(r"<h2>Notes</h2>.*?(?=<h2>)", "", html_report.render([doc], []), flags=re.S)
    missing, _ = _missing_from_page(report.markdown(doc), page)
    assert any(m.startswith("Thresholds per precision") for m in missing) and any("cache:" in m for m in missing)


def test_the_page_fits_a_phone_width(tmp_path):
    doc = _every_note_doc()
    page = html_report.render([doc, _doc([_artifact("onnx_fp32")], target="jetson")], [tmp_path, tmp_path])
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
    # every table scrolls in a box of its own, so a wide table never widens the page
    tables = page.count("<table")
    assert tables >= 3 and page.count('<div class="scroll"><table') == tables
    assert re.search(r"\.scroll\{overflow-x:auto", page)
    # names break after "_" only, never inside a word
    assert '<td class="name" title="executorch_int8">executorch_<wbr>int8</td>' in page
    assert "overflow-wrap:anywhere" not in page and "word-break:break-all" not in page
    # charts are drawn no wider than a phone leaves them (390 px less the page's 2 × 16 px padding): their text is
    # shown at its own 12px, not scaled down
    charts = _charts(page)
    assert len(charts) >= 3 and svg_text.FONT_PX >= 11
    for chart in charts:
        assert float(ET.fromstring(chart).get("width")) <= 390 - 2 * 16
        _assert_clear(chart)


def _axis_ticks(chart: str) -> tuple[list[float], list[float]]:
    """(size ticks, metric ticks) of an accuracy-vs-size chart: tick labels below the plot and left of it."""
    root = ET.fromstring(chart)
    found = [
        (float(t.get("x")), float(t.get("y")), float(t.text)) for t in root.iter("text") if t.get("class") == "tick"
    ]
    lowest = max(y for _, y, _ in found)
    return [v for _, y, v in found if y == lowest], [v for _, y, v in found if y != lowest]


@pytest.mark.parametrize("count", [1, 4])
def test_artifacts_that_all_agree_still_get_axes_with_round_ticks_around_them(count):
    artifacts = [_artifact(f"a{i}_fp32", size=5_000_000, acc1=97.5) for i in range(count)]
    chart = html_report.accuracy_size_chart([_doc(artifacts)])
    _assert_clear(chart)
    sizes, metrics = _axis_ticks(chart)
    assert len(sizes) >= 3 and len(metrics) >= 3, (sizes, metrics)
    assert sizes[0] == 0 and sizes[-1] > 5.0 and metrics[0] < 97.5 < metrics[-1], (sizes, metrics)
    assert metrics[-1] - metrics[0] <= 5  # a range of a few points around it, not 0–100
    assert len(re.findall(r"<circle ", chart)) == count


def test_the_metric_axis_stays_within_0_and_100_percent():
    chart = html_report.accuracy_size_chart([_doc([_artifact("a_fp32", acc1=100.0), _artifact("b_int8", acc1=99.9)])])
    _, metrics = _axis_ticks(chart)
    assert metrics[-1] == 100 and metrics[0] < 99.9


def test_a_chart_with_nothing_to_plot_says_why():
    unlabeled = _doc([_artifact("a_fp32", accuracy=None)])
    unlabeled.data["labeled"] = False
    assert "needs labeled --data" in html_report.accuracy_size_chart([unlabeled])
    unavailable = _doc([_artifact("coreml_fp16", status="unavailable", p50=None)])
    assert "No artifact has both a measured acc@1 and a size" in html_report.accuracy_size_chart([unavailable])


@pytest.mark.parametrize("low,high", [(96.5, 98.5), (0.0, 6.93), (99.0, 100.0), (0.0, 1200.0), (0.013, 0.017)])
def test_ticks_are_round_and_cover_the_range(low, high):
    values = html_report.ticks(low, high)
    step = values[1] - values[0]
    assert 2 <= len(values) <= 5 and values[0] <= low and values[-1] >= high
    assert all(v2 - v1 == pytest.approx(step) for v1, v2 in itertools.pairwise(values))
    mantissa = step / 10 ** np.floor(np.log10(step))
    assert any(mantissa == pytest.approx(m) for m in (1, 2, 5)), step


# --- (e) operator names: XNNPACK's profiler calls its int8 lookup-table ops "Invalid Unary Op" ---
class _Int8Activation(torch.nn.Module):
    """A convolution with a ReLU (XNNPACK's graph then holds an unbounded clamp, written as inf), an activation
    XNNPACK has no int8 kernel for (it runs it as a 256-entry lookup table), a convolution."""

    def __init__(self, activation: torch.nn.Module):
        super().__init__()
        self.first, self.activation, self.second = torch.nn.Conv2d(3, 8, 3), activation, torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.second(self.activation(torch.relu(self.first(x))))


def test_an_int8_lookup_table_op_is_named_by_what_it_computes(tmp_path):
    from exporter.formats import executorch
    from exporter.quant import Calibration

    torch.manual_seed(0)
    x = torch.randn(1, 3, 16, 16)
    path = tmp_path / "hardswish_int8.pte"
    executorch.FORMAT.export(
        _Int8Activation(torch.nn.Hardswish()).eval(), x, "int8", Calibration([torch.randn(1, 3, 16, 16)] * 2), path, {}
    )
    profile = executorch.FORMAT.profile(path, x, 1, 1)
    if not profile.get("available"):
        pytest.skip(f"no operator profile: {profile.get('reason')}")
    ops = [o["op"] for o in profile["ops"]]
    assert executorch.XNNPACK_UNNAMED not in ops, ops  # the profiler's bare label is not what a reader gets ...
    named = [op for op in ops if executorch.XNNPACK_UNNAMED in op]
    assert named == [f"Hardswish (int8 lookup table; XNNPACK profiler name: {executorch.XNNPACK_UNNAMED})"], ops
    assert any(op.startswith("Convolution (NHWC, QC8)") for op in ops), ops  # ... and named ops stay as XNNPACK says
    assert executorch._lookup_table_kinds(path) == {"Hardswish"}  # read from the graph, not the fallback's words


def test_the_latency_chart_draws_the_builds_one_eager_baseline_once():
    """Every row timed against one eager baseline: one grey bar for it, one blue bar per artifact. A manifest from
    before the baseline (eager timed beside each artifact, each p50 its own) keeps a grey bar per artifact."""
    doc = _doc([_artifact("executorch_fp32", p50=4.0), _artifact("litert_fp32", p50=3.0)])
    shared = [full for _, _, full in _texts(html_report.latency_chart([doc]))[1]]
    assert shared.count("9.00 ms") == 1 and "eager (the build's baseline)" in shared
    assert not any(t.endswith("ms eager") for t in shared)
    doc.artifacts[1].eager_latency_ms = Latency.from_json(_latency(11.0))
    apart = [full for _, _, full in _texts(html_report.latency_chart([doc]))[1]]
    assert {"9.00 ms eager", "11.00 ms eager"} <= set(apart) and "eager (the build's baseline)" not in apart
