"""Atomic writes: a reader never sees a half-written file."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: Path):
    """Yield a temporary path beside `final`; rename it into place only on success."""
    final = Path(final)
    # keep the real suffix last: some writers (coremltools) insist on it
    fd, tmp = tempfile.mkstemp(prefix=f".{final.stem}.", suffix=f".partial{final.suffix}", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp)
    tmp.unlink()
    try:
        yield tmp
        if tmp.is_dir() and final.is_dir():
            shutil.rmtree(final)  # directory artifacts (.mlpackage) cannot be replaced in one step
        os.replace(tmp, final)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def sha256(path: Path) -> str:
    """Of a file's bytes; of a directory, over its files' relative paths and hashes, sorted."""
    path = Path(path)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path).as_posix()}\0{sha256(f)}\n".encode())
        return h.hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def size(path: Path) -> int:
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
