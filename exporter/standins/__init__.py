"""Really trained offline models (scikit-learn's digits) that stand in for downloaded weights in the demo and tests.

Not on the product's path: a build never imports this package. Each stand-in is trained once into a cache
directory, by one process at a time: a second process asking for it (two trained-tier sweeps sharing
~/.cache/exporter/digits, a sweep and the demo) waits for the first and then finds its record."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .. import files


def one_at_a_time(record: Path):
    """The lock under which a stand-in's `record` (its JSON in the cache) is checked, and made if missing."""
    return files.locked(record.with_name(f".{record.name}.lock"))


def write_once(data_dir: Path, write: Callable[[Path], None]) -> Path:
    """A held-out set several stand-ins share, written by `write` only where no other process already wrote it."""
    with files.locked(data_dir.with_name(f".{data_dir.name}.lock")):
        if not data_dir.exists():
            write(data_dir)
    return data_dir


def weight_stem(weight: str) -> str:
    """The stem of the weight's own file name (torchvision's URL), which a stand-in's checkpoint is named after."""
    from torchvision.models import get_weight

    return Path(get_weight(weight).url).name.split("-")[0].removesuffix(".pth")


def save_checkpoint(state: dict, cache_dir: Path, stem: str) -> Path:
    """`state` as CACHE/<stem>_digits-<first 8 of its sha256>.pth, named as torchvision names its files. torch.save
    records the file's name in the archive, so it is written under one fixed name, in a directory of its own (two
    processes may save at once): the same state always gets the same bytes and name."""
    import torch

    stage = Path(tempfile.mkdtemp(prefix=".checkpoint.", dir=cache_dir))
    try:
        tmp = stage / "digits.pth.tmp"
        torch.save(state, tmp)
        checkpoint = cache_dir / f"{stem}_digits-{hashlib.sha256(tmp.read_bytes()).hexdigest()[:8]}.pth"
        tmp.replace(checkpoint)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return checkpoint
