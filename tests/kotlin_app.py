"""The Android app's pure-Kotlin files (no Android imports: the resize, the SSD decode, the .bpte reader) compiled
with kotlinc and run on a JVM by tests/kotlin/AppCheck.kt, so that what the app computes is held to torchvision
and to the exporter here. Needs Debian's `kotlin` and `libandroid-json-java` (Android's org.json), which .ci/run
installs; elsewhere the tests skip, unless EXPORTER_TEST_KOTLIN=1 makes a missing compiler a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "apps/android/app/src/main/java/org/example/bundleclassifier"
PURE = ("Preprocess.kt", "Detections.kt", "Bpte.kt")
HARNESS = Path(__file__).resolve().parent / "kotlin/AppCheck.kt"
ANDROID_JSON = Path("/usr/share/java/com.android.json.jar")
MAIN = "org.example.bundleclassifier.AppCheckKt"


def compile_app(out_dir: Path) -> Path:
    """The jar of the app's pure files and the harness; skips (or fails, in CI) where kotlinc is missing."""
    missing = [
        what
        for what, ok in (("kotlinc", shutil.which("kotlinc")), (str(ANDROID_JSON), ANDROID_JSON.is_file()))
        if not ok
    ]
    if missing:
        reason = f"no {' or '.join(missing)} (Debian: apt-get install kotlin libandroid-json-java)"
        if os.environ.get("EXPORTER_TEST_KOTLIN") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    jar = out_dir / "app.jar"
    sources = [str(APP / name) for name in PURE] + [str(HARNESS)]
    done = subprocess.run(
        ["kotlinc", *sources, "-cp", str(ANDROID_JSON), "-d", str(jar)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and jar.is_file(), done.stderr
    return jar


def run(jar: Path, cases: Path) -> None:
    """Every case directory under `cases` through the app's code (one JVM)."""
    done = subprocess.run(
        ["kotlin", "-cp", f"{jar}:{ANDROID_JSON}", MAIN, str(cases)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]


def case(cases: Path, name: str, check: str, **spec) -> Path:
    directory = cases / name
    directory.mkdir(parents=True)
    (directory / "case.json").write_text(json.dumps({"check": check, **spec}))
    return directory


def floats(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes(), dtype="<f4")


def read_bpte(jar: Path, bpte: Path, work: Path) -> dict:
    """The app's reading of a `.bpte` (Bpte.read), in the shape of exporter.formats.bundled_program.read's."""
    directory = case(work, "bpte", "bpte")
    shutil.copyfile(bpte, directory / "program.bpte")
    run(jar, work)
    described = json.loads((directory / "read.json").read_text())

    def array(t: dict) -> np.ndarray:
        dtype = "<f4" if t["dtype"] == "float32" else np.uint8
        return np.frombuffer((directory / t["file"]).read_bytes(), dtype=dtype).reshape(t["sizes"])

    return {
        "version": described["version"],
        "method": described["method"],
        "cases": [{role: [array(t) for t in c[role]] for role in ("inputs", "expected")} for c in described["cases"]],
        "program": (directory / "program.pte").read_bytes(),
    }


def servable(jar: Path, cpuinfo: str, bundle: dict, work: Path) -> dict:
    """The CPU features the app reads from `cpuinfo`, and per artifact of `bundle` whether it keeps it."""
    directory = case(work, "servable", "servable", cpuinfo=cpuinfo, bundle=bundle)
    run(jar, work)
    return json.loads((directory / "servable.json").read_text())


def takes(jar: Path, bundle: dict, work: Path) -> dict:
    """What the app feeds each of the bundle's artifacts: "uint8", "float32" or "refused: <why>"."""
    directory = case(work, "takes", "takes", bundle=bundle)
    run(jar, work)
    return json.loads((directory / "takes.json").read_text())
