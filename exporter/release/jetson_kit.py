"""The Jetson device kit, written into the build directory after the artifacts (the target's post_build).

Engines are not portable across GPU model or TensorRT version, so the kit ships the ONNX files plus
build_engine.sh (trtexec, TensorRT 10 and 11 variants of what exporter.formats.tensorrt builds) and
device_validate.py (golden inputs against golden eager logits on the device), and lists, for detection,
the build's detection_decode.py beside it (the validator decodes boxes with it). Pre-flight warnings go to the
manifest under jetson.warnings.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..precision import Precision
from .. import files
from ..device import device_validate
from ..formats import onnx as onnx_format
from ..formats import tensorrt as tensorrt_format
from ..results import Manifest

NANO_CLASS_LIMIT_MB = 100  # larger models often fail on the Jetson Nano's memory
SCRIPT = "build_engine.sh"
VALIDATOR = "device_validate.py"
DECODER = device_validate.DECODER


def _options(doc: dict, precision: str) -> dict:
    """The TensorRT artifact's options for this precision (CLI overrides included), else the ONNX one's."""
    specs = [a for a in doc["target"]["artifacts"] if a["precision"] == precision]
    specs.sort(key=lambda a: a["format"] != "tensorrt")
    options = specs[0].get("options", {}) if specs else {}
    return {
        "batch": onnx_format.batch_profile(options.get("batch", onnx_format.DEFAULT_BATCH)),
        "workspace_mb": options.get("workspace_mb", tensorrt_format.DEFAULT_WORKSPACE_MB),
        "dla_core": options.get("dla_core"),
    }


def trtexec_args(onnx_file: str, engine_file: str, precision: str, chw, options: dict, trt_major: int) -> list[str]:
    shape = "x".join(str(d) for d in chw)
    args = [f"--onnx={onnx_file}", f"--saveEngine={engine_file}"]
    args += [f"--{k}Shapes={onnx_format.INPUT}:{n}x{shape}" for k, n in zip(("min", "opt", "max"), options["batch"])]
    args += [f"--memPoolSize=workspace:{options['workspace_mb']}M", f"--timingCacheFile={tensorrt_format.TIMING_CACHE}"]
    if precision == Precision.FP32:
        args.append("--noTF32")
    elif trt_major < 11:  # TensorRT 11 removed the precision flags: the graph's own types decide
        args.append("--fp16" if precision == Precision.FP16 else "--int8")
    if options["dla_core"] is not None:
        args += [f"--useDLACore={options['dla_core']}", "--allowGPUFallback"]
    return args


def _script(builds: list[dict]) -> str:
    def lines(major: int) -> str:
        return "\n".join(f'  "$TRTEXEC" {shlex.join(b["trtexec"][str(major)])}' for b in builds)

    return f"""#!/usr/bin/env bash
# Builds this device's TensorRT engines from the ONNX files beside this script, with the same
# settings as exporter's own TensorRT build. Then check them: python3 {VALIDATOR} .
# TRTEXEC and TRT_MAJOR may be set in the environment to override the detection below.
set -euo pipefail
cd "$(dirname "$0")"
TRTEXEC="${{TRTEXEC:-$(command -v trtexec || echo /usr/src/tensorrt/bin/trtexec)}}"
TRT_MAJOR="${{TRT_MAJOR:-$(python3 -c 'import tensorrt; print(tensorrt.__version__.split(".")[0])' 2>/dev/null || echo 10)}}"
if [ "$TRT_MAJOR" -ge 11 ]; then
{lines(11)}
else
{lines(10)}
fi
"""


def _warnings(doc: dict, onnx_entries: list[dict], builds: list[dict]) -> list[str]:
    warnings = []
    largest = max((e["size_bytes"] or 0 for e in onnx_entries), default=0) / 1e6
    if largest > NANO_CLASS_LIMIT_MB:
        warnings.append(
            f"model is {largest:.0f} MB: models over ~{NANO_CLASS_LIMIT_MB} MB often fail to build or load on "
            "Nano-class Jetsons (shared 4 GB memory)"
        )
    for b in builds:
        low, opt, high = b["options"]["batch"]
        if low > 1:
            warnings.append(
                f"{b['precision']}: batch profile {low}:{opt}:{high} excludes batch 1, which host validation "
                f"used; {VALIDATOR} feeds each golden input repeated {low} times"
            )
        dla = b["options"]["dla_core"]
        if dla is None:
            continue
        if b["precision"] == Precision.FP32:
            warnings.append(
                f"fp32 on DLA core {dla}: DLA runs only fp16 and int8, so every layer falls back to the GPU"
            )
        else:
            warnings.append(
                f"{b['precision']} on DLA core {dla}: layers DLA cannot run fall back to the GPU silently "
                "(--allowGPUFallback); check placement with trtexec --profilingVerbosity=detailed --dumpLayerInfo"
            )
        if b["precision"] == Precision.INT8:
            warnings.append(
                f"int8 on DLA core {dla}: the engine comes from explicit Q/DQ; layers left in fp32 between "
                "Q/DQ pairs cannot run on DLA, and DLA support differs across TensorRT releases (none in 11.0-11.3)"
            )
    return warnings


def write_device_kit(out: Path, doc: Manifest, session) -> None:
    """The target's post_build step: the kit written into `out`, described as the manifest's `jetson`."""
    doc.jetson = device_kit(out, doc.to_json(), tuple(session.fed.example.shape[1:]))


def device_kit(out: Path, doc: dict, chw: tuple) -> dict:
    """Write the kit for the build whose manifest record is `doc` (input of shape `chw`) into `out`; its description."""
    out = Path(out)
    model = doc["weight"]["model"]
    onnx_entries = [a for a in doc["artifacts"] if a["format"] == "onnx" and a["path"]]
    builds = []
    for entry in onnx_entries:
        options = _options(doc, entry["precision"])
        engine = f"{model}_tensorrt_{entry['precision']}{tensorrt_format.FORMAT.suffix}"
        builds.append(
            {
                "precision": entry["precision"],
                "onnx": entry["path"],
                "engine": engine,
                "options": options,
                "trtexec": {
                    str(m): trtexec_args(entry["path"], engine, entry["precision"], chw, options, m) for m in (10, 11)
                },
            }
        )
    kit = {"build_script": SCRIPT if builds else None, "validator": VALIDATOR, "golden": "golden", "engines": builds}
    if builds:
        files.write_text(out / SCRIPT, _script(builds))
        (out / SCRIPT).chmod(0o755)
    files.write_text(out / VALIDATOR, Path(device_validate.__file__).read_text(encoding="utf-8"))
    names = [SCRIPT, VALIDATOR]
    if (doc.get("task") or {}).get("name") == "detection":
        kit["decoder"] = DECODER  # the build wrote it (the task's device files)
        names.append(DECODER)
    kit["sha256"] = {name: files.sha256(out / name) for name in names if (out / name).is_file()}
    kit["warnings"] = _warnings(doc, onnx_entries, builds)
    return kit
