"""What a build decides about an artifact, as values: a status, and reasons that carry a kind and the text for people.

Code decides on `Reason.kind` (and `metric`, `cpu`); `Reason.text` is only ever shown. The manifest holds each reason
as {"kind", "text", ...} (schema 4): JSON is made and read here and in release/manifest.py, nowhere else. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(str, enum.Enum):
    """An artifact's verdict (and a build's: failed when any artifact failed, else passed)."""

    PASSED = "passed"
    FAILED = "failed"
    UNAVAILABLE = "unavailable"  # not made or not run on this host, by design or for want of its runtime
    BUILDING = "building"  # a manifest written while its build is under way


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
    NOTE = "note"  # said for the reader; decides nothing


@dataclass(frozen=True)
class Reason:
    kind: Kind
    text: str  # for people; never parsed
    metric: str | None = None  # Kind.THRESHOLD: the threshold key broken (e.g. "top1_agreement")
    cpu: str | None = None  # the emulated aarch64 CPU the reason was found on, if any

    def __str__(self) -> str:
        return self.text

    def on_cpu(self, cpu: str) -> Reason:
        """The same reason, found on an emulated aarch64 CPU (its text says so)."""
        return Reason(self.kind, f"aarch64 {cpu} (emulated): {self.text}", self.metric, cpu)

    def to_json(self) -> dict:
        record = {"kind": self.kind.value, "text": self.text}
        if self.metric is not None:
            record["metric"] = self.metric
        if self.cpu is not None:
            record["cpu"] = self.cpu
        return record

    @classmethod
    def from_json(cls, record: dict) -> Reason:
        return cls(Kind(record["kind"]), record["text"], record.get("metric"), record.get("cpu"))


def threshold(metric: str, text: str) -> Reason:
    return Reason(Kind.THRESHOLD, text, metric=metric)


def kinds(reasons) -> set[Kind]:
    """The kinds among `reasons` (Reason values or their JSON records)."""
    return {r.kind if isinstance(r, Reason) else Kind(r["kind"]) for r in reasons or ()}


def texts(reasons) -> list[str]:
    """The sentences of `reasons` (Reason values or their JSON records), for people."""
    return [r.text if isinstance(r, Reason) else r["text"] for r in reasons or ()]
