"""The validation contract, the same for every artifact of every target.

It knows nothing about formats: it takes runners (callables from a batch-1 tensor
to logits) and inputs, and returns plain dicts of metrics.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Mapping

import numpy as np
import torch

from .thresholds import breaches

Runner = Callable[[torch.Tensor], torch.Tensor]


def run_all(runner: Runner, inputs: torch.Tensor) -> torch.Tensor:
    """Outputs for every input, fed one at a time (batch 1, as exported)."""
    with torch.no_grad():
        return torch.cat([runner(inputs[i : i + 1]).detach().float().reshape(1, -1) for i in range(len(inputs))])


def fidelity(reference: torch.Tensor, output: torch.Tensor) -> dict:
    ref, out = reference.double(), output.double()
    diff = out - ref
    rmse = diff.pow(2).mean().sqrt().item()
    peak = ref.abs().max().item()
    k = min(5, ref.shape[1])
    ref_top1 = ref.argmax(1)
    return {
        "samples": int(ref.shape[0]),
        "top1_agreement": (out.argmax(1) == ref_top1).double().mean().item(),
        # the eager top-1 class is among the artifact's top-5
        "top5_agreement": (out.topk(k, 1).indices == ref_top1[:, None]).any(1).double().mean().item(),
        "psnr_db": math.inf if rmse == 0 else 20 * math.log10(peak / rmse),
        "cosine": torch.nn.functional.cosine_similarity(ref, out, dim=1).mean().item(),
        "max_abs_error": diff.abs().max().item(),
    }


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    k = min(5, logits.shape[1])
    top = logits.topk(k, 1).indices
    return {
        "acc1": 100.0 * (top[:, 0] == labels).double().mean().item(),
        "acc5": 100.0 * (top == labels[:, None]).any(1).double().mean().item(),
    }


def accuracy_vs_eager(eager: dict, artifact: dict) -> dict:
    return {
        "eager_acc1": eager["acc1"],
        "eager_acc5": eager["acc5"],
        "acc1": artifact["acc1"],
        "acc5": artifact["acc5"],
        "drop_points": eager["acc1"] - artifact["acc1"],
    }


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


def quality(outputs: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor | None, eager_accuracy: dict | None,
            thresholds: Mapping[str, float]) -> dict:
    """Fidelity against eager, labeled accuracy when there are labels, and the thresholds it breaks."""
    metrics = {"fidelity": fidelity(reference, outputs), "accuracy": None}
    if labels is not None and eager_accuracy is not None:
        metrics["accuracy"] = accuracy_vs_eager(eager_accuracy, accuracy(outputs, labels))
    metrics["reasons"] = breaches(metrics, thresholds)
    return metrics


def evaluate(
    runner: Runner,
    eager: Runner,
    inputs: torch.Tensor,
    reference: torch.Tensor,
    labels: torch.Tensor | None,
    eager_accuracy: dict | None,
    thresholds: Mapping[str, float],
    warmup: int,
    iterations: int,
) -> dict:
    """The whole contract for one runner against the eager reference."""
    metrics = quality(run_all(runner, inputs), reference, labels, eager_accuracy, thresholds)
    timing = measure_latency({"eager": eager, "artifact": runner}, inputs[:1], warmup, iterations)
    metrics["latency_ms"] = timing["artifact"]
    metrics["eager_latency_ms"] = timing["eager"]
    metrics["speedup_vs_eager"] = timing["eager"]["p50"] / timing["artifact"]["p50"]
    metrics["status"] = "failed" if metrics["reasons"] else "passed"
    return metrics
