"""What every task shares: the bound dataclass, logit fidelity, and the quality verdict.

`Task` is abstract: a task names its model's input size, classes and construction, its preprocessing and data,
its output, its metrics and its golden files (the `@abstractmethod`s); the rest has a default it may override."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping

import torch
from torch import nn

from ..thresholds import breaches


def logit_fidelity(reference: torch.Tensor, output: torch.Tensor) -> dict:
    """PSNR against the reference's peak, mean per-image cosine, max abs error: rows are images."""
    ref, out = reference.double(), output.double()
    diff = out - ref
    if not torch.isfinite(diff).all():  # outputs not finite: not measurable (validation.not_finite says why)
        nan = math.nan
        return {"samples": int(ref.shape[0]), "psnr_db": nan, "cosine": nan, "max_abs_error": nan}
    rmse = diff.pow(2).mean().sqrt().item()
    peak = ref.abs().max().item()
    return {
        "samples": int(ref.shape[0]),
        "psnr_db": math.inf if rmse == 0 else -math.inf if peak == 0 else 20 * math.log10(peak / rmse),
        "cosine": torch.nn.functional.cosine_similarity(ref, out, dim=1).mean().item(),
        "max_abs_error": diff.abs().max().item(),
    }


@dataclass(frozen=True)
class Task(ABC):
    num_classes: int
    input_size: tuple[int, int]  # (H, W) of the exported graph's input

    name: ClassVar[str]
    agreement: ClassVar[str]  # the fidelity key the int8 search and summaries headline
    drop: ClassVar[str]  # the labeled key that says how much worse than eager
    output_name: ClassVar[str] = "logits"
    # why its graph cannot take uint8-nhwc bytes (image_input), or None: its inputs are images resized as bytes
    image_bytes_refusal: ClassVar[str | None] = None
    # why its graph is not exported for a dynamic height and width ([input] size_range), or None: it is, for sides of
    # at least `min_side`
    dynamic_size_refusal: ClassVar[str | None] = "only segmentation graphs take a dynamic height and width"
    min_side: ClassVar[int] = 1

    # --- before the task is bound: the model ---
    @classmethod
    def unsupported_model(cls, model_name: str) -> str | None:
        """Why this model of the task cannot be exported, or None."""
        return None

    @classmethod
    def for_model(cls, model_name: str) -> "type[Task]":
        """The class that exports `model_name`: a subclass that takes it (a task may export some of its models
        another way: Faster R-CNN's detection), else this one."""
        return next((sub for sub in cls.__subclasses__() if sub.takes(model_name)), cls)

    @classmethod
    def for_decode(cls, decode: str) -> "type[Task] | None":
        """The class whose graph decodes where `decode` (profiles.DECODES) says: this one for "host"; for "graph",
        the task's graph ending in final detections, None where it has no detections to decode."""
        return cls if decode == "host" else None

    @classmethod
    def takes(cls, model_name: str) -> bool:
        """Whether this subclass, rather than its task's class, exports `model_name`."""
        return False

    @classmethod
    def format_options(cls) -> dict[str, dict]:
        """Format -> options its graph can only be exported with (they replace the target profile's)."""
        return {}

    @classmethod
    def format_refusal(cls, format_name: str, precision: str | None = None) -> str | None:
        """Why a format (at a precision) cannot take this task's graph (measured), or None: the pipeline asks,
        formats never see the task."""
        return None

    @classmethod
    def bind(cls, weights, model_name: str, num_classes: int, input_size: tuple[int, int] | None = None) -> "Task":
        """The task for one build's graph (input_size: --input-size, else the weight's own). The caller names
        the model builder, so tasks never look weights up in the registry (exporter.weights imports tasks)."""
        return cls(num_classes, cls.input_size_of(weights, model_name, input_size))

    @classmethod
    @abstractmethod
    def input_size_of(cls, weights, model_name: str, requested: tuple[int, int] | None) -> tuple[int, int]:
        """(H, W) of the graph's input: `requested` (--input-size) where the model takes it, else the weight's own."""

    @classmethod
    @abstractmethod
    def num_classes_in(cls, state: dict, model_name: str, default: int) -> int:
        """How many classes the checkpoint `state` was trained for (`default` where it does not say)."""

    @classmethod
    @abstractmethod
    def construct(cls, model_name: str, num_classes: int, state: dict, arch: dict | None = None) -> nn.Module:
        """The model without weights, for `state`; `arch`: what the weight's own builder sets from the weight
        (exporter.weights.builder_kwargs)."""

    @classmethod
    def graph(cls, model: nn.Module) -> nn.Module:
        """The module every format exports: it returns one tensor."""
        return model

    # --- bound: data, metrics, files ---
    @abstractmethod
    def preprocessing(self, weights) -> dict:
        """The exact preprocessing of the weight, as the manifest and preprocessing.json record it."""

    @abstractmethod
    def transform(self, weights):
        """The callable that turns one input read from --data into the graph's input tensor."""

    @abstractmethod
    def load_data(self, root, transform, calib_size: int, val_size: int, seed: int, class_names=None):
        """The --data folder's inputs (data.Inputs); `class_names`: the labels in effect for the build, by which a
        classifier's class folders are read (None: the model's classes have no names)."""

    @abstractmethod
    def output(self) -> dict:
        """The graph's output (name, layout, shape) as `describe` reports it."""

    def describe(self) -> dict:
        """The manifest's, bundle's and formats' view of the graph: `meta["task"]`."""
        return {
            "name": self.name,
            "input_size": list(self.input_size),
            "num_classes": self.num_classes,
            "output": self.output(),
        }

    def device_files(self) -> dict[str, str]:
        """Code a device needs beside the artifacts (build-relative path -> text): written into every build,
        so that a bundle ships what validated the build, not what is installed when it is bundled. An image task's
        builds carry the numpy reference of the resize (and crop) the app does before every artifact."""
        if self.image_bytes_refusal:
            return {}
        from ..device import preprocess

        return {preprocess.SHIPPED_AS: Path(preprocess.__file__).read_text(encoding="utf-8")}

    @abstractmethod
    def fidelity(self, reference: torch.Tensor, outputs: torch.Tensor) -> dict:
        """How close an artifact's `outputs` are to eager's `reference` (the threshold keys of this task)."""

    @abstractmethod
    def labeled(self, outputs: torch.Tensor, labels: torch.Tensor) -> dict:
        """The labeled metrics of `outputs` (accuracy or its task's equivalent)."""

    @abstractmethod
    def vs_eager(self, eager: dict, artifact: dict) -> dict:
        """An artifact's labeled metrics beside eager's, with how much worse it is (the `drop` key)."""

    def quality(
        self,
        outputs: torch.Tensor,
        reference: torch.Tensor,
        labels,
        eager_labeled: dict | None,
        thresholds: Mapping[str, float],
    ) -> dict:
        """Fidelity against eager, labeled metrics when there are labels, and the thresholds broken."""
        metrics = {"fidelity": self.fidelity(reference, outputs), "accuracy": None}
        if labels is not None and eager_labeled is not None:
            metrics["accuracy"] = self.vs_eager(eager_labeled, self.labeled(outputs, labels))
        metrics["reasons"] = breaches(metrics, thresholds)
        return metrics

    def headline(self, metrics: dict) -> dict:
        """Agreement, PSNR and drop, whatever the task calls them (int8 search steps, summaries)."""
        accuracy = metrics.get("accuracy") or {}
        return {
            "agreement": metrics["fidelity"][self.agreement],
            "psnr_db": metrics["fidelity"]["psnr_db"],
            "drop": accuracy.get(self.drop),
        }

    def aligned(self, reference: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """`outputs` in the order of the `reference` rows they stand for, before a value-by-value comparison: as
        they are, unless the output is a list whose order rounding may change (final detections)."""
        return outputs

    def golden_rows(self, reference: torch.Tensor, count: int) -> list[int]:
        """Which validation rows go to golden/ for on-device checks (indices into `reference`, eager's
        outputs): those where a device's numerics show first. By default the first `count`."""
        return list(range(min(count, len(reference))))

    @abstractmethod
    def golden(self, inputs: torch.Tensor, reference: torch.Tensor, labels) -> dict:
        """File name under golden/ -> numpy array (.npy) or list (.json), for on-device checks."""

    def departure(self, reference: torch.Tensor, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """How far each row of an artifact's outputs departs from eager's: term -> (N,) scores, the terms in
        ranking order (the first what a person sees in the preview, the last the raw error that breaks ties).
        Higher is further; 0 on every term when the row is the same. By default the row's RMSE."""
        diff = (outputs.double() - reference.double()).reshape(len(reference), -1)
        return {"logit_rmse": diff.pow(2).mean(1).sqrt()}

    def preview(
        self,
        image: torch.Tensor,
        eager_row: torch.Tensor,
        artifact_row: torch.Tensor,
        preprocessing: dict,
        labels: list[str] | None = None,
    ):
        """A picture of one validation input a person can judge an artifact by (PIL image), or None;
        `labels` names the classes when the picture names any."""
        return None
