"""One target's build plan: its profile and the CLI's overrides resolved ONCE, for one task, into frozen values.

The pipeline parses each target profile into a Plan right after it knows the weight's task, and passes the
Plan along; nothing reads the TOML dicts again. `describe()` is the manifest's view of it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from ..precision import Precision
from .. import hostload
from ..errors import UsageError
from ..formats import FORMATS
from ..quant import SETTINGS as QUANT_SETTINGS
from . import profiles


def _frozen(table: Mapping) -> Mapping:
    return MappingProxyType({k: _frozen(v) if isinstance(v, Mapping) else v for k, v in table.items()})


def _plain(table: Mapping) -> dict:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in table.items()}


@dataclass(frozen=True)
class ArtifactSpec:
    """One [[artifacts]] entry: what to export; `name` is the profile's own, if it gave one."""

    format: str
    precision: str
    name: str | None = None
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))

    @property
    def label(self) -> str:
        return self.name or f"{self.format}_{self.precision}"

    @classmethod
    def read(cls, entry: Mapping) -> "ArtifactSpec":
        return cls(entry["format"], entry["precision"], entry.get("name"), _frozen(entry.get("options", {})))

    def describe(self) -> dict:
        entry = {"format": self.format, "precision": self.precision}
        if self.name is not None:
            entry["name"] = self.name
        if self.options:
            entry["options"] = _plain(self.options)
        return entry


@dataclass(frozen=True)
class DataSettings:
    calib_size: int = 128
    val_size: int = 256
    seed: int = 0

    def describe(self) -> dict:
        return {"calib_size": self.calib_size, "val_size": self.val_size, "seed": self.seed}


@dataclass(frozen=True)
class LatencySettings:
    threads: int
    warmup: int = 10
    iterations: int = 100
    max_spread: float = 2.0  # p90/p50 above this: the latency is unreliable (hostload.judge), never a failure

    def describe(self) -> dict:
        return {
            "threads": self.threads,
            "warmup": self.warmup,
            "iterations": self.iterations,
            "max_spread": self.max_spread,
        }


@dataclass(frozen=True)
class ValidateSettings:
    """Where artifacts are validated: this host always; on aarch64 (emulated) on each named CPU when asked."""

    arches: tuple[str, ...] = ("x86_64",)
    cpus: tuple[str, ...] = ()
    count: bool = True  # instructions per inference on each CPU (exporter.aarch64.counting), where it can count
    reference_cpu: str | None = None  # the core "ship this" ranks by count on (None, or not among cpus: x86 latency)
    must_run_on: tuple[str, ...] = ()  # the cores an app must run on: "ship this" never picks what cannot

    @property
    def aarch64_cpus(self) -> tuple[str, ...]:
        return self.cpus if "aarch64" in self.arches else ()

    @property
    def ranking_cpu(self) -> str | None:
        return self.reference_cpu if self.count and self.reference_cpu in self.aarch64_cpus else None

    def describe(self) -> dict:
        return {
            "arch": list(self.arches),
            "cpus": list(self.cpus),
            "count": self.count,
            "reference_cpu": self.reference_cpu,
        } | ({"must_run_on": list(self.must_run_on)} if self.must_run_on else {})


@dataclass(frozen=True)
class Plan:
    target: str
    profile_path: str
    task: str
    artifacts: tuple[ArtifactSpec, ...]
    thresholds: Mapping  # precision -> {key: value}, for this task
    data: DataSettings
    latency: LatencySettings
    quant_settings: Mapping  # exporter.quant SETTINGS with the profile's [quantization] on top
    quant_budget: Mapping  # what int8 must hold: [thresholds.int8] unless [quantization.budget] says otherwise
    post_build: str | None = None  # "module:function" called with (out_dir, the Manifest, session) after the artifacts
    validate: ValidateSettings = ValidateSettings()
    input_format: str = "float32-nchw"  # what every artifact takes (profiles.INPUT_FORMATS)
    size_range: tuple[int, int] | None = None  # [input] size_range: the sides of a dynamic-size graph
    detection_decode: str = "host"  # where a detector's boxes are decoded (profiles.DECODES)
    decode_kept: str | None = None  # why a target asked for "graph" keeps "host" (no format of it takes the graph)

    def thresholds_for(self, precision: str) -> dict:
        return dict(self.thresholds.get(precision, {}))

    def for_eager_quantized(self) -> "Plan":
        """An eager-quantized weight is int8 whatever the profile asks: one int8 artifact per format."""
        by_format = {}
        for spec in self.artifacts:
            by_format.setdefault(spec.format, replace(spec, precision=Precision.INT8, name=None))
        return replace(self, artifacts=tuple(by_format.values()))

    def describe(self) -> dict:
        """The manifest's `target` section."""
        return {
            "name": self.target,
            "profile": self.profile_path,
            "artifacts": [spec.describe() for spec in self.artifacts],
            "thresholds": _plain(self.thresholds),
            "quantization": {"settings": _plain(self.quant_settings), "budget": _plain(self.quant_budget)},
            "data": self.data.describe(),
            "latency": self.latency.describe(),
            "validate": self.validate.describe(),
            "input": {
                "format": self.input_format,
                **({"size_range": list(self.size_range)} if self.size_range else {}),
            },
            **({"detection": self._detection()} if self.task == "detection" else {}),
        }

    def _detection(self) -> dict:
        decode = {"decode": self.detection_decode}
        return {**decode, "asked": "graph", "kept_host_because": self.decode_kept} if self.decode_kept else decode


def export_order(precisions: list[str]) -> list[int]:
    """The order a target's artifacts are made in (indexes into its list): the float ones first, the int8 ones (a
    budget search: 2328 s of a random EfficientNet-B7's 3275-s Android build) last, each group in the target's
    order. A build stopped or failing in its int8 search has its float artifacts made; the manifest still lists
    artifacts in the target's order."""
    return sorted(range(len(precisions)), key=lambda i: precisions[i] == Precision.INT8)


def _options_applied(targets: list[dict], options: Mapping) -> list[dict]:
    """The request's --option KEY=VALUE on every artifact whose format takes it; one that none takes is refused."""
    unused = set(options)
    resolved = []
    for profile in targets:
        artifacts = []
        for entry in profile["artifacts"]:
            accepted = set(FORMATS[entry["format"]].format().options) & set(options)
            if accepted:
                entry = {**entry, "options": {**entry.get("options", {}), **{k: options[k] for k in sorted(accepted)}}}
                unused -= accepted
            artifacts.append(entry)
        resolved.append({**profile, "artifacts": artifacts})
    if unused:
        names = ", ".join(p["name"] for p in targets)
        raise UsageError(f"option(s) {', '.join(sorted(unused))} apply to no format of target {names}")
    return resolved


def make(profile: dict, task: str) -> Plan:
    """A checked profile (profiles.load + with_overrides) resolved for one task."""
    resolved = profiles.for_task(profile, task)
    table = dict(resolved.get("quantization", {}))
    budget = {**resolved.get("thresholds", {}).get(Precision.INT8, {}), **table.pop("budget", {})}
    latency = {**resolved.get("latency", {})}
    latency["threads"] = latency.get("threads") or hostload.usable_cores()
    return Plan(
        target=resolved["name"],
        profile_path=resolved["path"],
        task=task,
        artifacts=tuple(_sized(ArtifactSpec.read(entry), _size_range(resolved)) for entry in resolved["artifacts"]),
        thresholds=_frozen(resolved.get("thresholds", {})),
        data=DataSettings(**resolved.get("data", {})),
        latency=LatencySettings(**latency),
        quant_settings=_frozen({**QUANT_SETTINGS, **table}),
        quant_budget=_frozen(budget),
        post_build=resolved.get("post_build"),
        validate=ValidateSettings(
            tuple(resolved.get("validate", {}).get("arch", ["x86_64"])),
            tuple(resolved.get("validate", {}).get("cpus", [])),
            resolved.get("validate", {}).get("count", True),
            resolved.get("validate", {}).get("reference_cpu"),
            tuple(resolved.get("validate", {}).get("must_run_on", [])),
        ),
        input_format=resolved.get("input", {}).get("format", profiles.INPUT_FORMATS[0]),
        size_range=_size_range(resolved),
        detection_decode=resolved.get("detection", {}).get("decode", profiles.DECODES[0]),
    )


def _sized(spec: ArtifactSpec, size_range: tuple[int, int] | None) -> ArtifactSpec:
    """The artifact exported with a dynamic height and width within `size_range`, where its format takes one."""
    if not size_range or FORMATS[spec.format].fixed_size is not None:
        return spec
    return replace(spec, options=_frozen({**spec.options, "size_range": f"{size_range[0]}:{size_range[1]}"}))


def _size_range(resolved: dict) -> tuple[int, int] | None:
    bounds = resolved.get("input", {}).get("size_range")
    return (int(bounds[0]), int(bounds[1])) if bounds else None


def with_required(profile: dict, required: Mapping[str, Mapping], options: Mapping = MappingProxyType({})) -> dict:
    """The profile with the options a graph can only be exported with (the task's format_options) in place of its
    own; an --option that asks for another value is refused."""
    artifacts = []
    for entry in profile["artifacts"]:
        needs = required.get(entry["format"], {})
        for key, value in needs.items():
            if key in options and str(options[key]) != str(value):
                raise UsageError(
                    f"--option {key}={options[key]}: this model's graph is exported with {key}={value} only"
                )
        artifacts.append({**entry, "options": {**entry.get("options", {}), **needs}} if needs else entry)
    return {**profile, "artifacts": artifacts}


def make_all(
    targets: list[dict],
    task: str,
    options: Mapping = MappingProxyType({}),
    required: Mapping[str, Mapping] = MappingProxyType({}),
) -> list[Plan]:
    """Every target's Plan for one build; the targets must share one calibration and validation set. `required`:
    format -> the options its graph can only be exported with (Task.format_options)."""
    plans = [make(with_required(profile, required, options), task) for profile in _options_applied(targets, options)]
    if len({p.data for p in plans}) > 1:
        names = ", ".join(p.target for p in plans)
        raise UsageError(
            f"targets {names} ask for different [data] settings; pass --calib-size and --val-size to share one set"
        )
    return plans
