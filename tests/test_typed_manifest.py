"""The typed manifest: what a build holds as values is written to JSON only at the edge, and the JSON is what it
was before the fields were typed: tests/golden_json/hand_built_manifest.json was written from
tests/hand_built_manifest.py by the untyped code of commit a72da1a (its results.py, files.py, errors.py and
release/manifest.py alone), before any of these fields had a type; its eager baseline's `build`, bundled program,
a row's instruction counts and the cache record (as a build writes them) by the code of 686bc6b, where those were
still dicts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from exporter.release import manifest as manifest_file
from exporter.results import (
    ArtifactResult,
    CacheUse,
    Checkpoint,
    Host,
    InputDescription,
    Labels,
    Latency,
    Manifest,
    Memory,
    Metric,
    Profile,
    ProxyMetrics,
    Reason,
    Status,
    threshold,
)
from exporter.thresholds import FRACTIONS, TASK_KEYS, THRESHOLD_KEYS, breaches

from .fake_manifest import complete
from .hand_built_manifest import manifest as hand_built

BEFORE = Path(__file__).parent / "golden_json" / "hand_built_manifest.json"


def test_a_hand_built_manifest_writes_the_json_it_wrote_before_it_was_typed(tmp_path):
    manifest_file.write(tmp_path, hand_built())
    written = (tmp_path / "manifest.json").read_text()
    assert written == BEFORE.read_text()


def test_a_manifest_read_back_writes_the_same_json():
    read_back = Manifest.from_json(json.loads(BEFORE.read_text()))
    assert manifest_file.dumps(read_back) == BEFORE.read_text()
    assert manifest_file.dumps(Manifest.from_json(json.loads(manifest_file.dumps(read_back)))) == BEFORE.read_text()


def test_update_refuses_a_name_that_is_no_field_and_the_unknown_fields_holder():
    entry = ArtifactResult(name="a", format="onnx", precision="fp32")
    entry.update(export_s=1.5)
    assert entry.export_s == 1.5
    for name in ("exports", "extra"):
        with pytest.raises(TypeError, match=name):
            entry.update({name: {}})


def test_the_checkpoint_is_a_value_until_the_manifest_is_written():
    record = hand_built_record()["checkpoint"]
    typed = Checkpoint(**record)
    doc = hand_built()
    assert doc.checkpoint == typed and doc.checkpoint.verified is True  # a record given is read as a Checkpoint
    doc.checkpoint = typed
    reference = {"kind": "unquantized float", "weight": "Float.TEST", "checkpoint": typed}
    doc.eager = dataclasses.replace(doc.eager, reference=reference)
    assert doc.eager.reference.checkpoint is typed
    written = json.loads(manifest_file.dumps(doc))
    assert list(written["checkpoint"].items()) == list(record.items())
    assert written["eager"]["reference"]["checkpoint"] == record
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.sha256 = "0" * 64


def test_a_checkpoint_keeps_keys_this_exporter_does_not_know_and_needs_the_four_it_does():
    record = {**hand_built_record()["checkpoint"], "mirror": "https://example.org/tiny.pth"}
    assert Checkpoint.from_json(record).to_json() == record
    with pytest.raises(TypeError):
        Checkpoint.from_json({k: v for k, v in record.items() if k != "verified"})


def hand_built_record() -> dict:
    return json.loads(BEFORE.read_text())


def test_the_metric_names_are_one_enum_and_write_as_the_strings_they_were():
    assert set(THRESHOLD_KEYS) == set(Metric) and all(isinstance(key, Metric) for key in THRESHOLD_KEYS)
    assert {key for keys in TASK_KEYS.values() for key in keys} | set(FRACTIONS) <= set(Metric)
    (broken,) = breaches({"fidelity": {"psnr_db": 25.0}}, {"psnr_db": 30.0})  # a profile's keys are plain strings
    assert broken.metric is Metric.PSNR_DB and broken.text == "psnr_db 25 (needs >= 30)"
    record = broken.to_json()
    assert type(record["metric"]) is str and json.dumps(record) == json.dumps({**record, "metric": "psnr_db"})
    assert Reason.from_json(record) == broken and f"{Metric.ACCURACY_DROP}" == "accuracy_drop"
    with pytest.raises(ValueError):
        threshold("psnr", "psnr 25 (needs >= 30)", 25.0, 30.0)


def test_the_host_and_the_labels_are_values_and_a_build_writes_all_of_their_keys():
    doc = hand_built()
    assert doc.host == Host(platform="Linux", machine="x86_64", cpu="Test CPU", cores=2, threads=1, python="3.11.7")
    assert doc.labels == Labels(file="labels.txt", count=2, from_file=None)
    written = json.loads(manifest_file.dumps(doc))
    assert list(written["host"]) == ["platform", "machine", "cpu", "cores", "threads", "python"]
    assert written["labels"] == {"file": "labels.txt", "count": 2, "from_file": None}


def test_a_manifest_made_by_hand_with_only_the_keys_the_schema_requires_reads_as_values():
    doc = Manifest.from_json(complete({"labels": {"count": 3, "note": "mine"}}))
    assert (doc.host.cpu, doc.host.threads, doc.host.machine) == ("Test CPU", 1, None)
    assert (doc.labels.file, doc.labels.count) == ("labels.txt", 3)
    assert doc.labels.to_json() == {"file": "labels.txt", "count": 3, "from_file": None, "note": "mine"}
    with pytest.raises(TypeError):
        Labels.from_json({"file": "labels.txt"})


# Each record as its producer writes it (formats/memory.py, formats/executorch.py, tasks/image_input.describe,
# engine/pipeline.py, validation.evaluate, engine/record.py): read as its value, written back key for key.
PRODUCED = [
    (Memory, {"available": False, "reason": "onnx has no memory measurement"}),
    (
        Memory,
        {
            **{"available": True, "planned_bytes": 10, "planned_buffers": [10], "planned_note": "plan"},
            **{"constants_bytes": 5, "delegate_blobs_bytes": 1, "peak_rss_bytes": 100},
            **{"runtime_baseline_rss_bytes": 90, "peak_rss_increase_bytes": 10, "load_increase_bytes": 2, "runs": 2},
            "method": "a fresh process",
        },
    ),
    (
        Profile,
        {
            **{"available": True, "source": "ONNX Runtime profiler", "runs": 5, "wall_ms": 2.5, "ops_ms": 2.0},
            "ops": [
                {"op": "Conv", "ms": 1.5, "count": 3, "share": 0.75},
                {"op": "Add", "ms": 0.5, "count": 1.5, "share": 0.25},
            ],
            "others_share": 0.0,
            "conditions": {"window_s": 0.1, "threads": 1, "reliable": True, "reasons": []},
        },
    ),
    (InputDescription, {"format": "own", "note": "Core ML's image input", "size_range": [64, 224]}),
    (
        InputDescription,
        {"format": "uint8-nhwc", "dtype": "uint8", "layout": "NHWC", "shape": [1, 8, 8, 3], "preprocessing": "p"},
    ),
    (
        ProxyMetrics,
        {
            **{"fidelity": {"psnr_db": 70.0}, "accuracy": None, "reasons": [], "status": "passed"},
            **{"outlier_inputs": {"rows": [1], "of": 8}, "latency_ms": None, "eager_latency_ms": None},
            "speedup_vs_eager": None,
        },
    ),
    (CacheUse, {"root": "/c", "events": ["whole build reused from the cache"], "build_record": "ab" * 32}),
    (Latency, {"p50": 1.0, "p90": 1.5, "p99": 2.0, "mean": 1.1, "iterations": 5}),
]


@pytest.mark.parametrize(("kind", "record"), PRODUCED, ids=[f"{k.__name__}-{i}" for i, (k, _) in enumerate(PRODUCED)])
def test_a_record_as_its_producer_writes_it_reads_as_a_value_and_writes_back_key_for_key(kind, record):
    typed = kind.from_json(json.loads(json.dumps(record)))
    assert isinstance(typed, kind) and not typed.extra and kind.from_json(typed) is typed
    assert json.dumps(typed.to_json()) == json.dumps(record)


def test_an_artifact_result_holds_its_records_as_values_however_they_are_given():
    entry = ArtifactResult(name="a", format="onnx", precision="fp32", memory={"available": False, "reason": "r"})
    entry.update(latency_ms={"p50": 2.0, "p90": 3.0}, profile=Profile(available=False, reason="r"))
    assert isinstance(entry.memory, Memory) and entry.profile.reason == "r" and entry.latency_ms.p50 == 2.0
    entry.update(proxy={"weights": PRODUCED[5][1]})
    assert entry.proxy["weights"].status is Status.PASSED and entry.proxy["weights"].accuracy is None
    assert entry.to_json()["latency_ms"] == {"p50": 2.0, "p90": 3.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.latency_ms.p50 = 1.0
