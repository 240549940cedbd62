"""Instructions per inference on a named emulated aarch64 CPU: an artifact run by the runner's Python under the
counting qemu (counter.py), at one thread, its load and each inference between markers (inside_count.py).

    counts = count(runner, counter, "model.pte", images, "cortex-a76", warmup=1, runs=3)
    counts.per_inference, counts.spread, counts.load

A count is deterministic (no host load enters it) and is not time: no caches, no pipeline. Compare counts on one
named core only, and across engines only on an out-of-order core, loosely (shared/NOTES.md, "Counting instructions
under qemu").
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from . import cpus as named
from .counter import Counter, read_lines
from .layout import Runner

INSIDE_COUNT = Path(__file__).with_name("inside_count.py")  # run by its host path, as execute.py runs inside.py
SUFFIXES = (".pte", ".ptl", ".onnx", ".tflite", ".pt2")
EMPTY, LOAD, RUN, STRIDE = 1, 3, 5, 10  # inside_count.py's start tags (artifact k: + STRIDE * k); an end is start + 1


@dataclass
class Counts:
    artifact: str
    cpu: str
    per_inference: int  # instructions, median over the counted runs, a marker's cost subtracted
    spread: float  # (max - min) / median over the counted runs
    runs: list[int]  # each counted inference
    warmup: list[int]  # each warm-up inference (the first is usually dearer: caches, packing, allocation)
    load: int  # the artifact's load (its runtime imported before, not counted; a .pt2's includes torch.export's
    # deserializer imports, about 3 G instructions)
    marker_cost: int  # what one marker adds to a region (median over empty pairs), subtracted from every count
    qemu_version: str
    info: dict = field(default_factory=dict)  # what ran it (inside.py's loader answer)
    seconds: float = 0.0  # wall clock of the whole emulated process

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class Failed:
    """An artifact of a batch that could not be counted (the others were)."""

    artifact: str
    cpu: str
    reason: str


def regions(lines: list[dict], pid: int | None = None) -> dict:
    """The instructions between each start and end marker from the plugin's lines of process `pid` (default: the
    first marker's): {"empty": [...], "artifacts": [{"load": [...], "run": [...]} for artifact 0, 1, ...]}, each
    list in order. Markers out of order, or from more than one vCPU, are refused: the counts would not be of one
    thread's region."""
    markers = [line for line in lines if line["kind"] == "marker"]
    if pid is None and markers:
        pid = markers[0]["pid"]
    markers = [m for m in markers if m["pid"] == pid]
    if len({m["vcpu"] for m in markers}) > 1:
        raise UsageError("the markers came from more than one thread: counts of one region cannot be told apart")
    empty: list[int] = []
    artifacts: list[dict[str, list[int]]] = []
    start = None
    for m in markers:
        k, kind = divmod(m["tag"], STRIDE)
        if start is None and (m["tag"] == EMPTY or kind in (LOAD, RUN)):
            start = m
        elif start is not None and m["tag"] == start["tag"] + 1:
            if start["tag"] == EMPTY:
                empty.append(m["count"] - start["count"])
            else:
                while len(artifacts) <= k:
                    artifacts.append({"load": [], "run": []})
                artifacts[k]["load" if kind == LOAD + 1 else "run"].append(m["count"] - start["count"])
            start = None
        else:
            raise UsageError(f"the counting markers are out of order (tag {m['tag']} after {start and start['tag']})")
    if start is not None:
        raise UsageError(f"the counting ended inside a region (tag {start['tag']} never closed)")
    return {"empty": empty, "artifacts": artifacts}


def summarize(empty: list[int], found: dict[str, list[int]], warmup: int) -> dict:
    """One artifact's counts with the marker's cost (the median of the `empty` pairs) subtracted, the counted runs'
    median and spread."""
    if not empty:
        raise UsageError("no empty marker pair: the marker's own cost cannot be measured")
    if len(found["load"]) != 1 or len(found["run"]) <= warmup:
        raise UsageError(f"expected one load and more than {warmup} inferences, got {found}")
    cost = round(statistics.median(empty))
    runs = [n - cost for n in found["run"]]
    counted = runs[warmup:]
    median = round(statistics.median(counted))
    return {
        "marker_cost": cost,
        "load": found["load"][0] - cost,
        "warmup": runs[:warmup],
        "runs": counted,
        "per_inference": median,
        "spread": (max(counted) - min(counted)) / median if median else 0.0,
    }


def _eager_program(model, example, path: Path) -> Path:
    """An nn.Module as a torch.export program, which the guest runs op by op (eager PyTorch's kernels)."""
    import torch

    with torch.no_grad():
        program = torch.export.export(model.eval(), (torch.as_tensor(example),))
    torch.export.save(program, str(path))
    return path


def count(runner: Runner, counter: Counter, artifact_or_eager, inputs, cpu: str, **options) -> Counts:
    """One artifact's (or an nn.Module's) counts: count_many of one; UsageError (one line) when it cannot be
    counted."""
    (result,) = count_many(runner, counter, [artifact_or_eager], inputs, cpu, **options)
    if isinstance(result, Failed):
        raise UsageError(f"counting {result.artifact} on {cpu} failed: {result.reason}")
    return result


def count_many(
    runner: Runner,
    counter: Counter,
    items: list,
    inputs,
    cpu: str,
    warmup: int = 1,
    runs: int = 3,
    empty: int = 5,
    timeout: float = 1800,
) -> list[Counts | Failed]:
    """Instructions per inference on `cpu`, at one thread, of each of `items` (a .pte, .ptl, .onnx, .tflite or .pt2
    path, or an nn.Module, exported here with torch.export and run op by op), one after another in one emulated
    process (the imports paid once): `warmup` inferences reported apart, then `runs` counted. `inputs`: an
    N x C x H x W float32 array or a .npy path (inference i takes image i % N). An item that fails (a module
    torch.export refuses, a file the guest cannot run) is a Failed beside the others' Counts; a bad request, or an
    emulated process that dies, is a UsageError (one line)."""
    import numpy as np

    (cpu,) = named.check([cpu], runner.cpus)
    if warmup < 0 or runs < 1 or empty < 1 or not items:
        raise UsageError(f"warmup {warmup} must be >= 0, runs {runs}, empty {empty} and the items >= 1")
    work = Path(tempfile.mkdtemp(prefix="exporter-count-"))
    try:
        if isinstance(inputs, (str, Path)):
            batch = Path(inputs).resolve()
            array = np.load(batch, mmap_mode="r")
        else:
            array = np.ascontiguousarray(inputs, dtype=np.float32)
            batch = work / "inputs.npy"
            np.save(batch, array)
        if array.ndim != 4 or array.shape[0] < 1:
            raise UsageError(f"inputs: expected N x C x H x W, got shape {array.shape}")
        names, paths, results = [], [], {}
        for k, item in enumerate(items):
            if isinstance(item, (str, Path)):
                artifact = Path(item).resolve()
                if artifact.suffix not in SUFFIXES or not artifact.is_file():
                    raise UsageError(f"{artifact}: not a {', '.join(SUFFIXES)} file")
                names.append(artifact.name)
                paths.append((k, artifact))
                continue
            names.append(f"eager {type(item).__name__}")
            try:
                paths.append((k, _eager_program(item, np.asarray(array[:1], np.float32), work / f"eager{k}.pt2")))
            except Exception as e:  # noqa: BLE001 - a module torch.export refuses leaves the artifacts counted
                results[k] = Failed(names[k], cpu, f"torch.export: {(str(e).splitlines() or [type(e).__name__])[0]}")
        if paths:
            results.update(_run_guest(runner, counter, paths, names, batch, cpu, work, warmup, runs, empty, timeout))
        return [results[k] for k in range(len(items))]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_guest(runner, counter, paths, names, batch, cpu, work, warmup, runs, empty, timeout) -> dict:
    """{k: Counts or Failed} for each (k, path) of `paths`, run in turn by inside_count.py in one emulated process."""
    out = work / "counts.txt"
    command = runner.python(
        cpu,
        str(INSIDE_COUNT),
        *(a for _, path in paths for a in ("--artifact", str(path))),
        *("--inputs", str(batch), "--warmup", str(warmup), "--runs", str(runs), "--empty", str(empty)),
        qemu=counter.qemu,
        options=counter.plugin_option(out),
    )
    what = names[paths[0][0]] if len(paths) == 1 else f"{len(paths)} programs"
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=Runner.environment(), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UsageError(f"counting {what} on {cpu}: timed out after {timeout:.0f} s under qemu") from None
    seconds = round(time.perf_counter() - started, 2)
    answers = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not answers:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        reason = errors[-1] if errors else f"exit code {done.returncode}"
        raise UsageError(f"counting {what} on {cpu} failed: {reason[:300]}")
    answer = json.loads(answers[-1])
    found = regions(read_lines(out.read_text() if out.exists() else ""), answer["pid"])
    results = {}
    for j, ((k, _), info) in enumerate(zip(paths, answer["artifacts"], strict=True)):
        if "error" in info:
            results[k] = Failed(names[k], cpu, info["error"])
            continue
        one = found["artifacts"][j] if j < len(found["artifacts"]) else {"load": [], "run": []}
        counts = summarize(found["empty"], one, warmup)
        results[k] = Counts(
            artifact=names[k], cpu=cpu, qemu_version=counter.version, info=info, seconds=seconds, **counts
        )
    return results
