"""The sweep's row cache: each finished build (weight x target) is stored as
`$EXPORTER_CACHE/coverage/<key>.json`, keyed on the weight, the target and its profile (targets/*.toml:
artifacts, thresholds), the sweep's settings, the exporter's version and source and the tools' versions, so an
interrupted sweep continues where it stopped and a re-run rebuilds nothing, while a fix to the exporter's code
or a changed threshold builds its rows again (keyed on the version alone, a re-run after the shared-head Q/DQ
fix served the rows the code before it had made)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import __version__, files
from . import outcome

ROW_VERSION = 1  # bump when a row's meaning changes


def root(cache_dir: Path | None = None) -> Path:
    from ..engine.cache import default_root

    return Path(cache_dir or default_root()) / "coverage"


def key(weight: str, target: str, settings: dict, tools: dict) -> str:
    from ..engine import profiles
    from ..engine.cache import source_digest

    parts = {
        "row_version": ROW_VERSION,
        "exporter": __version__,
        "exporter_source": source_digest(),
        "weight": weight,
        "target": target,
        "profile": profiles.load(target),
        "settings": settings,
        "tools": tools,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def fetch(directory: Path, row_key: str, time_limit: float | None, input_size: list[int] | None = None) -> dict | None:
    """The stored row, unless it stopped at a time limit shorter than today's or on the wall clock alone (rows
    from before the limit was CPU time: a busy host stopped them), or was built at another input size
    than the one the weight gets today (the key holds the size the sweep asks for, not the one a weight accepts);
    then it is built again."""
    path = directory / f"{row_key}.json"
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if row.get("key") != row_key or outcome.not_a_verdict(row):
        return None  # another row's, or stored before such rows were refused
    if input_size is not None and row.get("input_size") not in (None, list(input_size)):
        return None
    if row.get("timed_out"):
        if row.get("stopped_by") in (None, "wall"):  # the wall clock stops a starved or blocked build, not the weight's
            return None
        earlier = row.get("time_limit_s")
        if earlier is None or (time_limit is None or time_limit > earlier):
            return None
    return row


def store(directory: Path, row: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    files.write_text(directory / f"{row['key']}.json", json.dumps(row, indent=2) + "\n")
