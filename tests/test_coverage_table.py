"""The coverage table (exporter.coverage.table): merging row files, refusing bad ones in one line, and
writing the JSON and Markdown together or not at all."""

from __future__ import annotations

import json

import pytest

from exporter import coverage
from exporter.coverage import table

from .coverage_helpers import merge_doc
from .helpers import assert_clean_refusal, run_cli


def test_a_merge_keeps_measured_rows_and_says_what_its_files_were_made_with(tmp_path):
    row = {"weight": "W.V1", "model": "w", "task": "classification", "params": 40e6, "target": "android"}
    built = dict(row, outcome="built", reason=None, seconds=3.0, time_limit_s=900, cells=[])
    skipped = dict(row, outcome="skipped", reason="40M parameters, over --max-params 30M", seconds=0.0, cells=[])
    other = dict(built, weight="X.V1", model="x", time_limit_s=3600)
    whole = merge_doc(tmp_path, "whole.json", [built], 900)
    small = merge_doc(tmp_path, "small.json", [skipped, other], 3600, "2.15.0")
    # a later sweep with --max-params skips what an earlier one built: the measured row stays
    doc = coverage.merge([whole, small], tmp_path / "m", command="test")
    assert {r["weight"]: r["outcome"] for r in doc["rows"]} == {"W.V1": "built", "X.V1": "built"}
    # ...while a skipped row is replaced by one that was built
    assert {
        r["weight"]: r["outcome"] for r in coverage.merge([small, whole], tmp_path / "n", command="test")["rows"]
    } == {"W.V1": "built", "X.V1": "built"}
    text = (tmp_path / "m" / "coverage.md").read_text()
    assert "time limit 900 to 3600 s per build" in text and "torch 2.14.1 / 2.15.0" in text
    # the sweeps merged are listed under the table, not in its header
    assert "| merged from | 2 file(s): [the commands that made them](#merged-from) |" in text
    merged_from = text.split("\n## Merged from\n", 1)[1].split("\n## ", 1)[0]
    assert merged_from.count("\n- `test`") == 1  # one line per sweep: both files were made by `test` the same day
    # a file named on the command line that is not a table is refused, not left out of a "complete" merge
    (tmp_path / "cut.json").write_text(whole.read_text()[:100])
    (tmp_path / "no_rows.json").write_text(json.dumps({"coverage_version": table.COVERAGE_VERSION}))
    for bad in ("cut.json", "no_rows.json"):
        result = run_cli("coverage", "--merge", whole, tmp_path / bad, "--out", tmp_path / "bad")
        assert result.exit_code == 2 and "is not a coverage JSON file" in result.stderr, result.output
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())
    # a merged table merged again (alone, or with more rows) still names every host its rows were built on
    for path, cpu in ((whole, "Intel Xeon"), (small, "AMD EPYC")):
        doc = json.loads(path.read_text())
        doc["host"] = dict(doc["host"], cpu=cpu)
        doc["run"] = {"wall_s": 10.0 if path == whole else 20.0}
        path.write_text(json.dumps(doc))
    coverage.merge([whole, small], tmp_path / "two", command="test")
    again = coverage.merge([tmp_path / "two" / "coverage.json"], tmp_path / "again", command="test")
    assert sorted(h["cpu"] for h in again["hosts"]) == ["AMD EPYC", "Intel Xeon"]
    assert again["run"]["shards_wall_s"] == [10.0, 20.0] and again["run"]["wall_s"] == 20.0  # each shard's, still
    host_line = next(
        line for line in (tmp_path / "again" / "coverage.md").read_text().splitlines() if line.startswith("| host |")
    )
    assert "AMD EPYC" in host_line and "Intel Xeon" in host_line


def test_a_sweep_of_one_format_adds_its_column_to_the_rows_of_a_whole_sweep(tmp_path):
    def cell(name, outcome, **more):
        fmt, precision = name.rsplit("_", 1)
        return {"name": name, "format": fmt, "precision": precision, "status": "passed", "outcome": outcome, **more}

    def acc(eager):
        return {"eager_acc1": eager, "acc1": eager}

    row = {"model": "w", "task": "classification", "params": 4e6, "target": "android", "reason": None}
    built = dict(row, outcome="built", time_limit_s=900, status="passed")
    whole = merge_doc(
        tmp_path,
        "whole.json",
        [
            dict(built, weight="W.V1", seconds=30.0, cells=[cell("executorch_fp32", "passed")]),
            dict(built, weight="X.V1", seconds=40.0, cells=[cell("executorch_fp32", "passed")]),
            dict(built, weight="Y.V1", seconds=50.0, cells=[cell("executorch_fp32", "passed", accuracy=acc(99.4))]),
        ],
        900,
    )
    refusal = "litert: torch.export stops in this graph; export failed: UnsupportedOp aten.foo"
    column = merge_doc(
        tmp_path,
        "litert.json",
        [
            dict(
                built,
                weight="W.V1",
                seconds=5.0,
                status="failed",
                cells=[cell("litert_fp32", "export", reason=refusal)],
            ),
            dict(row, weight="X.V1", outcome="skipped", reason="over --max-params", seconds=0.0, cells=[]),
            dict(built, weight="Y.V1", seconds=9.0, cells=[cell("litert_fp32", "passed", accuracy=acc(96.5))]),
        ],
        900,
        formats=("litert:fp32",),
    )
    doc = coverage.merge([whole, column], tmp_path / "m", command="test")
    rows = {r["weight"]: r for r in doc["rows"]}
    assert [c["name"] for c in rows["W.V1"]["cells"]] == ["executorch_fp32", "litert_fp32"]
    assert rows["W.V1"]["seconds"] == 35.0 and rows["W.V1"]["status"] == "failed"
    assert [c["name"] for c in rows["X.V1"]["cells"]] == ["executorch_fp32"]  # a skip hides no measured row
    header = next(line for line in (tmp_path / "m" / "coverage.md").read_text().splitlines() if "| weight |" in line)
    assert "| executorch_fp32 | litert_fp32 |" in header
    # a trained model trained again for the column's sweep is another model: its cell names its own eager
    assert "acc@1 96.5 (its own eager 96.5)" in (tmp_path / "m" / "coverage.md").read_text()
    # the same column swept again replaces its cells, not the others; a whole sweep later replaces the row
    again = merge_doc(
        tmp_path,
        "again.json",
        [dict(built, weight="W.V1", seconds=6.0, cells=[cell("litert_fp32", "passed")])],
        900,
        formats=("litert:fp32",),
    )
    twice = {r["weight"]: r for r in coverage.merge([whole, column, again], tmp_path / "t", command="test")["rows"]}
    assert [(c["name"], c["outcome"]) for c in twice["W.V1"]["cells"]] == [
        ("executorch_fp32", "passed"),
        ("litert_fp32", "passed"),
    ]
    rebuilt = {
        r["weight"]: r
        for r in coverage.merge([tmp_path / "m" / "coverage.json", whole], tmp_path / "w", command="test")["rows"]
    }
    assert [c["name"] for c in rebuilt["W.V1"]["cells"]] == ["executorch_fp32"]


def test_rows_built_at_a_classifier_size_merge_with_rows_at_the_crop_and_say_their_size(tmp_path):
    row = {
        "weight": "W.V1",
        "model": "w",
        "task": "classification",
        "params": 4e6,
        "target": "android",
        "outcome": "built",
        "reason": None,
        "seconds": 3.0,
        "time_limit_s": 900,
        "cells": [],
    }
    whole = merge_doc(tmp_path, "whole.json", [row], 900)
    small = merge_doc(
        tmp_path, "small.json", [dict(row, weight="X.V1", model="x", classifier_size=[96, 96])], 900, classifier_size=96
    )
    doc = coverage.merge([whole, small], tmp_path / "m", command="test")
    assert {r["weight"]: r.get("classifier_size") for r in doc["rows"]} == {"W.V1": None, "X.V1": [96, 96]}
    text = (tmp_path / "m" / "coverage.md").read_text()
    assert "| X.V1 (96×96) |" in text and "| W.V1 |" in text and "or at the size their row names" in text


MERGE_ROW = {
    "weight": "W.V1",
    "model": "w",
    "task": "classification",
    "params": 4e6,
    "target": "android",
    "outcome": "built",
    "reason": None,
    "seconds": 3.0,
    "time_limit_s": 900,
    "cells": [],
}


@pytest.mark.parametrize(
    "rows,needle",
    [
        ([{"foo": 1}], "row 1 has no 'weight'"),
        ([1], "row 1 is a number, not an object"),
        ([MERGE_ROW, dict(MERGE_ROW, weight="X.V1", outcome="finished")], "row 2 (X.V1 × android) outcome 'finished'"),
        ([dict(MERGE_ROW, cells=[{"name": "onnx_fp32", "outcome": "passed"}, "passed"])], "cell 2 is a string"),
        ([dict(MERGE_ROW, params="4M")], "'params', not a number"),
        (
            [dict(MERGE_ROW, cells=[{"name": "onnx_fp32", "outcome": "failed", "kind": "validation", "reasons": 5}])],
            "row 1 (W.V1 × android) cell 1 (onnx_fp32): 'reasons' is not a list of reasons (objects with a kind",
        ),
        (  # a sentence without its kind (a row from before manifest schema 4): nothing to decide on
            [
                dict(
                    MERGE_ROW,
                    cells=[
                        {
                            "name": "onnx_fp32",
                            "outcome": "failed",
                            "kind": "validation",
                            "reasons": ["top1_agreement 0.5 (needs >= 0.97)"],
                        }
                    ],
                )
            ],
            "row 1 (W.V1 × android) cell 1 (onnx_fp32): 'reasons' is not a list of reasons (objects with a kind",
        ),
        (  # a kind this exporter does not know
            [
                dict(
                    MERGE_ROW,
                    cells=[
                        {
                            "name": "onnx_fp32",
                            "outcome": "failed",
                            "kind": "validation",
                            "reasons": [{"kind": "bad_luck", "text": "x"}],
                        }
                    ],
                )
            ],
            "row 1 (W.V1 × android) cell 1 (onnx_fp32): 'reasons' is not a list of reasons (objects with a kind",
        ),
        (
            [dict(MERGE_ROW, earlier_runs=[{"seconds": "1 h"}])],
            "row 1 (W.V1 × android) 'earlier_runs' is not a list of",
        ),
    ],
)
def test_a_coverage_file_with_a_bad_row_is_refused_in_one_line_naming_it(rows, needle, tmp_path):
    good = merge_doc(tmp_path, "good.json", [dict(MERGE_ROW, weight="Y.V1")], 900)
    (tmp_path / "shards").mkdir()
    bad = merge_doc(tmp_path / "shards", "bad.json", rows, 900)
    # named on the command line, or found in a directory: a table with bad rows is refused either way
    for i, paths in enumerate(([good, bad], [good, tmp_path / "shards"])):
        out = tmp_path / f"out{i}"
        result = run_cli("coverage", "--merge", *paths, "--out", out)
        assert_clean_refusal(result, out, str(bad), "is not a valid coverage table", needle)
        assert not out.exists()


def test_a_refused_merge_leaves_no_output_directory(tmp_path):
    good = merge_doc(tmp_path, "good.json", [MERGE_ROW], 900)
    bad = merge_doc(tmp_path, "bad.json", [{"foo": 1}], 900)
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "nan.json").write_text(good.read_text().replace('"seconds": 3.0', '"seconds": NaN'))
    (tmp_path / "empty").mkdir()
    for i, (paths, needle) in enumerate(
        [
            ([good, tmp_path / "missing.json"], "does not exist"),
            ([good, tmp_path / "garbage.json"], "is not a coverage JSON file"),
            ([tmp_path / "nan.json"], "is not a coverage JSON file"),  # json.loads reads NaN; the table never has it
            ([tmp_path / "empty"], "no coverage JSON files"),
            ([bad, good], "row 1 has no 'weight'"),
        ]
    ):
        out = tmp_path / f"out{i}" / "table"
        result = run_cli("coverage", "--merge", *paths, "--out", out)
        assert_clean_refusal(result, out, needle)
        assert not out.parent.exists(), (needle, list(out.parent.rglob("*")))


def test_a_merge_that_fails_while_writing_leaves_the_previous_table_whole(tmp_path, monkeypatch):
    first = merge_doc(tmp_path, "first.json", [MERGE_ROW], 900)
    second = merge_doc(tmp_path, "second.json", [dict(MERGE_ROW, weight="X.V1", model="x")], 900)
    out = tmp_path / "out"
    assert run_cli("coverage", "--merge", first, "--out", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["coverage.json", "coverage.md"]

    # the Markdown fails after the JSON could have been written: neither file changes, no staging file is left
    def broken(doc):
        raise RuntimeError("the table cannot be rendered")

    with monkeypatch.context() as patch:
        patch.setattr(table, "markdown", broken)
        result = run_cli("coverage", "--merge", first, second, "--out", out)
    assert result.exit_code == 3 and "RuntimeError: the table cannot be rendered" in result.stderr, result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    # the Markdown's place is taken (a directory): refused in one line, and the JSON is not written without it
    other = tmp_path / "other"
    (other / "coverage.md").mkdir(parents=True)
    result = run_cli("coverage", "--merge", first, second, "--out", other)
    assert result.exit_code == 2 and "Traceback" not in result.output, (result.output, result.exception)
    assert "cannot write coverage.json and coverage.md" in result.stderr.strip().splitlines()[-1], result.stderr
    assert [p.name for p in other.iterdir()] == ["coverage.md"] and not any((other / "coverage.md").iterdir())

    # and a good merge replaces both
    assert run_cli("coverage", "--merge", first, second, "--out", out).exit_code == 0
    assert {r["weight"] for r in json.loads((out / "coverage.json").read_text())["rows"]} == {"W.V1", "X.V1"}
    assert "| X.V1 |" in (out / "coverage.md").read_text() and sorted(p.name for p in out.iterdir()) == sorted(before)
