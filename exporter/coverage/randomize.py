"""Random checkpoints for the coverage sweep: a weight's architecture with random weights whose batch-norm
statistics are settled on synthetic images, so that nothing is downloaded and yet the eager reference means
something (its outputs vary across inputs).

How a checkpoint is made (deterministic: the seed comes from the weight's name):
1. the model is constructed as the exporter constructs it (the task's `construct`, the weight's category count);
2. every Linear/Conv whose weight is all zeros (torchvision zero-initialises some heads, e.g. ViT's
   `heads.head`, whose logits would then be 0 for every input) is re-initialised with PyTorch's default init;
3. every BatchNorm gets momentum=None (a cumulative average) and fresh statistics, then a few no-grad passes
   over synthetic images, preprocessed like the weight's own transforms, run with only the BatchNorms in
   train mode (so dropout stays off and detectors need no targets);
4. if the outputs still barely vary across the images (a head with no normalisation between small-init convs:
   RetinaNet v1's towers of std-0.01 convs shrink the signal ~2x per layer, so every image gets the prior
   bias), every Linear/Conv, in the order the forward pass reaches it, is scaled so that what its weights add
   has unit standard deviation on the images (LSUV), and step 3 is run again;
5. the state dict is saved with torch.save (the exporter reads it with weights_only=True).

A quantized torchvision weight gets two files: its float model's (the eager reference, --float-checkpoint)
and that model quantized as torchvision quantizes it (fuse, observe on the synthetic images, convert; the
QAT-prepared layout for MobileNetV3, as torchvision ships it)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import nn

from .. import data, weights

SETTLE_IMAGES = 16  # synthetic images the statistics are settled on
SETTLE_BATCH = 4
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def seed_for(weight_name: str) -> int:
    return int.from_bytes(hashlib.sha256(weight_name.encode()).digest()[:4], "little")


def _reinit_zero_layers(model: nn.Module) -> list[str]:
    """Re-initialise every Linear/Conv whose weight is all zeros; returns their names."""
    done = []
    for name, module in model.named_modules():
        if isinstance(module, _WEIGHTED) and not bool(module.weight.any()):
            module.reset_parameters()
            done.append(name)
    return done


def _batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _settle(graph: nn.Module, images: torch.Tensor) -> int:
    """Batch-norm statistics from `images` (cumulative average over every pass); returns how many layers."""
    norms = _batchnorms(graph)
    if not norms:  # nothing to settle: ViT-H-14 ran 16 images at 518 px for nothing (8 take it 195 s)
        graph.eval()
        return 0
    for bn in norms:
        bn.momentum = None
        bn.reset_running_stats()
    graph.eval()
    for bn in norms:
        bn.train()
    with torch.no_grad():
        for start in range(0, len(images), SETTLE_BATCH):
            graph(images[start : start + SETTLE_BATCH])
    graph.eval()
    return len(norms)


NEAR_CONSTANT_DB = 40.0  # as the builds' degenerate-reference check: the mean output is this close to every row


def _near_constant(graph: nn.Module, images: torch.Tensor) -> bool:
    with torch.no_grad():
        out = graph(images[:SETTLE_BATCH]).flatten(1).double()
    rmse = (out - out.mean(0, keepdim=True)).pow(2).mean().sqrt().item()
    return rmse == 0 or 20 * math.log10(out.abs().max().item() / rmse) >= NEAR_CONSTANT_DB


def _unit_variance(graph: nn.Module, images: torch.Tensor) -> list[str]:
    """Scale each Linear/Conv, in forward order, so that its weights' contribution (output minus bias, over
    every call: a head shared across pyramid levels is called once per level) has unit std; returns their names.
    BatchNorms normalise with the batch's statistics meanwhile (their running ones predate the scaling)."""
    batch = images[:SETTLE_BATCH]
    for bn in _batchnorms(graph):
        bn.train()
    reached: list[str] = []
    layers = {m: n for n, m in graph.named_modules() if isinstance(m, _WEIGHTED) and m.weight.is_floating_point()}
    hooks = [
        m.register_forward_hook(lambda m, i, o: reached.append(layers[m]) if layers[m] not in reached else None)
        for m in layers
    ]
    with torch.no_grad():
        graph(batch)
    for h in hooks:
        h.remove()
    modules = dict(graph.named_modules())
    for name in reached:
        layer, seen = modules[name], []
        hook = layer.register_forward_hook(
            lambda m, i, o: seen.append(
                (o if m.bias is None else o - m.bias.view(-1, *[1] * (o.dim() - 2))).detach().flatten()
            )
        )
        with torch.no_grad():
            graph(batch)
            hook.remove()
            std = torch.cat(seen).double().std().item()
            if std > 0 and math.isfinite(std):
                layer.weight.mul_(1 / std)
    graph.eval()
    return reached


def _spread(graph: nn.Module, images: torch.Tensor) -> dict:
    """How much the eager outputs vary across inputs: mean per-output std across images, relative to their
    mean magnitude (0: every input gets the same output, a reference that judges nothing)."""
    with torch.no_grad():
        out = graph(images[:SETTLE_BATCH]).flatten(1).double()
    std = out.std(0).mean().item()
    scale = out.abs().mean().item()
    return {
        "output_std": std,
        "relative_std": std / scale if scale > 0 else 0.0,
        "finite": bool(math.isfinite(std) and torch.isfinite(out).all()),
    }


def _synthetic_images(w, task, count: int, seed: int) -> torch.Tensor:
    return data.synthetic(task.transform(w), 0, count, seed).validation


def _float_model(w, model_name: str, num_classes: int, input_size, seed: int) -> tuple[nn.Module, dict]:
    """A settled random float model built as the exporter builds it, and what was done to it."""
    task_class = weights.task_class(w)
    task = task_class.bind(w, model_name, num_classes, input_size)
    torch.manual_seed(seed)
    model = task_class.construct(model_name, num_classes, {}, weights.builder_kwargs(w))
    graph = task_class.graph(model)
    reinitialised = _reinit_zero_layers(model)
    images = _synthetic_images(w, task, SETTLE_IMAGES, seed % (2**31))
    settled = _settle(graph, images)
    info = {
        "seed": seed,
        "num_classes": num_classes,
        "batchnorms_settled": settled,
        "settle_images": len(images),
        "reinitialised_zero_layers": reinitialised,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if _near_constant(graph, images):
        info["unit_variance_layers"] = len(_unit_variance(graph, images))
        _settle(graph, images)
    info["reference_spread"] = _spread(graph, images)
    return model.eval(), info


def _quantized_state(w, float_model: nn.Module, model_name: str, num_classes: int, images: torch.Tensor) -> dict:
    """The float model quantized as torchvision quantizes its builders' models (eager mode)."""
    from torchvision.models import get_model

    backend = w.meta["backend"]
    if backend not in torch.backends.quantized.supported_engines:
        raise RuntimeError(f"{model_name} needs the {backend} quantized engine, which this torch build lacks")
    torch.backends.quantized.engine = backend
    model = get_model(model_name, weights=None, quantize=False, num_classes=num_classes, **weights.builder_kwargs(w))
    model.load_state_dict(float_model.state_dict())
    model.eval()
    if model_name.startswith("quantized_mobilenet_v3"):
        # torchvision ships MobileNetV3 as a QAT checkpoint: the prepared model's state (the loader converts it)
        model.fuse_model(is_qat=True)
        model.qconfig = torch.ao.quantization.get_default_qat_qconfig(backend)
        torch.ao.quantization.prepare_qat(model.train(), inplace=True)
        model.eval()
        with torch.no_grad():
            for start in range(0, len(images), SETTLE_BATCH):
                model(images[start : start + SETTLE_BATCH])
        return model.state_dict()
    observer = (
        torch.ao.quantization.default_per_channel_weight_observer
        if backend == "fbgemm"
        else torch.ao.quantization.default_weight_observer
    )
    model.qconfig = torch.ao.quantization.QConfig(activation=torch.ao.quantization.default_observer, weight=observer)
    model.fuse_model()
    torch.ao.quantization.prepare(model, inplace=True)
    with torch.no_grad():
        for start in range(0, len(images), SETTLE_BATCH):
            model(images[start : start + SETTLE_BATCH])
    torch.ao.quantization.convert(model, inplace=True)
    return model.state_dict()


def accepted_input_size(weight_name: str, input_size, classifier_size: int | None = None):
    """`input_size` where the weight's graph takes one (segmentation, RetinaNet/FCOS, video frames no smaller than
    the weight's min_size) and it is no larger than the weight's own (the sweep measures small: R3D-18's frames
    stay 112x112), else None (SSD keeps its weight's own size; a size equal to the weight's own is its own). A
    classifier takes `classifier_size` square on those terms (ViT, MaxViT and Swin take only their crop), and its
    own crop without one."""
    from ..errors import UsageError

    w = weights.resolve(weight_name)
    task, model_name = weights.task_class(w), weights.model_name_of(w)
    if task.name == "classification":
        input_size = (classifier_size, classifier_size) if classifier_size else None
    if input_size is None or tuple(input_size) == task.input_size_of(w, model_name, None):
        return None
    try:
        task.input_size_of(w, model_name, tuple(input_size))
    except UsageError:
        return None
    own = task.input_size_of(w, model_name, None)
    return None if any(r > o for r, o in zip(input_size, own)) else tuple(input_size)


def built_input_size(weight_name: str, input_size, classifier_size: int | None = None) -> list[int]:
    """The input (H, W) a build of the weight gets when the sweep asks for `input_size` and `classifier_size`."""
    w = weights.resolve(weight_name)
    task, model_name = weights.task_class(w), weights.model_name_of(w)
    return list(task.input_size_of(w, model_name, accepted_input_size(weight_name, input_size, classifier_size)))


def make(weight_name: str, directory: Path, input_size=None) -> dict:
    """Write the weight's random checkpoint(s) into `directory` (kept if already there); returns
    {"checkpoint": path, "float_checkpoint": path or None, ...what was done}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    w = weights.resolve(weight_name)
    name = weights.canonical_name(w)
    model_name = weights.model_name_of(w)
    num_classes = len(w.meta.get("categories") or []) or 1000
    seed = seed_for(name)
    stem = f"{name}.random" + (f"-{input_size[0]}x{input_size[1]}" if input_size else "")  # batch norms settled at it
    checkpoint = directory / f"{stem}.pt"
    info_path = directory / f"{stem}.json"
    float_path = directory / f"{stem}-float.pt" if weights.is_quantized(w) else None
    if checkpoint.is_file() and info_path.is_file() and (float_path is None or float_path.is_file()):
        import json

        return json.loads(info_path.read_text())
    if weights.is_quantized(w):
        unquantized = w.meta["unquantized"]
        float_name = weights.model_name_of(unquantized)
        model, info = _float_model(unquantized, float_name, num_classes, input_size, seed)
        torch.save(model.state_dict(), _tmp(float_path))
        _tmp(float_path).replace(float_path)
        task = weights.task_class(unquantized).bind(unquantized, float_name, num_classes, input_size)
        images = _synthetic_images(unquantized, task, SETTLE_IMAGES, (seed + 1) % (2**31))
        state = _quantized_state(w, model, model_name, num_classes, images)
        info["quantized"] = {"backend": w.meta["backend"], "float_model": float_name}
    else:
        model, info = _float_model(w, model_name, num_classes, input_size, seed)
        state = model.state_dict()
    torch.save(state, _tmp(checkpoint))
    _tmp(checkpoint).replace(checkpoint)
    info.update(checkpoint=str(checkpoint), float_checkpoint=str(float_path) if float_path else None)
    import json

    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".partial")
