"""Target profiles: data in targets/<name>.toml, overridable from the CLI."""

from __future__ import annotations

import copy
import difflib
import math
import re
import tomllib
from pathlib import Path

from ..precision import Precision
from ..errors import UsageError
from ..formats import FORMATS
from ..quant import ONNX_CALIBRATIONS, SETTINGS as QUANT_SETTINGS
from ..thresholds import FRACTIONS, MIN_INPUTS, TASK_KEYS, THRESHOLD_KEYS
from .request import Overrides

PROFILE_DIR = Path(__file__).resolve().parents[2] / "targets"
SECTIONS = {
    "name": str,
    "description": str,
    "artifacts": list,
    "thresholds": dict,
    "data": dict,
    "latency": dict,
    "post_build": str,  # "module:function" called with (out_dir, the Manifest, session) after the artifacts
    "quantization": dict,  # how int8 artifacts meet their budget (exporter.quant); [quantization.budget] overrides
    "validate": dict,  # where the artifacts are validated besides this host: arch = [...], cpus = [...]
    "input": dict,  # what the artifacts take: format = "float32-nchw" (default) or "uint8-nhwc"
    "detection": dict,  # a detector's output: decode = "host" (raw heads, default) or "graph" (final detections)
    # [tasks.<task>.thresholds.<precision>] and [tasks.<task>.data] for tasks other than classification,
    # whose thresholds and data settings are the top-level ones
    "tasks": dict,
    "overrides": dict,  # the CLI's, kept to be applied again once the task is known (for_task)
    "task": str,  # set by for_task: the profile is resolved for this task
}
TASK_SECTIONS = {"thresholds": dict, "data": dict}
DATA_KEYS = {"calib_size": int, "val_size": int, "seed": int}
LATENCY_KEYS = {"threads": int, "warmup": int, "iterations": int}
# on_request = true: made only when --format names it as FORMAT:PRECISION (a precision not yet measured on every task)
ARTIFACT_KEYS = {"name", "format", "precision", "options", "on_request"}
ARCHES = ("x86_64", "aarch64")  # x86_64: this host (always); aarch64: the emulated runner (exporter.aarch64)
VALIDATE_KEYS = {"arch": list, "cpus": list, "count": bool, "reference_cpu": str, "must_run_on": list}
INPUT_KEYS = {"format": str, "size_range": list}
MAX_SIDE = 4096  # the largest side a dynamic-size graph is exported for (an [input] size_range bound)
# float32-nchw: the normalized tensor torchvision's transforms make; uint8-nhwc: the RGB bytes an app's bitmap holds,
# at the input size, the scaling, mean/std and layout change inside the graph
INPUT_FORMATS = ("float32-nchw", "uint8-nhwc")
DETECTION_KEYS = {"decode": str}
# host: the graph ends in the raw heads, detection_decode.py decodes; graph: torchvision's post-processing inside it
DECODES = ("host", "graph")


def _runs_on_aarch64(format_name) -> bool:
    return format_name in FORMATS and FORMATS[format_name].runs_on_aarch64


def available_targets() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def profile_path(target: str) -> Path:
    """The file a target name (android, ios, jetson) or a .toml path stands for, whether it exists or not."""
    path = Path(target)
    return path if path.suffix == ".toml" else PROFILE_DIR / f"{target}.toml"


def load(target: str) -> dict:
    """A target name (android, ios, jetson) or a path to a .toml profile."""
    path = profile_path(target)
    if Path(target).suffix != ".toml":
        if not path.is_file():
            known = available_targets()
            close = difflib.get_close_matches(target.lower(), known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UsageError(
                f"unknown target '{target}'; {hint}choose from {', '.join(known)}, all, or a .toml profile"
            )
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
    if not isinstance(table, dict):
        raise UsageError(f"{where}: must be a table, got {table!r}")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _check_threshold(key: str, value, where: str) -> float:
    if key not in THRESHOLD_KEYS:
        raise UsageError(f"{where}: unknown threshold '{key}'; allowed: {', '.join(THRESHOLD_KEYS)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise UsageError(f"{where}: threshold {key} must be a number, got {value!r}")
    bounded = key in (*FRACTIONS, "cosine")
    if (bounded and not -1 <= value <= 1) or (key in FRACTIONS and value < 0):
        raise UsageError(f"{where}: threshold {key} is a fraction in [0, 1], got {value}")
    if key in ("max_abs_error", "psnr_db") and value < 0:
        # a PSNR floor below 0 dB passes an artifact whose error outweighs eager's own output
        raise UsageError(f"{where}: threshold {key} must be >= 0, got {value}")
    return float(value)


BOOLEAN_SETTINGS = ("fallback", "dynamic_ranges")


def _check_quant_setting(key: str, value, where: str):
    if key not in QUANT_SETTINGS:
        raise UsageError(f"{where}: unknown key '{key}'; allowed: budget, {', '.join(QUANT_SETTINGS)}")
    if key in BOOLEAN_SETTINGS:
        ok = isinstance(value, bool)
    elif key == "onnx_calibration":
        ok = value in ONNX_CALIBRATIONS
    else:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value) and value >= 0
        ok = ok and (key == "psnr_margin_db" or value <= 1) and (key != "check_fraction" or 0 < value < 1)
    if not ok:
        expected = {
            **dict.fromkeys(BOOLEAN_SETTINGS, "true or false"),
            "onnx_calibration": " or ".join(ONNX_CALIBRATIONS),
            "psnr_margin_db": "a number of dB >= 0",
            "check_fraction": "a fraction strictly between 0 and 1",
        }
        raise UsageError(f"{where}: {key} must be {expected.get(key, 'a fraction in [0, 1]')}, got {value!r}")
    return value


def _check_quantization(table: dict, where: str) -> None:
    for key, value in table.items():
        if key == "budget":
            if not isinstance(value, dict):
                raise UsageError(f"{where}: [quantization.budget] must be a table")
            for k, v in value.items():
                _check_threshold(k, v, f"{where} [quantization.budget]")
        else:
            _check_quant_setting(key, value, f"{where} [quantization]")


def _check_thresholds(tables: dict, where: str, section: str, task: str | None = None) -> None:
    if not isinstance(tables, dict):
        raise UsageError(f"{where}: [{section}] must be a table, got {tables!r}")
    for precision, table in tables.items():
        if not isinstance(table, dict):
            raise UsageError(f"{where}: [{section}.{precision}] must be a table")
        for key, value in table.items():
            _check_threshold(key, value, f"{where} [{section}.{precision}]")
            if task is not None and key not in TASK_KEYS[task]:
                raise UsageError(
                    f"{where} [{section}.{precision}]: {key} is not a {task} threshold; "
                    f"allowed: {', '.join(TASK_KEYS[task])}"
                )


def _check_ints(table: dict, keys: dict, where: str, minimum: int) -> None:
    _check_keys(table, keys, where)
    for k, v in table.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise UsageError(f"{where}: {k} must be an integer >= {minimum}, got {v!r}")


def _check_name(name, where: str) -> None:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UsageError(
            f"{where}: name {name!r} must be letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


def _check_val_size(table: dict, where: str) -> None:
    if table.get("val_size", MIN_INPUTS) < MIN_INPUTS:
        raise UsageError(
            f"{where}: val_size must be >= {MIN_INPUTS} (whether eager's outputs vary, and so whether "
            f"agreement with them means anything, takes two inputs), got {table['val_size']}"
        )


def _check_validate(table: dict, artifacts: list, where: str) -> None:
    from ..aarch64 import cpus as named

    _check_keys(table, VALIDATE_KEYS, where)
    arches = table.get("arch", ["x86_64"])
    if not isinstance(arches, list) or any(a not in ARCHES for a in arches):
        raise UsageError(f"{where}: arch must be a list of {', '.join(ARCHES)}, got {arches!r}")
    if "x86_64" not in arches:
        raise UsageError(f"{where}: arch must include x86_64 (this host's validation, and its latency, always run)")
    cpus = table.get("cpus", [])
    if not isinstance(cpus, list) or not all(isinstance(c, str) for c in cpus):
        raise UsageError(f"{where}: cpus must be a list of aarch64 CPU names, got {cpus!r}")
    try:
        named.check(cpus)
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    reference = table.get("reference_cpu")
    if reference is not None and reference not in cpus:
        raise UsageError(
            f"{where}: reference_cpu '{reference}' must be one of cpus ({', '.join(cpus) or 'none named'})"
        )
    must = table.get("must_run_on", [])
    if not isinstance(must, list) or any(c not in cpus for c in must) or (must and "aarch64" not in arches):
        raise UsageError(
            f"{where}: must_run_on (the cores an app must run on) must list cores among cpus "
            f"({', '.join(cpus) or 'none named'}) with aarch64 in arch, got {must!r}"
        )
    if "aarch64" in arches and not cpus and any(_runs_on_aarch64(a.get("format")) for a in artifacts):
        raise UsageError(
            f"{where}: arch includes aarch64 but no cpus are named; e.g. cpus = {list(named.FOR_TARGET['android'])}"
        )


def check(profile: dict, where: str) -> None:
    _check_keys({k: v for k, v in profile.items() if k != "path"}, SECTIONS, where)
    for key, kind in SECTIONS.items():
        if key in profile and not isinstance(profile[key], kind):
            raise UsageError(f"{where}: '{key}' must be a {kind.__name__}")
    _check_name(profile.get("name", ""), where)  # it names the build's folder
    if not profile.get("artifacts"):
        raise UsageError(f"{where}: no [[artifacts]] listed")
    for art in profile["artifacts"]:
        _check_keys(art, ARTIFACT_KEYS, f"{where} [[artifacts]]")
        if "name" in art:  # it names the artifact's file
            _check_name(art["name"], f"{where} [[artifacts]]")
        if art.get("format") not in FORMATS:
            raise UsageError(f"{where}: unknown format {art.get('format')!r}; known: {', '.join(FORMATS)}")
        if art.get("precision") not in tuple(Precision):
            raise UsageError(f"{where}: unknown precision {art.get('precision')!r}")
        if not isinstance(art.get("options", {}), dict):
            raise UsageError(f"{where}: [[artifacts]] options must be a table")
        if not isinstance(art.get("on_request", False), bool):
            raise UsageError(f"{where}: [[artifacts]] on_request must be true or false")
    _check_thresholds(profile.get("thresholds", {}), where, "thresholds")
    _check_quantization(profile.get("quantization", {}), where)
    _check_ints(profile.get("data", {}), DATA_KEYS, f"{where} [data]", 0)
    _check_val_size(profile.get("data", {}), f"{where} [data]")
    _check_keys(profile.get("tasks", {}), set(TASK_KEYS) - {"classification"}, f"{where} [tasks]")
    for task, table in profile.get("tasks", {}).items():
        _check_keys(table, TASK_SECTIONS, f"{where} [tasks.{task}]")
        _check_thresholds(table.get("thresholds", {}), where, f"tasks.{task}.thresholds", task)
        _check_ints(table.get("data", {}), DATA_KEYS, f"{where} [tasks.{task}.data]", 0)
        _check_val_size(table.get("data", {}), f"{where} [tasks.{task}.data]")
    latency = profile.get("latency", {})
    _check_ints({k: v for k, v in latency.items() if k != "max_spread"}, LATENCY_KEYS, f"{where} [latency]", 0)
    spread = latency.get("max_spread", 2.0)  # p90/p50 beyond which latency is reported unreliable (hostload)
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not spread >= 1:
        raise UsageError(f"{where} [latency]: max_spread (p90/p50) must be a number >= 1, got {spread!r}")
    if profile.get("latency", {}).get("iterations", 1) < 1:
        raise UsageError(f"{where} [latency]: iterations must be >= 1")
    _check_validate(profile.get("validate", {}), profile["artifacts"], f"{where} [validate]")
    _check_keys(profile.get("input", {}), INPUT_KEYS, f"{where} [input]")
    input_format = profile.get("input", {}).get("format", INPUT_FORMATS[0])
    if input_format not in INPUT_FORMATS:
        raise UsageError(f"{where} [input]: format must be one of {', '.join(INPUT_FORMATS)}, got {input_format!r}")
    size_range = profile.get("input", {}).get("size_range")
    if size_range is not None:
        check_size_range(size_range, f"{where} [input] size_range")
    _check_keys(profile.get("detection", {}), DETECTION_KEYS, f"{where} [detection]")
    decode = profile.get("detection", {}).get("decode", DECODES[0])
    if decode not in DECODES:
        raise UsageError(f"{where} [detection]: decode must be one of {', '.join(DECODES)}, got {decode!r}")


def check_size_range(bounds, where: str) -> tuple[int, int]:
    """[MIN, MAX]: the sides a dynamic-size graph takes, whole numbers with 1 <= MIN <= MAX <= MAX_SIDE."""
    if (
        not isinstance(bounds, (list, tuple))
        or len(bounds) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in bounds)
        or not 1 <= bounds[0] <= bounds[1] <= MAX_SIDE
    ):
        raise UsageError(
            f"{where}: expected [MIN, MAX], whole numbers with 1 <= MIN <= MAX <= {MAX_SIDE}, got {bounds!r}"
        )
    return int(bounds[0]), int(bounds[1])


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
    if precision and precision not in tuple(Precision):
        raise UsageError(f"--threshold {text!r}: unknown precision {precision!r}")
    return precision or "*", key, _check_threshold(key, value, f"--threshold {text}")


def check_precisions(chosen: list[dict], thresholds=(), quant_budget=()) -> None:
    """A `--threshold PRECISION.KEY=VALUE` whose precision none of the chosen targets builds, or a `--quant-budget`
    where none builds int8, would change nothing: refused, so a typo or a wrong target is not taken for a stricter
    build."""
    built = {a["precision"] for profile in chosen for a in profile["artifacts"]}
    wanted = [(f"--threshold {text}", parse_threshold_override(text)[0]) for text in thresholds]
    wanted += [(f"--quant-budget {text}", Precision.INT8) for text in quant_budget]
    for option, precision in wanted:
        if precision != "*" and precision not in built:
            names = ", ".join(profile["name"] for profile in chosen)
            raise UsageError(
                f"{option}: {names} build{'s' if len(chosen) == 1 else ''} no {precision} "
                f"artifact (precisions built: {', '.join(sorted(built))})"
            )


def parse_quant_budget(text: str) -> tuple[str, object]:
    """`--quant-budget KEY=VALUE`: a threshold key (the int8 budget only) or a [quantization] setting."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"--quant-budget {text!r}: expected KEY=VALUE, e.g. psnr_db=35 or max_float_fraction=0.1")
    if key in THRESHOLD_KEYS:
        try:
            return key, _check_threshold(key, float(raw), f"--quant-budget {text}")
        except ValueError:
            raise UsageError(f"--quant-budget {text!r}: {raw!r} is not a number") from None
    if key in QUANT_SETTINGS and key != "fallback":
        value = raw.strip()
        if key in BOOLEAN_SETTINGS:
            value = {"true": True, "false": False}.get(value.lower(), value)
        elif key != "onnx_calibration":
            try:
                value = float(value)
            except ValueError:
                raise UsageError(f"--quant-budget {text!r}: {raw!r} is not a number") from None
        return key, _check_quant_setting(key, value, f"--quant-budget {text}")
    allowed = [*THRESHOLD_KEYS, *(k for k in QUANT_SETTINGS if k != "fallback")]
    raise UsageError(f"--quant-budget {text!r}: unknown key '{key}'; allowed: {', '.join(allowed)} (and --no-fallback)")


def with_overrides(profile: dict, changes: Overrides) -> dict:
    """The profile with the request's `changes`: `arch` adds architectures to [validate] arch, `cpus` replaces its
    cpus, `must_run_on` adds cores an app must run on (validated on, whatever `cpus`), `count` its count,
    `input_format` its [input] format, `detections` its [detection] decode, `size_range` its [input] size_range."""
    profile = copy.deepcopy(profile)
    overrides = profile.setdefault("overrides", {})
    _override_thresholds(profile, changes.thresholds)
    overrides["thresholds"] = [*overrides.get("thresholds", []), *changes.thresholds]
    wanted = {f.strip() for f in changes.formats}
    keep = [a for a in profile["artifacts"] if _asked(a, wanted)]
    if wanted and not keep:
        choices = sorted({f"{a['format']}:{a['precision']}" for a in profile["artifacts"]})
        raise UsageError(
            f"--format {', '.join(sorted(wanted))} matches nothing in target {profile['name']}; choose from {', '.join(choices)}"
        )
    profile["artifacts"] = keep
    quantization = profile.setdefault("quantization", {})
    for text in changes.quant_budget:
        key, value = parse_quant_budget(text)
        if key in THRESHOLD_KEYS:
            quantization.setdefault("budget", {})[key] = value
        else:
            quantization[key] = value
    if changes.fallback is not None:
        quantization["fallback"] = changes.fallback
    for section, key, value in (
        ("data", "calib_size", changes.calib_size),
        ("data", "val_size", changes.val_size),
        ("latency", "threads", changes.threads),
        ("latency", "warmup", changes.warmup),
        ("latency", "iterations", changes.iterations),
        ("validate", "count", changes.count),
        ("input", "format", changes.input_format),
        ("detection", "decode", changes.detections),
        ("input", "size_range", list(changes.size_range) if changes.size_range else None),
    ):
        if value is not None:
            profile.setdefault(section, {})[key] = value
            overrides.setdefault(section, {})[key] = value
    arch, cpus, must = changes.arch, changes.cpus, changes.must_run_on
    if arch or cpus or must:
        validate = profile.setdefault("validate", {})
        validate["arch"] = list(
            dict.fromkeys([*validate.get("arch", ["x86_64"]), *arch, *(["aarch64"] if cpus or must else [])])
        )
        must = list(dict.fromkeys([*validate.get("must_run_on", []), *must]))
        # the cores an app must run on are validated whatever --cpu names
        validate["cpus"] = list(dict.fromkeys([*(cpus or validate.get("cpus", [])), *must]))
        if must:
            validate["must_run_on"] = must
        if validate.get("reference_cpu") not in validate["cpus"]:  # --cpus left it out: rank by x86 latency
            validate.pop("reference_cpu", None)
        overrides.setdefault("validate", {}).update(arch=list(arch), cpus=list(cpus))
        if changes.must_run_on:
            overrides["validate"]["must_run_on"] = list(changes.must_run_on)
    check(profile, f"target {profile['name']} with CLI overrides")
    return profile


def _asked(artifact: dict, wanted: set[str]) -> bool:
    """Whether a build asking for `wanted` (--format; empty: the profile's own) makes `artifact`: one made only
    on request is named with its precision."""
    named = f"{artifact['format']}:{artifact['precision']}" in wanted
    if artifact.get("on_request"):
        return named
    return not wanted or named or artifact["format"] in wanted


def _override_thresholds(profile: dict, texts) -> None:
    for text in texts:
        precision, key, value = parse_threshold_override(text)
        precisions = {a["precision"] for a in profile["artifacts"]} if precision == "*" else {precision}
        for p in precisions:
            profile.setdefault("thresholds", {}).setdefault(p, {})[key] = value


def for_task(profile: dict, task: str) -> dict:
    """The profile as a build of `task` uses it: that task's thresholds and data settings, with the CLI's
    overrides on top; a threshold (or int8 budget key) that means nothing for the task is refused."""
    resolved = copy.deepcopy(profile)
    tables, overrides = resolved.pop("tasks", {}), resolved.pop("overrides", {})
    where = f"target {profile['name']}"
    if task != "classification" and profile.get("task") != task:
        if task not in tables:
            raise UsageError(f"{where} has no [tasks.{task}] thresholds, so it cannot build {task} weights")
        resolved["thresholds"] = copy.deepcopy(tables[task].get("thresholds", {}))
        resolved["data"] = {**resolved.get("data", {}), **tables[task].get("data", {}), **overrides.get("data", {})}
        _override_thresholds(resolved, overrides.get("thresholds", []))
    allowed = TASK_KEYS[task]
    budget = resolved.get("quantization", {}).get("budget", {})
    for key in [k for table in resolved.get("thresholds", {}).values() for k in table] + list(budget):
        if key not in allowed:
            raise UsageError(
                f"{where}: threshold {key} does not apply to {task} weights; their keys: {', '.join(allowed)}"
            )
    resolved["task"] = task
    return resolved
