"""What a build decides about an artifact, as values: a status, and reasons that carry a kind and the text for people.

Code decides on `Reason.kind` (and `metric`, `cpu`); `Reason.text` is only ever shown. The manifest holds each reason
as {"kind", "text", ...} (schema 4): JSON is made and read here and in release/manifest.py, nowhere else. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


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


FIELDS = ("kind", "text", "metric", "cpu", "value", "limit")  # a reason's JSON record: kind and text, the rest if set


@dataclass(frozen=True)
class Reason:
    kind: Kind
    text: str  # for people; never parsed
    metric: str | None = None  # Kind.THRESHOLD: the threshold key broken (e.g. "top1_agreement")
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
            if getattr(self, name) is not None:
                record[name] = getattr(self, name)
        return record

    @classmethod
    def from_json(cls, record) -> Reason:
        """A reason from its JSON record (a Reason is returned as it is)."""
        if isinstance(record, Reason):
            return record
        return cls(Kind(record["kind"]), record["text"], *(record.get(name) for name in FIELDS[2:]))


def threshold(metric: str, text: str, value: float | None = None, limit: float | None = None) -> Reason:
    return Reason(Kind.THRESHOLD, text, metric=metric, value=value, limit=limit)


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
    """`value` with every Reason as its JSON record and every Status or Kind as its string, through dicts, lists
    and tuples (lists in the result); anything else as it is. What the manifest writer and the caches store."""
    if isinstance(value, Reason):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
