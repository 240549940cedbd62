"""Whole-build records: an unchanged re-run restores the earlier build's files, without torch.

The key covers the request (paths made absolute), the resolved target profiles, the tool versions,
which format packages are installed, the exporter's own source and the host. The record lists the
input files the build read (checkpoint, labels, every file of the data folder) with their sha256,
checked again at every lookup, and the files the build wrote, stored by content under blobs/. A build whose
latency (an artifact's, or the eager baseline every speedup divides) was timed on a busy host (exporter.hostload judged
it unreliable) is not recorded: the next run times it again.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import stat
import sys
from pathlib import Path

from rich.markup import escape

from .. import files
from ..release import html_report, manifest, report
from ..results import ArtifactResult, Kind, Manifest, kinds
from . import cache, default_out
from .cache import BuildCache
from ..formats import FORMATS
from ..progress import Progress

# where and whether, not what; `offline` only forbids fetching a missing checkpoint, and a record is
# replayed only when the checkpoint it read is still there, unchanged, so it never needs the network
NOT_KEYED = ("out", "force", "cache", "cache_dir", "target", "offline")
RENDERED = ("manifest.json", "report.md", "report.html")  # written afresh at every restore
# outcomes a converter's or a runtime's crash (or a full disk) may not repeat: a build with one is not replayed
UNSETTLED = {Kind.EXPORT_FAILED, Kind.DISK_FULL, Kind.DOES_NOT_LOAD, Kind.DOES_NOT_RUN}


def _absolute(value):
    return str(Path(value).absolute()) if isinstance(value, Path) else value


def _request_fields(request) -> dict:
    fields = dataclasses.asdict(request)
    return {k: _absolute(v) for k, v in fields.items() if k not in NOT_KEYED}


def _environment() -> dict:
    gpus = Path("/proc/driver/nvidia/gpus")
    return {
        "tools": manifest.tool_versions(),
        "installed": {name: spec.installed() for name, spec in FORMATS.items()},
        "exporter_source": cache.source_digest(),
        "host": {k: v for k, v in manifest.host(0).items() if k != "threads"},
        "gpus": sorted(os.listdir(gpus)) if gpus.is_dir() else [],
        # where torch looks for hub checkpoints when no --checkpoint is given
        "hub": [os.environ.get(k) for k in ("TORCH_HOME", "XDG_CACHE_HOME")],
    }


def _tree(directory: Path, known: dict | None = None) -> dict:
    """relative path -> [size, mtime_ns, sha256] of every file; a file whose size and mtime match
    `known` keeps its recorded hash (as git's index does), any other is hashed. Folders are listed too
    ("name/" -> [0, 0, "folder"]): an ImageFolder's classes are its sorted folder names, an empty one included."""
    listing = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_dir()):
        listing[path.relative_to(directory).as_posix() + "/"] = [0, 0, "folder"]
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel, st = path.relative_to(directory).as_posix(), path.stat()
        seen = (known or {}).get(rel)
        same = seen is not None and seen[:2] == [st.st_size, st.st_mtime_ns]
        listing[rel] = [st.st_size, st.st_mtime_ns, seen[2] if same else files.sha256(path)]
    return listing


def _inputs(request, docs: list[Manifest]) -> dict:
    checkpoint, reference = docs[0].checkpoint, docs[0].eager.reference
    read = {checkpoint.path: checkpoint.sha256}
    if reference is not None and reference.checkpoint is not None:  # a quantized weight's float model
        read[reference.checkpoint.path] = reference.checkpoint.sha256
    if request.labels:
        read[str(Path(request.labels).absolute())] = files.sha256(request.labels)
    trees = {str(Path(request.data).absolute()): _tree(Path(request.data))} if request.data else {}
    # a float model looked for and not found: once it is there, the build validates against it instead
    absent = [reference.looked_for] if reference is not None and reference.looked_for else []
    return {"files": read, "trees": trees, "absent": absent}


def _inputs_unchanged(recorded: dict) -> bool:
    for path, digest in recorded["files"].items():
        if not Path(path).is_file() or files.sha256(path) != digest:
            return False
    if any(Path(path).exists() for path in recorded.get("absent", [])):
        return False
    for directory, listing in recorded["trees"].items():
        if not Path(directory).is_dir():
            return False
        now = _tree(Path(directory), listing)
        if {k: v[2] for k, v in now.items()} != {k: v[2] for k, v in listing.items()}:
            return False
    return True


def _written(doc: Manifest) -> list[str]:
    """The files a build wrote into its directory (as its manifest describes them), less those rendered at restore."""
    names = [n for n in manifest.BUILD_FILES if n not in RENDERED] + [
        *manifest.BUILD_FOLDERS,
        *(doc.jetson or {}).get("sha256", {}),
    ]
    names += [a.path for a in doc.artifacts if a.path]
    names += [a.bundled_program.path for a in doc.artifacts if a.bundled_program]
    code = ((doc.task or {}).get("decode") or {}).get("code")  # a task's device files (detection's decode)
    reference = ((doc.preprocessing or {}).get("reference") or {}).get("file")  # an image task's resize
    return list(dict.fromkeys(names + [name for name in (code, reference) if name]))


def _files_under(directory: Path, names: list[str]) -> list[Path]:
    found = []
    for name in names:
        path = directory / name
        found += (
            sorted(p for p in path.rglob("*") if p.is_file())
            if path.is_dir()
            else [path, *files.companions(path)]
            if path.is_file()
            else []
        )
    return found


def _unsettled(artifact: ArtifactResult) -> bool:
    """Whether the artifact's outcome is a crash that may not happen again: its export, load or run on this host
    failed (an emulated CPU's verdict stands), or its golden program could not be made."""
    golden = (artifact.details or {}).get("golden_program")
    return any(r.kind in UNSETTLED and r.cpu is None for r in artifact.reasons) or (
        Kind.BUNDLED_PROGRAM_FAILED in kinds([golden] if golden else [])
    )


def _unsettled_timing(docs: list[Manifest]) -> bool:
    """Whether the build's eager baseline, or any artifact's latency or operator profile, was judged unreliable
    (exporter.hostload: timed on a busy host)."""
    baselines = [doc.eager.latency.conditions for doc in docs if doc.eager.latency is not None]
    return not all(b.get("reliable", True) for b in baselines) or any(
        not (a.latency_conditions or {}).get("reliable", True)
        or not ((a.profile.conditions if a.profile else None) or {}).get("reliable", True)
        for doc in docs
        for a in doc.artifacts
    )


def _counts_missing(docs: list[Manifest]) -> bool:
    """Whether a build counted instructions only in part: the counter unavailable then, a program whose count failed
    (the emulated process died or timed out), or an aarch64 row left without counts. A later build may count them."""
    for doc in docs:
        counts = (doc.aarch64 or {}).get("instructions")
        if counts is None:
            continue
        if "unavailable" in counts or counts.get("failed"):
            return True
        if any(row.instructions is None for entry in doc.artifacts for row in entry.aarch64 or []):
            return True
    return False


class BuildRecord:
    def __init__(self, cache_root: Path, request, profiles: list[dict]):
        self.cache_root = Path(cache_root)
        self.request = request
        self.cache = BuildCache(self.cache_root)
        self.profiles = profiles  # each target's, with the request's overrides
        self.key = self._key()

    def _key(self) -> str:
        return cache.key(
            kind="build", request=_request_fields(self.request), plans=self.profiles, environment=_environment()
        )

    def _blob(self, digest: str) -> Path:
        return self.cache_root / "blobs" / digest[:2] / digest

    def _outs(self, base: Path, targets: list[str]) -> list[Path]:
        return [base] if len(targets) == 1 else [base / t for t in targets]

    def restore(self, progress: Progress) -> list[dict] | None:
        """The earlier build's manifests, with its files restored into --out; None when there is none."""
        record = self.cache.fetch_json("builds", self.key)
        recorded = [Manifest.from_json(doc) for doc in record["docs"]] if record is not None else []
        if record is None or _unsettled_timing(recorded) or _counts_missing(recorded):
            return None
        if not _inputs_unchanged(record["inputs"]):
            return None
        base = Path(self.request.out or default_out(recorded[0].weight.name, record["targets"]))
        outs = self._outs(base, record["targets"])
        for out in dict.fromkeys([base, *outs]):
            files.check_out_dir(out, self.request.force)
        with progress.step("restore the identical earlier build from the cache"):
            written = record["files"]
            if any(
                not self._blob(f["sha256"]).is_file() or files.file_sha256(self._blob(f["sha256"])) != f["sha256"]
                for f in written.values()
            ):
                return None  # a blob went missing or was damaged: build again, which stores it anew
            for out in outs:
                if out.is_dir():
                    manifest.clear_build_files(out)
            # a graph before its external data: writing a file clears companions it was not written with
            for rel, f in sorted(written.items(), key=lambda item: item[0].endswith(files.COMPANION_SUFFIXES)):
                target = base / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with files.atomic_path(target) as tmp:
                    shutil.copyfile(self._blob(f["sha256"]), tmp)
                    if f["executable"]:
                        tmp.chmod(0o755)
            docs, typed = record["docs"], []
            for doc, out in zip(docs, outs):
                built = doc["created"]
                doc.update(
                    created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    command=list(sys.argv),
                    exporter_commit=manifest.exporter_commit(),
                )
                doc["cache"] = {
                    "root": str(self.cache_root),
                    "events": [
                        f"whole build reused from the cache (record {self.key[:12]}, built {built}): checkpoint, "
                        "data, labels, target profile, tool versions, exporter code and host unchanged"
                    ],
                    "build_record": self.key,
                }
                manifest.write(out, doc)
                typed.append(Manifest.from_json(doc))
                files.write_text(out / "report.md", report.markdown(typed[-1]))
                files.write_text(out / "report.html", html_report.render([typed[-1]], [out]))
            if len(outs) > 1:
                files.write_text(base / "report.html", html_report.render(typed, outs))
        return docs

    def store(self, base: Path, docs: list[dict], progress: Progress | None = None) -> None:
        """Records the build whose manifests (JSON, as written) are `docs`, its files stored by content."""
        typed = [Manifest.from_json(doc) for doc in docs]
        if any(_unsettled(a) for doc in typed for a in doc.artifacts):
            return  # a crash in a converter or a runtime may not happen again; only settled outcomes are replayed
        if _unsettled_timing(typed):
            return  # latency or a profile timed on a busy host is not settled: the next run times it again
        if self._key() != self.key:
            return  # tools or exporter code changed while it built: the result belongs to neither key
        targets = [doc.target["name"] for doc in typed]
        written = {}
        earlier_events, new_blobs = len(self.cache.events), []
        with self.cache.unless_disk_full("this build, for an unchanged re-run,"):
            for doc, out in zip(typed, self._outs(base, targets)):
                for path in _files_under(out, _written(doc)):
                    digest = files.file_sha256(path)  # one blob per file: a graph and its external data apart
                    blob = self._blob(digest)
                    if not blob.is_file():
                        blob.parent.mkdir(parents=True, exist_ok=True)
                        with files.atomic_path(blob) as tmp:
                            shutil.copyfile(path, tmp)
                        new_blobs.append(blob)
                    executable = bool(path.stat().st_mode & stat.S_IXUSR)
                    written[path.relative_to(base).as_posix()] = {"sha256": digest, "executable": executable}
            self.cache.store_json(
                "builds",
                self.key,
                {
                    "inputs": _inputs(self.request, typed),
                    "targets": targets,
                    "files": written,
                    "docs": docs,
                },
            )
        given_up = self.cache.events[earlier_events:]
        for blob in new_blobs if given_up else ():  # no record names them: they would only fill the disk
            blob.unlink(missing_ok=True)
        for event in given_up if progress else ():  # the manifests are written already
            progress.note(f"[yellow]–[/yellow] {escape(event)}")
