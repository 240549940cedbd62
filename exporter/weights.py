"""Named torchvision weights: resolve a name, describe it, load its checkpoint offline."""

from __future__ import annotations

import difflib
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torchvision
from torch import nn
from torchvision.models import WeightsEnum, get_model, get_model_weights, list_models

from .errors import UsageError
from .files import sha256

# torch.hub's convention: "<name>-<sha256 prefix>.<ext>"
HASH_IN_NAME = re.compile(r"-([a-f0-9]{6,64})\.")

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
    for task in ("classification", "detection", "segmentation", "video", "optical_flow"):
        for name in _models_by_task()[task]:
            table.setdefault(get_model_weights(name), name)
    return table


def model_name_of(weights: WeightsEnum) -> str:
    return _enum_to_model()[type(weights)]


def task_of(model_name: str) -> str:
    for task, names in _models_by_task().items():
        if task != "quantization" and model_name in names:
            return task
    return "unknown"


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


def preprocessing_spec(weights: WeightsEnum) -> dict:
    t = weights.transforms()
    return {
        "resize_size": list(t.resize_size),
        "crop_size": list(t.crop_size),
        "interpolation": t.interpolation.value,
        "antialias": t.antialias,
        "mean": list(t.mean),
        "std": list(t.std),
        "layout": "NCHW",
        "dtype": "float32",
        "range": "RGB scaled to [0, 1] before normalization",
    }


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
            rows.append(
                {
                    "weight": canonical_name(w),
                    "model": model,
                    "acc@1": acc.get("acc@1"),
                    "params": meta.get("num_params"),
                    "gflops": meta.get("_ops"),
                    "size_mb": meta.get("_file_size"),
                }
            )
    return rows


@dataclass
class LoadedModel:
    weights: WeightsEnum
    model_name: str
    model: nn.Module
    num_classes: int
    labels: list[str]
    checkpoint: dict = field(default_factory=dict)  # path, sha256, source, verified

    @property
    def weight_name(self) -> str:
        return canonical_name(self.weights)


def _read_state_dict(path: Path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"checkpoint {path} was rejected by torch.load(weights_only=True): {first}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise UsageError(f"checkpoint {path} is truncated or not a torch file ({type(e).__name__})") from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(f"checkpoint {path} is not a state dict (expected a dict of tensors)")
    return obj


def _last_linear_key(model: nn.Module) -> str | None:
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    return f"{last}.weight" if last else None


def _num_classes_in(state: dict, model_name: str, default: int) -> int:
    probe = get_model(model_name, weights=None, num_classes=default)
    key = _last_linear_key(probe)
    if key and key in state and state[key].ndim == 2:
        return int(state[key].shape[0])
    return default


def load(
    name: str,
    checkpoint: str | Path | None = None,
    verify: bool = True,
    labels_file: str | Path | None = None,
) -> LoadedModel:
    weights = resolve(name)
    model_name = model_name_of(weights)
    if task_of(model_name) != "classification":
        raise UsageError(f"{canonical_name(weights)} is a {task_of(model_name)} weight; only classification is supported")

    if checkpoint is None:
        path = hub_checkpoint_path(weights)
        source = "torch-hub-cache"
        if not path.is_file():
            raise UsageError(
                f"no cached checkpoint for {canonical_name(weights)} at {path} and no download on this host; "
                f"place the file there or pass --checkpoint PATH"
            )
    else:
        path, source = Path(checkpoint), "checkpoint"
        if not path.is_file():
            raise UsageError(f"checkpoint {path} does not exist")

    digest = sha256(path)
    match = HASH_IN_NAME.search(path.name)
    verified = False
    if match and verify:
        if not digest.startswith(match.group(1)):
            raise UsageError(
                f"checkpoint {path} fails its hash check: name says {match.group(1)}, file is {digest[: len(match.group(1))]} "
                f"(pass --no-verify to skip)"
            )
        verified = True

    state = _read_state_dict(path)
    categories = list(weights.meta.get("categories") or [])
    num_classes = _num_classes_in(state, model_name, len(categories) or 1000)
    model = get_model(model_name, weights=None, num_classes=num_classes)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        parts = []
        if result.missing_keys:
            parts.append(f"{len(result.missing_keys)} missing keys (e.g. {result.missing_keys[0]})")
        if result.unexpected_keys:
            parts.append(f"{len(result.unexpected_keys)} unexpected keys (e.g. {result.unexpected_keys[0]})")
        raise UsageError(f"checkpoint {path} does not fit {model_name}: {', '.join(parts)}")
    model.eval()

    labels = read_labels(labels_file, num_classes) if labels_file else None
    if labels is None:
        labels = categories if len(categories) == num_classes else [f"class_{i}" for i in range(num_classes)]
    return LoadedModel(
        weights=weights,
        model_name=model_name,
        model=model,
        num_classes=num_classes,
        labels=labels,
        checkpoint={"path": str(path.resolve()), "sha256": digest, "source": source, "verified": verified},
    )


def read_labels(path: str | Path, num_classes: int) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"labels file {path} does not exist")
    labels = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(labels) != num_classes:
        raise UsageError(f"labels file {path} has {len(labels)} labels but the model has {num_classes} classes")
    return labels
