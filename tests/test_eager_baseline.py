"""One eager baseline per build (issue 77, items 5 and 6): eager timed alone with no other thread of the process
running beside it, every speedup and the pick against it, the rounds' spread recorded and judged; and the pick in
the manifest, the sentence the reports show."""

from __future__ import annotations

import ctypes
import dataclasses
import html
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exporter import hostload, validation
from exporter.engine import context, pipeline
from exporter.engine.record import _unsettled_timing
from exporter.progress import Progress
from exporter.release import manifest, recommend, report
from exporter.results import EagerBaseline, Manifest

from .fake_manifest import complete

REAL_JUDGE = hostload.judge  # tests/conftest.py stands a quiet-host judge in for it once the session starts
SPIN_S = 0.03  # how long the fake runtime's worker keeps running after each call
linux_only = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads from /proc")


@pytest.fixture
def real_judge(monkeypatch):
    monkeypatch.setattr(hostload, "judge", REAL_JUDGE)


def _spin(done) -> None:
    """Keep a core busy until `done()`, outside the GIL (as a runtime's native worker does): memset through ctypes,
    which releases the GIL for each call."""
    buffer = ctypes.create_string_buffer(1 << 20)
    while not done():
        ctypes.memset(buffer, 1, len(buffer))


def _running(tids: set[int]) -> bool:
    """Whether any of the threads `tids` of this process is running or waiting for a core."""
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # ended
            continue
        if stat[stat.rindex(")") + 2 :].startswith("R"):
            return True
    return False


class SpinningRuntime:
    """A runner whose worker keeps a core busy for SPIN_S after each call returns, as ONNX Runtime's intra-op pool
    and torch's OpenMP workers do (spin-waiting for the next call before they sleep)."""

    def __init__(self):
        self.workers: set[int] = set()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        started = threading.Event()

        def spin():
            self.workers.add(threading.get_native_id())
            started.set()
            end = time.perf_counter() + SPIN_S
            _spin(lambda: time.perf_counter() >= end)

        threading.Thread(target=spin, daemon=True).start()
        started.wait()
        return x * 2


class WatchedEager:
    """Eager (a small computation) that notes, at the start of each call, whether the runtime's workers run."""

    def __init__(self, runtime: SpinningRuntime):
        self.runtime, self.calls, self.beside = runtime, 0, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.beside += _running(self.runtime.workers)
        return x + 1


QUIET = {"window_s": 1.0, "cpus": 2, "load_avg_1m": 0.5, "own_cpu_s": 1.9, "other_cpu_s": 0.0, "steal_s": 0.0}


def _latency(p50: float) -> dict:
    return {"p50": p50, "p90": p50 * 1.1, "p99": p50 * 1.2, "mean": p50, "iterations": 10}


def _baseline(p50: float, rounds: list[float], reliable: bool = True, reasons=()) -> EagerBaseline:
    conditions = {**QUIET, "threads": 2, "spread": {"eager": 1.1}, "max_spread": 2.0}
    conditions.update(reliable=reliable, reasons=list(reasons))
    return EagerBaseline(_latency(p50), rounds, hostload.round_spread(rounds), conditions)


def _measured(artifact_p50: float, eager_rounds: list[float], **conditions) -> dict:
    """Latency fields as latency_against_eager measures them beside eager, before the baseline is applied."""
    rounds = {"eager": eager_rounds, "artifact": [artifact_p50] * len(eager_rounds)}
    return {
        "latency_ms": _latency(artifact_p50),
        "latency_conditions": {
            **QUIET,
            "rounds_p50_ms": rounds,
            "eager_beside_ms": _latency(sorted(eager_rounds)[len(eager_rounds) // 2]),
            **conditions,
        },
    }


@linux_only
def test_a_runtime_spinning_after_each_call_never_runs_beside_eager_and_leaves_the_baseline_alone():
    runtime = SpinningRuntime()
    eager = WatchedEager(runtime)
    x = torch.ones(1, 3)
    baseline = validation.eager_baseline(eager, x, warmup=0, iterations=10, threads=1)
    calls_for_baseline = eager.calls
    timed = validation.latency_against_eager(runtime, eager, x, 0, 20, threads=1, baseline=baseline)
    assert eager.calls == calls_for_baseline + 20 and runtime.workers
    assert eager.beside == 0  # each eager turn waited for the runtime's worker to stop
    assert timed["latency_conditions"]["unsettled"] == []
    assert timed["eager_latency_ms"] == baseline.latency_ms  # the baseline, not the eager timed beside it
    assert timed["latency_conditions"]["eager_beside_ms"]["iterations"] == 20
    assert timed["speedup_vs_eager"] == baseline.p50 / timed["latency_ms"].p50
    assert len(timed["latency_conditions"]["rounds_p50_ms"]["eager"]) == 5


@linux_only
def test_without_the_wait_the_spinning_worker_runs_beside_eager(monkeypatch):
    """The control: what the test above rules out happens when nothing waits for the runtime's threads."""
    monkeypatch.setattr(hostload, "settle", lambda *a, **k: [])
    runtime = SpinningRuntime()
    eager = WatchedEager(runtime)
    validation.measure_latency_on_host({"artifact": runtime, "eager": eager}, torch.ones(1, 3), 0, 20)
    assert eager.beside >= 1


@linux_only
def test_a_thread_that_does_not_stop_is_named_and_makes_the_latency_unreliable(real_judge):
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop.is_set,), daemon=True)
    busy.start()
    try:
        still = hostload.settle(timeout_s=0.02)
    finally:
        stop.set()
        busy.join()
    assert still  # the busy thread's name, as /proc gives it
    reliable, reasons = REAL_JUDGE({"cpus": 2, "unsettled": still}, threads=1)
    assert not reliable and reasons == [f"threads of this process still ran when a runner was timed: {still[0]}"]


def test_every_rows_speedup_divides_the_same_eager_p50():
    baseline = _baseline(6.5, [6.4, 6.5, 6.6, 6.5, 6.5])
    rows = [
        validation.against_baseline(_measured(p50, [eager] * 5), baseline, threads=2)
        for p50, eager in ((2.0, 6.6), (4.0, 6.4), (1.0, 6.5))
    ]
    assert {json.dumps(row["eager_latency_ms"].to_json()) for row in rows} == {
        json.dumps(baseline.latency_ms.to_json())
    }
    assert [row["speedup_vs_eager"] for row in rows] == [6.5 / 2.0, 6.5 / 4.0, 6.5 / 1.0]


def test_a_window_where_eager_ran_slower_than_its_baseline_makes_that_row_unreliable(real_judge):
    # issue 77's demo: eager's p50 beside the .tflite fp32 was 11.33 ms, 6.55 ms beside another row
    baseline = _baseline(6.55, [6.5, 6.55, 6.6, 6.5, 6.55])
    slow = validation.against_baseline(_measured(3.0, [11.3, 11.33, 11.4, 11.2, 11.3]), baseline, threads=2)
    steady = validation.against_baseline(_measured(3.0, [6.6, 6.5, 6.7, 6.6, 6.5]), baseline, threads=2)
    assert steady["latency_conditions"]["reliable"], steady["latency_conditions"]["reasons"]
    conditions = slow["latency_conditions"]
    assert conditions["round_spread"]["eager"] == pytest.approx(11.4 / 6.5, abs=1e-3)
    assert not conditions["reliable"] and conditions["reasons"] == [
        f"eager's p50 moved 1.75x between rounds (its rounds beside the artifact with the build's eager baseline's); "
        f"a quiet host allows "
        f"{hostload.DEFAULT_MAX_ROUND_SPREAD:g}x"
    ]
    assert slow["speedup_vs_eager"] == 6.55 / 3.0  # shown as measured against the one baseline


def test_a_baseline_timed_on_a_busy_host_makes_every_speedup_unreliable(real_judge):
    busy = _baseline(6.5, [6.5] * 5, reliable=False, reasons=["load 3.9 on 2 cores, 2 threads timed"])
    row = validation.against_baseline(_measured(2.0, [6.5] * 5), busy, threads=2)
    assert not row["latency_conditions"]["reliable"]
    assert row["latency_conditions"]["reasons"] == [
        "the build's eager baseline is unreliable: load 3.9 on 2 cores, 2 threads timed"
    ]
    # restated against a quiet baseline (a later build's), the earlier one's reasons do not stay
    quiet = validation.against_baseline(row, _baseline(6.5, [6.5] * 5), threads=2)
    assert quiet["latency_conditions"]["reliable"] and "baseline_reasons" not in quiet["latency_conditions"]


def test_a_build_times_eager_alone_once_for_all_its_targets_and_records_the_spread():
    calls = []
    eager = lambda x: calls.append(1) or x  # noqa: E731
    latency = {"threads": 1, "warmup": 1, "iterations": 10, "max_spread": 2.0}
    plan = SimpleNamespace(latency=SimpleNamespace(describe=lambda: dict(latency)))
    loaded = SimpleNamespace(eager=eager)
    session = context.BuildContext(
        loaded=loaded,
        task=None,
        inputs=SimpleNamespace(validation=torch.ones(4, 3)),
        byte_inputs=None,
        reference=None,
        eager_accuracy=None,
        digests={},
        cache=None,
        plan=plan,
        out=Path("unused"),
        progress=Progress(quiet=True),
    )
    first = session.eager_baseline()
    other_target = dataclasses.replace(session, plan=SimpleNamespace(latency=plan.latency))
    assert other_target.eager_baseline() is first and session.eager_baseline() is first
    assert len(calls) == 11  # one warm-up and ten timed runs, once
    assert len(first.rounds_p50_ms) == 5 and first.round_spread == hostload.round_spread(first.rounds_p50_ms)

    timed = SimpleNamespace(latency_ms={"p50": 1.0}, latency_conditions={"rounds_p50_ms": {"eager": [2.0, 4.0]}})
    untimed = SimpleNamespace(latency_ms=None, latency_conditions=None)
    recorded = session.eager_latency([timed, untimed])
    rounds = first.rounds_p50_ms + [2.0, 4.0]
    assert recorded.build.to_json() == {
        "rounds": 7,
        "artifacts": 1,
        "p50_range_ms": [min(rounds), max(rounds)],
        "round_spread": hostload.round_spread(rounds),
    }
    record = manifest.record(
        Manifest.from_json(
            complete({"eager": {"accuracy": None, "latency": recorded.to_json()}, "command": ["exporter"]})
        )
    )
    assert manifest.schema_problem(record) is None and record["eager"]["latency"]["build"]["rounds"] == 7


def test_a_build_whose_eager_baseline_was_timed_on_a_busy_host_is_not_kept_whole():
    def built(baseline: EagerBaseline) -> Manifest:
        return Manifest.from_json(complete({"eager": {"accuracy": None, "latency": baseline.to_json()}}))

    assert not _unsettled_timing([built(_baseline(5.0, [5.0, 5.1]))])
    assert _unsettled_timing([built(_baseline(5.0, [5.0, 9.0], reliable=False, reasons=["busy"]))])


def _artifact(name: str, fmt: str, precision: str, p50: float, mb: float) -> dict:
    return {
        "name": name,
        "format": fmt,
        "precision": precision,
        "path": f"m_{name}.bin",
        "sha256": "0" * 64,
        "size_bytes": int(mb * 1e6),
        "status": "passed",
        "reasons": [],
        "thresholds": {},
        "fidelity": None,
        "latency_ms": _latency(p50),
        "eager_latency_ms": _latency(6.5),
        "speedup_vs_eager": 6.5 / p50,
    }


ARTIFACTS = [
    _artifact("executorch_fp32", "executorch", "fp32", 3.0, 6.1),
    _artifact("executorch_int8", "executorch", "int8", 2.0, 1.7),
    _artifact("litert_fp32", "litert", "fp32", 1.5, 6.2),
]


def test_the_pick_is_in_the_manifest_and_is_the_sentence_both_reports_show(tmp_path):
    doc = Manifest.from_json(complete({"artifacts": ARTIFACTS, "command": ["exporter"]}))
    written = pipeline._finish(tmp_path, doc, Progress(quiet=True))
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    read_back = Manifest.from_json(on_disk)
    assert (
        on_disk["recommended"]
        == written["recommended"]
        == {
            "artifact": "litert_fp32",
            "ranked_by": "x86 latency",
            "smallest": "executorch_int8",
            "why": recommend.line(read_back),
            # every other artifact, and why it was not picked
            "not_picked": {"executorch_fp32": "p50 3.00 ms against litert_fp32's 1.50 ms on x86"},
        }
    )
    assert manifest.schema_problem(on_disk) is None
    why = on_disk["recommended"]["why"]
    assert why.startswith("Ship for android (3 passed): fastest litert_fp32 (p50 1.50 ms); smallest executorch_int8")
    head, _, rest = why.partition(": ")
    page = html.unescape((tmp_path / "report.html").read_text())
    assert f"<b>{head}:</b> {rest}</p>" in page
    markdown = recommend.line(read_back, markdown=True)
    assert markdown.replace("`", "") == why and markdown.count("`") == 4
    assert "**" + markdown.replace(": ", ":** ", 1) in (tmp_path / "report.md").read_text()
    not_picked = "Not picked: executorch_fp32: p50 3.00 ms against litert_fp32's 1.50 ms on x86."
    assert f"<p>{not_picked}</p>" in page and not_picked in (tmp_path / "report.md").read_text().replace("`", "")


def test_the_reports_show_the_manifests_sentence_not_one_computed_again():
    record = complete({"artifacts": ARTIFACTS, "command": ["exporter"]})
    record["recommended"] = {
        "artifact": "x",
        "ranked_by": "x86 latency",
        "smallest": None,
        "why": "Ship for android: x.",
    }
    doc = Manifest.from_json(record)
    assert recommend.shown(doc) == "Ship for android: x."
    assert "**Ship for android:** x." in report.markdown(doc)
    del record["recommended"]  # a manifest written before the field: computed as it always was
    doc = Manifest.from_json(record)
    assert doc.recommended is None and recommend.shown(doc) == recommend.line(doc)
    assert recommend.shown(doc, markdown=True) == recommend.line(doc, markdown=True)


def test_artifact_names_are_code_in_markdown_whole_names_only():
    record = complete({"artifacts": [_artifact("onnx_fp32", "onnx", "fp32", 1.0, 1.0)]})
    record["recommended"] = {
        "artifact": "onnx_fp32",
        "ranked_by": "x86 latency",
        "smallest": "onnx_fp32",
        "why": "Ship for jetson: onnx_fp32, the only one; not onnx_fp32x nor `onnx_fp32`.",
    }
    assert recommend.shown(Manifest.from_json(record), markdown=True) == (
        "Ship for jetson: `onnx_fp32`, the only one; not onnx_fp32x nor `onnx_fp32`."
    )


def test_a_manifest_round_trips_its_pick_and_baseline():
    doc = complete({"artifacts": ARTIFACTS, "command": ["exporter"]})
    doc["recommended"] = recommend.recommendation(Manifest.from_json(doc)).to_json()
    doc["eager"]["latency"] = _baseline(6.5, [6.5] * 5).to_json()
    assert manifest.schema_problem(doc) is None
    typed = Manifest.from_json(doc)
    assert typed.recommended.artifact == "litert_fp32"
    record = manifest.record(typed)
    assert record["recommended"] == doc["recommended"] and record["eager"] == doc["eager"]
