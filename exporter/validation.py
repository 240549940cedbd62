"""The validation contract, the same for every artifact of every target.

It knows nothing about formats: it takes runners (callables from a batch-1 tensor to the graph's
output) and inputs, asks the task (exporter.tasks) for the metrics, and returns plain dicts (the build's eager
baseline, timed once: results.EagerBaseline).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from . import hostload
from .results import BaselineSpread, EagerBaseline, Kind, Latency, Reason, Status
from .tasks import Task
from .thresholds import MIN_INPUTS, THRESHOLD_KEYS, breaches

Runner = Callable[[torch.Tensor], torch.Tensor]
# what a cached validation holds (2: outlier_inputs; 3: reasons with kinds, an ill-conditioned reference named among
# them; 4: latency against the build's one eager baseline, each runner's rounds kept); a new one is not served an older
# record
CONTRACT = 4


def run_all(runner: Runner, inputs: torch.Tensor) -> torch.Tensor:
    """Outputs for every input, fed one at a time (batch 1, as exported)."""
    with torch.no_grad():
        return torch.cat([runner(inputs[i : i + 1]).detach().float().reshape(1, -1) for i in range(len(inputs))])


def percentiles(samples_ms: list[float]) -> dict:
    a = np.asarray(samples_ms)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "iterations": int(a.size),
    }


def measure_latency(
    runners: Mapping[str, Runner], example: torch.Tensor, warmup: int, iterations: int, rounds: int = 5
) -> dict[str, dict]:
    """Latency of several runners on the same input, interleaved in rounds so that
    drift on the host (thermal, other load) hits all of them alike."""
    return measure_latency_on_host(runners, example, warmup, iterations, rounds)[0]


def measure_latency_on_host(
    runners: Mapping[str, Runner],
    example: torch.Tensor,
    warmup: int,
    iterations: int,
    rounds: int = 5,
    examples: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, dict], dict]:
    """measure_latency, plus what the host did over the timed rounds (hostload.conditions, with each runner's p90/p50
    as `spread`, the p50 of each of its rounds as `rounds_p50_ms` and their max/min as `round_spread`; not yet
    judged). Before each runner's turn, hostload.settle waits for the process's other threads to stop (a runtime's
    workers spin after its last call, on the cores the next runner needs); any still running are named in
    `unsettled`. Interleaving protects a ratio from slow drift only: when other processes oversubscribe the cores,
    runtimes that use threads differently lose different shares.
    `examples`: a runner's own input (the same image as it takes it), where it is not `example`."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    fed = {name: (examples or {}).get(name, example) for name in runners}
    per_round = max(1, math.ceil(iterations / rounds))
    unsettled: set[str] = set()
    with torch.no_grad():
        for name, run in runners.items():
            for _ in range(warmup):
                run(fed[name])
        with hostload.Window() as window:
            for _ in range(rounds):
                for name, run in runners.items():
                    unsettled.update(hostload.settle() or ())
                    x = fed[name]
                    for _ in range(per_round):
                        start = time.perf_counter()
                        run(x)
                        samples[name].append((time.perf_counter() - start) * 1e3)
    timing = {name: percentiles(s) for name, s in samples.items()}
    by_round = {name: _round_p50s(s, per_round) for name, s in samples.items()}
    return timing, {
        **window.conditions,
        "spread": {name: hostload.spread(t) for name, t in timing.items()},
        "rounds_p50_ms": by_round,
        "round_spread": {name: hostload.round_spread(p50s) for name, p50s in by_round.items()},
        "unsettled": sorted(unsettled),
    }


def _round_p50s(samples_ms: list[float], per_round: int) -> list[float]:
    return [round(float(np.median(samples_ms[i : i + per_round])), 4) for i in range(0, len(samples_ms), per_round)]


def eager_baseline(
    eager: Runner,
    example: torch.Tensor,
    warmup: int,
    iterations: int,
    threads: int | None = None,
    max_spread: float | None = None,
) -> EagerBaseline:
    """Eager timed alone, in rounds, each after the process's other threads stopped: the one baseline of a build.
    Timed beside an artifact instead, eager's p50 moved with that window (issue 77: 6.55 to 11.33 ms across the rows
    of one build, each judged reliable), and every row had a baseline of its own."""
    threads = threads or torch.get_num_threads()
    timing, conditions = measure_latency_on_host({"eager": eager}, example, warmup, iterations)
    rounds = conditions["rounds_p50_ms"]["eager"]
    return EagerBaseline(
        timing["eager"], rounds, hostload.round_spread(rounds), hostload.judged(conditions, threads, max_spread)
    )


def latency_against_eager(
    runner: Runner,
    eager: Runner,
    example: torch.Tensor,
    warmup: int,
    iterations: int,
    threads: int | None = None,
    max_spread: float | None = None,
    fed: torch.Tensor | None = None,
    baseline: EagerBaseline | None = None,
) -> dict:
    """The contract's latency fields for one runner timed beside eager (the same threads, interleaved rounds):
    latency_ms, eager_latency_ms, speedup_vs_eager (as measured, whatever the host did) and latency_conditions,
    judged with `threads` (torch's current setting when None) and the profile's `max_spread`. Status never depends
    on any of them. With the build's `baseline`, eager_latency_ms and the speedup are the baseline's
    (against_baseline); without one, eager's as timed beside the runner. `fed`: the same image as the runner takes
    it, where that is not `example` (uint8-nhwc)."""
    threads = threads or torch.get_num_threads()
    timing, conditions = measure_latency_on_host(
        {"eager": eager, "artifact": runner},
        example,
        warmup,
        iterations,
        examples=None if fed is None else {"artifact": fed},
    )
    artifact, eager_beside = Latency.from_json(timing["artifact"]), Latency.from_json(timing["eager"])
    measured = {"latency_ms": artifact, "eager_latency_ms": eager_beside}
    if baseline is not None:
        conditions = {**conditions, "eager_beside_ms": timing["eager"]}
        return against_baseline({**measured, "latency_conditions": conditions}, baseline, threads, max_spread)
    return {
        **measured,
        "speedup_vs_eager": eager_beside.p50 / artifact.p50,
        "latency_conditions": hostload.judged(conditions, threads, max_spread),
    }


def against_baseline(latency: Mapping, baseline: EagerBaseline, threads: int, max_spread: float | None = None) -> dict:
    """A runner's latency fields (latency_against_eager's, or a cached validation's) restated against the build's
    eager baseline: eager_latency_ms is the baseline's, the speedup divides its p50, and the conditions are judged
    again with eager's round spread taken over the baseline's rounds and eager's rounds beside this runner (a window
    where eager ran slower or faster than when the baseline was timed makes the ratio unreliable), and with the
    baseline's own reasons when it was timed on a busy host."""
    conditions = dict(latency["latency_conditions"])
    beside = (conditions.get("rounds_p50_ms") or {}).get("eager") or []
    conditions["round_spread"] = {
        **(conditions.get("round_spread") or {}),
        "eager": hostload.round_spread(baseline.rounds_p50_ms + beside),
    }
    conditions.pop("baseline_reasons", None)
    if not baseline.reliable:
        conditions["baseline_reasons"] = list(baseline.conditions.get("reasons") or ["host busy"])
    for key in ("reliable", "reasons"):
        conditions.pop(key, None)
    artifact = Latency.from_json(latency["latency_ms"])
    return {
        "latency_ms": artifact,
        "eager_latency_ms": baseline.latency_ms,
        "speedup_vs_eager": baseline.p50 / artifact.p50,
        "latency_conditions": hostload.judged(conditions, threads, max_spread),
    }


def build_spread(baseline: EagerBaseline, beside: list[list[float]]) -> EagerBaseline:
    """The baseline with `build`: how far eager's p50 moved over every round of the build, the baseline's and
    those timed beside each artifact (`beside`, one list of round p50s per timed artifact)."""
    rounds = baseline.rounds_p50_ms + [p50 for artifact in beside for p50 in artifact]
    build = BaselineSpread(
        rounds=len(rounds),
        artifacts=len(beside),
        p50_range_ms=[min(rounds), max(rounds)],
        round_spread=hostload.round_spread(rounds),
    )
    return dataclasses.replace(baseline, build=build)


NEAR_CONSTANT_DB = 40.0  # eager's outputs vary by less than 1 % of their peak across the inputs


def blind_spot(task: Task, reference: torch.Tensor, thresholds: Mapping[str, float]) -> str | None:
    """Why these fidelity thresholds cannot judge an artifact against this eager reference, or None.

    The reference barely varies across the inputs (a zero-initialised head, a collapsed random model: eager's
    mean output is within NEAR_CONSTANT_DB of every row), and an artifact that ignored its input and returned
    that mean for every image would pass them, so a pass would be a verdict on nothing. Thresholds that pass
    anything on a reference that does vary (e.g. set to 0 on purpose) are the user's choice, not flagged."""
    limits = _fidelity_limits(thresholds)
    if not limits:
        return None
    if len(reference) < MIN_INPUTS:
        return (
            f"fidelity not measurable on {len(reference)} validation input: whether eager's outputs vary "
            f"across inputs, and so whether agreement with them means anything, takes two or more"
        )
    constant = reference.double().mean(0, keepdim=True).expand_as(reference).float()
    fidelity = task.fidelity(reference, constant)
    if fidelity["psnr_db"] < NEAR_CONSTANT_DB or breaches({"fidelity": fidelity}, limits):
        return None
    return (
        f"fidelity not measurable: degenerate eager reference (its outputs barely vary across the "
        f"{len(reference)} validation inputs: returning their mean for every input passes "
        f"{', '.join(sorted(limits))} too)"
    )


# An input whose RMS error is this many times the median input's is one the artifact fails alone: the rounding of an
# int8 artifact spreads within a few times the median (at most 5.8x on the trained stand-ins' int8 floors: MNASNet,
# RegNet, torchvision's quantized MobileNets), while inputs past the calibration's ranges, clipped, reach 25-36x
# (the trained EfficientNets: eager's logits on them 20x the median input's).
OUTLIER_RATIO = 10.0
MAX_OUTLIER_SHARE = 0.1  # more inputs than this over the ratio is an error spread, not a few inputs


def outlier_inputs(task: Task, outputs: torch.Tensor, reference: torch.Tensor, thresholds: Mapping[str, float]):
    """When a few inputs carry an artifact's error, which ones and what the rest measure, or None: the rows (worst
    first) whose error (the task's raw departure: RMS, after a detector's rows are aligned) is over OUTLIER_RATIO
    times the median row's (any error, where most rows have none), their share of the squared error, how far
    eager's outputs on them peak past the median row's, and the task's fidelity on the other rows, judged with
    the same fidelity thresholds."""
    if len(reference) < 2:
        return None
    rms = list(task.departure(reference, outputs).values())[-1].double()
    squared = rms.pow(2)
    if not torch.isfinite(squared).all() or squared.sum() == 0:
        return None
    median = rms.median()
    far = rms > OUTLIER_RATIO * median
    count = int(far.sum())
    if count == 0 or count > MAX_OUTLIER_SHARE * len(rms):
        return None
    peaks = reference.double().reshape(len(reference), -1).abs().amax(1)
    fidelity = _measured(task.fidelity(reference[~far], outputs[~far]), False)
    return {
        "rows": [int(i) for i in rms.argsort(descending=True)[:count]],
        "of": len(rms),
        "error_share": round(float(squared[far].sum() / squared.sum()), 4),
        "rms_over_median": {"over": OUTLIER_RATIO, "max": round(float(rms.max() / median), 1) if median > 0 else None},
        "peak_over_median": round(float(peaks[far].max() / peaks.median()), 1) if peaks.median() > 0 else None,
        "fidelity_without": fidelity,
        "thresholds_met_without": not breaches({"fidelity": fidelity}, _fidelity_limits(thresholds)),
    }


def _fidelity_limits(thresholds: Mapping[str, float]) -> dict:
    return {k: v for k, v in thresholds.items() if THRESHOLD_KEYS[k][0][0] == "fidelity"}


def judge(
    task: Task,
    outputs: torch.Tensor,
    reference: torch.Tensor,
    labels: torch.Tensor | None,
    eager_accuracy: dict | None,
    thresholds: Mapping[str, float],
) -> dict:
    """Fidelity and accuracy of outputs already computed (one flattened row per input, as run_all makes them)
    against the eager reference, with the status they earn: the contract without running or timing anything."""
    broken = not_finite(outputs, reference)
    metrics = _measured(task.quality(outputs, reference, labels, eager_accuracy, thresholds), bool(broken))
    if broken:
        metrics["reasons"].insert(0, Reason(Kind.NON_FINITE, broken))
    blind = blind_spot(task, reference, thresholds)
    if blind:  # too few inputs to tell, or a reference that barely varies
        metrics["reasons"].append(
            Reason(Kind.TOO_FEW_INPUTS if len(reference) < MIN_INPUTS else Kind.DEGENERATE_REFERENCE, blind)
        )
    metrics["status"] = Status.FAILED if metrics["reasons"] else Status.PASSED
    fidelity_broken = breaches({"fidelity": metrics["fidelity"]}, _fidelity_limits(thresholds))
    outliers = None if broken or blind or not fidelity_broken else outlier_inputs(task, outputs, reference, thresholds)
    if outliers:
        metrics["outlier_inputs"] = outliers
    return metrics


def not_finite(outputs: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Why outputs with NaN or infinity where eager's are finite fail (an fp16 graph that overflowed), or None.
    No threshold can say it: a NaN compares false with every limit."""
    bad = ~torch.isfinite(outputs) & torch.isfinite(reference)
    if not bad.any():
        return None
    rows = int(bad.reshape(len(bad), -1).any(1).sum())
    return (
        f"outputs not finite: {int(bad.sum())} of {bad.numel()} values are NaN or infinite where eager's are "
        f"finite ({rows} of {len(bad)} inputs)"
    )


def _measured(value, outputs_broken: bool):
    """The metrics with NaN as None: not measurable, as JSON can say it; when the outputs were not finite, their
    infinite metrics too (a PSNR of inf is a perfect match only between finite outputs)."""
    if isinstance(value, float) and (math.isnan(value) or outputs_broken and math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _measured(v, outputs_broken) for k, v in value.items()}
    if isinstance(value, list):
        return [_measured(v, outputs_broken) for v in value]
    return value


@dataclass(frozen=True)
class EagerReference:
    """What every artifact of a build is evaluated against: the task, eager (as a runner), the validation inputs
    and eager's outputs on them (one flattened row per input, as run_all makes them), the labels and eager's
    labeled accuracy when there are labels, how the latency is timed (warm-up runs, timed iterations) and, where a
    build shares one, the eager baseline every artifact's speedup divides (a callable: timed on first use)."""

    task: Task
    eager: Runner
    inputs: torch.Tensor
    outputs: torch.Tensor
    labels: torch.Tensor | None = None
    eager_accuracy: dict | None = None
    warmup: int = 0
    iterations: int = 0
    baseline: Callable[[], EagerBaseline] | None = None


def non_finite_inputs(outputs: torch.Tensor) -> int:
    """How many inputs (rows of `outputs`, as run_all makes them) have a NaN or infinite output."""
    return int((~torch.isfinite(outputs.reshape(len(outputs), -1))).any(1).sum())


def evaluate(
    reference: EagerReference,
    runner: Runner,
    thresholds: Mapping[str, float],
    timed: bool = True,
    max_spread: float | None = None,
    fed: torch.Tensor | None = None,
) -> tuple[dict, torch.Tensor]:
    """The whole contract for one runner against the eager reference: (metrics, the runner's outputs).
    Untimed for stand-ins whose speed says nothing about the runtime they stand in for. The latency is judged
    (hostload.judge) with torch's thread setting on entry, the build's, and `max_spread`; it never sets status.
    `fed`: the validation inputs as the runner takes them (uint8-nhwc bytes), where that is not as eager does."""
    threads = torch.get_num_threads()  # the build's setting, before a runtime can change it
    fed = reference.inputs if fed is None else fed
    outputs = run_all(runner, fed)
    metrics = judge(reference.task, outputs, reference.outputs, reference.labels, reference.eager_accuracy, thresholds)
    if not timed:
        metrics.update(latency_ms=None, eager_latency_ms=None, speedup_vs_eager=None)
        return metrics, outputs
    metrics.update(
        latency_against_eager(
            runner,
            reference.eager,
            reference.inputs[:1],
            reference.warmup,
            reference.iterations,
            threads,
            max_spread,
            fed[:1],
            reference.baseline() if reference.baseline else None,
        )
    )
    return metrics, outputs
