"""Runs inside the aarch64 root under qemu (copied there as /opt/exporter/inside.py); imports nothing of the
exporter's, only numpy and the runtime of the artifact.

    inside.py --check
        import torch, ExecuTorch's pybindings and ONNX Runtime; print their versions and the registered
        ExecuTorch backends as one JSON line
    inside.py --jobs JOBS.json --inputs X.npy [--threads N] [--timeout S]
        JOBS: a list of {"artifact", "out"[, "bundled", "rtol", "atol"]}, run in order in this one process (so
        that Python, torch and the runtimes start once per CPU, not once per artifact): load the artifact
        (.pte: ExecuTorch, .ptl: the lite interpreter, .onnx: ONNX Runtime CPU), run every image of X
        (N x C x H x W float32) through it one at a time, save output k of every image stacked as `out{k}`
        in its "out" .npz, verify its .bpte when given. Per job, two JSON lines on stdout (which nothing else
        may write to: the libraries' prints go to stderr): {"job": k, "started": true} before, and
        {"job": k, "seconds": ..., ...} after (load and run seconds, what ran it). A job that raises answers
        {"job": k, "error": ...} and the next one runs; a job past S seconds ends the process (faulthandler,
        "Timeout" on stderr), as does one that crashes it: the rest are left to exporter/aarch64/execute.py
    inside.py --bundled PATH --rtol R --atol A [--threads N]
        ExecuTorch's verifier on every test case of a BundledProgram (.bpte); print one JSON line
        {"passed", "cases", "error", ...}: a mismatch is passed false with the first failing case and its
        worst element, not a failure of the script

The runner's torch is the CUDA build with its CUDA libraries replaced by stubs; with EXPORTER_AARCH64_NO_CUDA
set, torch is told so as soon as its core is loaded (no CUDA, no distributed package) so nothing reaches a stub.
The same script runs on x86 with the host's packages, to compare like with like.
"""

import argparse
import importlib.abc
import json
import os
import sys
import time


class _NoCuda(importlib.abc.MetaPathFinder):
    """At the first import after torch._C is loaded: torch built without CUDA or distributed, as far as its
    Python side can tell (torch.cuda.is_available() is False without calling into CUDA)."""

    done = False

    def find_spec(self, name, path=None, target=None):
        core = sys.modules.get("torch._C")
        if core is not None and not self.done:
            self.done = True
            core._has_cuda = False
            for attr in (
                "_cuda_getDeviceCount",
                "_c10d_init",
                "_rpc_init",
                "_dist_autograd_init",
                "_faulty_agent_init",
            ):
                if hasattr(core, attr):
                    delattr(core, attr)
        return None


if os.environ.get("EXPORTER_AARCH64_NO_CUDA"):
    sys.meta_path.insert(0, _NoCuda())


def _flatten(value):
    if isinstance(value, dict):
        return [a for v in value.values() for a in _flatten(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _flatten(v)]
    if hasattr(value, "detach"):
        return [value.detach().cpu().numpy()]
    import numpy as np

    return [np.asarray(value)]


def _executorch(path, threads):
    import torch  # noqa: F401  (loads libtorch, which the pybindings link)
    from executorch.extension.pybindings import _C

    backends = list(_C._get_registered_backend_names())
    with open(path, "rb") as f:
        data = f.read()
    delegated = "XnnpackBackend" if b"XnnpackBackend" in data else None
    if delegated and delegated not in backends:
        raise RuntimeError(f"{path}: delegated to {delegated}, which this runtime lacks ({backends})")
    if _C._threadpool_get_thread_count() != threads:
        _C._unsafe_reset_threadpool(threads)
    module = _C._load_for_executorch(str(path))  # fails when a delegate's backend is unavailable
    info = {"runtime": "executorch", "backends": backends, "delegate": delegated}
    return (lambda x: module.forward((torch.from_numpy(x),))), info


def _lite(path, threads):
    import torch
    from torch.jit.mobile import _load_for_lite_interpreter

    # one thread: PyPI's aarch64 torch, run with two, executes an instruction ARMv8.0 cores lack (SIGILL on
    # cortex-a53 with 2 threads, not with 1; measured). That is this wheel's parallel path, not the artifact's
    torch.set_num_threads(1)
    if "qnnpack" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "qnnpack"
    module = _load_for_lite_interpreter(str(path))
    return (lambda x: module(torch.from_numpy(x))), {
        "runtime": "lite interpreter",
        "threads": 1,
        "quantized_engine": torch.backends.quantized.engine,
    }


def _onnx(path, threads):
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    dtype = {"tensor(float16)": np.float16, "tensor(uint8)": np.uint8}.get(first.type, np.float32)
    return (lambda x: session.run(None, {first.name: x.astype(dtype)})), {
        "runtime": "onnxruntime",
        "version": ort.__version__,
        "providers": session.get_providers(),
    }


def _litert(path, threads):
    import numpy as np
    from ai_edge_litert import __version__ as version
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path), num_threads=threads)  # XNNPACK delegate by default
    interpreter.allocate_tensors()
    (feed,) = interpreter.get_input_details()
    fetches = interpreter.get_output_details()
    (signature, *more) = interpreter._get_full_signature_list().values() or [None]
    if signature and not more:  # the model's output order (output_0, output_1, ...), as formats/litert.py reads it
        by_index = {d["index"]: d for d in fetches}
        names = sorted(signature["outputs"], key=lambda n: (len(n), n))
        fetches = [by_index[signature["outputs"][n]] for n in names]

    def quantized(x, detail):
        if detail["dtype"] in (np.float32, x.dtype):  # float, or a uint8-nhwc input's pixels
            return x
        scale, zero_point = detail["quantization"]
        info = np.iinfo(detail["dtype"])
        return np.clip(np.round(x / scale) + zero_point, info.min, info.max).astype(detail["dtype"])

    def dequantized(y, detail):
        if detail["dtype"] == np.float32:
            return y.copy()
        scale, zero_point = detail["quantization"]
        return ((y.astype(np.float32) - zero_point) * scale).astype(np.float32)

    def forward(x):
        interpreter.set_tensor(feed["index"], quantized(x, feed))
        interpreter.invoke()
        return [dequantized(interpreter.get_tensor(d["index"]), d) for d in fetches]

    delegated = sum(op["op_name"] == "DELEGATE" for op in interpreter._get_ops_details())
    return forward, {"runtime": "ai-edge-litert", "version": version, "delegate_nodes": delegated}


LOADERS = {".pte": _executorch, ".ptl": _lite, ".onnx": _onnx, ".tflite": _litert}


def check():
    started = time.time()
    import numpy
    import onnxruntime
    import torch
    from executorch.extension.pybindings import _C
    from torch.jit.mobile import _load_for_lite_interpreter  # noqa: F401

    try:
        from ai_edge_litert import __version__ as litert
    except ImportError:  # a runner set up where the [litert] extra is not installed
        litert = None
    return {
        "numpy": numpy.__version__,
        "ai-edge-litert": litert,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "onnxruntime": onnxruntime.__version__,
        "executorch_backends": list(_C._get_registered_backend_names()),
        "seconds": round(time.time() - started, 1),
    }


def _image(x, i):
    """Input i of `x`, batch 1: float32, or uint8 pixels as they are (a uint8-nhwc artifact's)."""
    import numpy as np

    return np.ascontiguousarray(x[i : i + 1], dtype=np.uint8 if x.dtype == np.uint8 else np.float32)


def run(artifact, inputs, out, threads):
    import numpy as np

    started = time.time()
    suffix = os.path.splitext(artifact)[1]
    if suffix not in LOADERS:
        raise ValueError(f"unknown artifact type {suffix}")
    x = np.load(inputs)
    forward, info = LOADERS[suffix](artifact, threads)
    loaded = time.time()
    outputs = []
    for i in range(x.shape[0]):
        outputs.append(_flatten(forward(_image(x, i))))
    ran = time.time()
    stacked = {
        f"out{k}": np.concatenate([o[k] for o in outputs])
        if outputs[0][k].ndim and outputs[0][k].shape[0] == 1
        else np.stack([o[k] for o in outputs])
        for k in range(len(outputs[0]))
    }
    np.savez(out, **stacked)
    info.update(images=int(x.shape[0]), load_seconds=round(loaded - started, 3), run_seconds=round(ran - loaded, 3))
    return info


def run_jobs(jobs, inputs, threads, timeout):
    import faulthandler

    answers = os.fdopen(os.dup(1), "w")  # the answers' own copy of stdout; fd 1 itself becomes stderr, so that
    os.dup2(2, 1)  # what a native library prints cannot run into an answer line
    suffixes = {os.path.splitext(job["artifact"])[1] for job in jobs}
    if ".onnx" in suffixes and suffixes & {".pte", ".ptl"}:
        import onnxruntime  # noqa: F401  (before torch, the order the runner's set-up checked: --check)
    for k, job in enumerate(jobs):
        answers.write(json.dumps({"job": k, "started": True}) + "\n")
        answers.flush()
        started = time.perf_counter()
        if timeout:
            faulthandler.dump_traceback_later(timeout, exit=True)
        result = run_job(job, inputs, threads)
        faulthandler.cancel_dump_traceback_later()
        answers.write(json.dumps({"job": k, **result, "seconds": time.perf_counter() - started}) + "\n")
        answers.flush()


def run_job(job, inputs, threads):
    try:
        result = run(job["artifact"], inputs, job["out"], threads)
        if job.get("bundled"):  # the .pte's golden program, verified in the same emulated process
            result["bundled"] = bundled(job["bundled"], job["rtol"], job["atol"], threads)
    except Exception as e:  # noqa: BLE001  (this artifact's failure to run, reported; the next job still runs)
        line = f"{type(e).__name__}: {e}".strip().splitlines()
        return {"error": line[0] if line else type(e).__name__}
    return result


# -- .bpte: a reader kept in step with exporter/formats/bundled_program.py (read), which this may not import ----

_SCALAR_TYPES = {0: "uint8", 1: "int8", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 7: "float64", 11: "bool"}


def _bpte_cases(data):
    """(method name, [(inputs, expected)] as numpy arrays) of a .bpte's first test suite."""
    import struct

    import numpy as np

    def u32(at):
        return struct.unpack_from("<I", data, at)[0]

    def ref(at):
        return at + u32(at)

    def field(table, k):
        vtable = table - struct.unpack_from("<i", data, table)[0]
        if 4 + 2 * k >= struct.unpack_from("<H", data, vtable)[0]:
            return None
        offset = struct.unpack_from("<H", data, vtable + 4 + 2 * k)[0]
        return table + offset if offset else None

    def vector(table, k):
        at = field(table, k)
        return (0, 0) if at is None else (ref(at) + 4, u32(ref(at)))

    def tables(table, k):
        start, n = vector(table, k)
        return [ref(start + 4 * i) for i in range(n)]

    def tensor(value):
        if data[field(value, 0)] != 1:
            raise ValueError("only tensor values are read")
        t = ref(field(value, 1))
        scalar = struct.unpack_from("<b", data, field(t, 0))[0] if field(t, 0) is not None else 0
        start, n = vector(t, 1)
        sizes = struct.unpack_from(f"<{n}i", data, start)
        start, n = vector(t, 2)
        return np.frombuffer(data[start : start + n], dtype=_SCALAR_TYPES[scalar]).reshape(sizes)

    if data[4:8] != b"BP08":
        raise ValueError("not a bundled program (file identifier BP08 missing)")
    suite = tables(u32(0), 1)[0]
    name = ref(field(suite, 0))
    method = data[name + 4 : name + 4 + u32(name)].decode()
    return method, [([tensor(v) for v in tables(c, 0)], [tensor(v) for v in tables(c, 1)]) for c in tables(suite, 1)]


def bundled(path, rtol, atol, threads):
    import numpy as np
    import torch
    from executorch.extension.pybindings import _C

    started = time.time()
    with open(path, "rb") as f:
        data = f.read()
    try:
        method, cases = _bpte_cases(data)
        if _C._threadpool_get_thread_count() != threads:
            _C._unsafe_reset_threadpool(threads)
        bundle = _C._load_bundled_program_from_buffer(data)
    except (ValueError, RuntimeError, IndexError) as e:
        return {"passed": False, "cases": 0, "error": f"cannot load {os.path.basename(path)}: {e}"}
    info = {"passed": True, "cases": len(cases), "error": None, "backends": list(_C._get_registered_backend_names())}
    for i, (inputs, expected) in enumerate(cases):
        try:
            bundle.verify_result_with_bundled_expected_output(method, i, rtol, atol)
        except RuntimeError as e:
            detail = ""
            try:  # the worst element, from the program's own run of this case
                program = _C._load_for_executorch_from_bundled_program(bundle)
                got = program.run_method(method, tuple(torch.from_numpy(x.copy()) for x in inputs))
                worst = max(
                    (
                        float(np.max(np.abs(o.numpy().astype(np.float64) - w) - (atol + np.abs(rtol * o.numpy())))),
                        k,
                        float(np.max(np.abs(o.numpy().astype(np.float64) - w))),
                    )
                    for k, (o, w) in enumerate(zip(got, expected))
                )
                detail = (
                    f"; output {worst[1]}: max |out - expected| {worst[2]:.3g}, {worst[0]:.3g} beyond what is allowed"
                )
            except Exception as inner:  # noqa: BLE001  (the verifier's own word stands)
                detail = f"; (no detail: {inner})"
            info.update(passed=False, error=f"case {i} of {len(cases)}: {e}{detail} (rtol {rtol:.3g}, atol {atol:.3g})")
            break
    info["seconds"] = round(time.time() - started, 3)
    return info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--jobs")
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--inputs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bundled")
    parser.add_argument("--rtol", type=float)
    parser.add_argument("--atol", type=float)
    args = parser.parse_args()
    if args.bundled and (args.rtol is None or args.atol is None):
        parser.error("--bundled needs --rtol and --atol")
    if args.check:
        result = check()
    elif args.jobs:
        with open(args.jobs) as f:
            run_jobs(json.load(f), args.inputs, args.threads, args.timeout)
        return
    else:
        result = bundled(args.bundled, args.rtol, args.atol, args.threads)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
