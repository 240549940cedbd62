"""Runs inside the aarch64 root under the counting qemu (exporter/aarch64/counting.py starts it by its host path, as
execute.py does inside.py): loads each artifact in turn and runs its inferences between markers, at one thread.

    inside_count.py --artifact PATH [--artifact PATH ...] --inputs X.npy [--warmup W] [--runs R] [--empty E]

A marker is the syscall 4242 with a tag; the counting plugin (count_plugin.c) writes the calling vCPU's instruction
count at each. Tags, in this order:
    1, 2                 E empty pairs (nothing between: the cost of a marker itself, subtracted by the host)
    10k+3, 10k+4         artifact k's load (the runtimes are imported before: their import is not counted)
    10k+5, 10k+6         each of its inferences, W warm-ups then R counted, image i % N of X (N x C x H x W float32)
then one JSON line on stdout: {"pid", "artifacts": [what ran each, or its "error"]}. One process for several
artifacts pays the emulated imports once (about 15 s of each count). Everything is run at one thread: the counts of
a thread pool that spins are not reproducible (shared/NOTES.md, "Counting instructions under qemu").

Formats: .pte (ExecuTorch, thread pool at 1), .ptl (lite interpreter), .onnx (ONNX Runtime, intra-op 1),
.tflite (ai-edge-litert, when the runner has it), .pt2 (a torch.export program run op by op: eager PyTorch).
The loaders are inside.py's (this file's neighbour, on sys.path as the script's directory).
"""

import argparse
import ctypes
import json
import os
import sys

import inside  # (also keeps torch off CUDA when EXPORTER_AARCH64_NO_CUDA is set)

MARKER = 4242
EMPTY, LOAD, RUN, STRIDE = 1, 3, 5, 10  # start tags (artifact k: LOAD and RUN + STRIDE * k); the end tag is start + 1

_syscall = ctypes.CDLL(None).syscall  # the process's own libc: no ldconfig, no subprocess
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_long]


def mark(tag):
    _syscall(MARKER, tag)


def _runtime(suffix):
    """Import the runtime before the load marker, and keep torch (when it is loaded) at one thread."""
    if suffix in (".pte", ".ptl", ".pt2"):
        import torch

        torch.set_num_threads(1)
        if suffix == ".pte":
            from executorch.extension.pybindings import _C  # noqa: F401
    elif suffix == ".onnx":
        import onnxruntime  # noqa: F401
    elif suffix == ".tflite":
        from ai_edge_litert.interpreter import Interpreter  # noqa: F401


def _eager(path, threads):
    import torch

    torch.set_num_threads(threads)
    module = torch.export.load(path).module()

    def forward(x):
        with torch.inference_mode():
            return module(torch.from_numpy(x))

    return forward, {"runtime": "torch (eager, torch.export program)", "version": torch.__version__, "threads": 1}


LOADERS = {**inside.LOADERS, ".pt2": _eager}


def _count(path, k, images, warmup, runs):
    """Artifact k's load and inferences between its markers; the closing marker is written even when it fails."""
    mark(LOAD + STRIDE * k)
    try:
        forward, info = LOADERS[os.path.splitext(path)[1]](path, 1)
    finally:
        mark(LOAD + STRIDE * k + 1)
    for i in range(warmup + runs):
        image = images[i % len(images)]
        mark(RUN + STRIDE * k)
        try:
            y = forward(image)
        finally:
            mark(RUN + STRIDE * k + 1)
        del y
    return info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifact", required=True, action="append")
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--empty", type=int, default=5)
    args = parser.parse_args()
    answers = os.fdopen(os.dup(1), "w")  # the answer's own stdout; what libraries print goes to stderr
    os.dup2(2, 1)

    import numpy as np

    suffixes = [os.path.splitext(path)[1] for path in args.artifact]
    unknown = sorted(set(suffixes) - set(LOADERS))
    if unknown:
        raise SystemExit(f"unknown artifact type {', '.join(unknown)}")
    x = np.load(args.inputs)
    images = [inside._image(x, i) for i in range(x.shape[0])]
    for suffix in dict.fromkeys(suffixes):
        _runtime(suffix)
    for _ in range(args.empty):
        mark(EMPTY)
        mark(EMPTY + 1)
    done = []
    for k, path in enumerate(args.artifact):
        try:
            done.append(_count(path, k, images, args.warmup, args.runs))
        except Exception as e:  # noqa: BLE001 - one artifact that cannot run leaves the others counted
            done.append({"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
    answers.write(json.dumps({"pid": os.getpid(), "artifacts": done}) + "\n")
    answers.flush()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
