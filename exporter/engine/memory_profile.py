"""Per artifact, how much RAM it needs and where its time goes (issue 20, "see it"): the format's optional
`memory(path, input_shape, threads)` (a .pte's planned memory and constants; the peak resident memory of a
fresh process running it) and `profile(path, example, runs, threads)` (top operators by time from the runtime's
own profiler, in a session of its own after validation: it never touches the timed runs).

Recorded as the manifest entry's `memory` and `profile`; cached by the artifact's bytes, the tools, the threads
and the CPU. Neither decides the status: a measurement that fails is recorded with its reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import hostload
from ..formats import FORMATS
from ..results import ArtifactResult, Memory, Profile, texts
from . import cache

if TYPE_CHECKING:
    from .context import BuildContext

VERSION = 2  # bump when what is measured changes
PROFILE_RUNS = 10  # profiled inferences after one warm-up, at most...
# ...and fewer where one takes long: about this much inference in all, at least one run (RegNetY-128GF's .pte,
# 13.6 s a run: its memory and profile step took 944 s of a 5400-s sweep build, on a busy host).
PROFILE_BUDGET_MS = 10_000.0


def _unavailable(reason: str) -> dict:
    return {"available": False, "reason": reason}


def _reason(entry: ArtifactResult, fmt) -> str | None:
    """Why this artifact gets no measurement here, or None."""
    elsewhere = FORMATS[entry.format].runs_only_on
    if elsewhere:
        return f"{elsewhere}: not measured on this host"
    if not entry.ran_here():
        return "not run on this host: " + "; ".join(texts(entry.reasons) or ["no artifact"])
    if fmt is None or fmt.memory is None:
        return f"{entry.format} has no memory measurement"
    return None


def _measure(what: str, function, *args) -> dict:
    try:
        return {"available": True, **function(*args)} if what == "memory" else function(*args)
    except Exception as e:  # a finding, never a crash: the artifact itself was validated
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return _unavailable(f"{what} not measured: {type(e).__name__}: {first}")


def measure(session: BuildContext, entry: ArtifactResult) -> None:
    """entry.memory and entry.profile, from the cache when this artifact was measured before."""
    fmt = FORMATS[entry.format].format() if FORMATS[entry.format].installed() else None
    reason = _reason(entry, fmt)
    if reason is not None:
        entry.update(memory=_unavailable(reason), profile=_unavailable(reason))
        return
    threads = session.latency["threads"]
    example = session.fed_to(entry.format).validation[:1]
    # not keyed on the runs (from a measured latency: a key that moved with it would measure memory again)
    digest = cache.key(
        kind="memory_profile",
        version=VERSION,
        artifact=entry.sha256,
        threads=threads,
        shape=list(example.shape),
        **({"dtype": "uint8"} if example.dtype == torch.uint8 else {}),
        cpu=session_cpu(session),
        tools=session.digests["tools"],
    )
    cached = session.cache.fetch_json("memory", digest)
    if cached is not None:
        entry.update(cached)
        session.cache.events.append(f"{entry.name}: memory and profile reused from the cache")
        return
    path = session.out / entry.path
    with session.progress.step(f"{session.prefix}memory and profile {entry.name}"):
        pixels = ["uint8"] if example.dtype == torch.uint8 else []  # a uint8-nhwc input; float32 by default
        entry.memory = Memory.from_json(_measure("memory", fmt.memory, path, tuple(example.shape), threads, *pixels))
        if fmt.profile is not None:
            with hostload.Window() as window:
                profile = _measure("profile", fmt.profile, path, example, profile_runs(entry), threads)
            if profile.get("available"):  # its times are wall clock: a busy host stretches them
                profile["conditions"] = hostload.judged(window.conditions, threads)
            entry.profile = Profile.from_json(profile)
        else:
            entry.profile = Profile.from_json(_unavailable(f"{entry.format} has no profiler here"))
    torch.set_num_threads(threads)  # a runtime's profiler may have changed torch's; eager is timed with these
    # a profile taken on a busy host is measured again by the next build, as a latency is
    if entry.memory.available and entry.profile.available and (entry.profile.conditions or {}).get("reliable", True):
        session.cache.store_json("memory", digest, {"memory": entry.memory, "profile": entry.profile})


def profile_runs(entry: ArtifactResult) -> int:
    """How many inferences to profile: PROFILE_RUNS, or as many as fit PROFILE_BUDGET_MS at the artifact's
    validated latency (at least one)."""
    p50 = entry.latency_ms.p50 if entry.latency_ms else None
    if not p50 or p50 <= 0:
        return PROFILE_RUNS
    return max(1, min(PROFILE_RUNS, int(PROFILE_BUDGET_MS // p50)))


def session_cpu(session: BuildContext) -> str:
    """The host's CPU model, as the validation cache keys on it (times and kernels depend on it)."""
    from ..release import manifest

    return manifest.host(session.latency["threads"])["cpu"]
