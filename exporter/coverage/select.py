"""Which weights a coverage sweep covers: every torchvision weight (or each builder's DEFAULT), filtered by
model name or glob, task group and size, split into shards; and which of them the exporter refuses by design
(asked of the exporter itself, without building) or the sweep skips for size."""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass

from ..errors import UsageError
from ..precision import Precision

TASK_ORDER = ("classification", "segmentation", "detection", "quantization", "video", "optical_flow")


@dataclass(frozen=True)
class Candidate:
    weight: str  # canonical Enum.MEMBER
    model: str  # the torchvision builder
    task: str  # torchvision's model group (weights.TASK_MODULES)
    params: int | None
    quantized: bool = False
    refused: str | None = None  # the exporter's own one-line refusal
    skipped: str | None = None  # why the sweep does not build it (--max-params)

    def describe(self) -> dict:
        return asdict(self)


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = 0
    if not sep or n < 1 or not 1 <= i <= n:
        raise UsageError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 2/8")
    return i, n


def patterns(models) -> list[str]:
    return [p.strip() for text in models for p in str(text).split(",") if p.strip()]


def _matches(patterns: list[str], *names: str) -> bool:
    return any(fnmatch.fnmatchcase(n.lower(), p.lower()) for p in patterns for n in names)


def candidates(models=(), tasks=(), one_per_builder: bool = False, max_params: int | None = None) -> list[Candidate]:
    """The weights to cover, in table order (task group, builder, weight)."""
    from torchvision.models import get_model_weights, list_models

    from .. import weights

    by_task = {task: list_models(module=module) for task, module in weights.TASK_MODULES.items()}
    tasks = list(dict.fromkeys(tasks)) or list(TASK_ORDER)
    for task in tasks:
        if task not in by_task:
            raise UsageError(f"--task {task!r}: choose from {', '.join(TASK_ORDER)}")
    wanted = patterns(models)
    found, matched = [], set()
    for task in sorted(tasks, key=lambda t: TASK_ORDER.index(t) if t in TASK_ORDER else len(TASK_ORDER)):
        for model in sorted(by_task[task]):
            enum_cls = get_model_weights(model)
            members = [enum_cls.DEFAULT] if one_per_builder else list(enum_cls)
            for w in members:
                name = weights.canonical_name(w)
                if wanted:
                    hits = [p for p in wanted if _matches([p], model, name, f"{model}:{w.name}")]
                    if not hits:
                        continue
                    matched.update(hits)
                found.append(_candidate(w, model, task, max_params))
    unmatched = [p for p in wanted if p not in matched]
    if unmatched:
        raise UsageError(
            f"--models {', '.join(unmatched)} matches no weight of the chosen tasks "
            f"({', '.join(tasks)}); see 'exporter list --task TASK'"
        )
    return found


def _candidate(w, model: str, task: str, max_params: int | None) -> Candidate:
    from .. import weights

    name = weights.canonical_name(w)
    params = w.meta.get("num_params")
    refused = skipped = None
    try:
        weights.task_class(w)
    except UsageError as e:
        refused = str(e).removeprefix(f"{name}: ")
    if refused is None and max_params is not None and params is not None and params > max_params:
        skipped = f"{params / 1e6:.1f}M parameters, over --max-params {max_params / 1e6:g}M"
    return Candidate(name, model, task, params, weights.is_quantized(w), refused, skipped)


def shard(found: list[Candidate], which: tuple[int, int] | None) -> list[Candidate]:
    """Weights i, i+N, i+2N, … (1-based): shards of similar size and mix, every weight in exactly one."""
    if which is None:
        return found
    i, n = which
    return found[i - 1 :: n]


def planned_artifacts(weight: str, target: str, formats=(), quantized: bool = False) -> list[dict]:
    """The artifacts a build of `weight` for `target` makes, in order (from the target profile, torch-free)."""
    from ..engine import BuildRequest, target_profile

    artifacts = target_profile(BuildRequest(weight, target=target, formats=list(formats)), target)["artifacts"]
    if quantized:  # an eager-quantized weight: one int8 artifact per format (Plan.for_eager_quantized)
        seen = {}
        for a in artifacts:
            seen.setdefault(a["format"], {"format": a["format"], "precision": Precision.INT8})
        artifacts = list(seen.values())
    return [
        {"name": a.get("name") or f"{a['format']}_{a['precision']}", "format": a["format"], "precision": a["precision"]}
        for a in artifacts
    ]


def targets_for(targets, formats=()) -> list[str]:
    """The targets to build: with --format, only those that have such an artifact (a --format that matches
    nothing anywhere is an error)."""
    from ..engine import BuildRequest, expand_targets, target_profile

    chosen = expand_targets(list(targets) or ["all"])
    kept = []
    for target in chosen:  # every target is read here, so a misspelt one stops the sweep before any build
        try:
            target_profile(BuildRequest("coverage", target=target, formats=list(formats)), target)
        except UsageError as e:
            if not formats or "matches nothing" not in str(e):
                raise
            continue
        kept.append(target)
    if not kept:
        raise UsageError(f"--format {', '.join(formats)} matches no artifact of target {', '.join(chosen)}")
    return kept
