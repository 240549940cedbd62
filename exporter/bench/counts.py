"""The bench's ARM columns: emulated aarch64 instructions per inference of every bench artifact and of eager, at one
thread, on named cores (exporter.aarch64.counting): the comparison x86's NCHWc kernels distort, made on the ISA the
devices run. A count is not time (no caches, no pipeline); it ranks one engine's files on one core, engines against
each other loosely (under COUNT_TIE a tie) and only on an out-of-order core (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

from ..aarch64 import counting
from ..engine import profiles
from ..release.recommend import COUNT_TIE
from ..errors import UsageError
from .rows import ORT_OWN_INT8

UNIT = "emulated aarch64 instructions per inference, one thread (qemu TCG plugin): not time"
WARMUP, RUNS = 1, 2  # on the example, then two other images: three inputs, the counted two on images of their own
# (name, a, b): how many times fewer instructions a executes than b, on one core
RATIOS = [
    ("pte fp32 vs ORT fp32", "pte fp32", "onnx fp32 (ORT)"),
    ("pte fp32 vs tflite fp32", "pte fp32", "tflite fp32"),
    ("pte int8 vs ORT int8", "pte int8 plain", "onnx int8 plain (ORT)"),
    ("pte int8 vs ORT's own int8", "pte int8 plain", ORT_OWN_INT8),
    ("pte int8 vs tflite int8", "pte int8 plain", "tflite int8 plain"),
    ("pte int8 vs pte fp32", "pte int8 plain", "pte fp32"),
    ("pte fp16 vs pte fp32", "pte fp16", "pte fp32"),
    ("tflite fp16 vs tflite fp32", "tflite fp16", "tflite fp32"),
    ("pte fp16 vs tflite fp16", "pte fp16", "tflite fp16"),
    ("pte dynamic vs pte fp32", "pte int8 dynamic", "pte fp32"),
    ("tflite dynamic vs tflite fp32", "tflite int8 dynamic", "tflite fp32"),
    ("eager / pte fp32", "pte fp32", "eager"),
]


def profile_cpus(targets=("android", "jetson")) -> list[str]:
    """The emulated cores the targets' profiles validate on, reference cores first."""
    loaded = [profiles.load(t).get("validate", {}) for t in targets]
    cpus = [v["reference_cpu"] for v in loaded if v.get("reference_cpu")]
    cpus += [cpu for v in loaded for cpu in v.get("cpus", [])]
    return list(dict.fromkeys(cpus))


class ArmCounter:
    """The runner and counting qemu, set up once for a bench run; `unavailable` says why when either cannot be."""

    def __init__(self, cpus: list[str], log, offline: bool | None = None):
        from ..aarch64 import counter, runner

        self.cpus, self.log, self.runner, self.counter, self.unavailable = cpus, log, None, None, None
        try:
            self.runner = runner.prepare(offline=offline)
            self.counter = counter.prepare(offline=offline)
            self.cpus = counting.named.check(cpus, self.runner.cpus)
        except UsageError as e:
            self.unavailable = str(e)
            log(f"ARM instruction counts: unavailable ({e})")

    def count(self, name: str, model, artifacts: dict[str, Path], images) -> dict:
        """{"unit", "cpus": {cpu: {label: per_inference}}, "spread": worst, "failed": {...}} for eager (`model`) and
        every runtime label's artifact that the runner can load, one emulated process per core."""
        if self.unavailable:
            return {"unavailable": self.unavailable}
        items = {"eager": model}
        items.update({label: path for label, path in artifacts.items() if path.suffix in counting.SUFFIXES})
        per_cpu, failed, spread = {}, {}, 0.0
        for cpu in self.cpus:
            try:
                results = counting.count_many(
                    self.runner, self.counter, list(items.values()), images, cpu, WARMUP, RUNS
                )
            except UsageError as e:
                failed.update({f"{label} on {cpu}": str(e) for label in items})
                continue
            counts = per_cpu[cpu] = {}
            seconds = next((r.seconds for r in results if isinstance(r, counting.Counts)), None)
            for label, result in zip(items, results, strict=True):
                if isinstance(result, counting.Failed):
                    failed[f"{label} on {cpu}"] = result.reason
                else:
                    counts[label] = result.per_inference
                    spread = max(spread, result.spread)
            self.log(
                f"  {name}: counted on {cpu}: "
                + ", ".join(f"{label} {n / 1e6:.1f} M" for label, n in counts.items())
                + f" ({seconds} s)"
            )
        return {"unit": UNIT, "cpus": per_cpu, "spread": round(spread, 6), "failed": failed}


def ratios(counts: dict) -> dict[str, float]:
    """RATIOS on one core: how many times fewer instructions a executes than b."""
    return {name: round(counts[b] / counts[a], 3) for name, a, b in RATIOS if counts.get(a) and counts.get(b)}


def table(results: dict, labels: list[str]) -> list[str]:
    """Per core, a table of millions of instructions per inference by model and runtime, and the RATIOS."""
    counted = {m: r["instructions"] for m, r in results.items() if r.get("instructions")}
    if not counted:
        return []
    lines = ["", f"ARM columns: {UNIT}. Counted on three inputs (one warm-up, two counted). Ratios are count ratios:"]
    lines.append(f"runtimes within {COUNT_TIE:g}× of each other are a tie; only an out-of-order core ranks runtimes.")
    for model, c in counted.items():
        if "unavailable" in c:
            lines.append(f"- {model}: unavailable ({c['unavailable']})")
        elif c["failed"]:
            lines.append(f"- {model}: not counted: " + "; ".join(f"{k}: {v}" for k, v in c["failed"].items()))
    cpus = list(dict.fromkeys(cpu for c in counted.values() for cpu in c.get("cpus", {})))
    for cpu in cpus:
        columns = ["eager"] + [
            label for label in labels if any(label in c.get("cpus", {}).get(cpu, {}) for c in counted.values())
        ]
        lines += [
            "",
            f"emulated instructions per inference on {cpu}, millions:",
            "",
            "| model | " + " | ".join(columns) + " | " + " | ".join(n for n, *_ in RATIOS) + " |",
            "|---|" + "---|" * (len(columns) + len(RATIOS)),
        ]
        for model, c in counted.items():
            counts = c.get("cpus", {}).get(cpu)
            if not counts:
                continue
            ratio = ratios(counts)
            lines.append(
                f"| {model} | "
                + " | ".join(f"{counts[label] / 1e6:.1f}" if label in counts else "—" for label in columns)
                + " | "
                + " | ".join(f"{ratio[n]:.2f}×" if n in ratio else "—" for n, *_ in RATIOS)
                + " |"
            )
    return lines
