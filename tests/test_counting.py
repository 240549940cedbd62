"""Instructions per inference under the counting qemu (exporter/aarch64/counter.py, counting.py, inside_count.py,
count_plugin.c). The plugin's lines, the regions and the marker's cost, the key and the refusals always run; building
the counting qemu and counting real .pte files on an emulated cortex-a76 run with EXPORTER_TEST_AARCH64=1 (the
counting qemu is built once under the runner's cache, about 2-5 minutes on 2 cores, then found)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import aarch64
from exporter.aarch64 import counter, counting
from exporter.aarch64.layout import READY
from exporter.errors import UsageError
from exporter.progress import Progress

from .helpers import ARM_CACHE as RUNNER_CACHE, ARM_E2E as E2E


def _marker(tag: int, count: int, pid: int = 10, vcpu: int = 0) -> str:
    return f"marker {pid} {vcpu} {tag} {count}"


def _regions_text(
    empty=(5000, 5010, 4990), load=100_000, runs=(1_300_000, 1_005_000, 1_004_000, 1_006_000), artifacts=1
) -> str:
    """Artifact k's regions are its load and runs, each 10 * k instructions dearer than artifact 0's."""
    lines, at = [], 1_000_000
    regions = [(1, e) for e in empty]
    for k in range(artifacts):
        regions += [(10 * k + 3, load + 10 * k)] + [(10 * k + 5, r + 10 * k) for r in runs]
    for tag, n in regions:
        lines += [_marker(tag, at), _marker(tag + 1, at + n)]
        at += n + 777  # what runs between two regions is never counted
    return "\n".join(lines)


def test_the_plugins_lines_are_read_and_anything_else_ignored():
    text = "marker 12 0 7 3\nUnsupported syscall: 4242\nmarker 12 x 7 3\ntotal 12 6\n\nmarker 1 2 3\n"
    assert counter.read_lines(text) == [
        {"kind": "marker", "pid": 12, "vcpu": 0, "tag": 7, "count": 3},
        {"kind": "total", "pid": 12, "count": 6},
    ]


def test_the_marker_cost_is_subtracted_and_the_warm_up_reported_apart():
    found = counting.regions(counter.read_lines(_regions_text()))
    assert found == {
        "empty": [5000, 5010, 4990],
        "artifacts": [{"load": [100_000], "run": [1_300_000, 1_005_000, 1_004_000, 1_006_000]}],
    }
    summary = counting.summarize(found["empty"], found["artifacts"][0], warmup=1)
    assert summary["marker_cost"] == 5000
    assert summary["load"] == 95_000
    assert summary["warmup"] == [1_295_000]
    assert summary["runs"] == [1_000_000, 999_000, 1_001_000]
    assert summary["per_inference"] == 1_000_000
    assert summary["spread"] == pytest.approx(2_000 / 1_000_000)


def test_each_artifact_of_one_process_has_its_own_regions_and_shares_the_marker_cost():
    found = counting.regions(counter.read_lines(_regions_text(artifacts=3)))
    assert len(found["artifacts"]) == 3
    per = [counting.summarize(found["empty"], one, warmup=1) for one in found["artifacts"]]
    assert [p["per_inference"] for p in per] == [1_000_000, 1_000_010, 1_000_020]
    assert [p["load"] for p in per] == [95_000, 95_010, 95_020] and {p["marker_cost"] for p in per} == {5000}


def test_only_the_counted_process_and_thread_are_read():
    child = "\n".join(_marker(tag, 1, pid=11) for tag in (5, 5, 5))  # a forked child's markers: another process
    found = counting.regions(counter.read_lines(_regions_text() + "\n" + child), pid=10)
    assert len(found["artifacts"][0]["run"]) == 4
    two_threads = _marker(5, 0) + "\n" + _marker(6, 10, vcpu=1)
    with pytest.raises(UsageError, match="more than one thread"):
        counting.regions(counter.read_lines(two_threads))


@pytest.mark.parametrize(
    "text, message",
    [
        (_marker(5, 0) + "\n" + _marker(4, 10), "out of order"),
        (_marker(5, 0) + "\n" + _marker(5, 10), "out of order"),
        (_marker(9, 0), "out of order"),
        (_marker(13, 0) + "\n" + _marker(4, 10), "out of order"),  # artifact 1's load closed as artifact 0's
        (_marker(1, 0) + "\n" + _marker(2, 10) + "\n" + _marker(3, 20), "never closed"),
    ],
)
def test_markers_that_do_not_pair_are_refused(text, message):
    with pytest.raises(UsageError, match=message):
        counting.regions(counter.read_lines(text))


def test_too_few_regions_are_refused():
    found = counting.regions(counter.read_lines(_regions_text(runs=(1000,))))
    with pytest.raises(UsageError, match="more than 1 inferences"):
        counting.summarize(found["empty"], found["artifacts"][0], warmup=1)
    with pytest.raises(UsageError, match="marker's own cost"):
        counting.summarize([], {"load": [1], "run": [1, 2]}, warmup=1)


def test_the_key_follows_the_qemu_source_the_plugin_and_the_layout():
    source = counter.PLUGIN_SOURCE.read_text()
    base = counter.key("1:10.0.2+ds-2", source, 1)
    assert base == counter.key("1:10.0.2+ds-2", source, 1) == counter.key("1:10.0.2+ds-2")
    assert len({base, counter.key("1:10.1.0+ds-1", source, 1), counter.key("1:10.0.2+ds-2", source + " ", 1)}) == 3
    assert counter.key("1:10.0.2+ds-2", source, 2) != base


def test_the_newest_source_version_is_taken():
    showsrc = "Package: qemu\nVersion: 1:10.0.2+ds-2\n\nPackage: other\nVersion: 9:1\n\nPackage: qemu\nVersion: 1:10.0.3+ds-1\n"
    assert counter.newest_source_version(showsrc) == "1:10.0.3+ds-1"
    with pytest.raises(UsageError, match="no source package 'qemu'"):
        counter.newest_source_version("Package: other\nVersion: 1\n")


def test_missing_build_tools_are_named_in_one_apt_get_line(monkeypatch):
    missing = counter.missing_prerequisites(
        which=lambda tool: None if tool == "ninja" else f"/usr/bin/{tool}",
        has_library=lambda name: name == "zlib",
        has_venv=lambda: False,
    )
    assert missing == ["ninja-build", "libglib2.0-dev", "python3-venv"]
    with pytest.raises(UsageError, match="Debian or Ubuntu"):
        counter.missing_prerequisites(which=lambda tool: None if tool == "apt-get" else tool, has_venv=lambda: True)
    monkeypatch.setattr(counter, "missing_prerequisites", lambda: missing)
    with pytest.raises(UsageError) as refused:
        counter.check_host()
    assert str(refused.value).endswith("`apt-get install -y ninja-build libglib2.0-dev python3-venv`")
    assert "exporter arm-setup` (installs them)" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_offline_with_no_counting_qemu_is_refused_and_writes_nothing(tmp_path):
    with pytest.raises(UsageError, match="offline, and no counting qemu"):
        counter.prepare(root=tmp_path / "counter", offline=True)
    assert [p.name for p in (tmp_path / "counter").iterdir()] == [".lock"]


class _FakeApt:
    def __init__(self, where):
        pass

    def update(self):
        pass

    def source_version(self):
        return "1:10.0.2+ds-2"


def test_a_counting_qemu_is_built_once_in_a_sibling_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    root, quiet = tmp_path / "counter", Progress(quiet=True)
    builds = []

    def build(tmp, apt, version, progress):
        builds.append(tmp)
        (tmp / "qemu-aarch64").write_bytes(b"half")
        if len(builds) == 1:
            raise UsageError("ninja qemu-aarch64 failed: an error")
        (tmp / "libcount.so").write_bytes(b"")
        return {"qemu_version": "qemu-aarch64 version 10.0.2"}

    monkeypatch.setattr(counter, "_Apt", _FakeApt)
    monkeypatch.setattr(counter, "check_host", lambda: None)
    monkeypatch.setattr(counter, "build", build)
    (root / ".tmp-killed-1").mkdir(parents=True)  # a build killed part way
    with pytest.raises(UsageError, match="ninja"):
        counter.prepare(quiet, root=root, offline=False)
    assert sorted(p.name for p in root.iterdir()) == [".lock"]
    built = counter.prepare(quiet, root=root, offline=False)
    assert built.path == root / counter.key("1:10.0.2+ds-2") and builds[-1].name.startswith(".tmp-")
    assert built.info["qemu_source"] == "qemu=1:10.0.2+ds-2" and built.info["plugin_sha256"] == counter.plugin_hash()
    assert sorted(p.name for p in root.iterdir()) == [".lock", built.path.name]
    assert json.loads((built.path / READY).read_text())["key"] == built.path.name
    again = counter.prepare(quiet, root=root, offline=True)
    assert again.path == built.path and len(builds) == 2


def test_only_a_complete_counting_qemu_for_this_plugin_is_found(tmp_path):
    def made(name: str, **info) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "qemu-aarch64").write_bytes(b"")
        (path / "libcount.so").write_bytes(b"")
        ready = {"layout": counter.LAYOUT, "plugin_sha256": counter.plugin_hash(), "finished": 1, **info}
        (path / READY).write_text(json.dumps(ready))
        return path

    assert counter.find(root=tmp_path) is None
    made(".tmp-abc-1")
    made("old-plugin", plugin_sha256="0" * 64, finished=5)
    made("old-layout", layout=counter.LAYOUT - 1, finished=5)
    (made("no-ready") / READY).unlink()
    assert counter.find(root=tmp_path) is None
    made("good", qemu_version="qemu-aarch64 version 10.0.2")
    found = counter.find(root=tmp_path)
    assert found.path.name == "good" and found.version == "qemu-aarch64 version 10.0.2"
    assert found.plugin_option(tmp_path / "out") == ["-plugin", f"{found.plugin},out={tmp_path / 'out'}"]
    with pytest.raises(UsageError, match="comma"):
        found.plugin_option(tmp_path / "a,b")


def test_bad_requests_are_refused_before_anything_runs(tmp_path):
    import numpy as np

    runner = aarch64.Runner(tmp_path, {"cpus": {"cortex-a76": "0x414fd0b1"}})
    qemu = counter.Counter(tmp_path)
    x = np.zeros((1, 3, 8, 8), np.float32)
    (tmp_path / "model.txt").write_text("")
    with pytest.raises(UsageError, match="max is refused"):
        counting.count(runner, qemu, tmp_path / "model.pte", x, "max")
    with pytest.raises(UsageError, match="does not model 'cortex-a53'"):
        counting.count(runner, qemu, tmp_path / "model.pte", x, "cortex-a53")
    with pytest.raises(UsageError, match="not a .pte"):
        counting.count(runner, qemu, tmp_path / "model.txt", x, "cortex-a76")
    with pytest.raises(UsageError, match="not a .pte"):
        counting.count(runner, qemu, tmp_path / "missing.pte", x, "cortex-a76")
    with pytest.raises(UsageError, match="N x C x H x W"):
        counting.count(runner, qemu, tmp_path / "model.txt", x[0], "cortex-a76")
    with pytest.raises(UsageError, match="runs 0"):
        counting.count(runner, qemu, tmp_path / "model.txt", x, "cortex-a76", runs=0)
    with pytest.raises(UsageError, match="items >= 1"):
        counting.count_many(runner, qemu, [], x, "cortex-a76")


def test_a_module_torch_export_refuses_is_a_failed_count_and_nothing_runs(tmp_path):
    import numpy as np
    import torch

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # a branch on a tensor's value: torch.export refuses it

    runner = aarch64.Runner(tmp_path, {"cpus": {"cortex-a76": "0x414fd0b1"}})
    (failed,) = counting.count_many(
        runner, counter.Counter(tmp_path), [DataDependent()], np.ones((1, 3, 8, 8)), "cortex-a76"
    )
    assert isinstance(failed, counting.Failed) and failed.artifact == "eager DataDependent", failed
    assert failed.reason.startswith("torch.export: ") and failed.cpu == "cortex-a76", failed


def test_the_tiny_program_is_an_aarch64_executable():
    data = counter.tiny_elf()
    assert data[:4] == b"\x7fELF" and len(data) == 64 + 56 + 6 * 4
    assert int.from_bytes(data[18:20], "little") == 183  # EM_AARCH64


def _net(width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(width, width, 3, padding=1),
        torch.nn.ReLU(),
    ).eval()


def test_the_guest_script_runs_on_the_host_too_and_one_broken_artifact_leaves_the_others_counted(tmp_path):
    """inside_count.py's own logic, with this host's Python and packages: on x86 the marker is an unknown syscall
    (ENOSYS, harmless), so it runs the same sequence and answers its line, an error for the file that is no model."""
    import numpy as np
    import torch

    x = torch.randn(2, 3, 16, 16)
    torch.onnx.export(_net(4), (x[:1],), tmp_path / "net.onnx", dynamo=False)
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    np.save(tmp_path / "x.npy", x.numpy())
    done = subprocess.run(
        [
            sys.executable,
            str(counting.INSIDE_COUNT),
            *(a for name in ("broken", "net") for a in ("--artifact", str(tmp_path / f"{name}.onnx"))),
            *("--inputs", str(tmp_path / "x.npy"), "--runs", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    broken, net = answer["artifacts"]
    assert "error" in broken and net["runtime"] == "onnxruntime" and answer["pid"] > 0, answer


# -- for real, under the counting qemu ----------------------------------------------------------------------------

needs_arm = pytest.mark.skipif(
    not E2E, reason="set EXPORTER_TEST_AARCH64=1: sets up the aarch64 runner and builds the counting qemu once"
)


@pytest.fixture(scope="module")
def arm_runner():
    """The runner the background set-up made (waits for it: prepare takes the set-up's lock)."""
    return aarch64.prepare(RUNNER_CACHE, offline=False)


@pytest.fixture(scope="module")
def counting_qemu():
    """Found, or set up as `exporter arm-setup` does (its Debian packages installed first where missing): this may
    take the lock before the suite's background arm-setup reaches the counting qemu."""
    return counter.prepare(cache_dir=RUNNER_CACHE, offline=False, install=counter.apt_install)


@pytest.mark.slow
@needs_arm
def test_the_counting_qemu_counts_a_six_instruction_program_exactly(counting_qemu, tmp_path):
    assert counter.smoke(counting_qemu.qemu, counting_qemu.plugin, tmp_path) == {"marker_at": 3, "total": 6}
    assert counting_qemu.version.startswith("qemu-aarch64 version 10.")
    assert counting_qemu.info["size_bytes"] > 0 and counting_qemu.info["seconds"] > 0


@pytest.mark.slow
@needs_arm
def test_a_pte_counts_the_same_alone_and_in_a_batch_and_four_times_the_work_counts_clearly_more(
    arm_runner, counting_qemu, tmp_path
):
    """Two small conv nets (64 x 64, 16 and 32 channels: 3.7x the multiply-adds), fp32 .pte, on cortex-a76: the
    first alone, then both and a file that is no model in one process (about 20 s a process under emulation, most of
    it importing torch)."""
    import torch

    from exporter.formats import executorch

    x = torch.randn(2, 3, 64, 64)
    for width in (16, 32):
        executorch.FORMAT.export(_net(width), x[:1], "fp32", None, tmp_path / f"net{width}.pte", {})
    (tmp_path / "broken.pte").write_bytes(b"not a program")
    first = counting.count(arm_runner, counting_qemu, tmp_path / "net16.pte", x.numpy(), "cortex-a76")
    second, broken, large = counting.count_many(
        arm_runner, counting_qemu, [tmp_path / n for n in ("net16.pte", "broken.pte", "net32.pte")], x, "cortex-a76"
    )
    assert isinstance(broken, counting.Failed) and broken.artifact == "broken.pte", broken
    assert first.info["delegate"] == "XnnpackBackend" and first.cpu == "cortex-a76"
    assert first.qemu_version == counting_qemu.version
    assert abs(first.per_inference - second.per_inference) / first.per_inference < 1e-3, (first, second)
    assert first.spread < 1e-3 and large.spread < 1e-3, (first, large)
    assert 0 < first.marker_cost < 50_000, first
    assert first.per_inference > 1_000_000 and first.load > 0 and len(first.warmup) == 1 and len(first.runs) == 3
    assert large.per_inference > 2 * first.per_inference, (first, large)
