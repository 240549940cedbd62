"""`exporter coverage` cannot rot: a real sweep of two small weights (random weights, ONNX fp32 on the jetson
target, the cheapest artifact), one weight the exporter refuses (Mask R-CNN) and one skipped for size;
resumed from the row cache, sharded and merged, stopped at a time limit, built again in its --builds folder.
About a minute on 2 shared cores."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from .coverage_helpers import SMALL
from .helpers import run_cli

SWEEP = [
    "coverage",
    "--models",
    ",".join(SMALL + ["maskrcnn_resnet50_fpn", "resnet18"]),
    "--one-per-builder",
    "--target",
    "jetson",
    "--format",
    "onnx:fp32",
    "--max-params",
    "3000000",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A row cache of this module's own (the builds' children inherit it through the environment)."""
    return tmp_path_factory.mktemp("coverage_cache")


def _sweep(cache_dir: Path, out: Path, *extra: str):
    started = time.perf_counter()
    result = run_cli(*SWEEP, "--out", out, *extra, env={"EXPORTER_CACHE": str(cache_dir)})
    return result, time.perf_counter() - started


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("coverage_out")
    result, seconds = _sweep(cache_dir, out)
    assert result.exit_code == 0, (result.output, result.exception)
    return out, result, seconds


def _rows(out: Path, name: str = "coverage.json") -> dict:
    doc = json.loads((out / name).read_text())
    return {r["weight"].split("_Weights")[0].lower(): r for r in doc["rows"]}


def test_sweep_builds_refuses_and_skips(first_run, cache_dir):
    out, result, _ = first_run
    doc = json.loads((out / "coverage.json").read_text())
    rows = _rows(out)
    assert set(rows) == {"mobilenet_v3_small", "squeezenet1_1", "maskrcnn_resnet50_fpn", "resnet18"}
    assert doc["complete"] and doc["planned_rows"] == 4 and {r["target"] for r in doc["rows"]} == {"jetson"}
    for name in SMALL:
        row = rows[name]
        assert row["outcome"] == "built" and row["status"] == "passed", row
        (cell,) = row["cells"]
        assert (cell["name"], cell["outcome"]) == ("onnx_fp32", "passed"), cell
        assert cell["size_bytes"] > 1_000_000 and cell["export_s"] > 0 and row["seconds"] > 0
        # the random checkpoint: BN statistics settled, outputs that vary across inputs
        assert row["checkpoint"]["batchnorms_settled"] > 0 or name == "squeezenet1_1"
        assert row["checkpoint"]["reference_spread"]["relative_std"] > 0.01
        assert row["input_size"] == [224, 224]  # a classifier's own crop, whatever the sweep's --input-size
    refused = rows["maskrcnn_resnet50_fpn"]
    assert refused["outcome"] == "refused" and "masks have no output layout" in refused["reason"]
    assert refused["cells"] == []  # refused without building
    assert rows["resnet18"]["outcome"] == "skipped" and "--max-params" in rows["resnet18"]["reason"]
    (group,) = [g for g in doc["summary"] if g["task"] == "classification"]
    assert (group["built"], group["skipped"], group["artifacts"]["passed"]) == (2, 1, 2)
    # one progress line per build, on stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(lines) == 4 and sum("✅" in line for line in lines) == 2 and any("⛔" in line for line in lines)
    # and each build's steps as they finish, before its row's line
    stderr = result.stderr.splitlines()
    for weight in (r["weight"] for r in doc["rows"] if r["outcome"] == "built"):
        steps = [i for i, line in enumerate(stderr) if line.startswith(f"  {weight} jetson: ✓ ")]
        assert any("✓ validate onnx_fp32" in stderr[i] for i in steps), result.stderr
        assert max(steps) < next(i for i, line in enumerate(stderr) if line.startswith("[") and weight in line)


def test_the_table_says_what_made_it(first_run):
    out, _, _ = first_run
    md = (out / "coverage.md").read_text()
    for needle in (
        "# torchvision coverage",
        "complete: 4 of 4",
        "`exporter coverage --target jetson --format onnx:fp32 --models",
        "cores",
        f"torch {torch.__version__.split('+')[0]}",
        "onnxruntime",
        "executorch",
        "coremltools",
        "## Summary",
        "## jetson",
        "| onnx_fp32 |",
        "✅",
        "## Refused by design (⛔)",
        "MaskRCNN_ResNet50_FPN_Weights",
        "## Skipped (⏭)",
        "ResNet18_Weights",
        "## How this table is made",
    ):
        assert needle in md, needle


def test_a_second_run_is_served_from_the_row_cache(first_run, cache_dir, tmp_path):
    out, _, first_seconds = first_run
    result, seconds = _sweep(cache_dir, tmp_path)
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "coverage.json").read_text())
    assert doc["run"]["rows_built"] == 0 and doc["run"]["rows_from_cache"] == 2
    assert all(r["from_cache"] for r in doc["rows"] if r["outcome"] == "built")
    assert sum("(cached)" in line for line in result.stderr.splitlines()) == 2
    assert seconds < first_seconds
    before, after = _rows(out), _rows(tmp_path)
    assert {k: r["cells"] for k, r in before.items()} == {k: r["cells"] for k, r in after.items()}


def test_a_resumed_sweep_counts_the_interrupted_runs_clock(first_run, cache_dir, tmp_path):
    out, _, _ = first_run
    doc = json.loads((out / "coverage.json").read_text())
    doc.update(complete=False, interrupted=True, rows=doc["rows"][:1])
    doc["run"] = dict(doc["run"], wall_s=1234.0)
    (tmp_path / "coverage.json").write_text(json.dumps(doc))
    result, _ = _sweep(cache_dir, tmp_path)
    assert result.exit_code == 0, result.output
    resumed = json.loads((tmp_path / "coverage.json").read_text())
    assert resumed["complete"] and [r["wall_s"] for r in resumed["run"]["earlier_runs"]] == [1234.0]
    assert resumed["run"]["total_wall_s"] >= 1234.0
    assert "over 2 runs" in (tmp_path / "coverage.md").read_text()


def _merges_complete(*paths: Path, out: Path) -> None:
    """Merged into OUT, the files plan the first run's 4 builds and hold them all."""
    result = run_cli("coverage", "--merge", *paths, "--out", out)
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "coverage.json").read_text())
    assert doc["planned_rows"] == 4 and doc["complete"], (doc["planned_rows"], doc["complete"])


def test_shards_merge_into_the_table(first_run, cache_dir, tmp_path):
    out, _, _ = first_run
    matrix = run_cli("coverage", "--matrix", "2")
    assert json.loads(matrix.output) == {"include": [{"shard": "1/2"}, {"shard": "2/2"}]}
    for shard in ("1/2", "2/2"):
        result, _ = _sweep(cache_dir, tmp_path / "shards", "--shard", shard)
        assert result.exit_code == 0, result.output
    one, two = (_rows(tmp_path / "shards", f"coverage-shard-{i}-of-2.json") for i in (1, 2))
    assert set(one) | set(two) == set(_rows(out)) and not set(one) & set(two)
    merged = run_cli("coverage", "--merge", tmp_path / "shards", "--out", tmp_path / "merged")
    assert merged.exit_code == 0, merged.output
    doc = json.loads((tmp_path / "merged" / "coverage.json").read_text())
    assert doc["complete"] and len(doc["rows"]) == 4 and len(doc["merged_from"]) == 2
    # each file says where it was made: merged sweeps may come from other commits and hosts
    assert doc["exporter_commit"] is None and all(
        m["host"]["cpu"] and "exporter_commit" in m for m in doc["merged_from"]
    )
    assert {k: r["outcome"] for k, r in _rows(tmp_path / "merged").items()} == {
        k: r["outcome"] for k, r in _rows(out).items()
    }
    assert "complete: 4 of 4" in (tmp_path / "merged" / "coverage.md").read_text()
    # a part merged into its whole plans no build twice
    _merges_complete(out / "coverage.json", tmp_path / "shards" / "coverage-shard-1-of-2.json", out=tmp_path / "again")
    # an interrupted sweep whose missing builds another run made is complete once merged
    stopped = json.loads(out.joinpath("coverage.json").read_text())
    stopped.update(complete=False, interrupted=True, rows=stopped["rows"][:2])
    (tmp_path / "stopped.json").write_text(json.dumps(stopped))
    rest = [p for p in (tmp_path / "shards").glob("coverage-shard-*.json")]
    assert run_cli("coverage", "--merge", tmp_path / "stopped.json", *rest, "--out", tmp_path / "whole").exit_code == 0
    assert json.loads((tmp_path / "whole" / "coverage.json").read_text())["complete"]
    # a merged table (its header keeps the first file's selection, which lists fewer weights than it holds)
    # merged again with rows it already plans stays complete
    merged_doc = json.loads((tmp_path / "merged" / "coverage.json").read_text())
    merged_doc["selection"]["models"] = [SMALL[0]]
    (tmp_path / "merged.json").write_text(json.dumps(merged_doc))
    _merges_complete(
        tmp_path / "merged.json", tmp_path / "shards" / "coverage-shard-2-of-2.json", out=tmp_path / "twice"
    )
    # ...and names the files the merged one came from (their selections and commands), not the merged file alone
    twice = json.loads((tmp_path / "twice" / "coverage.json").read_text())
    assert [m["file"] for m in twice["merged_from"]] == [m["file"] for m in merged_doc["merged_from"]] + [
        str(tmp_path / "shards" / "coverage-shard-2-of-2.json")
    ]
    # so does a partial one: merged again with one of its own files it plans the same 4 builds, not 4 + 2
    stopped.update(rows=stopped["rows"][:1])
    (tmp_path / "stopped.json").write_text(json.dumps(stopped))
    shard_one = tmp_path / "shards" / "coverage-shard-1-of-2.json"
    assert (
        run_cli("coverage", "--merge", tmp_path / "stopped.json", shard_one, "--out", tmp_path / "part").exit_code == 0
    )
    part = json.loads((tmp_path / "part" / "coverage.json").read_text())
    part["selection"]["models"] = [SMALL[0]]
    (tmp_path / "part.json").write_text(json.dumps(part))
    assert run_cli("coverage", "--merge", tmp_path / "part.json", shard_one, "--out", tmp_path / "part2").exit_code == 0
    again = json.loads((tmp_path / "part2" / "coverage.json").read_text())
    assert not part["complete"] and part["planned_rows"] == again["planned_rows"] == 4, again["planned_rows"]
    missing = sorted({tuple(k) for k in again["planned"]} - {(r["weight"], r["target"]) for r in again["rows"]})
    assert (
        missing
        and f"; not built: {', '.join(f'{w} × {t}' for w, t in missing)} |"
        in (tmp_path / "part2" / "coverage.md").read_text()
    )  # the status names the builds a partial table lacks
    # a sweep of other targets (rows rebuilt for one target) merges in; other sizes do not
    other = json.loads(out.joinpath("coverage.json").read_text())
    other["settings"]["targets"], other["rows"] = ["android"], []
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert (
        run_cli(
            "coverage", "--merge", out / "coverage.json", tmp_path / "other.json", "--out", tmp_path / "t"
        ).exit_code
        == 0
    )
    assert json.loads((tmp_path / "t" / "coverage.json").read_text())["settings"]["targets"] == ["android", "jetson"]
    other["settings"]["val_size"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    refused = run_cli("coverage", "--merge", out / "coverage.json", tmp_path / "other.json", "--out", tmp_path / "u")
    assert refused.exit_code == 2 and "other settings" in refused.stderr


def test_a_build_past_the_time_limit_is_killed_and_marked(cache_dir, tmp_path):
    result = run_cli(
        "coverage",
        "--models",
        "shufflenet_v2_x0_5",
        "--one-per-builder",
        "--target",
        "jetson",
        "--format",
        "onnx:fp32",
        "--time-limit",
        "2",
        "--out",
        tmp_path,
        env={"EXPORTER_CACHE": str(cache_dir)},
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "coverage.json").read_text())["rows"]
    assert row["outcome"] == "stopped" and row["timed_out"] and row["seconds"] < 30
    assert [(c["name"], c["outcome"], c["kind"]) for c in row["cells"]] == [("onnx_fp32", "time", "time limit")]
    assert "⏱" in (tmp_path / "coverage.md").read_text()


def test_a_row_built_again_in_its_builds_folder_goes_on_from_what_the_earlier_build_made(cache_dir, tmp_path):
    """A giant stopped by the time limit went back to nothing on every run (ViT-H-14's Android row: 2400 s of CPU
    to reach its .ptl's validation). With --builds, a stopped row is built again (not served from the row cache)
    and reuses its earlier build's exports and validations, and the row says so."""
    common = [
        "coverage",
        "--models",
        "shufflenet_v2_x0_5",
        "--one-per-builder",
        "--target",
        "jetson",
        "--builds",
        tmp_path / "builds",
        "--format",
        "onnx:fp32",
    ]
    env = {"EXPORTER_CACHE": str(cache_dir)}

    def row(*extra):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        result = run_cli(*common, *extra, "--out", out, env=env)
        assert result.exit_code == 0, result.output
        (only,) = json.loads((out / "coverage.json").read_text())["rows"]
        return only, result, (out / "coverage.md").read_text()

    for _ in range(2):  # stopped before it exported anything, twice: the second is built again, not cached
        stopped, _, _ = row("--time-limit", "2")
        assert stopped["outcome"] == "stopped" and not stopped["from_cache"] and "earlier_runs" not in stopped
    earlier, _, _ = row()  # nothing to go on from: it starts a new history
    assert "earlier_runs" not in earlier and not any("reused" in c for c in earlier["cells"])
    # the row wants onnx_fp16 too (another row key): onnx_fp32 is the earlier build's
    again, result, md = row("--format", "onnx:fp16")
    cells = {c["name"]: c for c in again["cells"]}
    assert cells["onnx_fp32"]["reused"] == ["export", "validation"] and cells["onnx_fp32"]["outcome"] == "passed"
    assert "reused" not in cells["onnx_fp16"] and cells["onnx_fp16"]["outcome"] == "passed"
    assert [(r["seconds"], r["outcome"]) for r in again["earlier_runs"]] == [(earlier["seconds"], "built")]
    assert f"| {again['seconds']:.0f} (+{earlier['seconds']:.0f} earlier) |" in md
    assert "going on from 1 earlier build(s) in --builds" in result.stderr


def test_a_cached_row_with_a_failure_gets_its_floor_measured(first_run, cache_dir, tmp_path):
    """A row cached before floors were measured: the sweep remakes the checkpoint and measures the floor
    (in a worker process, on the build's own validation inputs) instead of rebuilding."""
    out, _, _ = first_run
    row = _rows(out)["mobilenet_v3_small"]
    path = cache_dir / "coverage" / f"{row['key']}.json"
    cached = json.loads(path.read_text())
    (cell,) = cached["cells"]
    cell.update(status="failed", outcome="failed", kind="validation", reason="top1_agreement 0.875 (needs >= 1)")
    cell.pop("reasons", None)
    cached.pop("floor", None)
    path.write_text(json.dumps(cached))
    result, _ = _sweep(cache_dir, tmp_path)
    assert result.exit_code == 0, result.output
    measured = _rows(tmp_path)["mobilenet_v3_small"]
    assert measured["from_cache"] and set(measured["floor"]) >= {"fp32", "fp16", "int8", "int8_static"}, measured.get(
        "floor"
    )
    # float64 eager keeps float32 eager's top-1 on a settled MobileNetV3-Small: the failure is not explained
    assert measured["floor"]["fp32"]["fidelity"]["top1_agreement"] == 1.0
    assert measured["cells"][0]["kind"] == "validation"
    assert "floor" in json.loads(path.read_text())  # stored back: a third run measures nothing
