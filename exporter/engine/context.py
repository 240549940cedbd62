"""A build's context: what every step of one target's build reads (the weight, its inputs as eager and as each
artifact is fed them, eager's reference, what the cache keys hang on) and where it writes and reports.

Built whole before the first step (pipeline._start_session and BuildContext.for_target) and never filled in later;
what the targets of one build share (SharedContext) is computed once for all of them."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__, data, validation, weights
from ..formats import FORMATS
from ..precision import CALIBRATED
from ..progress import Progress
from ..quant import Calibration
from ..release import manifest
from ..results import ArtifactResult, InputDescription
from ..tasks import Task, image_input
from . import cache
from .cache import BuildCache
from .plan import Plan

GOLDEN_COUNT = 8  # validation inputs written to golden/ for on-device checks


def meta_of(loaded: weights.LoadedModel, task: Task) -> dict:
    """What is written about the weight into artifacts (Core ML's class names) and previews."""
    return {
        "weight": loaded.weight_name,
        "model": loaded.model_name,
        "labels": list(loaded.labels),
        "task": task.describe(),
        "preprocessing": task.preprocessing(loaded.weights),
        "accuracy": weights.meta_summary(loaded.weights)["metrics"],
        "recipe": loaded.weights.meta.get("recipe"),
        "exporter_version": __version__,
    }


def digests_of(loaded: weights.LoadedModel, task: Task, inputs: data.Inputs) -> dict:
    """What the cache keys hang on: the exact checkpoint, input tensors and what is written with them."""
    labels = inputs.labels
    return {
        "checkpoint": loaded.checkpoint.sha256,
        "reference": getattr(loaded.reference.get("checkpoint"), "sha256", None),
        "model": loaded.model_name,
        "num_classes": loaded.num_classes,
        "task": task.describe(),
        "calibration": cache.tensors_digest(inputs.calibration),
        "validation": cache.tensors_digest([inputs.validation]),
        "labels": cache.tensors_digest([labels]) if labels is not None else None,
        "calibration_labels": (
            cache.tensors_digest([inputs.calibration_labels]) if inputs.calibration_labels is not None else None
        ),
        "meta": meta_of(loaded, task),  # written into artifacts (Core ML's class names) and previews
        # every cached step is keyed on these: the exporter's own code is one of the tools
        "tools": {**manifest.tool_versions(), "exporter_source": cache.source_digest()},
        "exporter": __version__,
    }


def inputs_as_bytes(loaded: weights.LoadedModel, task: Task, inputs: data.Inputs) -> data.Inputs:
    """The calibration and validation images as uint8-nhwc artifacts take them (image_input.as_bytes); inputs that
    are not whole bytes are refused (UsageError)."""
    pre = task.preprocessing(loaded.weights)
    to_bytes = functools.partial(image_input.as_bytes, mean=pre["mean"], std=pre["std"])
    return dataclasses.replace(
        inputs, calibration=[to_bytes(x) for x in inputs.calibration], validation=to_bytes(inputs.validation)
    )


@dataclass(frozen=True, kw_only=True)
class SharedContext:
    """What the targets of one build that export the same graph share: the weight, its inputs, eager's outputs on
    them, what the cache keys hang on, and what is measured once for all of those targets."""

    loaded: weights.LoadedModel
    task: Task
    inputs: data.Inputs  # as eager is fed them (torchvision's transforms)
    byte_inputs: data.Inputs | None  # the same images as uint8-nhwc; None when no target of the build takes those
    reference: torch.Tensor  # eager's outputs on inputs.validation
    eager_accuracy: dict | None  # None without labels
    digests: dict  # digests_of(loaded, task, inputs)
    cache: BuildCache
    shared_proxies: dict = field(default_factory=dict)  # (shared_key, thresholds) -> a proxy's metrics
    sized: dict = field(default_factory=dict)  # (h, w) -> the validation images and eager at that size
    # latency settings -> the eager baseline every timed artifact is compared with (shared by a build's targets)
    baselines: dict = field(default_factory=dict)

    @property
    def meta(self) -> dict:
        return meta_of(self.loaded, self.task)

    def eager(self, x):
        return self.loaded.eager(x)

    @functools.cached_property
    def golden_rows(self) -> list[int]:
        """The validation rows written to golden/ and measured as golden_fidelity."""
        return self.task.golden_rows(self.reference, GOLDEN_COUNT)

    def _behind_preprocessing(self, module: torch.nn.Module) -> torch.nn.Module:
        pre = self.task.preprocessing(self.loaded.weights)
        return image_input.ImageBytesInput(module, pre["mean"], pre["std"]).eval()


@dataclass(frozen=True, kw_only=True)
class BuildContext(SharedContext):
    """One target's build: what each of its artifacts is validated against, and where its steps write (`out`) and
    report (`progress`, each label after `prefix`)."""

    plan: Plan
    out: Path
    progress: Progress
    prefix: str = ""  # "TARGET: " in a build of several targets
    x86_outputs: dict = field(default_factory=dict)  # artifact name -> its outputs on this host (for the aarch64 rows)

    @classmethod
    def for_target(
        cls, shared: SharedContext, plan: Plan, out: Path, progress: Progress, prefix: str = ""
    ) -> BuildContext:
        """A target's context over what it shares with the build's other targets (the same caches and measures)."""
        common = {f.name: getattr(shared, f.name) for f in dataclasses.fields(SharedContext)}
        return cls(**common, plan=plan, out=out, progress=progress, prefix=prefix)

    @property
    def latency(self) -> dict:
        return self.plan.latency.describe()

    def eager_baseline(self) -> validation.EagerBaseline:
        """Eager timed alone, once per build and latency setting (validation.eager_baseline), on first use."""
        key = json.dumps(self.latency, sort_keys=True)
        if key not in self.baselines:
            torch.set_num_threads(self.latency["threads"])
            self.baselines[key] = validation.eager_baseline(
                self.eager,
                self.inputs.validation[:1],
                self.latency["warmup"],
                self.latency["iterations"],
                self.latency["threads"],
                self.latency.get("max_spread"),
            )
        return self.baselines[key]

    def eager_latency(self, artifacts: list[ArtifactResult]) -> validation.EagerBaseline | None:
        """The build's eager baseline with how eager's rounds beside each timed artifact compare with it (the
        manifest's eager.latency), or None when no artifact was timed."""
        baseline = self.baselines.get(json.dumps(self.latency, sort_keys=True))
        if baseline is None:
            return None
        beside = [(a.latency_conditions.get("rounds_p50_ms") or {}).get("eager") for a in artifacts if a.latency_ms]
        return validation.build_spread(baseline, [rounds for rounds in beside if rounds])

    @property
    def takes_bytes(self) -> bool:
        """Whether this target's artifacts take uint8-nhwc (those whose format has no image input of its own)."""
        return self.plan.input_format == image_input.BYTES

    def format_takes_bytes(self, format_name: str) -> bool:
        """Whether this target's artifact of `format_name` takes uint8-nhwc."""
        return self.takes_bytes and not FORMATS[format_name].own_image_input

    def graph_for(self, format_name: str) -> torch.nn.Module:
        """The module an artifact of `format_name` is exported from: the weight's graph, behind the preprocessing
        when it takes bytes."""
        model = self.loaded.model
        return self._behind_preprocessing(model) if self.format_takes_bytes(format_name) else model

    @property
    def fed(self) -> data.Inputs:
        """The inputs every artifact without an image input of its own is fed (all that run on aarch64)."""
        return self.byte_inputs if self.takes_bytes else self.inputs

    def fed_to(self, format_name: str) -> data.Inputs:
        """The inputs an artifact of `format_name` is fed (exported with, calibrated and validated on): the
        validation images as the app feeds them, the same images eager is fed as torchvision's transforms make
        them."""
        return self.byte_inputs if self.format_takes_bytes(format_name) else self.inputs

    @property
    def eager_taking_fed(self) -> torch.nn.Module:
        """Eager as a module that takes `fed` (behind the preprocessing for uint8-nhwc): what is counted beside
        those artifacts."""
        return self._behind_preprocessing(self.loaded.eager) if self.takes_bytes else self.loaded.eager

    def describe_fed(self, format_name: str, example: torch.Tensor) -> InputDescription:
        """What an artifact of `format_name` takes, as the manifest and bundle.json record it."""
        own = FORMATS[format_name].own_image_input
        if own and self.takes_bytes:
            return InputDescription(format="own", note=own)
        return InputDescription.from_json(image_input.describe(self.plan.input_format, example))

    def calibration(self, precision: str, format_name: str, log=lambda _message: None) -> Calibration | None:
        """What a format quantizes with: for int8 (and w8a16), the images (as the artifact takes them) plus the
        budget and how to meet it; None for a precision that needs none."""
        if precision not in CALIBRATED:
            return None
        return Calibration(
            self.fed_to(format_name).calibration,
            self.inputs.calibration_labels,
            dict(self.plan.quant_budget),
            dict(self.plan.quant_settings),
            log,
            self.task,
        )
