"""A minimal aarch64 sysfs for the emulated Python, one per CPU model.

qemu-user lets the guest read the host's /sys, and the host's x86 cache topology makes torch's aarch64
start-up crash; with no /sys at all, cpuinfo fails, XNNPACK does not initialise and a .pte with XNNPACK
refuses to load. With `-L PREFIX`, qemu serves a path from PREFIX when it exists there, so each CPU gets a
prefix directory: links to the shared arm64 root, plus its own `sys/` listing the host's CPU count (as
qemu's emulated /proc/cpuinfo does) with that model's MIDR_EL1.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT_ENTRIES = ("bin", "etc", "lib", "opt", "sbin", "usr", "var")


def midr(cpuinfo: str) -> int:
    """MIDR_EL1 from the first processor of an emulated /proc/cpuinfo."""
    fields = {}
    for line in cpuinfo.splitlines():
        if ":" in line:
            k, _, v = line.partition(":")
            fields.setdefault(k.strip(), v.strip())
    return (
        int(fields["CPU implementer"], 16) << 24
        | int(fields["CPU variant"], 16) << 20
        | 0xF << 16
        | int(fields["CPU part"], 16) << 4
        | int(fields["CPU revision"], 0)
    )


def write_prefix(prefix: Path, root: Path, midr_value: int, count: int | None = None) -> None:
    """`prefix`: relative links to `root`'s top-level entries and a fake sys/devices/system/cpu."""
    count = count or os.cpu_count() or 1
    prefix.mkdir(parents=True)
    for name in ROOT_ENTRIES:
        if (root / name).exists() or (root / name).is_symlink():
            (prefix / name).symlink_to(os.path.relpath(root / name, prefix))
    cpu = prefix / "sys" / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    span = "0" if count == 1 else f"0-{count - 1}"
    for name in ("possible", "present", "online"):
        (cpu / name).write_text(span + "\n")
    (cpu / "kernel_max").write_text(f"{max(count - 1, 0)}\n")
    for i in range(count):
        topology = cpu / f"cpu{i}" / "topology"
        topology.mkdir(parents=True)
        for name, value in (
            ("physical_package_id", "0"),
            ("cluster_id", "0"),
            ("core_id", str(i)),
            ("core_siblings_list", span),
            ("package_cpus_list", span),
            ("cluster_cpus_list", span),
            ("thread_siblings_list", str(i)),
            ("core_cpus_list", str(i)),
        ):
            (topology / name).write_text(value + "\n")
        regs = cpu / f"cpu{i}" / "regs" / "identification"
        regs.mkdir(parents=True)
        (regs / "midr_el1").write_text(f"0x{midr_value:016x}\n")
        (regs / "revidr_el1").write_text("0x0000000000000000\n")
