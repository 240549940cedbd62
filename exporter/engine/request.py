"""What a user asks a build for: the weight, the targets and every override (data, torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Overrides:
    """What a request changes in a target's profile (profiles.with_overrides); None or empty: the profile's own."""

    thresholds: tuple[str, ...] = ()  # [PRECISION.]KEY=VALUE
    quant_budget: tuple[str, ...] = ()  # KEY=VALUE: int8 budget keys or [quantization] settings
    fallback: bool | None = None  # False: plain PTQ, no layers kept in float
    formats: tuple[str, ...] = ()  # only these artifacts: FORMAT or FORMAT:PRECISION
    calib_size: int | None = None
    val_size: int | None = None
    threads: int | None = None
    warmup: int | None = None
    iterations: int | None = None
    arch: tuple[str, ...] = ()  # added to [validate] arch
    cpus: tuple[str, ...] = ()  # replace [validate] cpus
    must_run_on: tuple[str, ...] = ()  # added to [validate] must_run_on (and to its cpus)
    count: bool | None = None  # [validate] count
    input_format: str | None = None  # [input] format
    detections: str | None = None  # [detection] decode
    size_range: tuple[int, int] | None = None  # [input] size_range


@dataclass
class BuildRequest:
    weight: str
    target: str = "android"
    out: Path | None = None
    checkpoint: Path | None = None
    verify: bool = True
    labels: Path | None = None
    data: Path | None = None
    force: bool = False
    thresholds: list[str] = field(default_factory=list)
    quant_budget: list[str] = field(default_factory=list)  # KEY=VALUE: int8 budget keys or [quantization] settings
    fallback: bool = True  # False: plain PTQ, no layers kept in float (for comparison)
    formats: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)  # format options, applied to every artifact that takes them
    cache: bool = True
    cache_dir: Path | None = None  # default: $EXPORTER_CACHE or ~/.cache/exporter
    calib_size: int | None = None
    val_size: int | None = None
    threads: int | None = None
    warmup: int | None = None
    iterations: int | None = None
    offline: bool = False  # never download a missing checkpoint (also $EXPORTER_OFFLINE=1)
    float_checkpoint: Path | None = None  # a quantized weight's float model, the eager reference
    arch: list[str] = field(default_factory=list)  # validate on these architectures too (aarch64: emulated)
    cpus: list[str] = field(default_factory=list)  # the emulated aarch64 CPUs, replacing the profile's
    must_run_on: list[str] = field(
        default_factory=list
    )  # cores an app must run on: an artifact that cannot is not picked
    count: bool | None = None  # instruction counts on those CPUs; None: the profile's [validate] count
    input_format: str | None = None  # float32-nchw or uint8-nhwc; None: the profile's [input] format
    size_range: tuple[int, int] | None = None  # MIN, MAX sides of a dynamic-size graph; None: the profile's
    detections: str | None = None  # host or graph (a detector's decode); None: the profile's [detection] decode
    aarch64_runners: Path | None = None  # the aarch64 runners' directory; default: aarch64.cache_root(cache_dir)
    input_size: tuple[int, int] | None = (
        None  # (H, W) of a segmentation graph; default: the weight's resize size, square
    )

    def overrides(self) -> Overrides:
        """What this request changes in each target's profile (a fallback left on is the profile's own)."""
        return Overrides(
            thresholds=tuple(self.thresholds),
            quant_budget=tuple(self.quant_budget),
            fallback=None if self.fallback else False,
            formats=tuple(self.formats),
            calib_size=self.calib_size,
            val_size=self.val_size,
            threads=self.threads,
            warmup=self.warmup,
            iterations=self.iterations,
            arch=tuple(self.arch),
            cpus=tuple(self.cpus),
            must_run_on=tuple(self.must_run_on),
            count=self.count,
            input_format=self.input_format,
            detections=self.detections,
            size_range=self.size_range,
        )
