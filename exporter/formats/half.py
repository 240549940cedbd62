"""fp16 graphs with float32 input and output, shared by the formats that make them (ONNX, ExecuTorch): the whole
model in half, or only the parts a graph names in `half_modules`, each with its BatchNorms folded in float32 first."""

from __future__ import annotations

import copy

import torch


class HalfModel(torch.nn.Module):
    """fp16 weights and activations with fp32 I/O: the exporter writes the two casts into the graph."""

    def __init__(self, model):
        super().__init__()
        self.model = copy.deepcopy(model).half()

    def forward(self, x):
        return self.model(x.half()).float()


class HalfPart(torch.nn.Module):
    """One part of a mixed graph in half: its tensors in cast to half, out (in dicts, lists, tuples) back to float."""

    def __init__(self, part):
        super().__init__()
        self.part = part.half()

    def forward(self, *args, **kwargs):
        return cast(self.part(*cast(args, torch.half), **cast(kwargs, torch.half)), torch.float)


# ONNX's dynamo exporter writes each node's module path into the graph's metadata (pkg.torch.onnx.class_hierarchy,
# namespace), these wrappers' qualified names included: they keep the names they had when they lived in onnx.py, so
# the fp16 ONNX files this module makes stay byte-identical to those made before it.
HalfModel.__module__ = HalfPart.__module__ = "exporter.formats.onnx"
HalfModel.__qualname__, HalfPart.__qualname__ = "_HalfModel", "_HalfPart"


def cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)((k, cast(v, dtype)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple takes its items as arguments
        return type(value)(*(cast(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast(v, dtype) for v in value)
    return value


def half_graph(model) -> tuple[torch.nn.Module, dict]:
    """The fp16 graph: the whole model in half, or, for a graph that names its `half_modules` (the parts that
    can compute in half; the rest needs float, e.g. steps that run kernels with no Half version while traced),
    only those, each with its BatchNorms folded first."""
    parts = getattr(model, "half_modules", None)
    if not parts:
        folded, folding = fold_batchnorms(model)
        return HalfModel(folded).eval(), folding
    mixed, folding = copy.deepcopy(model).eval(), {"half_modules": list(parts)}
    for name in parts:
        parent, _, leaf = name.rpartition(".")
        owner = mixed.get_submodule(parent) if parent else mixed
        folded, folding[name] = fold_batchnorms(getattr(owner, leaf))
        setattr(owner, leaf, HalfPart(folded))
    return mixed, folding


def fold_batchnorms(model, by_parts: bool = False) -> tuple[torch.nn.Module, dict]:
    """`model` with each BatchNorm that follows a conv folded into it, in float32. Folded after the cast (as the
    ONNX optimizer does with a half graph), scale and shift are computed in half and the folded weights rounded
    twice: measured on random MNASNet1.0, RegNetY-800MF, MobileNetV3-L and ResNet18, folding first gives the
    fp16 graph 3-5 dB more PSNR against eager. A model torch.fx cannot trace is left as it is, or, `by_parts`,
    folded in each of its children that can be traced (the folded conv keeps its name)."""
    from torch.fx.experimental.optimization import fuse

    def count(m):
        return sum(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())

    def fold(module):
        if not count(module):
            return module
        try:
            return fuse(module)
        except Exception:  # symbolic tracing refused (control flow on values)
            if not by_parts:
                raise
            for name, child in list(module.named_children()):
                setattr(module, name, fold(child))
            return module

    before = count(model)
    if not before:
        return model, {"batchnorms": 0}
    try:
        fused = fold(copy.deepcopy(model).eval())
    except Exception as e:
        return model, {"batchnorms": before, "folded": 0, "not_folded_because": f"{type(e).__name__}: {str(e)[:160]}"}
    return fused, {"batchnorms": before, "folded": before - count(fused)}


def half_described(folding: dict) -> str:
    """The manifest's words for a graph half_graph made."""
    if "half_modules" in folding:
        return f"float16 in {', '.join(folding['half_modules'])}, float32 elsewhere"
    return "float16 with fp32 I/O casts"
