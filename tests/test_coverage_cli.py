"""`exporter coverage`'s bad input: refused in one line, exit 2, before anything is built or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from .coverage_helpers import SMALL
from .helpers import run_cli

DOCS = Path(__file__).parents[1] / "docs"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--shard", "3/2"], "--shard"),
        (["--models", "no_such_model"], "matches no weight"),
        (["--target", "android", "--format", "onnx:fp32"], "matches no artifact"),
        (["--merge"], "--merge needs"),
        (["--task", "poetry"], "--task"),
        (["--train-epochs", "2"], "--train-epochs is for --weights digits"),
        (["--weights", "imagenet"], "--weights"),
        (["--cpu", "cortex-a99"], "unknown aarch64 CPU 'cortex-a99'"),
        (["--arch", "riscv64"], "--arch"),
        (["--target", "jetson", "--target", "jetsn"], "unknown target 'jetsn'"),  # refused before jetson's build
        (["--matrix", "2", "--merge", "shards"], "give one of them"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, tmp_path):
    result = run_cli("coverage", "--out", tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_bad_output_directories_are_refused_before_any_build(tmp_path):
    (tmp_path / "a_file").write_text("")
    for args in (
        ["--out", tmp_path / "a_file"],
        ["--out", tmp_path / "o", "--builds", tmp_path / "a_file"],
        ["--merge", DOCS / "coverage-digits.json", "--out", tmp_path / "a_file"],
    ):
        result = run_cli("coverage", "--models", SMALL[0], "--one-per-builder", *args)
        assert result.exit_code == 2 and "cannot be a directory" in result.stderr.strip().splitlines()[-1], (
            result.output
        )
