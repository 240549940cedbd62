"""What a build decides about an artifact, as values: a status, and reasons that carry a kind and the text for people.

Code decides on `Reason.kind` (and `metric`, `cpu`); `Reason.text` is only ever shown. The manifest holds each reason
as {"kind", "text", ...} (schema 4): JSON is made and read here and in release/manifest.py, nowhere else. No torch."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Literal


class Status(str, enum.Enum):
    """An artifact's verdict (and a build's: failed when any artifact failed, else passed)."""

    PASSED = "passed"
    FAILED = "failed"
    UNAVAILABLE = "unavailable"  # not made or not run on this host, by design or for want of its runtime
    BUILDING = "building"  # a manifest written while its build is under way

    def __str__(self) -> str:  # "failed" in an f-string, as the plain strings it replaces
        return self.value


class Kind(str, enum.Enum):
    """Why an artifact did not pass, or what a note on it is about."""

    NOT_MADE = (
        "not_made"  # the format (or the task's graph) cannot take this model at all: by design, no runtime needed
    )
    NOT_OFFERED = "not_offered"  # the format does not offer the precision asked for
    UNAVAILABLE_HERE = "unavailable_here"  # its converter or runtime is not on this host (no GPU, no macOS)
    EXPORT_FAILED = "export_failed"  # the converter raised
    DISK_FULL = "disk_full"  # the export was stopped by a full disk: the host's problem, not the artifact's
    DOES_NOT_LOAD = "does_not_load"  # made, but its runtime refuses to load it
    DOES_NOT_RUN = "does_not_run"  # loads, but its runtime fails on some validation inputs
    THRESHOLD = "threshold"  # a metric breaks its threshold (`metric` names the threshold key)
    NON_FINITE = "non_finite"  # the artifact's outputs hold NaN or infinite values
    DEGENERATE_REFERENCE = "degenerate_reference"  # eager's outputs barely vary: agreement with them proves nothing
    ILL_CONDITIONED_REFERENCE = "ill_conditioned_reference"  # eager rounded to the artifact's precision breaks it too
    LOWERING_FAULT = "lowering_fault"  # the program was lowered wrong (its runtime computes another graph)
    BUNDLED_PROGRAM_FAILED = "bundled_program_failed"  # its golden program (.bpte) does not verify
    EMULATOR_TIMEOUT = "emulator_timeout"  # an emulated aarch64 run hit its time limit
    AARCH64_MISMATCH = "aarch64_mismatch"  # an emulated aarch64 run returned outputs of another layout
    TOO_FEW_INPUTS = "too_few_inputs"  # fewer validation inputs than it takes to tell whether eager's outputs vary
    NOTE = "note"  # said for the reader; decides nothing

    def __str__(self) -> str:
        return self.value


class Metric(enum.StrEnum):
    """A threshold's key: what a profile's [thresholds] name, and the metric a broken threshold's Reason names.
    A StrEnum, so it is its own string in JSON, TOML and messages, and the same key in a dict of plain strings.
    (exporter.thresholds says where each is measured and which way it breaks.)"""

    TOP1_AGREEMENT = "top1_agreement"
    TOP5_AGREEMENT = "top5_agreement"
    PSNR_DB = "psnr_db"
    COSINE = "cosine"
    MAX_ABS_ERROR = "max_abs_error"
    ACCURACY_DROP = "accuracy_drop"
    PIXEL_AGREEMENT = "pixel_agreement"
    MIOU_VS_EAGER = "miou_vs_eager"
    MIOU_DROP = "miou_drop"
    MATCHED_RECALL = "matched_recall"
    MATCHED_PRECISION = "matched_precision"
    MAP_DROP = "map_drop"
    FLOW_AGREEMENT = "flow_agreement"
    EPE_VS_EAGER = "epe_vs_eager"
    EPE_INCREASE = "epe_increase"


FIELDS = ("kind", "text", "metric", "cpu", "value", "limit")  # a reason's JSON record: kind and text, the rest if set


@dataclass(frozen=True)
class Reason:
    kind: Kind
    text: str  # for people; never parsed
    metric: str | None = None  # Kind.THRESHOLD: the threshold key broken (a Metric; as read from older records)
    cpu: str | None = None  # the emulated aarch64 CPU the reason was found on, if any
    value: float | None = None  # Kind.THRESHOLD: the measured value (None when not finite: NaN breaks any threshold)
    limit: float | None = None  # Kind.THRESHOLD: the threshold it broke

    def __str__(self) -> str:
        return self.text

    def on_cpu(self, cpu: str) -> Reason:
        """The same reason, found on an emulated aarch64 CPU (its text says so)."""
        return replace(self, text=f"aarch64 {cpu} (emulated): {self.text}", cpu=cpu)

    def to_json(self) -> dict:
        record = {"kind": self.kind.value, "text": self.text}
        for name in FIELDS[2:]:
            value = getattr(self, name)
            if value is not None:
                record[name] = value.value if isinstance(value, enum.Enum) else value
        return record

    @classmethod
    def from_json(cls, record) -> Reason:
        """A reason from its JSON record (a Reason is returned as it is)."""
        if isinstance(record, Reason):
            return record
        return cls(Kind(record["kind"]), record["text"], *(record.get(name) for name in FIELDS[2:]))


def threshold(metric: Metric | str, text: str, value: float | None = None, limit: float | None = None) -> Reason:
    """A broken threshold (`metric` must name one: ValueError otherwise)."""
    return Reason(Kind.THRESHOLD, text, metric=Metric(metric), value=value, limit=limit)


def revived(reasons) -> list[Reason]:
    """`reasons` (Reason values or their JSON records, as a manifest or a cache holds them) as Reason values."""
    return [Reason.from_json(r) for r in reasons or ()]


def kinds(reasons) -> set[Kind]:
    """The kinds among `reasons` (Reason values or their JSON records)."""
    return {r.kind if isinstance(r, Reason) else Kind(r["kind"]) for r in reasons or ()}


def texts(reasons) -> list[str]:
    """The sentences of `reasons` (Reason values or their JSON records), for people."""
    return [r.text if isinstance(r, Reason) else r["text"] for r in reasons or ()]


def broken_metrics(reasons) -> set[str]:
    """The threshold keys `reasons` (Reason values or their JSON records) say were broken."""
    return {r.metric for r in revived(reasons) if r.kind is Kind.THRESHOLD and r.metric}


def broken_value(reasons, metric: str) -> float | None:
    """The value measured for the threshold `metric` where `reasons` say it was broken, else None."""
    return next((r.value for r in revived(reasons) if r.kind is Kind.THRESHOLD and r.metric == metric), None)


def jsonable(value):
    """`value` with every result value (RECORDS: a Reason, a Checkpoint, an ArtifactResult, …) as its JSON record and
    every enum (Status, Kind, Metric) as its string, through dicts, lists and tuples (lists in the result); anything
    else as it is. What the manifest writer and the caches store."""
    if isinstance(value, RECORDS):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _record(obj, always: tuple[str, ...]) -> dict:
    """A result's JSON record, its fields in declared order: those in `always` whatever their value, the others
    only when set (not None), as the manifest has always written them; then the fields it was read with that this
    exporter does not know (the schema leaves records open), as they were."""
    values = ((f.name, getattr(obj, f.name)) for f in fields(obj) if f.name != "extra")
    record = {name: jsonable(value) for name, value in values if name in always or value is not None}
    return {**record, **{k: v for k, v in obj.extra.items() if k not in record}}


def _from_record(cls, record: Mapping):
    known = {f.name for f in fields(cls)} - {"extra"}
    return cls(
        **{k: v for k, v in _typed(record).items() if k in known},
        extra={k: v for k, v in record.items() if k not in known},
    )


def _extra() -> dict:
    """Fields a record was read with that this exporter does not know, kept as they were."""
    return field(default_factory=dict, repr=False, compare=False)


@dataclass(kw_only=True)
class EmulatedRow:
    """One artifact judged on one emulated aarch64 CPU (exporter.engine.validate_on_arm): the contract on the
    emulated outputs, never timed, and how far they are from the same artifact's x86 outputs."""

    arch: str = "aarch64"
    cpu: str
    why: str | None = None  # why the profile names this CPU
    emulated: bool = True
    latency_ms: None = None  # an emulated run has no latency
    seconds: float | None = None  # the emulated run's wall time (not the artifact's latency)
    runtime: dict | None = None  # what ran it there (versions)
    status: Status
    reasons: list[Reason] = field(default_factory=list)
    fidelity: dict | None = None
    accuracy: dict | None = None
    vs_x86: dict | None = None
    bundled_program: dict | None = None  # the .pte's golden program, verified on this CPU
    # emulated instructions per inference at one thread on this CPU (not time), and eager's on the same CPU
    instructions: dict | None = None
    reused_from_cache: bool | None = None
    extra: dict = _extra()

    ALWAYS = ("arch", "cpu", "why", "emulated", "latency_ms", "seconds", "runtime", "status", "reasons")
    ALWAYS += ("fidelity", "accuracy", "vs_x86")

    def __post_init__(self):
        self.status, self.reasons = Status(self.status), revived(self.reasons)

    def failed(self) -> bool:
        return self.status is Status.FAILED

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, record: Mapping) -> EmulatedRow:
        return _from_record(cls, record)


@dataclass(kw_only=True)
class SizeRow:
    """One dynamic-size artifact judged at one more input size (exporter.engine.validate_sizes): the contract
    against eager at that size, on the same images resized to it, never timed."""

    size: list  # [height, width]
    images: int
    status: Status
    reasons: list[Reason] = field(default_factory=list)
    fidelity: dict | None = None
    accuracy: dict | None = None
    extra: dict = _extra()

    ALWAYS = ("size", "images", "status", "reasons", "fidelity", "accuracy")

    def __post_init__(self):
        self.status, self.reasons = Status(self.status), revived(self.reasons)

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, record: Mapping) -> SizeRow:
        return _from_record(cls, record)


@dataclass(frozen=True)
class EagerBaseline:
    """Eager timed alone, once per build, in rounds with no other thread of the process running beside it
    (validation.eager_baseline): the latency every artifact's speedup divides and the pick compares against. Once
    the build is done, `build` adds how eager's rounds beside every artifact compare with it (validation.build_spread).
    """

    latency_ms: dict  # validation.percentiles of every timed run
    rounds_p50_ms: list[float]  # the p50 of each round
    round_spread: float | None  # max/min of those (hostload.round_spread)
    conditions: dict  # hostload.judged: what the host did meanwhile, and whether it can be trusted
    build: dict | None = None  # {"rounds": eager's rounds in the build, "round_spread": their max/min, ...}

    @property
    def p50(self) -> float:
        return self.latency_ms["p50"]

    @property
    def reliable(self) -> bool:
        return bool(self.conditions.get("reliable", True))

    def to_json(self) -> dict:
        record = {
            "latency_ms": self.latency_ms,
            "rounds_p50_ms": self.rounds_p50_ms,
            "round_spread": self.round_spread,
            "conditions": self.conditions,
        }
        return {**record, "build": self.build} if self.build is not None else record

    @classmethod
    def from_json(cls, record: Mapping) -> EagerBaseline:
        if isinstance(record, EagerBaseline):
            return record
        return cls(
            record["latency_ms"],
            list(record["rounds_p50_ms"]),
            record["round_spread"],
            dict(record["conditions"]),
            record.get("build"),
        )


@dataclass(frozen=True)
class Recommendation:
    """Which artifact to ship for a target (release/recommend.py): the fastest that passed, what "fastest" was
    ranked by, the smallest that passed, and why, in the sentence the reports show."""

    artifact: str | None  # None: nothing passed, or nothing that passed was timed
    ranked_by: str  # "x86 latency" or "instructions on <cpu>"
    smallest: str | None
    why: str

    def to_json(self) -> dict:
        return {"artifact": self.artifact, "ranked_by": self.ranked_by, "smallest": self.smallest, "why": self.why}

    @classmethod
    def from_json(cls, record) -> Recommendation:
        if isinstance(record, Recommendation):
            return record
        return cls(record["artifact"], record["ranked_by"], record.get("smallest"), record["why"])


@dataclass
class ArtifactResult:
    """One artifact of a build, as the engine fills it in (export, validation, golden program, memory, aarch64
    rows) and the manifest records it. Fields below `speedup_vs_eager` appear in the record only once set."""

    name: str
    format: str
    precision: str
    path: str | None = None  # relative to the build directory; None until the artifact is complete
    sha256: str | None = None
    size_bytes: int | None = None
    status: Status = Status.FAILED
    reasons: list[Reason] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # what its format's export says (quantization report, sizes…)
    thresholds: dict[str, float] = field(default_factory=dict)  # threshold key (a Metric's string) -> limit
    # the contract's measurements: in every record, None where not measured
    fidelity: dict | None = None
    accuracy: dict | None = None
    latency_ms: dict | None = None
    eager_latency_ms: dict | None = None
    speedup_vs_eager: float | None = None
    export_s: float | None = None
    artifact_reused_from_cache: bool | None = None
    validation_reused_from_cache: bool | None = None
    outlier_inputs: list | None = None
    latency_conditions: dict | None = None
    golden_fidelity: dict | None = None
    preview_rows: list | None = None  # [] when the artifact's outputs are bit-identical to eager's
    preview: str | None = None
    proxy: dict | None = None  # stand-ins' metrics where its runtime is not on this host
    proxy_unavailable: str | None = None
    bundled_program: dict | None = None
    memory: dict | None = None
    profile: dict | None = None
    aarch64: list[EmulatedRow] | None = None  # one row per emulated CPU
    input: dict | None = None  # what it takes (tasks/image_input.describe); absent in older manifests: float32-nchw
    sizes: list[SizeRow] | None = None  # a dynamic-size artifact judged at more sizes than its input size
    extra: dict = _extra()

    ALWAYS = (
        *("name", "format", "precision", "path", "sha256", "size_bytes", "status", "reasons", "details"),
        *("thresholds", "fidelity", "accuracy", "latency_ms", "eager_latency_ms", "speedup_vs_eager"),
    )

    def __post_init__(self):
        self.status, self.reasons = Status(self.status), revived(self.reasons)
        if self.aarch64 is not None:
            self.aarch64 = [row if isinstance(row, EmulatedRow) else EmulatedRow.from_json(row) for row in self.aarch64]
        if self.sizes is not None:
            self.sizes = [row if isinstance(row, SizeRow) else SizeRow.from_json(row) for row in self.sizes]

    def update(self, values: Mapping | None = None, **more) -> None:
        """Set the fields named in `values` and `more` (a metrics record, a cached validation); an unknown name
        is an error, never a silent new key."""
        for name, value in _typed({**(values or {}), **more}).items():
            if name not in _ARTIFACT_FIELDS:
                raise TypeError(f"ArtifactResult has no field {name!r}")
            setattr(self, name, value)

    def clear(self, *names: str) -> None:
        for name in names:
            setattr(self, name, None)

    def fields(self, names) -> dict:
        """The fields among `names` that are set, by name (what a cached validation stores)."""
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def passed(self) -> bool:
        return self.status is Status.PASSED

    def ran_here(self) -> bool:
        """Made and run on this host's validation inputs (passed or failed by them, not unavailable)."""
        return bool(self.path) and self.status in (Status.PASSED, Status.FAILED) and self.fidelity is not None

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, record: Mapping) -> ArtifactResult:
        return _from_record(cls, record)


_ARTIFACT_FIELDS = frozenset(f.name for f in fields(ArtifactResult)) - {"extra"}  # what `update` may set


def _typed(values: Mapping) -> dict:
    """`values` with a status as a Status and reasons as Reason values (a JSON record holds their strings)."""
    typed = dict(values)
    if "status" in typed:
        typed["status"] = Status(typed["status"])
    if "reasons" in typed:
        typed["reasons"] = revived(typed["reasons"])
    return typed


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """The checkpoint file a model was loaded from (exporter.weights.load makes it): the manifest's `checkpoint`,
    and a quantized weight's float model's in `eager.reference`."""

    path: str  # absolute, on the host that built
    sha256: str
    source: Literal["checkpoint", "torch-hub-cache", "download"]  # --checkpoint, the hub cache, or fetched now
    verified: bool  # its sha256 was checked against the prefix its file name carries
    extra: dict = _extra()

    ALWAYS = ("path", "sha256", "source", "verified")

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, record: Mapping) -> Checkpoint:
        """A checkpoint from its JSON record (a Checkpoint is returned as it is)."""
        return record if isinstance(record, Checkpoint) else _from_record(cls, record)


@dataclass(frozen=True, kw_only=True)
class Host:
    """The host that built (release/manifest.host): what its latencies were measured on."""

    platform: str
    machine: str | None = None  # None: a record made by hand without it (a build always writes it)
    cpu: str
    cores: int | None  # os.cpu_count(): None where it cannot tell
    threads: int  # the threads every runtime was timed with
    python: str | None = None
    extra: dict = _extra()

    ALWAYS = ("platform", "machine", "cpu", "cores", "threads", "python")  # as a build writes them

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, record: Mapping) -> Host:
        return record if isinstance(record, Host) else _from_record(cls, record)


@dataclass(frozen=True, kw_only=True)
class Labels:
    """The build's class names: the file they are written to in the build folder, how many, and the --labels file
    they were read from (None: the weight's own categories, or class_<i>)."""

    file: str  # relative to the build folder
    count: int
    from_file: str | None = None
    extra: dict = _extra()

    ALWAYS = ("file", "count", "from_file")

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, record: Mapping) -> Labels:
        return record if isinstance(record, Labels) else _from_record(cls, record)


@dataclass(kw_only=True)
class Manifest:
    """A build's manifest as the engine holds it (release/manifest.py writes and reads its JSON file)."""

    schema_version: int
    exporter_version: str
    exporter_commit: str | None = None  # the git commit exporter ran from, when a checkout
    created: str
    command: list[str] | None = None
    status: Status
    weight: dict
    task: dict | None = None
    checkpoint: Checkpoint
    preprocessing: dict
    labels: Labels
    target: dict
    tools: dict[str, str | None]  # distribution -> its version, None where not installed
    host: Host
    data: dict
    eager: dict
    artifacts: list[ArtifactResult] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)  # step -> seconds
    aarch64: dict | None = None  # the emulated CPUs' summary, when the target validates on them
    jetson: dict | None = None  # the Jetson device kit (its post_build step)
    cache: dict | None = None
    validated: str | None = None  # when `exporter validate` judged it again
    recommended: Recommendation | None = None  # the pick the reports show (set when the build is finished)
    extra: dict = _extra()

    ALWAYS = ("schema_version", "exporter_version", "exporter_commit", "created", "command", "status", "weight")
    ALWAYS += ("checkpoint", "preprocessing", "labels", "target", "tools", "host", "data", "eager", "artifacts")
    ALWAYS += ("timings_s",)

    def __post_init__(self):
        self.status, self.checkpoint = Status(self.status), Checkpoint.from_json(self.checkpoint)
        self.labels, self.host = Labels.from_json(self.labels), Host.from_json(self.host)
        self.artifacts = [a if isinstance(a, ArtifactResult) else ArtifactResult.from_json(a) for a in self.artifacts]
        if self.recommended is not None:
            self.recommended = Recommendation.from_json(self.recommended)

    def overall_status(self) -> Status:
        return Status.FAILED if any(a.status is Status.FAILED for a in self.artifacts) else Status.PASSED

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, doc: Mapping) -> Manifest:
        return _from_record(cls, doc)


# the result classes: each is written to JSON by its own to_json (through `jsonable`), and only there
RECORDS = (
    *(Reason, EmulatedRow, SizeRow, ArtifactResult, Manifest),
    *(Checkpoint, Host, Labels, EagerBaseline, Recommendation),
)
