"""ExecuTorch's own golden program (`.bpte`): a `.pte`'s bytes with golden inputs and the outputs expected for
them, in ExecuTorch's BundledProgram format, which ExecuTorch's runtimes check themselves
(`verify_result_with_bundled_expected_output`, C++ `verify_method_outputs`).

What goes in: the `.pte` as written (BundledProgram takes the file, no ExecutorchProgramManager needed), one
test case per golden input (1 x C x H x W), and as expected outputs the `.pte`'s own outputs on this host
(`outputs()`): a verify on x86 checks the runtime reproduces the build, one on an ARM CPU checks its kernels
do too.

Tolerances (`tolerances()`), from what the build measured on those same golden inputs: with
gap = max |artifact − eager| and scale = max |eager| over every output element,

    atol = max(MARGIN × gap, FLOOR × scale)        rtol = max(MARGIN × gap / scale, FLOOR)

(MARGIN 2, FLOOR 1e-5). ExecuTorch passes an element when |out − expected| <= atol + rtol × |out|, so
another CPU may depart from the build by twice what the artifact departs from eager; the floor keeps a
bit-identical artifact (gap 0) from demanding bit-identical ARM kernels.

`verify()` answers {"passed", "cases", "error"}; a mismatch is passed False with the worst element named,
never an exception. `read()` is a dependency-free reader of the file (the Android self-test ports it).
"""

from __future__ import annotations

import struct
from pathlib import Path

from .. import files

SUFFIX = ".bpte"
METHOD = "forward"
MARGIN = 2.0
FLOOR = 1e-5
RULE = (
    f"over the golden inputs, gap = max|artifact - eager|, scale = max|eager|; atol = max({MARGIN:g} * gap, "
    f"{FLOOR:g} * scale), rtol = max({MARGIN:g} * gap / scale, {FLOOR:g}); an element passes when "
    "|out - expected| <= atol + rtol * |out|"
)

# executorch_flatbuffer.ScalarType -> numpy dtype name, for the scalar types a bundle of ours holds
SCALAR_TYPES = {0: "uint8", 1: "int8", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 7: "float64", 11: "bool"}


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return [value]


def tolerances(artifact, eager) -> dict:
    """rtol and atol from the artifact's measured distance to eager on the golden inputs. `artifact` and
    `eager`: a tensor (or array) each, or equally long sequences of them (output k against output k)."""
    import numpy as np

    pairs = list(zip(_flat(artifact), _flat(eager), strict=True))
    if not pairs:
        raise ValueError("tolerances: no outputs")
    gap, scale = 0.0, 0.0
    for a, e in pairs:
        a = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64)
        e = np.asarray(e.detach().cpu() if hasattr(e, "detach") else e, dtype=np.float64)
        if a.shape != e.shape:
            raise ValueError(f"tolerances: artifact output {a.shape} against eager {e.shape}")
        if not (np.isfinite(a).all() and np.isfinite(e).all()):
            raise ValueError("tolerances: non-finite outputs")
        if a.size:
            gap, scale = max(gap, float(np.abs(a - e).max())), max(scale, float(np.abs(e).max()))
    scale = scale or 1.0  # all-zero eager outputs: tolerances in absolute terms
    return {
        "rtol": max(MARGIN * gap / scale, FLOOR),
        "atol": max(MARGIN * gap, FLOOR * scale),
        "max_abs_gap": gap,
        "output_scale": scale,
        "rule": RULE,
    }


def _cases(inputs) -> list:
    """Golden inputs as 1 x C x H x W tensors: a list of them, or one N x C x H x W batch."""
    import torch

    if isinstance(inputs, torch.Tensor):
        inputs = [inputs[i : i + 1] for i in range(inputs.shape[0])] if inputs.dim() == 4 else [inputs]
    return [x.detach().cpu().contiguous() for x in inputs]


class _Program:
    """A program loaded from bytes; the runtime reads the buffer in place, so it is kept alive here."""

    def __init__(self, data: bytes):
        from executorch.extension.pybindings import portable_lib

        from .executorch import _native_stderr_silenced

        self.data = data
        with _native_stderr_silenced():
            self.module = portable_lib._load_for_executorch_from_buffer(data)

    def forward(self, inputs: tuple) -> list:
        return self.module.forward(inputs)

    def method_meta(self, name: str):
        return self.module.method_meta(name)


def outputs(pte_path: Path, inputs) -> list[tuple]:
    """Every output of the `.pte`'s forward on this host, per golden input: the expected outputs to bundle."""
    program = _Program(Path(pte_path).read_bytes())
    return [tuple(t.clone() for t in program.forward((x,))) for x in _cases(inputs)]


def write(
    pte_path: Path, inputs, expected: list, rtol: float, atol: float, out_path: Path, dynamic_size: bool = False
) -> dict:
    """Write `out_path` (atomically): the `.pte` at `pte_path` with one test case per input, expecting
    `expected[i]` (a tensor or tuple of tensors, every output of forward) for `inputs[i]`. rtol and atol are
    not part of the format (a verifier is given them); they are checked and returned for the manifest.
    dynamic_size: a program exported for a range of heights and widths, whose method meta gives each dim's upper
    bound, so a case's tensors may be smaller."""
    from executorch.devtools.bundled_program.config import MethodTestCase, MethodTestSuite
    from executorch.devtools.bundled_program.core import BundledProgram
    from executorch.devtools.bundled_program.serialize import serialize_from_bundled_program_to_flatbuffer

    pte_path, out_path = Path(pte_path), Path(out_path)
    cases = _cases(inputs)
    expected = [
        tuple(t.detach().cpu().contiguous() for t in _flat(list(e) if isinstance(e, tuple) else e)) for e in expected
    ]
    if not cases or len(cases) != len(expected):
        raise ValueError(f"{len(cases)} golden inputs against {len(expected)} expected outputs")
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"rtol {rtol} and atol {atol} must be non-negative")
    # BundledProgram skips its own checks when given a file; the runtime's view of the program does them
    program = _Program(pte_path.read_bytes())  # kept: the method's meta reads the loaded program's memory
    meta = program.method_meta(METHOD)
    want_in = tuple(meta.input_tensor_meta(0).sizes())

    def fits(shape, want) -> bool:
        shape = tuple(shape)
        if not dynamic_size:
            return shape == want
        return len(shape) == len(want) and all(s <= w for s, w in zip(shape, want))

    for i, (x, e) in enumerate(zip(cases, expected)):
        takes = SCALAR_TYPES.get(int(meta.input_tensor_meta(0).dtype()), "another dtype")
        if meta.num_inputs() != 1 or not fits(x.shape, want_in) or str(x.dtype).removeprefix("torch.") != takes:
            raise ValueError(f"input {i}: {tuple(x.shape)} {x.dtype}, the program takes {want_in} {takes}")
        if len(e) != meta.num_outputs():
            raise ValueError(f"case {i}: {len(e)} expected outputs, the program has {meta.num_outputs()}")
        for k, t in enumerate(e):
            want = tuple(meta.output_tensor_meta(k).sizes())
            if not fits(t.shape, want):
                raise ValueError(f"case {i} output {k}: {tuple(t.shape)}, the program gives {want}")
    suite = MethodTestSuite(METHOD, [MethodTestCase(inputs=(x,), expected_outputs=e) for x, e in zip(cases, expected)])
    data = serialize_from_bundled_program_to_flatbuffer(BundledProgram(None, [suite], pte_file_path=str(pte_path)))
    with files.atomic_path(out_path) as tmp:
        tmp.write_bytes(data)
    return {
        "path": out_path.name,
        "sha256": files.sha256(out_path),
        "size_bytes": files.size(out_path),
        "program_sha256": files.sha256(pte_path),
        "method": METHOD,
        "cases": len(cases),
        "rtol": float(rtol),
        "atol": float(atol),
    }


# -- a reader of the file, needing nothing but struct and numpy -----------------------------------------------


def _u32(b, at):
    return struct.unpack_from("<I", b, at)[0]


def _field(b, table, k):
    """Where field k of the table at `table` is, or None when absent."""
    vtable = table - struct.unpack_from("<i", b, table)[0]
    if 4 + 2 * k >= struct.unpack_from("<H", b, vtable)[0]:
        return None
    offset = struct.unpack_from("<H", b, vtable + 4 + 2 * k)[0]
    return table + offset if offset else None


def _ref(b, at):
    return at + _u32(b, at)


def _vector(b, table, k):
    """(start, length) of vector field k (empty when absent)."""
    at = _field(b, table, k)
    if at is None:
        return 0, 0
    v = _ref(b, at)
    return v + 4, _u32(b, v)


def _tables(b, table, k):
    start, n = _vector(b, table, k)
    return [_ref(b, start + 4 * i) for i in range(n)]


def _value(b, value):
    import numpy as np

    kind_at = _field(b, value, 0)
    if kind_at is None or b[kind_at] != 1:  # ValueUnion.Tensor
        raise ValueError("only tensor values are read")
    tensor = _ref(b, _field(b, value, 1))
    at = _field(b, tensor, 0)
    scalar = struct.unpack_from("<b", b, at)[0] if at is not None else 0
    start, n = _vector(b, tensor, 1)
    sizes = struct.unpack_from(f"<{n}i", b, start)
    start, n = _vector(b, tensor, 2)
    if scalar not in SCALAR_TYPES:
        raise ValueError(f"scalar type {scalar} is not read")
    return np.frombuffer(bytes(b[start : start + n]), dtype=SCALAR_TYPES[scalar]).reshape(sizes)


def read(data: bytes) -> dict:
    """{"version", "method", "cases": [{"inputs": [arrays], "expected": [arrays]}], "program": bytes} of the
    first method's suite (ours hold one, forward)."""
    b = memoryview(data)
    if bytes(b[4:8]) != b"BP08":
        raise ValueError("not a bundled program (file identifier BP08 missing)")
    root = _u32(b, 0)
    at = _field(b, root, 0)
    version = _u32(b, at) if at is not None else 0
    suites = _tables(b, root, 1)
    if not suites:
        raise ValueError("the bundled program holds no test suite")
    name_at = _ref(b, _field(b, suites[0], 0))
    method = bytes(b[name_at + 4 : name_at + 4 + _u32(b, name_at)]).decode()
    cases = [
        {"inputs": [_value(b, v) for v in _tables(b, case, 0)], "expected": [_value(b, v) for v in _tables(b, case, 1)]}
        for case in _tables(b, suites[0], 1)
    ]
    start, n = _vector(b, root, 2)
    return {"version": version, "method": method, "cases": cases, "program": bytes(b[start : start + n])}


def _worst(program, case: dict, rtol: float, atol: float) -> str:
    """Which output departs most beyond what ExecuTorch's rule allows, and by how much."""
    import numpy as np
    import torch

    got = program.forward(tuple(torch.from_numpy(x.copy()) for x in case["inputs"]))
    worst = None
    for k, (out, want) in enumerate(zip(got, case["expected"])):
        out = out.numpy().astype(np.float64)
        diff, allowed = np.abs(out - want.astype(np.float64)), atol + np.abs(rtol * out)
        j = int(np.argmax(diff - allowed))
        outside = int((diff > allowed).sum())
        if worst is None or diff.flat[j] - allowed.flat[j] > worst[0]:
            reason = (
                f"output {k}: |out - expected| {diff.flat[j]:.3g} where {allowed.flat[j]:.3g} is allowed; "
                f"{outside} of {diff.size} elements outside"
            )
            worst = (diff.flat[j] - allowed.flat[j], reason)
    return worst[1] if worst else "no outputs"


def verify(bpte_path: Path, rtol: float, atol: float) -> dict:
    """ExecuTorch's verifier (pybindings) on every case of the `.bpte`, on this host:
    {"passed": bool, "cases": n, "error": None or why not (the first failing case, its worst element)}."""
    from executorch.extension.pybindings import portable_lib

    from .executorch import _native_stderr_silenced

    try:
        data = Path(bpte_path).read_bytes()
        content = read(data)
        with _native_stderr_silenced():
            bundle = portable_lib._load_bundled_program_from_buffer(data)
    except (OSError, ValueError, RuntimeError, struct.error) as e:
        return {"passed": False, "cases": 0, "error": f"cannot load {Path(bpte_path).name}: {e}"}
    cases = content["cases"]
    for i in range(len(cases)):
        try:
            with _native_stderr_silenced():
                bundle.verify_result_with_bundled_expected_output(content["method"], i, rtol, atol)
        except RuntimeError as e:
            try:
                detail = _worst(_Program(content["program"]), cases[i], rtol, atol)
            except Exception as inner:  # noqa: BLE001  (the verifier's own word stands)
                detail = f"(no detail: {inner})"
            return {
                "passed": False,
                "cases": len(cases),
                "error": f"case {i} of {len(cases)}: {e}; {detail} (rtol {rtol:.3g}, atol {atol:.3g})",
            }
    return {"passed": True, "cases": len(cases), "error": None}
