"""Runs inside the aarch64 root under qemu (copied there as /opt/exporter/inside.py); imports nothing of the
exporter's, only numpy and the runtime of the artifact.

    inside.py --check
        import torch, ExecuTorch's pybindings and ONNX Runtime; print their versions and the registered
        ExecuTorch backends as one JSON line
    inside.py --artifact PATH --inputs X.npy --out Y.npz [--threads N]
        load one artifact (.pte: ExecuTorch, .ptl: the lite interpreter, .onnx: ONNX Runtime CPU), run every
        image of X (N x C x H x W float32) through it one at a time, save output k of every image stacked as
        `out{k}` in Y, print one JSON line (load and run seconds, what ran it)

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
            for attr in ("_cuda_getDeviceCount", "_c10d_init", "_rpc_init", "_dist_autograd_init", "_faulty_agent_init"):
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

    torch.set_num_threads(threads)
    if "qnnpack" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "qnnpack"
    module = _load_for_lite_interpreter(str(path))
    return (lambda x: module(torch.from_numpy(x))), {"runtime": "lite interpreter",
                                                     "quantized_engine": torch.backends.quantized.engine}


def _onnx(path, threads):
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    dtype = np.float16 if first.type == "tensor(float16)" else np.float32
    return (lambda x: session.run(None, {first.name: x.astype(dtype)})), {
        "runtime": "onnxruntime", "version": ort.__version__, "providers": session.get_providers()}


LOADERS = {".pte": _executorch, ".ptl": _lite, ".onnx": _onnx}


def check():
    started = time.time()
    import numpy
    import onnxruntime
    import torch
    from executorch.extension.pybindings import _C
    from torch.jit.mobile import _load_for_lite_interpreter  # noqa: F401

    return {"numpy": numpy.__version__, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "onnxruntime": onnxruntime.__version__, "executorch_backends": list(_C._get_registered_backend_names()),
            "seconds": round(time.time() - started, 1)}


def run(artifact, inputs, out, threads):
    import numpy as np

    started = time.time()
    suffix = os.path.splitext(artifact)[1]
    if suffix not in LOADERS:
        raise SystemExit(f"unknown artifact type {suffix}")
    x = np.load(inputs)
    forward, info = LOADERS[suffix](artifact, threads)
    loaded = time.time()
    outputs = []
    for i in range(x.shape[0]):
        outputs.append(_flatten(forward(np.ascontiguousarray(x[i:i + 1], dtype=np.float32))))
    ran = time.time()
    stacked = {f"out{k}": np.concatenate([o[k] for o in outputs]) if outputs[0][k].ndim and outputs[0][k].shape[0] == 1
               else np.stack([o[k] for o in outputs]) for k in range(len(outputs[0]))}
    np.savez(out, **stacked)
    info.update(images=int(x.shape[0]), load_seconds=round(loaded - started, 3), run_seconds=round(ran - loaded, 3))
    return info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--artifact")
    parser.add_argument("--inputs")
    parser.add_argument("--out")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    result = check() if args.check else run(args.artifact, args.inputs, args.out, args.threads)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
