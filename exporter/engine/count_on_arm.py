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
from typing import TYPE_CHECKING

from .. import aarch64, files
from ..aarch64 import counter as counting_qemu
from ..aarch64 import counting
from ..errors import UsageError
from ..progress import Progress
from ..results import ArtifactResult, Instructions, Manifest
from . import cache

if TYPE_CHECKING:
    from .context import BuildContext

UNIT = "emulated aarch64 instructions per inference, one thread (qemu TCG plugin): not time"
WARMUP, RUNS = 1, 2


@functools.cache
def _scripts() -> str:
    here = Path(aarch64.__file__).parent
    return "".join(files.sha256(here / name) for name in ("inside.py", "inside_count.py"))


def _key(session: BuildContext, what, cpu: str, runner, counter) -> str:
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


def _record(counts: counting.Counts) -> dict:
    return {
        "per_inference": counts.per_inference,
        "warmup": counts.warmup[0] if counts.warmup else None,
        "load": counts.load,
        "spread": round(counts.spread, 6),
        "runs": len(counts.runs),
        "unit": UNIT,
        "qemu": counts.qemu_version,
    }


def _count_on(session: BuildContext, cpu: str, items: dict, runner, counter, failed: dict) -> dict:
    """{name: record} for `items` ({name: (cache key material, artifact path or nn.Module)}) on `cpu`: each from the
    cache, the rest counted in one emulated process and stored. What cannot be counted goes to `failed`."""
    records, missing = {}, {}
    for name, (what, item) in items.items():
        digest = _key(session, what, cpu, runner, counter)
        cached = session.cache.fetch_json("instructions", digest)
        if cached is not None:
            records[name] = cached
        else:
            missing[name] = (digest, item)
    if not missing:
        return records
    try:
        results = counting.count_many(
            runner,
            counter,
            [item for _, item in missing.values()],
            session.fed.validation[:1].numpy(),
            cpu,
            WARMUP,
            RUNS,
        )
    except Exception as e:  # noqa: BLE001 - a count never fails a build (torch.export may refuse eager, qemu may die)
        reason = (str(e).splitlines() or [type(e).__name__])[0][:300]
        failed.update({f"{name} on {cpu}": reason for name in missing})
        return records
    for (name, (digest, _)), result in zip(missing.items(), results, strict=True):
        if isinstance(result, counting.Failed):
            failed[f"{name} on {cpu}"] = result.reason
        else:
            records[name] = _record(result)
            session.cache.store_json("instructions", digest, records[name])
    return records


def check_before_build(plans, request, progress: Progress) -> None:
    """Before anything is built: where a plan counts on aarch64 and no counting qemu can be had, one line says what is
    missing and the command that fixes it; with --count asked for, the build is refused (exit 2, nothing written).
    Without a reason (one is built, or the build can build it) nothing is said."""
    if not any(p.validate.count and p.validate.aarch64_cpus for p in plans):
        return
    runners = request.aarch64_runners
    reason = counting_qemu.unavailable(
        request.cache_dir,
        offline=request.offline or None,
        root=Path(runners) / "counter" if runners is not None else None,
    )
    if reason is None:
        return
    if request.count:
        raise UsageError(f"--count: no instruction counts can be taken here: {reason}")
    progress.note(f"aarch64 instruction counts: unavailable, the rows will carry none ({reason})")


def add_counts(
    session: BuildContext,
    doc: Manifest,
    entries: list[ArtifactResult],
    runner,
    offline: bool,
    request_cache_dir: Path | None,
    runners: Path | None = None,
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
            session.progress,
            cache_dir=request_cache_dir,
            offline=offline or None,
            root=Path(runners) / "counter" if runners is not None else None,
        )
    except UsageError as e:
        summary["instructions"] = {"unavailable": str(e), "unit": UNIT}
        return
    started = time.perf_counter()
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
    eager_key = {"eager": {k: session.digests[k] for k in ("checkpoint", "reference", "model", "task")}}
    if session.takes_bytes:  # counted behind the preprocessing, on the bytes the artifacts take
        eager_key["input"] = session.plan.input_format
    for cpu in validate.cpus:
        rows = {e.name: r for e in entries for r in e.aarch64 or [] if r.cpu == cpu}
        items = {"eager": (eager_key, session.eager_taking_fed)}
        items.update({e.name: (e.sha256, session.out / e.path) for e in entries if e.name in rows})
        with session.progress.step(
            f"{session.prefix}aarch64 instruction counts on {cpu} (emulated, one thread, {len(items)} programs)"
        ):
            records = _count_on(session, cpu, items, runner, counter, failed)
        base = records.get("eager", {}).get("per_inference")
        if base is not None:
            eager[cpu] = base
        for name, row in rows.items():
            if name in records:
                counted = records[name]["per_inference"]
                row.instructions = Instructions.from_json(
                    {
                        **records[name],
                        "eager_per_inference": base,
                        "ratio_to_eager": round(base / counted, 3) if base and counted else None,
                    }
                )
    info["seconds"] = round(time.perf_counter() - started, 1)
