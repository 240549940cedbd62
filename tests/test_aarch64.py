"""The aarch64 runner: a half-built runner is never used, the key follows the pinned versions, refusals are one
line with exit 2, the CUDA stubs are well-formed ELF. Runs under qemu: tests/test_validation_on_arm.py."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from exporter import aarch64
from exporter.aarch64 import cpus, elf, runner, sysfs
from exporter.aarch64 import versions as pins
from exporter.cli import main
from exporter.errors import UsageError

WANTED = {"torch": "2.14.1", "executorch": "1.5.1", "onnxruntime": "1.32.0", "numpy": "2.4.6"}


class FakeBuilder:
    """Writes a runner's files without downloading anything; can fail part way, as a killed set-up would."""

    def __init__(self, fail: bool = False):
        self.fail, self.builds = fail, []

    def check_host(self):
        pass

    def qemu_version(self, progress):
        return "qemu-user=1:10.0.2"

    def build(self, tmp, wanted, progress):
        self.builds.append(tmp)
        (tmp / "root").mkdir()
        (tmp / "qemu-aarch64").write_text("fake")
        if self.fail:
            raise UsageError("the network went away")
        return {"cpus": {"cortex-a53": "0x410fd034"}}


def _prepare(tmp_path, builder, **kwargs):
    return aarch64.prepare(tmp_path, builder=builder, wanted=WANTED, offline=False, **kwargs)


def test_a_runner_is_built_once_then_reused(tmp_path):
    builder = FakeBuilder()
    first = _prepare(tmp_path, builder)
    assert first.path.parent == tmp_path / "aarch64" and (first.path / runner.READY).exists()
    assert json.loads((first.path / runner.READY).read_text())["packages"] == WANTED
    again = _prepare(tmp_path, builder)
    assert again.path == first.path and len(builder.builds) == 1
    assert _prepare(tmp_path, builder, rebuild=True).path == first.path and len(builder.builds) == 2


def test_a_killed_setup_leaves_nothing_taken_for_ready(tmp_path):
    """A set-up killed part way leaves its .tmp-* directory (even with a READY file in it): it is never
    used, and the next set-up removes it and builds."""
    leftover = tmp_path / "aarch64" / f".tmp-{pins.key(WANTED, 'qemu-user=1:10.0.2')}-killed"
    (leftover / "root").mkdir(parents=True)
    (leftover / runner.READY).write_text(json.dumps({"packages": WANTED, "layout": pins.LAYOUT}))
    assert aarch64.find(tmp_path, WANTED) is None
    builder = FakeBuilder()
    built = _prepare(tmp_path, builder)
    assert len(builder.builds) == 1 and not leftover.exists() and built.path.name != leftover.name


def test_a_final_directory_without_its_marker_is_rebuilt(tmp_path):
    final = tmp_path / "aarch64" / pins.key(WANTED, "qemu-user=1:10.0.2")
    (final / "root").mkdir(parents=True)
    (final / "stale").write_text("from a copy that lost READY.json")
    assert aarch64.find(tmp_path, WANTED) is None
    builder = FakeBuilder()
    built = _prepare(tmp_path, builder)
    assert built.path == final and len(builder.builds) == 1
    assert not (final / "stale").exists() and (final / runner.READY).exists()


def test_a_failed_setup_leaves_no_directory(tmp_path):
    with pytest.raises(UsageError, match="network"):
        _prepare(tmp_path, FakeBuilder(fail=True))
    assert [p.name for p in (tmp_path / "aarch64").iterdir()] == [".lock"]
    assert aarch64.find(tmp_path, WANTED) is None


def test_a_runner_for_other_versions_is_not_used(tmp_path):
    _prepare(tmp_path, FakeBuilder())
    assert aarch64.find(tmp_path, {**WANTED, "torch": "2.15.0"}) is None
    assert aarch64.find(tmp_path, WANTED) is not None


def test_offline_with_nothing_cached_is_refused(tmp_path):
    builder = FakeBuilder()
    with pytest.raises(UsageError, match="offline.*arm-setup"):
        aarch64.prepare(tmp_path, builder=builder, wanted=WANTED, offline=True)
    assert builder.builds == []


PYPROJECT = """
[project]
dependencies = [
    "torch==2.14.1",
    "numpy",
]
[project.optional-dependencies]
android = ["executorch==1.5.1"]
jetson = ["onnx>=1.16", "onnxruntime>=1.18"]
"""


def test_the_key_follows_every_pinned_version():
    versions = pins.wanted(PYPROJECT)
    assert versions["torch"] == "2.14.1" and versions["executorch"] == "1.5.1"
    bumped = pins.wanted(PYPROJECT.replace("executorch==1.5.1", "executorch==1.6.0"))
    assert bumped["executorch"] == "1.6.0"
    assert pins.key(versions, "q") != pins.key(bumped, "q")
    assert pins.key(pins.wanted(PYPROJECT.replace("torch==2.14.1", "torch==2.15.0")), "q") != pins.key(versions, "q")
    assert pins.key(versions, "qemu-user=1:10.0.2") != pins.key(versions, "qemu-user-static=1:7.2")
    assert pins.key(versions, "q") == pins.key(dict(reversed(list(versions.items()))), "q")


def test_the_real_pyproject_pins_torch_and_executorch():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    pinned = pins._pins(text)
    assert pinned["torch"] and pinned["executorch"]
    assert pins.wanted(text)["torch"] == pinned["torch"]


def test_arm_setup_refuses_a_host_that_is_not_x86_64(monkeypatch, tmp_path):
    monkeypatch.setattr(runner.platform, "machine", lambda: "aarch64")
    result = CliRunner().invoke(main, ["arm-setup"], env={"EXPORTER_CACHE": str(tmp_path)})
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Linux x86_64" in lines[0], result.output
    assert not (tmp_path / "aarch64").exists()


def test_arm_setup_offline_with_nothing_cached_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["arm-setup", "--offline"], env={"EXPORTER_CACHE": str(tmp_path)})
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "offline" in lines[0] and "exporter arm-setup" in lines[0], result.output


def test_arm_setup_without_a_counting_qemu_still_gives_the_runner(monkeypatch, tmp_path):
    """The runner is cached, the counting qemu is not and cannot be built (offline): the runner is reported, the
    counter's absence is one line with the reason, and the exit is 0 (validation runs without counts)."""
    monkeypatch.delenv("EXPORTER_AARCH64_CACHE", raising=False)
    aarch64.prepare(tmp_path, builder=FakeBuilder(), offline=False)  # for the versions this checkout pins
    result = CliRunner().invoke(main, ["arm-setup", "--offline"], env={"EXPORTER_CACHE": str(tmp_path)})
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("aarch64 runner: ") and str(tmp_path) in lines[0]
    unavailable = [line for line in lines if line.startswith("counting qemu:")]
    assert len(unavailable) == 1 and "unavailable (offline" in unavailable[0], result.output
    assert not [p for p in (tmp_path / "aarch64" / "counter").glob("*") if p.name != ".lock"]
    quiet = CliRunner().invoke(
        main, ["arm-setup", "--offline", "--no-counter", "--json"], env={"EXPORTER_CACHE": str(tmp_path)}
    )
    assert quiet.exit_code == 0 and "counter" not in json.loads(quiet.output)


def test_setting_up_without_root_is_one_line(monkeypatch, tmp_path):
    from exporter.aarch64 import debian

    monkeypatch.setattr(debian.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(debian.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.delenv("EXPORTER_AARCH64_CACHE", raising=False)  # it would put the runner outside tmp_path
    result = CliRunner().invoke(main, ["arm-setup"], env={"EXPORTER_CACHE": str(tmp_path), "EXPORTER_OFFLINE": "0"})
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "root" in lines[0] and "sudo -E exporter arm-setup" in lines[0], result.output
    assert [p.name for p in (tmp_path / "aarch64").iterdir()] == [".lock"]


def test_max_and_unknown_cpus_are_refused():
    assert cpus.check(["cortex-a53", "cortex-a76", "cortex-a53"]) == ["cortex-a53", "cortex-a76"]
    for bad in ("max", "max,sme=off", "cortex-x9"):
        with pytest.raises(UsageError):
            cpus.check([bad])
    with pytest.raises(UsageError, match="does not model"):
        cpus.check(["neoverse-n2"], available=["cortex-a53"])
    assert all(name in cpus.WHY for names in cpus.FOR_TARGET.values() for name in names)


def test_a_stub_library_defines_what_it_is_asked_to(tmp_path):
    """The stub is read back by the same ELF reader that finds what torch's libraries need; readelf agrees."""
    symbols = {
        "cudaMalloc": "libcudart.so.13",
        "cudaFree": "libcudart.so.13",
        "_ZTIN3foo3BarE": None,
        "_ZN3c104cuda9allocatorE": None,
    }
    path = tmp_path / "libcudart.so.13"
    elf.write_stub(path, "libcudart.so.13", symbols, objects={"_ZN3c104cuda9allocatorE": 8})
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and struct.unpack_from("<H", data, 18)[0] == elf.EM_AARCH64
    back = elf.Library(path)
    assert back.defined == set(symbols) and back.needed == [] and back.undefined == {}
    assert set(back.objects) == {"_ZTIN3foo3BarE", "_ZN3c104cuda9allocatorE"}  # the rest are functions
    readelf = subprocess.run(["readelf", "-W", "--dyn-syms", "-V", str(path)], capture_output=True, text=True)
    if readelf.returncode == 0:  # binutils present: it agrees, versions included
        assert "cudaMalloc@@libcudart.so.13" in readelf.stdout and "Warning" not in readelf.stderr, readelf.stderr
        assert "_ZN3c104cuda9allocatorE" in readelf.stdout and "_ZTIN3foo3BarE" in readelf.stdout


def test_the_elf_reader_sees_needed_libraries_and_versions():
    """On the host's own libraries (x86_64, the same ELF64 layout): libc's needs and a versioned import."""
    python = Path(os.path.realpath(sys.executable))
    libs = [p for p in (Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu")) if (p / "libm.so.6").exists()]
    if not libs:
        pytest.skip("no /lib/x86_64-linux-gnu/libm.so.6 here")
    libm = elf.Library(libs[0] / "libm.so.6")
    assert "libc.so.6" in libm.needed and "cos" in libm.defined
    versioned = [v for f, v in libm.undefined.values() if f == "libc.so.6"]
    assert versioned and all(v.startswith("GLIBC_") for v in versioned)
    assert python.exists()


def test_midr_is_read_from_an_emulated_cpuinfo(tmp_path):
    cpuinfo = "processor\t: 0\nCPU implementer\t: 0x41\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n"
    assert sysfs.midr(cpuinfo) == 0x414FD0B1  # Cortex-A76 r4p1
    (tmp_path / "root" / "usr").mkdir(parents=True)
    sysfs.write_prefix(tmp_path / "cpu", tmp_path / "root", 0x414FD0B1, count=2)
    cpu = tmp_path / "cpu" / "sys" / "devices" / "system" / "cpu"
    assert (cpu / "possible").read_text() == "0-1\n"
    assert (cpu / "cpu1" / "regs" / "identification" / "midr_el1").read_text() == "0x00000000414fd0b1\n"
    assert (tmp_path / "cpu" / "usr").resolve() == (tmp_path / "root" / "usr").resolve()


def test_importing_the_package_imports_neither_torch_nor_numpy():
    code = "import sys, exporter.aarch64, exporter.aarch64.execute; print(sorted({'torch','numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


_HOST_INSIDE = """import importlib.util, os, signal, sys, time
with open(os.environ["PROCESS_LOG"], "a") as log:
    log.write(sys.argv[1] + "\\n")
spec = importlib.util.spec_from_file_location("inside", sys.argv[2])
inside = importlib.util.module_from_spec(spec)
spec.loader.exec_module(inside)
lite, onnx = inside.LOADERS[".ptl"], inside.LOADERS[".onnx"]

def ptl(path, threads):
    if "crash" in path:
        os.kill(os.getpid(), signal.SIGSEGV)
    if "hang" in path:
        time.sleep(600)
    return lite(path, threads)

def stray(path, threads):
    os.write(1, b"a native library's line without its newline ")  # on fd 1, as C code would print
    return onnx(path, threads)

inside.LOADERS.update({".ptl": ptl, ".onnx": stray})
sys.argv = sys.argv[2:]
inside.main()
"""


class _HostRunner(aarch64.Runner):
    """inside.py run by this host's Python (the emulator's part taken away), each process logged with its CPU;
    a .ptl whose name says "crash" kills its process, as a kernel fault under qemu would, one that says "hang"
    sleeps past any limit; an ONNX file's loader writes to stdout as native code may."""

    def python(self, cpu, script, *args):
        return [sys.executable, str(self.path / "host_inside.py"), cpu, script, *args]


def _host_runner(tmp_path, monkeypatch):
    (tmp_path / "host_inside.py").write_text(_HOST_INSIDE)
    log = tmp_path / "processes.log"
    monkeypatch.setattr(aarch64.Runner, "environment", staticmethod(lambda: {**os.environ, "PROCESS_LOG": str(log)}))
    return _HostRunner(tmp_path, {"cpus": {"cortex-a53": "", "cortex-a76": ""}}), log


def _models(tmp_path, x, names):
    """A different small model per file (5, 6, 7... outputs), so that one artifact's outputs on another's row show."""
    import torch

    models = {}
    for n, name in enumerate(names):
        torch.manual_seed(n)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5 + n)
        ).eval()
        if name.endswith(".onnx"):
            torch.onnx.export(model, (x[:1],), tmp_path / name, dynamo=False)
        else:
            torch.jit.trace(model, x[:1])._save_for_lite_interpreter(str(tmp_path / name))
        with torch.no_grad():
            models[name] = model(x).numpy()
    return models


def test_one_process_per_cpu_runs_every_artifact_and_one_that_kills_it_is_named(tmp_path, monkeypatch):
    import numpy as np
    import torch

    x = torch.randn(3, 3, 8, 8)
    expected = _models(tmp_path, x, ["good.onnx", "crash.ptl", "good.ptl"])
    (tmp_path / "bad.pte").write_bytes(b"not a program" * 10)
    host, log = _host_runner(tmp_path, monkeypatch)
    artifacts = [tmp_path / n for n in ("good.onnx", "crash.ptl", "bad.pte", "good.ptl")]
    results = aarch64.run(host, artifacts, x.numpy(), ["cortex-a53", "cortex-a76"])

    assert [(r.artifact.name, r.cpu) for r in results] == [
        (a.name, c) for a in artifacts for c in ("cortex-a53", "cortex-a76")
    ]
    for r in results:
        if r.artifact.name.startswith("good"):  # its own outputs, the stray print on stdout notwithstanding
            assert r.ok and np.allclose(r.outputs[0], expected[r.artifact.name], atol=1e-5), (r.artifact, r.error)
            assert r.info["images"] == 3 and r.seconds > 0
        else:
            assert not r.ok and r.error.endswith(f"({r.cpu})"), r
    crash = [r for r in results if r.artifact.name == "crash.ptl"]
    assert all(r.error.startswith("killed by SIGSEGV") for r in crash), crash  # the process it killed, named for it
    assert all(r.error.startswith("RuntimeError") for r in results if r.artifact.name == "bad.pte")
    # per CPU: good.onnx, then crash.ptl ends the process; crash.ptl alone again (a crash may come from what an
    # earlier job left), ending it again: blamed; then bad.pte (an error, not a crash) and good.ptl in a third
    assert log.read_text().split() == ["cortex-a53"] * 3 + ["cortex-a76"] * 3


def test_an_artifact_past_its_time_limit_is_named_and_the_next_runs(tmp_path, monkeypatch):
    import numpy as np
    import torch

    x = torch.randn(2, 3, 8, 8)
    expected = _models(tmp_path, x, ["hang.ptl", "good.ptl"])
    host, log = _host_runner(tmp_path, monkeypatch)
    # the limit covers a job's imports (torch for a .ptl: seconds on a busy host), not the process's start-up
    hang, good = aarch64.run(
        host, [tmp_path / "hang.ptl", tmp_path / "good.ptl"], x.numpy(), ["cortex-a53"], timeout=30
    )
    assert hang.error == "timed out after 30 s under qemu (cortex-a53)", hang.error
    assert hang.timed_out and not good.timed_out  # what the aarch64 rows read (Kind.EMULATOR_TIMEOUT), not the text
    assert good.ok and np.allclose(good.outputs[0], expected["good.ptl"], atol=1e-5), good.error
    assert log.read_text().split() == ["cortex-a53"] * 2  # the hung one first: blamed at once
