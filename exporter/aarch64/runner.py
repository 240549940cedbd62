"""Where the aarch64 runner lives and when it counts as ready: `<cache>/aarch64/<key>/`, complete only with its
READY file, built in a temporary sibling and renamed into place, under a lock.

A set-up killed part way leaves a `.tmp-*` directory (removed by the next set-up) and never a final
directory; a final directory without READY (copied, damaged) is never used and is rebuilt.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Protocol

from .. import files
from ..errors import UsageError
from ..progress import Progress
from . import versions as pins
from .layout import READY, Runner


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where runners live: $EXPORTER_AARCH64_CACHE when set (a runner is large and independent of any build),
    else `<cache>/aarch64`, the cache being `cache_dir`, $EXPORTER_CACHE or ~/.cache/exporter (as the build's)."""
    if cache_dir is None and os.environ.get("EXPORTER_AARCH64_CACHE"):
        return Path(os.environ["EXPORTER_AARCH64_CACHE"])
    base = cache_dir or Path(os.environ.get("EXPORTER_CACHE") or Path.home() / ".cache" / "exporter")
    return Path(base) / "aarch64"


def read_ready(path: Path) -> dict | None:
    try:
        info = json.loads((path / READY).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def find(
    cache_dir: Path | None = None, wanted: dict[str, str] | None = None, root: Path | None = None
) -> Runner | None:
    """The newest complete runner for these package versions (whatever its qemu), or None. Temporary and
    READY-less directories are never returned. `root`: the runners' directory, instead of cache_root(cache_dir)."""
    wanted = pins.wanted() if wanted is None else wanted
    root = Path(root) if root is not None else cache_root(cache_dir)
    found = []
    for path in root.glob("*") if root.is_dir() else []:
        if path.name.startswith(".") or not path.is_dir():
            continue
        info = read_ready(path)
        if info and info.get("packages") == wanted and info.get("layout") == pins.LAYOUT:
            found.append((info.get("finished", 0), path, info))
    if not found:
        return None
    _, path, info = max(found, key=lambda item: item[0])
    return Runner(path, info)


class Builder(Protocol):
    """The set-up steps (the real one: debian.DebianBuilder; tests inject a fake)."""

    def check_host(self) -> None: ...

    def qemu_version(self, progress: Progress) -> str: ...

    def build(self, tmp: Path, wanted: dict[str, str], progress: Progress) -> dict: ...


def check_platform() -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise UsageError(
            f"the aarch64 runner needs a Linux x86_64 host (this is {platform.system()} "
            f"{platform.machine()}); run the aarch64 step on Linux x86_64 CI"
        )


def offline_by_environment() -> bool:
    return os.environ.get("EXPORTER_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def prepare(
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    rebuild: bool = False,
    offline: bool | None = None,
    builder: Builder | None = None,
    wanted: dict[str, str] | None = None,
    clock: Callable[[], float] = time.time,
    root: Path | None = None,
) -> Runner:
    """A ready runner: an existing complete one for these versions, else one built now (in a temporary
    directory, renamed into place when complete). UsageError (one line) when it cannot be."""
    progress = progress or Progress()
    wanted = pins.wanted() if wanted is None else wanted
    offline = offline_by_environment() if offline is None else offline
    check_platform()
    if builder is None:
        from .debian import DebianBuilder

        builder = DebianBuilder()
    root = Path(root) if root is not None else cache_root(cache_dir)
    with files.locked(root / ".lock"):
        for leftover in root.glob(".tmp-*"):  # a set-up killed part way (we hold the lock: none is running)
            progress.note(f"removing an unfinished aarch64 runner set-up: {leftover}")
            shutil.rmtree(leftover, ignore_errors=True)
        existing = None if rebuild else find(cache_dir, wanted, root)
        if existing:
            return existing
        if offline:
            versions = ", ".join(f"{k} {v}" for k, v in wanted.items())
            raise UsageError(
                f"offline, and no aarch64 runner for {versions} is cached in {root}: "
                "run `exporter arm-setup` once with network access"
            )
        builder.check_host()
        qemu = builder.qemu_version(progress)
        final = root / pins.key(wanted, qemu)
        if final.exists():  # without READY (or rebuilding): never used as it is
            progress.note(f"removing an incomplete or replaced aarch64 runner: {final}")
            shutil.rmtree(final)
        info = build_in_place(
            final,
            lambda tmp: builder.build(tmp, wanted, progress),
            clock,
            packages=wanted,
            qemu=qemu,
            layout=pins.LAYOUT,
        )
        return Runner(final, info)


def build_in_place(final: Path, build: Callable[[Path], dict], clock: Callable[[], float], **recorded) -> dict:
    """`build(tmp)` in a temporary sibling of `final`, its answer with `recorded`, the key, time and size written
    to READY last, then the directory renamed to `final`; a build that raises leaves nothing. The caller holds
    the lock and has removed an earlier `final`."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    started = clock()
    try:
        info = build(tmp)
        info.update(
            recorded,
            key=final.name,
            seconds=round(clock() - started, 1),
            finished=clock(),
            size_bytes=tree_size(tmp),
        )
        (tmp / READY).write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def tree_size(path: Path) -> int:
    """Bytes of the files under `path`, links not followed."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            total += os.lstat(os.path.join(folder, name)).st_size
    return total
