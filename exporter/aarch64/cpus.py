"""The emulated CPUs the aarch64 rows run on, named and with why each is there; never qemu's `max`.

XNNPACK picks its kernels by CPU feature (NEON, dotprod, i8mm, SVE) and core, so the cores are chosen to
take different int8 paths. qemu 7.2's `max` computes wrong int8 (its SME emulation; shared/NOTES.md), and a
row on `max` would describe no real device anyway.
"""

from __future__ import annotations

from ..errors import UsageError

WHY = {
    "cortex-a35": "ARMv8.0, no dotprod: low-end in-order core (wearables, Android Go)",
    "cortex-a53": "ARMv8.0, no dotprod: the little core of older and budget Android phones (plain NEON int8 kernels)",
    "cortex-a55": "ARMv8.2 + dotprod: the little core of most current Android phones",
    "cortex-a76": "ARMv8.2 + dotprod: a typical Android big core (dotprod int8 kernels); also the stand-in for "
    "Jetson Orin's Cortex-A78AE (the same ISA: v8.2, dotprod, no SVE, no i8mm), which qemu does not model",
    "neoverse-n2": "ARMv9 + i8mm + SVE2: the newest phones' int8 matrix-multiply kernels",
    "cortex-a57": "ARMv8.0, no dotprod: the Jetson Nano's core",
    "cortex-a72": "ARMv8.0, no dotprod: Raspberry Pi 4 class",
    "neoverse-n1": "ARMv8.2 + dotprod: server core (Graviton2)",
    "neoverse-v1": "ARMv8.4 + SVE + i8mm + bf16: server core (Graviton3)",
    "cortex-a710": "ARMv9 + SVE2 + i8mm: big core of 2022 phones",
}
# Armv8.2-A FP16 arithmetic (FEAT_FP16): the cores of WHY that compute an fp16 program's ops in half precision.
# The others (Armv8.0) still run it: cortex-a53 counted a digits MobileNetV3-Small fp16 .pte at 1.11x its fp32
# program's instructions, cortex-a76 at 0.72x (docs/precisions.md).
FP16_ARITHMETIC = frozenset({"cortex-a55", "cortex-a76", "neoverse-n2", "neoverse-n1", "neoverse-v1", "cortex-a710"})
FOR_TARGET = {
    "android": ("cortex-a53", "cortex-a76", "neoverse-n2"),
    "jetson": ("cortex-a57", "cortex-a76"),
}


def check(names: list[str] | tuple[str, ...], available: list[str] | None = None) -> list[str]:
    """The CPU names, refused (UsageError) when one is `max`, unknown here, or not modelled by this qemu."""
    for name in names:
        if name == "max" or name.startswith("max,"):
            raise UsageError(
                "--cpu max is refused: qemu's 'max' models no real core (and qemu 7.2's computes "
                f"wrong int8); name one, e.g. {', '.join(FOR_TARGET['android'])}"
            )
        if name not in WHY:
            raise UsageError(f"unknown aarch64 CPU '{name}'; choose from {', '.join(sorted(WHY))}")
        if available is not None and name not in available:
            raise UsageError(
                f"this qemu does not model '{name}' (it lists {', '.join(available)}); "
                "rebuild the runner with a newer qemu (exporter arm-setup --rebuild) or pick another"
            )
    return list(dict.fromkeys(names))
