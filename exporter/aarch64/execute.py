"""Run artifacts on emulated aarch64 CPUs: one qemu process per CPU, running every artifact on every image.

`run(runner, artifacts, inputs, cpus)` is what a build calls after its x86 validation: the outputs come
back as numpy arrays (output k of every image stacked), with the seconds taken; nothing is judged here.
`verify_bundled(runner, bpte, cpus, rtol, atol)` runs ExecuTorch's own verifier on a `.bpte` on each CPU.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from . import cpus as named
from .layout import Runner

SUFFIXES = (".pte", ".ptl", ".onnx", ".tflite")
# The package's inside.py, run by its host path (qemu falls back to host paths outside the -L prefix): the copy
# in a runner's root dates from its set-up, and may predate a mode (--jobs) this module asks for.
INSIDE = Path(__file__).with_name("inside.py")


@dataclass
class Result:
    artifact: Path
    cpu: str
    outputs: list = field(default_factory=list)  # numpy arrays, output k of every image stacked
    # this artifact's share of its qemu process (wall clock): its load, every image and its golden program's check,
    # and for the first artifact of a process (or one that ended it) the start-up and imports as well (10-30 s)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of the whole qemu process that ran it (shared with the artifacts run with it)
    info: dict = field(default_factory=dict)  # what ran it (runtime, backends, delegate), load/run seconds
    error: str | None = None  # the artifact could not be run there (one line)
    timed_out: bool = False  # that is because its process hit a time limit under qemu (the job's or the whole one's)

    @property
    def ok(self) -> bool:
        return self.error is None


def run(
    runner: Runner,
    artifacts: list[Path],
    inputs,
    cpus: list[str],
    threads: int = 1,
    timeout: float = 1800,
    bundled: dict | None = None,
) -> list[Result]:
    """Each artifact on each CPU, returned artifact-major; one process per CPU runs them all. `inputs`: an
    N x C x H x W float32 array or a .npy path. `bundled`: artifact -> (its .bpte, rtol, atol), verified in the
    same process (`info["bundled"]`, as verify_bundled answers). `timeout` is per artifact. A failure to run
    is a Result with `error`, not an exception (an artifact that kills its process is that artifact's error,
    and the ones after it run again in a new process); a bad request is a UsageError."""
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
            array = np.asarray(inputs)  # float32, or the uint8 pixels of uint8-nhwc artifacts
            array = np.ascontiguousarray(array, dtype=np.uint8 if array.dtype == np.uint8 else np.float32)
            if array.ndim != 4:
                raise UsageError(f"inputs: expected N x C x H x W, got shape {array.shape}")
            batch = work / "inputs.npy"
            np.save(batch, array)
        jobs = []
        for i, artifact in enumerate(artifacts):
            job = {"artifact": str(artifact)}
            golden = (bundled or {}).get(artifact) or (bundled or {}).get(Path(artifact).name)
            if golden is not None:
                bpte, rtol, atol = golden
                job.update(bundled=str(Path(bpte).resolve()), rtol=float(rtol), atol=float(atol))
            jobs.append(job)
        per_cpu = {cpu: _on_cpu(runner, jobs, batch, work, cpu, threads, timeout) for cpu in cpus}
        return [per_cpu[cpu][i] for i in range(len(artifacts)) for cpu in cpus]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _on_cpu(
    runner: Runner, jobs: list[dict], batch: Path, work: Path, cpu: str, threads: int, timeout: float
) -> list[Result]:
    """Every job on `cpu`, in as few qemu processes as the jobs allow: one, unless one of them ends it. A job that
    ends a process it was not the first of is run once more at the head of the next (a crash can come from what
    an earlier job left behind) before it is blamed."""
    import numpy as np

    results: dict[int, Result] = {}
    pending, suspects = list(range(len(jobs))), set()
    while pending:
        spec = work / f"jobs-{cpu}-{pending[0]}.json"
        spec.write_text(json.dumps([{**jobs[i], "out": str(work / f"{i}-{cpu}.npz")} for i in pending]))
        command = runner.python(
            cpu,
            str(INSIDE),
            "--jobs",
            str(spec),
            "--inputs",
            str(batch),
            "--threads",
            str(threads),
            "--timeout",
            repr(float(timeout)),
        )
        started, used = time.perf_counter(), _children_cpu()
        limit = timeout * (len(pending) + 1)  # each job has its own limit inside; this one is for the start-up
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=Runner.environment(), timeout=limit)
            stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            stdout, stderr, returncode = _text(e.stdout), "", None
        wall, cpu_seconds = time.perf_counter() - started, round(_children_cpu() - used, 2)
        began, answers = set(), {}
        for line in stdout.splitlines():
            answer = _answer(line)
            if answer is None or not 0 <= answer["job"] < len(pending):
                continue
            i = pending[answer.pop("job")]
            if answer.pop("started", False):
                began.add(i)
            else:
                answers[i] = answer
        unanswered = [i for i in pending if i not in answers]
        ended = next((i for i in unanswered if i in began), None)  # the job the process ended in
        if ended is None and answers and unanswered:  # between two jobs: the next one goes first in a new process
            ended = unanswered[0]
        # the process's time outside the jobs (start-up, imports) goes to its first job, or to the one that ended it
        rest = max(wall - sum(a.get("seconds", 0) for a in answers.values()), 0.0)
        charged = pending[0] if ended is None else ended
        for i in (i for i in pending if i in answers):
            answer, artifact = answers[i], Path(jobs[i]["artifact"])
            seconds = round(answer.pop("seconds", 0) + (rest if i == charged else 0), 3)
            out = work / f"{i}-{cpu}.npz"
            if answer.get("error") or not out.exists():
                error = answer.get("error") or "no outputs written"
                results[i] = Result(
                    artifact, cpu, seconds=seconds, cpu_seconds=cpu_seconds, error=f"{error[:300]} ({cpu})"
                )
                continue
            with np.load(out) as saved:
                outputs = [saved[f"out{k}"] for k in range(len(saved.files))]
            results[i] = Result(artifact, cpu, outputs=outputs, seconds=seconds, cpu_seconds=cpu_seconds, info=answer)
        if not unanswered:
            break
        reason = _reason(returncode, stderr, limit, timeout)
        timed_out = _timed_out(returncode, stderr)
        if ended is None:  # the process ended before it began any of them: each fails with its reason
            for i in unanswered:
                results[i] = Result(
                    Path(jobs[i]["artifact"]),
                    cpu,
                    seconds=round(rest, 3) if i == charged else 0.0,
                    cpu_seconds=cpu_seconds,
                    error=f"{reason[:300]} ({cpu})",
                    timed_out=timed_out,
                )
            break
        after = unanswered[unanswered.index(ended) + 1 :]
        if ended != pending[0] and ended not in suspects:
            suspects.add(ended)
            pending = [ended, *after]
            continue
        results[ended] = Result(
            Path(jobs[ended]["artifact"]),
            cpu,
            seconds=round(rest, 3),
            cpu_seconds=cpu_seconds,
            error=f"{reason[:300]} ({cpu})",
            timed_out=timed_out,
        )
        pending = after
    return [results[i] for i in range(len(jobs))]


def _reason(returncode: int | None, stderr: str, limit: float, timeout: float) -> str:
    """Why a process ended in a job: killed by a signal, past the job's time limit (faulthandler's "Timeout" on
    stderr) or the whole process's, or what it printed last."""
    if returncode is None:
        return f"timed out after {limit:.0f} s under qemu (the whole process)"
    if returncode < 0:  # a fault or kill: whatever it printed last was not the reason
        return _ended(returncode)
    if "Timeout (" in stderr:
        return f"timed out after {timeout:.0f} s under qemu"
    errors = [line for line in stderr.strip().splitlines() if line.strip()]
    return errors[-1] if errors else _ended(returncode)


def _timed_out(returncode: int | None, stderr: str) -> bool:
    """Whether the process ended at a time limit: the whole process's (no return code) or a job's (faulthandler's
    "Timeout" on stderr, as _reason reads it)."""
    return returncode is None or (returncode >= 0 and "Timeout (" in stderr)


def _ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _answer(line: str) -> dict | None:
    """inside.py's line for one job, or None for anything else a library printed."""
    if not line.startswith("{"):
        return None
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) and isinstance(answer.get("job"), int) else None


def _text(output) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def verify_bundled(
    runner: Runner, bpte: Path, cpus: list[str], rtol: float, atol: float, threads: int = 1, timeout: float = 1800
) -> list[dict]:
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
        command = runner.python(
            cpu,
            str(INSIDE),
            "--bundled",
            str(bpte),
            "--rtol",
            repr(float(rtol)),
            "--atol",
            repr(float(atol)),
            "--threads",
            str(threads),
        )
        started, used = time.perf_counter(), _children_cpu()
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=Runner.environment(), timeout=timeout)
        except subprocess.TimeoutExpired:
            results.append(
                {
                    "cpu": cpu,
                    "passed": False,
                    "cases": 0,
                    "seconds": timeout,
                    "cpu_seconds": None,
                    "error": f"timed out after {timeout:.0f} s under qemu ({cpu})",
                }
            )
            continue
        measured = {"seconds": round(time.perf_counter() - started, 2), "cpu_seconds": round(_children_cpu() - used, 2)}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
            reason = errors[-1] if errors else f"exit code {done.returncode}"
            results.append({"cpu": cpu, "passed": False, "cases": 0, "error": f"{reason[:300]} ({cpu})", **measured})
            continue
        answer = json.loads(lines[-1])
        results.append(
            {
                "cpu": cpu,
                "passed": bool(answer.get("passed")),
                "cases": int(answer.get("cases", 0)),
                "error": answer.get("error"),
                **measured,
            }
        )
    return results


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
