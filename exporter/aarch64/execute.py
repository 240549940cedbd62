"""Run artifacts on emulated aarch64 CPUs: one qemu process per artifact and CPU, running every image.

`run(runner, artifacts, inputs, cpus)` is what a build calls after its x86 validation: the outputs come
back as numpy arrays (output k of every image stacked), with the seconds taken; nothing is judged here.
`verify_bundled(runner, bpte, cpus, rtol, atol)` runs ExecuTorch's own verifier on a `.bpte` on each CPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from . import cpus as named
from .layout import Runner

SUFFIXES = (".pte", ".ptl", ".onnx")
# The package's inside.py, run by its host path (qemu falls back to host paths outside the -L prefix): the copy
# in a runner's root dates from its set-up, and may predate a mode (--bundled) this module asks for.
INSIDE = Path(__file__).with_name("inside.py")


@dataclass
class Result:
    artifact: Path
    cpu: str
    outputs: list = field(default_factory=list)  # numpy arrays, output k of every image stacked
    seconds: float = 0.0  # the whole qemu process: start-up, imports, load, every image (wall clock)
    cpu_seconds: float = 0.0  # CPU time the qemu process took (wall clock less waiting for a busy host)
    info: dict = field(default_factory=dict)  # what ran it (runtime, backends, delegate), load/run seconds
    error: str | None = None  # the artifact could not be run there (one line)

    @property
    def ok(self) -> bool:
        return self.error is None


def run(runner: Runner, artifacts: list[Path], inputs, cpus: list[str], threads: int = 1,
        timeout: float = 1800, bundled: dict | None = None) -> list[Result]:
    """Each artifact on each CPU (artifact-major). `inputs`: an N x C x H x W float32 array or a .npy path.
    `bundled`: artifact -> (its .bpte, rtol, atol), verified in the same process (`info["bundled"]`, as
    verify_bundled answers). A failure to run is a Result with `error`, not an exception; a bad request is
    a UsageError."""
    import numpy as np

    cpus = named.check(cpus, runner.cpus)
    artifacts = [Path(a).resolve() for a in artifacts]
    for artifact in artifacts:
        if artifact.suffix not in SUFFIXES or not artifact.is_file():
            raise UsageError(f"{artifact}: not a .pte, .ptl or .onnx file")
    work = Path(tempfile.mkdtemp(prefix="exporter-aarch64-"))
    try:
        if isinstance(inputs, (str, Path)):
            batch = Path(inputs).resolve()
        else:
            array = np.ascontiguousarray(inputs, dtype=np.float32)
            if array.ndim != 4:
                raise UsageError(f"inputs: expected N x C x H x W, got shape {array.shape}")
            batch = work / "inputs.npy"
            np.save(batch, array)
        results = []
        for i, artifact in enumerate(artifacts):
            for cpu in cpus:
                out = work / f"{i}-{cpu}.npz"
                golden = (bundled or {}).get(artifact) or (bundled or {}).get(Path(artifact).name)
                results.append(_one(runner, artifact, batch, out, cpu, threads, timeout, golden))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _one(runner: Runner, artifact: Path, batch: Path, out: Path, cpu: str, threads: int, timeout: float,
         golden: tuple | None = None) -> Result:
    import numpy as np

    # the package's own inside.py (qemu's -L prefix falls back to host paths): a runner's copy predates changes
    command = runner.python(cpu, str(INSIDE), "--artifact", str(artifact), "--inputs", str(batch),
                            "--out", str(out), "--threads", str(threads))
    if golden is not None:
        bpte, rtol, atol = golden
        command += ["--bundled", str(Path(bpte).resolve()), "--rtol", repr(float(rtol)), "--atol", repr(float(atol))]
    started, used = time.perf_counter(), _children_cpu()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=Runner.environment(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return Result(artifact, cpu, seconds=timeout, error=f"timed out after {timeout:.0f} s under qemu ({cpu})")
    seconds, cpu_seconds = round(time.perf_counter() - started, 2), round(_children_cpu() - used, 2)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines or not out.exists():
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        reason = errors[-1] if errors else f"exit code {done.returncode}"
        return Result(artifact, cpu, seconds=seconds, cpu_seconds=cpu_seconds, error=f"{reason[:300]} ({cpu})")
    with np.load(out) as saved:
        outputs = [saved[f"out{k}"] for k in range(len(saved.files))]
    return Result(artifact, cpu, outputs=outputs, seconds=seconds, cpu_seconds=cpu_seconds, info=json.loads(lines[-1]))


def verify_bundled(runner: Runner, bpte: Path, cpus: list[str], rtol: float, atol: float, threads: int = 1,
                   timeout: float = 1800) -> list[dict]:
    """ExecuTorch's verifier on every test case of `bpte`, one qemu process per CPU, in the order given:
    [{"cpu", "passed", "cases", "error", "seconds", "cpu_seconds"}]. A mismatch, or a CPU the program cannot
    run on, is passed False with the reason, not an exception; a bad request is a UsageError."""
    cpus = named.check(cpus, runner.cpus)
    bpte = Path(bpte).resolve()
    if bpte.suffix != ".bpte" or not bpte.is_file():
        raise UsageError(f"{bpte}: not a .bpte file")
    if not (rtol >= 0 and atol >= 0):
        raise UsageError(f"rtol {rtol} and atol {atol} must be non-negative")
    results = []
    for cpu in cpus:
        command = runner.python(cpu, str(INSIDE), "--bundled", str(bpte), "--rtol", repr(float(rtol)),
                                "--atol", repr(float(atol)), "--threads", str(threads))
        started, used = time.perf_counter(), _children_cpu()
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=Runner.environment(), timeout=timeout)
        except subprocess.TimeoutExpired:
            results.append({"cpu": cpu, "passed": False, "cases": 0, "seconds": timeout, "cpu_seconds": None,
                            "error": f"timed out after {timeout:.0f} s under qemu ({cpu})"})
            continue
        measured = {"seconds": round(time.perf_counter() - started, 2), "cpu_seconds": round(_children_cpu() - used, 2)}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
            reason = errors[-1] if errors else f"exit code {done.returncode}"
            results.append({"cpu": cpu, "passed": False, "cases": 0, "error": f"{reason[:300]} ({cpu})", **measured})
            continue
        answer = json.loads(lines[-1])
        results.append({"cpu": cpu, "passed": bool(answer.get("passed")), "cases": int(answer.get("cases", 0)),
                        "error": answer.get("error"), **measured})
    return results


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
