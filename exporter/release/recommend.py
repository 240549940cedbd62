"""Which artifact to ship, per target: the fastest that passed and the smallest that passed (bytes).

"Fastest" is the fewest emulated instructions per inference on the profile's reference core where every artifact
that passed was counted there (`[validate] reference_cpu`, an out-of-order core: the device's ISA, and the same
count on a quiet or a busy host), else the x86 p50. Counts rank exactly within one runtime; between runtimes a
difference under COUNT_TIE is a tie (measured: cross-engine counts are off by up to 1.8x on the same phone table,
docs/benchmarks.md), which the x86 p50 then breaks.

Only measured numbers count and only artifacts that passed: one without a latency (not timed on this host)
can be the smallest but never the fastest; a failed or unvalidated (unavailable) one is never picked."""

from __future__ import annotations

import re

from ..formats import FORMATS
from ..results import ArtifactResult, Kind, Manifest, Recommendation, Status, kinds


def _p50(a: ArtifactResult) -> float:
    p50 = a.latency_ms.p50 if a.latency_ms is not None else None
    return float("inf") if p50 is None else p50


COUNT_TIE = 1.5


def _count(a: ArtifactResult, cpu: str | None) -> int | None:
    for row in a.aarch64 or []:
        if row.cpu == cpu:
            return row.instructions.per_inference if row.instructions is not None else None
    return None


def reference_cpu(doc: Manifest) -> str | None:
    return ((doc.aarch64 or {}).get("instructions") or {}).get("reference_cpu")


def _fewest_instructions(passed: list[ArtifactResult], cpu: str) -> ArtifactResult:
    """The pick by count on `cpu`: the lowest count of each runtime, then, where runtimes come within COUNT_TIE of
    the lowest, the x86 p50 among those (then size, then name)."""
    best: dict[str, ArtifactResult] = {}
    for a in sorted(passed, key=lambda a: (_count(a, cpu), _size(a), a.name)):
        best.setdefault(_app_runtime(a), a)
    lowest = min(_count(a, cpu) for a in best.values())
    close = [a for a in best.values() if _count(a, cpu) <= COUNT_TIE * lowest]
    if len(close) == 1:
        return close[0]
    return min(close, key=lambda a: (_p50(a), _count(a, cpu), _size(a), a.name))


def _size(a: ArtifactResult) -> float:
    return a.size_bytes or float("inf")


def _refused_by_design(artifact: ArtifactResult) -> bool:
    """The format (or the task's graph) cannot take this model at all: refused by design, no runtime needed."""
    return Kind.NOT_MADE in kinds(artifact.reasons)


def choose(doc: Manifest) -> dict:
    """{"passed": names, "ranked_by": what "fastest" was decided by, "fastest": its ArtifactResult or None,
    "smallest": its ArtifactResult or None, "failed": names, "unavailable": names (no runtime here), "not_made":
    names (the format cannot take this model)}; ties go to the other measure, then to the name."""
    passed = [a for a in doc.artifacts if a.status is Status.PASSED]
    cpu = reference_cpu(doc)
    by_count = bool(passed) and cpu is not None and all(_count(a, cpu) for a in passed)
    return {
        "passed": [a.name for a in passed],
        "ranked_by": f"instructions on {cpu}" if by_count else "x86 latency",
        "fastest": _fewest_instructions(passed, cpu)
        if by_count
        else min(
            (a for a in passed if _p50(a) != float("inf")), key=lambda a: (_p50(a), _size(a), a.name), default=None
        ),
        "smallest": min((a for a in passed if a.size_bytes), key=lambda a: (_size(a), _p50(a), a.name), default=None),
        "failed": [a.name for a in doc.artifacts if a.status is Status.FAILED],
        "unavailable": [a.name for a in doc.artifacts if a.status is Status.UNAVAILABLE and not _refused_by_design(a)],
        "not_made": [a.name for a in doc.artifacts if a.status is Status.UNAVAILABLE and _refused_by_design(a)],
    }


def _app_runtime(artifact: ArtifactResult | None) -> str:
    spec = FORMATS.get(artifact.format) if artifact else None
    return spec.app_runtime if spec else ""


def runtime_needed(fastest: ArtifactResult | None, smallest: ArtifactResult | None) -> str:
    """What the app links to run the pick, as a sentence ("" when no format of the pick declares one)."""
    on_fastest, on_smallest = _app_runtime(fastest), _app_runtime(smallest)
    if on_fastest == on_smallest or not (on_fastest and on_smallest):
        runtime = on_fastest or on_smallest
        return f" The app then needs {runtime}." if runtime else ""
    return f" The app then needs {on_fastest} for the fastest, {on_smallest} for the smallest."


def line(doc: Manifest, markdown: bool = False) -> str:
    """One sentence for the target of `doc`, e.g. "Ship for android: executorch_int8, the fastest (p50 1.20 ms)
    and the smallest (2.41 MB) of the 2 that passed. The app then needs the ExecuTorch runtime (XNNPACK backend)."
    Every artifact of the target competes, whichever runtime runs it (on android the .pte and the .tflite).
    Artifact names in backticks when `markdown`."""
    pick, target = choose(doc), doc.target["name"]
    code = (lambda n: f"`{n}`") if markdown else (lambda n: n)
    unvalidated = (
        f" Not validated on this host (runtime unavailable): {', '.join(map(code, pick['unavailable']))}."
        if pick["unavailable"]
        else ""
    )
    if pick["not_made"]:
        unvalidated += f" Not made for this model (the notes say why): {', '.join(map(code, pick['not_made']))}."
    if not pick["passed"]:
        failed = f"{len(pick['failed'])} failed" if pick["failed"] else "none was validated"
        return f"Nothing to ship for {target}: no artifact passed ({failed}).{unvalidated}"
    fastest, smallest, count = pick["fastest"], pick["smallest"], len(pick["passed"])
    speed = _speed(fastest, reference_cpu(doc) if pick["ranked_by"] != "x86 latency" else None)
    mb = f"{smallest.size_bytes / 1e6:.2f} MB" if smallest else None
    unvalidated = runtime_needed(fastest, smallest) + unvalidated
    if fastest and smallest and fastest is smallest:
        if count == 1:
            return f"Ship for {target}: {code(fastest.name)}, the only one that passed ({speed}, {mb}).{unvalidated}"
        return (
            f"Ship for {target}: {code(fastest.name)}, the fastest ({speed}) and the smallest ({mb}) "
            f"of the {count} that passed.{unvalidated}"
        )
    parts = [
        f"fastest {code(fastest.name)} ({speed})" if fastest else "fastest: none was timed on this host",
        f"smallest {code(smallest.name)} ({mb})" if smallest else "smallest: no size recorded",
    ]
    return f"Ship for {target} ({count} passed): {'; '.join(parts)}.{unvalidated}"


def recommendation(doc: Manifest) -> Recommendation:
    """The pick as the manifest records it (`recommended`): the fastest that passed, what it was ranked by, the
    smallest that passed, and `line`'s sentence, the one the reports show (`shown`)."""
    pick = choose(doc)
    named = lambda artifact: artifact.name if artifact else None  # noqa: E731
    return Recommendation(named(pick["fastest"]), pick["ranked_by"], named(pick["smallest"]), line(doc))


def shown(doc: Manifest, markdown: bool = False) -> str:
    """The "Ship for" sentence a report shows for the manifest `doc`: its `recommended.why` (computed by
    `line` when the build finished; `line` itself for a manifest without one), artifact names in backticks when
    `markdown`."""
    why = doc.recommended.why if doc.recommended is not None else None
    if why is None:
        return line(doc, markdown)
    if not markdown:
        return why
    names = sorted({a.name for a in doc.artifacts}, key=len, reverse=True)
    if not names:
        return why
    pattern = re.compile(r"(?<![\w`])(" + "|".join(map(re.escape, names)) + r")(?![\w`])")
    return pattern.sub(r"`\1`", why)


def _speed(fastest: ArtifactResult | None, cpu: str | None) -> str | None:
    """What made the pick the fastest: its count on the reference core (with its x86 p50 beside), or its x86 p50."""
    if not fastest:
        return None
    p50 = fastest.latency_ms.p50 if fastest.latency_ms is not None else None
    x86 = f"p50 {p50:.2f} ms" if p50 is not None else "x86 p50 not measured"
    if p50 is not None and not (fastest.latency_conditions or {}).get("reliable", True):
        x86 += ", unreliable (see the latency notes)"
    if cpu is None:
        return x86
    return (
        f"{_count(fastest, cpu) / 1e6:.2f} M emulated instructions per inference on {cpu}, ranked by count; x86 {x86}"
    )
