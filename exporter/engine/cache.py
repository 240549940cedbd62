"""Content-addressed build cache: artifacts, validation results and the eager reference.

A key is the sha256 of everything that decides the result (checkpoint hash, format, precision,
options, calibration and validation inputs, tool versions, ...). An entry is trusted only if its
files still match the sha256 recorded when it was stored; a corrupt entry is dropped and rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .. import files
from ..errors import UsageError
from ..results import jsonable

if TYPE_CHECKING:
    import torch


PACKAGE = Path(__file__).resolve().parents[1]  # the whole exporter package
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full(error: OSError) -> bool:
    if isinstance(error, shutil.Error):  # copytree (a .mlpackage) gathers its files' errors, without an errno
        return any(os.strerror(code) in str(error) for code in DISK_FULL)
    return error.errno in DISK_FULL


def disk_full(error: BaseException) -> bool:
    """Whether `error` is a full disk (or quota): the host's, not a finding about what was being written."""
    return isinstance(error, OSError) and _disk_full(error)


def default_root() -> Path:
    root = Path(os.environ.get("EXPORTER_CACHE") or Path.home() / ".cache" / "exporter")
    if root.exists() and not root.is_dir():
        raise UsageError(
            f"the exporter's cache {root} ($EXPORTER_CACHE or ~/.cache/exporter) is a file, not a directory"
        )
    return root


def source_digest() -> str:
    """The exporter package's own code: every cached step and whole build is keyed on it, so a fix to an exporter
    or a metric is never answered with what the code before it made (a Q/DQ artifact came back from the cache
    unchanged after the search learned to quantize every call of a shared head). Read afresh at every call: a
    build record compares it before and after the build (code edited while it ran)."""
    h = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".json") and p.is_file()):
        h.update(f"{path.relative_to(PACKAGE).as_posix()}\0{files.sha256(path)}\n".encode())
    return h.hexdigest()


def key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def tensors_digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


class BuildCache:
    def __init__(self, root: Path | None):
        self.root = Path(root) if root else None
        self.events: list[str] = []  # what was reused, stored or found corrupt, for the manifest

    def _entry(self, kind: str, digest: str) -> Path:
        return self.root / kind / digest[:2] / digest

    def _drop(self, entry: Path, why: str) -> None:
        self.events.append(f"corrupt cache entry {entry.name[:12]} dropped ({why}); rebuilt")
        shutil.rmtree(entry, ignore_errors=True)

    @contextlib.contextmanager
    def unless_disk_full(self, what: str):
        """A store that finds the disk full is given up, not the build: the cache only saves work, and what was
        made stands (a 2.6 GB .ptl, written, was reported failed when its copy into a full cache failed). The
        manifest's cache events say what was not kept."""
        try:
            yield
        except OSError as e:
            if not _disk_full(e):
                raise
            self.events.append(f"{what} not cached: {e.strerror or os.strerror(errno.ENOSPC)} ({self.root})")

    def _record(self, entry: Path):
        try:
            return json.loads((entry / "entry.json").read_text())
        except (OSError, ValueError):
            return None

    def fetch_artifact(self, digest: str, target: Path) -> dict | None:
        """Copy a cached artifact to `target` (a temporary path); its details, or None on a miss."""
        if self.root is None:
            return None
        entry = self._entry("artifacts", digest)
        if not entry.exists():
            return None
        record = self._record(entry)
        stored = entry / "artifact"
        if record is None or not stored.exists() or files.sha256(stored) != record.get("sha256"):
            self._drop(entry, "content does not match its recorded sha256")
            return None
        files.copy(stored, target)
        return record["details"]

    def store_artifact(self, digest: str, path: Path, details: dict) -> None:
        if self.root is None:
            return
        entry = self._entry("artifacts", digest)
        with self.unless_disk_full(path.name):
            entry.parent.mkdir(parents=True, exist_ok=True)
            with files.atomic_path(entry) as staging:
                staging.mkdir()
                files.copy(path, staging / "artifact")
                record = {"sha256": files.sha256(staging / "artifact"), "details": jsonable(details)}
                (staging / "entry.json").write_text(json.dumps(record))

    def fetch_json(self, kind: str, digest: str) -> dict | None:
        if self.root is None:
            return None
        entry = self._entry(kind, digest)
        if not entry.exists():
            return None
        record = self._record(entry)
        body = json.dumps(record.get("value") if record else None, sort_keys=True)
        if record is None or hashlib.sha256(body.encode()).hexdigest() != record.get("sha256"):
            self._drop(entry, "record does not match its sha256")
            return None
        return record["value"]

    def store_json(self, kind: str, digest: str, value, plain: bool = False) -> None:
        """Store `value` as JSON (its Reason values as their records, results.jsonable, unless `plain`: numbers
        and lists alone, as a tensor's)."""
        if self.root is None:
            return
        entry = self._entry(kind, digest)
        value = value if plain else jsonable(value)
        body = json.dumps(value, sort_keys=True)
        with self.unless_disk_full(f"a {kind} record"):
            entry.parent.mkdir(parents=True, exist_ok=True)
            with files.atomic_path(entry) as staging:
                staging.mkdir()
                (staging / "entry.json").write_text(
                    json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "value": value})
                )

    def fetch_tensor(self, digest: str) -> torch.Tensor | None:
        import torch  # not at the top: a re-run served whole from the cache never imports torch

        value = self.fetch_json("tensors", digest)
        return torch.tensor(value) if value is not None else None

    def store_tensor(self, digest: str, tensor: torch.Tensor) -> None:
        self.store_json("tensors", digest, tensor.tolist(), plain=True)
