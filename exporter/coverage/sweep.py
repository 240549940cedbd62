"""The sweep itself: for each chosen weight and target, one build in its own process (isolated from crashes
and out-of-memory kills, stopped at the time limit), its cells read from the manifest it wrote, the row
cached, progress on stderr (the build's steps as they finish, then the row's line), and the table rewritten
after every row (so an interrupted sweep leaves a partial table that says so)."""

from __future__ import annotations

import datetime
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import files
from . import memory as build_memory, outcome, rowcache, table, trained
from ..engine import target_refusal
from .select import Candidate, planned_artifacts

WALL_FACTOR = 3  # the CPU time limit's backstop on the wall clock
CLASSIFIER_TASKS = ("classification", "quantization")  # the rows --classifier-size applies to


@dataclass(frozen=True)
class Settings:
    """How each build of the sweep runs. Small on purpose: the sweep asks "does it export and agree", not
    "how fast" (that is `make bench`)."""

    targets: tuple[str, ...] = ("android", "ios", "jetson")
    formats: tuple[str, ...] = ()
    calib_size: int | None = 16  # None: the target's own (the trained tier's labeled digits)
    val_size: int | None = 8
    warmup: int = 1
    iterations: int = 2
    threads: int = 1
    input_size: tuple[int, int] = (
        128,
        128,
    )  # graphs that take one: segmentation, RetinaNet/FCOS, video frames (not classifiers, SSD)
    classifier_size: int | None = None  # classifiers built (and in the trained tier, trained) at this square where
    # their graph takes it (not ViT, MaxViT, Swin: their crop), instead of their weight's crop
    time_limit: float | None = (
        900.0  # CPU seconds per build (weight x target), WALL_FACTOR x on the wall clock; None: none
    )
    weights: str = "random"  # or "digits": each architecture trained on the digits (coverage.trained)
    train_epochs: int = trained.EPOCHS  # the digits tier's training: these epochs, then more while its acc@1
    train_until: float = trained.UNTIL  # on its own training digits is under this, up to train_max_epochs
    train_max_epochs: int = trained.MAX_EPOCHS
    cpus: tuple[str, ...] = ()  # emulated aarch64 CPUs each runnable artifact is validated on too; ("target",): the
    # target's own [validate] cpus; (): this host only

    @property
    def is_trained(self) -> bool:
        return self.weights == "digits"

    @property
    def on_aarch64(self) -> bool:
        return bool(self.cpus)

    def key_parts(self, task: str | None = None) -> dict:
        """What a row of `task` depends on (the time limit only decides whether it finished; the classifier size
        only a classifier's build)."""
        parts = self.describe()
        parts.pop("time_limit")
        parts.pop("targets")
        if task not in CLASSIFIER_TASKS:
            parts.pop("classifier_size", None)
        return parts

    def describe(self) -> dict:
        parts = asdict(self)
        if not self.is_trained:  # the random tier reads as it did before there were tiers (row keys, merges)
            parts.pop("weights")
            for name in ("train_epochs", "train_until", "train_max_epochs"):
                parts.pop(name)
        if not self.on_aarch64:  # as before there were aarch64 rows
            parts.pop("cpus")
        if self.classifier_size is None:  # as before classifiers could be built at another size
            parts.pop("classifier_size")
        return json.loads(json.dumps(parts))


@dataclass
class Sweep:
    settings: Settings
    candidates: list[Candidate]
    json_path: Path
    md_path: Path
    command: str
    selection: dict = field(default_factory=dict)  # the filters, for the table's header
    cache: bool = True
    cache_dir: Path | None = None
    builds_dir: Path | None = None  # keep every build here; default: temporary, removed per weight

    @staticmethod
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def run(self) -> dict:
        from ..release.manifest import tool_versions

        tools = tool_versions()
        if self.settings.on_aarch64:  # set up once, here, where downloads are allowed (the builds run offline)
            from .. import aarch64
            from ..progress import Progress

            self._runners = aarch64.cache_root(self.cache_dir)
            aarch64.prepare(progress=Progress(), root=self._runners)
        started = time.time()
        doc = table.new_document(self.command, self.settings.describe(), self.selection, tools)
        planned = [(c, t) for c in self.candidates for t in self.settings.targets]
        doc["planned_rows"] = len(planned)
        doc["planned"] = table.sorted_keys((c.weight, t) for c, t in planned)
        self._earlier = _earlier_runs(self.json_path, doc)
        rows: list[dict] = []
        cache_root = rowcache.root(self.cache_dir)
        stop = _StopOnSignal()
        n = 0
        try:
            for candidate in _build_order(self.candidates):
                weight_dir = self._weight_dir(candidate)
                try:
                    for target in self.settings.targets:
                        n += 1
                        row = self._row(candidate, target, tools, cache_root, weight_dir, stop)
                        if stop.signalled:  # a build cut short by Ctrl-C or SIGTERM says nothing about the weight
                            raise KeyboardInterrupt
                        rows.append(row)
                        if candidate.refused or candidate.skipped:  # one line for all its targets
                            if target == self.settings.targets[-1]:
                                self.log(_progress_line(n, len(planned), dict(row, target="every target")))
                            continue
                        self.log(_progress_line(n, len(planned), row))
                        doc = self._write(doc, rows, started, complete=False)
                finally:
                    if self.builds_dir is None:
                        shutil.rmtree(weight_dir, ignore_errors=True)
        except KeyboardInterrupt:
            why = "SIGTERM" if stop.signalled else "Ctrl-C (SIGINT)"
            self.log(f"interrupted by {why}: {len(rows)} of {len(planned)} rows done; the table says it is partial")
            return self._write(doc, rows, started, complete=False, interrupted=True)
        finally:
            stop.restore()
        return self._write(doc, rows, started, complete=True)

    def _write(self, doc: dict, rows: list[dict], started: float, complete: bool, interrupted: bool = False) -> dict:
        doc = dict(
            doc,
            rows=table.sorted_rows(rows),
            complete=complete and len(rows) == doc["planned_rows"],
            interrupted=interrupted,
        )
        doc["run"] = {
            "started": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.time() - started, 1),
            "rows_built": sum(1 for r in rows if r.get("built_now")),
            "rows_from_cache": sum(1 for r in rows if r.get("from_cache")),
        }
        if self._earlier:  # this run resumed an interrupted one of the same sweep: its clock counts too
            doc["run"]["earlier_runs"] = self._earlier
            doc["run"]["total_wall_s"] = round(doc["run"]["wall_s"] + sum(r["wall_s"] for r in self._earlier), 1)
        table.write(doc, self.json_path, self.md_path)
        return doc

    def _weight_dir(self, candidate: Candidate) -> Path:
        if self.builds_dir is not None:
            path = Path(self.builds_dir) / candidate.weight
            path.mkdir(parents=True, exist_ok=True)
            return path
        return Path(tempfile.mkdtemp(prefix=f"coverage-{candidate.model}-"))

    def _row(self, candidate: Candidate, target: str, tools: dict, cache_root: Path, weight_dir: Path, stop) -> dict:
        if stop.signalled:
            raise KeyboardInterrupt
        row = {
            "weight": candidate.weight,
            "model": candidate.model,
            "task": candidate.task,
            "params": candidate.params,
            "quantized": candidate.quantized,
            "target": target,
        }
        if candidate.refused:
            return dict(row, outcome="refused", reason=candidate.refused, cells=[], seconds=0.0)
        if candidate.skipped:
            return dict(row, outcome="skipped", reason=candidate.skipped, cells=[], seconds=0.0)
        refusal = target_refusal(candidate.weight, target, self.settings.formats)
        if refusal:  # as `exporter build` refuses it: this target makes none of its artifacts from the weight
            return dict(row, outcome="refused", reason=refusal, cells=[], seconds=0.0)
        key = rowcache.key(candidate.weight, target, self.settings.key_parts(candidate.task), tools)
        input_size = self._input_size(candidate)
        if self.cache:
            cached = rowcache.fetch(cache_root, key, self.settings.time_limit, input_size)
            if cached is not None and cached.get("timed_out") and self.builds_dir is not None:
                cached = None  # built again: it goes on from what its build kept in --builds made (_BuildRuns)
            if cached is not None:
                cached = outcome.reclassify(cached)
                if outcome.floor_wanted(cached):
                    cached["floor"] = self._floor_only(candidate, cached, weight_dir, stop)
                    if not stop.signalled:
                        rowcache.store(cache_root, cached)
                return dict(outcome.reclassify(cached), from_cache=True, built_now=False)
        row = outcome.reclassify(
            dict(
                row,
                key=key,
                input_size=input_size,
                **self._resized(candidate, input_size),
                **self._build(candidate, target, weight_dir, stop),
            )
        )
        row["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if not stop.signalled and _cacheable(row):
            rowcache.store(cache_root, row)
        return dict(row, from_cache=False, built_now=True)

    def _input_size(self, candidate: Candidate) -> list[int] | None:
        """The size the sweep builds the weight at (None in the trained tier at the weights' own crops)."""
        s = self.settings
        if s.is_trained and not s.classifier_size:
            return None
        from . import randomize

        return randomize.built_input_size(candidate.weight, None if s.is_trained else s.input_size, s.classifier_size)

    def _resized(self, candidate: Candidate, input_size: list[int] | None) -> dict:
        """{"classifier_size": the size} for a classifier built at a size other than its weight's crop."""
        from . import randomize

        if candidate.task not in CLASSIFIER_TASKS or not self.settings.classifier_size:
            return {}
        return (
            {"classifier_size": input_size} if input_size != randomize.built_input_size(candidate.weight, None) else {}
        )

    def _spec(self, candidate: Candidate, target: str, weight_dir: Path) -> dict:
        s = self.settings
        return {
            "weight": candidate.weight,
            "task": candidate.task,
            "target": target,
            "formats": list(s.formats),
            "calib_size": s.calib_size,
            "val_size": s.val_size,
            "warmup": s.warmup,
            "iterations": s.iterations,
            "threads": s.threads,
            "input_size": list(s.input_size) if s.input_size else None,
            "classifier_size": s.classifier_size,
            "checkpoints": str(weight_dir / "checkpoints"),
            "build_cache": str(weight_dir / "cache"),
            "out": str(weight_dir / target),
            "result": str(weight_dir / f"{target}.result.json"),
            "weights": s.weights,
            "train_epochs": s.train_epochs,
            "train_until": s.train_until,
            "train_max_epochs": s.train_max_epochs,
            "trained": str(trained.directory(self.cache_dir)),
            "cpu_limit_s": s.time_limit,
            "aarch64_cpus": [c for c in s.cpus if c != "target"] if s.on_aarch64 else None,
            "aarch64_runners": str(self._runners) if s.on_aarch64 else None,
        }

    def _run_worker(
        self, spec: dict, weight_dir: Path, stop
    ) -> tuple[subprocess.Popen, str | None, float, Path, dict | None]:
        """One worker process on `spec`, under the time limit; (process, what stopped it at the limit: "cpu",
        "wall" or None, seconds, log path, its memory last sampled: exporter.coverage.memory). The limit is the
        worker's CPU time (RLIMIT_CPU, set by the worker), so that builds sharing a busy host are not stopped where
        a quiet host finishes them (Swin-V2-B's android build: ⏱ at 1800 s of wall clock with three sweeps on two
        cores, 1368 s with two); the wall clock stops a build starved or blocked for WALL_FACTOR times the limit."""
        s = self.settings
        name = spec["target"] + (".floor" if spec.get("floor_only") else "")
        spec_path = weight_dir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=2))
        Path(spec["result"]).unlink(missing_ok=True)
        log_path = weight_dir / f"{name}.log"
        env = dict(
            os.environ,
            EXPORTER_OFFLINE="1",
            PYTHONWARNINGS="ignore",
            TQDM_DISABLE="1",
            **{k: str(s.threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
        )
        start, cpu_before = time.perf_counter(), _children_cpu_seconds()
        stopped_by, memory = None, None
        relay = _LogRelay(log_path, f"  {spec['weight']} {name}: ", self.log)
        with open(log_path, "wb") as log:
            proc = _spawn([sys.executable, "-m", "exporter.coverage.worker", str(spec_path)], log, env)
            stop.child = proc
            try:
                if stop.signalled:  # SIGTERM came between builds, before this one could be killed by it
                    raise KeyboardInterrupt
                while not _waited(proc, RELAY_EVERY_S):
                    relay()
                    memory = build_memory.sample(proc.pid, memory) or memory  # its own process group (_spawn)
                    if s.time_limit is not None and time.perf_counter() - start > WALL_FACTOR * s.time_limit:
                        stopped_by = "wall"
                        break
                relay()
            except KeyboardInterrupt:
                _kill_group(proc)
                raise
            finally:
                stop.child = None
        if stopped_by:
            _kill_group(proc)
            proc.wait()
        cpu = _children_cpu_seconds() - cpu_before  # the worker's and its waited-for children's (one worker at a time)
        if s.time_limit is not None and (
            proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL and cpu > s.time_limit
        ):
            stopped_by = "cpu"  # SIGXCPU at the soft limit; SIGKILL at the hard one (10 s on), if it survived the first
        return proc, stopped_by, round(time.perf_counter() - start, 1), log_path, memory

    def _floor_only(self, candidate: Candidate, row: dict, weight_dir: Path, stop) -> dict:
        """The precision floors for a cached row that has validation failures but was built before (some of)
        them were measured (the checkpoint is deterministic, so it is remade as the build made it)."""
        spec = dict(
            self._spec(candidate, row["target"], weight_dir),
            floor_only=True,
            result=str(weight_dir / f"{row['target']}.floor.json"),
        )
        self._run_worker(spec, weight_dir, stop)
        result = _read_json(Path(spec["result"])) or {}
        return result.get("floor") or {"error": result.get("error") or "the floor was not measured"}

    def _build(self, candidate: Candidate, target: str, weight_dir: Path, stop) -> dict:
        s = self.settings
        spec = self._spec(candidate, target, weight_dir)
        out = Path(spec["out"])
        runs = _BuildRuns(weight_dir / f"{target}.runs.json")
        started = time.perf_counter()
        try:
            proc, stopped_by, seconds, log_path, memory = self._run_worker(spec, weight_dir, stop)
        except KeyboardInterrupt:
            runs.interrupted(time.perf_counter() - started)
            raise
        if stop.signalled:  # killed by the sweep's SIGTERM: no row, but what it cached is reused next time
            runs.interrupted(seconds)
            raise KeyboardInterrupt
        timed_out = stopped_by is not None
        killed_by_kernel = proc.returncode == -signal.SIGKILL and not timed_out  # the sweep's own kills set stopped_by
        result = _read_json(Path(spec["result"])) or {}
        manifest = _read_json(out / "manifest.json")
        done = outcome.cells_from_manifest(manifest) if manifest else []
        error = result.get("error")
        finished = result.get("stage") == "done"
        if finished and timed_out:  # stopped while measuring the floor: the build and its cells stand
            floor_stopped = f"the time limit ({_limit_text(stopped_by, s.time_limit, seconds)}) stopped the floor"
            result.setdefault("floor", {"error": floor_stopped})
            timed_out, stopped_by = False, None
        info = {
            "seconds": seconds,
            "returncode": proc.returncode,
            "timed_out": timed_out,
            "stopped_by": stopped_by,
            "usage_error": result.get("usage_error"),
            "time_limit_s": s.time_limit,
            "checkpoint": _checkpoint_summary(result.get("checkpoint")),
            "checkpoint_s": result.get("checkpoint_s"),
            "floor": result.get("floor"),
        }
        if killed_by_kernel and not finished:
            info["memory"] = memory  # whether the build had the host to itself
        if manifest:
            info["status"] = manifest.get("status")
            info["timings_s"] = {
                k: v
                for k, v in (manifest.get("timings_s") or {}).items()
                if k in ("load weights", "load data", "eager reference")
            }
        if finished:
            row = dict(info, outcome="built", reason=None, cells=done)
        else:
            planned = planned_artifacts(candidate.weight, target, s.formats, candidate.quantized)
            limit = _limit_text(stopped_by, s.time_limit, seconds)
            cells = outcome.stopped_cells(planned, done, proc.returncode, timed_out, error, limit, info.get("memory"))
            if timed_out:
                reason = f"time limit: stopped after {limit}"
            elif error:
                reason = error
            else:
                reason = outcome.death_reason(proc.returncode, info.get("memory"))
            row = dict(info, outcome="stopped", reason=reason, cells=cells, log_tail=_tail(log_path))
        return runs.add(row)


class _BuildRuns:
    """The builds of one row in its weight's folder. Kept with --builds, that folder's build cache lets a build
    go on from what its earlier builds exported and validated (a giant stopped by the time limit goes on where it
    stopped). A row that reused anything names the builds since the last one that started from nothing (its own
    seconds are this build's); what another target of the weight made in the same sweep is reused too (the
    cells say `reused`), without an earlier build of this row to name."""

    def __init__(self, path: Path):
        self.path = path
        earlier = _read_json(path)
        self.earlier = earlier if isinstance(earlier, list) and all(isinstance(r, dict) for r in earlier) else []

    def add(self, row: dict) -> dict:
        reused = any(c.get("reused") for c in row["cells"])
        if reused and self.earlier:
            row = dict(row, earlier_runs=self.earlier)
        self._write((self.earlier if reused else []) + [self._run(row["seconds"], row["outcome"], row["reason"])])
        return row

    def interrupted(self, seconds: float) -> None:
        """A build cut short by Ctrl-C or SIGTERM: its row is not kept, what it cached is."""
        self._write(self.earlier + [self._run(round(seconds, 1), "interrupted", "interrupted (Ctrl-C or SIGTERM)")])

    @staticmethod
    def _run(seconds, outcome_: str, reason) -> dict:
        return {
            "seconds": seconds,
            "outcome": outcome_,
            "reason": reason,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

    def _write(self, runs: list[dict]) -> None:
        files.write_text(self.path, json.dumps(runs, indent=2) + "\n")


def _earlier_runs(json_path: Path, doc: dict) -> list[dict]:
    """The runs of the same sweep (settings and selection) that an unfinished table at `json_path` records:
    a resumed sweep reports the wall clock of all of them."""
    old = _read_json(json_path)
    if (
        not old
        or old.get("complete")
        or old.get("settings") != doc["settings"]
        or old.get("selection") != doc["selection"]
    ):
        return []
    run = old.get("run") or {}
    earlier = list(run.get("earlier_runs") or [])
    if run.get("wall_s") is not None:
        earlier.append({"started": run.get("started"), "wall_s": run["wall_s"], "rows_built": run.get("rows_built")})
    return earlier


def _cacheable(row: dict) -> bool:
    """Whether a row says something lasting about the weight. Not a build that stopped on a Python error before
    any artifact (an ImportError, a broken checkout, a full disk: the environment, not the weight); the
    exporter's own one-line refusals (UsageError) are about the weight and are kept. Nor a build whose end says
    nothing about the weight (outcome.not_a_verdict)."""
    if outcome.not_a_verdict(row):
        return False
    if (
        row.get("outcome") != "stopped"
        or row.get("timed_out")
        or row.get("usage_error")
        or row.get("returncode", 0) < 0
    ):
        return True
    return any(c.get("status") for c in row.get("cells", []))  # an artifact was done: the error came from the build


class _StopOnSignal:
    """SIGTERM (a CI job cancelled, `kill PID`) stops the sweep like Ctrl-C: the running build is killed and
    the partial table is written."""

    def __init__(self):
        self.signalled = False
        self.child = None
        self._previous = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            self._previous = None

    def _handle(self, signum, frame):
        self.signalled = True
        if self.child is not None:
            _kill_group(self.child)

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _limit_text(stopped_by: str | None, limit: float | None, seconds: float) -> str | None:
    if stopped_by == "cpu":
        return f"{limit:g} s of CPU time ({seconds:g} s wall clock)"
    if stopped_by == "wall":
        return f"{seconds:g} s of wall clock ({WALL_FACTOR}× the {limit:g} s CPU limit: starved or blocked)"
    return None


def _spawn(command: list[str], log, env: dict) -> subprocess.Popen:
    """A worker in a process group of its own (so that a time limit kills the build and whatever it started,
    and the terminal's Ctrl-C reaches only the sweep) but in the sweep's session: with Linux's autogroup
    scheduling each session's CPU share is set by its autogroup, not by its processes' nice values, and a
    worker in a new session (start_new_session) left a backgrounded sweep's autogroup (measured: two sweeps
    whose sessions were set to autogroup nice 19 had workers at nice-0 weight, 100 % of a core each, while
    another process in a nice-19 autogroup got 2 %)."""
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)


def _kill_group(proc: subprocess.Popen) -> None:
    """The build and whatever it started (its own process group, made by _spawn)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _build_order(candidates: list[Candidate]) -> list[Candidate]:
    """Refused and skipped first (instant), then the smallest models first: a sweep cut short has covered as
    many weights as it could."""
    return sorted(candidates, key=lambda c: (not (c.refused or c.skipped), c.params or 0))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 6) -> list[str]:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:300] for line in text if line.strip()][-lines:]


def _checkpoint_summary(info: dict | None) -> dict | None:
    if not info:
        return None
    keep = (
        "seed",
        "num_classes",
        "params",
        "batchnorms_settled",
        "reinitialised_zero_layers",
        "reference_spread",
        "quantized",
        "recipe",
        "epochs",
        "until_train_acc1",
        "epochs_trained",
        "held_out_acc1",
        "quantized_held_out_acc1",
        "prepare_s",
    )
    return {k: info[k] for k in keep if k in info}


RELAY_EVERY_S = 2.0


def _waited(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


class _LogRelay:
    """Passes on the worker's progress lines (worker.PROGRESS_MARKS) as the log grows, so an hour-long build
    shows its steps as they finish instead of nothing until its row's line."""

    def __init__(self, path: Path, prefix: str, log):
        self.path, self.prefix, self.log, self.offset = path, prefix, log, 0

    def __call__(self) -> None:
        from .worker import PROGRESS_MARKS

        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self.offset += len(complete)
        for line in complete.decode("utf-8", "replace").splitlines():
            if line.startswith(PROGRESS_MARKS):
                self.log(self.prefix + line)


def _progress_line(n: int, total: int, row: dict) -> str:
    head = f"[{n}/{total}] {row['weight']} {row['target']}:"
    if row["outcome"] in ("refused", "skipped"):
        return f"{head} {outcome.SYMBOLS[row['outcome']]} {row['outcome']}: {row['reason']}"
    icons = "".join(outcome.icon(c) for c in row["cells"])
    where = "cached" if row.get("from_cache") else f"{row['seconds']:.0f} s"
    if row.get("earlier_runs") and not row.get("from_cache"):
        where += f", going on from {len(row['earlier_runs'])} earlier build(s) in --builds"
    tail = f" — {row['reason']}" if row["outcome"] == "stopped" else ""
    return f"{head} {icons} ({where}){tail}"
