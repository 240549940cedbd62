"""Counts on a fresh machine: `exporter arm-setup` installs what the counting qemu is built with (the installer is
injected here: nothing is installed), a build that cannot count says so in one line before it starts, and a row
cached while counts were unavailable is not served once they are (the real caches, fabricated rows)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from exporter import aarch64
from exporter.aarch64 import counter
from exporter.aarch64.layout import Runner
from exporter.cli import main
from exporter.errors import UsageError
from exporter.progress import Progress

from .test_aarch64 import FakeBuilder

GLIB = "libglib2.0-dev"


def ENV(cache: Path) -> dict:
    return {"EXPORTER_CACHE": str(cache), "EXPORTER_OFFLINE": "0"}  # the suite runs offline; set-up is online


class Host:
    """A host's build prerequisites: `lacking` until an installer installs them (recorded in `installs`)."""

    def __init__(self, *lacking: str):
        self.lacking, self.installs = list(lacking), []

    def missing(self) -> list[str]:
        return list(self.lacking)

    def install(self, packages: list[str]) -> None:
        self.installs.append(list(packages))
        self.lacking = [p for p in self.lacking if p not in packages]


def test_the_dependency_step_installs_exactly_what_is_missing_and_nothing_when_all_is_there():
    quiet = Progress(quiet=True)
    fresh = Host(GLIB, "ninja-build")
    assert counter.install_prerequisites(quiet, fresh.missing, fresh.install) == [GLIB, "ninja-build"]
    assert fresh.installs == [[GLIB, "ninja-build"]]
    ready = Host()
    assert counter.install_prerequisites(quiet, ready.missing, ready.install) == []
    assert ready.installs == []


def test_an_install_that_leaves_a_package_missing_is_one_line_naming_it():
    stubborn = Host(GLIB)
    with pytest.raises(UsageError) as refused:
        counter.install_prerequisites(Progress(quiet=True), stubborn.missing, lambda packages: None)
    assert GLIB in str(refused.value) and "\n" not in str(refused.value)


def test_installing_without_root_names_the_command_that_does_it(monkeypatch):
    monkeypatch.setattr(counter.os, "geteuid", lambda: 1000)
    with pytest.raises(UsageError) as refused:
        counter.apt_install([GLIB, "ninja-build"])
    line = str(refused.value)
    assert "\n" not in line and f"sudo apt-get install -y {GLIB} ninja-build" in line and "arm-setup" in line


def _fake_counter_build(monkeypatch, host: Host, installer: bool = True) -> list:
    """counter.prepare's download and compile replaced (as tests/test_counting.py does), the host's prerequisites
    those of `host`, installed by its installer (or by the real apt_install when not `installer`)."""
    builds = []

    class Apt:
        def __init__(self, where):
            pass

        def update(self):
            pass

        def source_version(self):
            return "1:10.0.2+ds-2"

    def build(tmp, apt, version, progress):
        builds.append(tmp)
        (tmp / "qemu-aarch64").write_bytes(b"")
        (tmp / "libcount.so").write_bytes(b"")
        return {"qemu_version": "qemu-aarch64 version 10.0.2"}

    monkeypatch.setattr(counter, "missing_prerequisites", host.missing)
    if installer:
        monkeypatch.setattr(counter, "apt_install", host.install)
    monkeypatch.setattr(counter, "_Apt", Apt)
    monkeypatch.setattr(counter, "build", build)
    return builds


@pytest.mark.parametrize("lacking", [[GLIB, "pkg-config"], []])
def test_arm_setup_installs_what_the_counting_qemu_needs_then_builds_it(monkeypatch, tmp_path, lacking):
    monkeypatch.delenv("EXPORTER_AARCH64_CACHE", raising=False)
    aarch64.prepare(tmp_path, builder=FakeBuilder(), offline=False)  # the runner, for the versions this checkout pins
    host = Host(*lacking)
    builds = _fake_counter_build(monkeypatch, host)
    result = CliRunner().invoke(main, ["arm-setup", "--json"], env=ENV(tmp_path))
    assert result.exit_code == 0, result.output
    assert host.installs == ([lacking] if lacking else [])
    built = json.loads(result.output)["counter"]
    assert "unavailable" not in built and len(builds) == 1
    assert counter.find(tmp_path) is not None
    again = CliRunner().invoke(main, ["arm-setup", "--json"], env=ENV(tmp_path))
    assert again.exit_code == 0 and len(builds) == 1 and len(host.installs) == len([lacking] if lacking else [])


def test_arm_setup_that_cannot_install_says_what_to_install_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("EXPORTER_AARCH64_CACHE", raising=False)
    aarch64.prepare(tmp_path, builder=FakeBuilder(), offline=False)
    builds = _fake_counter_build(monkeypatch, Host(GLIB), installer=False)
    monkeypatch.setattr(counter.os, "geteuid", lambda: 1000)  # the real installer refuses before running apt-get
    result = CliRunner().invoke(main, ["arm-setup"], env=ENV(tmp_path))
    assert result.exit_code == 0, result.output  # the runner stands without it
    (line,) = [line for line in result.output.splitlines() if line.startswith("counting qemu:")]
    assert f"sudo apt-get install -y {GLIB}" in line and builds == []


def _arm_build(monkeypatch, tmp_path, *extra: str, counter_built: bool = False):
    """`exporter build … --cpu cortex-a76` on a host lacking glib's development files, stopped at the runner step
    (the first step of the build proper): what it said before, and its output folder."""
    monkeypatch.setenv("EXPORTER_AARCH64_CACHE", str(tmp_path / "runners"))
    monkeypatch.setattr(counter, "missing_prerequisites", Host(GLIB).missing)
    if counter_built:
        monkeypatch.setattr(counter, "find", lambda cache_dir=None, root=None: counter.Counter(tmp_path))

    def runner_step(*args, **kwargs):
        raise UsageError("the runner step was reached")

    monkeypatch.setattr(aarch64, "prepare", runner_step)
    out = tmp_path / "out"
    args = ["build", "mobilenet_v3_small", "--target", "android", "--cpu", "cortex-a76", "--out", str(out), *extra]
    result = CliRunner().invoke(main, args, env=ENV(tmp_path / "cache"))
    return result, out


def _notices(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if "instruction counts" in line]


def test_a_build_that_cannot_count_says_so_in_one_line_before_it_starts(monkeypatch, tmp_path):
    result, out = _arm_build(monkeypatch, tmp_path)
    lines = result.stderr.strip().splitlines()
    (notice,) = _notices(result)
    assert lines.index(notice) < lines.index("error: the runner step was reached"), lines
    assert GLIB in notice and "exporter arm-setup" in notice and f"apt-get install -y {GLIB}" in notice, notice


def test_a_build_asked_to_count_where_it_cannot_is_refused_with_nothing_written(monkeypatch, tmp_path):
    from .helpers import assert_clean_refusal

    result, out = _arm_build(monkeypatch, tmp_path, "--count")
    assert_clean_refusal(result, out, "--count", GLIB, "exporter arm-setup")


@pytest.mark.parametrize("extra,counter_built", [(["--no-count"], False), ([], True)])
def test_a_build_that_counts_or_is_told_not_to_says_nothing(monkeypatch, tmp_path, extra, counter_built):
    result, _ = _arm_build(monkeypatch, tmp_path, *extra, counter_built=counter_built)
    assert result.exit_code == 2 and "the runner step was reached" in result.stderr, result.output
    assert _notices(result) == []


CPU = "cortex-a76"


def _session(cache_root: Path, out: Path):
    """What add_rows and add_counts read of a build's session, for one .pte judged on one emulated CPU."""
    import torch

    from exporter.engine.cache import BuildCache

    validate = SimpleNamespace(arches=("x86_64", "aarch64"), cpus=(CPU,), count=True, ranking_cpu=CPU)
    digests = {k: f"digest-{k}" for k in ("validation", "labels", "tools", "checkpoint", "reference", "task", "model")}
    return SimpleNamespace(
        plan=SimpleNamespace(validate=validate),
        digests=digests,
        cache=BuildCache(cache_root),
        fed=SimpleNamespace(validation=torch.zeros(2, 3, 8, 8)),
        eager_taking_fed="the eager module",
        takes_bytes=False,
        latency={"threads": 1},
        x86_outputs={},
        out=out,
        progress=Progress(quiet=True),
        prefix="",
    )


def _pte(out: Path):
    from exporter.results import ArtifactResult, Status

    out.mkdir(exist_ok=True)
    (out / "model.pte").write_bytes(b"a .pte")
    return ArtifactResult(
        name="executorch_fp32",
        format="executorch",
        precision="fp32",
        path="model.pte",
        sha256="ab" * 32,
        status=Status.PASSED,
        fidelity={"top1_agreement": 1.0},
        thresholds={"top1_agreement": 1.0},
    )


def test_a_row_cached_while_counts_were_unavailable_is_counted_once_they_are(monkeypatch, tmp_path):
    """The row is served from the real row cache both times (the emulator never runs); without a counting qemu it
    carries no count, and once one is there the same cached row carries one, counted and cached by the counter."""
    from exporter.aarch64.counting import Counts
    from exporter.engine import count_on_arm, validate_on_arm
    from exporter.results import EmulatedRow, Status

    runner = Runner(tmp_path / "runner", {"key": "runner-key", "cpus": {CPU: "0x414fd0b1"}})
    monkeypatch.setattr(aarch64, "prepare", lambda *args, **kwargs: runner)
    monkeypatch.setattr(aarch64, "run", lambda *args, **kwargs: pytest.fail("a cached row was emulated again"))
    out = tmp_path / "build"
    session = _session(tmp_path / "cache", out)
    entry = _pte(out)
    stored = EmulatedRow(cpu=CPU, status=Status.PASSED, fidelity={"top1_agreement": 1.0})  # as a build stores it
    session.cache.store_json("aarch64", validate_on_arm._key(session, entry, CPU, runner), stored)
    counted = []

    def count_many(runner, counter, items, inputs, cpu, warmup=1, runs=2):
        counted.append([getattr(item, "name", item) for item in items])
        return [
            Counts(str(item), cpu, 1000 + k, 0.0, [1000 + k] * runs, [1001] * warmup, 5, 40, "qemu")
            for k, item in enumerate(items)
        ]

    monkeypatch.setattr(count_on_arm.counting, "count_many", count_many)

    def build(counter_prepare):
        monkeypatch.setattr(counter, "prepare", counter_prepare)
        doc = SimpleNamespace(artifacts=[_pte(out)], aarch64=None)
        validate_on_arm.add_rows(session, doc, tmp_path / "cache", offline=False)
        (row,) = doc.artifacts[0].aarch64
        assert row.reused_from_cache
        return doc, row

    def no_counter(*args, **kwargs):
        raise UsageError("no counting qemu built")

    doc, row = build(no_counter)
    assert row.instructions is None and "unavailable" in doc.aarch64["instructions"] and counted == []
    doc, row = build(lambda *args, **kwargs: counter.Counter(tmp_path / "counter", {"key": "counter-key"}))
    assert counted == [["the eager module", "model.pte"]], counted
    assert row.instructions.per_inference == 1001 and row.instructions.eager_per_inference == 1000
    assert doc.aarch64["instructions"]["counter"] == "counter-key" and not doc.aarch64["instructions"]["failed"]
    doc, row = build(lambda *args, **kwargs: counter.Counter(tmp_path / "counter", {"key": "counter-key"}))
    assert row.instructions.per_inference == 1001 and len(counted) == 1  # now from the instructions cache


def _stored_build(tmp_path: Path, counts: dict):
    """A whole-build record of one .pte with a cortex-a76 row, its counts summary `counts`, stored in the real
    record cache as a build stores it (a fabricated manifest, no file besides it)."""
    from exporter.engine.record import BuildRecord
    from exporter.engine.request import BuildRequest

    from .fake_manifest import complete, verdict

    instructions = {"per_inference": 1001, "unit": "instructions"} if "unavailable" not in counts else None
    row = {"arch": "aarch64", "cpu": CPU, "emulated": True, "seconds": 12.0, "status": "passed", "reasons": []}
    row.update(dict.fromkeys(("latency_ms", "fidelity", "vs_x86")))
    artifact = {
        "name": "executorch_fp32",
        "format": "executorch",
        "precision": "fp32",
        **verdict("executorch"),
        **{"path": "model.pte", "sha256": "ab" * 32, "size_bytes": 6, "details": {}, "thresholds": {}},
        **dict.fromkeys(("fidelity", "accuracy", "eager_latency_ms", "speedup_vs_eager")),
        "aarch64": [{**row, **({"instructions": instructions} if instructions else {})}],
    }
    doc = complete({"artifacts": [artifact], "aarch64": {"cpus": {CPU: ""}, "instructions": counts}})
    (tmp_path / "out").mkdir(parents=True)
    request = BuildRequest(weight="mobilenet_v3_small", out=tmp_path / "out", cache_dir=tmp_path / "cache")
    record = BuildRecord(tmp_path / "cache", request, [{"name": "android", "validate": {"count": True}}])
    inputs = {"files": {}, "trees": {}, "absent": []}
    record.cache.store_json(
        "builds", record.key, {"inputs": inputs, "targets": ["android"], "files": {}, "docs": [doc]}
    )
    return record


def test_a_whole_build_stored_while_counts_were_unavailable_is_not_restored(tmp_path):
    counted = _stored_build(tmp_path / "counted", {"counter": "counter-key", "eager": {CPU: 1000}, "failed": {}})
    (doc,) = counted.restore(Progress(quiet=True))
    assert doc["artifacts"][0]["aarch64"][0]["instructions"]["per_inference"] == 1001
    uncounted = _stored_build(tmp_path / "uncounted", {"unavailable": "no counting qemu built", "unit": "x"})
    assert uncounted.cache.fetch_json("builds", uncounted.key) is not None
    assert uncounted.restore(Progress(quiet=True)) is None  # a build now may count: it runs


def test_a_whole_build_whose_counts_failed_in_part_is_not_restored(tmp_path):
    """A count that failed (the emulated process died or timed out) leaves its row without counts: restoring that
    record would serve the row uncounted for good, so the next build counts again."""
    failed = _stored_build(
        tmp_path / "failed",
        {"counter": "counter-key", "eager": {CPU: 1000}, "failed": {f"executorch_fp32 on {CPU}": "timed out"}},
    )
    assert failed.restore(Progress(quiet=True)) is None
    rowless = _stored_build(tmp_path / "rowless", {"counter": "counter-key", "eager": {CPU: 1000}, "failed": {}})
    record = rowless.cache.fetch_json("builds", rowless.key)
    del record["docs"][0]["artifacts"][0]["aarch64"][0]["instructions"]
    rowless.cache.store_json("builds", rowless.key, record)
    assert rowless.restore(Progress(quiet=True)) is None
