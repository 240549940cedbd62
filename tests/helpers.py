"""What the tests share besides fixtures: where the stand-ins are cached, the small-but-real build options,
running the CLI in-process, and assertions several test files make (a clean refusal, a device script that imports
neither torch nor the exporter, a device kit that reproduces its build, an artifact's preview)."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from exporter.cli import main
from exporter.standins import digits

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("EXPORTER_TEST_CACHE", ROOT / ".cache" / "digits"))

QUANTIZED_WEIGHT = "ShuffleNet_V2_X0_5_QuantizedWeights.IMAGENET1K_FBGEMM_V1"

# The aarch64 step under qemu (tests/test_validation_on_arm.py): on when EXPORTER_TEST_AARCH64=1 (`.ci/run` sets it).
# Its runner lives outside the clone and the suite's temporary cache, so a later run on the machine reuses it.
ARM_E2E = os.environ.get("EXPORTER_TEST_AARCH64", "") not in ("", "0")
ARM_CACHE = Path(os.environ.get("EXPORTER_TEST_AARCH64_CACHE") or Path.home() / ".cache" / "exporter")

# Small but real: every number below is measured, only on fewer images and iterations.
FAST = ["--calib-size", "64", "--val-size", "120", "--warmup", "2", "--iterations", "10"]
# For the builds whose subject is not the int8 budget (ONNX files, the device kit, byte-identity, ARM rows): the
# digits stand-in is trained on the host running the suite, and training differs by CPU. 120 validation digits
# resolve 0.83 points of acc@1; a stand-in trained on an AMD EPYC without AVX-512 lost 2 of them at int8 (1.67
# points, onnx and .pte alike) where the budget's 32 check images saw none, so the 1-point default failed there
# and only there. These builds judge int8 at 5 points (6 digits) and every other int8 threshold as the profile
# has it; the budget itself is tested by test_quant_cli on what the search guarantees. Their int8 is still built to
# the profile's 1-point budget, so it is the default build's artifact and comes from the suite's cache.
(_BUDGET,) = {
    tomllib.loads((ROOT / "targets" / f"{t}.toml").read_text())["thresholds"]["int8"]["accuracy_drop"]
    for t in ("android", "jetson")
}  # one value, or these builds' int8 would differ from the default's
INT8_SLACK = ["--threshold", "int8.accuracy_drop=5", "--quant-budget", f"accuracy_drop={_BUDGET}"]
# For builds whose subject is the artifacts' bytes, not their accuracy: 112 px (a quarter of the calibration's and
# the search's work at 224, the same code paths), few validation images, one timed iteration, thresholds that
# cannot fail.
BYTES_ONLY = [
    *("--input-size", "112", "112", "--val-size", "8", "--warmup", "0", "--iterations", "1"),
    *("--threshold", "top1_agreement=0", "--threshold", "psnr_db=0", "--threshold", "accuracy_drop=100"),
]


def hide_module(monkeypatch, hidden: str) -> None:
    """Make the format registry see `hidden` as not installed, as when its extra is missing."""
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == hidden else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def assert_clean_refusal(result, out, *needles):
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    # progress lines of steps that finished may precede it; the error itself is one line, last
    *progress, error = result.stderr.strip().splitlines()
    assert error.startswith("error: ") and all(line.startswith("✓") for line in progress), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in error, error
    assert not out.exists() or not any(out.iterdir())


def run_without_torch(script: Path, *args):
    """Run a script as it runs on a device: it fails if it imported torch or the exporter package."""
    import subprocess
    import sys

    code = (
        "import runpy, sys\n"
        f"sys.argv = [{script.name!r}, *{[str(a) for a in args]!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "finally:\n"
        f"    assert not {{'torch', 'exporter'}} & set(sys.modules), '{script.name} imported torch or exporter'\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def run_cli(*args: str, env: dict | None = None):
    result = CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=True)
    return result


def build_args(model: digits.DigitsModel, out: Path, *extra: str) -> list[str]:
    return [
        "build",
        model.weight,
        "--checkpoint",
        model.checkpoint,
        "--data",
        model.data_dir,
        "--labels",
        model.labels_file,
        "--out",
        out,
        "--quiet",
        *FAST,
        *extra,
    ]


def assert_device_reproduces_the_build(directory: Path) -> None:
    """device_validate.py here (ONNX Runtime, as the build ran its ONNX files) measures on the golden inputs
    what the build recorded for them (golden_fidelity): the same counts, the same numbers to float
    rounding, so it passes every ONNX artifact the build passed."""
    from exporter.device import device_validate

    doc = json.loads((directory / "manifest.json").read_text())
    # the build's threads: ONNX Runtime's int8 outputs move with the thread count (device_validate.validate)
    checked = {r["name"]: r for r in device_validate.validate(directory, "onnxruntime", doc["host"]["threads"])}
    entries = [a for a in doc["artifacts"] if a["format"] == "onnx" and a.get("path")]
    assert entries and set(checked) == {a["name"] for a in entries}
    for entry in entries:
        recorded, measured = entry["golden_fidelity"], checked[entry["name"]]["fidelity"]
        for key, value in recorded.items():
            if key not in measured or value is None:
                continue
            if isinstance(value, int):
                assert measured[key] == value, (entry["name"], key)
            else:
                assert measured[key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), (entry["name"], key)
        if entry["status"] == "passed":
            assert checked[entry["name"]]["status"] == "passed", checked[entry["name"]]


def assert_preview(build: Path, entry: dict, size: int) -> None:
    """An artifact's preview: a stack of one strip (input | eager | artifact under a title) per departing
    input it lists, or no picture when it is bit-identical to eager everywhere."""
    from PIL import Image

    from exporter.release import previews

    rows = entry["preview_rows"]
    if rows == []:
        assert "preview" not in entry, entry
        return
    assert 1 <= len(rows) <= previews.MOST and all(r["departure"] for r in rows), rows
    with Image.open(build / entry["preview"]) as im:
        n = len(rows)
        assert im.size[1] == n * (size + previews.TITLE) + (n - 1) * previews.GAP, (im.size, n)
        assert im.size[0] > 3 * size  # input | eager | artifact
