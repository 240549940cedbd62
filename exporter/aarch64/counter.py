"""The counting qemu: qemu-aarch64 (linux-user) built with TCG plugins, and our counting plugin (count_plugin.c).

Debian's qemu-user (the runner's) is a static binary, and a static qemu loads no plugin, so this one is built
from the same source package: bookworm-backports' qemu, fetched with `apt-get source --download-only` into a
private apt state (the host's apt is not touched), its upstream tarball (without Debian's patches) configured for
aarch64-linux-user only, `ninja qemu-aarch64`. The plugin is compiled against that tree's qemu-plugin.h.

    <aarch64 cache root>/counter/<key>/{qemu-aarch64, libcount.so, count_plugin.c, READY.json}

The key hashes the source package's version, the plugin's source and LAYOUT. Built in a `.tmp-*` sibling under
a lock, READY.json written last, then renamed into place (as runner.py does). The binary is dynamic (the host's
glib): it runs on the host that built it, not inside a chroot. Building needs a C compiler, ninja, pkg-config and
glib's development files: `exporter arm-setup` installs the missing ones with apt-get (prepare's `install`); a build
gets one line naming what is missing and the command that fixes it (unavailable()), and counts nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import files
from ..errors import UsageError
from ..progress import Progress
from . import versions as pins
from .runner import build_in_place, cache_root, check_platform, offline_by_environment, read_ready

LAYOUT = 1  # bump when the build (configure options, files kept) changes
PLUGIN_SOURCE = Path(__file__).with_name("count_plugin.c")
MARKER = 4242  # the syscall number the plugin reports at (count_plugin.c's MARKER)
MIRROR = os.environ.get("EXPORTER_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SOURCE_PACKAGE = "qemu"
# the +ds tarball lacks the wheels qemu's configure installs into its own venv (shared/NOTES.md)
WHEELS = ("meson==1.5.0", "pycotap==1.3.1")
CONFIGURE = (
    "--target-list=aarch64-linux-user",
    "--enable-plugins",
    "--without-default-features",  # no optional host library (capstone, io_uring, ...): only glib and zlib
    "--disable-system",
    "--disable-tools",
    "--disable-docs",
    "--disable-werror",
    "--disable-install-blobs",
)
# what building needs, and the Debian package that brings it
TOOLS = {"gcc": "gcc", "ninja": "ninja-build", "pkg-config": "pkg-config", "python3": "python3", "apt-get": None}
LIBRARIES = {"glib-2.0": "libglib2.0-dev", "zlib": "zlib1g-dev"}
SETUP_COMMAND = "sudo -E exporter arm-setup"  # -E keeps $EXPORTER_CACHE
WHAT = {  # what each package brings, for a line a person reads
    "gcc": "a C compiler",
    "ninja-build": "ninja",
    "libglib2.0-dev": "glib's development files",
    "zlib1g-dev": "zlib's development files",
    "python3-venv": "Python's venv, for qemu's configure",
}


@dataclass
class Counter:
    """A complete counting qemu: `qemu-aarch64 -plugin libcount.so,out=FILE ...`."""

    path: Path
    info: dict = field(default_factory=dict)

    @property
    def qemu(self) -> Path:
        return self.path / "qemu-aarch64"

    @property
    def plugin(self) -> Path:
        return self.path / "libcount.so"

    @property
    def version(self) -> str:
        return self.info.get("qemu_version", "")

    def plugin_option(self, out: Path) -> list[str]:
        """qemu's option loading the plugin, writing its lines to `out` (no comma: it separates plugin arguments)."""
        if "," in str(self.plugin) or "," in str(out):
            raise UsageError(f"qemu's -plugin option cannot take a path with a comma: {self.plugin} or {out}")
        return ["-plugin", f"{self.plugin},out={out}"]


def plugin_hash(source: str | None = None) -> str:
    source = PLUGIN_SOURCE.read_text() if source is None else source
    return hashlib.sha256(source.encode()).hexdigest()


def key(source_version: str, plugin_source: str | None = None, layout: int = LAYOUT) -> str:
    text = json.dumps(
        {"qemu_source": source_version, "plugin": plugin_hash(plugin_source), "layout": layout}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def counter_root(cache_dir: Path | None = None, root: Path | None = None) -> Path:
    """`<aarch64 cache root>/counter`, or `root` itself when given."""
    return Path(root) if root is not None else cache_root(cache_dir) / "counter"


def find(cache_dir: Path | None = None, root: Path | None = None) -> Counter | None:
    """The newest complete counting qemu built with this plugin source and layout (whatever qemu version), or None.
    Temporary and READY-less directories are never returned."""
    root = counter_root(cache_dir, root)
    found = []
    for path in root.glob("*") if root.is_dir() else []:
        if path.name.startswith(".") or not path.is_dir():
            continue
        info = read_ready(path)
        if info and info.get("layout") == LAYOUT and info.get("plugin_sha256") == plugin_hash():
            if (path / "qemu-aarch64").is_file() and (path / "libcount.so").is_file():
                found.append((info.get("finished", 0), path, info))
    if not found:
        return None
    _, path, info = max(found, key=lambda item: item[0])
    return Counter(path, info)


def missing_prerequisites(
    which: Callable[[str], str | None] = shutil.which, has_library=None, has_venv=None
) -> list[str]:
    """The Debian packages to install before the counting qemu can be built here ([] when none)."""
    has_library = has_library or _has_library
    has_venv = has_venv or _has_venv
    packages = []
    for tool, package in TOOLS.items():
        if not which(tool):
            if package is None:
                raise UsageError(
                    f"the counting qemu is built from Debian's qemu source package ('{tool}' is missing) with gcc, "
                    "ninja, pkg-config and glib's and zlib's development files: run `exporter arm-setup` on a Debian "
                    "or Ubuntu x86_64 host"
                )
            packages.append(package)
    if "pkg-config" not in packages:
        packages += [package for library, package in LIBRARIES.items() if not has_library(library)]
    else:  # cannot tell without pkg-config: name them all (installing one already there is harmless)
        packages += LIBRARIES.values()
    if not has_venv():  # qemu's configure makes a venv of the `python3` on PATH and installs meson into it
        packages.append("python3-venv")
    return packages


def setup_command() -> str:
    """The command that installs what is missing and builds the counting qemu, as this user types it."""
    return "exporter arm-setup" if os.geteuid() == 0 else SETUP_COMMAND


def describe(packages: list[str]) -> str:
    """The Debian packages, each with what it brings: `libglib2.0-dev (glib's development files)`."""
    return ", ".join(f"{p} ({WHAT[p]})" if p in WHAT else p for p in packages)


def apt_install(packages: list[str]) -> None:
    """`apt-get install` of `packages` on this host, as root; UsageError (one line) when it cannot be done."""
    if os.geteuid() != 0:
        raise UsageError(
            f"the counting qemu is built with {describe(packages)}; installing them needs root: run "
            f"`sudo apt-get install -y {' '.join(packages)}` or `{SETUP_COMMAND}`"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "-q", "update"], "apt-get update", timeout=600, env=env)
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    _run(command, f"apt-get install {' '.join(packages)}", timeout=1800, env=env)


def install_prerequisites(
    progress: Progress,
    missing: Callable[[], list[str]] | None = None,
    install: Callable[[list[str]], None] = apt_install,
) -> list[str]:
    """Install what building the counting qemu needs and this host lacks: the packages installed ([] when nothing
    was missing). UsageError (one line) when they cannot be, or are still missing after."""
    missing = missing or missing_prerequisites
    packages = missing()
    if not packages:
        return []
    with progress.step(f"counter: apt-get install {' '.join(packages)} (what the counting qemu is built with)"):
        install(packages)
    left = missing()
    if left:
        raise UsageError(f"apt-get installed {' '.join(packages)}, and these are still missing: {describe(left)}")
    return packages


def unavailable(
    cache_dir: Path | None = None,
    offline: bool | None = None,
    root: Path | None = None,
    missing: Callable[[], list[str]] | None = None,
) -> str | None:
    """Why a build here can take no instruction counts, in one line (what is missing, the command that fixes it), or
    None: a counting qemu is built, or the build can build one (prepare, a few minutes)."""
    root = counter_root(cache_dir, root)
    if find(root=root) is not None:
        return None
    if offline_by_environment() if offline is None else offline:
        return f"offline, and no counting qemu is built in {root}: run `exporter arm-setup` once with network access"
    try:
        packages = (missing or missing_prerequisites)()
    except UsageError as e:  # not a Debian host
        return str(e)
    if not packages:
        return None
    return (
        f"no counting qemu is built, and building it needs {describe(packages)}: run `{setup_command()}` "
        f"(installs them and builds it), or `apt-get install -y {' '.join(packages)}`"
    )


def _has_library(name: str) -> bool:
    return subprocess.run(["pkg-config", "--exists", name], capture_output=True).returncode == 0


def _has_venv() -> bool:
    try:
        done = subprocess.run(["python3", "-c", "import venv, ensurepip"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def check_host() -> None:
    packages = missing_prerequisites()
    if packages:
        raise UsageError(
            f"building the counting qemu needs {describe(packages)}: run `{setup_command()}` (installs them), or "
            f"`apt-get install -y {' '.join(packages)}`"
        )


def _run(command: list, what: str, cwd: Path | None = None, timeout: float = 1800, env: dict | None = None) -> str:
    """Run a build step; on failure one line: the step and its first error line (else its last line)."""
    try:
        result = subprocess.run(
            [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
        )
    except FileNotFoundError:
        raise UsageError(f"{what}: {command[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"{what}: timed out after {timeout:.0f} s") from None
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stdout + "\n" + result.stderr).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:") or "error:" in line]
        reason = (errors or lines or ["(no output)"])[0 if errors else -1]
        raise UsageError(f"{what} failed: {reason[:300]}")
    return result.stdout


class _Apt:
    """A private apt state with bookworm-backports' `deb` and `deb-src` lines only."""

    def __init__(self, where: Path, mirror: str = MIRROR):
        self.dir = where
        for sub in ("lists/partial", "cache/archives/partial"):
            (where / sub).mkdir(parents=True, exist_ok=True)
        suite = f"{mirror} {pins.SUITE}-backports main"
        (where / "sources.list").write_text(f"deb {suite}\ndeb-src {suite}\n")

    def options(self) -> list[str]:
        return [
            "-o",
            f"Dir::Etc::SourceList={self.dir / 'sources.list'}",
            "-o",
            "Dir::Etc::SourceParts=/dev/null",
            "-o",
            f"Dir::State::Lists={self.dir / 'lists'}",
            "-o",
            f"Dir::Cache={self.dir / 'cache'}",
            "-o",
            "APT::Sandbox::User=root",
        ]

    def update(self) -> None:
        _run(["apt-get", "-q", *self.options(), "update"], "apt-get update (bookworm-backports sources)", timeout=300)

    def source_version(self, package: str = SOURCE_PACKAGE) -> str:
        out = _run(["apt-cache", *self.options(), "showsrc", package], f"apt-cache showsrc {package}", timeout=60)
        return newest_source_version(out, package)

    def download_source(self, package: str, version: str, into: Path) -> Path:
        """The upstream tarball of `package=version` (its .dsc and Debian tarball come along, unused)."""
        into.mkdir(parents=True, exist_ok=True)
        try:
            _run(
                ["apt-get", "-q", *self.options(), "source", "--download-only", f"{package}={version}"],
                f"apt-get source --download-only {package}={version}",
                cwd=into,
                timeout=1800,
            )
        except UsageError:
            # Some mirrors (seen on deb.debian.org through this workplace's proxy, 2026-12-04) serve the upstream
            # tarball but answer 404 for the .dsc and Debian tarball, which nothing here uses: apt has checked the
            # tarball against the signed Sources index before keeping it, so it is used when it arrived.
            if not sorted(into.glob(f"{package}_*.orig.tar.*")):
                raise
        tarballs = sorted(into.glob(f"{package}_*.orig.tar.*"))
        if not tarballs:
            raise UsageError(f"apt-get source {package}={version}: no .orig tarball downloaded")
        return tarballs[-1]


def newest_source_version(showsrc: str, package: str = SOURCE_PACKAGE) -> str:
    """The highest Version of `package` in `apt-cache showsrc` output (compared by dpkg when present)."""
    versions, current = [], None
    for line in showsrc.splitlines():
        if line.startswith("Package:"):
            current = line.split(":", 1)[1].strip()
        elif line.startswith("Version:") and current == package:
            versions.append(line.split(":", 1)[1].strip())
    if not versions:
        raise UsageError(f"no source package '{package}' in bookworm-backports (apt-cache showsrc found none)")
    best = versions[0]
    for version in versions[1:]:
        if shutil.which("dpkg"):
            newer = subprocess.run(["dpkg", "--compare-versions", version, "gt", best], capture_output=True)
            if newer.returncode == 0:
                best = version
        elif version > best:
            best = version
    return best


def _extract(tarball: Path, into: Path) -> Path:
    """The tarball's one top directory, extracted by Python's tarfile (no dpkg-source needed)."""
    import tarfile

    with tarfile.open(tarball) as archive:
        tops = {member.name.split("/", 1)[0] for member in archive.getmembers()}
        if len(tops) != 1:
            raise UsageError(f"{tarball.name}: expected one top directory, found {len(tops)}")
        if hasattr(tarfile, "data_filter"):
            archive.extractall(into, filter="data")
        else:  # Python without extraction filters: the archive comes from Debian's signed sources
            archive.extractall(into)
    return into / tops.pop()


def tiny_elf() -> bytes:
    """A static aarch64 Linux program of six instructions, for the smoke test: marker 4242 with tag 7, then exit(0).
    The plugin must report the marker at 3 instructions and a total of 6."""
    import struct

    def movz(register: int, value: int) -> int:  # MOVZ Xd, #imm16
        return 0xD2800000 | (value << 5) | register

    svc = 0xD4000001
    code = struct.pack("<6I", movz(8, MARKER), movz(0, 7), svc, movz(8, 93), movz(0, 0), svc)  # 93: exit
    base, header = 0x400000, 64 + 56
    elf = struct.pack(
        "<4sBBBB8xHHIQQQIHHHHHH",
        b"\x7fELF",
        2,  # 64-bit
        1,  # little-endian
        1,  # ELF version
        0,  # System V ABI
        2,  # executable
        183,  # AArch64
        1,
        base + header,  # entry: the code after the headers
        64,  # program headers right after this one
        0,
        0,
        64,
        56,
        1,
        0,
        0,
        0,
    )
    size = header + len(code)
    segment = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000)  # PT_LOAD, R+X, the whole file
    return elf + segment + code


def read_lines(text: str) -> list[dict]:
    """The plugin's lines: {"kind": "marker", "pid", "vcpu", "tag", "count"} or {"kind": "total", "pid", "count"};
    anything else is ignored."""
    lines = []
    for line in text.splitlines():
        words = line.split()
        try:
            if len(words) == 5 and words[0] == "marker":
                pid, vcpu, tag, count = (int(w) for w in words[1:])
                lines.append({"kind": "marker", "pid": pid, "vcpu": vcpu, "tag": tag, "count": count})
            elif len(words) == 3 and words[0] == "total":
                lines.append({"kind": "total", "pid": int(words[1]), "count": int(words[2])})
        except ValueError:
            continue
    return lines


def smoke(qemu: Path, plugin: Path, work: Path) -> dict:
    """Run tiny_elf() under the counting qemu: the exact counts it must give."""
    program, out = work / "tiny", work / "tiny.counts"
    program.write_bytes(tiny_elf())
    program.chmod(0o755)
    _run([qemu, "-plugin", f"{plugin},out={out}", program], "the counting qemu's smoke test", timeout=60)
    lines = read_lines(out.read_text() if out.exists() else "")
    markers = [(line["tag"], line["count"]) for line in lines if line["kind"] == "marker"]
    totals = [line["count"] for line in lines if line["kind"] == "total"]
    if markers != [(7, 3)] or totals != [6]:
        raise UsageError(
            f"the counting qemu counts wrong: markers {markers} (expected [(7, 3)]), totals {totals} ([6])"
        )
    return {"marker_at": 3, "total": 6}


def _pip(*args) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir", *args]


def build(tmp: Path, apt: _Apt, source_version: str, progress: Progress) -> dict:
    """Everything into `tmp` (the qemu tree in tmp/.work, removed at the end)."""
    work = tmp / ".work"
    work.mkdir()
    with progress.step(f"counter: qemu source {source_version} (apt-get source, ~40 MB)"):
        tarball = apt.download_source(SOURCE_PACKAGE, source_version, work / "download")
        src = _extract(tarball, work)
        shutil.rmtree(work / "download")
        wheels = src / "python" / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        _run(_pip("download", "-q", "--no-deps", "-d", wheels, *WHEELS), "pip download " + " ".join(WHEELS))
    with progress.step("counter: configure qemu (aarch64-linux-user, plugins)"):
        _run(["./configure", *CONFIGURE], "qemu's configure", cwd=src, timeout=900)
    with progress.step("counter: ninja qemu-aarch64 (a few minutes on 2 cores)"):
        _run(["ninja", "-C", "build", "qemu-aarch64"], "ninja qemu-aarch64", cwd=src, timeout=7200)
        shutil.copy(src / "build" / "qemu-aarch64", tmp / "qemu-aarch64")
        (tmp / "qemu-aarch64").chmod(0o755)
    with progress.step("counter: the counting plugin (gcc)"):
        glib = _run(["pkg-config", "--cflags", "glib-2.0"], "pkg-config --cflags glib-2.0").split()
        shutil.copy(PLUGIN_SOURCE, tmp / PLUGIN_SOURCE.name)
        _run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                "-O2",
                "-Wall",
                "-I",
                src / "include" / "qemu",
                *glib,
                tmp / PLUGIN_SOURCE.name,
                "-o",
                tmp / "libcount.so",
            ],
            "gcc (the counting plugin)",
        )
    shutil.rmtree(work)
    with progress.step("counter: smoke test (a six-instruction program, counted exactly)"):
        check = Path(tempfile.mkdtemp(prefix="exporter-counter-"))
        try:
            counted = smoke(tmp / "qemu-aarch64", tmp / "libcount.so", check)
        finally:
            shutil.rmtree(check, ignore_errors=True)
    version = _run([tmp / "qemu-aarch64", "--version"], "qemu-aarch64 --version").splitlines()[0]
    return {"qemu_version": version, "smoke": counted}


def prepare(
    progress: Progress | None = None,
    rebuild: bool = False,
    cache_dir: Path | None = None,
    offline: bool | None = None,
    root: Path | None = None,
    clock: Callable[[], float] = time.time,
    install: Callable[[list[str]], None] | None = None,
) -> Counter:
    """A ready counting qemu: an existing complete one (this plugin source, this layout), else one built now in a
    temporary directory renamed into place when complete. UsageError (one line) when it cannot be.
    install: what installs the missing build prerequisites (arm-setup: apt_install), under the lock, before building;
    None (a build): a host that lacks one is refused in one line."""
    progress = progress or Progress()
    offline = offline_by_environment() if offline is None else offline
    check_platform()
    root = counter_root(cache_dir, root)
    with files.locked(root / ".lock"):
        for leftover in root.glob(".tmp-*"):  # a build killed part way (we hold the lock: none is running)
            progress.note(f"removing an unfinished counting qemu build: {leftover}")
            shutil.rmtree(leftover, ignore_errors=True)
        existing = None if rebuild else find(root=root)
        if existing:
            return existing
        if offline:
            raise UsageError(f"offline, and no counting qemu is built in {root}: build it once with network access")
        if install is not None:
            install_prerequisites(progress, install=install)
        check_host()
        apt_dir = Path(tempfile.mkdtemp(prefix="exporter-apt-"))
        try:
            apt = _Apt(apt_dir)
            with progress.step("counter: find qemu's source package (bookworm-backports)"):
                apt.update()
                source_version = apt.source_version()
            final = root / key(source_version)
            if final.exists():  # without READY, or rebuilding: never used as it is
                progress.note(f"removing an incomplete or replaced counting qemu: {final}")
                shutil.rmtree(final)
            info = build_in_place(
                final,
                lambda tmp: build(tmp, apt, source_version, progress),
                clock,
                qemu_source=f"{SOURCE_PACKAGE}={source_version}",
                configure=list(CONFIGURE),
                plugin_sha256=plugin_hash(),
                layout=LAYOUT,
            )
        finally:
            shutil.rmtree(apt_dir, ignore_errors=True)
        return Counter(final, info)
