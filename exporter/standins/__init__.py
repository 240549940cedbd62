"""Really trained offline models (scikit-learn's digits) that stand in for downloaded weights in the demo and tests.

Not on the product's path: a build never imports this package. Each stand-in is trained once into a cache
directory, by one process at a time: a second process asking for it (two trained-tier sweeps sharing
~/.cache/exporter/digits, a sweep and the demo) waits for the first and then finds its record."""

from __future__ import annotations

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
