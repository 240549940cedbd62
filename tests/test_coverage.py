"""`exporter coverage` cannot rot: a real sweep of two small weights (random weights, ONNX fp32 on the jetson
target, the cheapest artifact), one weight the exporter refuses (Mask R-CNN) and one skipped for size;
resumed from the row cache, sharded and merged, stopped at a time limit; plus the pieces the sweep classifies
and randomises with. About a minute on 2 shared cores."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import exporter
from exporter import coverage
from exporter.coverage import memory, outcome, randomize, rowcache, sweep, table

from .conftest import CACHE, QUANTIZED_WEIGHT, assert_clean_refusal, run_cli

DOCS = Path(__file__).parents[1] / "docs"
SMALL = ["mobilenet_v3_small", "squeezenet1_1"]
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


@pytest.mark.parametrize(
    "behaviour,stopped_by",
    [
        ("time.sleep(2)", None),  # waiting (a starved build on a busy host) is not spending the limit...
        ("sum(1 for _ in iter(int, 1))", "cpu"),  # ...computing is: SIGXCPU at the limit
        ("time.sleep(60)", "wall"),  # blocked for 3x the limit: the wall clock stops it
    ],
)
def test_the_time_limit_counts_a_builds_cpu_time_with_the_wall_clock_as_backstop(
    behaviour, stopped_by, tmp_path, monkeypatch
):
    """A background sweep on a shared host had builds stopped at the limit that a quiet host finishes (Swin-V2-B:
    ⏱ at 1800 s with three sweeps on two cores, 1368 s with two): the limit is the build's CPU time."""
    import signal

    _fake_worker(monkeypatch, behaviour)
    monkeypatch.setattr(sweep, "WALL_FACTOR", 3)
    runner = sweep.Sweep(sweep.Settings(time_limit=1), [], tmp_path / "c.json", tmp_path / "c.md", "test")
    stop = type("Stop", (), {"child": None, "signalled": False})()
    proc, stopped, seconds, _log, sampled = runner._run_worker(
        {"weight": "W.V1", "target": "jetson", "result": str(tmp_path / "r.json"), "cpu_limit_s": 1}, tmp_path, stop
    )
    assert stopped == stopped_by, (proc.returncode, seconds)
    if stopped_by is None:
        assert proc.returncode == 0 and seconds >= 2  # past the 1 s limit on the wall clock, and not stopped
    elif stopped_by == "cpu":
        assert proc.returncode == -signal.SIGXCPU and seconds < 3
    else:
        assert 3 <= seconds < 10
        assert sampled["build_peak_bytes"] > 0  # sampled while it ran (every RELAY_EVERY_S)
    text = sweep._limit_text(stopped, 1, seconds)
    assert (text is None) == (stopped_by is None) and (stopped_by is None or "CPU" in text)


def _fake_worker(monkeypatch, script: str) -> None:
    """The sweep's worker replaced by `script` (argv[1]: its spec), under the same CPU limit."""
    script = (
        "import json, sys, time; from exporter.coverage.worker import limit_cpu; "
        "spec = json.load(open(sys.argv[1])); limit_cpu(spec); " + script
    )
    spawn = sweep._spawn
    monkeypatch.setattr(
        sweep, "_spawn", lambda command, log, env: spawn([sys.executable, "-c", script, command[-1]], log, env)
    )


def test_a_build_that_finished_before_the_limit_stopped_its_floor_stands(tmp_path, monkeypatch):
    """The precision floor is measured after the build, in the same process: the limit ending it leaves a row
    built (with the floor's error), not a ⏱ on a build that finished."""
    _fake_worker(
        monkeypatch,
        "json.dump({'stage': 'done', 'status': 'failed'}, open(spec['result'], 'w')); sum(1 for _ in iter(int, 1))",
    )
    runner = sweep.Sweep(
        sweep.Settings(targets=("jetson",), formats=("onnx:fp32",), time_limit=1),
        [],
        tmp_path / "c.json",
        tmp_path / "c.md",
        "test",
    )
    candidate = sweep.Candidate("MobileNet_V3_Small_Weights.IMAGENET1K_V1", "mobilenet_v3_small", "classification", 2)
    row = runner._build(candidate, "jetson", tmp_path, type("Stop", (), {"child": None, "signalled": False})())
    assert row["outcome"] == "built" and not row["timed_out"], row
    assert "stopped the floor" in row["floor"]["error"] and "CPU time" in row["floor"]["error"]


@pytest.mark.parametrize("others_share, kept", [(0.0, False), (1.0, True)])
def test_a_build_the_kernel_killed_records_its_memory(others_share, kept, tmp_path, monkeypatch):
    """SIGKILL the sweep did not send (the kernel's OOM killer, here the worker's own): the row says what the
    build and the other processes held when last sampled, and is a verdict only if the others held little."""
    _fake_worker(
        monkeypatch,
        "held = b'x' * (100 * 2**20); time.sleep(3); import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    )
    monkeypatch.setattr(sweep.build_memory, "OTHERS_SHARE", others_share)
    runner = sweep.Sweep(
        sweep.Settings(targets=("jetson",), formats=("onnx:fp32",), time_limit=60),
        [],
        tmp_path / "c.json",
        tmp_path / "c.md",
        "test",
    )
    candidate = sweep.Candidate("MobileNet_V3_Small_Weights.IMAGENET1K_V1", "mobilenet_v3_small", "classification", 2)
    row = runner._build(candidate, "jetson", tmp_path, type("Stop", (), {"child": None, "signalled": False})())
    assert row["outcome"] == "stopped" and row["returncode"] == -9 and not row["timed_out"], row
    assert row["memory"]["build_peak_bytes"] >= 100 * 2**20 and "out of memory" in row["reason"]
    assert sweep._cacheable(row) is kept and outcome.not_a_verdict(row) is not kept
    assert ("built again next time" in row["cells"][0]["reason"]) is not kept


def test_the_sweeps_own_kill_of_a_finished_build_is_no_oom(tmp_path, monkeypatch):
    """A build that finished and was then blocked past the wall clock is killed by the sweep (SIGKILL too):
    its row stands as built, with no memory verdict."""
    _fake_worker(
        monkeypatch, "json.dump({'stage': 'done', 'status': 'failed'}, open(spec['result'], 'w')); time.sleep(60)"
    )
    monkeypatch.setattr(sweep, "WALL_FACTOR", 3)
    monkeypatch.setattr(sweep.build_memory, "OTHERS_SHARE", 0.0)
    runner = sweep.Sweep(
        sweep.Settings(targets=("jetson",), formats=("onnx:fp32",), time_limit=1),
        [],
        tmp_path / "c.json",
        tmp_path / "c.md",
        "test",
    )
    candidate = sweep.Candidate("MobileNet_V3_Small_Weights.IMAGENET1K_V1", "mobilenet_v3_small", "classification", 2)
    row = runner._build(candidate, "jetson", tmp_path, type("Stop", (), {"child": None, "signalled": False})())
    assert row["outcome"] == "built" and row["returncode"] == -9 and "memory" not in row, row
    assert sweep._cacheable(row) and not outcome.not_a_verdict(row)


def test_sigterm_between_builds_stops_the_sweep_before_the_next_build_runs(tmp_path, monkeypatch):
    _fake_worker(monkeypatch, "time.sleep(30)")
    runner = sweep.Sweep(sweep.Settings(time_limit=60), [], tmp_path / "c.json", tmp_path / "c.md", "test")
    stop = type("Stop", (), {"child": None, "signalled": True})()
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        runner._run_worker({"weight": "W.V1", "target": "jetson", "result": str(tmp_path / "r.json")}, tmp_path, stop)
    assert time.perf_counter() - started < 10


def test_a_worker_stays_in_the_sweeps_session_and_its_kill_takes_what_it_started(tmp_path):
    """A worker keeps the sweep's session (under autogroup scheduling that is what keeps a `nice`d sweep in the
    background) but has a process group of its own, which the time limit kills with everything it started."""
    child = (
        "import os, subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(os.getsid(0), os.getpgrp(), g.pid, flush=True); time.sleep(60)"
    )
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = sweep._spawn([sys.executable, "-c", child], out, dict(os.environ))
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    session, group, grandchild = map(int, log.read_text().split())
    assert session == os.getsid(0) and group == proc.pid != os.getpgrp()
    sweep._kill_group(proc)
    assert proc.returncode == -9
    deadline = time.monotonic() + 10
    while (
        Path(f"/proc/{grandchild}").exists()
        and "Z" not in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not Path(f"/proc/{grandchild}").exists() or Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z"


def test_a_build_killed_from_outside_the_sweep_is_not_kept_as_the_weights_verdict(tmp_path):
    """EfficientNet-B6's row was ended by a `kill` (its .ptl profile was filling memory): the row said
    "converter crash" and the row cache served it ever after. A build ended by SIGTERM, SIGINT or SIGHUP the
    sweep did not send is "killed" and built again next time; a crash (SIGSEGV) and the OOM killer's SIGKILL
    stay verdicts."""
    planned = [{"name": "executorch_fp32", "format": "executorch", "precision": "fp32"}]
    for code, kind, kept in (
        (-signal.SIGTERM, "killed", False),
        (-signal.SIGHUP, "killed", False),
        (-signal.SIGSEGV, "converter crash", True),
        (-signal.SIGKILL, "out of memory", True),
    ):
        (cell,) = outcome.stopped_cells(planned, [], code, False, None, None)
        row = outcome.reclassify({"outcome": "stopped", "returncode": code, "cells": [cell]})
        assert (cell["kind"], sweep._cacheable(row)) == (kind, kept), code
    rowcache.store(tmp_path, {"key": "b6", "outcome": "stopped", "returncode": -signal.SIGTERM, "cells": []})
    assert rowcache.fetch(tmp_path, "b6", None) is None  # one stored before this rule: built again too
    built = {"weight": "W", "target": "android", "outcome": "built", "returncode": 0}
    killed = dict(built, outcome="stopped", returncode=-signal.SIGTERM)
    assert not table._kept(built, killed) and table._kept(killed, built)  # a merge keeps the built row


def test_an_artifact_a_full_disk_stopped_is_not_kept_as_the_weights_verdict(tmp_path):
    """RegNetY-128GF's .ptl failed with "No space left on device" while another giant's build filled the disk:
    a converter crash by the old rules, cached and shown as the weight's ❌."""
    cell = outcome.cell_from_artifact(
        {
            "name": "torchscript_lite_fp32",
            "format": "torchscript_lite",
            "precision": "fp32",
            "status": "failed",
            "reasons": ["export failed: OSError: [Errno 28] No space left on device: '/b/r.ptl'"],
            "details": {},
        }
    )
    assert (cell["outcome"], cell["kind"]) == ("export", "disk full")
    built = {"weight": "W", "target": "android", "outcome": "built", "returncode": 0}
    full = dict(built, key="r", cells=[cell])
    assert outcome.not_a_verdict(full) and not sweep._cacheable(full)
    rowcache.store(tmp_path, full)
    assert rowcache.fetch(tmp_path, "r", None) is None
    # a merge keeps the built row, also over a row written before this rule ("converter crash")
    row = {"model": "w", "task": "classification", "params": 1e6, "seconds": 1.0, "time_limit_s": 900, "reason": None}
    earlier = _merge_doc(tmp_path, "earlier.json", [dict(built, **row, cells=[])], 900)
    later = _merge_doc(tmp_path, "later.json", [dict(full, **row, cells=[dict(cell, kind="converter crash")])], 900)
    (merged,) = coverage.merge([earlier, later], tmp_path / "m", command="test")["rows"]
    assert merged["cells"] == []


def test_the_trained_tier_judges_int8_on_labeled_digits(quantized_digits, tmp_path):
    """--weights digits: the classifier trained on the digits (the stand-ins' own training, cached, handed to the
    sweep's cache as the sweep would have left it) gets its int8 .pte judged on held-out labels; a task with no
    digits recipe is skipped, saying why; the table goes to its own file."""
    cache = tmp_path / "cache"
    (cache / "digits").mkdir(parents=True)
    shutil.copy(CACHE / "digits_shufflenet_v2_x0_5.json", cache / "digits")
    result = run_cli(
        "coverage",
        "--weights",
        "digits",
        "--models",
        "shufflenet_v2_x0_5,lraspp_mobilenet_v3_large",
        "--one-per-builder",
        "--target",
        "android",
        "--format",
        "executorch:int8",
        "--out",
        tmp_path / "out",
        env={"EXPORTER_CACHE": str(cache)},
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "coverage-digits.json").read_text())
    assert not (tmp_path / "out" / "coverage.json").exists()
    rows = {r["model"]: r for r in doc["rows"]}
    assert rows["lraspp_mobilenet_v3_large"]["outcome"] == "skipped"
    assert "no digits recipe for segmentation" in rows["lraspp_mobilenet_v3_large"]["reason"]
    row = rows["shufflenet_v2_x0_5"]
    assert row["checkpoint"]["recipe"] == "digits" and row["checkpoint"]["held_out_acc1"] > 90
    assert row["checkpoint"]["until_train_acc1"] == 95 and row["checkpoint"]["epochs_trained"] >= 4  # checked, said
    (cell,) = row["cells"]
    accuracy = cell["accuracy"]
    assert accuracy["eager_acc1"] > 90, accuracy  # a trained reference, judged on real labels
    # which range method won and whether the budget held on the check images: what a row is read for later
    q = cell["quantization"]
    assert q["ranges"] in ("histogram", "dynamic") and isinstance(q["meets_budget"], bool), q
    # judged on the labels, the verdict follows them: a pass within the budget, or a failure whose kind says whose it
    # is (the stand-in is trained on the host: one trained on an AMD EPYC without AVX-512 lost 3 of 172 digits at
    # int8, and eager rounded to int8 lost as much: "ill-conditioned reference")
    assert (cell["outcome"] == "passed") == (accuracy["drop_points"] <= 1.0 and not cell["reasons"]), cell
    if cell["outcome"] != "passed":
        assert cell["kind"] in ("validation", "ill-conditioned reference") and row["floor"], cell
    text = (tmp_path / "out" / "coverage-digits.md").read_text()
    assert "trained from scratch on scikit-learn's digits" in text and f"acc@1 {accuracy['acc1']:.1f}" in text


def test_the_trained_tier_trains_and_builds_a_classifier_at_the_size_asked(tmp_path):
    """--weights digits --classifier-size N: the architecture is trained on digits preprocessed at N x N (the resize
    scaled with the crop, as the build scales it), built at that size and judged on held-out labels at it; the row
    and the table name the size."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    result = run_cli(
        "coverage",
        "--weights",
        "digits",
        "--classifier-size",
        "64",
        "--models",
        "shufflenet_v2_x0_5",
        "--one-per-builder",
        "--target",
        "jetson",
        "--format",
        "onnx:fp32",
        "--out",
        out,
        env={"EXPORTER_CACHE": str(cache)},
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads((out / "coverage-digits.json").read_text())["rows"]
    assert row["input_size"] == row["classifier_size"] == [64, 64]
    assert row["checkpoint"]["held_out_acc1"] > 80  # learned at 64 px, not a model of 224 px run small
    assert json.loads((cache / "digits" / "digits_shufflenet_v2_x0_5_64px.json").read_text())["checkpoint"].endswith(
        ".pth"
    )  # cached apart from the model trained at the weight's crop
    (cell,) = row["cells"]
    assert cell["accuracy"]["eager_acc1"] > 80 and cell["outcome"] == "passed", cell
    text = (out / "coverage-digits.md").read_text()
    assert "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V1 (64×64)" in text and "or at the size their row names" in text


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--shard", "3/2"], "--shard"),
        (["--models", "no_such_model"], "matches no weight"),
        (["--target", "android", "--format", "onnx:fp32"], "matches no artifact"),
        (["--merge"], "--merge needs"),
        (["--task", "poetry"], "--task"),
        (["--train-epochs", "2"], "--train-epochs is for --weights digits"),
        (["--weights", "imagenet"], "--weights"),
        (["--cpu", "cortex-a99"], "unknown aarch64 CPU 'cortex-a99'"),
        (["--arch", "riscv64"], "--arch"),
        (["--target", "jetson", "--target", "jetsn"], "unknown target 'jetsn'"),  # refused before jetson's build
        (["--matrix", "2", "--merge", "shards"], "give one of them"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, tmp_path):
    result = run_cli("coverage", "--out", tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "error,kind",
    [
        ("export failed: Unsupported: torch.* op returned non-Tensor", "unsupported op"),
        ("export failed: NotImplementedError: aten::_upsample_bicubic2d_aa has no lowering", "unsupported op"),
        ("export failed: RuntimeError: XNNPACK partitioner left the graph unlowered", "delegate fallback"),
        (
            "export failed: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
            "out of memory",
        ),
        ("export failed: AssertionError: ", "converter crash"),
        ("export failed: OSError: [Errno 28] No space left on device: '/b/r.ptl' -> '/b/cache/r'", "disk full"),
        ("the eager reference is degenerate: every input gives the same output", "degenerate reference"),
    ],
)
def test_export_failures_are_classified_from_their_first_line(error, kind):
    assert outcome.classify(error.removeprefix("export failed: ")) == kind


def test_cells_read_from_a_manifest():
    def artifact(**kw):
        return {
            "name": "a",
            "format": "coreml",
            "precision": "fp16",
            "path": None,
            "size_bytes": None,
            "status": "failed",
            "reasons": [],
            "details": {},
            **kw,
        }

    core_ml = outcome.cell_from_artifact(
        artifact(
            status="unavailable",
            path="m.mlpackage",
            size_bytes=5_000_000,
            reasons=["not validated: Core ML predict needs macOS"],
        )
    )
    assert (core_ml["outcome"], table.cell_text(core_ml)) == ("unavailable", "⚪ 5.0 MB")
    refused = outcome.cell_from_artifact(
        artifact(status="unavailable", reasons=["cannot take an eager-quantized model: …"])
    )
    assert refused["outcome"] == "refused"
    broke = outcome.cell_from_artifact(
        artifact(path="m.pte", size_bytes=1, reasons=["top1_agreement 0.375 (needs >= 0.97)"])
    )
    assert (broke["outcome"], table.cell_text(broke)) == ("failed", "❎ top1_agreement 0.375")
    degenerate = outcome.cell_from_artifact(
        artifact(path="m.pte", reasons=["degenerate eager reference: constant outputs"])
    )
    assert (degenerate["outcome"], degenerate["kind"]) == ("failed", "degenerate reference")
    stops = outcome.cell_from_artifact(
        artifact(
            path="m.onnx",
            reasons=["does not run on every validation input: RuntimeError: [ONNXRuntimeError] : 1 : FAIL : Reshape"],
        )
    )
    assert (stops["outcome"], stops["kind"], table.cell_text(stops)) == (
        "failed",
        "runtime error",
        "❎ runtime error (RuntimeError)",
    )
    assert not outcome.floor_wanted({"cells": [stops]})  # no rounding of eager explains a crash
    crashed = outcome.cell_from_artifact(artifact(reasons=["export failed: TypeError: bad thing"]))
    assert (crashed["outcome"], crashed["kind"], table.cell_text(crashed)) == (
        "export",
        "converter crash",
        "❌ converter crash",
    )
    pte = outcome.cell_from_artifact(
        artifact(
            format="executorch",
            status="passed",
            path="m.pte",
            details={
                "delegation": {
                    "delegated_nodes": 9,
                    "non_delegated_nodes": 1,
                    "delegated_subgraphs": 1,
                    "ops_outside_delegate": {"mean": 1},
                    "ops_outside_on_tensors": {"mean": 1},
                }
            },
        )
    )
    assert table._outside_xnnpack([pte]) == "fp16: mean×1"

    def rows(*statuses):
        return [{"cpu": cpu, "status": st} for cpu, st in zip(("cortex-a53", "cortex-a76"), statuses)]

    on_arm = outcome.cell_from_artifact(
        artifact(status="passed", path="m.pte", size_bytes=2_000_000, aarch64=rows("passed", "passed"))
    )
    assert table.cell_text(on_arm) == "✅ 2.0 MB · ✅ on cortex-a53, cortex-a76"
    broke_there = outcome.cell_from_artifact(
        artifact(
            path="m.pte",
            aarch64=rows("passed", "failed"),
            reasons=["aarch64 cortex-a76 (emulated): psnr_db 25.1 (needs >= 30)"],
        )
    )
    assert (broke_there["outcome"], table.cell_text(broke_there)) == ("failed", "❎ cortex-a76: psnr_db 25.1")
    # qemu out of time (a starved host) is no verdict on the artifact
    slow = outcome.cell_from_artifact(
        artifact(
            path="m.ptl",
            aarch64=rows("passed", "failed"),
            reasons=[
                "aarch64 cortex-a76 (emulated): could not run on aarch64: timed out after 1800 s under qemu (cortex-a76)"
            ],
        )
    )
    assert (slow["outcome"], slow["kind"], table.cell_text(slow)) == ("time", "time limit", "⏱ qemu on cortex-a76")


def test_a_killed_build_marks_where_it_stopped():
    planned = [
        {"name": n, "format": "executorch", "precision": p}
        for n, p in (("x_fp32", "fp32"), ("x_int8", "int8"), ("y", "fp32"))
    ]
    done = [{"name": "x_fp32", "outcome": "passed"}]
    cells = outcome.stopped_cells(planned, done, -9, False, None, None)
    # a build makes its float artifacts first: it was at y, and had not reached x_int8; cells in the target's order
    assert [(c["name"], c["outcome"], c.get("kind")) for c in cells] == [
        ("x_fp32", "passed", None),
        ("x_int8", "not_run", "not reached"),
        ("y", "export", "out of memory"),
    ]
    done.append({"name": "y", "outcome": "passed"})
    cells = outcome.stopped_cells(planned, done, -9, False, None, None)
    assert [(c["name"], c["outcome"], c.get("kind")) for c in cells] == [
        ("x_fp32", "passed", None),
        ("x_int8", "export", "out of memory"),
        ("y", "passed", None),
    ]
    refused = outcome.stopped_cells(planned, [], 2, False, "the eager reference is degenerate", None)
    assert {(c["outcome"], c["kind"]) for c in refused} == {("export", "degenerate reference")}


def test_an_oom_kill_is_the_weights_verdict_only_when_the_build_had_the_host():
    """RegNetY-128GF's android build was killed by the kernel at 12.3 GB while another sweep's build held
    14.8 GB of the 24 GB host: kept, that row would have said the weight needs more than this host has."""
    planned = [{"name": "executorch_fp32", "format": "executorch", "precision": "fp32"}]
    gb = 10**9
    alone = {"build_peak_bytes": 22 * gb, "host_bytes": 24 * gb, "others_bytes": 1 * gb}
    crowded = {"build_peak_bytes": 12.3 * gb, "host_bytes": 24 * gb, "others_bytes": 11 * gb}
    for sample, kept in ((alone, True), (crowded, False), (None, True)):
        (cell,) = outcome.stopped_cells(planned, [], -signal.SIGKILL, False, None, None, sample)
        row = {
            "outcome": "stopped",
            "returncode": -signal.SIGKILL,
            "timed_out": False,
            "memory": sample,
            "cells": [cell],
        }
        assert cell["kind"] == "out of memory" and sweep._cacheable(row) is kept
        assert ("built again next time" in cell["reason"]) is not kept
    assert (
        "held at least 12.3 GB of this host's 24.0 GB, other processes 11.0 GB when last sampled: built again"
        in outcome.death_reason(-9, crowded)
    )
    later = {"weight": "W", "target": "android", "outcome": "stopped", "returncode": -9, "memory": crowded}
    built = {"weight": "W", "target": "android", "outcome": "built", "returncode": 0}
    assert not table._kept(built, later) and table._kept(built, dict(later, memory=alone))  # a merge keeps the build


def test_memory_is_sampled_from_the_whole_build():
    """The build's process group: the worker and what it started (a grandchild holding 300 MB here)."""
    import subprocess

    grandchild = "import sys, time; held = b'x' * (300 * 2**20); print('ready', flush=True); time.sleep(30)"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, process_group=0)
    try:
        assert proc.stdout.readline() == b"ready\n"
        sample = memory.sample(proc.pid)
        again = memory.sample(proc.pid, dict(sample, build_peak_bytes=2**50))
    finally:
        sweep._kill_group(proc)
    assert sample["build_peak_bytes"] >= 300 * 2**20 and sample["host_bytes"] > sample["build_peak_bytes"]
    assert 0 <= sample["others_bytes"] < sample["host_bytes"] and again["build_peak_bytes"] == 2**50  # the peak so far
    assert memory.sample(proc.pid) is None  # gone: nothing to say


def test_random_checkpoints_mean_something():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    nn.init.zeros_(model[4].weight)  # as torchvision zero-initialises ViT's head
    assert randomize._reinit_zero_layers(model) == ["4"]
    images = torch.randn(8, 3, 8, 8) * 3 + 2
    assert randomize._settle(model, images) == 1
    bn = model[1]
    assert bn.momentum is None and not bn.training and bn.num_batches_tracked.item() == 2
    with torch.no_grad():
        expected = model[0](images).mean((0, 2, 3))
    assert torch.allclose(bn.running_mean, expected, atol=1e-4)  # the cumulative mean over both passes
    assert randomize._spread(model, images)["relative_std"] > 0.01
    assert not randomize._near_constant(model, images)
    calls = []
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LayerNorm(6)).train()  # no BatchNorm (a ViT): no pass to make
    plain.register_forward_hook(lambda *_: calls.append(1))
    assert randomize._settle(plain, images) == 0 and not calls and not plain.training


def test_a_random_head_that_gives_every_input_the_same_output_is_rescaled_until_it_varies():
    """RetinaNet v1's head: convs initialised with std 0.01 and no normalisation between them shrink the signal
    at each layer, so a random model outputs its prior bias for every image (a degenerate reference)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()]
    head = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), *layers, nn.Conv2d(16, 9, 3, padding=1)
    )
    for m in head.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.constant_(m.bias, 0)
    nn.init.constant_(head[-1].bias, -4.6)  # the focal-loss prior
    images = torch.randn(8, 3, 12, 12)
    randomize._settle(head, images)
    assert randomize._near_constant(head, images)
    assert randomize._unit_variance(head, images) == [n for n, m in head.named_modules() if isinstance(m, nn.Conv2d)]
    randomize._settle(head, images)
    assert not randomize._near_constant(head, images)
    assert randomize._spread(head, images)["relative_std"] > 0.1


def _task(num_classes: int):
    from exporter.tasks import Classification

    return Classification(num_classes=num_classes, input_size=(4, 4))


THRESHOLDS = {
    "fp32": {"top1_agreement": 1.0, "psnr_db": 60.0},
    "fp16": {"top1_agreement": 0.99, "psnr_db": 40.0},
    "int8": {"top1_agreement": 0.97, "psnr_db": 30.0},
}


def test_the_precision_floor_tells_a_fragile_reference_from_a_sound_one():
    """Two linear classifiers on the same inputs: one whose top-1 wins by a wide margin, one whose two leading
    logits differ by far less than 8-bit rounding moves them. Rounded to 8 bits, eager keeps the first's top-1
    and loses the second's; float16 and float64 keep both."""
    from exporter.coverage import conditioning

    torch.manual_seed(0)
    unit = nn.functional.normalize(torch.randn(48), dim=0)
    features = torch.randn(16, 48)
    sign = torch.tensor([1.0, -1.0]).repeat(8)
    features = features - (features @ unit)[:, None] * unit + 4 * sign[:, None] * unit  # ±4 along `unit`
    images = features.view(16, 3, 4, 4)

    def classifier(rows: list[torch.Tensor]) -> nn.Module:
        model = nn.Sequential(nn.Flatten(), nn.Linear(48, len(rows)))
        with torch.no_grad():
            model[1].weight.copy_(torch.stack(rows))
            model[1].bias.zero_()
        return model.eval()

    other = torch.randn(48)
    models = {
        "sound": classifier([unit, -unit, 0.05 * other]),  # top-1 wins by 8 on every image
        "fragile": classifier([unit, unit + 1e-5 * other, -unit]),
    }  # classes 0 and 1 tie on half of them
    floors = {}
    for name, model in models.items():
        with torch.no_grad():
            reference = model(images)
        floors[name] = conditioning.floor(_task(3), model, images, reference, THRESHOLDS)
    assert set(floors["sound"]) == {"fp32", "fp16", "int8", "margins"}
    assert all(not floors["sound"][p]["reasons"] for p in conditioning.PRECISIONS), floors["sound"]
    assert not floors["fragile"]["fp32"]["reasons"]
    assert "top1_agreement" in outcome.broken_keys(floors["fragile"]["int8"]["reasons"]), floors["fragile"]["int8"]
    assert floors["fragile"]["int8"]["fidelity"]["top1_agreement"] < 0.97
    # every top-1 the 8-bit rounding flipped sat on a near-tie by the rule's measure; the sound model has none
    fragile, sound = floors["fragile"], floors["sound"]
    with torch.no_grad():
        flipped = (
            (conditioning.outputs(models["fragile"], images, "int8").argmax(1) != models["fragile"](images).argmax(1))
            .nonzero()
            .flatten()
            .tolist()
        )
    assert flipped and len(fragile["margins"]) == len(fragile["int8"]["rms"]) == 16
    assert all(fragile["margins"][i] < outcome.NEAR_TIE * fragile["int8"]["rms"][i] for i in flipped)
    assert not any(m < outcome.NEAR_TIE * e for m, e in zip(sound["margins"], sound["int8"]["rms"]))
    # with labels (the trained tier) the floor is judged on them too: the flips the rounding made cost acc@1
    labeled = dict(THRESHOLDS, int8=dict(THRESHOLDS["int8"], accuracy_drop=1.0))
    for name, model in models.items():
        with torch.no_grad():
            reference = model(images)
        floors[name] = conditioning.floor(_task(3), model, images, reference, labeled, labels=reference.argmax(1))
    assert floors["fragile"]["labeled"] and floors["fragile"]["int8"]["accuracy"]["drop_points"] > 1.0
    assert "accuracy_drop" in outcome.broken_keys(floors["fragile"]["int8"]["reasons"])
    assert floors["sound"]["int8"]["accuracy"]["drop_points"] == 0 and not floors["sound"]["int8"]["reasons"]


def _outlier_images(calib: int, val: int, outlier: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Calibration images of unit scale; validation images of which half carry one pixel `outlier` times larger."""
    torch.manual_seed(1)
    calibration = [torch.randn(1, 3, 4, 4) for _ in range(calib)]
    images = torch.randn(val, 3, 4, 4)
    images[::2, 0, 0, 0] = outlier
    return calibration, images


def test_the_static_int8_floor_clips_what_calibration_never_saw():
    """A static int8 runtime fixes each tensor's range from calibration images; an input whose outlier lies far
    outside it clips. The dynamic floor (each tensor's own max) cannot show that; the static one must."""
    from exporter.coverage import conditioning

    calibration, images = _outlier_images(64, 8, 40.0)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.Identity(), nn.Linear(32, 10)).eval()
    with torch.no_grad():
        reference = model(images)
    floors = conditioning.floor(_task(10), model, images, reference, THRESHOLDS, calibration)
    assert set(floors) == {"fp32", "fp16", "int8", "int8_static", "margins"}
    dynamic, static = floors["int8"]["fidelity"]["psnr_db"], floors["int8_static"]["fidelity"]["psnr_db"]
    assert dynamic >= 30 and static < dynamic - 10, (dynamic, static)
    assert "psnr_db" in outcome.broken_keys(floors["int8_static"]["reasons"])
    # the same images without the outliers: calibration covers them, and the static floor is as good as 8 bits allow
    _, plain = _outlier_images(64, 8, 0.0)
    with torch.no_grad():
        reference = model(plain)
    assert not conditioning.floor(_task(10), model, plain, reference, THRESHOLDS, calibration)["int8_static"]["reasons"]


def test_the_static_int8_floor_gives_a_module_called_twice_a_range_per_call():
    """ResNet's blocks call one ReLU twice. A graph quantizer observes each call on its own; one range for both
    calls would round the small one to nothing and blame the random model for it."""
    from exporter.coverage import conditioning

    class TwoScales(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU()
            self.big = nn.Linear(48, 10)
            self.small = nn.Linear(48, 10)

        def forward(self, x):
            x = x.flatten(1)
            return self.relu(self.small(x)) + self.relu(1000 * self.big(x)) / 1000

    torch.manual_seed(3)
    model = TwoScales().eval()
    calibration, images = _outlier_images(64, 8, 0.0)
    with torch.no_grad():
        reference = model(images)
    static = conditioning.floor(_task(10), model, images, reference, THRESHOLDS, calibration)["int8_static"]
    assert static["fidelity"]["psnr_db"] >= 30, static


def test_an_int8_failure_the_static_floor_shows_is_ill_conditioned():
    """EfficientNetV2-S's random int8 .pte: 22.7 dB from eager, the dynamic floor 29.9 (7.2 dB better: not
    explained), eager with static ranges from the calibration images 24.5 dB."""
    int8 = {"int8": {"fidelity": {"psnr_db": 29.9}, "reasons": ["psnr_db 29.9 (needs >= 30)"]}}
    static = {"int8_static": {"fidelity": {"psnr_db": 24.5}, "reasons": ["psnr_db 24.5 (needs >= 30)"]}}
    cell = {"precision": "int8", "outcome": "failed", "kind": "validation", "reasons": ["psnr_db 22.7 (needs >= 30)"]}
    assert outcome.reclassify({"floor": int8, "cells": [dict(cell)]})["cells"][0]["kind"] == "validation"
    row = outcome.reclassify({"floor": dict(int8, **static), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "ill-conditioned reference"
    assert table.floor_text(row, row["cells"][0]) == (
        "eager rounded to int8: psnr_db 29.9; with static int8 ranges: psnr_db 24.5"
    )
    # far below even the static floor: ours to explain
    far = dict(cell, reasons=["psnr_db 12 (needs >= 30)"])
    assert outcome.reclassify({"floor": dict(int8, **static), "cells": [far]})["cells"][0]["kind"] == "validation"
    # a cached row measured before the static floor existed asks for it; one that has it, or is explained, does not
    assert outcome.floor_wanted({"floor": int8, "cells": [dict(cell)]})
    assert not outcome.floor_wanted(row)
    assert not outcome.floor_wanted({"floor": int8, "cells": [dict(cell, kind="ill-conditioned reference")]})
    assert not outcome.floor_wanted({"floor": {"error": "x"}, "cells": [dict(cell)]})
    assert outcome.floor_wanted({"cells": [dict(cell, precision="fp32")]})


def test_a_labeled_int8_failure_needs_a_floor_judged_on_the_labels():
    """The trained EfficientNet-B1's int8 .pte: 26.8 dB and 1.2 points of acc@1 lost; eager rounded to int8 27.4 dB.
    A floor without labels cannot have broken accuracy_drop, so it explains nothing and is measured again; one
    judged on the labels that loses as much explains the cell, and the table says what it lost."""
    cell = {
        "precision": "int8",
        "outcome": "failed",
        "kind": "validation",
        "reasons": ["psnr_db 26.83 (needs >= 30)", "accuracy_drop 1.163 (needs <= 1)"],
    }
    unlabeled = {
        "int8": {"fidelity": {"psnr_db": 27.4}, "reasons": ["psnr_db 27.4 (needs >= 30)"]},
        "int8_static": {"fidelity": {"psnr_db": 26.0}, "reasons": ["psnr_db 26 (needs >= 30)"]},
    }
    assert outcome.reclassify({"floor": unlabeled, "cells": [dict(cell)]})["cells"][0]["kind"] == "validation"
    assert outcome.floor_wanted({"floor": unlabeled, "cells": [dict(cell)]})
    lost = {
        "fidelity": {"psnr_db": 27.4},
        "accuracy": {"drop_points": 2.326},
        "reasons": ["psnr_db 27.4 (needs >= 30)", "accuracy_drop 2.326 (needs <= 1)"],
    }
    row = outcome.reclassify({"floor": dict(unlabeled, labeled=True, int8=lost), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "ill-conditioned reference"
    assert not outcome.floor_wanted(row)
    assert table.floor_text(row, row["cells"][0]).startswith("eager rounded to int8: accuracy_drop 2.326, psnr_db 27.4")
    # the int8 search's own measure of how much the model amplifies a small error is shown beside it
    moved = dict(row["cells"][0], quantization={"perturbation": {"input_snr_db": 40.0, "output_psnr_db": 31.46}})
    assert table.floor_text(row, moved).endswith("; eager, its input perturbed at 40 dB SNR: psnr_db 31.46")
    # judged on the labels and losing less than the artifact's budget allows: the failure is ours to explain
    kept = dict(lost, accuracy={"drop_points": 0.0}, reasons=lost["reasons"][:1])
    row = outcome.reclassify({"floor": dict(unlabeled, labeled=True, int8=kept), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "validation" and not outcome.floor_wanted(row)


def test_a_failure_the_floor_also_shows_is_marked_ill_conditioned():
    floor = {
        "int8": {
            "fidelity": {"top1_agreement": 0.5, "psnr_db": 29.6},
            "reasons": ["top1_agreement 0.5 (needs >= 0.97)", "psnr_db 29.6 (needs >= 30)"],
        },
        "fp32": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 130.0}, "reasons": []},
    }

    def cell(precision, reasons):
        return {
            "name": f"x_{precision}",
            "precision": precision,
            "outcome": "failed",
            "kind": "validation",
            "reason": reasons[0],
            "reasons": reasons,
        }

    row = {
        "floor": floor,
        "cells": [
            cell("int8", ["top1_agreement 0.375 (needs >= 0.97)"]),
            cell("int8", ["top1_agreement 0.375 (needs >= 0.97)", "accuracy_drop 5 (needs <= 1)"]),
            cell("fp32", ["top1_agreement 0.875 (needs >= 1)"]),
            cell("int8", ["top1_agreement 0.5 (needs >= 0.97)", "psnr_db 25.1 (needs >= 30)"]),
            cell("int8", ["top1_agreement 0 (needs >= 0.97)", "psnr_db 11.86 (needs >= 30)"]),
        ],
    }
    kinds = [c["kind"] for c in outcome.reclassify(row)["cells"]]
    # explained only when every broken threshold is one eager's own rounding breaks too, and the artifact's PSNR
    # is within the margin of eager's own (MaxViT-T's int8 .pte: 11.86 dB against a floor of 28.9)
    assert kinds == ["ill-conditioned reference", "validation", "validation", "ill-conditioned reference", "validation"]
    assert table.cell_text(row["cells"][0]) == "❎ top1_agreement 0.375 · ill-conditioned"
    assert table.floor_text(row, row["cells"][0]) == "eager rounded to int8: top1_agreement 0.5"
    assert (
        outcome.reclassify({"cells": [cell("int8", ["top1_agreement 0.375 (needs >= 0.97)"])]})["cells"][0]["kind"]
        == "validation"
    )


def test_a_quantized_weights_own_loss_is_told_from_its_exports():
    """torchvision's int8 weights are judged against their float model: the digits-trained quantized MobileNetV2's
    .ptl lost 1.16 points of acc@1 because the int8 weight itself does (eager, run as it is); a .ptl losing what
    the weight does not is ours to explain, and a quantized row measured before the weight's row asks for it."""
    weight = {"fidelity": {"psnr_db": 31.8}, "reasons": ["accuracy_drop 1.163 (needs <= 1)"]}
    floor = {
        "int8": {"fidelity": {"psnr_db": 40.0}, "reasons": []},
        "int8_static": {"fidelity": {"psnr_db": 38.0}, "reasons": []},
    }
    cell = {
        "precision": "int8",
        "outcome": "failed",
        "kind": "validation",
        "psnr_db": 31.76,
        "reason": "accuracy_drop 1.163 (needs <= 1)",
        "reasons": ["accuracy_drop 1.163 (needs <= 1)"],
    }
    row = outcome.reclassify({"quantized": True, "floor": dict(floor, quantized_weight=weight), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "quantized weight"
    assert table.cell_text(row["cells"][0]) == "❎ accuracy_drop 1.163 · the int8 weight's own"
    assert table.floor_text(row, row["cells"][0]) == "the int8 weight in eager PyTorch: accuracy_drop 1.163"
    worse = dict(cell, reasons=["accuracy_drop 1.163 (needs <= 1)", "psnr_db 20.1 (needs >= 30)"], psnr_db=20.1)
    assert (
        outcome.reclassify({"quantized": True, "floor": dict(floor, quantized_weight=weight), "cells": [worse]})[
            "cells"
        ][0]["kind"]
        == "validation"
    )
    assert outcome.floor_wanted({"quantized": True, "floor": floor, "cells": [dict(cell)]})
    # a float weight's row has no weight floor to ask for once its own floor was judged on the labels
    assert not outcome.floor_wanted({"quantized": False, "floor": dict(floor, labeled=True), "cells": [dict(cell)]})


def test_a_quantized_weight_is_judged_as_it_is_against_its_float_model(quantized_digits):
    """The row that tells a quantized weight's own loss: its eager int8 model against its float model on the
    build's images, labeled metrics included (the digits' held-out labels)."""
    from exporter import data, weights
    from exporter.coverage import conditioning

    loaded = weights.load(
        QUANTIZED_WEIGHT,
        quantized_digits.checkpoint,
        verify=False,
        offline=True,
        float_checkpoint=quantized_digits.float_checkpoint,
    )
    task = loaded.task_class.bind(loaded.weights, loaded.model_name, loaded.num_classes, None)
    inputs = data.from_imagefolder(quantized_digits.data_dir, task.transform(loaded.weights), 0, 64, 0, num_classes=10)
    with torch.no_grad():
        reference = torch.cat([loaded.eager(x[None]) for x in inputs.validation])
    tight = conditioning.weight_row(
        task, loaded.model, inputs.validation, reference, inputs.labels, {"accuracy_drop": -100.0, "psnr_db": 200.0}
    )
    assert {r.split()[0] for r in tight["reasons"]} == {"accuracy_drop", "psnr_db"}
    assert 15 < tight["fidelity"]["psnr_db"] < 80  # int8 against float: close, not equal
    loose = conditioning.weight_row(
        task, loaded.model, inputs.validation, reference, inputs.labels, {"accuracy_drop": 100.0, "psnr_db": 0.0}
    )
    assert loose["reasons"] == []


def test_decisions_flipped_by_an_artifact_closer_to_eager_than_the_floor_are_ill_conditioned():
    """Wide-ResNet50-2's ONNX fp16 flipped 2 of 8 top-1s (margins 0.005 and 0.013) at 47.4 dB from eager; eager
    rounded to fp16 sat at 44.2 dB and happened to flip none. Eager in half precision flipped the same two."""
    floor = {"fp16": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 44.22}, "reasons": []}}
    closer = {
        "precision": "fp16",
        "outcome": "failed",
        "kind": "validation",
        "reasons": ["top1_agreement 0.75 (needs >= 0.99)"],
    }
    row = {
        "floor": floor,
        "cells": [
            dict(closer, psnr_db=47.36),
            dict(closer, psnr_db=40.0),
            dict(closer),
            dict(
                closer, psnr_db=47.36, reasons=["top1_agreement 0.75 (needs >= 0.99)", "accuracy_drop 5 (needs <= 1)"]
            ),
        ],
    }
    kinds = [c["kind"] for c in outcome.reclassify(row)["cells"]]
    # farther than the floor, no PSNR recorded, or a broken threshold that is no decision: ours to explain
    assert kinds == ["ill-conditioned reference", "validation", "validation", "validation"]
    # ShuffleNetV2-0.5's random Q/DQ ONNX: one top-1 of 8 flipped at 27.3 dB; eager rounded to int8 (25.1 dB) broke
    # the PSNR threshold too but flipped none. Every threshold the artifact broke is either broken by the floor
    # or a decision flipped closer to eager than the floor; 6 dB farther than the floor, not.
    int8 = {"int8": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 25.08}, "reasons": ["psnr_db 25.08 (needs >= 30)"]}}
    reasons = ["top1_agreement 0.875 (needs >= 0.97)", "psnr_db 27.28 (needs >= 30)"]
    flipped = {"precision": "int8", "outcome": "failed", "kind": "validation", "reasons": reasons, "psnr_db": 27.28}
    farther = dict(flipped, reasons=[reasons[0], "psnr_db 19 (needs >= 30)"], psnr_db=19.0)
    kinds = [c["kind"] for c in outcome.reclassify({"floor": int8, "cells": [flipped, farther]})["cells"]]
    assert kinds == ["ill-conditioned reference", "validation"]
    artifact = {
        "name": "onnx_fp16",
        "format": "onnx",
        "precision": "fp16",
        "status": "failed",
        "path": "m.onnx",
        "reasons": closer["reasons"],
        "fidelity": {"psnr_db": 47.3641, "top1_agreement": 0.75},
    }
    assert outcome.cell_from_artifact(artifact)["psnr_db"] == 47.36


def test_a_top1_flipped_on_a_near_tie_is_the_references_not_the_exports():
    """Swin-V2-S's random int8 .pte flipped one top-1 of 8 at 39.51 dB, 0.12 dB farther from eager than its
    floor (39.63 dB), which flipped none: eager's margin on that image was 0.004, a fifth of the RMS error."""
    margins = [0.004, 0.020, 0.029, 0.038, 0.081, 0.104, 0.113, 0.294]
    floor = {
        "margins": margins,
        "int8": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 39.63}, "reasons": [], "rms": [0.022] * 8},
    }
    cell = {
        "precision": "int8",
        "outcome": "failed",
        "kind": "validation",
        "psnr_db": 39.51,
        "reasons": ["top1_agreement 0.875 (needs >= 0.97)"],
    }
    tie = dict(cell, flipped_rows=[{"row": 0, "top1_flipped": 1.0}])
    cells = [
        tie,
        dict(cell, flipped_rows=[{"row": 7, "top1_flipped": 1.0}]),  # a margin 13x the error: the export's
        dict(cell),  # the flipped images unknown
        dict(tie, reasons=["top1_agreement 0.75 (needs >= 0.97)"]),  # two flipped, one listed
        dict(tie, psnr_db=33.0),
    ]  # 6.6 dB farther than eager's own rounding
    row = outcome.reclassify({"floor": floor, "cells": cells})
    assert [c["kind"] for c in row["cells"]] == ["ill-conditioned reference"] + ["validation"] * 4
    assert table.floor_text(row, row["cells"][0]) == (
        "eager rounded to int8: top1_agreement 1; "
        "top-1 flipped where eager's margin was 0.004 "
        "(rounding's RMS error there 0.022)"
    )
    # the flipped images come from the manifest's preview rows (the images where the artifact departs most)
    artifact = {
        "name": "executorch_int8",
        "format": "executorch",
        "precision": "int8",
        "status": "failed",
        "path": "m.pte",
        "reasons": cell["reasons"],
        "preview_rows": [
            {"row": 3, "departure": {"top1_flipped": 1.0, "logit_rmse": 0.03}},
            {"row": 5, "departure": {"top1_flipped": 0.0, "logit_rmse": 0.02}},
        ],
    }
    assert outcome.cell_from_artifact(artifact)["flipped_rows"] == [{"row": 3, "top1_flipped": 1.0, "logit_rmse": 0.03}]


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


def test_the_sweeps_input_size_goes_to_the_graphs_that_take_one():
    size = (128, 128)
    assert randomize.accepted_input_size("LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1", size) == size
    assert randomize.accepted_input_size("FCOS_ResNet50_FPN_Weights.COCO_V1", size) == size
    assert randomize.accepted_input_size("SSD300_VGG16_Weights.COCO_V1", size) is None  # SSD: its anchors' size
    assert randomize.accepted_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", size) is None
    # video frames: never larger than the weight's own (R3D-18: 112), never under its minimum (MViT-V2-S: 224)
    assert randomize.accepted_input_size("R3D_18_Weights.KINETICS400_V1", size) is None
    assert randomize.accepted_input_size("R3D_18_Weights.KINETICS400_V1", (64, 64)) == (64, 64)
    assert randomize.accepted_input_size("MViT_V2_S_Weights.KINETICS400_V1", size) is None
    assert randomize.built_input_size("R3D_18_Weights.KINETICS400_V1", size) == [112, 112]
    assert randomize.built_input_size("MViT_V2_S_Weights.KINETICS400_V1", size) == [224, 224]
    assert randomize.built_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", size) == [224, 224]
    # --classifier-size: a classifier whose graph takes that square; ViT's position embedding takes only its crop,
    # Inception v3 nothing under 75x75
    assert randomize.accepted_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", size, 96) == (96, 96)
    assert randomize.accepted_input_size("GoogLeNet_QuantizedWeights.IMAGENET1K_FBGEMM_V1", None, 96) == (96, 96)
    assert randomize.accepted_input_size("LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1", size, 96) == size
    assert randomize.built_input_size("ViT_B_16_Weights.IMAGENET1K_V1", None, 96) == [224, 224]
    assert randomize.built_input_size("Inception_V3_Weights.IMAGENET1K_V1", None, 64) == [299, 299]
    # a size equal to the crop is the crop: the model trained (and cached) at it serves
    assert randomize.accepted_input_size("MobileNet_V3_Small_Weights.IMAGENET1K_V1", None, 224) is None
    # only a classifier's row depends on the classifier size, and only its row says it
    settings = sweep.Settings(classifier_size=96)
    assert (
        "classifier_size" not in settings.key_parts("segmentation")
        and settings.key_parts("quantization")["classifier_size"] == 96
    )
    assert sweep.Settings().key_parts("classification") == settings.key_parts("segmentation")
    runner = sweep.Sweep(settings, [], Path("x.json"), Path("x.md"), "test")
    found = coverage.select.candidates(("lraspp_mobilenet_v3_large", "mobilenet_v3_small"), one_per_builder=True)
    assert {c.model: runner._resized(c, runner._input_size(c)) for c in found} == {
        "lraspp_mobilenet_v3_large": {},
        "mobilenet_v3_small": {"classifier_size": [96, 96]},
    }


def test_a_random_checkpoint_settled_at_one_size_is_not_served_at_another(tmp_path):
    """Batch norms are settled on images of the size the graph is built at: --builds keeps one checkpoint per size."""
    weight = "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    small, own = randomize.make(weight, tmp_path, (96, 96)), randomize.make(weight, tmp_path, None)
    assert small["checkpoint"] != own["checkpoint"]
    assert randomize.make(weight, tmp_path, (96, 96))["checkpoint"] == small["checkpoint"]  # kept, not made again
    first, second = (torch.load(info["checkpoint"], weights_only=True) for info in (small, own))
    assert any(not torch.equal(first[k], second[k]) for k in first if k.endswith("running_var"))


def test_a_change_to_the_exporters_code_keys_its_rows_anew(monkeypatch):
    from exporter.engine import cache

    def row_key(source):
        monkeypatch.setattr(cache, "source_digest", lambda: source)
        return rowcache.key("W.V1", "android", {"calib": 16}, {"torch": "2.14.1"})

    assert row_key("before") == row_key("before") != row_key("after")


def test_a_cached_row_built_at_another_input_size_is_built_again(tmp_path):
    """The row key holds the size the sweep asks for; the size a weight accepts of it can change (R3D-18's frames
    were built at the sweep's 128 before they were kept at the weight's own 112), so a row records it."""
    rowcache.store(tmp_path, {"key": "k", "input_size": [128, 128], "cells": []})
    assert rowcache.fetch(tmp_path, "k", None, [128, 128]) is not None
    assert rowcache.fetch(tmp_path, "k", None, [112, 112]) is None
    assert rowcache.fetch(tmp_path, "k", None, None) is not None  # the trained tier: the digits' own size


def test_a_digits_run_that_did_not_learn_is_run_again_at_a_lower_learning_rate(monkeypatch):
    """SqueezeNet 1.1's trained tier collapsed at the recipe's learning rate (held-out acc@1 7 %: the ReLU on its
    logits died); a collapsed run is tried again, from the same start, at a tenth of it."""
    from exporter.standins import digits

    x, y = torch.randn(6, 3, 8, 8), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda weight, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    rates, accuracies = [], iter([0.07, 0.95])
    monkeypatch.setattr(digits, "_fit", lambda model, x, y, idx, epochs, lr, log: rates.append(lr))
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: next(accuracies))
    _state, accuracy, _data = digits.train("SqueezeNet1_1_Weights.IMAGENET1K_V1", 1, log=lambda _m: None)
    assert accuracy == 0.95 and rates == [2e-3, 2e-3 * digits.RETRY_LR_FACTOR]
    rates.clear()
    accuracies = iter([0.9])
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: next(accuracies))
    assert digits.train("SqueezeNet1_1_Weights.IMAGENET1K_V1", 1, log=lambda _m: None)[1] == 0.9 and rates == [2e-3]


def test_a_digits_run_that_did_not_learn_at_either_rate_is_run_again_with_its_classifier_shrunk(monkeypatch):
    """EfficientNet-B6 (27 % held out) and V2-M (13 and 11 %) learned at neither learning rate: their heads start
    10x ImageNet's scale at 10 classes. The last try shrinks the classifier; the first two keep their start."""
    from exporter.standins import digits

    weight = "EfficientNet_B0_Weights.IMAGENET1K_V1"
    torch.manual_seed(digits.SEED)
    initial = digits._model(weight).classifier[1].weight.abs().max().item()
    x, y = torch.randn(6, 3, 32, 32), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda w, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    tries, accuracies = [], iter([0.27, 0.11, 0.92])

    def fit(model, x, y, idx, epochs, lr, log):
        tries.append((lr, round(model.classifier[1].weight.abs().max().item() / initial, 4)))

    monkeypatch.setattr(digits, "_fit", fit)
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: next(accuracies))
    assert digits.train(weight, 1, log=lambda _m: None)[1] == 0.92
    assert tries == [(2e-3, 1.0), (2e-3 * digits.RETRY_LR_FACTOR, 1.0), (2e-3, 0.1)]

    tries.clear()
    accuracies = iter([0.27, 0.11, 0.2, 0.25])  # none learns: the best try is kept, not the last
    state, accuracy, _data = digits.train(weight, 1, log=lambda _m: None)
    assert accuracy == 0.27 and state["classifier.1.weight"].abs().max().item() == pytest.approx(initial)
    assert len(tries) == len(digits.ATTEMPTS) == 4


def test_the_last_try_starts_every_residual_block_as_the_identity():
    """EfficientNet-V2-L learned under none of the first three tries; the fourth zeroes the last batch norm of each
    residual branch, so each block passes its input through unchanged at the start."""
    from exporter.standins import digits

    for weight, block in (
        ("EfficientNet_V2_S_Weights.IMAGENET1K_V1", "MBConv"),
        ("MobileNet_V2_Weights.IMAGENET1K_V1", "InvertedResidual"),
        ("MNASNet0_5_Weights.IMAGENET1K_V1", "_InvertedResidual"),
        ("ResNet50_Weights.IMAGENET1K_V1", "Bottleneck"),
    ):
        model = digits._model(weight).eval()
        inputs = {}
        residual = [
            m
            for m in model.modules()
            if type(m).__name__ == block
            and getattr(m, "use_res_connect", getattr(m, "apply_residual", True))
            and getattr(m, "downsample", None) is None
        ]
        hooks = [m.register_forward_hook(lambda m, args, out: inputs.__setitem__(m, (args[0], out))) for m in residual]
        assert digits.zero_residual_branches(model) >= len(residual) > 0, weight
        with torch.no_grad():
            model(torch.rand(2, 3, 64, 64))
        for h in hooks:
            h.remove()
        for module, (x, out) in inputs.items():  # ResNet's blocks add, then ReLU: their inputs are already >= 0
            torch.testing.assert_close(out, x, rtol=0, atol=0, msg=f"{weight}: {type(module).__name__}")
    assert digits.zero_residual_branches(digits._model("VGG11_Weights.IMAGENET1K_V1")) == 0


def test_a_cached_model_that_did_not_learn_goes_on_with_the_tries_added_since(tmp_path, monkeypatch):
    """A model trained when the recipe had three tries is not trained again from the first: the fourth is made, and
    the cached model stays the answer if the new try is worse."""
    from exporter.standins import digits

    weight = "ResNet18_Weights.IMAGENET1K_V1"
    cached = digits._model(weight).state_dict()
    checkpoint = tmp_path / "resnet18_digits.pth"
    torch.save(cached, checkpoint)
    info_file = tmp_path / "digits_resnet18.json"
    info = {
        "recipe": digits.RECIPE_VERSION,
        "epochs": 4,
        "builder_kwargs": {},
        "checkpoint": str(checkpoint),
        "accuracy": 0.11,
        "recipe_tries": 3,
    }
    info_file.write_text(json.dumps(info))
    earlier = digits._earlier_tries(info_file, 4, {})
    assert earlier[0] == 3 and earlier[2] == 0.11
    x, y = torch.randn(6, 3, 32, 32), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda w, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    tries = []
    monkeypatch.setattr(digits, "_fit", lambda model, x, y, idx, epochs, lr, log: tries.append(lr))
    monkeypatch.setattr(digits, "_accuracy", lambda model, x, y, idx: 0.09)
    state, accuracy, _data = digits.train(weight, 4, log=lambda _m: None, earlier=earlier)
    assert tries == [digits.ATTEMPTS[3].lr] and accuracy == 0.11 and state is earlier[1]
    for changed in (
        {"accuracy": 0.5},
        {"recipe_tries": 4},
        {"epochs": 8},
        {"builder_kwargs": {"x": 1}},
        {"until": 0.95, "epochs_trained": 16},
    ):
        info_file.write_text(json.dumps({**info, **changed}))
        assert digits._earlier_tries(info_file, 4, {}) is None, changed


@pytest.mark.parametrize("weight", ["EfficientNet_B4_Weights.IMAGENET1K_V1", "SqueezeNet1_1_Weights.IMAGENET1K_V1"])
def test_a_shrunk_classifier_starts_near_chance_and_can_still_learn(weight):
    """EfficientNet-B4's head (a Linear) starts far from chance at 10 classes; shrunk, the first loss is near
    chance's, ln 10. SqueezeNet's is a convolution under a ReLU: shrunk, not zeroed, its output still moves."""
    from exporter.standins import digits

    torch.manual_seed(0)
    model, x, y = digits._model(weight).train(), torch.randn(8, 3, 64, 64), torch.arange(8)
    torch.manual_seed(1)
    with torch.no_grad():
        start = nn.functional.cross_entropy(model(x), y).item()
    digits.shrink_classifier(model)
    torch.manual_seed(1)
    loss = nn.functional.cross_entropy(model(x), y)
    assert start > 2 * math.log(10) or weight.startswith("Squeeze")
    assert abs(loss.item() - math.log(10)) < 0.5
    loss.backward()
    head = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
    assert head.weight.grad.abs().sum() > 0


def test_a_cached_digits_model_that_did_not_learn_before_the_last_try_existed_is_trained_again(tmp_path):
    from exporter.standins import digits

    info_file = tmp_path / "digits_efficientnet_v2_m_64px.json"
    info = {"recipe": digits.RECIPE_VERSION, "epochs": 4, "checkpoint": str(info_file), "accuracy": 0.11}
    info_file.write_text(json.dumps(info))
    assert digits._cached_info(info_file, 4, "checkpoint") is None
    info_file.write_text(json.dumps(dict(info, recipe_tries=len(digits.ATTEMPTS))))
    assert (
        digits._cached_info(info_file, 4, "checkpoint") is not None
    )  # the recipe had every try: do not train it again
    info_file.write_text(json.dumps(dict(info, accuracy=0.97)))
    assert digits._cached_info(info_file, 4, "checkpoint") is not None  # learned before: keeps its checkpoint


def test_inception_v3_trains_at_96_px_and_keeps_its_auxiliary_head():
    """Inception v3's auxiliary head, run by every training-mode forward, cannot take a 96-px input (its 5x5
    pooling gets a 4x4 map): the trained tier's Inception v3 failed before its first step. Training leaves the
    head out and the model keeps it, so the checkpoint loads into the model a build makes."""
    from exporter.standins import digits

    weight = "Inception_V3_Weights.IMAGENET1K_V1"
    torch.manual_seed(0)
    model, x, y = digits._model(weight), torch.randn(8, 3, 96, 96), torch.arange(8) % 10
    with pytest.raises(RuntimeError):
        model.train()(x)  # what the trained tier hit
    head = model.AuxLogits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    digits._fit(model, x, y, list(range(8)), 1, 2e-3, log=lambda _m: None)
    state = model.state_dict()
    assert model.AuxLogits is head and set(state) == set(before)
    assert not torch.equal(state["fc.weight"], before["fc.weight"])  # it did train
    digits._model(weight).load_state_dict(state)


def test_an_undertrained_digits_model_is_trained_on_until_its_training_images_are_learned(monkeypatch, tmp_path):
    """The trained tier's SqueezeNet (51 and 78 % held out after 4 epochs) and EfficientNet-B1 (87 %) gave int8
    verdicts about their training: the model goes on, in warm restarts as long as all training so far, while its
    acc@1 on its own training images is under the target, up to a cap; only the training images decide."""
    from exporter.standins import digits

    weight = "SqueezeNet1_1_Weights.IMAGENET1K_V1"
    checkpoint = tmp_path / "start.pth"
    torch.save(digits._model(weight).state_dict(), checkpoint)
    x, y = torch.randn(6, 3, 8, 8), torch.arange(6) % 10
    monkeypatch.setattr(digits, "_dataset", lambda w, size=None: (x, y, [0, 1, 2], [3, 4, 5], ([], [])))
    fits, seen = [], []

    def accuracy(model, x, y, idx):
        seen.append(list(idx))
        return scores.pop(0) if idx == [0, 1, 2] else 0.5

    monkeypatch.setattr(digits, "_fit", lambda model, x, y, idx, epochs, lr, log: fits.append((epochs, lr)))
    monkeypatch.setattr(digits, "_accuracy", accuracy)
    scores = [0.78, 0.9, 0.97]
    state, reached = digits.train_further(weight, checkpoint, 4, 0.95, 16, log=lambda _m: None)
    assert state is not None and reached == {"epochs": 16, "train_accuracy": 0.97, "accuracy": 0.5}
    assert fits == [(4, 2e-3 * digits.RETRY_LR_FACTOR), (8, 2e-3 * digits.RETRY_LR_FACTOR)]
    assert [3, 4, 5] not in seen[:-1]  # the held-out digits are read once, to report, never to decide

    fits.clear()
    scores = [0.5, 0.5, 0.5]
    assert digits.train_further(weight, checkpoint, 4, 0.95, 8, log=lambda _m: None)[1]["epochs"] == 8  # the cap
    assert fits == [(4, 2e-3 * digits.RETRY_LR_FACTOR)]

    fits.clear()
    scores = [0.99]
    state, reached = digits.train_further(weight, checkpoint, 4, 0.95, 16, log=lambda _m: None)
    assert state is None and reached["epochs"] == 4 and fits == []  # learned already: the cached model stands

    # a model trained on serves callers training until the same accuracy, not the plain 4-epoch recipe
    info_file = tmp_path / "digits_squeezenet1_1.json"
    info = {"recipe": digits.RECIPE_VERSION, "epochs": 4, "checkpoint": str(checkpoint), "data_dir": str(tmp_path)}
    info_file.write_text(json.dumps(dict(info, until=0.95, epochs_trained=16)))
    assert digits._cached_info(info_file, 4, "checkpoint", until=0.95) is not None
    assert digits._cached_info(info_file, 4, "checkpoint") is None
    info_file.write_text(json.dumps(dict(info, until=0.95, epochs_trained=4)))
    assert digits._cached_info(info_file, 4, "checkpoint") is not None
    # a model trained before the builder took the weight's arguments (GoogLeNet's transform_input) is another model
    assert digits._cached_info(info_file, 4, "checkpoint", arch={}) is not None
    assert digits._cached_info(info_file, 4, "checkpoint", arch={"transform_input": True}) is None
    info_file.write_text(json.dumps(dict(info, epochs_trained=4, builder_kwargs={"transform_input": True})))
    assert digits._cached_info(info_file, 4, "checkpoint", arch={"transform_input": True}) is not None
    assert digits._cached_info(info_file, 4, "checkpoint", arch={}) is None


def test_a_cached_row_stopped_on_the_wall_clock_alone_is_built_again(tmp_path):
    """Rows from before the limit was CPU time were stopped by the wall clock, which a busy host runs out of:
    built again; a row stopped at the CPU limit is kept unless today's limit is longer."""
    rowcache.store(tmp_path, {"key": "old", "timed_out": True, "time_limit_s": 1800, "cells": []})
    assert rowcache.fetch(tmp_path, "old", 1800) is None
    rowcache.store(tmp_path, {"key": "cpu", "timed_out": True, "stopped_by": "cpu", "time_limit_s": 1800, "cells": []})
    assert rowcache.fetch(tmp_path, "cpu", 1800) is not None
    assert rowcache.fetch(tmp_path, "cpu", 3600) is None
    # the backstop stops a starved or blocked build: that says nothing about the weight either
    rowcache.store(
        tmp_path, {"key": "wall", "timed_out": True, "stopped_by": "wall", "time_limit_s": 1800, "cells": []}
    )
    assert rowcache.fetch(tmp_path, "wall", 1800) is None


def test_a_changed_target_profile_keys_its_rows_anew(tmp_path):
    """A threshold lives in targets/*.toml, not in the exporter's source: a row cached under the old one would
    show a ✅ the new one does not give."""
    profile = tmp_path / "jetson.toml"
    profile.write_text((Path(exporter.__file__).parents[1] / "targets" / "jetson.toml").read_text())
    before = rowcache.key("W.V1", str(profile), {"calib": 16}, {"torch": "2.14.1"})
    profile.write_text(profile.read_text().replace("psnr_db = 60.0", "psnr_db = 200.0", 1))
    assert rowcache.key("W.V1", str(profile), {"calib": 16}, {"torch": "2.14.1"}) != before


def test_bad_output_directories_are_refused_before_any_build(tmp_path):
    (tmp_path / "a_file").write_text("")
    for args in (
        ["--out", tmp_path / "a_file"],
        ["--out", tmp_path / "o", "--builds", tmp_path / "a_file"],
        ["--merge", DOCS / "coverage-digits.json", "--out", tmp_path / "a_file"],
    ):
        result = run_cli("coverage", "--models", SMALL[0], "--one-per-builder", *args)
        assert result.exit_code == 2 and "cannot be a directory" in result.stderr.strip().splitlines()[-1], (
            result.output
        )


def _merge_doc(
    tmp_path,
    name: str,
    rows: list[dict],
    time_limit: float,
    torch_version: str = "2.14.1",
    classifier_size: int | None = None,
) -> Path:
    settings = sweep.Settings(targets=("android",), time_limit=time_limit, classifier_size=classifier_size).describe()
    doc = table.new_document("test", settings, {}, {"torch": torch_version})
    doc.update(rows=rows, planned_rows=len(rows), complete=True)
    (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path / name


def test_a_merge_keeps_measured_rows_and_says_what_its_files_were_made_with(tmp_path):
    row = {"weight": "W.V1", "model": "w", "task": "classification", "params": 40e6, "target": "android"}
    built = dict(row, outcome="built", reason=None, seconds=3.0, time_limit_s=900, cells=[])
    skipped = dict(row, outcome="skipped", reason="40M parameters, over --max-params 30M", seconds=0.0, cells=[])
    other = dict(built, weight="X.V1", model="x", time_limit_s=3600)
    whole = _merge_doc(tmp_path, "whole.json", [built], 900)
    small = _merge_doc(tmp_path, "small.json", [skipped, other], 3600, "2.15.0")
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
    whole = _merge_doc(tmp_path, "whole.json", [row], 900)
    small = _merge_doc(
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
            "row 1 (W.V1 × android) cell 1 (onnx_fp32): 'reasons' is not a list of strings",
        ),
        (
            [dict(MERGE_ROW, earlier_runs=[{"seconds": "1 h"}])],
            "row 1 (W.V1 × android) 'earlier_runs' is not a list of",
        ),
    ],
)
def test_a_coverage_file_with_a_bad_row_is_refused_in_one_line_naming_it(rows, needle, tmp_path):
    good = _merge_doc(tmp_path, "good.json", [dict(MERGE_ROW, weight="Y.V1")], 900)
    (tmp_path / "shards").mkdir()
    bad = _merge_doc(tmp_path / "shards", "bad.json", rows, 900)
    # named on the command line, or found in a directory: a table with bad rows is refused either way
    for i, paths in enumerate(([good, bad], [good, tmp_path / "shards"])):
        out = tmp_path / f"out{i}"
        result = run_cli("coverage", "--merge", *paths, "--out", out)
        assert_clean_refusal(result, out, str(bad), "is not a valid coverage table", needle)
        assert not out.exists()


def test_a_refused_merge_leaves_no_output_directory(tmp_path):
    good = _merge_doc(tmp_path, "good.json", [MERGE_ROW], 900)
    bad = _merge_doc(tmp_path, "bad.json", [{"foo": 1}], 900)
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
    first = _merge_doc(tmp_path, "first.json", [MERGE_ROW], 900)
    second = _merge_doc(tmp_path, "second.json", [dict(MERGE_ROW, weight="X.V1", model="x")], 900)
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


def test_a_model_with_auxiliary_heads_trains_on_its_main_logits():
    """GoogLeNet's trained row failed before training began: in training mode it returns its logits with its two
    auxiliary heads' (GoogLeNetOutputs), which the loss cannot take. The loss takes the main logits."""
    from torchvision.models import GoogLeNetOutputs

    from exporter.standins import digits

    class WithAuxiliary(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.aux = nn.Linear(12, 10), nn.Linear(12, 10)

        def forward(self, x):
            logits = self.head(x.flatten(1))
            return GoogLeNetOutputs(logits, self.aux(x.flatten(1)), None) if self.training else logits

    torch.manual_seed(0)
    model, x, y = WithAuxiliary(), torch.randn(64, 3, 2, 2), torch.arange(64) % 10
    head, aux = model.head.weight.detach().clone(), model.aux.weight.detach().clone()
    digits._fit(model, x, y, list(range(64)), 2, 1e-2, lambda _m: None)
    assert not torch.equal(model.head.weight, head) and torch.equal(model.aux.weight, aux)


def test_a_target_the_build_refuses_is_a_refused_row_without_a_build(tmp_path):
    """As `exporter build` refuses it (Faster R-CNN makes nothing for Android): ⛔ with each format's reason, no
    build process, and the row has its own progress line."""
    out = tmp_path / "out"
    result = run_cli(
        "coverage",
        "--models",
        "fasterrcnn_mobilenet_v3_large_320_fpn",
        "--task",
        "detection",
        "--one-per-builder",
        "--target",
        "android",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads((out / "coverage.json").read_text())["rows"]
    assert row["outcome"] == "refused" and row["cells"] == [] and row["seconds"] == 0.0, row
    assert "executorch: cannot take a detection graph" in row["reason"] and "nms and roi_align" in row["reason"]
    assert "[1/1] FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1 android: ⛔ refused" in result.stderr
