"""The declared format interface (exporter/formats/interface.py): every registered format is one `Format` object,
a hook a format does not define has the default declared there, and the engine reaches hooks only through it.
No export is made here."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from exporter.errors import UsageError
from exporter.formats import FORMATS, FormatSpec, RuntimeUnavailable
from exporter.formats.interface import Format
from exporter.precision import Precision
from exporter.progress import Progress
from exporter.results import ArtifactResult, Status

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL_HOOKS = ("proxies", "per_inference_ranges", "memory", "profile")


class Bare(Format):
    """Only what is required: every optional hook keeps its default."""

    name, suffix, precisions = "bare", ".bare", (Precision.FP32,)

    def export(self, model, example, precision, calib, path, meta, **options):
        return {}

    def load(self, path, threads):
        return lambda x: x


def _registered(monkeypatch, fmt: Format) -> None:
    """`fmt` as the registry's format of its name, from a module of its own (as a real format is)."""
    module = types.ModuleType(f"fake_format_{fmt.name}")
    module.FORMAT = fmt
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(FORMATS, fmt.name, FormatSpec(fmt.name, module.__name__, "android", ()))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_registered_format_is_one_format_object(name):
    import importlib

    spec = FORMATS[name]
    if not spec.installed():
        pytest.skip(f"{name}'s extra ({spec.extra}) is not installed")
    fmt = spec.format()
    assert isinstance(fmt, Format) and fmt.name == name
    assert fmt.suffix.startswith(".") and fmt.precisions and all(isinstance(p, Precision) for p in fmt.precisions)
    assert isinstance(fmt.precisions, tuple) and isinstance(fmt.options, tuple)
    assert type(fmt).export is not Format.export and type(fmt).load is not Format.load
    # exactly one object per module, the one the registry returns
    module = importlib.import_module(spec.module)
    assert [k for k, v in vars(module).items() if isinstance(v, Format)] == ["FORMAT"] and module.FORMAT is fmt
    for hook in OPTIONAL_HOOKS:  # a hook is None (none) or a method of the format's own
        assert getattr(fmt, hook) is None or callable(getattr(fmt, hook)), hook
    assert fmt.proxies_version is None or isinstance(fmt.proxies_version, int)


def test_what_the_formats_declare():
    """The hooks each format has today; a change here is a change the engine sees (and caches key on)."""
    have = {}
    for name, spec in FORMATS.items():
        if spec.installed():
            fmt = spec.format()
            hooks = [h for h in OPTIONAL_HOOKS if getattr(fmt, h) is not None]
            overridden = type(fmt).preflight is not Format.preflight
            have[name] = (*hooks, *(["preflight"] if overridden else []), fmt.proxies_version)
    expected = {
        "executorch": ("per_inference_ranges", "memory", "profile", None),
        "litert": ("memory", None),  # ai-edge-litert has no per-operator profiler from Python
        "torchscript_lite": ("memory", "profile", None),
        "onnx": ("memory", "profile", "preflight", None),
        "tensorrt": ("preflight", None),
        "coreml": ("proxies", "preflight", 2),
    }
    assert have == {name: expected[name] for name in have}


def test_a_hook_not_defined_has_the_declared_default():
    fmt = Bare()
    assert all(getattr(fmt, hook) is None for hook in OPTIONAL_HOOKS)
    assert fmt.proxies_version is None and fmt.options == ()
    assert fmt.preflight("fp32") is None and fmt.preflight("int8", anything=1) is None  # nothing to check


def test_a_format_without_export_or_load_cannot_be_made():
    class NoLoad(Format):
        name, suffix, precisions = "no_load", ".x", (Precision.FP32,)

        def export(self, model, example, precision, calib, path, meta, **options):
            return {}

    class NoExport(Format):
        name, suffix, precisions = "no_export", ".x", (Precision.FP32,)

        def load(self, path, threads):
            return lambda x: x

    for incomplete, missing in ((Format, "export, load"), (NoLoad, "load"), (NoExport, "export")):
        with pytest.raises(TypeError, match=f"abstract methods? {missing}"):
            incomplete()
    assert isinstance(Bare(), Format)  # both defined: it can


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_memory_hook_takes_the_input_dtype(name):
    """The engine passes dtype ("uint8") for a uint8-nhwc build: a format's memory() without it measured nothing."""
    import inspect

    spec = FORMATS[name]
    if not spec.installed():
        pytest.skip(f"{name}'s extra ({spec.extra}) is not installed")
    fmt = spec.format()
    if fmt.memory is None:
        pytest.skip(f"{name} has no memory hook")
    parameters = list(inspect.signature(fmt.memory).parameters)
    assert parameters == ["path", "input_shape", "threads", "dtype"], parameters
    inspect.signature(fmt.memory).bind(Path("a"), (1, 3, 4, 4), 1, "uint8")  # as memory_profile.measure calls it


def test_precision_is_its_string():
    """Members compare, hash, format and serialize as the strings target profiles and manifests hold."""
    import json

    assert [str(p) for p in Precision] == ["fp32", "fp16", "int8", "int8_dynamic", "w8a16"]
    assert Precision.INT8 == "int8" and {"int8": 1}[Precision.INT8] == 1 and Precision("fp16") is Precision.FP16
    assert json.dumps({Precision.FP16: Precision.INT8}) == '{"fp16": "int8"}' and f"{Precision.FP32}" == "fp32"


def test_the_registry_imports_no_torch_and_no_format():
    script = (
        "import sys, exporter.formats as f, exporter.formats.interface\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "assert not [s.module for s in f.FORMATS.values() if s.module in sys.modules]\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_builds_preflight_calls_the_formats_own(monkeypatch):
    from exporter.engine import pipeline
    from exporter.engine.plan import ArtifactSpec

    class Refuses(Bare):
        name = "refuses"
        options = ("size",)

        def preflight(self, precision, size=1):
            if size > 4:
                raise UsageError(f"size {size} is too big")
            if precision == "fp16":
                raise RuntimeUnavailable("no fp16 here")

    _registered(monkeypatch, Refuses())
    _registered(monkeypatch, Bare())

    def plan(*specs):
        return SimpleNamespace(target="test", post_build=None, artifacts=specs)

    with pytest.raises(UsageError, match="size 5 is too big"):
        pipeline._preflight(plan(ArtifactSpec("refuses", "fp32", options={"size": 5})))
    with pytest.raises(UsageError, match="bad options for refuses"):  # its signature is its option check
        pipeline._preflight(plan(ArtifactSpec("refuses", "fp32", options={"colour": "red"})))
    pipeline._preflight(plan(ArtifactSpec("refuses", "fp16")))  # unavailable here: reported by export, later
    pipeline._preflight(plan(ArtifactSpec("bare", "fp32", options={"anything": 1})))  # the default checks nothing


def test_validation_asks_the_format_for_its_proxies(monkeypatch, tmp_path):
    from exporter.engine import pipeline

    class Unavailable(Bare):
        name = "unavailable"

        def load(self, path, threads):
            raise RuntimeUnavailable("not on this host")

    class WithProxies(Unavailable):
        name = "with_proxies"
        asked = []

        def proxies(self, path, model):
            self.asked.append((path.name, model))
            raise ValueError("no stand-in for this one")

    _registered(monkeypatch, Unavailable())
    _registered(monkeypatch, WithProxies())
    session = SimpleNamespace(
        latency={"threads": 1},
        loaded=SimpleNamespace(model="the model"),
        out=tmp_path,
        progress=Progress(quiet=True),
        prefix="",
    )
    entries = {name: ArtifactResult(name, name, "fp32", path=f"a.{name}") for name in ("unavailable", "with_proxies")}
    for entry in entries.values():
        assert pipeline._run_validation(session, entry)
    assert entries["unavailable"].status is Status.UNAVAILABLE and entries["unavailable"].proxy_unavailable is None
    assert entries["with_proxies"].proxy_unavailable == "no stand-in for this one"
    assert WithProxies.asked == [("a.with_proxies", "the model")]


def test_memory_and_profile_say_when_a_format_has_none(monkeypatch, tmp_path):
    import torch

    from exporter.engine import memory_profile

    class MemoryOnly(Bare):
        name = "memory_only"

        def memory(self, path, input_shape, threads, dtype="float32"):
            return {"peak_rss_increase_bytes": 1, "shape": list(input_shape)}

    _registered(monkeypatch, Bare())
    _registered(monkeypatch, MemoryOnly())

    class Cache:
        events: list = []

        def fetch_json(self, kind, digest):
            return None

        def store_json(self, kind, digest, record):
            pass

    inputs = SimpleNamespace(validation=torch.zeros((2, 3, 4, 4)))
    session = SimpleNamespace(
        latency={"threads": 1},
        inputs=inputs,
        fed_to=lambda format_name: inputs,
        cache=Cache(),
        digests={"tools": "test"},
        out=tmp_path,
        progress=Progress(quiet=True),
        prefix="",
    )

    def entry(fmt):
        return ArtifactResult(fmt, fmt, "fp32", path="a", sha256="0" * 64, status=Status.PASSED, fidelity={})

    bare, memory_only = entry("bare"), entry("memory_only")
    threads = torch.get_num_threads()
    try:
        memory_profile.measure(session, bare)
        memory_profile.measure(session, memory_only)
    finally:
        torch.set_num_threads(threads)  # add() sets the build's threads
    none = {"available": False, "reason": "bare has no memory measurement"}
    assert bare.memory.to_json() == none and bare.profile.to_json() == none
    assert memory_only.memory.to_json() == {"available": True, "peak_rss_increase_bytes": 1, "shape": [1, 3, 4, 4]}
    assert memory_only.profile.to_json() == {"available": False, "reason": "memory_only has no profiler here"}


def test_the_engine_does_not_probe_formats():
    """Hooks are called on the interface: no hasattr/getattr on a format, no format module imported by name."""
    probe = re.compile(
        r"\b(hasattr|getattr)\([^)]*[\"'](%s)[\"']" % "|".join((*OPTIONAL_HOOKS, "preflight", "shared_key", "[A-Z_]+"))
    )
    sources = [path for part in ("engine", "bench") for path in sorted((ROOT / "exporter" / part).glob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line) or "load_module" in line
    ]
    assert found == []
