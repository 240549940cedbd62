"""A complete aarch64 runner on disk: its files, and the command and environment that run its Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

READY = "READY.json"  # written last, inside the temporary directory, before the rename


@dataclass
class Runner:
    """A complete runner: qemu-aarch64, the arm64 root, one `-L` prefix per CPU model."""

    path: Path
    info: dict = field(default_factory=dict)

    @property
    def qemu(self) -> Path:
        return self.path / "qemu-aarch64"

    @property
    def root(self) -> Path:
        return self.path / "root"

    @property
    def cpus(self) -> list[str]:
        return list(self.info.get("cpus", {}))

    def python(self, cpu: str, script: str, *args: str, qemu: Path | None = None, options=()) -> list[str]:
        """The command running `script` (a path inside the root) with the runner's Python on `cpu`; `qemu` and
        its `options`: another qemu-aarch64 (the counting one, with its plugin) instead of the runner's."""
        prefix = self.path / "cpus" / cpu
        return [
            str(qemu or self.qemu),
            "-cpu",
            cpu,
            "-L",
            str(prefix),
            *options,
            str(prefix / "usr" / "bin" / "python3"),
            "-s",
            script,
            *args,
        ]

    @staticmethod
    def environment() -> dict[str, str]:
        """The guest's whole environment (qemu passes its own on): nothing of the host's (no x86
        LD_LIBRARY_PATH), the installed wheels on the path, CUDA off, no byte code written."""
        return {
            "PATH": "/usr/bin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "PYTHONPATH": "/opt/site",
            "PYTHONDONTWRITEBYTECODE": "1",
            "EXPORTER_AARCH64_NO_CUDA": "1",
            "OMP_NUM_THREADS": "1",
        }
