"""Atomic writes (a reader never sees a half-written file), hashes, and output-directory checks.

A file may have companions that are part of it: an ONNX graph over protobuf's 2 GiB keeps its tensors in
`<name>.data` beside it (ONNX external data, which ONNX Runtime and TensorRT read from the graph's directory).
Writes, copies, hashes and sizes here take the file with its companions."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import UsageError


COMPANION_SUFFIXES = (".data",)  # ONNX external data, named after its graph's file as torch.onnx and onnx write it


def companions(path: Path) -> list[Path]:
    """The files beside `path` that are part of it (its ONNX external data), if any."""
    path = Path(path)
    return [c for c in (path.with_name(path.name + s) for s in COMPANION_SUFFIXES) if c.is_file()]


@contextlib.contextmanager
def atomic_path(final: Path):
    """Yield a temporary path beside `final`; rename it into place only on success.

    The temporary path carries the final file name (inside a hidden staging directory): some
    writers insist on a suffix (coremltools) and some record their own file name (TorchScript
    archives, ONNX external data), which would otherwise make two identical builds differ. Companions
    written beside it move first, so a reader that finds `final` finds them too."""
    final = Path(final)
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    tmp = stage / final.name
    try:
        yield tmp
        new = {c.name for c in companions(tmp)}
        for old in companions(final):
            if old.name not in new:
                old.unlink()
        for name in sorted(new):
            os.replace(stage / name, final.with_name(name))
        if tmp.is_dir() and final.is_dir():
            shutil.rmtree(final)  # directory artifacts (.mlpackage) cannot be replaced in one step
        os.replace(tmp, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def copy(source: Path, target: Path) -> None:
    """A file (with its companions, renamed after `target`) or a directory tree."""
    source, target = Path(source), Path(target)
    if source.is_dir():
        shutil.copytree(source, target)
        return
    for companion in companions(source):
        shutil.copyfile(companion, target.with_name(target.name + companion.name[len(source.name) :]))
    shutil.copyfile(source, target)


@contextlib.contextmanager
def locked(lock_file: Path):
    """Hold an exclusive lock on `lock_file` (made if missing) for the block: another process about to do the same
    work waits here, then finds it done, instead of repeating or racing it. Released when the process dies."""
    import fcntl

    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a cache path through a file, or a read-only place
        raise UsageError(f"cannot make {lock_file.parent}: {e.strerror or e}") from None
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
    """Of a file's bytes (with companions: over its own hash and theirs, by suffix); of a directory, over its
    files' relative paths and hashes, sorted."""
    path = Path(path)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
        return h.hexdigest()
    parts = companions(path)
    if not parts:
        return file_sha256(path)
    h = hashlib.sha256()
    for f in [path, *parts]:
        h.update(f"{f.name[len(path.name) :]}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """Of one file's bytes, whatever lies beside it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def size(path: Path) -> int:
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return sum(f.stat().st_size for f in [path, *companions(path)])


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
