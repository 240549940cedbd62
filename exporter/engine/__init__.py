"""The Python API behind `exporter build` and `exporter validate`.

This module imports no torch: an unchanged re-run is answered from the build record in the cache
(see build.record) in well under the seconds torch alone takes to import."""

from __future__ import annotations

from pathlib import Path

from . import cache, profiles
from ..errors import UsageError
from .request import BuildRequest
from ..progress import Progress


def expand_targets(targets) -> list[str]:
    """The targets named, `all` expanded, each profile once (`android` and `targets/android.toml` are one)."""
    targets = [targets] if isinstance(targets, (str, Path)) else list(targets)
    expanded = [name for t in targets for name in (profiles.available_targets() if str(t) == "all" else [str(t)])]
    first = {}
    for name in expanded:
        try:
            path = profiles.profile_path(name).resolve()
        except (OSError, RuntimeError):  # a symlink loop: loading it says what is wrong
            path = profiles.profile_path(name)
        first.setdefault(path, name)
    return list(first.values())


def default_out(weight: str, targets: list[str]) -> Path:
    """Where a build without --out writes: exports/WEIGHT/TARGET, or exports/WEIGHT holding one folder per target."""
    return Path("exports") / weight / (targets[0] if len(targets) == 1 else "")


def _distinct(chosen: list[dict]) -> list[dict]:
    """Each target's files go under its name: two profiles of one name would write the same folder."""
    seen = {}
    for profile in chosen:
        other = seen.setdefault(profile["name"], profile)
        if other is not profile:
            raise UsageError(
                f"targets {other.get('path')} and {profile.get('path')} are both named "
                f"'{profile['name']}' (a build's folders are named after its targets): give one another `name`"
            )
    return chosen


def target_profile(request: BuildRequest, target: str) -> dict:
    """The target's profile with the request's overrides, checked; the pipeline turns it into a Plan."""
    return profiles.with_overrides(profiles.load(target), request.overrides())


def target_refusal(weight: str, target: str, formats=()) -> str | None:
    """Why `build` would refuse this weight on this target (it makes none of the target's artifacts, or of those
    `formats` keeps), or None. A weight no target can take is refused here as in `build`."""
    from .. import weights
    from . import pipeline
    from .plan import make_all

    resolved = weights.resolve(weight)
    task_class = weights.task_class(resolved)
    profile = target_profile(BuildRequest(weight, target=target, formats=list(formats)), target)
    (plan,) = make_all([profile], task_class.name, required=task_class.format_options())
    return pipeline.whole_target_refusal(resolved, task_class, plan)


def build(request: BuildRequest, progress: Progress | None = None) -> dict:
    """Build one target (request.target); returns its manifest."""
    (doc,) = build_targets(request, [request.target], progress)
    return doc


def build_targets(request: BuildRequest, targets, progress: Progress | None = None) -> list[dict]:
    """Build several targets sharing one model load, one calibration set and one eager reference run.

    With one target its files go straight into --out; with several, into --out/<target>/, plus a
    combined report.html in --out. A request identical to an earlier one (same checkpoint, data,
    profiles, tools, exporter code and host) is answered from the cache without importing torch."""
    from .record import BuildRecord

    progress = progress or Progress(quiet=True)
    chosen = _distinct([target_profile(request, t) for t in expand_targets(targets)])
    profiles.check_precisions(chosen, request.thresholds, request.quant_budget)
    record = BuildRecord(request.cache_dir or cache.default_root(), request, chosen) if request.cache else None
    if record is not None:
        docs = record.restore(progress)
        if docs is not None:
            return docs
    from . import pipeline

    base, docs = pipeline.run(request, chosen, record.cache_root if record else None, progress)
    if record is not None:
        record.store(base, docs, progress)
    return docs


def validate_build(
    out: Path,
    data_dir: Path | None = None,
    thresholds: list[str] = (),
    progress: Progress | None = None,
    checkpoint: Path | None = None,
) -> dict:
    """Re-run the validation contract on an existing build directory."""
    from . import pipeline

    return pipeline.validate(Path(out), data_dir, thresholds, progress or Progress(quiet=True), checkpoint)
