"""Fetch a checkpoint into the torch hub cache: verified, atomic, one line when it fails.

Torch-free on purpose: only a build that needs the file calls it, never a whole-build cache lookup."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import UsageError

# torch.hub's convention: "<name>-<sha256 prefix>.<ext>"; torchvision's prefixes are 8 or 10 hex digits, so a
# shorter tail ("-100000.pth", a training step) is not taken for one
HASH_IN_NAME = re.compile(r"-([a-f0-9]{8,64})\.")
OFFLINE_ENV = "EXPORTER_OFFLINE"
CHUNK = 1 << 16
TIMEOUT_S = 30


def offline_by_environment() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def fetch(url: str, dest: Path, progress) -> str:
    """Download `url` to `dest` and return its sha256.

    The bytes go to a temporary file beside `dest`, are checked against the Content-Length and the
    sha256 prefix in `dest`'s name, and only then renamed to `dest`: whatever fails, no partial or
    unverified file is left in the cache, nor a folder made for it."""
    made = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]  # the deepest first
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    except OSError as e:
        _remove_empty(made)
        raise UsageError(f"cannot write to the checkpoint cache {dest.parent}: {e.strerror or e}") from None
    tmp = Path(name)
    try:
        digest = _copy(url, fd, progress, dest.name)
        expected = HASH_IN_NAME.search(dest.name)
        if expected and not digest.startswith(expected.group(1)):
            raise UsageError(
                f"download of {url} fails its hash check: name says {expected.group(1)}, "
                f"file is {digest[: len(expected.group(1))]}; nothing was kept"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
        if not dest.exists():
            _remove_empty(made)
    return digest


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # another download put a file there meanwhile, or it was never made
            break


def _copy(url: str, fd: int, progress, label: str) -> str:
    h = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "exporter"})
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            received = 0
            with progress.transfer(f"download {label}", total) as advance:
                while chunk := response.read(CHUNK):
                    f.write(chunk)
                    h.update(chunk)
                    received += len(chunk)
                    advance(len(chunk))
            if total is not None and received != total:
                raise UsageError(f"download of {url} stopped after {received} of {total} bytes; nothing was kept")
    except urllib.error.HTTPError as e:
        raise UsageError(f"download of {url} failed: HTTP {e.code} {e.reason}; nothing was kept") from None
    except urllib.error.URLError as e:
        raise UsageError(
            f"download of {url} failed: {_reason(e.reason)} (no network? pass --checkpoint PATH "
            f"or place the file in the cache)"
        ) from None
    except (http.client.HTTPException, OSError) as e:  # cut connection, timeout, disk full
        raise UsageError(f"download of {url} failed: {_reason(e)}; nothing was kept") from None
    return h.hexdigest()


def _reason(error) -> str:
    if isinstance(error, http.client.IncompleteRead):
        return "the connection closed before the whole file arrived"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
