"""What memory a build held, and what its neighbours held, sampled from /proc while it runs (Linux). The
kernel's OOM killer says only that the host ran out: whether that is the weight's verdict depends on whether
the build had the host to itself. Measured: RegNetY-128GF's android build killed at 12.3 GB on a 24 GB host
while another sweep's ViT-H-14 build held 14.8 GB; alone, it was not."""

from __future__ import annotations

from pathlib import Path

OTHERS_SHARE = 0.25  # other processes holding more of the host than this when the build was killed: not its verdict


def sample(pid: int) -> dict | None:
    """The process's peak resident memory, the host's total and what other processes held (total less what is
    available less the process's own), in bytes; None where /proc cannot say."""
    try:
        lines = [*Path(f"/proc/{pid}/status").read_text().splitlines(), *Path("/proc/meminfo").read_text().splitlines()]
    except OSError:
        return None
    kb = {}
    for line in lines:
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            kb[key] = int(parts[0]) * 1024
    if not {"VmRSS", "MemTotal", "MemAvailable"} <= kb.keys():
        return None
    return {"build_peak_bytes": kb.get("VmHWM", kb["VmRSS"]), "host_bytes": kb["MemTotal"],
            "others_bytes": max(0, kb["MemTotal"] - kb["MemAvailable"] - kb["VmRSS"])}


def others_to_blame(memory: dict | None) -> bool:
    return bool(memory) and memory["others_bytes"] > OTHERS_SHARE * memory["host_bytes"]


def oom_text(memory: dict | None) -> str:
    """Why the kernel killed the build, with the memory last sampled before it did."""
    if not memory:
        return "out of memory (killed by the kernel)"
    text = (f"out of memory (killed by the kernel; the build had reached {_gb(memory['build_peak_bytes'])} "
            f"of this host's {_gb(memory['host_bytes'])}")
    if others_to_blame(memory):
        return f"{text}, other processes held {_gb(memory['others_bytes'])}: built again next time)"
    return f"{text})"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
