"""The sweep's build processes (exporter.coverage.sweep, exporter.coverage.memory): one process group per
build, stopped at its CPU-time limit with the wall clock as backstop, its memory sampled, and a kill told from
the weight's verdict. The worker is replaced by a small script, so nothing is built."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from exporter.coverage import memory, outcome, sweep


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
