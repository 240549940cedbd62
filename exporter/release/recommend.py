"""Which artifact to ship, per target: the fastest that passed and the smallest that passed (bytes), and why each
other artifact was not picked.

"Fastest" is the fewest emulated instructions per inference on the profile's reference core where every artifact
that passed was counted there (`[validate] reference_cpu`, an out-of-order core: the device's ISA, and the same
count on a quiet or a busy host), else the x86 p50. Counts rank exactly within one runtime; between runtimes a
difference under COUNT_TIE is a tie (measured: cross-engine counts are off by up to 1.8x on the same phone table,
docs/benchmarks.md), which fidelity to eager (PSNR) then breaks, then size: not the x86 p50, which says nothing of
an Arm core's fp16 (x86 has no FP16 arithmetic: an fp16 program's p50 there was 3.6x its fp32's).

Only measured numbers count and only artifacts that passed: one without a latency (not timed on this host)
can be the smallest but never the fastest; a failed or unvalidated (unavailable) one is never picked. A profile's
`[validate] must_run_on` names the cores an app must run on: an artifact not passed on each of them, or made for
what one of them lacks (an fp16 program on a core without FP16 arithmetic), is not picked either."""

from __future__ import annotations

import re

from ..formats import FORMATS
from ..results import ArtifactResult, Kind, Manifest, Recommendation, Status, kinds, texts


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


def _psnr(a: ArtifactResult) -> float:
    value = (a.fidelity or {}).get("psnr_db")
    return float(value) if isinstance(value, (int, float)) else float("-inf")


def _lowest_per_runtime(passed: list[ArtifactResult], cpu: str) -> dict[str, ArtifactResult]:
    best: dict[str, ArtifactResult] = {}
    for a in sorted(passed, key=lambda a: (_count(a, cpu), _size(a), a.name)):
        best.setdefault(_app_runtime(a), a)
    return best


def _fewest_instructions(passed: list[ArtifactResult], cpu: str) -> ArtifactResult:
    """The pick by count on `cpu`: the lowest count of each runtime, then, where runtimes come within COUNT_TIE of
    the lowest, the closest to eager among those (PSNR; then size, then name)."""
    best = _lowest_per_runtime(passed, cpu)
    lowest = min(_count(a, cpu) for a in best.values())
    close = [a for a in best.values() if _count(a, cpu) <= COUNT_TIE * lowest]
    return min(close, key=lambda a: (-_psnr(a), _size(a), a.name))


def must_run_on(doc: Manifest) -> tuple[str, ...]:
    return tuple((doc.target.get("validate") or {}).get("must_run_on") or ())


def _cannot_serve(artifact: ArtifactResult, cores: tuple[str, ...]) -> str | None:
    """Why an app that must run on `cores` cannot ship `artifact` (None: it can)."""
    rows = {row.cpu: row for row in artifact.aarch64 or []}
    for cpu in cores:
        row = rows.get(cpu)
        if row is None:
            return f"not validated on {cpu}, which the app must run on"
        if row.status is not Status.PASSED:
            return f"failed on {cpu}, which the app must run on: {'; '.join(texts(row.reasons))}"
        if row.lacks:
            return f"not for {cpu}, which the app must run on: {row.lacks}"
    return None


def _size(a: ArtifactResult) -> float:
    return a.size_bytes or float("inf")


def _refused_by_design(artifact: ArtifactResult) -> bool:
    """The format (or the task's graph) cannot take this model at all: refused by design, no runtime needed."""
    return Kind.NOT_MADE in kinds(artifact.reasons)


def choose(doc: Manifest) -> dict:
    """{"passed": names (that can serve every core of must_run_on), "excluded": {name: why} (passed, but cannot),
    "ranked_by": what "fastest" was decided by, "fastest": its ArtifactResult or None, "smallest": its
    ArtifactResult or None, "failed": names, "unavailable": names (no runtime here), "not_made": names (the format
    cannot take this model)}; ties go to the other measure, then to the name."""
    cores = must_run_on(doc)
    excluded = {a.name: why for a in doc.artifacts if a.status is Status.PASSED and (why := _cannot_serve(a, cores))}
    passed = [a for a in doc.artifacts if a.status is Status.PASSED and a.name not in excluded]
    cpu = reference_cpu(doc)
    by_count = bool(passed) and cpu is not None and all(_count(a, cpu) for a in passed)
    return {
        "passed": [a.name for a in passed],
        "excluded": excluded,
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
    if not pick["passed"] and pick["excluded"]:
        cores = ", ".join(must_run_on(doc))
        return f"Nothing to ship for {target}: none of the {len(pick['excluded'])} that passed runs on {cores}."
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


def not_picked(doc: Manifest) -> dict[str, str]:
    """Why each artifact of `doc` other than the picks was not picked, in the manifest's order: it failed (its
    reasons), was not validated or not made, cannot serve a core the app must run on, or costs more than the
    fastest by what "fastest" was ranked by (a tie across runtimes lost on fidelity or size says so)."""
    pick = choose(doc)
    fastest, cpu = pick["fastest"], reference_cpu(doc) if pick["ranked_by"] != "x86 latency" else None
    picked = {a.name for a in (fastest, pick["smallest"]) if a is not None}
    passed = [a for a in doc.artifacts if a.name in pick["passed"]]
    runtime_lowest = set(map(id, _lowest_per_runtime(passed, cpu).values())) if cpu is not None else set()
    why: dict[str, str] = {}
    for a in doc.artifacts:
        if a.name in picked:
            continue
        if a.status is not Status.PASSED:
            kind = "failed" if a.status is Status.FAILED else "not made" if _refused_by_design(a) else "not validated"
            why[a.name] = f"{kind}: {'; '.join(texts(a.reasons)) or a.status}"
        elif a.name in pick["excluded"]:
            why[a.name] = pick["excluded"][a.name]
        elif fastest is None:
            why[a.name] = "not the smallest, and none was timed"
        elif cpu is not None:
            ratio = _count(a, cpu) / _count(fastest, cpu)
            tie = id(a) in runtime_lowest and _app_runtime(a) != _app_runtime(fastest) and ratio <= COUNT_TIE
            why[a.name] = f"{ratio:.2f}x the instructions of {fastest.name} on {cpu}" + (
                f" (a tie across runtimes: {fastest.name} is closer to eager or smaller)" if tie else ""
            )
        else:
            why[a.name] = f"p50 {_p50(a):.2f} ms against {fastest.name}'s {_p50(fastest):.2f} ms on x86"
    return why


def recommendation(doc: Manifest) -> Recommendation:
    """The pick as the manifest records it (`recommended`): the fastest that passed, what it was ranked by, the
    smallest that passed, `line`'s sentence, the one the reports show (`shown`), and why the others were not."""
    pick = choose(doc)
    named = lambda artifact: artifact.name if artifact else None  # noqa: E731
    return Recommendation(
        named(pick["fastest"]), pick["ranked_by"], named(pick["smallest"]), line(doc), not_picked(doc)
    )


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


def not_picked_line(doc: Manifest, markdown: bool = False) -> str | None:
    """The reports' line under "Ship for": why each other artifact was not picked (the manifest's
    `recommended.not_picked`, computed for a manifest written before it), or None when there is none."""
    why = doc.recommended.not_picked if doc.recommended is not None else not_picked(doc)
    if not why:
        return None
    code = (lambda n: f"`{n}`") if markdown else (lambda n: n)
    return "Not picked: " + "; ".join(f"{code(name)}: {reason}" for name, reason in why.items()) + "."


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
