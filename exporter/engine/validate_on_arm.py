"""aarch64 rows: after a target's x86 validation, every .pte, .tflite, .ptl and ONNX artifact run again on emulated
aarch64 CPUs (exporter.aarch64), judged against the same eager reference with the same thresholds and task
metrics, and compared with the same artifact's x86 outputs.

An artifact passes only when it passes on this host and on every CPU. Latency is never taken under emulation.
Each row is cached by the artifact's bytes, the CPU, the runner, the inputs and the thresholds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import aarch64, files, validation
from ..formats import FORMATS
from ..precision import NEEDS_FP16_ARITHMETIC
from ..results import ArtifactResult, EmulatedRow, Kind, Manifest, Reason, Status
from . import cache
from .count_on_arm import add_counts

if TYPE_CHECKING:
    from .context import BuildContext


def _not_run(entry: ArtifactResult) -> str:
    spec = FORMATS[entry.format]
    if not spec.runs_on_aarch64:
        return spec.runs_only_on or f"the aarch64 runner has no runtime for {entry.format}"
    ran_here = not entry.path or entry.status is not Status.FAILED or entry.fidelity is not None
    return "not built" if ran_here else "its runtime fails on it on x86 already"


def wanted(entry: ArtifactResult) -> bool:
    return entry.ran_here() and FORMATS[entry.format].runs_on_aarch64


def versus_x86(outputs: torch.Tensor, x86: torch.Tensor | None) -> dict | None:
    """How far the aarch64 outputs are from the same artifact's x86 outputs on the same inputs."""
    if x86 is None or outputs.shape != x86.shape:
        return None
    differ = (outputs != x86) & ~(torch.isnan(outputs) & torch.isnan(x86))
    gap = (outputs.double() - x86.double()).abs().nan_to_num(0.0)
    return {
        "max_abs_diff": float(gap.max()) if gap.numel() else 0.0,
        "bit_identical": not bool(differ.any()),
        "rows_differing": int(differ.any(dim=1).sum()),
    }


def _paired(task, outputs: torch.Tensor, x86: torch.Tensor | None) -> torch.Tensor | None:
    """The x86 outputs row for row with the aarch64 ones: final detections whose scores are equal to rounding may
    come out of the two runs in either order, and are compared with their partners (Task.aligned)."""
    return x86 if x86 is None or x86.shape != outputs.shape else task.aligned(outputs, x86)


def _flat(result_outputs: list, count: int) -> torch.Tensor:
    """The runtime's first output, one flattened float32 row per input: what validation.run_all makes of a
    format's runner on x86 (each format's runner returns its graph's first output)."""
    first = np.asarray(result_outputs[0], dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(first.reshape(count, -1)))


def row(session: BuildContext, entry: ArtifactResult, cpu: str, result, x86: torch.Tensor | None) -> EmulatedRow:
    """One CPU's row for one artifact: the validation contract on the emulated outputs, never timed."""
    where = {"cpu": cpu, "why": aarch64.WHY.get(cpu, ""), "seconds": result.seconds, "runtime": result.info}
    if NEEDS_FP16_ARITHMETIC in entry.details.get("cpu_needs", ()) and cpu not in aarch64.FP16_ARITHMETIC:
        where["lacks"] = (
            f"FP16 arithmetic (Armv8.2-A FEAT_FP16): {cpu} has none, so this fp16 program cannot compute in half precision there"
        )

    def failed(reason: Reason) -> EmulatedRow:
        return EmulatedRow(**where, status=Status.FAILED, reasons=[reason])

    if not result.ok:
        return failed(Reason(_failed_run_kind(result), f"could not run on aarch64: {result.error}"))
    try:
        outputs = _flat(result.outputs, len(session.inputs.validation))
    except (ValueError, IndexError) as e:
        return failed(Reason(Kind.AARCH64_MISMATCH, f"aarch64 outputs do not match the graph's: {e}"))
    metrics = validation.judge(
        session.task, outputs, session.reference, session.inputs.labels, session.eager_accuracy, entry.thresholds
    )
    verified = result.info.pop("bundled", None)  # the .pte's golden program, checked by ExecuTorch's verifier there
    judged = EmulatedRow(
        **where,
        status=metrics["status"],
        reasons=metrics["reasons"],
        fidelity=metrics["fidelity"],
        accuracy=metrics.get("accuracy"),
        vs_x86=versus_x86(outputs, _paired(session.task, outputs, x86)),
        bundled_program=verified,
    )
    if verified is not None and not verified.get("passed"):
        judged.status = Status.FAILED
        why = f"golden program fails ExecuTorch's verifier: {verified.get('error')}"
        judged.reasons = [*judged.reasons, Reason(Kind.BUNDLED_PROGRAM_FAILED, why)]
    return judged


def _failed_run_kind(result) -> Kind:
    """An emulated run that did not finish: stopped by its time limit under qemu, or its runtime failed there."""
    return Kind.EMULATOR_TIMEOUT if result.timed_out else Kind.DOES_NOT_RUN


def x86_outputs(session: BuildContext, entry: ArtifactResult) -> torch.Tensor | None:
    """The artifact's outputs on this host (kept from its validation, or run again when that came from the cache)."""
    kept = session.x86_outputs.get(entry.name)
    if kept is not None:
        return kept
    try:
        runner = FORMATS[entry.format].format().load(session.out / entry.path, session.latency["threads"])
        outputs = validation.run_all(runner, session.fed_to(entry.format).validation)
    except Exception:  # noqa: BLE001 - the comparison is then reported as not made, the rows still judged
        return None
    finally:
        torch.set_num_threads(session.latency["threads"])
    return outputs


@functools.cache
def _script() -> str:
    """What runs inside the emulator (inside.py): a change to it changes every row."""
    return files.sha256(Path(aarch64.__file__).with_name("inside.py"))


def _golden(entry: ArtifactResult, out: Path) -> dict | None:
    golden = entry.bundled_program
    if not golden:
        return None
    return {(out / entry.path).resolve(): (out / golden.path, golden.rtol, golden.atol)}


def _key(session: BuildContext, entry: ArtifactResult, cpu: str, runner) -> str:
    return cache.key(
        kind="aarch64",
        artifact=entry.sha256,
        cpu=cpu,
        runner=runner.info.get("key"),
        script=_script(),
        thresholds=entry.thresholds,
        bundled_program=entry.bundled_program.sha256 if entry.bundled_program else None,
        **{k: session.digests[k] for k in ("validation", "labels", "tools", "checkpoint", "reference", "task")},
    )


def add_rows(
    session: BuildContext,
    doc: Manifest,
    request_cache_dir: Path | None,
    offline: bool,
    write=lambda: None,
    runners: Path | None = None,
    runner_shown: bool = False,
) -> None:
    """Run every runnable artifact of `doc` on each CPU the plan names, add its rows, fail what fails there.
    runner_shown: the build has set the runner up and shown that step already (here it is found again, silently)."""
    if "aarch64" not in session.plan.validate.arches:
        return
    cpus = list(session.plan.validate.cpus)
    entries = [e for e in doc.artifacts if wanted(e)]
    summary = {
        "cpus": {cpu: aarch64.WHY.get(cpu, "") for cpu in cpus},
        "emulated": True,
        "not_run": {e.name: _not_run(e) for e in doc.artifacts if not wanted(e)},
    }
    doc.aarch64 = summary
    if not entries or not cpus:
        return
    out, progress = session.out, session.progress
    started = time.perf_counter()
    with contextlib.nullcontext() if runner_shown else progress.step(f"{session.prefix}aarch64 runner"):
        runner = aarch64.prepare(request_cache_dir, progress, offline=offline or None, root=runners)
    summary["runner"] = {k: runner.info.get(k) for k in ("key", "qemu", "packages", "seconds", "size_bytes")}
    inputs = session.fed.validation.contiguous().numpy()
    rows: dict[str, dict[str, EmulatedRow]] = {entry.name: {} for entry in entries}
    for entry in entries:
        for cpu in cpus:
            cached = session.cache.fetch_json("aarch64", _key(session, entry, cpu, runner))
            if cached is not None:
                rows[entry.name][cpu] = EmulatedRow.from_json({**cached, "reused_from_cache": True})
                session.cache.events.append(f"{entry.name}: aarch64 {cpu} row reused from the cache")

    def show_progress():  # an emulated CPU can take many minutes: the manifest holds the rows made so far
        summary["pending_cpus"] = [c for c in cpus if any(c not in rows[e.name] for e in entries)]
        for entry in entries:
            entry.aarch64 = [rows[entry.name][c] for c in cpus if c in rows[entry.name]]
        write()

    show_progress()
    x86 = {}
    for cpu in cpus:  # one emulated process per CPU runs every artifact missing there (Python and torch start once)
        missing = [entry for entry in entries if cpu not in rows[entry.name]]
        if not missing:
            continue
        golden = {}
        for entry in missing:
            golden.update(_golden(entry, out) or {})
        with progress.step(f"{session.prefix}aarch64 {', '.join(e.name for e in missing)} on {cpu} (emulated)"):
            # the threads of the x86 run: fp32 reductions split by thread, so another count changes the bits
            results = aarch64.run(
                runner,
                [out / e.path for e in missing],
                inputs,
                [cpu],
                threads=session.latency["threads"],
                bundled=golden,
            )
        for entry, result in zip(missing, results):
            if entry.name not in x86:
                x86[entry.name] = x86_outputs(session, entry)
            rows[entry.name][cpu] = row(session, entry, cpu, result, x86[entry.name])
            session.cache.store_json("aarch64", _key(session, entry, cpu, runner), rows[entry.name][cpu])
        show_progress()
    del summary["pending_cpus"]
    for entry in entries:
        entry.aarch64 = [rows[entry.name][cpu] for cpu in cpus]
        if entry.bundled_program:
            on_arm = {r.cpu: r.bundled_program for r in entry.aarch64 if r.bundled_program}
            verified = {**(entry.bundled_program.verified or {}), **on_arm}
            entry.bundled_program = dataclasses.replace(entry.bundled_program, verified=verified)
        judge_entry(entry)
    write()
    add_counts(session, doc, entries, runner, offline, request_cache_dir, runners)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    write()


def judge_entry(entry: ArtifactResult) -> None:
    """The artifact fails when any CPU's row fails; each such row's reasons join the artifact's, named by CPU."""
    for arch_row in entry.aarch64 or []:
        if arch_row.failed():
            entry.status = Status.FAILED
            entry.reasons = [*entry.reasons, *(r.on_cpu(arch_row.cpu) for r in arch_row.reasons)]
