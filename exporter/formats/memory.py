"""How much RAM an artifact needs, and where its time goes: the shared half of a format's optional
`memory(path, input_shape, threads)` and `profile(path, example, runs, threads)`.

Peak resident memory is measured in a fresh Python process that imports only the artifact's runtime, makes
the input, loads the artifact and runs it: the resident set after the import (the runtime's own baseline),
then the peak while loading and running (Linux: VmHWM, restarted after the import through
/proc/self/clear_refs; elsewhere getrusage's ru_maxrss). The format gives the three code snippets
(import, load, run); nothing of the exporter runs in that process.

A profile is a list of operators by total time over `runs` profiled inferences, from the runtime's own
profiler, in a session of its own (never the one latency is timed with).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

TOP = 8  # operators kept per profile

_SCRIPT = """\
import json, resource, sys
def _status():
    # Linux: current and peak resident set (VmRSS, VmHWM) in KiB; elsewhere only the peak from getrusage
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
        return peak, peak
import numpy as np
{imports}
x = {make_input}
threads, path = {threads}, {path!r}
baseline, import_peak = _status()
try:  # Linux >= 4.0: restart the peak (VmHWM) here, so an import's passing peak does not hide the model's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
{load}
loaded = _status()[0]
for _ in range({runs}):
{run}
current, peak = _status()
print("@@memory@@" + json.dumps({{"baseline": baseline, "import_peak": import_peak, "loaded": loaded,
                                 "peak": peak, "reset": reset}}))
"""


def peak_rss(
    imports: str,
    load: str,
    run: str,
    path,
    input_shape,
    threads: int,
    runs: int = 2,
    timeout: float = 300,
    dtype: str = "float32",
) -> dict:
    """Resident memory of a fresh process that imports a runtime (`imports`), makes the input `x` (float32 noise, or
    uint8 pixels), loads `path` (`load`, with `path` and `threads` defined) and runs it `runs` times (`run`). Bytes."""
    shape = tuple(int(s) for s in input_shape)
    rng = "np.random.default_rng(0)"
    script = _SCRIPT.format(
        imports=imports,
        make_input=(
            f"{rng}.integers(0, 256, {shape}, dtype=np.uint8)"
            if dtype == "uint8"
            else f"{rng}.standard_normal({shape}, dtype=np.float32)"
        ),
        threads=int(threads),
        path=str(path),
        load=load,
        runs=int(runs),
        run=textwrap.indent(run, "    "),
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@memory@@")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise RuntimeError(f"the measuring process failed (exit {done.returncode}): {tail}")
    measured = json.loads(lines[-1][len("@@memory@@") :])
    record = {
        "peak_rss_bytes": max(measured["peak"], measured["import_peak"]),
        "runtime_baseline_rss_bytes": measured["baseline"],
        "peak_rss_increase_bytes": measured["peak"] - measured["baseline"],
        "load_increase_bytes": measured["loaded"] - measured["baseline"],
        "runs": int(runs),
        "method": "a fresh process: peak_rss_bytes is its whole peak resident set (Python, the runtime and its "
        "libraries, the model); runtime_baseline_rss_bytes what it held after importing the runtime and "
        "making the input; peak_rss_increase_bytes the peak while loading the artifact and running it, "
        "minus that baseline: what the model itself needs",
    }
    if not measured["reset"]:  # without a peak reset, an import's passing peak can hide the model's
        record["method"] += " (peak not resettable on this host: the increase is a lower bound)"
    return record


def top_ops(totals: dict[str, tuple[float, int]], wall_ms: float, runs: int, source: str, top: int = TOP) -> dict:
    """A profile record from {op: (total ms over all runs, calls)} and the runs' total wall time; the record's
    times are per run (the mean of `runs`), `share` is of the operators' summed time."""
    ops_ms = sum(ms for ms, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))
    return {
        "available": True,
        "source": source,
        "runs": runs,
        "wall_ms": round(wall_ms / runs, 4),  # per run, as every time here
        "ops_ms": round(ops_ms / runs, 4),
        "ops": [
            {
                "op": op,
                "ms": round(ms / runs, 4),
                "count": calls // runs if calls % runs == 0 else calls / runs,
                "share": round(ms / ops_ms, 4) if ops_ms else 0.0,
            }
            for op, (ms, calls) in ranked[:top]
        ],
        "others_share": round(sum(ms for _, (ms, _) in ranked[top:]) / ops_ms, 4) if ops_ms else 0.0,
    }


@contextlib.contextmanager
def native_stderr_silenced():
    """Profilers' C++ logging (kineto's probing for GPUs, cpuinfo) writes straight to fd 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
