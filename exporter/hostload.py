"""What the host was doing while latency was timed, and whether that latency can be trusted.

`Window` samples the host before and after a timed window: the 1-minute load average (/proc/loadavg), the
host's busy, idle and steal time (/proc/stat, all CPUs) and this process's own CPU time (getrusage, all of its
threads). The CPU time other processes took is the host's busy time over the window minus our own. `judge`
is pure: from those numbers, the thread count timed and the profile's `max_spread` (p90/p50), it says whether
the latency is reliable and, when not, why. Where /proc is missing (macOS) only our own time and the load
average (os.getloadavg) are known, and only they and the spread are judged.

Runners are timed in rounds, and `settle` waits before each runner's turn until no other thread of this process
runs: a runtime's workers keep spinning after its last call, on cores the next runner needs (measured on the digits
MobileNetV3-Small: ONNX Runtime's for 60-110 ms, torch's OpenMP workers for 9-40 ms, XNNPACK's pool in ExecuTorch and
LiteRT for ~2 ms). The p50 of each round is kept; how far they move between rounds (`round_spread`, max over min) is
judged against what a quiet host allows (DEFAULT_MAX_ROUND_SPREAD): a p90/p50 within one window cannot see a window
that is slower as a whole.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

DEFAULT_MAX_SPREAD = 2.0  # p90/p50 of a runner above this: the samples are too scattered to stand for a p50
# Others may use the cores we leave free (cores - threads); beyond that, by more than this many cores' worth
# over the window, they competed with the timed threads.
OTHER_CORES_MARGIN = 0.25
STEAL_CORES_MARGIN = 0.10  # the hypervisor gave our vCPUs' time to other guests
LOAD_MARGIN = 0.5  # 1-minute load average above cores + this: more runnable tasks than cores (it lags a minute)
TICKS = 2  # /proc/stat counts whole clock ticks per CPU: tolerate this many per CPU of rounding
# max/min of a runner's per-round p50s, eager's taken with the build's eager baseline: above this the runner ran at
# another speed in some rounds than in others (another window, other load). Issue 77's demo had eager's p50 at 6.55 to
# 11.33 ms (1.73x) across one build's rows, each judged reliable. 1.25 is a first choice, set on a shared host: a quiet
# host's own figure is the manifest's eager.latency.build.round_spread of `make demo` run there.
DEFAULT_MAX_ROUND_SPREAD = 1.25
SETTLE_TIMEOUT_S = 0.5  # the longest wait for this process's other threads to stop running before a runner's turn
SETTLE_QUIET_POLLS = 3  # polls in a row (SETTLE_POLL_S apart) that must find no other thread running
SETTLE_POLL_S = 0.001


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def _proc_stat() -> tuple[float, float, float | None] | None:
    """(busy, idle, steal) seconds of all CPUs since boot; steal None when the kernel does not report it."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu":
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    ticks = [int(v) for v in first[1:]]
    user, nice, system, idle = ticks[:4]
    iowait, irq, softirq = (ticks[4:7] + [0, 0, 0])[:3]
    steal = ticks[7] if len(ticks) > 7 else None
    # guest time is already inside user/nice
    return (
        (user + nice + system + irq + softirq) / hz,
        (idle + iowait) / hz,
        (steal / hz if steal is not None else None),
    )


def _load_1m() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except (OSError, AttributeError):
            return None


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sample() -> dict:
    """One reading of the host: wall clock, load average, host CPU times, our own CPU time."""
    return {"t": time.perf_counter(), "load_1m": _load_1m(), "stat": _proc_stat(), "own_s": _own_cpu_s()}


def conditions(before: dict, after: dict, cpus: int | None = None) -> dict:
    """What the host did between two samples (the numbers the manifest records)."""
    cpus = cpus or os.cpu_count() or 1
    window = max(after["t"] - before["t"], 1e-9)
    own = max(after["own_s"] - before["own_s"], 0.0)
    found = {
        "window_s": round(window, 4),
        "cpus": cpus,
        "load_avg_1m": after["load_1m"],
        "own_cpu_s": round(own, 4),
        "other_cpu_s": None,
        "other_cpu_share": None,
        "steal_s": None,
    }
    if before["stat"] and after["stat"]:
        busy = after["stat"][0] - before["stat"][0]
        other = max(busy - own, 0.0)
        found.update(other_cpu_s=round(other, 4), other_cpu_share=round(other / (window * cpus), 4))
        if before["stat"][2] is not None and after["stat"][2] is not None:
            found["steal_s"] = round(after["stat"][2] - before["stat"][2], 4)
    return found


class Window:
    """`with Window() as w: ...timed code...`; then `w.conditions` (see `conditions`)."""

    def __enter__(self) -> "Window":
        self.conditions: dict = {}
        self._before = sample()
        return self

    def __exit__(self, *exc) -> None:
        self.conditions = conditions(self._before, sample())


def running_threads() -> list[str] | None:
    """The names of this process's threads, other than the calling one, that are running or waiting for a core now
    (state R in /proc/self/task), None where /proc is missing. A runtime's idle workers sleep (state S)."""
    import threading

    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    running = []
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split(" ", 1)[0]
        if state == "R":
            running.append(name)
    return running


def settle(timeout_s: float = SETTLE_TIMEOUT_S) -> list[str] | None:
    """Wait until no other thread of this process runs (SETTLE_QUIET_POLLS polls in a row), at most `timeout_s`:
    [] once they stopped, the names of those still running at the timeout, None where /proc is missing."""
    deadline, quiet, running = time.perf_counter() + timeout_s, 0, []
    while True:
        running = running_threads()
        if running is None:
            return None
        quiet = 0 if running else quiet + 1
        if quiet >= SETTLE_QUIET_POLLS:
            return []
        if time.perf_counter() >= deadline:
            return sorted(set(running))
        time.sleep(SETTLE_POLL_S)


def round_spread(p50s: list[float]) -> float | None:
    """max/min of per-round p50s (None with none, or a zero p50)."""
    values = [v for v in p50s if v is not None]
    return round(max(values) / min(values), 3) if values and min(values) > 0 else None


def spread(latency: dict) -> float | None:
    """p90/p50 of one runner's percentiles (validation.percentiles)."""
    p50, p90 = latency.get("p50"), latency.get("p90")
    return round(p90 / p50, 3) if p50 and p90 is not None else None


def judge(conditions: dict, threads: int, max_spread: float | None = None) -> tuple[bool, list[str]]:
    """(reliable, reasons): whether latency timed under these conditions with `threads` threads stands for the
    runtimes' speed. `conditions` may carry `spread` ({runner: p90/p50}), judged against `max_spread`;
    `round_spread` ({runner: max/min of its per-round p50s}), judged against its `max_round_spread`
    (DEFAULT_MAX_ROUND_SPREAD when absent); `unsettled` (threads of this process still running when a runner's
    turn came); `baseline_reasons` (why the build's eager baseline, which a speedup divides, was unreliable)."""
    max_spread = DEFAULT_MAX_SPREAD if max_spread is None else max_spread
    cpus = conditions.get("cpus") or os.cpu_count() or 1
    window = conditions.get("window_s") or 0.0
    slack = TICKS * cpus / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
    reasons = []
    load = conditions.get("load_avg_1m")
    if load is not None and load > cpus + LOAD_MARGIN:
        reasons.append(f"load {load:.1f} on {cpus} cores, {threads} threads timed")
    other = conditions.get("other_cpu_s")
    if other is not None and window > 0:
        allowed = max(cpus - threads, 0) * window + OTHER_CORES_MARGIN * window + slack
        if other > allowed:
            share = other / (window * cpus)
            reasons.append(
                f"other processes took {share:.0%} of the CPU ({other / window:.1f} of {cpus} cores) "
                f"over the {window:.2f} s timed"
            )
    steal = conditions.get("steal_s")
    if steal is not None and window > 0 and steal > STEAL_CORES_MARGIN * window + slack:
        reasons.append(f"the hypervisor took {steal / (window * cpus):.0%} of the CPU (steal time)")
    for name, value in (conditions.get("spread") or {}).items():
        if value is not None and value > max_spread:
            reasons.append(f"{name} p90/p50 {value:.1f} (the profile allows {max_spread:g})")
    max_round_spread = conditions.get("max_round_spread") or DEFAULT_MAX_ROUND_SPREAD
    for name, value in (conditions.get("round_spread") or {}).items():
        if value is not None and value > max_round_spread:
            beside = name == "eager" and "eager_beside_ms" in conditions  # with the baseline's rounds (validation)
            against = " (its rounds beside the artifact with the build's eager baseline's)" if beside else ""
            reasons.append(
                f"{name}'s p50 moved {value:.2f}x between rounds{against}; a quiet host allows {max_round_spread:g}x"
            )
    if conditions.get("unsettled"):
        reasons.append(
            f"threads of this process still ran when a runner was timed: {', '.join(conditions['unsettled'])}"
        )
    if conditions.get("baseline_reasons"):
        reasons.append(f"the build's eager baseline is unreliable: {'; '.join(conditions['baseline_reasons'])}")
    return not reasons, reasons


def judged(conditions: dict, threads: int, max_spread: float | None = None) -> dict:
    """`conditions` with `threads`, `max_spread`, `max_round_spread`, `reliable` and `reasons` set by `judge`."""
    max_spread = DEFAULT_MAX_SPREAD if max_spread is None else max_spread
    conditions = {**conditions, "max_round_spread": conditions.get("max_round_spread") or DEFAULT_MAX_ROUND_SPREAD}
    reliable, reasons = judge(conditions, threads, max_spread)
    return {**conditions, "threads": threads, "max_spread": max_spread, "reliable": reliable, "reasons": reasons}


def summary(conditions: dict) -> str:
    """One phrase for a report: why the latency under these conditions is unreliable ('' when it is not)."""
    if not conditions or conditions.get("reliable", True):
        return ""
    return "; ".join(conditions.get("reasons") or ["host busy"])
