"""Atomic writes (a reader never sees a half-written file), hashes, output-directory checks, and the one check every
path read from a build's manifest passes before it is opened (`build_file`).

A file may have companions that are part of it: an ONNX graph over protobuf's 2 GiB keeps its tensors in
`<name>.data` beside it (ONNX external data, which ONNX Runtime and TensorRT read from the graph's directory).
Writes, copies, hashes and sizes here take the file with its companions."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath

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
    problem = unwritable(out)
    if problem:
        raise UsageError(f"--out {out} is not writable ({problem})")


def unwritable(folder: Path) -> str | None:
    """Why no file can be made in `folder` or the folders that would be made for it, or None: tried with a real file
    (as root, permission bits stop nothing; a read-only or pseudo file system, or a path through a file, does)."""
    probe = Path(folder).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"{probe} does not accept new files: {e.strerror or e}"
    return None


ENVIRONMENT_ERRORS = {  # errno -> what the host should do; none of them is a finding about the model or a bug
    errno.ENOSPC: "free some space and run it again",
    errno.EDQUOT: "free some space (a quota is full) and run it again",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "no permission to write there",
    errno.EPERM: "no permission to write there",
}


def environment_problem(error: BaseException) -> str | None:
    """One line for an OSError that is the host's (a full disk, a read-only file system, no permission), or None."""
    if not isinstance(error, OSError) or error.errno not in ENVIRONMENT_ERRORS:
        return None
    where = f": {error.filename}" if error.filename else ""
    return f"{error.strerror or os.strerror(error.errno)}{where} ({ENVIRONMENT_ERRORS[error.errno]})"


def relative_path(relative, where: str, what: str = "") -> PurePosixPath:
    """`relative` as a path a build (or a bundle) may name: a non-empty relative POSIX path without `..`, a
    backslash, a drive or a NUL; else a UsageError naming it. `where`: the folder it must stay in, for the message."""
    pure = PurePosixPath(relative) if isinstance(relative, str) else None
    if pure is not None and (pure.is_absolute() or ".." in pure.parts or any(c in relative for c in "\\:\0")):
        raise UsageError(f"{what}path {relative!r} would leave {where}: it must name a file inside it, relatively")
    if pure is None or not pure.parts:  # "", "." or not text
        raise UsageError(f"{what}path {relative!r} names no file in {where}")
    return pure


def build_file(root: Path, relative, what: str = "", missing_ok: bool = False, folder_ok: bool = False) -> Path | None:
    """`root / relative` for a path read from a build's manifest, checked before anything opens it: a relative path
    (relative_path) that leads, through any symbolic links, to a regular file inside `root` (or with `folder_ok`, a
    folder of regular files and folders: a .mlpackage), its companions (ONNX external data) likewise; no FIFO,
    device or socket, which would hang or feed a reader. A missing one is None with `missing_ok`. Anything else is a
    UsageError naming the path (`what` prefixes the message, e.g. "artifact onnx_fp32: ")."""
    root = Path(root)
    path = root / relative_path(relative, f"the build folder {root}", what)
    if not os.path.lexists(path):
        if missing_ok:
            return None
        raise UsageError(f"{what}{path} is missing from the build")
    _check_inside(root, path, what, folder_ok)
    for companion in (path.with_name(path.name + suffix) for suffix in COMPANION_SUFFIXES):
        if os.path.lexists(companion):
            _check_inside(root, companion, what, folder_ok=False)
    return path


def _check_inside(root: Path, path: Path, what: str, folder_ok: bool) -> None:
    try:
        real = path.resolve(strict=True)
        mode = real.stat().st_mode
        inside = real.is_relative_to(root.resolve(strict=True))
    except (OSError, RuntimeError) as e:  # a dangling link, a loop of links
        raise UsageError(f"{what}{path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if not inside:
        raise UsageError(f"{what}{path} leads outside the build folder {root} (to {real}); a build names its own files")
    if stat.S_ISDIR(mode) and folder_ok:
        _check_folder(root, real, what)
    elif not stat.S_ISREG(mode):
        raise UsageError(f"{what}{path} is {_kind(mode)}, not a regular file")


def _check_folder(root: Path, folder: Path, what: str) -> None:
    """Every entry under a folder (a .mlpackage, golden/) is a folder, a regular file, or a link to a regular file
    inside `root` (rglob does not follow links to folders, so no loop of them is walked)."""
    for entry in sorted(folder.rglob("*")):
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode):
            _check_inside(root, entry, what, folder_ok=False)
        elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UsageError(f"{what}{entry} is {_kind(mode)}, not a regular file")


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")
