"""Named torchvision weights: resolve a name, describe it, load its checkpoint (downloading it when allowed)."""

from __future__ import annotations

import difflib
import pickle
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torchvision
from torch import nn
from torchvision.models import WeightsEnum, get_model, get_model_weights, list_models

from .. import tasks
from . import download
from .download import HASH_IN_NAME
from ..errors import UsageError
from ..files import sha256
from ..progress import Progress
from ..results import Checkpoint

TASK_MODULES = {
    "classification": torchvision.models,
    "detection": torchvision.models.detection,
    "segmentation": torchvision.models.segmentation,
    "video": torchvision.models.video,
    "optical_flow": torchvision.models.optical_flow,
    "quantization": torchvision.models.quantization,
}


@lru_cache(maxsize=None)
def _models_by_task() -> dict[str, list[str]]:
    return {task: list_models(module=module) for task, module in TASK_MODULES.items()}


@lru_cache(maxsize=None)
def _enum_to_model() -> dict[type, str]:
    table = {}
    for task in TASK_MODULES:
        for name in _models_by_task()[task]:
            table.setdefault(get_model_weights(name), name)
    return table


def model_name_of(weights: WeightsEnum) -> str:
    return _enum_to_model()[type(weights)]


def task_of(model_name: str) -> str:
    for task, names in _models_by_task().items():
        if model_name in names:
            return task
    return "unknown"


def builder_kwargs(weights: WeightsEnum) -> dict:
    """The arguments torchvision's builder sets from the weight when it is given one (`_ovewrite_named_param` in
    torchvision/models), besides num_classes and what only loading needs. Every model here is built without its
    weight, to load a checkpoint of its own; without these it would be another model: ViT's SWAG weights are
    trained at 384-518 px (their position embeddings' size), GoogLeNet and Inception v3 re-normalize their input
    inside the model (transform_input), MaxViT and MViT fix their input size."""
    name, meta = model_name_of(weights).removeprefix("quantized_"), weights.meta
    if name.startswith("vit_"):
        return {"image_size": meta["min_size"][0]}
    if name in ("googlenet", "inception_v3"):
        return {"transform_input": True}
    if name == "maxvit_t":
        return {"input_size": tuple(meta["min_size"])}
    if name.startswith("mvit_"):
        return {"spatial_size": tuple(meta["min_size"]), "temporal_size": meta["min_temporal_size"]}
    return {}


def is_quantized(weights: WeightsEnum) -> bool:
    """torchvision's int8 weights (torchvision.models.quantization): eager-mode quantized classifiers."""
    return "backend" in weights.meta


def all_weight_names() -> list[str]:
    names = []
    for enum_cls in _enum_to_model():
        names += [f"{enum_cls.__name__}.{m}" for m in enum_cls.__members__]
    return names


def _unknown(name: str, candidates: list[str]) -> UsageError:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.5)]
    hint = f"; did you mean {', '.join(close)}?" if close else "; see 'exporter list'"
    return UsageError(f"unknown weight '{name}'{hint}")


def resolve(name: str) -> WeightsEnum:
    """`Enum.MEMBER`, `model_name` (DEFAULT) or `model_name:MEMBER`."""
    name = name.strip()
    models = [m for task in _models_by_task().values() for m in task]
    if ":" in name or "." not in name:
        model, _, member = name.partition(":")
        if model not in models:
            raise _unknown(model, models + all_weight_names())
        enum_cls = get_model_weights(model)
        member = member or "DEFAULT"
        if member not in enum_cls.__members__:
            raise _unknown(f"{model}:{member}", [f"{model}:{m}" for m in enum_cls.__members__])
        return enum_cls[member]
    enum_name, _, member = name.partition(".")
    for enum_cls in _enum_to_model():
        if enum_cls.__name__ == enum_name:
            if member in enum_cls.__members__:
                return enum_cls[member]
            raise _unknown(name, [f"{enum_name}.{m}" for m in enum_cls.__members__])
    raise _unknown(name, all_weight_names())


def canonical_name(weights: WeightsEnum) -> str:
    return f"{type(weights).__name__}.{weights.name}"


def task_class(weights: WeightsEnum) -> type[tasks.Task]:
    """The weight's task (exporter.tasks), or a one-line refusal saying why it cannot be exported."""
    model_name = model_name_of(weights)
    return tasks.for_group(task_of(model_name), canonical_name(weights), model_name)


def bind_task(weights: WeightsEnum, num_classes: int | None = None, input_size=None) -> tasks.Task:
    """The weight's task bound to a graph: its class count and the input size (--input-size, else the weight's)."""
    return task_class(weights).bind(
        weights, model_name_of(weights), num_classes or len(weights.meta.get("categories") or []) or 1000, input_size
    )


def preprocessing_spec(weights: WeightsEnum, input_size=None) -> dict:
    return bind_task(weights, input_size=input_size).preprocessing(weights)


def meta_summary(weights: WeightsEnum) -> dict:
    meta = weights.meta
    metrics = meta.get("_metrics", {})
    return {
        "num_params": meta.get("num_params"),
        "gflops": meta.get("_ops"),
        "file_size_mb": meta.get("_file_size"),
        "metrics": metrics,
        "min_size": list(meta["min_size"]) if "min_size" in meta else None,
        "num_categories": len(meta.get("categories") or []),
        "recipe": meta.get("recipe"),
    }


def hub_checkpoint_path(weights: WeightsEnum) -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name


def _headline_metric(meta: dict) -> tuple[str | None, float | None]:
    """The first metric torchvision reports (acc@1, miou, box_map, epe …) on its first dataset."""
    metrics = next(iter(meta.get("_metrics", {}).values()), {})
    name = next(iter(metrics), None)
    return name, metrics.get(name)


def list_weights(task: str = "classification", max_params: int | None = None) -> list[dict]:
    if task not in TASK_MODULES:
        raise UsageError(f"unknown task '{task}'; choose from {', '.join(TASK_MODULES)}")
    rows = []
    for model in _models_by_task()[task]:
        for w in get_model_weights(model):
            meta = w.meta
            if max_params is not None and meta.get("num_params", 0) > max_params:
                continue
            acc = next(iter(meta.get("_metrics", {}).values()), {})
            metric, value = _headline_metric(meta)
            rows.append(
                {
                    "weight": canonical_name(w),
                    "model": model,
                    "acc@1": acc.get("acc@1"),
                    "metric": metric,
                    "value": value,
                    "params": meta.get("num_params"),
                    "gflops": meta.get("_ops"),
                    "size_mb": meta.get("_file_size"),
                    "backend": meta.get("backend"),  # quantized weights: the engine they run on
                }
            )
    return rows


def checkpoint_status(weights: WeightsEnum) -> dict:
    """Where the weight's checkpoint is (or would be downloaded to), whether it is there, and its size."""
    path = hub_checkpoint_path(weights)
    cached = path.is_file()
    return {
        "path": str(path),
        "cached": cached,
        "size_bytes": path.stat().st_size if cached else None,
        "url": weights.url,
    }


def quantization_summary(weights: WeightsEnum) -> dict | None:
    if not is_quantized(weights):
        return None
    unquantized = weights.meta["unquantized"]
    return {
        "backend": weights.meta["backend"],
        "unquantized": canonical_name(unquantized),
        "unquantized_checkpoint": checkpoint_status(unquantized),
        "exports": "torchscript_lite .ptl int8 (as quantized); other formats take the float weight",
    }


@dataclass
class LoadedModel:
    weights: WeightsEnum
    model_name: str
    model: nn.Module  # what gets exported: the task's graph (one output tensor)
    num_classes: int
    labels: list[str]
    checkpoint: Checkpoint
    # what artifacts are validated against, when it is not `model` itself: a quantized weight's own
    # float model (meta["unquantized"]) where its checkpoint is at hand
    reference_model: nn.Module | None = None
    reference: dict = field(default_factory=dict)  # kind, weight, checkpoint (a Checkpoint or None), note
    task_class: type[tasks.Task] = tasks.Classification

    @property
    def weight_name(self) -> str:
        return canonical_name(self.weights)

    @property
    def quantized(self) -> bool:
        return is_quantized(self.weights)

    @property
    def eager(self) -> nn.Module:
        return self.reference_model if self.reference_model is not None else self.model


def _is_state_value(value) -> bool:
    # eager-quantized modules store packed (weight, bias) tuples and a dtype beside their tensors
    if isinstance(value, tuple):
        return all(v is None or isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, (torch.Tensor, torch.dtype))


def _is_torchscript(path: Path) -> bool:
    """torch.jit.save's archive: a zip whose folder holds the program's code/ (a state dict's holds none)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/code/" in name for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise UsageError(
            f"{what} {path} is a directory, not a file" if path.is_dir() else f"{what} {path} does not exist"
        )


def _read_state_dict(path: Path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # the unpickler's own reason (an object other than tensors, an opcode it does not take), not torch's
        # advice to retry with weights_only=False: that would run whatever the file holds
        text = str(e)
        reason = (
            text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0]
            if "WeightsUnpickler error:" in text
            else (text.strip().splitlines() or [type(e).__name__])[0]
        )
        reason = reason.split(". ", 1)[0].rstrip(".")  # what it met, without its advice
        raise UsageError(
            f"checkpoint {path} was rejected by torch.load(weights_only=True): {reason} "
            f"(it holds objects other than tensors, or is not a torch file)"
        ) from None
    except (
        Exception
    ) as e:  # a file that is not a checkpoint fails in the unpickler in many ways (KeyError, IndexError, …)
        if _is_torchscript(path):
            raise UsageError(
                f"checkpoint {path} is a TorchScript program, not a state dict: pass the weights "
                f"torch.save(model.state_dict(), PATH) writes"
            ) from None
        raise UsageError(f"checkpoint {path} is truncated or not a torch file ({type(e).__name__})") from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if (
        not isinstance(obj, dict)
        or not any(isinstance(v, torch.Tensor) for v in obj.values())
        or not all(_is_state_value(v) for v in obj.values())
    ):
        raise UsageError(f"checkpoint {path} is not a state dict (expected a dict of tensors)")
    return obj


def _checked_digest(path: Path, verify: bool) -> tuple[str, bool]:
    """The file's sha256, checked against the prefix its name carries (torch.hub's convention)."""
    digest = sha256(path)
    match = HASH_IN_NAME.search(path.name)
    if match and verify:
        if not digest.startswith(match.group(1)):
            skip = (
                f"if {match.group(1)} is a step or a date, not a hash, pass --no-verify"
                if match.group(1).isdigit()
                else "pass --no-verify to skip"
            )
            raise UsageError(
                f"checkpoint {path} fails its hash check: name says {match.group(1)}, "
                f"file is {digest[: len(match.group(1))]} ({skip})"
            )
        return digest, True
    return digest, False


def _load_exactly(model: nn.Module, state: dict, path: Path, model_name: str) -> None:
    try:
        result = model.load_state_dict(state, strict=False)
    except KeyError as e:  # int8 modules read their keys themselves
        raise UsageError(f"checkpoint {path} does not fit {model_name}: no key {e.args[0]}") from None
    except (RuntimeError, TypeError, AttributeError) as e:  # shapes (or int8 layouts) that do not match
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
        raise UsageError(f"checkpoint {path} does not fit {model_name}: {first[:200]}") from None
    if result.missing_keys or result.unexpected_keys:
        parts = []
        if result.missing_keys:
            parts.append(f"{len(result.missing_keys)} missing keys (e.g. {result.missing_keys[0]})")
        if result.unexpected_keys:
            parts.append(f"{len(result.unexpected_keys)} unexpected keys (e.g. {result.unexpected_keys[0]})")
        raise UsageError(f"checkpoint {path} does not fit {model_name}: {', '.join(parts)}")


def _quantized_model(model_name: str, num_classes: int, backend: str, state: dict, path: Path, arch: dict) -> nn.Module:
    """An int8 model built as torchvision builds it (quantize=True, the weight's backend engine)."""
    if backend not in torch.backends.quantized.supported_engines:
        raise UsageError(f"{model_name} needs the {backend} quantized engine, which this torch build lacks")
    torch.backends.quantized.engine = backend  # as torchvision's builders do; int8 runtimes read it too
    if any("fake_quant" in key for key in state):
        # a quantization-aware-training checkpoint (torchvision's MobileNetV3): the prepared model
        # is loaded, then converted
        model = get_model(model_name, weights=None, num_classes=num_classes, **arch)
        model.fuse_model(is_qat=True)
        model.qconfig = torch.ao.quantization.get_default_qat_qconfig(backend)
        torch.ao.quantization.prepare_qat(model, inplace=True)
        _load_exactly(model, state, path, model_name)
        torch.ao.quantization.convert(model.eval(), inplace=True)
    else:
        model = get_model(model_name, weights=None, quantize=True, backend=backend, num_classes=num_classes, **arch)
        _load_exactly(model, state, path, model_name)
    return model.eval()


def _float_reference(weights: WeightsEnum, num_classes: int, path: Path | None, verify: bool):
    """A quantized weight's own float model, where its checkpoint is at hand (never downloaded)."""
    unquantized = weights.meta["unquantized"]
    source = "checkpoint" if path is not None else "torch-hub-cache"
    path = Path(path) if path is not None else hub_checkpoint_path(unquantized)
    if not path.is_file():
        if source == "checkpoint":
            _require_file(path, "float checkpoint")
        note = (
            f"no checkpoint of {canonical_name(unquantized)} at {path}: validated against the quantized "
            f"eager model (pass --float-checkpoint PATH to validate against the float model)"
        )
        return None, {
            "kind": "quantized eager",
            "weight": canonical_name(weights),
            "checkpoint": None,
            "looked_for": str(path),
            "note": note,
        }
    digest, verified = _checked_digest(path, verify)
    name = model_name_of(unquantized)
    model = get_model(name, weights=None, num_classes=num_classes, **builder_kwargs(unquantized))
    _load_exactly(model, _read_state_dict(path), path, name)
    checkpoint = Checkpoint(path=str(path.resolve()), sha256=digest, source=source, verified=verified)
    return model.eval(), {
        "kind": "unquantized float",
        "weight": canonical_name(unquantized),
        "checkpoint": checkpoint,
        "note": f"validated against the weight's own float model {canonical_name(unquantized)}",
    }


def load(
    name: str,
    checkpoint: str | Path | None = None,
    verify: bool = True,
    labels_file: str | Path | None = None,
    offline: bool = False,
    progress=None,
    float_checkpoint: str | Path | None = None,
) -> LoadedModel:
    """The named weight's model from `checkpoint`, else the torch hub cache, else (unless offline,
    by argument or $EXPORTER_OFFLINE) downloaded into the hub cache and verified."""
    weights = resolve(name)
    model_name = model_name_of(weights)
    task = task_class(weights)
    if float_checkpoint is not None and not is_quantized(weights):
        raise UsageError(f"--float-checkpoint is for quantized weights; {canonical_name(weights)} is float")

    if checkpoint is None:
        path = hub_checkpoint_path(weights)
        source = "torch-hub-cache"
        if not path.is_file():
            if offline or download.offline_by_environment():
                raise UsageError(
                    f"no cached checkpoint for {canonical_name(weights)} at {path} and downloads are off "
                    f"(--offline or ${download.OFFLINE_ENV}); place the file there or pass --checkpoint PATH"
                )
            download.fetch(weights.url, path, progress or Progress(quiet=True))
            source = "download"
    else:
        path, source = Path(checkpoint), "checkpoint"
        _require_file(path, "checkpoint")

    digest, verified = _checked_digest(path, verify or source == "download")
    state = _read_state_dict(path)
    categories = list(weights.meta.get("categories") or [])
    num_classes = task.num_classes_in(state, model_name, len(categories) or 1000)
    reference_model, reference = None, {"kind": "float eager", "weight": canonical_name(weights), "checkpoint": None}
    if is_quantized(weights):
        model = _quantized_model(model_name, num_classes, weights.meta["backend"], state, path, builder_kwargs(weights))
        reference_model, reference = _float_reference(weights, num_classes, float_checkpoint, verify)
    else:
        model = task.construct(model_name, num_classes, state, builder_kwargs(weights))
        _load_exactly(model, state, path, model_name)
        model = task.graph(model.eval())

    labels = read_labels(labels_file, num_classes) if labels_file else None
    if labels is None:
        labels = categories if len(categories) == num_classes else [f"class_{i}" for i in range(num_classes)]
    return LoadedModel(
        weights=weights,
        model_name=model_name,
        model=model,
        num_classes=num_classes,
        labels=labels,
        checkpoint=Checkpoint(path=str(path.resolve()), sha256=digest, source=source, verified=verified),
        reference_model=reference_model,
        reference=reference,
        task_class=task,
    )


def read_labels(path: str | Path, num_classes: int) -> list[str]:
    path = Path(path)
    _require_file(path, "labels file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"labels file {path} is not UTF-8 text (byte {e.start}): one class name per line") from None
    labels = [line.strip() for line in text.splitlines() if line.strip()]
    if len(labels) != num_classes:
        raise UsageError(f"labels file {path} has {len(labels)} labels but the model has {num_classes} classes")
    return labels
