"""Outcomes as values (exporter.results): every decision reads a reason's kind (and its threshold key, value or
emulated CPU), never its text; the manifest holds each reason as {"kind", "text", ...}."""

from __future__ import annotations

import json

import pytest

from exporter.coverage import outcome
from exporter.engine import record
from exporter.release import manifest, recommend
from exporter.results import ArtifactResult, Kind, Manifest, Reason, Status, jsonable, kinds, texts, threshold
from exporter.thresholds import breaches

from .fake_manifest import complete

REWORDED = "said another way entirely"  # no sentence any code could recognise


def _reworded(reason: Reason) -> dict:
    """The same reason with other words: what a reworded message would write."""
    return Reason(reason.kind, REWORDED, reason.metric, reason.cpu, reason.value, reason.limit).to_json()


def test_a_reason_round_trips_through_its_json_record():
    found = threshold("psnr_db", "psnr_db 25.1 (needs >= 30)", 25.1, 30.0).on_cpu("cortex-a76")
    record_ = found.to_json()
    assert record_ == {
        "kind": "threshold",
        "text": "aarch64 cortex-a76 (emulated): psnr_db 25.1 (needs >= 30)",
        "metric": "psnr_db",
        "cpu": "cortex-a76",
        "value": 25.1,
        "limit": 30.0,
    }
    assert Reason.from_json(json.loads(json.dumps(record_))) == found
    assert Reason(Kind.NOTE, "n").to_json() == {"kind": "note", "text": "n"}  # unset fields are left out
    assert kinds([found, record_]) == {Kind.THRESHOLD} and texts([found, record_]) == [found.text] * 2
    assert f"{Status.FAILED}" == "failed" and json.dumps(jsonable({"s": Status.PASSED, "r": [found]}))


def test_the_schema_names_every_kind():
    assert set(manifest.schema()["$defs"]["reason"]["properties"]["kind"]["enum"]) == {k.value for k in Kind}


def test_breaches_name_the_key_the_value_and_the_limit():
    (broken,) = breaches(
        {"fidelity": {"top1_agreement": 0.75, "psnr_db": 41.0}}, {"top1_agreement": 0.97, "psnr_db": 30}
    )
    assert (broken.kind, broken.metric, broken.value, broken.limit) == (Kind.THRESHOLD, "top1_agreement", 0.75, 0.97)
    assert broken.text == "top1_agreement 0.75 (needs >= 0.97)"
    (nan,) = breaches({"fidelity": {"psnr_db": float("nan")}}, {"psnr_db": 30})
    assert nan.value is None and json.dumps(nan.to_json(), allow_nan=False)  # NaN breaks any threshold, JSON holds it


def _artifact(reasons, **fields) -> dict:
    return {
        "name": "a",
        "format": "onnx",
        "precision": "int8",
        "path": "m.onnx",
        "size_bytes": 1,
        "status": "failed",
        "reasons": reasons,
        "details": {},
        **fields,
    }


CASES = [  # (reason, artifact fields, the cell's outcome and kind)
    (
        Reason(Kind.NOT_MADE, "cannot take a video graph: …"),
        {"status": "unavailable", "path": None},
        ("refused", "by design"),
    ),
    (
        Reason(Kind.UNAVAILABLE_HERE, "not built on this host: no GPU"),
        {"status": "unavailable", "path": None},
        ("unavailable", "cannot build here"),
    ),
    (Reason(Kind.DOES_NOT_LOAD, "does not load: RuntimeError: x"), {}, ("failed", "runtime error")),
    (Reason(Kind.DOES_NOT_RUN, "does not run on every validation input: x"), {}, ("failed", "runtime error")),
    (
        Reason(Kind.DEGENERATE_REFERENCE, "fidelity not measurable: degenerate …"),
        {},
        ("failed", "degenerate reference"),
    ),
    (
        Reason(Kind.EMULATOR_TIMEOUT, "could not run on aarch64: timed out after 9 s under qemu").on_cpu("cortex-a53"),
        {"aarch64": [{"cpu": "cortex-a53", "status": "failed"}]},
        ("time", "time limit"),
    ),
    (Reason(Kind.DISK_FULL, "export failed: OSError: [Errno 28] …"), {"path": None}, ("export", "disk full")),
    (threshold("psnr_db", "psnr_db 25 (needs >= 30)", 25.0, 30.0), {}, ("failed", "validation")),
]


def test_a_reworded_reason_changes_no_cell_of_the_coverage_table():
    for reason, fields, expected in CASES:
        for said in (reason.to_json(), _reworded(reason)):
            cell = outcome.cell_from_artifact(_artifact([said], **fields))
            assert (cell["outcome"], cell["kind"]) == expected, (said, cell)
    # an emulated CPU's runtime failure is that CPU's verdict, not a runtime error on this host
    there = Reason(Kind.DOES_NOT_RUN, "could not run on aarch64: illegal instruction").on_cpu("cortex-a53")
    assert outcome.cell_from_artifact(_artifact([_reworded(there)]))["kind"] == "validation"


def test_a_reworded_threshold_is_explained_by_the_floor_as_before():
    """The floors compare keys and values the reasons carry (metric, value), not numbers read back from text."""
    floor = {
        "int8": {
            "fidelity": {"psnr_db": 29.6},
            "reasons": [_reworded(breaches({"fidelity": {"psnr_db": 29.6}}, {"psnr_db": 30})[0])],
        }
    }
    for artifact_db, kind in ((27.0, "ill-conditioned reference"), (12.0, "validation")):
        (broken,) = breaches({"fidelity": {"psnr_db": artifact_db}}, {"psnr_db": 30})
        cell = {"precision": "int8", "outcome": "failed", "kind": "validation", "reasons": [_reworded(broken)]}
        assert outcome.reclassify({"floor": floor, "cells": [cell]})["cells"][0]["kind"] == kind, artifact_db


def test_not_made_and_unsettled_outcomes_are_read_from_kinds():
    not_made = _artifact([_reworded(Reason(Kind.NOT_MADE, "cannot take …"))], status="unavailable", path=None)
    unavailable = dict(not_made, name="b", reasons=[_reworded(Reason(Kind.UNAVAILABLE_HERE, "cannot take …"))])
    artifacts = [{**a, "thresholds": {}} for a in (not_made, unavailable)]  # as a manifest holds them
    pick = recommend.choose(Manifest.from_json(complete({"target": {"name": "t"}, "artifacts": artifacts})))
    assert (pick["not_made"], pick["unavailable"]) == (["a"], ["b"])

    # a crash may not repeat: not replayed; a threshold whose text happens to read like one is a settled verdict
    def unsettled(reasons, **fields) -> bool:  # read as the build record reads it: from the typed manifest
        return record._unsettled(ArtifactResult.from_json({**_artifact(reasons, **fields), "thresholds": {}}))

    assert unsettled([_reworded(Reason(Kind.EXPORT_FAILED, "export failed: x"))])
    assert not unsettled([threshold("psnr_db", "export failed: psnr_db 25", 25.0, 30.0).to_json()])
    # an emulated CPU's failure to run is its verdict there, replayed as before
    arm = Reason(Kind.DOES_NOT_RUN, "could not run on aarch64: x").on_cpu("cortex-a53")
    assert not unsettled([arm.to_json()])
    golden = Reason(Kind.BUNDLED_PROGRAM_FAILED, REWORDED)
    assert unsettled([], status="passed", details={"golden_program": golden.to_json()})
    assert not unsettled([], status="passed", details={"golden_program": Reason(Kind.NOTE, "x")})


def test_the_int8_remake_reads_which_thresholds_broke_from_the_reasons_kinds():
    from exporter.engine import pipeline

    entry = _artifact(
        [Reason(Kind.THRESHOLD, REWORDED, metric="psnr_db", value=25.0, limit=30.0)],
        thresholds={"psnr_db": 30.0},
        fidelity={"psnr_db": 25.0},
        details={"quantization": {"meets_budget": True}},
    )
    assert pipeline._ranges_did_not_hold(ArtifactResult.from_json(entry))
    for other in (Reason(Kind.DEGENERATE_REFERENCE, "psnr_db 25 (needs >= 30)"), Reason(Kind.NON_FINITE, "psnr_db")):
        remade = ArtifactResult.from_json(dict(entry, reasons=[*entry["reasons"], other]))
        assert not pipeline._ranges_did_not_hold(remade), other


def test_a_manifest_reads_and_writes_back_as_it_was_read_its_unknown_fields_kept():
    """release/manifest.py reads a manifest into Manifest (`exporter validate`) and writes it back: every field it
    was read with comes back, those this exporter does not know (the schema leaves records open) included."""
    from exporter.results import EmulatedRow, Manifest

    row = {"arch": "aarch64", "cpu": "cortex-a53", "why": "w", "emulated": True, "latency_ms": None, "seconds": 1.5}
    row |= {"runtime": {}, "status": "failed", "fidelity": None, "accuracy": None, "vs_x86": None, "note": "mine"}
    row["reasons"] = [Reason(Kind.DOES_NOT_RUN, "could not run on aarch64: x").to_json()]
    artifact = _artifact([threshold("psnr_db", "psnr_db 25 (needs >= 30)", 25.0, 30.0).to_json()], aarch64=[row])
    artifact |= {"sha256": None, "thresholds": {}, "fidelity": None, "accuracy": None, "latency_ms": None}
    artifact |= {"eager_latency_ms": None, "speedup_vs_eager": None, "annotation": {"by": "a user"}}
    doc = {name: {} for name in ("weight", "task", "checkpoint", "preprocessing", "labels", "target", "tools")}
    doc |= {name: {} for name in ("host", "data", "eager", "timings_s")}
    doc["weight"] = {"name": "W.TEST", "model": "w", "num_classes": 2, "meta": {}, "origin": "mine"}
    doc["eager"] = {"accuracy": None, "reference": {"kind": "float eager", "weight": "W.TEST", "checkpoint": None}}
    doc["checkpoint"] = {"path": "/c.pth", "sha256": "0" * 64, "source": "checkpoint", "verified": False, "why": "mine"}
    doc["labels"] = {"file": "labels.txt", "count": 2, "from_file": None, "language": "en"}
    doc["host"] = {"platform": "Linux", "machine": "x86_64", "cpu": "c", "cores": None, "threads": 1, "python": "3.11"}
    doc |= {"schema_version": 4, "exporter_version": "0", "exporter_commit": None, "created": "2026-12-03"}
    doc |= {"command": ["exporter"], "status": "failed", "artifacts": [artifact], "reviewed": True}
    manifest = Manifest.from_json(json.loads(json.dumps(doc)))
    assert manifest.status is Status.FAILED and manifest.artifacts[0].status is Status.FAILED
    assert isinstance(manifest.artifacts[0].aarch64[0], EmulatedRow) and manifest.artifacts[0].aarch64[0].failed()
    assert manifest.artifacts[0].reasons[0].metric == "psnr_db"
    assert jsonable(manifest) == doc


def test_an_artifact_result_takes_only_its_own_fields_and_types_what_it_is_given():
    entry = ArtifactResult("a", "onnx", "fp32", status="passed", reasons=[Reason(Kind.NOTE, "x").to_json()])
    assert entry.passed() and entry.reasons == [Reason(Kind.NOTE, "x")]
    entry.update({"status": "failed", "fidelity": {"psnr_db": 1.0}})
    assert entry.status is Status.FAILED and not entry.passed()
    with pytest.raises(TypeError, match="fidelty"):
        entry.update(fidelty={})  # a misspelt field is an error, never a new key in the manifest
    assert "fidelty" not in entry.to_json() and entry.to_json()["fidelity"] == {"psnr_db": 1.0}
