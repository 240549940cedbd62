"""Which artifact to ship, per target: the fastest that passed (p50) and the smallest that passed (bytes).

Only measured numbers count and only artifacts that passed: one without a latency (not timed on this host)
can be the smallest but never the fastest; a failed or unvalidated (unavailable) one is never picked."""

from __future__ import annotations

from ..formats import FORMATS
from ..results import Kind, kinds


def _p50(a: dict) -> float:
    p50 = (a.get("latency_ms") or {}).get("p50")
    return float("inf") if p50 is None else p50


def _size(a: dict) -> float:
    return a.get("size_bytes") or float("inf")


def _refused_by_design(artifact: dict) -> bool:
    """The format (or the task's graph) cannot take this model at all: refused by design, no runtime needed."""
    return Kind.NOT_MADE in kinds(artifact.get("reasons"))


def choose(doc: dict) -> dict:
    """{"passed": names, "fastest": artifact or None, "smallest": artifact or None, "failed": names,
    "unavailable": names (no runtime here), "not_made": names (the format cannot take this model)}; ties go to the
    other measure, then to the name."""
    passed = [a for a in doc["artifacts"] if a["status"] == "passed"]
    return {
        "passed": [a["name"] for a in passed],
        "fastest": min(
            (a for a in passed if _p50(a) != float("inf")), key=lambda a: (_p50(a), _size(a), a["name"]), default=None
        ),
        "smallest": min(
            (a for a in passed if a.get("size_bytes")), key=lambda a: (_size(a), _p50(a), a["name"]), default=None
        ),
        "failed": [a["name"] for a in doc["artifacts"] if a["status"] == "failed"],
        "unavailable": [
            a["name"] for a in doc["artifacts"] if a["status"] == "unavailable" and not _refused_by_design(a)
        ],
        "not_made": [a["name"] for a in doc["artifacts"] if a["status"] == "unavailable" and _refused_by_design(a)],
    }


def _app_runtime(artifact: dict | None) -> str:
    spec = FORMATS.get(artifact["format"]) if artifact else None
    return spec.app_runtime if spec else ""


def runtime_needed(fastest: dict | None, smallest: dict | None) -> str:
    """What the app links to run the pick, as a sentence ("" when no format of the pick declares one)."""
    on_fastest, on_smallest = _app_runtime(fastest), _app_runtime(smallest)
    if on_fastest == on_smallest or not (on_fastest and on_smallest):
        runtime = on_fastest or on_smallest
        return f" The app then needs {runtime}." if runtime else ""
    return f" The app then needs {on_fastest} for the fastest, {on_smallest} for the smallest."


def line(doc: dict, markdown: bool = False) -> str:
    """One sentence for the target of `doc`, e.g. "Ship for android: executorch_int8, the fastest (p50 1.20 ms)
    and the smallest (2.41 MB) of the 2 that passed. The app then needs the ExecuTorch runtime (XNNPACK backend)."
    Every artifact of the target competes, whichever runtime runs it (on android the .pte and the .tflite).
    Artifact names in backticks when `markdown`."""
    pick, target = choose(doc), doc["target"]["name"]
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
    speed = f"p50 {fastest['latency_ms']['p50']:.2f} ms" if fastest else None
    if fastest and not (fastest.get("latency_conditions") or {}).get("reliable", True):
        speed += ", timed on a busy host: unreliable"
    mb = f"{smallest['size_bytes'] / 1e6:.2f} MB" if smallest else None
    unvalidated = runtime_needed(fastest, smallest) + unvalidated
    if fastest and smallest and fastest is smallest:
        if count == 1:
            return f"Ship for {target}: {code(fastest['name'])}, the only one that passed ({speed}, {mb}).{unvalidated}"
        return (
            f"Ship for {target}: {code(fastest['name'])}, the fastest ({speed}) and the smallest ({mb}) "
            f"of the {count} that passed.{unvalidated}"
        )
    parts = [
        f"fastest {code(fastest['name'])} ({speed})" if fastest else "fastest: none was timed on this host",
        f"smallest {code(smallest['name'])} ({mb})" if smallest else "smallest: no size recorded",
    ]
    return f"Ship for {target} ({count} passed): {'; '.join(parts)}.{unvalidated}"
