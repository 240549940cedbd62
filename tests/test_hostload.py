"""Honest latency on a busy host (issue 20 §3): what the host did while timing is recorded, judged, reported,
never decides the verdict and is never frozen by a cache."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from exporter import hostload, validation
from exporter.build import target_profile
from exporter.engine.record import BuildRecord
from exporter.engine.request import BuildRequest
from exporter.release import html_report, recommend, report
from exporter.results import Manifest, Status
from exporter.tasks import Classification

from .helpers import build_args, run_cli

REAL_JUDGE = hostload.judge  # tests/conftest.py stands a quiet-host judge in for it once the session starts


@pytest.fixture
def real_judge(monkeypatch):
    monkeypatch.setattr(hostload, "judge", REAL_JUDGE)


def _conditions(**changes) -> dict:
    quiet = {
        "window_s": 1.0,
        "cpus": 2,
        "load_avg_1m": 1.9,
        "own_cpu_s": 1.9,
        "other_cpu_s": 0.05,
        "steal_s": 0.0,
        "spread": {"eager": 1.1, "artifact": 1.05},
    }
    return {**quiet, **changes}


def test_a_quiet_host_is_reliable():
    assert REAL_JUDGE(_conditions(), threads=2, max_spread=2.0) == (True, [])


def test_other_processes_on_the_timed_cores_make_it_unreliable():
    reliable, reasons = REAL_JUDGE(_conditions(other_cpu_s=1.22), threads=2, max_spread=2.0)
    assert not reliable and reasons == ["other processes took 61% of the CPU (1.2 of 2 cores) over the 1.00 s timed"]


def test_others_on_cores_left_free_do_not_count():
    # 8 cores, 2 timed threads: six cores' worth of other work leaves ours alone, seven does not
    assert REAL_JUDGE(_conditions(cpus=8, other_cpu_s=6.0, load_avg_1m=8.0), threads=2)[0]
    reliable, reasons = REAL_JUDGE(_conditions(cpus=8, other_cpu_s=7.0, load_avg_1m=8.0), threads=2)
    assert not reliable and reasons[0].startswith("other processes took 88% of the CPU (7.0 of 8 cores)")


def test_load_steal_and_spread_each_say_why():
    reliable, reasons = REAL_JUDGE(
        _conditions(load_avg_1m=3.9, steal_s=0.4, spread={"eager": 5.8, "artifact": 1.9}), threads=2, max_spread=2.0
    )
    assert not reliable
    assert reasons == [
        "load 3.9 on 2 cores, 2 threads timed",
        "the hypervisor took 20% of the CPU (steal time)",
        "eager p90/p50 5.8 (the profile allows 2)",
    ]
    assert REAL_JUDGE(_conditions(spread={"eager": 5.8}), threads=2, max_spread=6.0) == (True, [])


def test_what_the_host_does_not_report_is_not_judged():
    unknown = _conditions(load_avg_1m=None, other_cpu_s=None, steal_s=None)
    assert REAL_JUDGE(unknown, threads=2) == (True, [])


@pytest.mark.skipif(not hasattr(hostload.os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_latency_threads_default_to_the_cores_this_process_may_use(tmp_path):
    """`taskset -c 0 exporter build …` (or a container's cpuset) times on one core, not on the host's every core."""
    from exporter.engine.plan import make

    request = BuildRequest("MobileNet_V3_Small_Weights.IMAGENET1K_V1", out=tmp_path / "out")
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert make(target_profile(request, "android"), "classification").latency.threads == 1
        pinned = BuildRequest(request.weight, out=request.out, threads=3)
        assert make(target_profile(pinned, "android"), "classification").latency.threads == 3
    finally:
        os.sched_setaffinity(0, allowed)
    assert make(target_profile(request, "android"), "classification").latency.threads == len(allowed)


def test_conditions_from_two_samples():
    before = {"t": 10.0, "load_1m": 1.0, "stat": (100.0, 50.0, 1.0), "own_s": 10.0}
    after = {"t": 12.0, "load_1m": 3.9, "stat": (103.5, 50.5, 1.2), "own_s": 11.2}
    found = hostload.conditions(before, after, cpus=2)
    assert found == {
        "window_s": 2.0,
        "cpus": 2,
        "load_avg_1m": 3.9,
        "own_cpu_s": 1.2,
        "other_cpu_s": 2.3,
        "other_cpu_share": 0.575,
        "steal_s": 0.2,
    }
    assert hostload.conditions(before, {**after, "stat": None}, cpus=2)["other_cpu_s"] is None


def _busy(count: int, seconds: float) -> list[subprocess.Popen]:
    loop = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]


def test_a_loaded_host_is_measured_and_said_unreliable_and_the_verdict_ignores_it(real_judge):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10)
    ).eval()
    inputs = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        reference = validation.run_all(model, inputs)
    task = Classification(10, (32, 32))
    thresholds = {"top1_agreement": 1.0, "psnr_db": 60.0}
    threads = torch.get_num_threads()
    loops = _busy(3, 8.0)  # bounded by their own clock too, should terminate fail
    try:
        time.sleep(0.5)  # let them start
        eager = validation.EagerReference(task, model, inputs, reference, warmup=5, iterations=1000)
        metrics, _ = validation.evaluate(eager, model, thresholds, max_spread=2.0)
    finally:
        for p in loops:
            p.terminate()
        for p in loops:
            p.wait(timeout=10)
    conditions = metrics["latency_conditions"]
    assert conditions["threads"] == threads and conditions["window_s"] > 0.2, conditions
    assert conditions["other_cpu_s"] > 0.5 * conditions["window_s"], conditions  # three loops on two cores
    assert not conditions["reliable"] and any("other processes took" in r for r in conditions["reasons"]), conditions
    assert metrics["speedup_vs_eager"] > 0  # shown as measured
    # the verdict is the fidelity's alone
    assert metrics["status"] == "passed" and metrics["reasons"] == []
    assert metrics["fidelity"] == task.quality(reference, reference, None, None, thresholds)["fidelity"]


def _noisy(doc: dict, names=None) -> dict:
    doc = copy.deepcopy(doc)
    for a in doc["artifacts"]:
        if a.get("latency_conditions") and (names is None or a["name"] in names):
            a["latency_conditions"].update(
                reliable=False,
                reasons=[
                    "load 3.9 on 2 cores, 2 threads timed",
                    "other processes took 61% of the CPU (1.2 of 2 cores) over the 0.90 s timed",
                ],
            )
    return doc


def test_reports_say_which_latency_is_unreliable_and_why(android_build):
    out, result = android_build
    doc = json.loads((out / "manifest.json").read_text())
    timed = [a for a in doc["artifacts"] if a.get("latency_ms")]
    assert timed and all(a["latency_conditions"]["reliable"] for a in timed)  # judged quiet by conftest
    assert all({"load_avg_1m", "other_cpu_s", "steal_s", "window_s"} <= set(a["latency_conditions"]) for a in timed)
    assert "Latency unreliable" not in (out / "report.md").read_text()

    fastest = recommend.choose(Manifest.from_json(doc))["fastest"].name
    noisy = Manifest.from_json(_noisy(doc, [fastest]))  # the reports read the manifest typed
    text = report.markdown(noisy)
    assert (
        f"**Latency unreliable for 1 of {len(timed)} timed artifacts ({doc['host']['threads']} threads timed): a busy host"
        in text
    )
    assert f"- `{fastest}`: load 3.9 on 2 cores, 2 threads timed; other processes took 61% of the CPU" in text
    assert "the verdict does not use them" in text and "(unreliable) |" in text
    assert "unreliable (see the latency notes)" in recommend.line(noisy)
    page = html_report.render([noisy], [out])
    assert page.count('class="busy"') == 2 and "other processes took 61% of the CPU" in page
    assert noisy.status is Status(doc["status"])


def test_the_whole_build_cache_does_not_keep_a_noisy_latency(tmp_path, android_build):
    out, _ = android_build
    docs = [json.loads((out / "manifest.json").read_text())]
    request = BuildRequest(docs[0]["weight"]["name"], out=tmp_path / "unused", cache_dir=tmp_path / "cache")
    plans = [target_profile(request, "android")]
    record = BuildRecord(tmp_path / "cache", request, plans)
    record.store(out, [_noisy(docs[0])])
    assert record.cache.fetch_json("builds", record.key) is None
    record.store(out, docs)
    assert record.cache.fetch_json("builds", record.key)["docs"] == docs


def _mark_cached_validations_noisy(cache) -> int:
    marked = 0
    for path in cache.glob("validations/*/*/entry.json"):
        entry = json.loads(path.read_text())
        conditions = entry["value"].get("latency_conditions")
        if conditions:
            conditions.update(reliable=False, reasons=["load 3.9 on 2 cores, 2 threads timed"])
            body = json.dumps(entry["value"], sort_keys=True)
            entry["sha256"] = hashlib.sha256(body.encode()).hexdigest()
            path.write_text(json.dumps(entry))
            marked += 1
    return marked


def test_a_cached_noisy_latency_is_timed_again_and_its_fidelity_reused(
    tmp_path, android_build, build_cache, digits_model
):
    out, _ = android_build
    first = json.loads((out / "manifest.json").read_text())
    cache = tmp_path / "cache"
    shutil.copytree(build_cache, cache, ignore=shutil.ignore_patterns("builds"))
    assert _mark_cached_validations_noisy(cache) >= 1
    again = tmp_path / "again"
    # one artifact of the same build is enough: its cache entries are keyed on it alone
    result = run_cli(
        *build_args(digits_model, again, "--target", "android", "--format", "torchscript_lite"),
        env={"EXPORTER_CACHE": str(cache)},
    )
    assert result.exit_code in (0, 1), result.output
    second = json.loads((again / "manifest.json").read_text())
    timed = {a["name"]: a for a in first["artifacts"] if a.get("latency_ms") and a["format"] == "torchscript_lite"}
    retimed = [e for e in second["cache"]["events"] if "latency measured again" in e]
    assert len(timed) == len(retimed) == 1 and all("the cached one was unreliable: load 3.9" in e for e in retimed), (
        second["cache"]
    )
    assert [a["name"] for a in second["artifacts"]] == list(timed)
    for a in second["artifacts"]:
        if a["name"] in timed:
            assert a["fidelity"] == timed[a["name"]]["fidelity"] and a["validation_reused_from_cache"]
            assert a["latency_conditions"]["reliable"] and a["latency_ms"]["iterations"] == 10
    assert second["status"] == timed["torchscript_lite_fp32"]["status"]
