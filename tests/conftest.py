"""Shared fixtures: a really trained digits model (trained once, cached on disk) and one android build."""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from exporter.standins import digits
from exporter.cli import main

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


@pytest.fixture(scope="session", autouse=True)
def build_cache(tmp_path_factory) -> Path:
    """Builds in the suite share a cache of their own, never the user's ~/.cache/exporter."""
    root = tmp_path_factory.mktemp("exporter_cache")
    os.environ["EXPORTER_CACHE"] = str(root)
    return root


@pytest.fixture(scope="session", autouse=True)
def offline():
    """No test reaches the internet: a missing checkpoint is never fetched (test_download serves its own)."""
    os.environ["EXPORTER_OFFLINE"] = "1"


@pytest.fixture(scope="session", autouse=True)
def quiet_host():
    """The suite shares its cores with other jobs, so the host is often busy while a build times latency, and a
    build would then rightly refuse to cache it (exporter.hostload). In-process builds here judge every latency
    reliable, so that what the cache tests see does not depend on the neighbours; the conditions are still
    measured and recorded. tests/test_hostload.py judges for real, with the host loaded on purpose."""
    from exporter import hostload

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hostload, "judge", lambda conditions, threads, max_spread=None: (True, []))
        yield hostload


# Measured per file from a fresh clone (2-core host): the slowest first, so that the workers of `make test`
# (pytest-xdist, one per core) start on them and end together; the files not named follow in their own order.
ANDROID_BUILD = "android_build"  # the xdist group of every file that checks this session fixture
# test_region_detection starts once test_detection has had time to train the SSDlite stand-in its own starts from
# (a worker that asks for it earlier waits on the other's lock, idle).
SLOWEST_FIRST = (
    "test_segmentation",
    ANDROID_BUILD,
    "test_detection",
    "test_quant_cli",
    "test_coverage_sweep",
    "test_coverage_trained",
    "test_quant_pt2e",
    "test_optical_flow",
    "test_region_detection",
    "test_reproducibility",
    "test_ios",
    "test_video",
    "test_jetson",
)
ARM_SETUP = pytest.StashKey()


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the cores and keeps to it (CPU affinity), so a build's
    default threads (every core this process may use) are that share: two workers each timing on every core of
    the host would make every thread wait on another process's."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not workers or not hasattr(os, "sched_setaffinity"):
        return
    import torch

    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // int(workers))
    first = int(worker.removeprefix("gw")) * share % len(cores)
    os.sched_setaffinity(0, set(cores[first : first + share]))
    torch.set_num_threads(share)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """One xdist group per test file, and one for every file using `android_build`: a session fixture is made once
    per worker, and this build (and the suite's build cache it fills) is what those files check. Slowest first."""
    users = {item.path for item in items if ANDROID_BUILD in getattr(item, "fixturenames", ())}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(ANDROID_BUILD if item.path in users else item.path.stem))
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.get_closest_marker("xdist_group").args[0], len(rank)))


def pytest_sessionstart(session):
    """With the aarch64 step on and no runner ready, start `exporter arm-setup` when the session starts (minutes,
    mostly downloads), so it overlaps the suite; the tests that need it wait on its lock (aarch64.prepare). Started
    by the one process that outlives every test: pytest-xdist's controller, or pytest itself without workers."""
    import subprocess
    import sys
    import tempfile

    from exporter import aarch64

    if os.environ.get("PYTEST_XDIST_WORKER") or not ARM_E2E or aarch64.find(ARM_CACHE) is not None:
        return
    log = Path(tempfile.mkdtemp(prefix="arm-setup-")) / "arm-setup.log"
    env = {k: v for k, v in os.environ.items() if k not in ("EXPORTER_OFFLINE", "EXPORTER_CACHE")}
    env["EXPORTER_AARCH64_CACHE"] = str(aarch64.cache_root(ARM_CACHE))
    with open(log, "w") as handle:
        session.config.stash[ARM_SETUP] = subprocess.Popen(
            [sys.executable, "-c", "from exporter.cli import main; main()", "arm-setup"],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
        )


def pytest_sessionfinish(session):
    setup = session.config.stash.get(ARM_SETUP, None)
    if setup is not None and setup.poll() is None:  # nothing needed it; a killed set-up leaves nothing taken for ready
        setup.terminate()
        setup.wait()


@pytest.fixture(scope="session")
def digits_model() -> digits.DigitsModel:
    return digits.prepare(CACHE)


@pytest.fixture(scope="session")
def quantized_digits() -> digits.QuantizedDigitsModel:
    """ShuffleNetV2 x0.5 trained on the digits (about a minute) and quantized in eager mode as torchvision
    made its int8 weights: the stand-in for a downloaded quantized checkpoint."""
    return digits.prepare_quantized(CACHE, QUANTIZED_WEIGHT)


@pytest.fixture(scope="module")
def fragile_checkpoint(tmp_path_factory, digits_model):
    """The digits model with one deliberately fragile layer (same function in eager, hostile to a per-tensor int8
    range): tests/test_quant_sensitivity.py and tests/test_quant_cli.py."""
    return digits.fragile_checkpoint(digits_model, tmp_path_factory.mktemp("fragile"))


@pytest.fixture(scope="session")
def torch_home(tmp_path_factory, digits_model) -> Path:
    """A TORCH_HOME whose hub cache holds the digits checkpoint under torchvision's file name."""
    from torchvision.models import get_weight

    home = tmp_path_factory.mktemp("torch_home")
    checkpoints = home / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copy(digits_model.checkpoint, checkpoints / Path(get_weight(digits_model.weight).url).name)
    return home


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


@pytest.fixture(scope="session")
def android_build(tmp_path_factory, digits_model):
    out = tmp_path_factory.mktemp("android") / "build"
    result = run_cli(*build_args(digits_model, out, "--target", "android"))
    return out, result


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
