"""TorchScript for the lite interpreter (.ptl), the PyTorch Mobile route."""

from __future__ import annotations

from pathlib import Path

import torch

NAME = "torchscript_lite"
SUFFIX = ".ptl"
OPTIONS = ()
PRECISIONS = ("fp32",)


def export(model, example, precision, calib, path: Path, meta: dict) -> dict:
    from torch.utils.mobile_optimizer import optimize_for_mobile

    scripted = torch.jit.trace(model, example)
    details = {"xnnpack_rewrite": "applied"}
    try:
        module = optimize_for_mobile(scripted)
    except RuntimeError as e:
        # Stock torch wheels are built without XNNPACK; the lite model still runs, unoptimized.
        details = {"xnnpack_rewrite": "unavailable", "xnnpack_rewrite_reason": str(e).strip().splitlines()[0]}
        module = torch.jit.freeze(scripted)
    module._save_for_lite_interpreter(str(path))
    return details


def load(path: Path, threads: int):
    from torch.jit.mobile import _load_for_lite_interpreter

    torch.set_num_threads(threads)
    module = _load_for_lite_interpreter(str(path))
    return lambda x: module(x)
