"""Turn an accuracy budget into an int8 model: plain PTQ first, then the most sensitive layers back
in float, re-measured after each step, until the budget holds on held-out calibration images or the
cap on float layers is reached. Backends (PT2E, ONNX Q/DQ) only know how to quantize a graph with a
given set of layers left in float; the search, the budget and the report are the same for all."""

from __future__ import annotations

import math
import time
from typing import Protocol

import torch

from ..tasks import Classification
from ..validation import run_all
from .calibration import STATIC_RANGES, Calibration
from .sensitivity import layer_sensitivity


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


def quantize_with_budget(model: torch.nn.Module, backend: Backend, calibration: Calibration) -> tuple[Candidate, dict]:
    """The chosen int8 candidate and what was done to get it (for the manifest)."""
    start, log, task = time.perf_counter(), calibration.log, calibration.task
    range_images, check_images, check_labels = calibration.split()
    budget = calibration.budget_thresholds()
    layers = backend.layers()
    check = torch.cat(check_images) if check_images else None
    report = {**calibration.describe(getattr(backend, "settings", ())), "layers": len(layers)}
    if check is None:
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

    reference, task, judge = _judge(model, check, check_labels, task, budget)

    def attempt(float_layers: list[str], method: str, kinds: tuple[str, ...] = ()):
        candidate = _quantize(backend, float_layers, range_images, method, kinds)
        metrics = judge(candidate)
        in_float = len(_closure(backend, float_layers, method))  # with the producers XNNPACK needs float beside them
        steps.append(
            {
                "float_layers": in_float,
                "ranges": method,
                **({"float_kinds": list(kinds)} if kinds else {}),
                **_summary(task, metrics),
            }
        )
        log(
            f"  int8, {method} ranges, {in_float}/{len(layers)} layers float{_kinds_text(kinds)}: "
            f"{metrics['fidelity']['psnr_db']:.1f} dB, agreement {task.headline(metrics)['agreement']:.3f}"
            + ("" if metrics["reasons"] else ", budget met")
        )
        return candidate, metrics

    steps: list[dict] = []
    # One candidate is alive at a time (two while the next is made): each holds a runtime session or a
    # quantized copy of the model, and every step's used to be kept to the end (MViT-V2-S's Q/DQ search, 16
    # frames at 224²: letting the candidates go took the process from 5.0 to 3.4 GB). One chosen after it
    # was let go is made again (quantization is deterministic; the ONNX backend keeps its files).
    held: tuple[list[str], Candidate, str, tuple] | None = None  # (float layers, candidate, range method, kinds)
    # better ranges first: every range method on plain PTQ, the best on the check images goes on
    trials, unusable = {}, {}
    allowed = calibration.settings.get("dynamic_ranges", True)
    fallback_ranges = getattr(backend, "fallback_range_methods", ()) if allowed else ()
    static = calibration.settings.get(STATIC_RANGES, True) or not fallback_ranges
    methods = backend.range_methods if static else fallback_ranges
    for i, method in enumerate(methods):
        try:
            candidate, trials[method] = attempt([], method)
        except ValueError as error:  # e.g. ONNX Runtime's percentile histogram of a tensor with no range
            if not trials and i == len(methods) - 1:
                raise
            unusable[method] = f"{type(error).__name__}: {error}"
            log(f"  int8, {method} ranges cannot be measured on this model ({unusable[method]}): left out")
            continue
        if max(trials, key=lambda m: _rank(trials[m])) == method:
            held = ([], candidate, method, ())
        del candidate
    if unusable:
        report["range_methods_unusable"] = unusable
    method = max(trials, key=lambda m: _rank(trials[m]))
    cap = math.floor(calibration.settings["max_float_fraction"] * len(layers))
    if not static and len(_closure(backend, [], method)) > cap:  # as a fallback over the cap is never chosen
        raise ValueError(
            f"{method} ranges leave {len(_closure(backend, [], method))} layers in float, over the cap of {cap}"
        )
    metrics = trials[method]
    plain = steps[list(trials).index(method)]
    report["calibration_method"] = backend.describe(method)
    float_layers: list[str] = []
    chosen = plain
    kinds: tuple[str, ...] = ()
    if metrics["reasons"] and calibration.settings["fallback"] and static:
        # ranges a backend chooses only when its static ones miss: every layer stays int8
        for extra in fallback_ranges:
            try:
                candidate, trial = attempt([], extra)
            except Exception as error:  # a fallback that cannot quantize this graph must not fail a build that has one
                unusable[extra] = f"{type(error).__name__}: {error}".splitlines()[0]
                report["range_methods_unusable"] = unusable
                log(f"  int8, {extra} ranges cannot be used on this model ({unusable[extra]}): left out")
                continue
            if len(_closure(backend, [], extra)) > cap:  # layers the method cannot quantize count against the cap
                steps[-1]["over_cap"] = True
            elif _rank(trial) > _rank(metrics) and (not trial["reasons"] or _gain(trial, metrics) >= MIN_GAIN_DB):
                method, metrics, chosen, held = extra, trial, steps[-1], ([], candidate, extra, ())
                report["calibration_method"] = backend.describe(extra)
            del candidate
    if metrics["reasons"] and calibration.settings["fallback"] and method in backend.range_methods:
        # ops the backend quantizes beyond layers, each kind in float as a whole: an error spread over many
        # small ops (a residual stream requantized at every block) that no few layers in float recover
        for kind in getattr(backend, "op_fallbacks", ()):
            candidate, trial = attempt([], method, kinds + (kind,))
            if _rank(trial) > _rank(metrics) and (not trial["reasons"] or _gain(trial, metrics) >= MIN_GAIN_DB):
                kinds, metrics, chosen, held = (
                    kinds + (kind,),
                    trial,
                    steps[-1],
                    ([], candidate, method, kinds + (kind,)),
                )
            del candidate
    sensitivity, stopped = None, None
    if metrics["reasons"] and calibration.settings["fallback"] and layers:
        log(f"  int8 misses its budget on {len(check)} held-out images: measuring layer sensitivity")
        with torch.no_grad():
            sensitivity = layer_sensitivity(model, layers, torch.cat(range_images[:16]), check[:8], reference[:8])
        ranking = sensitivity.ranking()
        tried = [([], metrics, chosen)]
        best, stale = metrics["fidelity"]["psnr_db"], 0
        floated: list[str] = []
        for count in _steps(cap):
            if set(ranking[:count]) <= set(floated):  # already float beside an earlier layer: the same model
                continue
            held = None
            candidate, step_metrics = attempt(ranking[:count], method, kinds)
            floated = _closure(backend, ranking[:count], method)
            if len(floated) > cap:  # the cap holds for every layer in float, those floated with a layer too
                steps[-1]["over_cap"] = True
                stopped = f"the next step keeps {len(floated)} layers in float, over the cap of {cap}"
                break
            held = (ranking[:count], candidate, method, kinds)
            del candidate
            tried.append((ranking[:count], step_metrics, steps[-1]))
            psnr = step_metrics["fidelity"]["psnr_db"]
            if not step_metrics["reasons"]:
                break
            best, stale = max(best, psnr), (stale + 1 if psnr - best < MIN_GAIN_DB else 0)
            if stale == PATIENCE:
                stopped = f"{PATIENCE} steps in a row gained less than {MIN_GAIN_DB} dB"
                break
        if tried[-1][1]["reasons"]:
            # the budget was not met: float layers that did not buy MIN_GAIN_DB only cost speed
            top = max(t[1]["fidelity"]["psnr_db"] for t in tried)
            tried = [next(t for t in tried if t[1]["fidelity"]["psnr_db"] >= top - MIN_GAIN_DB)]
        float_layers, metrics, chosen = tried[-1]
        if kinds and float_layers and not metrics["reasons"]:
            # the layers may meet the budget without the adds: they stay int8 then (float adds only cost speed)
            candidate, trial = attempt(float_layers, method)
            if not trial["reasons"]:
                kinds, metrics, chosen, held = (), trial, steps[-1], (float_layers, candidate, method, ())
            del candidate
    if held is not None and (held[0], held[2], held[3]) == (float_layers, method, kinds):
        candidate = held[1]
    else:
        candidate = _quantize(backend, float_layers, range_images, method, kinds)
    kept = _closure(backend, float_layers, method)
    report.update(
        float_ops=_float_ops(backend, float_layers, kinds, method),
        float_layers=[_layer_entry(n, sensitivity, n not in float_layers, _is_fallback(backend, method)) for n in kept],
        int8_layers=len(layers) - len(kept),
        before=plain,
        after=chosen,
        meets_budget=not metrics["reasons"],
        steps=steps,
        sensitivity=None
        if sensitivity is None
        else {
            "output_psnr_db": {n: _rounded(v) for n, v in sensitivity.output_psnr_db.items()},
            "local_sqnr_db": {n: _rounded(v) for n, v in sensitivity.local_sqnr_db.items()},
            "images": min(8, len(check)),
        },
        seconds=round(time.perf_counter() - start, 1),
    )
    if kinds:
        report["float_kinds"] = list(kinds)
    if metrics["reasons"]:
        why = (
            "fallback is off (--no-fallback)"
            if not calibration.settings["fallback"]
            else stopped
            or f"the cap of {math.floor(calibration.settings['max_float_fraction'] * len(layers))} float layers was reached"
        )
        report["note"] = f"budget not met on the check images ({'; '.join(metrics['reasons'])}): {why}"
        if sensitivity is not None:
            report["note"] += (
                f"; kept the fewest float layers ({len(float_layers)}) within {MIN_GAIN_DB} dB of the best step"
            )
        moved = perturbed_psnr(model, check, reference, task)
        report["perturbation"] = {"input_snr_db": PERTURBATION_SNR_DB, "output_psnr_db": _rounded(moved)}
        if moved < budget.get("psnr_db", -math.inf):
            report["note"] += (
                f"; eager itself, its input perturbed at {PERTURBATION_SNR_DB:g} dB SNR, is "
                f"{moved:.1f} dB from its own outputs, under the budget's {budget['psnr_db']:g} dB: "
                "the model amplifies small errors"
            )
    return candidate, report


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
                "reasons": [f"does not run on every check image: {error}"],
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


def _quantize(backend: Backend, float_layers: list[str], range_images, method: str, kinds: tuple[str, ...]):
    """backend.quantize, with `kinds` only when there are some (a backend without op_fallbacks takes none)."""
    if kinds:
        return backend.quantize(float_layers, range_images, method, kinds)
    return backend.quantize(float_layers, range_images, method)


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
