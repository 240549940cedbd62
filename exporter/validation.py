"""The validation contract, the same for every artifact of every target.

It knows nothing about formats: it takes runners (callables from a batch-1 tensor to the graph's
output) and inputs, asks the task (exporter.tasks) for the metrics, and returns plain dicts.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Mapping

import numpy as np
import torch

from .tasks import Task

Runner = Callable[[torch.Tensor], torch.Tensor]


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
    samples: dict[str, list[float]] = {name: [] for name in runners}
    per_round = max(1, math.ceil(iterations / rounds))
    with torch.no_grad():
        for run in runners.values():
            for _ in range(warmup):
                run(example)
        for _ in range(rounds):
            for name, run in runners.items():
                for _ in range(per_round):
                    start = time.perf_counter()
                    run(example)
                    samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: percentiles(s) for name, s in samples.items()}


def evaluate(
    task: Task,
    runner: Runner,
    eager: Runner,
    inputs: torch.Tensor,
    reference: torch.Tensor,
    labels: torch.Tensor | None,
    eager_accuracy: dict | None,
    thresholds: Mapping[str, float],
    warmup: int,
    iterations: int,
    timed: bool = True,
) -> tuple[dict, torch.Tensor]:
    """The whole contract for one runner against the eager reference: (metrics, the runner's outputs).
    Untimed for stand-ins whose speed says nothing about the runtime they stand in for."""
    outputs = run_all(runner, inputs)
    metrics = task.quality(outputs, reference, labels, eager_accuracy, thresholds)
    metrics["status"] = "failed" if metrics["reasons"] else "passed"
    if not timed:
        metrics.update(latency_ms=None, eager_latency_ms=None, speedup_vs_eager=None)
        return metrics, outputs
    timing = measure_latency({"eager": eager, "artifact": runner}, inputs[:1], warmup, iterations)
    metrics["latency_ms"] = timing["artifact"]
    metrics["eager_latency_ms"] = timing["eager"]
    metrics["speedup_vs_eager"] = timing["eager"]["p50"] / timing["artifact"]["p50"]
    return metrics, outputs
