"""Target profiles: data in targets/<name>.toml, overridable from the CLI."""

from __future__ import annotations

import copy
import os
import math
import tomllib
from pathlib import Path

from .errors import UsageError
from .formats import FORMATS
from .thresholds import THRESHOLD_KEYS

PROFILE_DIR = Path(__file__).resolve().parent.parent / "targets"
SECTIONS = {
    "name": str,
    "description": str,
    "artifacts": list,
    "thresholds": dict,
    "data": dict,
    "latency": dict,
    "post_build": str,  # "module:function" called with (out_dir, manifest, session) after the artifacts
}
DATA_KEYS = {"calib_size": int, "val_size": int, "seed": int}
LATENCY_KEYS = {"threads": int, "warmup": int, "iterations": int}
ARTIFACT_KEYS = {"name", "format", "precision", "options"}


def available_targets() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load(target: str) -> dict:
    """A target name (android, ios, jetson) or a path to a .toml profile."""
    path = Path(target)
    if path.suffix != ".toml":
        path = PROFILE_DIR / f"{target}.toml"
        if not path.is_file():
            raise UsageError(f"unknown target '{target}'; choose from {', '.join(available_targets())}")
    elif not path.is_file():
        raise UsageError(f"target profile {path} does not exist")
    try:
        profile = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"target profile {path} is not valid TOML: {e}") from None
    profile.setdefault("name", path.stem)
    profile["path"] = str(path)
    check(profile, str(path))
    return profile


def _check_keys(table: dict, allowed: dict | set, where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _check_threshold(key: str, value, where: str) -> float:
    if key not in THRESHOLD_KEYS:
        raise UsageError(f"{where}: unknown threshold '{key}'; allowed: {', '.join(THRESHOLD_KEYS)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise UsageError(f"{where}: threshold {key} must be a number, got {value!r}")
    bounded = key in ("top1_agreement", "top5_agreement", "cosine")
    if (bounded and not -1 <= value <= 1) or (key in ("top1_agreement", "top5_agreement") and value < 0):
        raise UsageError(f"{where}: threshold {key} is a fraction in [0, 1], got {value}")
    if key in ("max_abs_error",) and value < 0:
        raise UsageError(f"{where}: threshold {key} must be >= 0, got {value}")
    return float(value)


def _check_ints(table: dict, keys: dict, where: str, minimum: int) -> None:
    _check_keys(table, keys, where)
    for k, v in table.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise UsageError(f"{where}: {k} must be an integer >= {minimum}, got {v!r}")


def check(profile: dict, where: str) -> None:
    _check_keys({k: v for k, v in profile.items() if k != "path"}, SECTIONS, where)
    for key, kind in SECTIONS.items():
        if key in profile and not isinstance(profile[key], kind):
            raise UsageError(f"{where}: '{key}' must be a {kind.__name__}")
    if not profile.get("artifacts"):
        raise UsageError(f"{where}: no [[artifacts]] listed")
    for art in profile["artifacts"]:
        _check_keys(art, ARTIFACT_KEYS, f"{where} [[artifacts]]")
        if art.get("format") not in FORMATS:
            raise UsageError(f"{where}: unknown format {art.get('format')!r}; known: {', '.join(FORMATS)}")
        if art.get("precision") not in ("fp32", "fp16", "int8"):
            raise UsageError(f"{where}: unknown precision {art.get('precision')!r}")
        if not isinstance(art.get("options", {}), dict):
            raise UsageError(f"{where}: [[artifacts]] options must be a table")
    for precision, table in profile.get("thresholds", {}).items():
        if not isinstance(table, dict):
            raise UsageError(f"{where}: [thresholds.{precision}] must be a table")
        for key, value in table.items():
            _check_threshold(key, value, f"{where} [thresholds.{precision}]")
    _check_ints(profile.get("data", {}), DATA_KEYS, f"{where} [data]", 0)
    _check_ints(profile.get("latency", {}), LATENCY_KEYS, f"{where} [latency]", 0)
    if profile.get("latency", {}).get("iterations", 1) < 1:
        raise UsageError(f"{where} [latency]: iterations must be >= 1")


def parse_threshold_override(text: str) -> tuple[str, str, float]:
    """`PRECISION.KEY=VALUE`, or `KEY=VALUE` for every precision."""
    name, sep, raw = text.partition("=")
    if not sep:
        raise UsageError(f"--threshold {text!r}: expected [PRECISION.]KEY=VALUE, e.g. int8.psnr_db=35")
    precision, _, key = name.strip().rpartition(".")
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"--threshold {text!r}: {raw!r} is not a number") from None
    if precision and precision not in ("fp32", "fp16", "int8"):
        raise UsageError(f"--threshold {text!r}: unknown precision {precision!r}")
    return precision or "*", key, _check_threshold(key, value, f"--threshold {text}")


def with_overrides(
    profile: dict,
    thresholds: list[str] = (),
    formats: list[str] = (),
    calib_size: int | None = None,
    val_size: int | None = None,
    threads: int | None = None,
    warmup: int | None = None,
    iterations: int | None = None,
) -> dict:
    profile = copy.deepcopy(profile)
    for text in thresholds:
        precision, key, value = parse_threshold_override(text)
        precisions = {a["precision"] for a in profile["artifacts"]} if precision == "*" else {precision}
        for p in precisions:
            profile.setdefault("thresholds", {}).setdefault(p, {})[key] = value
    if formats:
        wanted = {f.strip() for f in formats}
        keep = [a for a in profile["artifacts"] if a["format"] in wanted or f"{a['format']}:{a['precision']}" in wanted]
        if not keep:
            choices = sorted({f"{a['format']}:{a['precision']}" for a in profile["artifacts"]})
            raise UsageError(f"--format {', '.join(sorted(wanted))} matches nothing in target {profile['name']}; choose from {', '.join(choices)}")
        profile["artifacts"] = keep
    for section, key, value in (
        ("data", "calib_size", calib_size),
        ("data", "val_size", val_size),
        ("latency", "threads", threads),
        ("latency", "warmup", warmup),
        ("latency", "iterations", iterations),
    ):
        if value is not None:
            profile.setdefault(section, {})[key] = value
    check(profile, f"target {profile['name']} with CLI overrides")
    return profile


def settings(profile: dict) -> tuple[dict, dict]:
    data = {"calib_size": 128, "val_size": 256, "seed": 0, **profile.get("data", {})}
    latency = {"threads": 0, "warmup": 10, "iterations": 100, **profile.get("latency", {})}
    latency["threads"] = latency["threads"] or os.cpu_count() or 1
    return data, latency
