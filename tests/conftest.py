"""Shared fixtures (a really trained digits model, trained once and cached on disk, and one android build) and the
suite's pytest hooks. The helpers the tests share are in tests/helpers.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from exporter.standins import digits

from .helpers import ARM_CACHE, ARM_E2E, CACHE, INT8_SLACK, QUANTIZED_WEIGHT, build_args, run_cli


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


@pytest.fixture(scope="session")
def android_app_code(tmp_path_factory) -> Path:
    """The Android app's pure-Kotlin files and tests/kotlin/AppCheck.kt, compiled once per worker (tests/kotlin_app.py)."""
    from . import kotlin_app

    return kotlin_app.compile_app(tmp_path_factory.mktemp("kotlin"))


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
# test_quant and test_coverage were measured whole; split by module since, their slow files (real builds, trained
# stand-ins) stand where they stood, the whole builds first.
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
    """With the aarch64 step on and no runner (or no counting qemu) ready, start `exporter arm-setup` when the
    session starts (minutes: downloads, and compiling the counting qemu), so it overlaps the suite; the tests that
    need it wait on its locks (aarch64.prepare, counter.prepare). Started by the one process that outlives every
    test: pytest-xdist's controller, or pytest itself without workers."""
    import subprocess
    import sys
    import tempfile

    from exporter import aarch64
    from exporter.aarch64 import counter

    if os.environ.get("PYTEST_XDIST_WORKER") or not ARM_E2E:
        return
    if aarch64.find(ARM_CACHE) is not None and counter.find(ARM_CACHE) is not None:
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


@pytest.fixture(scope="session")
def android_build(tmp_path_factory, digits_model):
    out = tmp_path_factory.mktemp("android") / "build"
    result = run_cli(*build_args(digits_model, out, "--target", "android", *INT8_SLACK))
    return out, result
