"""A dynamic-size artifact ([input] size_range) judged at three more input sizes than its own.

The build's input size stays the one the artifact is calibrated, validated, timed and golden-checked at. Here the
same validation images are resized to each further size (the task's transform bound at that size, masks too),
eager is run on them, and the artifact is held to the same thresholds there, untimed. A size where it breaks one
fails the artifact, its reasons named by size."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from .. import data, validation
from ..formats import FORMATS
from ..results import ArtifactResult, Kind, Reason, SizeRow, Status
from ..tasks import image_input
from .plan import ArtifactSpec

if TYPE_CHECKING:
    from .context import BuildContext


def checked_sizes(bounds: tuple[int, int]) -> list[tuple[int, int]]:
    """The smallest and largest square, and the widest the bounds allow (a landscape camera frame's shape)."""
    low, high = bounds
    return list(dict.fromkeys([(low, low), (high, high), (low, high)]))


def bounds_of(spec: ArtifactSpec) -> tuple[int, int] | None:
    text = spec.options.get("size_range")
    return tuple(int(v) for v in str(text).split(":")) if text else None


@dataclasses.dataclass(frozen=True)
class AtSize:
    """The build's validation images at one input size, and eager's outputs on them."""

    task: object
    inputs: object  # data.Inputs
    reference: object  # torch.Tensor
    eager_accuracy: dict | None


def _at_size(session: BuildContext, size: tuple[int, int]) -> AtSize:
    """Cached on the session (shared by its targets): one eager run per size."""
    if size not in session.sized:
        loaded = session.loaded
        task = type(session.task).bind(loaded.weights, loaded.model_name, loaded.num_classes, size)
        source = session.inputs.description.get("source")
        path = None if source in (None, "synthetic") else Path(source)
        inputs = data.load_inputs(path, task, loaded.weights, session.plan.data, loaded.labels)
        reference = validation.run_all(loaded.eager, inputs.validation)
        accuracy = task.labeled(reference, inputs.labels) if inputs.labels is not None else None
        session.sized[size] = AtSize(task, inputs, reference, accuracy)
    return session.sized[size]


def _fed_at(session: BuildContext, entry: ArtifactResult, at: AtSize):
    """The images at this size as the artifact takes them (bytes for a uint8-nhwc artifact)."""
    if not session.format_takes_bytes(entry.format):
        return at.inputs.validation
    pre = session.task.preprocessing(session.loaded.weights)
    return image_input.as_bytes(at.inputs.validation, pre["mean"], pre["std"])


def add_rows(session: BuildContext, spec: ArtifactSpec, entry: ArtifactResult) -> None:
    """Judge a run, dynamic-size artifact at each checked size; a size that breaks a threshold fails it."""
    bounds = bounds_of(spec)
    if not bounds or not entry.ran_here():
        return
    runner = FORMATS[entry.format].format().load(session.out / entry.path, session.latency["threads"])
    rows = []
    for size in checked_sizes(bounds):
        with session.progress.step(f"{session.prefix}validate {entry.name} at {size[0]}x{size[1]}"):
            at = _at_size(session, size)
            reference = validation.EagerReference(
                at.task, session.eager, at.inputs.validation, at.reference, at.inputs.labels, at.eager_accuracy
            )
            try:
                metrics, _ = validation.evaluate(
                    reference, runner, entry.thresholds, timed=False, fed=_fed_at(session, entry, at)
                )
            except Exception as e:  # the runtime refuses this size: a finding about the artifact
                reason = Reason(Kind.DOES_NOT_RUN, f"does not run at {size[0]}x{size[1]}: {str(e).splitlines()[0]}")
                metrics = {"status": Status.FAILED, "reasons": [reason]}
        rows.append(
            SizeRow(
                size=list(size),
                images=len(at.inputs.validation),
                status=metrics["status"],
                reasons=metrics.get("reasons", []),
                fidelity=metrics.get("fidelity"),
                accuracy=metrics.get("accuracy"),
            )
        )
    entry.sizes = rows
    for row in rows:
        if row.status is Status.FAILED:
            entry.status = Status.FAILED
            entry.reasons = [
                *entry.reasons,
                *(dataclasses.replace(r, text=f"at {row.size[0]}x{row.size[1]}: {r.text}") for r in row.reasons),
            ]
