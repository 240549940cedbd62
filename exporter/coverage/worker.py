"""One build of the coverage sweep, run in its own process (`python -m exporter.coverage.worker SPEC.json`):
the weight's random checkpoint (made once per weight, kept beside the builds) or, in the trained tier, its
digits-trained one (coverage.trained), and then a real `exporter.engine.build_targets` of one target, offline,
on synthetic data (the trained tier: the held-out digits, labeled), with the sweep's settings.

The parent reads the build's manifest.json; this process adds RESULT.json: the checkpoint's description, its
timings, when the build stopped with an error that error's first line, and when an artifact failed validation
the weight's precision floor (coverage.conditioning). A spec with "floor_only" makes the checkpoint and measures
the floor without building (for rows cached before floors were measured). A crash or a kill leaves the
manifest as far as it got (it lists only complete artifacts)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import traceback
from pathlib import Path


# The lines of this process's log that the sweep relays as they come: the build's finished steps (done, failed,
# unavailable on this host) and the trained tier's training epochs (the rest is libraries' chatter).
PROGRESS_MARKS = ("✓ ", "✗ ", "– ", "train: ")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip(": ")


def _write(path: Path, result: dict) -> None:
    """RESULT.json, its reasons (the floor's broken thresholds) as their JSON records."""
    from ..results import jsonable

    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(jsonable(result), indent=2) + "\n")
    os.replace(tmp, path)


def limit_cpu(spec: dict) -> None:
    """The sweep's time limit on this process's CPU time: SIGXCPU ends it there, SIGKILL 10 s later."""
    if spec.get("cpu_limit_s"):
        seconds = math.ceil(spec["cpu_limit_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 10))


def run(spec: dict) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    limit_cpu(spec)
    result_path = Path(spec["result"])
    result: dict = {"stage": "checkpoint"}
    started = time.perf_counter()
    code = 0
    try:
        import torch

        from ..engine import BuildRequest, build_targets
        from ..progress import Progress
        from . import randomize

        torch.set_num_threads(spec["threads"])
        if spec.get("weights") == "digits":
            from . import trained

            input_size = randomize.accepted_input_size(spec["weight"], None, spec.get("classifier_size"))
            made = result["checkpoint"] = trained.make(
                spec["weight"],
                Path(spec["trained"]),
                spec["train_epochs"],
                log=lambda line: print(f"train: {line}", flush=True),
                until=spec["train_until"],
                max_epochs=spec["train_max_epochs"],
                size=input_size[0] if input_size else None,
            )
        else:
            input_size = randomize.accepted_input_size(
                spec["weight"], spec.get("input_size"), spec.get("classifier_size")
            )
            made = result["checkpoint"] = randomize.make(spec["weight"], Path(spec["checkpoints"]), input_size)
        result["checkpoint_s"] = round(time.perf_counter() - started, 3)
        result["stage"] = "build"
        request = BuildRequest(
            weight=spec["weight"],
            target=spec["target"],
            out=Path(spec["out"]),
            checkpoint=Path(made["checkpoint"]),
            verify=False,
            offline=True,
            force=True,
            formats=list(spec.get("formats") or []),
            calib_size=spec["calib_size"],
            val_size=spec["val_size"],
            threads=spec["threads"],
            warmup=spec["warmup"],
            iterations=spec["iterations"],
            input_size=input_size,
            float_checkpoint=Path(made["float_checkpoint"]) if made.get("float_checkpoint") else None,
            data=Path(made["data"]) if made.get("data") else None,
            labels=Path(made["labels"]) if made.get("labels") else None,
            cache=True,
            cache_dir=Path(spec["build_cache"]),  # shared by the weight's targets, then removed
            **(
                {
                    "arch": ["aarch64"],
                    "cpus": spec["aarch64_cpus"],
                    "aarch64_runners": Path(spec["aarch64_runners"]),
                    "count": False,  # the table judges, it does not cost: a minute per CPU and model saved
                }
                if spec.get("aarch64_runners")
                else {}
            ),
        )
        if spec.get("floor_only"):
            result.update(stage="done", floor=floor(request, spec["target"]), status=None)
        else:
            (doc,) = build_targets(request, [spec["target"]], Progress())
            result.update(stage="done", status=doc["status"])
            if any(
                a["status"] == "failed" and a.get("fidelity") is not None for a in doc["artifacts"]
            ):  # judged, failed
                _write(result_path, result)  # the build stands if the time limit ends the floor
                try:  # the build's row stands whatever happens here
                    result["floor"] = floor(request, spec["target"])
                except Exception as e:
                    traceback.print_exc()
                    result["floor"] = {"error": _first_line(e)}
    except Exception as e:  # UsageError included: the exporter's own one-line refusal of this build
        from ..errors import UsageError

        traceback.print_exc()
        result["error"] = str(e).strip().splitlines()[0] if isinstance(e, UsageError) else _first_line(e)
        result["usage_error"] = isinstance(e, UsageError)
        code = 2 if isinstance(e, UsageError) else 1
    result["seconds"] = round(time.perf_counter() - started, 3)
    _write(result_path, result)
    return code


def floor(request, target: str) -> dict:
    """The precision floor of the request's checkpoint on the inputs its build validates with, judged with
    `target`'s thresholds."""
    import torch

    from .. import data, weights
    from ..engine import target_profile
    from ..engine.plan import make, with_required
    from ..precision import Precision
    from . import conditioning
    from .outcome import WEIGHT_FLOOR

    started = time.perf_counter()
    loaded = weights.load(
        request.weight, request.checkpoint, verify=False, offline=True, float_checkpoint=request.float_checkpoint
    )
    task = loaded.task_class.bind(loaded.weights, loaded.model_name, loaded.num_classes, request.input_size)
    plan = make(with_required(target_profile(request, target), task.format_options()), task.name)
    size = (plan.data.calib_size, plan.data.val_size, plan.data.seed)
    transform = task.transform(loaded.weights)
    inputs = (
        data.synthetic(transform, *size) if request.data is None else task.load_data(request.data, transform, *size)
    )
    images = inputs.validation
    eager = loaded.eager.float().eval()
    with torch.no_grad():
        reference = torch.cat([eager(x[None]) for x in images])
    thresholds = {k: dict(v) for k, v in plan.thresholds.items()}
    result = conditioning.floor(task, eager, images, reference, thresholds, inputs.calibration, inputs.labels)
    # a quantized weight, against its float model
    if loaded.reference_model is not None and Precision.INT8 in thresholds:
        result[WEIGHT_FLOOR] = conditioning.weight_row(
            task, loaded.model.eval(), images, reference, inputs.labels, thresholds[Precision.INT8]
        )
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m exporter.coverage.worker SPEC.json", file=sys.stderr)
        return 2
    return run(json.loads(Path(argv[1]).read_text()))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
