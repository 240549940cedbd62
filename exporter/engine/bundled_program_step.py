"""Each `.pte`'s ExecuTorch golden program (`.bpte`, exporter.formats.bundled_program): written beside it after
its x86 validation, with the golden inputs, the `.pte`'s own outputs for them and tolerances derived from its
measured distance to eager there; verified here with ExecuTorch's verifier (and on each aarch64 CPU by
validate_on_arm). A `.bpte` that does not verify fails its artifact: the app's self-test would fail the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .. import files
from ..formats import bundled_program
from ..results import ArtifactResult, BundledProgram, Kind, Reason, Status
from . import cache

if TYPE_CHECKING:
    from .context import BuildContext

FORMAT = "executorch"
FAILED = "not made, it failed: "  # its note (Kind.BUNDLED_PROGRAM_FAILED): not replayed from the whole-build record
FLATBUFFER_LIMIT = 2**31  # bytes: a flatbuffer's offsets are signed 32-bit, and a .bpte embeds its whole program


def wanted(entry: ArtifactResult) -> bool:
    return entry.format == FORMAT and entry.ran_here()


def add_golden_program(session: BuildContext, entry: ArtifactResult) -> None:
    """Write the entry's `.bpte` (from the cache when the same one was made before), verify it on this host and
    record it as entry.bundled_program."""
    if not wanted(entry):
        return
    entry.details.pop("golden_program", None)  # a note from an earlier run (exporter validate runs it again)
    pte = session.out / entry.path
    size = pte.stat().st_size
    if size >= FLATBUFFER_LIMIT:  # measured: RegNetY-128GF's 2.6 GB fp32 .pte, BuilderSizeError
        entry.details["golden_program"] = Reason(
            Kind.NOTE,
            f"not made: the program is {size / 2**30:.2f} GiB, and a bundled program embeds it in one flatbuffer, "
            f"which holds under 2 GiB (the .pte itself keeps its weights in segments outside its flatbuffer)",
        )
        return
    bpte = pte.with_suffix(bundled_program.SUFFIX)
    try:
        details = _write_bpte(session, entry, pte, bpte)
    except (RuntimeError, OSError, MemoryError, ValueError) as e:  # ExecuTorch's, as the 2 GiB limit: the .pte stands
        first = (str(e).strip().splitlines() or [""])[0][:300]
        entry.details["golden_program"] = Reason(Kind.BUNDLED_PROGRAM_FAILED, f"{FAILED}{type(e).__name__}: {first}")
        session.progress.note(f"{session.prefix}golden program {bpte.name} {FAILED}{type(e).__name__}: {first}")
        return
    verified = bundled_program.verify(bpte, details["rtol"], details["atol"])
    entry.bundled_program = BundledProgram.from_json({**details, "verified": {"x86_64": verified}})
    if not verified["passed"]:
        entry.status = Status.FAILED
        entry.reasons = [
            *entry.reasons,
            Reason(
                Kind.BUNDLED_PROGRAM_FAILED,
                f"golden program {bpte.name} fails ExecuTorch's verifier on this host: {verified['error']}",
            ),
        ]


def _write_bpte(session: BuildContext, entry: ArtifactResult, pte: Path, bpte: Path) -> dict:
    """The .bpte written (or fetched from the cache): its details."""
    rows = session.golden_rows
    digest = cache.key(
        kind="bundled_program",
        artifact=entry.sha256,
        golden=rows,
        **{k: session.digests[k] for k in ("validation", "tools", "checkpoint", "reference", "task")},
    )
    with session.progress.step(f"{session.prefix}golden program {bpte.name}"):
        with files.atomic_path(bpte) as tmp:
            details = session.cache.fetch_artifact(digest, tmp)
            if details is None:
                golden = session.fed_to(entry.format).validation[rows]
                expected = bundled_program.outputs(pte, golden)
                first = [outputs[0].reshape(1, -1) for outputs in expected]  # what validation compares to eager
                import torch

                measured = bundled_program.tolerances(torch.cat(first), session.reference[rows])
                details = bundled_program.write(
                    pte,
                    golden,
                    expected,
                    measured["rtol"],
                    measured["atol"],
                    tmp,
                    dynamic_size="dynamic_size" in entry.details,
                )
                details.update(
                    path=bpte.name, tolerances={k: measured[k] for k in ("max_abs_gap", "output_scale", "rule")}
                )
                session.cache.store_artifact(digest, tmp, details)
            else:
                session.cache.events.append(f"{entry.name}: golden program reused from the cache")
    return details
