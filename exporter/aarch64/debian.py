"""The real set-up of the aarch64 runner on a Debian/Ubuntu x86_64 host, with no system-wide change.

- qemu-user: `apt-get download` into a private apt state (bookworm-backports' qemu 10 when reachable, else
  the host's own qemu-user-static), `dpkg-deb -x`, keep the static qemu-aarch64 binary.
- the arm64 root: debootstrap's first stage (`--foreign --variant=minbase --include=python3`; debootstrap
  itself `apt-get download`ed when not installed), then every fetched package unpacked with `dpkg-deb -x`:
  no second stage, so no chroot and no arm64 code runs while building.
- the aarch64 wheels: `pip download/install --no-deps --platform manylinux…_aarch64 --target root/opt/site`,
  CUDA cut out of torch (slim.py), byte-compiled.
- one `-L` prefix per CPU model qemu lists (sysfs.py), and a smoke test inside (inside.py --check).
Needs root once (debootstrap creates device nodes); a run needs none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from . import slim, sysfs
from . import versions as pins

MIRROR = os.environ.get("EXPORTER_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BACKPORTS = f"deb {MIRROR} {pins.SUITE}-backports main"
PLATFORMS = ["manylinux2014_aarch64"] + [f"manylinux_2_{minor}_aarch64" for minor in range(17, 37)]
INSIDE = Path(__file__).with_name("inside.py")
SKIP_CPUS = {"max", "a64fx"}  # max: no real core (and wrong int8 in qemu 7.2); a64fx: 512-bit SVE HPC


def _run(command: list, what: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 1800) -> str:
    try:
        result = subprocess.run(
            [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        raise UsageError(f"{what}: {command[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"{what}: timed out after {timeout:.0f} s") from None
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise UsageError(f"{what} failed: {tail[0][:300]}")
    return result.stdout


class DebianBuilder:
    def __init__(self, mirror: str = MIRROR):
        self.mirror = mirror
        self._apt_dir: Path | None = None
        self._qemu: tuple[str, str] | None = None  # (package, version)

    # -- host ------------------------------------------------------------------------------------------
    def check_host(self) -> None:
        for tool in ("apt-get", "apt-cache", "dpkg-deb"):
            if not shutil.which(tool):
                raise UsageError(
                    f"the aarch64 runner is set up with Debian's tools and '{tool}' is missing: "
                    "run `exporter arm-setup` on a Debian or Ubuntu x86_64 host"
                )
        if os.geteuid() != 0:
            raise UsageError(
                "setting up the aarch64 runner needs root once (debootstrap creates device nodes): "
                "run `sudo -E exporter arm-setup` (keeps $EXPORTER_CACHE); later runs need no root"
            )
        if not shutil.which("wget"):
            raise UsageError("debootstrap needs wget: apt-get install wget, then run `exporter arm-setup` again")

    def _options(self, private: bool) -> list[str]:
        """apt options for the private state (bookworm-backports only; the host's apt is not touched)."""
        if not private:
            return []
        d = self._apt_dir
        return [
            "-o",
            f"Dir::Etc::SourceList={d / 'sources.list'}",
            "-o",
            "Dir::Etc::SourceParts=/dev/null",
            "-o",
            f"Dir::State::Lists={d / 'lists'}",
            "-o",
            f"Dir::Cache={d / 'cache'}",
            "-o",
            "APT::Sandbox::User=root",
        ]

    def _apt(self, *args: str, private: bool = True) -> list[str]:
        return ["apt-get", "-q", *self._options(private), *args]

    def qemu_version(self, progress: Progress) -> str:
        """Which qemu-user the runner gets: bookworm-backports' (qemu 10) when reachable, else the host's
        apt sources' qemu-user-static (7.2 on bookworm: named CPUs only, never max)."""
        self._apt_dir = Path(tempfile.mkdtemp(prefix="exporter-apt-"))
        for sub in ("lists/partial", "cache/archives/partial"):
            (self._apt_dir / sub).mkdir(parents=True)
        (self._apt_dir / "sources.list").write_text(BACKPORTS + "\n")
        with progress.step("aarch64: find qemu-user (bookworm-backports, else the host's apt sources)"):
            try:
                _run(self._apt("update"), "apt-get update (bookworm-backports)", timeout=300)
                version = self._candidate("qemu-user", private=True)
                if version:
                    self._qemu = ("qemu-user", version)
            except UsageError:
                pass
            if self._qemu is None:
                version = self._candidate("qemu-user-static", private=False)
                if not version:
                    raise UsageError(
                        "no qemu-user package reachable (offline, or no Debian/Ubuntu apt sources) and "
                        "no aarch64 runner cached: connect to a Debian mirror and run `exporter arm-setup`"
                    )
                self._qemu = ("qemu-user-static", version)
        return f"{self._qemu[0]}={self._qemu[1]}"

    def _candidate(self, package: str, private: bool) -> str | None:
        try:
            out = _run(
                ["apt-cache", *self._options(private), "policy", package], f"apt-cache policy {package}", timeout=60
            )
        except UsageError:
            return None
        for line in out.splitlines():
            if line.strip().startswith("Candidate:"):
                value = line.split(":", 1)[1].strip()
                return None if value == "(none)" else value
        return None

    # -- build -----------------------------------------------------------------------------------------
    def build(self, tmp: Path, wanted: dict[str, str], progress: Progress) -> dict:
        try:
            info = {"qemu_package": self._qemu[0]}
            work = tmp / ".work"
            work.mkdir()
            with progress.step(f"aarch64: qemu-user ({self._qemu[0]} {self._qemu[1]})"):
                info["qemu_version"] = self._get_qemu(tmp, work)
            with progress.step(
                f"aarch64: arm64 Debian {pins.SUITE} root with Python {pins.PYTHON} (debootstrap, ~1 min)"
            ):
                self._root(tmp / "root", work)
            with progress.step("aarch64: aarch64 wheels (" + ", ".join(f"{k} {v}" for k, v in wanted.items()) + ")"):
                info["support"] = self._wheels(tmp / "root" / "opt" / "site", wanted, work)
            with progress.step("aarch64: cut CUDA out of torch (stub libraries instead of the nvidia wheels)"):
                info["slim"] = slim.slim(tmp / "root", tmp / "root" / "opt" / "site")
                shutil.rmtree(tmp / "root" / "opt" / "site" / "torch" / "include", ignore_errors=True)
                self._compile(tmp / "root" / "opt" / "site")
                (tmp / "root" / "opt" / "exporter").mkdir(parents=True)
                shutil.copy(INSIDE, tmp / "root" / "opt" / "exporter" / "inside.py")
            with progress.step("aarch64: one sysfs per CPU model"):
                info["cpus"] = self._cpus(tmp)
            shutil.rmtree(work)
            with progress.step("aarch64: smoke test inside (torch, ExecuTorch with XNNPACK, ONNX Runtime; ~1 min)"):
                info["check"] = self._smoke(tmp, info["cpus"])
            return info
        finally:
            if self._apt_dir:
                shutil.rmtree(self._apt_dir, ignore_errors=True)

    def _download(self, package: str, version: str, into: Path, private: bool) -> Path:
        into.mkdir(parents=True, exist_ok=True)
        _run(
            self._apt("download", f"{package}={version}", private=private),
            f"apt-get download {package}",
            cwd=into,
            timeout=900,
        )
        debs = sorted(into.glob(f"{package}_*.deb"))
        if not debs:
            raise UsageError(f"apt-get download {package}: no .deb written")
        return debs[-1]

    def _get_qemu(self, tmp: Path, work: Path) -> str:
        """The one static binary out of the package (qemu-user unpacks to 370 MB of emulators)."""
        import tarfile

        package, version = self._qemu
        deb = self._download(package, version, work / "debs", private=package == "qemu-user")
        wanted = {"./usr/bin/qemu-aarch64", "./usr/bin/qemu-aarch64-static"}
        # stops reading once the binary is out: dpkg-deb then dies of a broken pipe, quietly
        with subprocess.Popen(
            ["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        ) as unpack:
            with tarfile.open(fileobj=unpack.stdout, mode="r|") as archive:
                for member in archive:
                    if member.name in wanted and member.isfile():
                        with archive.extractfile(member) as source, open(tmp / "qemu-aarch64", "wb") as target:
                            shutil.copyfileobj(source, target)
                        break
            unpack.stdout.close()
        if not (tmp / "qemu-aarch64").exists():
            raise UsageError(f"{package} {version} has no qemu-aarch64 binary")
        (tmp / "qemu-aarch64").chmod(0o755)
        out = _run([tmp / "qemu-aarch64", "--version"], "qemu-aarch64 --version (is it a static binary?)")
        return out.splitlines()[0]

    def _debootstrap(self, work: Path) -> tuple[list[str], dict]:
        env = dict(os.environ)
        if shutil.which("debootstrap"):
            return ["debootstrap"], env
        version = self._candidate("debootstrap", private=False)
        if version is None:
            raise UsageError("debootstrap is neither installed nor downloadable: apt-get install debootstrap")
        deb = self._download("debootstrap", version, work / "debs", private=False)
        _run(["dpkg-deb", "-x", deb, work / "debootstrap"], "dpkg-deb -x debootstrap")
        env["DEBOOTSTRAP_DIR"] = str(work / "debootstrap" / "usr" / "share" / "debootstrap")
        return [str(work / "debootstrap" / "usr" / "sbin" / "debootstrap")], env

    def _root(self, root: Path, work: Path) -> None:
        command, env = self._debootstrap(work)
        _run(
            [
                *command,
                "--foreign",
                "--arch=arm64",
                "--variant=minbase",
                "--include=python3",
                pins.SUITE,
                root,
                self.mirror,
            ],
            "debootstrap (arm64 root)",
            env=env,
            timeout=1800,
        )
        archives = root / "var" / "cache" / "apt" / "archives"
        debs = sorted(archives.glob("*.deb"))
        if not any(d.name.startswith("python3.11_") or d.name.startswith("python3.11-minimal_") for d in debs):
            raise UsageError("debootstrap fetched no python3.11 for arm64")
        for deb in debs:  # the second stage, without running anything: unpack every package
            _run(["dpkg-deb", "-x", deb, root], f"dpkg-deb -x {deb.name}")
            deb.unlink()
        shutil.rmtree(root / "debootstrap", ignore_errors=True)
        for unused in ("doc", "man", "info", "locale"):  # 50 MB nothing here reads
            shutil.rmtree(root / "usr" / "share" / unused, ignore_errors=True)
        if not (root / "usr" / "bin" / "python3").exists():
            raise UsageError("the arm64 root has no /usr/bin/python3 after unpacking")

    def _pip(self, *args) -> list[str]:
        # no pip cache: it would keep a second copy of every wheel (0.5 GB) in ~/.cache/pip
        return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir", *args]

    def _wheels(self, site: Path, wanted: dict[str, str], work: Path) -> dict:
        cache = work / "wheels"  # removed with the work directory: the runner holds them installed
        cache.mkdir(exist_ok=True)
        tags = [a for p in PLATFORMS for a in ("--platform", p)]
        common = ["--only-binary=:all:", "--no-deps", "--python-version", pins.PYTHON, "--implementation", "cp", *tags]
        requirements = [f"{k}=={v}" for k, v in wanted.items()]
        support = {}
        for name, version in pins.support().items():
            pinned = f"{name}=={version}" if version else name
            try:  # the host's version when it has an aarch64 or pure wheel, else the newest that has
                _run(self._pip("download", "-q", "-d", cache, *common, pinned), f"pip download {pinned}", timeout=900)
                support[name] = version
            except UsageError:
                _run(self._pip("download", "-q", "-d", cache, *common, name), f"pip download {name}", timeout=900)
                support[name] = None
            requirements.append(pinned if support[name] else name)
        _run(
            self._pip("download", "-q", "-d", cache, *common, *[f"{k}=={v}" for k, v in wanted.items()]),
            "pip download (aarch64 wheels; offline?)",
            timeout=1800,
        )
        _run(
            self._pip(
                "install",
                "-q",
                "--no-index",
                "--find-links",
                cache,
                "--target",
                site,
                "--no-compile",
                *common,
                *requirements,
            ),
            "pip install --target (aarch64 wheels)",
            timeout=1800,
        )
        return support

    def _compile(self, site: Path) -> None:
        """Byte code for the guest's Python 3.11 (imports under emulation are slow: torch's 30 s instead of
        55 s); written by the host's Python when it is 3.11 (the same byte code), else left to the guest."""
        if sys.version_info[:2] == tuple(int(x) for x in pins.PYTHON.split(".")):
            subprocess.run(
                [sys.executable, "-m", "compileall", "-q", "-j", "2", str(site)], capture_output=True, timeout=1800
            )

    def _cpus(self, tmp: Path) -> dict:
        out = subprocess.run([tmp / "qemu-aarch64", "-cpu", "help"], capture_output=True, text=True).stdout
        names = [w for line in out.splitlines()[1:] for w in line.split() if w not in SKIP_CPUS]
        cpus = {}
        for name in names:
            cpuinfo = subprocess.run(
                [
                    tmp / "qemu-aarch64",
                    "-cpu",
                    name,
                    "-L",
                    tmp / "root",
                    tmp / "root" / "usr" / "bin" / "cat",
                    "/proc/cpuinfo",
                ],
                capture_output=True,
                text=True,
                env={"PATH": "/usr/bin:/bin"},
            ).stdout
            try:
                midr = sysfs.midr(cpuinfo)
            except (KeyError, ValueError):
                continue  # this qemu emulates no /proc/cpuinfo for the model: it cannot be told apart
            sysfs.write_prefix(tmp / "cpus" / name, tmp / "root", midr)
            cpus[name] = f"0x{midr:08x}"
        if not cpus:
            raise UsageError("qemu-aarch64 reports no usable named CPU (no emulated /proc/cpuinfo?)")
        return cpus

    def _smoke(self, tmp: Path, cpus: dict) -> dict:
        import json

        from .layout import Runner

        runner = Runner(tmp, {"cpus": cpus})
        cpu = "cortex-a53" if "cortex-a53" in cpus else next(iter(cpus))
        result = subprocess.run(
            runner.python(cpu, "/opt/exporter/inside.py", "--check"),
            capture_output=True,
            text=True,
            env=Runner.environment(),
            timeout=900,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        if result.returncode != 0 or not lines:
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise UsageError(f"the aarch64 runner does not start ({cpu}): {tail[:300]}")
        return json.loads(lines[-1])
