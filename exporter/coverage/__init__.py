"""The coverage sweep behind `exporter coverage` and `make coverage`: every torchvision weight (or each builder's
DEFAULT), with random weights, built for every artifact of every target and validated on synthetic inputs, one
build per process; the results as a table (docs/coverage.md) and JSON (docs/coverage.json). Its trained tier
(`weights="digits"`) trains each classifier on the digits instead and validates on labeled held-out digits
(docs/coverage-digits.md).

    from exporter.coverage import Settings, run
    doc = run(Settings(targets=("jetson",), formats=("onnx:fp32",)), models=["mobilenet_v3_small"], out=Path("cov"))

Modules: select (which weights, shards, refusals), randomize (the random checkpoints, made in the build's
process), trained (the digits-trained ones), worker (one build per process), outcome (a manifest read into
cells; failure kinds), rowcache (the resumable row cache), sweep (the loop), table (JSON, Markdown, merge).
The parent process imports torch only to list and resolve weights; the builds import it in their own
processes."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

from . import select, trained
from .sweep import Settings

__all__ = ["Settings", "run", "merge", "matrix", "output_paths"]


def _command() -> str:
    args = sys.argv[1:]
    return shlex.join(["exporter", *args])


def output_paths(
    out: Path, shard: tuple[int, int] | None, weights: str = "random", aarch64: bool = False
) -> tuple[Path, Path]:
    """OUT/coverage.json and .md, or OUT/coverage-shard-I-of-N.json and .md for a shard (a shard never
    overwrites the whole table); the trained tier's are OUT/coverage-digits*.json and .md; a sweep validated on
    aarch64 too adds -aarch64 (its verdicts are another table's)."""
    stem = ("coverage" if weights == "random" else f"coverage-{weights}") + ("-aarch64" if aarch64 else "")
    stem = stem if shard is None else f"{stem}-shard-{shard[0]}-of-{shard[1]}"
    out = Path(out)
    return out / f"{stem}.json", out / f"{stem}.md"


def _directory(path: Path, option: str) -> None:
    """Make an output directory now, so that a bad one is refused before hours of builds, not after the first."""
    from ..errors import UsageError

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot be a directory ({e.strerror or e})") from None


def run(
    settings: Settings,
    models=(),
    tasks=(),
    one_per_builder: bool = False,
    max_params: int | None = None,
    shard: str | None = None,
    out: Path = Path("docs"),
    cache: bool = True,
    cache_dir: Path | None = None,
    builds_dir: Path | None = None,
    command: str | None = None,
) -> dict:
    """Run the sweep (or one shard of it, "I/N"); writes the table after every build and returns the document."""
    from .sweep import Sweep

    which = select.parse_shard(shard)
    targets = tuple(select.targets_for(settings.targets, settings.formats))
    settings = dataclasses.replace(settings, targets=targets)
    found = select.shard(select.candidates(models, tasks, one_per_builder, max_params), which)
    if settings.is_trained:
        found = trained.restrict(found)
    if builds_dir is not None:
        _directory(builds_dir, "--builds")
    _directory(out, "--out")
    json_path, md_path = output_paths(out, which, settings.weights, settings.on_aarch64)
    selection = {
        "models": select.patterns(models),
        "tasks": list(tasks),
        "one_per_builder": one_per_builder,
        "max_params": max_params,
        "shard": shard,
        "weights": len(found),
    }
    sweep = Sweep(settings, found, json_path, md_path, command or _command(), selection, cache, cache_dir, builds_dir)
    return sweep.run()


def merge(paths, out: Path = Path("docs"), command: str | None = None) -> dict:
    """Merge coverage JSON files (or directories of them, e.g. downloaded CI shard artifacts) into
    OUT/coverage.json and OUT/coverage.md; returns the merged document. Every file is read and checked, and both
    texts made, before OUT is made or a file written: a refused merge leaves nothing behind, and the two files are
    renamed into place together, never half-written."""
    from ..errors import UsageError
    from . import table

    doc, texts = table.merged(paths, command or _command())
    json_path, md_path = output_paths(
        out, None, doc["settings"].get("weights", "random"), bool(doc["settings"].get("cpus"))
    )
    _directory(out, "--out")
    try:
        table.write_texts(zip((json_path, md_path), texts))
    except OSError as e:
        raise UsageError(
            f"--out {out}: cannot write {json_path.name} and {md_path.name} there ({e.strerror or e})"
        ) from None
    return doc


def matrix(shards: int) -> dict:
    """A CI matrix with one entry per shard: {"include": [{"shard": "1/N"}, …]}."""
    from ..errors import UsageError

    if shards < 1:
        raise UsageError("--matrix N needs N >= 1")
    return {"include": [{"shard": f"{i}/{shards}"} for i in range(1, shards + 1)]}
