"""Re-run artifacts on aarch64 kernels from an x86 Linux host: a qemu-user runner the exporter sets up under
its cache, and the runs on named emulated CPUs.

    runner = prepare()                                   # <cache>/aarch64/<key>, built once (arm-setup)
    results = run(runner, [pte, onnx], images, ["cortex-a53", "cortex-a76"])

Importing this package imports neither torch nor numpy (docs/validation.md, "aarch64 rows").
"""

from __future__ import annotations

from .cpus import FOR_TARGET, FP16_ARITHMETIC, WHY
from .execute import Result, run, verify_bundled
from .runner import Runner, cache_root, find, prepare

__all__ = [
    "FOR_TARGET",
    "FP16_ARITHMETIC",
    "WHY",
    "Result",
    "Runner",
    "cache_root",
    "find",
    "prepare",
    "run",
    "verify_bundled",
]
