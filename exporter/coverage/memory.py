"""What memory a build held, and what other processes held, sampled from /proc while it runs (Linux). The
kernel's OOM killer says only that the host ran out: whether that is the weight's verdict depends on whether
the build had the host to itself. Measured: RegNetY-128GF's android build killed at 12.3 GB on a 24 GB host
while another sweep's ViT-H-14 build held 14.8 GB. The host's memory is /proc/meminfo's: under a cgroup
limit lower than the machine's, the build's share looks smaller than it was."""

from __future__ import annotations

from pathlib import Path

OTHERS_SHARE = 0.25  # other processes holding more of the host than this when the build was killed: not its verdict


def sample(group: int, before: dict | None = None) -> dict | None:
    """Resident memory of the build (every process in its process group `group`: the worker and what it started,
    e.g. a fresh process measuring an artifact's RAM) at its largest so far (`before`: the previous sample), the
    host's total, and what other processes held now (total less available less the build's), in bytes; None
    where /proc cannot say."""
    try:
        host = _kb_fields(Path("/proc/meminfo"))
    except OSError:
        return None
    build = _group_rss(group)
    if not build or not {"MemTotal", "MemAvailable"} <= host.keys():
        return None
    peak = max(build, (before or {}).get("build_peak_bytes", 0))
    return {
        "build_peak_bytes": peak,
        "host_bytes": host["MemTotal"],
        "others_bytes": max(0, host["MemTotal"] - host["MemAvailable"] - build),
    }


def others_to_blame(memory: dict | None) -> bool:
    return bool(memory) and memory["others_bytes"] > OTHERS_SHARE * memory["host_bytes"]


def oom_text(memory: dict | None) -> str:
    """Why the kernel killed the build, with the memory last sampled before it did."""
    if not memory:
        return "out of memory (killed by the kernel)"
    text = (
        f"out of memory (killed by the kernel; the build held at least {_gb(memory['build_peak_bytes'])} "
        f"of this host's {_gb(memory['host_bytes'])}"
    )
    if others_to_blame(memory):
        return f"{text}, other processes {_gb(memory['others_bytes'])} when last sampled: built again next time)"
    return f"{text})"


def _group_rss(group: int) -> int:
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == group:
                total += _kb_fields(stat.with_name("status")).get("VmRSS", 0)
        except (OSError, IndexError, ValueError):
            continue  # gone between the listing and the read
    return total


def _kb_fields(path: Path) -> dict:
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) * 1024
    return fields


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
