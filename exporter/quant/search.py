"""Turn an accuracy budget into an int8 model: plain PTQ first, then the most sensitive layers back
in float, re-measured after each step, until the budget holds on held-out calibration images or the
cap on float layers is reached. Backends (PT2E, ONNX Q/DQ) only know how to quantize a graph with a
given set of layers left in float; the search, the budget and the report are the same for all."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..results import Kind, Reason, texts
from ..tasks import Classification
from ..validation import run_all
from .calibration import STATIC_RANGES, Calibration
from .sensitivity import Sensitivity, layer_sensitivity


# The search gives up before the cap when more float layers stop helping (an error no single layer
# causes): a random-init MobileNetV3-Large, whose activations sit below the observers' smallest
# scale, ran 8 steps to its cap (23 layers in float) without any gain.
PATIENCE, MIN_GAIN_DB = 4, 0.5
# When the budget is missed, eager is run once more on the check images with Gaussian noise this far (SNR) below
# them: about the error one int8 rounding of a tensor adds. Measured on digits-trained models (docs/int8.md): the
# output moved to 43 dB for EfficientNet-B0 (int8 passes), 30.5 dB for EfficientNet-B1 (int8 missed on both runtimes).
PERTURBATION_SNR_DB = 40.0


class CandidateFailed(Exception):
    """A candidate's runtime could not run it on an input (Faster R-CNN's int8 RPN leaving no proposal: ONNX
    Runtime cannot reshape the zero rows its box head gets). The search judges it the worst candidate there is
    and goes on; the artifact chosen is validated as any other."""


class Candidate(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # may raise CandidateFailed


class Backend(Protocol):
    range_methods: tuple[str, ...]  # ways to choose activation ranges; the search keeps the best
    # optional: ways tried only when every range method misses the budget (PT2E: ranges chosen per inference)
    fallback_range_methods: tuple[str, ...]
    op_fallbacks: tuple[str, ...]  # kinds of op (not layers) it quantizes and can keep in float, every one of them
    settings: tuple[str, ...]  # optional: the calibration.BACKEND_SETTINGS that mean something for it

    def layers(self) -> list[str]:
        """Names (module paths) of the layers this backend quantizes and can leave in float."""

    def describe(self, method: str) -> str:
        """How a range method quantizes, in words, for the manifest."""

    def quantize(
        self, float_layers: list[str], range_images: list[torch.Tensor], method: str, float_kinds: tuple[str, ...] = ()
    ) -> Candidate:
        """An int8 model with `float_layers`, and every op of `float_kinds` (of `op_fallbacks`), kept in float,
        calibrated on `range_images`."""

    def float_closure(self, float_layers: list[str], method: str | None = None) -> list[str]:
        """The layers that were in float in the last quantize() of `float_layers`: those asked for, plus
        any the backend had to leave in float with them."""

    def float_ops(
        self, float_layers: list[str], float_kinds: tuple[str, ...] = (), method: str | None = None
    ) -> dict[str, int]:
        """Compute ops, by name, that run in float in the int8 model with `float_layers` and `float_kinds` in
        float (and `method`, when it is one of the fallback_range_methods)."""


def _steps(cap: int):
    """How many layers are in float after each step: 1, 2, 3, then growing by half, up to the cap."""
    count = 0
    while count < cap:
        count = min(cap, count + max(1, count // 2))
        yield count


def _summary(task, metrics: dict) -> dict:
    headline = task.headline(metrics)
    return {
        **headline,
        "psnr_db": _rounded(headline["psnr_db"]),
        "meets_budget": not metrics["reasons"],
        "reasons": metrics["reasons"],
    }


@dataclass(frozen=True)
class Recipe:
    """How a candidate is made: the range method, the layers asked to stay in float (the backend may float more
    beside them) and the kinds of op (of the backend's op_fallbacks) kept in float, every one of them."""

    ranges: str
    float_layers: tuple[str, ...] = ()
    float_kinds: tuple[str, ...] = ()


@dataclass
class Trial:
    """A candidate judged on the check images: one step of the search, as the report lists it."""

    recipe: Recipe
    floated: list[str]  # every layer in float in it: those asked for and those the backend floats beside them
    metrics: dict  # the task's quality against eager on the check images (fidelity, accuracy, reasons)
    summary: dict  # what the report shows of `metrics` (_summary)
    over_cap: bool = False  # more layers in float than the cap allows: never chosen

    @property
    def meets_budget(self) -> bool:
        return not self.metrics["reasons"]

    @property
    def psnr_db(self) -> float:
        return self.metrics["fidelity"]["psnr_db"]

    def rank(self) -> tuple:
        return _rank(self.metrics)

    def beats(self, other: Trial) -> bool:
        """Ranks above `other` and is worth it: meets the budget, or gains at least MIN_GAIN_DB."""
        return self.rank() > other.rank() and (self.meets_budget or _gain(self.metrics, other.metrics) >= MIN_GAIN_DB)

    def to_json(self) -> dict:
        """The report's step: layers in float (counted), ranges, kinds in float, the summary, whether over the cap."""
        return {
            "float_layers": len(self.floated),
            "ranges": self.recipe.ranges,
            **({"float_kinds": list(self.recipe.float_kinds)} if self.recipe.float_kinds else {}),
            **self.summary,
            **({"over_cap": True} if self.over_cap else {}),
        }


@dataclass
class _Held:
    """The one candidate the search keeps alive, and how it was made."""

    recipe: Recipe
    candidate: Candidate


@dataclass
class _Search:
    """One budget search: what makes and judges candidates, every trial in order, and the candidate held.

    One candidate is alive at a time (two while the next is made): each holds a runtime session or a quantized copy
    of the model, and every step's used to be kept to the end (MViT-V2-S's Q/DQ search, 16 frames at 224²: letting
    the candidates go took the process from 5.0 to 3.4 GB). One chosen after it was let go is made again
    (quantization is deterministic; the ONNX backend keeps its files)."""

    backend: Backend
    range_images: list
    judge: Callable[[Candidate], dict]
    task: object
    log: Callable[[str], None]
    layer_count: int
    trials: list[Trial] = field(default_factory=list)
    held: _Held | None = None

    def attempt(self, recipe: Recipe) -> tuple[Candidate, Trial]:
        """A candidate made with `recipe`, judged, and its trial (added to the trials, and logged)."""
        candidate = _quantize(self.backend, recipe, self.range_images)
        metrics = self.judge(candidate)
        floated = _closure(self.backend, list(recipe.float_layers), recipe.ranges)
        trial = Trial(recipe, floated, metrics, _summary(self.task, metrics))
        self.trials.append(trial)
        self.log(
            f"  int8, {recipe.ranges} ranges, {len(floated)}/{self.layer_count} layers float"
            f"{_kinds_text(recipe.float_kinds)}: {trial.psnr_db:.1f} dB, agreement {trial.summary['agreement']:.3f}"
            + (", budget met" if trial.meets_budget else "")
        )
        return candidate, trial

    def hold(self, trial: Trial, candidate: Candidate) -> None:
        self.held = _Held(trial.recipe, candidate)

    def candidate_for(self, recipe: Recipe) -> Candidate:
        """The candidate made with `recipe`: the one held, or made again."""
        if self.held is not None and self.held.recipe == recipe:
            return self.held.candidate
        return _quantize(self.backend, recipe, self.range_images)


@dataclass
class _Found:
    """What the search found, before it is written as the report."""

    plain: Trial  # plain PTQ with the best range method
    chosen: Trial
    cap: int  # layers that may be in float
    unusable: dict[str, str]  # range methods that cannot measure this model: their errors
    unusable_fallbacks: dict[str, str] = field(default_factory=dict)  # fallback range methods that cannot quantize it
    sensitivity: Sensitivity | None = None  # measured when the layer search ran
    stopped: str | None = None  # why the layer search stopped short of the budget and the cap


def quantize_with_budget(model: torch.nn.Module, backend: Backend, calibration: Calibration) -> tuple[Candidate, dict]:
    """The chosen int8 candidate and what was done to get it (for the manifest)."""
    start = time.perf_counter()
    range_images, check_images, check_labels = calibration.split()
    budget = calibration.budget_thresholds()
    layers = backend.layers()
    report = {**calibration.describe(getattr(backend, "settings", ())), "layers": len(layers)}
    if not check_images:
        return _unchecked_ptq(backend, range_images, layers, report, start)
    check = torch.cat(check_images)
    reference, task, judge = _judge(model, check, check_labels, calibration.task, budget)
    search = _Search(backend, range_images, judge, task, calibration.log, len(layers))
    found = _run_phases(search, model, check, reference, layers, calibration.settings)
    candidate = search.candidate_for(found.chosen.recipe)
    report.update(_report(found, search.trials, backend, len(layers), check, start))
    if not found.chosen.meets_budget:
        report.update(_missed_budget(found, calibration.settings, model, check, reference, task, budget))
    return candidate, report


def _unchecked_ptq(backend: Backend, range_images: list, layers: list[str], report: dict, start: float):
    """Too few calibration images to hold any out: plain PTQ with the first range method, the budget not checked."""
    method = backend.range_methods[0]
    candidate = backend.quantize([], range_images, method)
    report.update(
        calibration_method=backend.describe(method),
        float_layers=[],
        int8_layers=len(layers),
        steps=[],
        float_ops=backend.float_ops([]),
        seconds=round(time.perf_counter() - start, 1),
        note="too few calibration images to hold any out: plain PTQ, budget not checked",
    )
    return candidate, report


def _run_phases(
    search: _Search, model: torch.nn.Module, check: torch.Tensor, reference: torch.Tensor, layers: list[str], settings
) -> _Found:
    """The phases of the search, each tried only while the budget is missed (docs/int8.md): the best range method,
    ranges chosen per inference, whole kinds of op in float, then the most sensitive layers in float."""
    backend = search.backend
    allowed = settings.get("dynamic_ranges", True)
    fallback_ranges = getattr(backend, "fallback_range_methods", ()) if allowed else ()
    static = settings.get(STATIC_RANGES, True) or not fallback_ranges
    plain, unusable = _best_range_method(search, backend.range_methods if static else fallback_ranges)
    cap = math.floor(settings["max_float_fraction"] * len(layers))
    if not static and len(plain.floated) > cap:  # as a fallback over the cap is never chosen
        raise ValueError(
            f"{plain.recipe.ranges} ranges leave {len(plain.floated)} layers in float, over the cap of {cap}"
        )
    found = _Found(plain, plain, cap, unusable)
    fallback = settings["fallback"]
    if not found.chosen.meets_budget and fallback and static:
        found.chosen, found.unusable_fallbacks = _fallback_ranges(search, found.chosen, fallback_ranges, cap)
    if not found.chosen.meets_budget and fallback and found.chosen.recipe.ranges in backend.range_methods:
        found.chosen = _kinds_in_float(search, found.chosen, getattr(backend, "op_fallbacks", ()))
    if not found.chosen.meets_budget and fallback and layers:
        search.log(f"  int8 misses its budget on {len(check)} held-out images: measuring layer sensitivity")
        with torch.no_grad():
            found.sensitivity = layer_sensitivity(
                model, layers, torch.cat(search.range_images[:16]), check[:8], reference[:8]
            )
        found.chosen, found.stopped = _layers_in_float(search, found.chosen, found.sensitivity.ranking(), cap)
        if found.chosen.recipe.float_kinds and found.chosen.recipe.float_layers and found.chosen.meets_budget:
            found.chosen = _without_kinds(search, found.chosen)
    return found


def _best_range_method(search: _Search, methods: tuple[str, ...]) -> tuple[Trial, dict[str, str]]:
    """Better ranges first: plain PTQ with every range method in `methods`, the best on the check images held and
    returned, with the methods that cannot measure this model and why (only when all fail does the error stand)."""
    tried: list[Trial] = []
    unusable: dict[str, str] = {}
    for i, method in enumerate(methods):
        try:
            candidate, trial = search.attempt(Recipe(method))
        except ValueError as error:  # e.g. ONNX Runtime's percentile histogram of a tensor with no range
            if not tried and i == len(methods) - 1:
                raise
            unusable[method] = f"{type(error).__name__}: {error}"
            search.log(f"  int8, {method} ranges cannot be measured on this model ({unusable[method]}): left out")
            continue
        tried.append(trial)
        if max(tried, key=Trial.rank) is trial:
            search.hold(trial, candidate)
        del candidate
    return max(tried, key=Trial.rank), unusable


def _fallback_ranges(
    search: _Search, chosen: Trial, methods: tuple[str, ...], cap: int
) -> tuple[Trial, dict[str, str]]:
    """Ranges a backend chooses only when its static ones miss (PT2E: per inference), every layer still int8; one
    is kept when within the cap and it beats `chosen`. Returns the trial chosen and the methods that cannot be used
    on this graph, with why (such a method must not fail a build that has another)."""
    unusable: dict[str, str] = {}
    for method in methods:
        try:
            candidate, trial = search.attempt(Recipe(method))
        except Exception as error:
            unusable[method] = f"{type(error).__name__}: {error}".splitlines()[0]
            search.log(f"  int8, {method} ranges cannot be used on this model ({unusable[method]}): left out")
            continue
        if len(trial.floated) > cap:  # layers the method cannot quantize count against the cap
            trial.over_cap = True
        elif trial.beats(chosen):
            chosen = trial
            search.hold(trial, candidate)
        del candidate
    return chosen, unusable


def _kinds_in_float(search: _Search, chosen: Trial, kinds: tuple[str, ...]) -> Trial:
    """Ops the backend quantizes beyond layers, each kind in float as a whole: an error spread over many small ops
    (a residual stream requantized at every block) that no few layers in float recover. A kind is kept when it
    beats the trial chosen so far; every kind is tried."""
    for kind in kinds:
        recipe = Recipe(chosen.recipe.ranges, float_kinds=chosen.recipe.float_kinds + (kind,))
        candidate, trial = search.attempt(recipe)
        if trial.beats(chosen):
            chosen = trial
            search.hold(trial, candidate)
        del candidate
    return chosen


def _layers_in_float(search: _Search, chosen: Trial, ranking: list[str], cap: int) -> tuple[Trial, str | None]:
    """The most sensitive layers in float, more at each step (_steps), re-measured each time, until the budget holds,
    the cap is reached or PATIENCE steps in a row gain less than MIN_GAIN_DB. Returns the trial chosen (when the
    budget is missed: the fewest float layers within MIN_GAIN_DB of the best) and why the search stopped short."""
    tried, stopped = [chosen], None
    best, stale = chosen.psnr_db, 0
    floated: list[str] = []
    for count in _steps(cap):
        if set(ranking[:count]) <= set(floated):  # already float beside an earlier layer: the same model
            continue
        search.held = None
        candidate, trial = search.attempt(
            Recipe(chosen.recipe.ranges, tuple(ranking[:count]), chosen.recipe.float_kinds)
        )
        floated = trial.floated
        if len(floated) > cap:  # the cap holds for every layer in float, those floated with a layer too
            trial.over_cap = True
            stopped = f"the next step keeps {len(floated)} layers in float, over the cap of {cap}"
            break
        search.hold(trial, candidate)
        del candidate
        tried.append(trial)
        if trial.meets_budget:
            break
        psnr = trial.psnr_db
        best, stale = max(best, psnr), (stale + 1 if psnr - best < MIN_GAIN_DB else 0)
        if stale == PATIENCE:
            stopped = f"{PATIENCE} steps in a row gained less than {MIN_GAIN_DB} dB"
            break
    if not tried[-1].meets_budget:
        # the budget was not met: float layers that did not buy MIN_GAIN_DB only cost speed
        top = max(t.psnr_db for t in tried)
        tried = [next(t for t in tried if t.psnr_db >= top - MIN_GAIN_DB)]
    return tried[-1], stopped


def _without_kinds(search: _Search, chosen: Trial) -> Trial:
    """The layers in float may meet the budget without the kinds in float: they go back to int8 then (float adds
    only cost speed)."""
    candidate, trial = search.attempt(Recipe(chosen.recipe.ranges, chosen.recipe.float_layers))
    if not trial.meets_budget:
        return chosen
    search.hold(trial, candidate)
    return trial


def _report(found: _Found, trials: list[Trial], backend: Backend, layer_count: int, check, start: float) -> dict:
    """The search as the manifest records it (details.quantization), after the calibration's own description."""
    chosen, sensitivity = found.chosen, found.sensitivity
    unusable = {**found.unusable, **found.unusable_fallbacks}
    fallback_ranges = _is_fallback(backend, chosen.recipe.ranges)
    report = {
        # where the search first had one: before the method chosen when a range method failed, else after it
        **({"range_methods_unusable": unusable} if found.unusable else {}),
        "calibration_method": backend.describe(chosen.recipe.ranges),
        **({"range_methods_unusable": unusable} if found.unusable_fallbacks and not found.unusable else {}),
        "float_ops": _float_ops(
            backend, list(chosen.recipe.float_layers), chosen.recipe.float_kinds, chosen.recipe.ranges
        ),
        "float_layers": [
            _layer_entry(n, sensitivity, n not in chosen.recipe.float_layers, fallback_ranges) for n in chosen.floated
        ],
        "int8_layers": layer_count - len(chosen.floated),
        "before": found.plain.to_json(),
        "after": chosen.to_json(),
        "meets_budget": chosen.meets_budget,
        "steps": [t.to_json() for t in trials],
        "sensitivity": None
        if sensitivity is None
        else {
            "output_psnr_db": {n: _rounded(v) for n, v in sensitivity.output_psnr_db.items()},
            "local_sqnr_db": {n: _rounded(v) for n, v in sensitivity.local_sqnr_db.items()},
            "images": min(8, len(check)),
        },
        "seconds": round(time.perf_counter() - start, 1),
    }
    if chosen.recipe.float_kinds:
        report["float_kinds"] = list(chosen.recipe.float_kinds)
    return report


def _missed_budget(found: _Found, settings, model, check, reference, task, budget: dict) -> dict:
    """Why the budget was missed (`note`), and how far eager itself moves when its input is perturbed about as
    much as one int8 rounding would (`perturbation`): under the budget's PSNR, the model amplifies small errors."""
    chosen = found.chosen
    why = (
        "fallback is off (--no-fallback)"
        if not settings["fallback"]
        else found.stopped or f"the cap of {found.cap} float layers was reached"
    )
    note = f"budget not met on the check images ({'; '.join(texts(chosen.metrics['reasons']))}): {why}"
    if found.sensitivity is not None:
        kept = len(chosen.recipe.float_layers)
        note += f"; kept the fewest float layers ({kept}) within {MIN_GAIN_DB} dB of the best step"
    moved = perturbed_psnr(model, check, reference, task)
    if moved < budget.get("psnr_db", -math.inf):
        note += (
            f"; eager itself, its input perturbed at {PERTURBATION_SNR_DB:g} dB SNR, is "
            f"{moved:.1f} dB from its own outputs, under the budget's {budget['psnr_db']:g} dB: "
            "the model amplifies small errors"
        )
    return {"note": note, "perturbation": {"input_snr_db": PERTURBATION_SNR_DB, "output_psnr_db": _rounded(moved)}}


def _judge(model: torch.nn.Module, check: torch.Tensor, check_labels, task, budget: dict):
    """Eager's outputs on the check images, the task, and a function scoring a candidate against them."""
    with torch.no_grad():
        reference = run_all(model, check)
    if task is None:  # callers from before tasks existed gave class logits
        task = Classification(reference.shape[1], tuple(check.shape[-2:]))
    with torch.no_grad():
        eager_accuracy = task.labeled(reference, check_labels) if check_labels is not None else None

    def judge(candidate: Candidate) -> dict:
        try:
            return task.quality(run_all(candidate, check), reference, check_labels, eager_accuracy, budget)
        except CandidateFailed as error:
            return {
                "fidelity": {task.agreement: 0.0, "psnr_db": -math.inf},
                "accuracy": None,
                "reasons": [Reason(Kind.DOES_NOT_RUN, f"does not run on every check image: {error}")],
            }

    return reference, task, judge


def lowered_quality(model: torch.nn.Module, load, calibration: Calibration) -> dict | None:
    """The lowered program (`load()` gives its runner) scored on the check images as the search scored its graph
    (None: no check images). A program that fails to load or run scores as the worst candidate.
    A lowering that changes the int8 model's numbers shows as a program missing a budget its graph met:
    ExecuTorch 1.5.1 lowered two dynamic int8 patterns wrong (docs/int8.md), and the search sees only graphs."""
    _, check_images, check_labels = calibration.split()
    if not check_images:
        return None
    _, task, judge = _judge(
        model, torch.cat(check_images), check_labels, calibration.task, calibration.budget_thresholds()
    )

    def program(x: torch.Tensor) -> torch.Tensor:
        try:
            return runner(x)
        except Exception as error:
            raise CandidateFailed(f"{type(error).__name__}: {error}".splitlines()[0]) from error

    try:
        runner = load()
    except Exception as error:
        runner = _raises(error)
    return _summary(task, judge(program))


def _raises(error: Exception):
    def run(_x):
        raise error

    return run


def lowering_broke(graph: dict, program: dict | None) -> bool:
    """The program misses the budget its graph met, and not by a rounding: it does not run, or it is more than
    MIN_GAIN_DB under its graph (a dynamic 1x1 conv's program differs from its graph by up to 0.7 dB either way)."""
    if program is None or program["meets_budget"] or not graph.get("meets_budget"):
        return False
    return program["psnr_db"] is None or graph["psnr_db"] is None or program["psnr_db"] < graph["psnr_db"] - MIN_GAIN_DB


def better(a: dict, b: dict) -> bool:
    """Whether score a ranks above score b: meeting the budget first, then PSNR."""
    return _rank(a) > _rank(b)


def perturbed_psnr(model: torch.nn.Module, images: torch.Tensor, reference: torch.Tensor, task) -> float:
    """PSNR of eager's outputs on `images` with Gaussian noise PERTURBATION_SNR_DB below them against `reference`."""
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
    noisy = images + noise * images.float().pow(2).mean().sqrt() * 10 ** (-PERTURBATION_SNR_DB / 20)
    with torch.no_grad():
        return task.fidelity(reference, run_all(model, noisy))["psnr_db"]


def _quantize(backend: Backend, recipe: Recipe, range_images):
    """backend.quantize, with the kinds only when there are some (a backend without op_fallbacks takes none)."""
    if recipe.float_kinds:
        return backend.quantize(list(recipe.float_layers), range_images, recipe.ranges, recipe.float_kinds)
    return backend.quantize(list(recipe.float_layers), range_images, recipe.ranges)


def _is_fallback(backend: Backend, method: str) -> bool:
    return method in getattr(backend, "fallback_range_methods", ())


def _closure(backend: Backend, float_layers: list[str], method: str) -> list[str]:
    """backend.float_closure, told the range method only when it is a fallback one (it may leave other layers float)."""
    if _is_fallback(backend, method):
        return backend.float_closure(float_layers, method)
    return backend.float_closure(float_layers)


def _float_ops(backend: Backend, float_layers: list[str], kinds: tuple[str, ...], method: str) -> dict[str, int]:
    """backend.float_ops, told the range method only when it is a fallback one (the others leave the same ops float)."""
    if _is_fallback(backend, method):
        return backend.float_ops(float_layers, kinds, method)
    return backend.float_ops(float_layers, kinds) if kinds else backend.float_ops(float_layers)


def _gain(metrics: dict, than: dict) -> float:
    return metrics["fidelity"]["psnr_db"] - than["fidelity"]["psnr_db"]


def _kinds_text(kinds: tuple[str, ...]) -> str:
    return f", every {', '.join(kinds)} float" if kinds else ""


def _rank(metrics: dict) -> tuple:
    """Which candidate is better: meeting the budget first, then PSNR against eager (metrics or their summary)."""
    if "fidelity" not in metrics:
        return metrics["meets_budget"], -math.inf if metrics["psnr_db"] is None else metrics["psnr_db"]
    return not metrics["reasons"], metrics["fidelity"]["psnr_db"]


def _layer_entry(name: str, sensitivity, not_asked: bool, fallback_ranges: bool = False) -> dict:
    entry = {
        "name": name,
        "output_psnr_db": _rounded(sensitivity.output_psnr_db.get(name) if sensitivity else None),
        "local_sqnr_db": _rounded(sensitivity.local_sqnr_db.get(name) if sensitivity else None),
    }
    if not_asked:
        entry["why"] = (
            "no int8 kernel for it with ranges chosen per inference (a depthwise conv, a conv reading a "
            "channel shuffle), or it feeds a float layer"
            if fallback_ranges
            else "feeds a float layer: the backend quantizes an op only together with its output"
        )
    return entry


def _rounded(value: float | None):
    if value is None:
        return None
    return None if math.isinf(value) or math.isnan(value) else round(value, 2)
