"""The request a command line builds: `build` and `coverage` keep every parameter and help text they had, and the
values reach the engine as the options say, checked before anything is written. Fast: nothing is built."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from exporter import build as api
from exporter.cli import main
from exporter.engine import profiles
from exporter.engine.request import BuildRequest
from exporter.errors import UsageError

from .helpers import run_cli

# `exporter build` and `exporter coverage` as their options were declared one by one (click.option decorators),
# before a request was built from them: each parameter's click description and the --help text.
BEFORE = Path(__file__).parent / "golden_json" / "cli_build_coverage.json"


def _described(command: str) -> dict:
    params = [
        dict(p.to_info_dict(), metavar=p.metavar, show_default=getattr(p, "show_default", None))
        for p in main.commands[command].params
    ]
    shown = CliRunner().invoke(main, [command, "--help"], terminal_width=100)
    assert shown.exit_code == 0, shown.output
    return json.loads(json.dumps({"params": params, "help": shown.output}, default=repr))


# what each declaration says, whatever click's version renders around it
DECLARED = ("name", "opts", "secondary_opts", "required", "default", "multiple", "nargs", "is_flag", "help")


@pytest.mark.parametrize("command", ["build", "coverage"])
def test_every_parameter_and_the_help_are_as_before(command):
    snapshot = json.loads(BEFORE.read_text())
    before, now = snapshot[command], _described(command)
    assert [p["name"] for p in now["params"]] == [p["name"] for p in before["params"]]
    for was, is_ in zip(before["params"], now["params"]):
        assert {k: is_.get(k) for k in DECLARED} == {k: was.get(k) for k in DECLARED}, was["name"]
        if click.__version__ == snapshot["click"]:  # the rest (types' descriptions, the help's layout) is click's
            assert is_ == was, was["name"]
    if click.__version__ == snapshot["click"]:
        assert now["help"] == before["help"]


@pytest.fixture
def built(monkeypatch):
    """What `exporter build` hands the Python API, the build stopped there."""
    seen = []

    def stop(request, targets, progress=None):
        seen.append((request, list(targets)))
        raise UsageError("stopped before the build")

    monkeypatch.setattr(api, "build_targets", stop)
    return seen


def test_every_option_reaches_the_request(built, tmp_path):
    result = run_cli(
        "build", "resnet18", "--target", "ios", "--target", "jetson", "--out", tmp_path / "o",
        "--checkpoint", "c.pt", "--no-verify", "--offline", "--float-checkpoint", "f.pt", "--labels", "l.txt",
        "--data", "d", "--input-size", "64", "96", "--calib-size", "0", "--val-size", "5", "--threads", "0",
        "--warmup", "3", "--iterations", "7", "--threshold", "int8.psnr_db=30", "--threshold", "fp32.psnr_db=60",
        "--arch", "aarch64", "--cpu", "cortex-a53", "--cpu", "cortex-a76", "--must-run-on", "cortex-a55", "--no-count",
        "--input-format", "uint8-nhwc", "--input-size-range", "64", "320", "--detections", "graph",
        "--quant-budget", "psnr_db=30", "--no-fallback", "--format", "onnx", "--format", "executorch:int8",
        "--option", "batch=1:2:4", "--option", "fast=true", "--batch", "1:1:8", "--workspace", "64",
        "--dla-core", "1", "--require-engine", "--deployment-target", "iOS17", "--no-cache", "--force", "--quiet",
    )  # fmt: skip
    assert result.exit_code == 2 and "stopped before the build" in result.stderr
    (request, targets), = built  # fmt: skip
    assert targets == ["ios", "jetson"]
    assert request == BuildRequest(
        weight="resnet18",
        target="ios",
        out=tmp_path / "o",
        checkpoint=Path("c.pt"),
        verify=False,
        labels=Path("l.txt"),
        data=Path("d"),
        force=True,
        thresholds=["int8.psnr_db=30", "fp32.psnr_db=60"],
        quant_budget=["psnr_db=30"],
        fallback=False,
        formats=["onnx", "executorch:int8"],
        # --batch over --option batch=, in the place --option gave it
        options={"batch": "1:1:8", "fast": True, "workspace_mb": 64, "dla_core": 1, "require_engine": True}
        | {"deployment_target": "iOS17"},
        cache=False,
        calib_size=0,
        val_size=5,
        threads=0,
        warmup=3,
        iterations=7,
        offline=True,
        float_checkpoint=Path("f.pt"),
        arch=["aarch64"],
        cpus=["cortex-a53", "cortex-a76"],
        must_run_on=["cortex-a55"],
        count=False,
        input_format="uint8-nhwc",
        size_range=(64, 320),
        detections="graph",
        input_size=(64, 96),
    )
    assert list(request.options) == ["batch", "fast", "workspace_mb", "dla_core", "require_engine", "deployment_target"]


def test_no_option_is_the_python_apis_default_request(built):
    assert run_cli("build", "resnet18").exit_code == 2
    assert built == [(BuildRequest("resnet18"), ["android"])]


@pytest.mark.parametrize("raw", ["novalue", "=3"])
def test_a_format_option_without_a_key_is_one_line_before_the_build(built, raw):
    result = run_cli("build", "resnet18", "--option", raw)
    assert result.exit_code == 2 and result.stderr == f"error: --option {raw!r}: expected KEY=VALUE\n"
    assert built == []


def test_coverage_hands_the_sweep_its_settings(monkeypatch, tmp_path):
    from exporter import coverage as sweep

    seen = []

    def stop(settings, *args, **kwargs):
        seen.append((settings, args, kwargs))
        raise UsageError("stopped before the sweep")

    monkeypatch.setattr(sweep, "run", stop)
    result = run_cli(
        "coverage", "--out", tmp_path, "--models", "resnet*", "--task", "classification", "--one-per-builder",
        "--max-params", "5000000", "--shard", "1/2", "--threads", "2", "--arch", "aarch64", "--no-cache",
    )  # fmt: skip
    assert result.exit_code == 2 and "stopped before the sweep" in result.stderr
    ((settings, args, kwargs),) = seen
    assert (settings.targets, settings.calib_size, settings.val_size, settings.threads) == (("all",), 16, 8, 2)
    assert (settings.cpus, settings.input_size, settings.time_limit, settings.weights) == (
        ("target",),
        (128, 128),
        900,
        "random",
    )
    assert args == (("resnet*",), ("classification",), True, 5000000, "1/2", tmp_path)
    assert kwargs["cache"] is False and kwargs["builds_dir"] is None


def test_a_request_overrides_its_targets_profile():
    request = BuildRequest("resnet18", formats=["executorch"], threads=3, cpus=["cortex-a53"], fallback=False)
    profile = profiles.with_overrides(profiles.load("android"), request.overrides())
    assert {a["format"] for a in profile["artifacts"]} == {"executorch"}
    assert profile["latency"]["threads"] == 3 and profile["quantization"]["fallback"] is False
    assert "aarch64" in profile["validate"]["arch"] and profile["validate"]["cpus"] == ["cortex-a53"]
    own = profiles.load("android")
    untouched = profiles.with_overrides(own, BuildRequest("resnet18").overrides())
    assert (untouched["quantization"], untouched["artifacts"], untouched["latency"]) == (
        own.get("quantization", {}),
        [a for a in own["artifacts"] if not a.get("on_request")],
        own["latency"],
    )


def test_the_cores_an_app_must_run_on_are_validated_and_recorded_whatever_cpu_names():
    from exporter.engine.plan import make

    request = BuildRequest("r", cpus=["cortex-a76"], must_run_on=["cortex-a53"])
    profile = profiles.with_overrides(profiles.load("android"), request.overrides())
    assert profile["validate"]["cpus"] == ["cortex-a76", "cortex-a53"]
    assert profile["validate"]["must_run_on"] == ["cortex-a53"] and "aarch64" in profile["validate"]["arch"]
    assert make(profile, "classification").describe()["validate"]["must_run_on"] == ["cortex-a53"]
    assert "must_run_on" not in make(profiles.load("android"), "classification").describe()["validate"]
    with pytest.raises(UsageError, match="unknown"):
        profiles.with_overrides(profiles.load("android"), BuildRequest("r", must_run_on=["cortex-z9"]).overrides())
    broken = profiles.load("android") | {"validate": {"arch": ["x86_64"], "must_run_on": ["cortex-a53"]}}
    with pytest.raises(UsageError, match="must_run_on"):
        profiles.check(broken, "a profile")


def test_an_artifact_made_on_request_is_made_only_when_named_with_its_precision():
    """android.toml lists the fp16 .pte on request: a default build and `--format executorch` leave it out,
    `--format executorch:fp16` makes it (alone, or beside the others named)."""

    def made(*formats):
        profile = profiles.with_overrides(
            profiles.load("android"), BuildRequest("r", formats=list(formats)).overrides()
        )
        return [f"{a['format']}:{a['precision']}" for a in profile["artifacts"]]

    assert "executorch:fp16" in [f"{a['format']}:{a['precision']}" for a in profiles.load("android")["artifacts"]]
    assert "executorch:fp16" not in made() and made("executorch") == ["executorch:fp32", "executorch:int8"]
    assert made("executorch:fp16") == ["executorch:fp16"]
    assert made("executorch", "executorch:fp16") == ["executorch:fp32", "executorch:fp16", "executorch:int8"]


def test_the_requests_checks_write_nothing(tmp_path):
    from exporter.engine import pipeline, target_profile
    from exporter.progress import Progress

    request = BuildRequest("mobilenet_v3_small", out=tmp_path / "o")
    chosen = [target_profile(request, t) for t in ("android", "ios")]
    checked = pipeline.check_request(request, chosen, None, Progress(quiet=True))
    assert checked.outs == [tmp_path / "o" / "android", tmp_path / "o" / "ios"] and not checked.single
    request.data = tmp_path / "missing"
    with pytest.raises(UsageError, match="is not a directory"):
        pipeline.check_request(request, chosen, None, Progress(quiet=True))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--quiet", "--json"])
def test_a_failed_build_without_its_report_says_why_on_stderr(monkeypatch, tmp_path, flag):
    """In CI a quiet build's exit 1 names each failed artifact and its reasons; a passing one says nothing."""

    from .fake_manifest import complete

    fidelity = {"samples": 8, "psnr_db": 60.0, "cosine": 1.0, "max_abs_error": 0.0}
    fidelity |= {"top1_agreement": 1.0, "top5_agreement": 1.0}

    def artifact(name, status, *texts):
        fmt, precision = name.split("_")
        made = {"path": f"{name}.bin", "sha256": "0" * 64, "size_bytes": 1, "fidelity": fidelity, "latency_ms": None}
        reasons = [{"kind": "threshold", "text": t} for t in texts]
        return {"name": name, "format": fmt, "precision": precision, "status": status, "reasons": reasons} | {
            "thresholds": {},
            **made,
        }

    doc = {
        "weight": {"name": "W"},
        "target": {"name": "android"},
        "artifacts": [
            artifact("executorch_fp32", "passed"),
            artifact("litert_int8", "failed", "accuracy_drop 1.667 (needs <= 1)", "psnr_db 20 (needs >= 30)"),
        ],
    }
    built = [complete(doc)]  # what the build returns: each target's manifest record
    monkeypatch.setattr(api, "build_targets", lambda request, targets, progress=None: built)
    monkeypatch.setattr("exporter.release.manifest.dumps", lambda d: "{}")
    result = run_cli("build", "resnet18", "--out", tmp_path / "o", flag)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "failed: android litert_int8: accuracy_drop 1.667 (needs <= 1); psnr_db 20 (needs >= 30)"
    ]
    built[:] = [complete({**doc, "artifacts": [artifact("executorch_fp32", "passed")]})]
    result = run_cli("build", "resnet18", "--out", tmp_path / "o", flag)
    assert result.exit_code == 0 and result.stderr == ""
