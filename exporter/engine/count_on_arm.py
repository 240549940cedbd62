"""Instruction counts beside the aarch64 rows: for every artifact that has a row, and for eager PyTorch, the emulated
instructions of one inference at one thread on each CPU the plan names (exporter.aarch64.counting), on the first
validation input after one warm-up. A count never changes a verdict.

A count is deterministic (the same on a quiet or a busy host) and is not time. What it can rank, measured
(docs/benchmarks.md, shared notes): artifacts of one engine on one named core; engines against each other loosely
(under ~1.5x a tie) and only on an out-of-order core; never across cores; a count ratio to eager is no speedup.
Counts are cached by what they depend on: the artifact's bytes (or eager's checkpoint), the CPU, the counting qemu,
the runner and the guest scripts.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from .. import aarch64, files
from ..aarch64 import counter as counting_qemu
from ..aarch64 import counting
from ..errors import UsageError
from ..progress import Progress
from ..results import ArtifactResult, Manifest
from . import cache

UNIT = "emulated aarch64 instructions per inference, one thread (qemu TCG plugin): not time"
WARMUP, RUNS = 1, 2


@functools.cache
def _scripts() -> str:
    here = Path(aarch64.__file__).parent
    return "".join(files.sha256(here / name) for name in ("inside.py", "inside_count.py"))


def _key(session, what, cpu: str, runner, counter) -> str:
    return cache.key(
        kind="instructions",
        what=what,
        cpu=cpu,
        runner=runner.info.get("key"),
        counter=counter.info.get("key"),
        scripts=_scripts(),
        warmup=WARMUP,
        runs=RUNS,
        validation=session.digests["validation"],
    )


def _counted(session, what, cpu: str, runner, counter, measure) -> dict:
    """The count of `what` on `cpu` from the cache, or measured now (and stored)."""
    digest = _key(session, what, cpu, runner, counter)
    cached = session.cache.fetch_json("instructions", digest)
    if cached is not None:
        return {**cached, "reused_from_cache": True}
    counts = measure()
    record = {
        "per_inference": counts.per_inference,
        "warmup": counts.warmup[0] if counts.warmup else None,
        "load": counts.load,
        "spread": round(counts.spread, 6),
        "runs": len(counts.runs),
        "unit": UNIT,
        "qemu": counts.qemu_version,
    }
    session.cache.store_json("instructions", digest, record)
    return record


def add_counts(
    session,
    doc: Manifest,
    entries: list[ArtifactResult],
    out: Path,
    runner,
    progress: Progress,
    offline: bool,
    request_cache_dir: Path | None,
    runners: Path | None = None,
    prefix: str = "",
) -> None:
    """Counts on every CPU of the plan for `entries` (their aarch64 rows made) and eager; written into each row's
    `instructions` and `doc.aarch64["instructions"]` (the counter, eager's counts, the reference core, what failed).
    Where no counting qemu can be had, that summary says why and the rows carry none."""
    validate = session.plan.validate
    summary = doc.aarch64
    if not validate.count:
        return
    try:
        counter = counting_qemu.prepare(
            progress,
            cache_dir=request_cache_dir,
            offline=offline or None,
            root=Path(runners) / "counter" if runners is not None else None,
        )
    except UsageError as e:
        summary["instructions"] = {"unavailable": str(e), "unit": UNIT}
        return
    started = time.perf_counter()
    inputs = session.inputs.validation[:1].contiguous().numpy()
    eager, failed = {}, {}
    info = {
        "unit": UNIT,
        "counter": counter.info.get("key"),
        "qemu": counter.version,
        "reference_cpu": validate.ranking_cpu,
        "eager": eager,
        "failed": failed,
    }
    summary["instructions"] = info
    for cpu in validate.cpus:
        with progress.step(f"{prefix}aarch64 instruction counts on {cpu} (emulated, one thread)"):
            try:
                eager[cpu] = _counted(
                    session,
                    {"eager": {k: session.digests[k] for k in ("checkpoint", "reference", "model", "task")}},
                    cpu,
                    runner,
                    counter,
                    lambda: counting.count(runner, counter, session.loaded.eager, inputs, cpu, WARMUP, RUNS),
                )["per_inference"]
            except Exception as e:  # noqa: BLE001 - a count never fails a build (torch.export may refuse eager)
                failed[f"eager on {cpu}"] = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            for entry in entries:
                row = next((r for r in entry.aarch64 or [] if r.cpu == cpu), None)
                if row is None:
                    continue
                try:
                    record = _counted(
                        session,
                        entry.sha256,
                        cpu,
                        runner,
                        counter,
                        lambda: counting.count(runner, counter, out / entry.path, inputs, cpu, WARMUP, RUNS),
                    )
                except Exception as e:  # noqa: BLE001 - a count never fails a build: the summary says what failed
                    failed[f"{entry.name} on {cpu}"] = (str(e).splitlines() or [type(e).__name__])[0][:300]
                    continue
                base = eager.get(cpu)
                record.pop("reused_from_cache", None)
                row.instructions = {
                    **record,
                    "eager_per_inference": base,
                    "ratio_to_eager": round(base / record["per_inference"], 3)
                    if base and record["per_inference"]
                    else None,
                }
    info["seconds"] = round(time.perf_counter() - started, 1)
