"""TorchScript for the lite interpreter (.ptl), the PyTorch Mobile route.

int8 here is a model already quantized in eager mode (torchvision's quantized weights), exported as
it is; this format does not quantize a float model (ExecuTorch's int8 does)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..precision import Precision
from .interface import Format


def _is_quantized(model) -> bool:
    return any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules())


_RSS_IMPORTS = "import torch\nfrom torch.jit.mobile import _load_for_lite_interpreter"
_RSS_LOAD = """\
torch.set_num_threads(threads)
module = _load_for_lite_interpreter(path)
tensor = torch.from_numpy(x)"""


# torch's profiler keeps every operator call it records: EfficientNet-B6's .ptl makes 30,000 calls a run (its
# depthwise convolutions run channel by channel), about 2.7 GB of trace per run; 10 runs filled 22 GB here.
PROFILE_CALLS = 20_000  # no further run is profiled once the runs so far made this many calls


class TorchScriptLiteFormat(Format):
    """A lite-interpreter TorchScript module: export, load, memory (a fresh process's peak RSS) and profile
    (torch's profiler)."""

    name, suffix = "torchscript_lite", ".ptl"
    precisions = (Precision.FP32, Precision.INT8)

    def export(self, model, example, precision, calib, path: Path, meta: dict) -> dict:
        from torch.utils.mobile_optimizer import optimize_for_mobile

        if (precision == Precision.INT8) != _is_quantized(model):
            raise ValueError(
                f"a {precision} .ptl is the model as it is: this model is "
                f"{Precision.INT8 if _is_quantized(model) else 'float'} (int8 needs a torchvision quantized weight)"
            )
        from .rewrites import drop_padding_taps

        model, trimmed = drop_padding_taps(model, example)
        details = {"xnnpack_rewrite": "applied"}
        try:
            scripted = torch.jit.trace(model, example)
        except torch.jit.TracingCheckError as e:
            # ViT-B/16: two traces of nn.MultiheadAttention differed ("Graphs differed across invocations"). The
            # build's validation compares the .ptl with eager on every validation input, which is the check that counts.
            scripted = torch.jit.trace(model, example, check_trace=False)
            details["trace_check"] = " ".join(str(e).split("Graph diff")[0].split())[:200]
        else:
            details["trace_check"] = "passed"
        try:
            module = optimize_for_mobile(scripted)
        except RuntimeError as e:
            # Stock torch wheels are built without XNNPACK; the lite model still runs, unoptimized.
            details.update(xnnpack_rewrite="unavailable", xnnpack_rewrite_reason=str(e).strip().splitlines()[0])
            module = torch.jit.freeze(scripted)
        if precision == Precision.INT8:
            # int8 weights are repacked for the engine selected when the model is loaded (phones: QNNPACK)
            details["quantized_engine_on_host"] = torch.backends.quantized.engine
        if trimmed:
            details["rewrites"] = {"padding_taps_dropped": trimmed}
        module._save_for_lite_interpreter(str(path))
        return details

    def load(self, path: Path, threads: int):
        from torch.jit.mobile import _load_for_lite_interpreter

        torch.set_num_threads(threads)
        module = _load_for_lite_interpreter(str(path))
        return lambda x: module(x)

    def memory(self, path: Path, input_shape, threads: int, dtype: str = "float32") -> dict:
        """Peak resident memory of a fresh process running the .ptl in the lite interpreter (the file has no memory
        plan: the interpreter allocates each intermediate as it goes)."""
        from . import memory as shared

        return shared.peak_rss(_RSS_IMPORTS, _RSS_LOAD, "module(tensor)", path, input_shape, threads, dtype=dtype)

    def profile(self, path: Path, example, runs: int, threads: int) -> dict:
        """Operators by self time from torch's profiler around the lite interpreter (a module of its own; one
        warm-up run left out). Each run has a profiler of its own, so memory holds one run's trace; after
        PROFILE_CALLS operator calls no further run is profiled, and the record's `runs` says how many were."""
        import gc
        import time

        from torch.jit.mobile import _load_for_lite_interpreter

        from . import memory as shared

        torch.set_num_threads(threads)
        module = _load_for_lite_interpreter(str(path))
        module(example)
        totals, wall, profiled, calls = {}, 0.0, 0, 0
        while profiled < runs and calls < PROFILE_CALLS:
            with (
                shared.native_stderr_silenced(),
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace,
            ):
                start = time.perf_counter()
                module(example)
                wall += (time.perf_counter() - start) * 1000
            for event in trace.key_averages():
                calls += event.count
                if event.self_cpu_time_total > 0:
                    ms, count = totals.get(event.key, (0.0, 0))
                    totals[event.key] = (ms + event.self_cpu_time_total / 1000, count + event.count)
            profiled += 1
            del trace
            gc.collect()  # a profiler refers to itself: only the cycle collector frees its trace
        return shared.top_ops(totals, wall, profiled, "torch.profiler (self time per aten operator)")


FORMAT = TorchScriptLiteFormat()
