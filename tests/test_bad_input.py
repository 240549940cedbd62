"""Every bad input: one line on stderr, exit code 2, no traceback, nothing written."""

import pytest
import torch

from exporter.errors import UsageError

from .helpers import assert_clean_refusal, hide_module, run_cli


@pytest.fixture
def build(tmp_path, digits_model):
    out = tmp_path / "out"

    def run(*args, weight=None, checkpoint="default", env=None):
        ckpt = (
            []
            if checkpoint is None
            else ["--checkpoint", digits_model.checkpoint if checkpoint == "default" else checkpoint]
        )
        return run_cli("build", weight or digits_model.weight, *ckpt, "--out", out, *args, env=env), out

    run.out = out
    return run


def test_unknown_weight_suggests(build):
    result, out = build(weight="mobilenet_v3_smal")
    assert_clean_refusal(result, out, "unknown weight", "mobilenet_v3_small")


def test_unknown_target(build):
    result, out = build("--target", "symbian")
    assert_clean_refusal(result, out, "unknown target 'symbian'", "android")


def test_missing_extra(build, monkeypatch):
    hide_module(monkeypatch, "executorch")
    result, out = build()
    assert_clean_refusal(result, out, "pip install 'exporter[android]'")


def test_offline_without_cached_weights(build, tmp_path):
    result, out = build(checkpoint=None, env={"TORCH_HOME": str(tmp_path / "empty")})
    assert_clean_refusal(result, out, "mobilenet_v3_small-047dcff4.pth", "--checkpoint")


def test_checkpoint_missing(build, tmp_path):
    result, out = build(checkpoint=tmp_path / "nope.pth")
    assert_clean_refusal(result, out, "does not exist")


def test_checkpoint_truncated(build, tmp_path, digits_model):
    cut = tmp_path / "cut.pth"
    cut.write_bytes(digits_model.checkpoint.read_bytes()[:100_000])
    result, out = build(checkpoint=cut)
    assert_clean_refusal(result, out, "truncated or not a torch file")


def test_checkpoint_not_a_state_dict(build, tmp_path):
    path = tmp_path / "list.pth"
    torch.save([torch.zeros(3)], path)
    result, out = build(checkpoint=path)
    assert_clean_refusal(result, out, "not a state dict")


def test_checkpoint_wrong_architecture(build, digits_model):
    result, out = build(weight="resnet18")
    assert_clean_refusal(result, out, "does not fit resnet18", "missing keys")


def test_checkpoint_hash_mismatch(build, tmp_path, digits_model):
    renamed = tmp_path / "mobilenet_v3_small-deadbeef.pth"
    renamed.write_bytes(digits_model.checkpoint.read_bytes())
    result, out = build(checkpoint=renamed)
    assert_clean_refusal(result, out, "hash check", "--no-verify")


def test_pickle_rejected_by_weights_only(build, tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"weight": torch.zeros(1), "hook": print}, path)
    result, out = build(checkpoint=path)
    assert_clean_refusal(result, out, "weights_only=True")


def test_data_dir_empty(build, tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    result, out = build("--data", empty)
    assert_clean_refusal(result, out, "no images")


def test_data_dir_without_images(build, tmp_path):
    data = tmp_path / "data"
    (data / "cat").mkdir(parents=True)
    (data / "cat" / "notes.txt").write_text("not an image")
    result, out = build("--data", data)
    assert_clean_refusal(result, out, "no images")


def test_out_dir_not_empty(build):
    out = build.out
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result, _ = build()
    assert result.exit_code == 2 and "--force" in result.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_out_dir_unwritable(digits_model):
    result = run_cli(
        "build", digits_model.weight, "--checkpoint", digits_model.checkpoint, "--out", "/proc/exporter/out"
    )
    assert result.exit_code == 2 and "not writable" in result.stderr


@pytest.mark.parametrize(
    "override, needle",
    [
        ("int8.psnr_db=abc", "is not a number"),
        ("top1_agreement=1.5", "fraction in [0, 1]"),
        ("int8.psnr_db=-5", "threshold psnr_db must be >= 0, got -5.0"),
        ("int8.speed=3", "unknown threshold 'speed'"),
        ("int4.psnr_db=30", "unknown precision"),
        ("psnr_db", "expected [PRECISION.]KEY=VALUE"),
        ("fp16.psnr_db=30", "android builds no fp16 artifact (precisions built: fp32, int8)"),
    ],
)
def test_bad_threshold(build, override, needle):
    result, out = build("--threshold", override)
    assert_clean_refusal(result, out, needle)


def test_threshold_precision_is_checked_against_every_chosen_target(build):
    """What the chosen targets build, after --format, decides (fp16 is iOS's, int8 left out by --format)."""
    result, out = build(
        "--target",
        "android",
        "--target",
        "ios",
        "--format",
        "executorch:fp32",
        "--format",
        "coreml",
        "--threshold",
        "int8.psnr_db=30",
    )
    assert_clean_refusal(result, out, "android, ios build no int8 artifact (precisions built: fp16, fp32)")
    result, out = build("--format", "executorch:fp32", "--quant-budget", "psnr_db=30")
    assert_clean_refusal(result, out, "--quant-budget psnr_db=30: android builds no int8 artifact")


def test_one_validation_input_is_refused(build, tmp_path):
    """Whether eager's outputs vary across inputs (and so whether agreement means anything) takes two."""
    result, out = build("--val-size", "1")  # click's own usage error
    assert result.exit_code == 2 and "'--val-size': 1 is not in the range x>=2" in result.stderr and not out.exists()
    profile = tmp_path / "custom.toml"
    profile.write_text('[[artifacts]]\nformat = "executorch"\nprecision = "fp32"\n[data]\nval_size = 1\n')
    result, out = build("--target", profile)
    assert_clean_refusal(result, out, "val_size must be >= 2")


def test_real_entry_point_exits_2_without_traceback(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "exporter.cli",
            "build",
            "MobileNet_V3_Large_Weights.IMAGENET1K_V9",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: unknown weight 'MobileNet_V3_Large_Weights.IMAGENET1K_V9'; did you mean")
    assert "MobileNet_V3_Large_Weights.IMAGENET1K_V1" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content", [b"hello", b"abc def", bytes(range(256)) * 4])
def test_a_file_that_is_no_checkpoint(build, tmp_path, content):
    path = tmp_path / "notes.pth"
    path.write_bytes(content)
    result, out = build(checkpoint=path)
    assert_clean_refusal(result, out, str(path))
    assert "weights_only=False" not in result.stderr  # never the advice to run what the file holds


def test_labels_that_are_not_text(build, tmp_path, digits_model):
    result, out = build("--labels", digits_model.checkpoint)
    assert_clean_refusal(result, out, "is not UTF-8 text")


def _profile(tmp_path, name: str, extra: str = "", stem: str = "android") -> str:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / f"{stem}.toml"
    path.write_text(extra + '[[artifacts]]\nformat = "executorch"\nprecision = "fp32"\n')
    return str(path)


@pytest.mark.parametrize(
    "args, needle",
    [
        (lambda t: ["--target", _profile(t, "a"), "--target", "android"], "are both named 'android'"),
        (lambda t: ["--target", _profile(t, "b", 'name = "../escaped"\n')], "name '../escaped' must be"),
        (
            lambda t: [
                "--target",
                _profile(t, "e", '[[artifacts]]\nformat = "onnx"\nprecision = "fp32"\nname = "../x"\n'),
            ],
            "name '../x' must be",
        ),
        (
            lambda t: ["--target", _profile(t, "c", 'post_build = "no_such_module:fn"\n')],
            "post_build 'no_such_module:fn' cannot be loaded",
        ),
        (lambda t: ["--target", _profile(t, "d", stem="pixel"), "--bundle"], "no bundle selection for target"),
        (lambda t: ["--format", "executorch:int8", "--calib-size", "0"], "need calibration images"),
        (lambda t: ["--format", "litert:w8a16", "--calib-size", "0"], "litert_w8a16 need calibration images"),
    ],
)
def test_a_build_that_cannot_finish_is_refused_before_it_writes(build, tmp_path, args, needle):
    result, out = build(*args(tmp_path))
    assert_clean_refusal(result, out, needle)


def _few_images(tmp_path, digits_model, count: int):
    data = tmp_path / f"data{count}"
    images = sorted(p for p in digits_model.data_dir.rglob("*") if p.is_file())[:count]
    for image in images:
        (data / image.parent.name).mkdir(parents=True, exist_ok=True)
        (data / image.parent.name / image.name).write_bytes(image.read_bytes())
    return data


@pytest.mark.parametrize(
    "count, args, needle",
    [
        (
            1,
            ["--format", "executorch:fp32"],
            "has 1 usable item(s); this build needs at least 3 (2 to validate on; "
            "--calib-size 0 sets none aside to calibrate)",
        ),
        (
            2,
            ["--format", "executorch:int8"],
            "this build needs at least 3 (2 to validate on, 1 to calibrate executorch_int8)",
        ),
    ],
)
def test_data_too_small_to_split_is_refused_before_it_writes(build, tmp_path, digits_model, count, args, needle):
    """Not judged on one input, nor calibrated on none (which crashed in the quantizer)."""
    result, out = build("--data", _few_images(tmp_path, digits_model, count), "--target", "android", *args)
    assert_clean_refusal(result, out, needle)


def test_two_images_are_enough_for_a_float_build_that_sets_none_aside(build, tmp_path, digits_model, monkeypatch):
    """The check counts what the split gives: with --calib-size 0 both images validate (the build goes on: it is
    stopped at the eager reference, past the check)."""
    from exporter.engine import pipeline

    def stop(*args):
        raise UsageError("stopped after the data check")

    monkeypatch.setattr(pipeline, "_start_session", stop)
    result, out = build(
        "--data",
        _few_images(tmp_path, digits_model, 2),
        "--target",
        "android",
        "--format",
        "executorch:fp32",
        "--calib-size",
        "0",
    )
    assert_clean_refusal(result, out, "stopped after the data check")


FP32_PTE = '[[artifacts]]\nformat = "executorch"\nprecision = "fp32"\n'


@pytest.mark.parametrize(
    "toml, needle",
    [
        (FP32_PTE + "[tasks]\nsegmentation = 1\n", "[tasks.segmentation]: must be a table, got 1"),
        (FP32_PTE + "[tasks.segmentation]\nthresholds = 5\n", "[tasks.segmentation.thresholds] must be a table, got 5"),
        (FP32_PTE + "[tasks.segmentation]\ndata = 5\n", "[tasks.segmentation.data]: must be a table, got 5"),
        ("artifacts = [3]\n", "[[artifacts]]: must be a table, got 3"),
        (FP32_PTE + "[latency]\nturbo = true\n", "unknown key(s) turbo"),
    ],
)
def test_profile_with_unknown_keys_or_tables_of_the_wrong_type(build, tmp_path, toml, needle):
    path = tmp_path / "odd.toml"
    path.write_text(toml)
    result, out = build("--target", path)
    assert_clean_refusal(result, out, needle)


def test_cache_path_through_a_file(build, tmp_path):
    blocker = tmp_path / "cache-file"
    blocker.write_text("")
    result, out = build(env={"EXPORTER_CACHE": str(blocker)})
    assert_clean_refusal(result, out, f"cache {blocker}", "is a file, not a directory")


def test_target_typo_suggests_the_name(build):
    result, out = build("--target", "andriod")
    assert_clean_refusal(result, out, "unknown target 'andriod'; did you mean 'android'?", "all, or a .toml profile")


def test_input_size_past_any_weight_is_refused(build):
    result, out = build("--input-size", "30000", "30000")
    assert result.exit_code == 2 and "30000 is not in the range 1<=x<=4096" in result.stderr and not out.exists()


def test_checkpoint_that_is_a_directory(build, tmp_path):
    result, out = build(checkpoint=tmp_path)
    assert_clean_refusal(result, out, f"checkpoint {tmp_path} is a directory, not a file")


def test_checkpoint_that_is_a_torchscript_program(build, tmp_path):
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    result, out = build(checkpoint=path)
    assert_clean_refusal(result, out, "is a TorchScript program, not a state dict", "model.state_dict()")


def test_a_bug_exits_3_with_its_traceback_not_1(build, monkeypatch):
    """Exit 1 means an artifact broke its thresholds: a CI job must not read a crash as that."""
    from exporter import data

    def broken(*args):
        raise RuntimeError("something the exporter did not expect")

    monkeypatch.setattr(data, "load_inputs", broken)
    result, _ = build("--format", "executorch:fp32")
    assert result.exit_code == 3, result.output
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the exporter failed (a bug; the traceback above is for its report): "
        "RuntimeError: something the exporter did not expect"
    )


def test_int8_artifacts_a_task_refuses_need_no_calibration(tmp_path):
    """RAFT's .pte is refused by design, so --calib-size 0 asks nothing of it: the build goes on to its checkpoint."""
    missing = tmp_path / "raft.pth"
    out = tmp_path / "out"
    result = run_cli(
        "build", "raft_small", "--target", "android", "--calib-size", "0", "--checkpoint", missing, "--out", out
    )
    assert_clean_refusal(result, out, f"checkpoint {missing} does not exist")
