"""Atomic writes (a reader never sees a half-written file), hashes, and output-directory checks."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import UsageError


@contextlib.contextmanager
def atomic_path(final: Path):
    """Yield a temporary path beside `final`; rename it into place only on success.

    The temporary path carries the final file name (inside a hidden staging directory): some
    writers insist on a suffix (coremltools) and some record their own file name (TorchScript
    archives), which would otherwise make two identical builds differ."""
    final = Path(final)
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    tmp = stage / final.name
    try:
        yield tmp
        if tmp.is_dir() and final.is_dir():
            shutil.rmtree(final)  # directory artifacts (.mlpackage) cannot be replaced in one step
        os.replace(tmp, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def locked(lock_file: Path):
    """Hold an exclusive lock on `lock_file` (made if missing) for the block: another process about to do the same
    work waits here, then finds it done, instead of repeating or racing it. Released when the process dies."""
    import fcntl

    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse an output directory that is a file, not empty (without --force), or not writable."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"--out {out} is not empty; pass --force to overwrite")
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError:
        raise UsageError(f"--out {out} is not writable ({probe} does not accept new files)") from None
