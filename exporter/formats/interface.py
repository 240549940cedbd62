"""What every export format implements, and each optional hook's default, in one place (torch-free).

A format is one module exposing one object, `FORMAT`, an instance of a `Format` subclass; the registry
(formats/__init__.py) names the module and `FormatSpec.format()` imports it and returns that object. The engine
calls formats only through this interface: it never asks a format module what it happens to define.

Required (`Format` is an abstract base class: a subclass without export or load cannot be made):
    name, suffix, precisions (Precision members), options (the option names export and preflight accept)
    export(model, example, precision, calib, path, meta, **options) -> dict  # writes `path`, returns details
    load(path, threads) -> Runner                                             # Runner(x: Tensor) -> Tensor

Optional, each with its default here:
    preflight(precision, **options) -> None     # raise UsageError / RuntimeUnavailable before any work; a
                                                # TypeError is reported as bad options. Default: nothing to check
    proxies_version = None                      # bump when the stand-ins change: cached validations keyed on it
    proxies(path, model) -> dict[str, Runner]   # stand-ins measured when the runtime is unavailable
    per_inference_ranges(calib, details) -> Calibration | None  # an int8 artifact made again when its calibrated
                                                # ranges failed validation
    memory(path, input_shape, threads, dtype) -> dict  # RAM: planned/constant bytes, peak RSS of a fresh process
                                                # (dtype: "float32", or "uint8" for a uint8-nhwc input)
    profile(path, example, runs, threads) -> dict  # top operators by time from the runtime's own profiler

`proxies`, `per_inference_ranges`, `memory` and `profile` are None by default: the format has none, and the
engine says so where it would have used one (e.g. "onnx has no profiler here"). A format that has one defines
it as a method. `meta` describes the weight: {"weight", "model", "labels", "preprocessing", "exporter_version"}.
Any hook may raise RuntimeUnavailable (no GPU, no macOS): the artifact is then `unavailable`, not `failed`.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..precision import Precision

if TYPE_CHECKING:  # the interface itself needs no torch
    import torch

    from ..quant import Calibration

    Runner = Callable[[torch.Tensor], torch.Tensor]
    # what export() quantizes with: the calibration images with their budget and settings (int8), None for a
    # precision that needs none
    Calib = Calibration | None


class SharedProxy:
    """A proxy runner that is the same for every artifact of one model (eager in fp16 for each fp16 Core ML
    package): its metrics are measured once per build, under `shared_key`."""

    shared_key: ClassVar[str]


class Format(abc.ABC):
    """One export format. Subclasses set the four class attributes, define export() and load() (an instance of a
    subclass missing either cannot be made), and define whichever optional hooks they have; every other hook keeps
    the default declared here."""

    name: ClassVar[str]
    suffix: ClassVar[str]  # the artifact's file name ends with it (".pte"; ".mlpackage" is a folder)
    precisions: ClassVar[tuple[Precision, ...]]  # the precisions it makes
    options: ClassVar[tuple[str, ...]] = ()  # what a target profile's [[artifacts]] `options` table may set

    @abc.abstractmethod
    def export(self, model, example, precision: Precision, calib: Calib, path: Path, meta: dict, **options) -> dict:
        """Writes the artifact to `path` and returns its details (recorded in the manifest)."""

    @abc.abstractmethod
    def load(self, path: Path, threads: int) -> Runner:
        """The artifact in its runtime, as a function of one input batch."""

    def preflight(self, precision: Precision, **options) -> None:
        """Impossible options (UsageError) or a host that cannot make the artifact (RuntimeUnavailable), found
        before anything is written. By default there is nothing to check."""

    # A cached validation that measured this format's proxies is served only to the same proxies_version
    # (None: the format has no proxies, or they never changed).
    proxies_version: ClassVar[int | None] = None

    # Optional hooks; None: this format has none.
    # proxies(path, model) -> {label: Runner}: numerical stand-ins on a host without the runtime (Core ML on
    # Linux), labelled proxy and never deciding the status; raise ValueError when they cannot be made. A
    # SharedProxy is the same for every artifact of one model (eager in fp16): measured once per build.
    proxies: Callable[[Path, Any], dict[str, Runner]] | None = None
    # per_inference_ranges(calib, details) -> Calibration | None: the calibration that makes an int8 artifact
    # again with ranges chosen per inference, after its calibrated ranges failed validation (None: not remade).
    per_inference_ranges: Callable[[Calib, dict], Calibration | None] | None = None
    # memory(path, input_shape, threads, dtype) -> dict: RAM (planned and constant bytes; the peak RSS of a fresh
    # process running it on a `dtype` input); recorded by engine/memory_profile.py, formats/memory.py measures.
    memory: Callable[[Path, tuple, int, str], dict] | None = None
    # profile(path, example, runs, threads) -> dict: top operators by time from the runtime's own profiler.
    profile: Callable[[Path, Any, int, int], dict] | None = None
