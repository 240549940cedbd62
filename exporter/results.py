"""What a build decides about an artifact, as values: a status, and reasons that carry a kind and the text for people.

Code decides on `Reason.kind` (and `metric`, `cpu`); `Reason.text` is only ever shown. The manifest holds each reason
as {"kind", "text", ...} (schema 4): JSON is made and read here and in release/manifest.py, nowhere else. No torch."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, Literal, Self


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
    """A result from its JSON record (a result of that class is returned as it is)."""
    if isinstance(record, cls):
        return record
    known = {f.name for f in fields(cls)} - {"extra"}
    return cls(
        **{k: v for k, v in _typed(record, cls).items() if k in known},
        extra={k: v for k, v in record.items() if k not in known},
    )


def _typed(values: Mapping, cls) -> dict:
    """`values` with a status as a Status, reasons as Reason values and each of `cls`'s typed fields (its TYPED: name
    -> what reads it) as its value, where they are given as the JSON records that hold them."""
    typed = dict(values)
    if "status" in typed:
        typed["status"] = Status(typed["status"])
    if "reasons" in typed:
        typed["reasons"] = revived(typed["reasons"])
    for name, kind in getattr(cls, "TYPED", {}).items():
        if typed.get(name) is not None:
            typed[name] = kind(typed[name])
    return typed


# What a record was read with that this exporter does not know, kept as it was (the schema leaves records open).
Extra = dict[str, object]


def _extra() -> Extra:
    return field(default_factory=dict, repr=False, compare=False)


class _Record:
    """A result written as its JSON record: ALWAYS's fields whatever their value, the others once set (`_record`);
    its typed fields (TYPED: name -> what reads one) given as their JSON records are read as values when it is made."""

    ALWAYS: ClassVar[tuple[str, ...]] = ()
    TYPED: ClassVar[dict] = {}

    def __post_init__(self):
        _revive(self)

    def to_json(self) -> dict:
        return _record(self, self.ALWAYS)

    @classmethod
    def from_json(cls, record: Mapping) -> Self:
        return _from_record(cls, record)


def _each(kind):
    """A list of `kind`'s values from a list of them or of their JSON records."""
    return lambda records: [kind.from_json(r) for r in records]


def _revive(obj) -> None:
    """Each typed field of `obj` that was given as its JSON record, as its value (frozen or not)."""
    for name, value in _typed({f.name: getattr(obj, f.name) for f in fields(obj)}, type(obj)).items():
        object.__setattr__(obj, name, value)


# Open records, typed for what they hold. A task's metrics by name (fidelity, accuracy: psnr_db, top1_agreement,
# acc1, per-class lists for some tasks; "inf" as the manifest file writes a non-finite value):
Metrics = dict[str, object]
FormatDetails = dict[str, object]  # what a format's export says: quantization report, delegation, sizes…
# hostload.judged: the host's load over the timed window, each runner's spreads and rounds, and the verdict. Its keys'
# order depends on how it was judged (fresh, or a cached record judged again), which the manifest keeps as it was.
LatencyConditions = dict[str, object]
Versions = dict[str, object]  # what a runtime reports of itself (the aarch64 runner's packages and versions)
# validation.outlier_inputs: the few inputs a failed artifact's error sits on (rows, their error share, the fidelity
# without them)
OutlierInputs = dict[str, object]


@dataclass(frozen=True, kw_only=True)
class Latency(_Record):
    """One runner's timed runs (validation.percentiles), in milliseconds."""

    p50: float
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    iterations: int | None = None
    extra: Extra = _extra()

    ALWAYS = ("p50",)


@dataclass(frozen=True, kw_only=True)
class BaselineSpread(_Record):
    """How far eager's p50 moved over every round of a build (validation.build_spread)."""

    rounds: int  # the baseline's rounds and those timed beside each artifact
    artifacts: int | None = None  # the artifacts timed beside it
    p50_range_ms: list[float] | None = None  # [min, max] of the rounds' p50s
    round_spread: float | None  # max/min of them (hostload.round_spread)
    extra: Extra = _extra()

    ALWAYS = ("rounds", "round_spread")


@dataclass(frozen=True, kw_only=True)
class Memory(_Record):
    """The RAM an artifact needs (a format's `memory` hook, engine/memory_profile.py), in bytes; or why it was not
    measured. The program's own plan (a .pte), its constants, and the peak resident memory of a fresh process
    running it (formats/memory.peak_rss)."""

    available: bool
    reason: str | None = None  # available False: why not
    planned_bytes: int | None = None
    planned_buffers: list[int] | None = None
    planned_note: str | None = None
    constants_bytes: int | None = None
    delegate_blobs_bytes: int | None = None
    peak_rss_bytes: int | None = None
    runtime_baseline_rss_bytes: int | None = None
    peak_rss_increase_bytes: int | None = None
    load_increase_bytes: int | None = None
    runs: int | None = None
    method: str | None = None
    extra: Extra = _extra()

    ALWAYS = ("available",)


@dataclass(frozen=True, kw_only=True)
class OpTime(_Record):
    """One operator (or kernel) of a profile: its time per run, calls per run, and share of the operators' time."""

    op: str
    ms: float
    count: float
    share: float
    extra: Extra = _extra()

    ALWAYS = ("op", "ms", "count", "share")


@dataclass(frozen=True, kw_only=True)
class Profile(_Record):
    """Where an artifact's time goes (a format's `profile` hook, formats/memory.top_ops): its top operators by time
    per run from the runtime's own profiler; or why there is none."""

    available: bool
    reason: str | None = None  # available False: why not
    source: str | None = None  # the profiler
    runs: int | None = None
    wall_ms: float | None = None
    ops_ms: float | None = None
    ops: list[OpTime] | None = None
    others_share: float | None = None
    conditions: LatencyConditions | None = None  # what the host did while it was profiled (wall-clock times)
    extra: Extra = _extra()

    ALWAYS = ("available",)
    TYPED: ClassVar[dict] = {"ops": _each(OpTime)}


@dataclass(frozen=True, kw_only=True)
class InputDescription(_Record):
    """What an artifact takes (tasks/image_input.describe); absent in older manifests: float32 NCHW."""

    format: str | None = None  # "float32-nchw", "uint8-nhwc" (an image's bytes, preprocessed in the graph) or "own"
    note: str | None = None  # "own": the format's own image input, what it takes
    dtype: str | None = None
    layout: str | None = None
    shape: list[int] | None = None
    preprocessing: str | None = None  # uint8-nhwc: what the graph does before the model
    size_range: list[int] | None = None  # a dynamic-size artifact: the heights and widths it takes
    extra: Extra = _extra()


@dataclass(frozen=True, kw_only=True)
class GoldenCheck(_Record):
    """A golden program run through ExecuTorch's verifier on one CPU (formats/bundled_program.verify)."""

    passed: bool
    cases: int
    error: str | None  # the first failing case, its worst element
    backends: list[str] | None = None  # on an emulated CPU: the backends registered in its ExecuTorch runtime
    seconds: float | None = None  # on an emulated CPU: the check's wall time there
    extra: Extra = _extra()

    ALWAYS = ("passed", "cases", "error")


@dataclass(frozen=True, kw_only=True)
class BundledProgram(_Record):
    """A .pte's ExecuTorch golden program (.bpte, formats/bundled_program.write): the file, the tolerances it holds
    the program to, and its verification per CPU (x86_64, then each emulated aarch64 CPU)."""

    path: str  # relative to the build folder, beside its .pte
    sha256: str
    size_bytes: int | None = None
    program_sha256: str | None = None  # the .pte's
    method: str | None = None
    cases: int
    rtol: float
    atol: float
    tolerances: dict[str, float | str] | None = None  # max_abs_gap, output_scale and the rule that made rtol, atol
    verified: dict[str, GoldenCheck]  # "x86_64" and each emulated CPU -> its check
    extra: Extra = _extra()

    ALWAYS = ("path", "sha256", "cases", "rtol", "atol", "verified")
    TYPED: ClassVar[dict] = {"verified": lambda checks: {cpu: GoldenCheck.from_json(c) for cpu, c in checks.items()}}


@dataclass(frozen=True, kw_only=True)
class Instructions(_Record):
    """Emulated aarch64 instructions of one inference at one thread on one CPU (engine/count_on_arm.py: qemu's TCG
    plugin; a count, not time), and eager's on the same CPU."""

    per_inference: int
    warmup: int | None = None  # the first (warm-up) inference's
    load: int | None = None  # loading the program
    spread: float | None = None  # (max - min) / median over the counted runs
    runs: int | None = None
    unit: str
    qemu: str | None = None  # the counting qemu's version
    eager_per_inference: int | None = None
    ratio_to_eager: float | None = None  # eager's count / this one's; None where eager was not counted
    extra: Extra = _extra()

    ALWAYS = ("per_inference", "warmup", "unit", "eager_per_inference", "ratio_to_eager")  # as a build writes them


@dataclass(kw_only=True)
class EmulatedRow(_Record):
    """One artifact judged on one emulated aarch64 CPU (exporter.engine.validate_on_arm): the contract on the
    emulated outputs, never timed, and how far they are from the same artifact's x86 outputs."""

    arch: str = "aarch64"
    cpu: str
    why: str | None = None  # why the profile names this CPU
    emulated: bool = True
    latency_ms: None = None  # an emulated run has no latency
    seconds: float | None = None  # the emulated run's wall time (not the artifact's latency)
    runtime: Versions | None = None  # what ran it there
    status: Status
    reasons: list[Reason] = field(default_factory=list)
    fidelity: Metrics | None = None
    accuracy: Metrics | None = None
    vs_x86: Metrics | None = None  # how far its outputs are from the same artifact's on x86
    bundled_program: GoldenCheck | None = None  # the .pte's golden program, verified on this CPU
    # emulated instructions per inference at one thread on this CPU (not time), and eager's on the same CPU
    instructions: Instructions | None = None
    # what this CPU lacks that the artifact was made for (an fp16 program on a core without FP16 arithmetic)
    lacks: str | None = None
    reused_from_cache: bool | None = None
    extra: Extra = _extra()

    ALWAYS = ("arch", "cpu", "why", "emulated", "latency_ms", "seconds", "runtime", "status", "reasons")
    ALWAYS += ("fidelity", "accuracy", "vs_x86")
    TYPED: ClassVar[dict] = {"bundled_program": GoldenCheck.from_json, "instructions": Instructions.from_json}

    def failed(self) -> bool:
        return self.status is Status.FAILED


@dataclass(kw_only=True)
class SizeRow(_Record):
    """One dynamic-size artifact judged at one more input size (exporter.engine.validate_sizes): the contract
    against eager at that size, on the same images resized to it, never timed."""

    size: list  # [height, width]
    images: int
    status: Status
    reasons: list[Reason] = field(default_factory=list)
    fidelity: Metrics | None = None
    accuracy: Metrics | None = None
    extra: Extra = _extra()

    ALWAYS = ("size", "images", "status", "reasons", "fidelity", "accuracy")


@dataclass(frozen=True)
class EagerBaseline:
    """Eager timed alone, once per build, in rounds with no other thread of the process running beside it
    (validation.eager_baseline): the latency every artifact's speedup divides and the pick compares against. Once
    the build is done, `build` adds how eager's rounds beside every artifact compare with it (validation.build_spread).
    """

    latency_ms: Latency  # every timed run
    rounds_p50_ms: list[float]  # the p50 of each round
    round_spread: float | None  # max/min of those (hostload.round_spread)
    conditions: LatencyConditions  # hostload.judged: what the host did meanwhile, and whether it can be trusted
    build: BaselineSpread | None = None

    TYPED: ClassVar[dict] = {"latency_ms": Latency.from_json, "build": BaselineSpread.from_json}

    def __post_init__(self):
        _revive(self)

    @property
    def p50(self) -> float:
        return self.latency_ms.p50

    @property
    def reliable(self) -> bool:
        return bool(self.conditions.get("reliable", True))

    def to_json(self) -> dict:
        record = {
            "latency_ms": self.latency_ms.to_json(),
            "rounds_p50_ms": self.rounds_p50_ms,
            "round_spread": self.round_spread,
            "conditions": self.conditions,
        }
        return {**record, "build": self.build.to_json()} if self.build is not None else record

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
    not_picked: dict[str, str] = field(default_factory=dict)  # every other artifact: why it was not picked

    def to_json(self) -> dict:
        record = {"artifact": self.artifact, "ranked_by": self.ranked_by, "smallest": self.smallest, "why": self.why}
        return record | ({"not_picked": dict(self.not_picked)} if self.not_picked else {})

    @classmethod
    def from_json(cls, record) -> Recommendation:
        if isinstance(record, Recommendation):
            return record
        return cls(
            record["artifact"], record["ranked_by"], record.get("smallest"), record["why"], record.get("not_picked", {})
        )


@dataclass(frozen=True, kw_only=True)
class ProxyMetrics(_Record):
    """The contract on one stand-in for an artifact whose runtime is not on this host (a format's `proxies`, e.g. a
    Core ML package's weights put back into eager): never timed, never deciding the artifact's status."""

    fidelity: Metrics
    accuracy: Metrics | None
    reasons: list[Reason]
    status: Status
    outlier_inputs: OutlierInputs | None = None
    latency_ms: None = None
    eager_latency_ms: None = None
    speedup_vs_eager: None = None
    extra: Extra = _extra()

    ALWAYS = ("fidelity", "accuracy", "reasons", "status", "latency_ms", "eager_latency_ms", "speedup_vs_eager")


@dataclass
class ArtifactResult(_Record):
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
    details: FormatDetails = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)  # threshold key (a Metric's string) -> limit
    # the contract's measurements: in every record, None where not measured
    fidelity: Metrics | None = None
    accuracy: Metrics | None = None
    latency_ms: Latency | None = None
    eager_latency_ms: Latency | None = None
    speedup_vs_eager: float | None = None
    export_s: float | None = None
    artifact_reused_from_cache: bool | None = None
    validation_reused_from_cache: bool | None = None
    outlier_inputs: OutlierInputs | None = None
    latency_conditions: LatencyConditions | None = None
    golden_fidelity: Metrics | None = None
    preview_rows: list | None = None  # [] when the artifact's outputs are bit-identical to eager's
    preview: str | None = None
    proxy: dict[str, ProxyMetrics] | None = None  # stand-ins' metrics by label where its runtime is not on this host
    proxy_unavailable: str | None = None
    bundled_program: BundledProgram | None = None
    memory: Memory | None = None
    profile: Profile | None = None
    aarch64: list[EmulatedRow] | None = None  # one row per emulated CPU
    input: InputDescription | None = None  # what it takes; absent in older manifests: float32-nchw
    sizes: list[SizeRow] | None = None  # a dynamic-size artifact judged at more sizes than its input size
    extra: Extra = _extra()

    ALWAYS = (
        *("name", "format", "precision", "path", "sha256", "size_bytes", "status", "reasons", "details"),
        *("thresholds", "fidelity", "accuracy", "latency_ms", "eager_latency_ms", "speedup_vs_eager"),
    )
    TYPED: ClassVar[dict] = {
        **{"latency_ms": Latency.from_json, "eager_latency_ms": Latency.from_json},
        **{"memory": Memory.from_json, "profile": Profile.from_json, "input": InputDescription.from_json},
        "bundled_program": BundledProgram.from_json,
        "proxy": lambda proxies: {label: ProxyMetrics.from_json(m) for label, m in proxies.items()},
        **{"aarch64": _each(EmulatedRow), "sizes": _each(SizeRow)},
    }

    def update(self, values: Mapping | None = None, **more) -> None:
        """Set the fields named in `values` and `more` (a metrics record, a cached validation); an unknown name
        is an error, never a silent new key."""
        for name, value in _typed({**(values or {}), **more}, ArtifactResult).items():
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


_ARTIFACT_FIELDS = frozenset(f.name for f in fields(ArtifactResult)) - {"extra"}  # what `update` may set


@dataclass(frozen=True, kw_only=True)
class Checkpoint(_Record):
    """The checkpoint file a model was loaded from (exporter.weights.load makes it): the manifest's `checkpoint`,
    and a quantized weight's float model's in `eager.reference`."""

    path: str  # absolute, on the host that built
    sha256: str
    source: Literal["checkpoint", "torch-hub-cache", "download"]  # --checkpoint, the hub cache, or fetched now
    verified: bool  # its sha256 was checked against the prefix its file name carries
    extra: Extra = _extra()

    ALWAYS = ("path", "sha256", "source", "verified")


@dataclass(frozen=True, kw_only=True)
class Host(_Record):
    """The host that built (release/manifest.host): what its latencies were measured on."""

    platform: str
    machine: str | None = None  # None: a record made by hand without it (a build always writes it)
    cpu: str
    cores: int | None  # os.cpu_count(): None where it cannot tell
    threads: int  # the threads every runtime was timed with
    python: str | None = None
    extra: Extra = _extra()

    ALWAYS = ("platform", "machine", "cpu", "cores", "threads", "python")  # as a build writes them


@dataclass(frozen=True, kw_only=True)
class Labels(_Record):
    """The build's class names: the file they are written to in the build folder, how many, and the --labels file
    they were read from (None: the weight's own categories, or class_<i>)."""

    file: str  # relative to the build folder
    count: int
    from_file: str | None = None
    extra: Extra = _extra()

    ALWAYS = ("file", "count", "from_file")


@dataclass(frozen=True, kw_only=True)
class Weight(_Record):
    """The torchvision weight built: its canonical name, its builder, the classes the model was built with."""

    name: str
    model: str
    num_classes: int | None
    meta: dict[str, object]  # weights.meta_summary: torchvision's meta, its long fields summarised
    extra: Extra = _extra()

    ALWAYS = ("name", "model", "num_classes", "meta")


@dataclass(frozen=True, kw_only=True)
class Reference(_Record):
    """What every artifact is compared with (weights.load): the weight's own eager model, or for a quantized weight
    its float model when its checkpoint is found, else the quantized eager model and where the float one was looked
    for."""

    kind: str  # "float eager", "unquantized float" or "quantized eager"
    weight: str
    checkpoint: Checkpoint | None  # the float model's, when it is not the build's own
    looked_for: str | None = None
    note: str | None = None
    extra: Extra = _extra()

    ALWAYS = ("kind", "weight", "checkpoint")
    TYPED: ClassVar[dict] = {"checkpoint": Checkpoint.from_json}


@dataclass(frozen=True, kw_only=True)
class Eager(_Record):
    """The eager model as the build ran it: its labeled metrics, what it is, and its one latency baseline."""

    accuracy: Metrics | None
    reference: Reference | None = None  # None: a record made without it (a build always writes it)
    latency: EagerBaseline | None = None  # set once the build has timed every artifact
    extra: Extra = _extra()

    ALWAYS = ("accuracy",)
    TYPED: ClassVar[dict] = {"reference": Reference.from_json, "latency": EagerBaseline.from_json}


@dataclass(frozen=True, kw_only=True)
class CacheUse(_Record):
    """The cache a build used (None: --no-cache) and what it reused from it, one sentence each."""

    root: str | None
    events: list[str]
    build_record: str | None = None  # the whole build restored from this record (engine/record.py)
    extra: Extra = _extra()

    ALWAYS = ("root", "events")


# Records whose keys are each producer's own, kept open: a task's description (tasks' describe: name, input size,
# classes, outputs, a detector's decode…), its preprocessing (what preprocessing.json holds), the target profile as
# planned (Plan.describe), the data read (data.Inputs.description), the emulated CPUs' summary (validate_on_arm, filled
# in as it runs) and the Jetson device kit (release/jetson_kit).
TaskDescription = dict[str, object]
Preprocessing = dict[str, object]
TargetDescription = dict[str, object]
DataDescription = dict[str, object]
EmulationSummary = dict[str, object]
DeviceKit = dict[str, object]


@dataclass(kw_only=True)
class Manifest(_Record):
    """A build's manifest as the engine holds it (release/manifest.py writes and reads its JSON file)."""

    schema_version: int
    exporter_version: str
    exporter_commit: str | None = None  # the git commit exporter ran from, when a checkout
    created: str
    command: list[str] | None = None
    status: Status
    weight: Weight
    task: TaskDescription | None = None
    checkpoint: Checkpoint
    preprocessing: Preprocessing
    labels: Labels
    target: TargetDescription
    tools: dict[str, str | None]  # distribution -> its version, None where not installed
    host: Host
    data: DataDescription
    eager: Eager
    artifacts: list[ArtifactResult] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)  # step -> seconds
    aarch64: EmulationSummary | None = None  # the emulated CPUs' summary, when the target validates on them
    jetson: DeviceKit | None = None  # the Jetson device kit (its post_build step)
    cache: CacheUse | None = None
    validated: str | None = None  # when `exporter validate` judged it again
    recommended: Recommendation | None = None  # the pick the reports show (set when the build is finished)
    extra: Extra = _extra()

    ALWAYS = ("schema_version", "exporter_version", "exporter_commit", "created", "command", "status", "weight")
    ALWAYS += ("checkpoint", "preprocessing", "labels", "target", "tools", "host", "data", "eager", "artifacts")
    ALWAYS += ("timings_s",)
    TYPED: ClassVar[dict] = {
        **{"weight": Weight.from_json, "checkpoint": Checkpoint.from_json, "labels": Labels.from_json},
        **{"host": Host.from_json, "eager": Eager.from_json, "cache": CacheUse.from_json},
        **{"artifacts": _each(ArtifactResult), "recommended": Recommendation.from_json},
    }

    def overall_status(self) -> Status:
        return Status.FAILED if any(a.status is Status.FAILED for a in self.artifacts) else Status.PASSED


# the result classes: each is written to JSON by its own to_json (through `jsonable`), and only there
RECORDS = (_Record, Reason, EagerBaseline, Recommendation)
