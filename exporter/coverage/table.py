"""The coverage table: the JSON document (header, rows, summary), its Markdown rendering, and the merge of
several row files (CI shards) into one. Torch-free."""

from __future__ import annotations

import contextlib
import datetime
import json
import posixpath
import shlex
from collections import Counter
from pathlib import Path

from .. import files
from ..errors import UsageError
from ..results import Kind, Reason, revived
from ..thresholds import THRESHOLD_KEYS
from .outcome import FLOORS, ORDER, SYMBOLS, WEIGHT_FLOOR, broken_keys, not_a_verdict, reclassify
from .select import TASK_ORDER

COVERAGE_VERSION = 1
TARGET_ORDER = ("android", "ios", "jetson")
SHOWN_TOOLS = ("exporter", "torch", "torchvision", "executorch", "coremltools", "onnx", "onnxruntime", "tensorrt")
ROW_OUTCOMES = ("built", "stopped", "refused", "skipped")


def host_info() -> dict:
    from ..release.manifest import host

    info = host(1)
    info.pop("threads", None)
    return info


def exporter_commit() -> str | None:
    from ..release.manifest import exporter_commit as commit

    return commit()


def new_document(command: str, settings: dict, selection: dict, tools: dict) -> dict:
    return {
        "coverage_version": COVERAGE_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "exporter_commit": exporter_commit(),
        "host": host_info(),
        "tools": tools,
        "settings": settings,
        "selection": selection,
        "planned_rows": 0,
        "planned": [],  # the [weight, target] builds, so that merges of merges count each once
        "complete": False,
        "rows": [],
    }


def _order(value, order) -> int:
    return order.index(value) if value in order else len(order)


def sorted_rows(rows: list[dict]) -> list[dict]:
    return sorted(
        rows,
        key=lambda r: (
            _order(r["task"], TASK_ORDER),
            r["model"],
            r["weight"],
            _order(r["target"], TARGET_ORDER),
            r["target"],
        ),
    )


def sorted_keys(keys) -> list[list[str]]:
    """(weight, target) pairs as the JSON lists a document plans, in the table's order."""
    return [[w, t] for w, t in sorted(keys, key=lambda k: (k[0], _order(k[1], TARGET_ORDER)))]


def summary(rows: list[dict]) -> list[dict]:
    """Per target and task: how many builds and weights ended how, and how many artifacts per outcome."""
    groups: dict[tuple[str, str], dict] = {}
    for row in rows:
        group = groups.setdefault(
            (row["target"], row["task"]),
            {
                "target": row["target"],
                "task": row["task"],
                **{k: 0 for k in ROW_OUTCOMES},
                "artifacts": {k: 0 for k in ORDER},
                "failures": {},
            },
        )
        group[row["outcome"]] += 1
        for cell in row["cells"]:
            group["artifacts"][cell["outcome"]] += 1
            if cell["outcome"] in ("failed", "export", "time"):
                label = f"{SYMBOLS[cell['outcome']]} {cell.get('kind') or ''}".strip()
                group["failures"][label] = group["failures"].get(label, 0) + 1
    return [
        groups[k] for k in sorted(groups, key=lambda k: (_order(k[0], TARGET_ORDER), k[0], _order(k[1], TASK_ORDER)))
    ]


def render(doc: dict, md: bool = True) -> tuple[str, str | None]:
    """The document's JSON text and (with `md`) its Markdown, made in memory: a document that cannot be rendered
    fails here, before a file is touched."""
    doc["summary"] = summary(doc["rows"])
    return json.dumps(doc, indent=2, allow_nan=False, default=str) + "\n", markdown(doc) if md else None


def write(doc: dict, json_path: Path, md_path: Path | None) -> None:
    """Both files rendered first, then written together: each is staged beside its place and renamed into it only
    once both are written, so a failure to render or write leaves the previous pair (only a failed second rename
    could leave them out of step, each file still whole)."""
    write_texts(zip((json_path, md_path), render(doc, md_path is not None)))


def write_texts(pairs) -> None:
    """(path, text) pairs (a None path is left out), staged together and renamed into place only when all are
    written."""
    pairs = [(Path(path), text) for path, text in pairs if path is not None]
    for path, _ in pairs:
        path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        for path, text in pairs:
            stack.enter_context(files.atomic_path(path)).write_text(text, encoding="utf-8")


# --- merge ---------------------------------------------------------------------------------------------------


def _row_files(paths) -> list[tuple[Path, bool]]:
    """(file, named on the command line) for each file to merge; a directory's are found in it."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found += [(f, False) for f in sorted(path.rglob("*.json"))]
        elif path.is_file():
            found.append((path, True))
        else:
            raise UsageError(f"--merge: {path} does not exist")
    return found


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: a table is written without them (allow_nan=False)


def _coverage_doc(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("coverage_version") != COVERAGE_VERSION:
        return None
    if not isinstance(doc.get("settings"), dict) or not isinstance(doc.get("rows"), list):
        return None
    return doc


_JSON_TYPES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _is_reason(value) -> bool:
    """A reason's JSON record (exporter.results: a kind we know and its text); a sentence alone is not one."""
    try:
        return isinstance(value, dict) and isinstance(Reason.from_json(value).text, str)
    except (KeyError, ValueError, TypeError):
        return False


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _row_problem(row) -> str | None:
    """What makes a row of a coverage file unfit for the merge and the table (the keys they read without a
    default), or None."""
    if not isinstance(row, dict):
        return f"is {_json_type(row)}, not an object"
    for key in ("weight", "target", "model", "task"):
        if key not in row:
            return f"has no {key!r}"
        if not isinstance(row[key], str):
            return f"has {_json_type(row[key])} for {key!r}, not a string"
    problem = None
    if row.get("outcome") not in ROW_OUTCOMES:
        problem = f"outcome {row.get('outcome')!r} is not one of {', '.join(ROW_OUTCOMES)}"
    elif not isinstance(row.get("cells"), list):
        problem = f"has {_json_type(row.get('cells'))} for 'cells', not a list"
    else:
        for key in ("params", "seconds", "time_limit_s"):
            if row.get(key) is not None and not _is_number(row[key]):
                problem = f"has {_json_type(row[key])} for {key!r}, not a number"
                break
        runs = row.get("earlier_runs")
        if (
            not problem
            and runs is not None
            and not (
                isinstance(runs, list)
                and all(isinstance(r, dict) and (r.get("seconds") is None or _is_number(r["seconds"])) for r in runs)
            )
        ):
            problem = "'earlier_runs' is not a list of builds with their seconds"
        for j, cell in enumerate(row["cells"], 1):
            if problem:
                break
            if not isinstance(cell, dict):
                problem = f"cell {j} is {_json_type(cell)}, not an object"
            elif not isinstance(cell.get("name"), str):
                problem = f"cell {j} has no 'name' string"
            elif cell.get("outcome") not in ORDER:
                problem = f"cell {j} ({cell['name']}): outcome {cell.get('outcome')!r} is not one of {', '.join(ORDER)}"
            elif not (isinstance(cell.get("reasons", []), list) and all(map(_is_reason, cell.get("reasons", [])))):
                problem = (
                    f"cell {j} ({cell['name']}): 'reasons' is not a list of reasons (objects with a kind and a text)"
                )
    return f"({row['weight']} × {row['target']}) {problem}" if problem else None


def _doc_problem(doc: dict) -> str | None:
    """What makes a coverage file (one _coverage_doc read) unfit for the merge: its targets or a row; or None."""
    targets = doc["settings"].get("targets")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        return "settings 'targets' is not a list of target names"
    for i, row in enumerate(doc["rows"], 1):
        problem = _row_problem(row)
        if problem:
            return f"row {i} {problem}"
    return None


def _kept(old: dict | None, new: dict) -> bool:
    """Whether `new` replaces `old` for one weight x target: the later file's, except that a row skipped for
    size, or ended by something other than its weight (outcome.not_a_verdict), never hides one that was built."""

    def stands_in(row: dict) -> bool:
        return row.get("outcome") == "skipped" or not_a_verdict(row)

    return old is None or not stands_in(new) or stands_in(old)


def _with_columns(old: dict, new: dict) -> dict:
    """One weight x target from a sweep of a few formats (`--format`, e.g. a new format's column) merged into a
    row that has the other artifacts: the new row's cells replace the old ones of the same name and join the rest.
    A new row that built nothing (skipped, refused, ended from outside) leaves the old row as it was."""
    if new.get("outcome") not in ("built", "stopped") or not_a_verdict(new):
        return old
    if old.get("outcome") not in ("built", "stopped"):
        return new
    names = {c["name"] for c in new["cells"]}
    old_eager = _eager_acc1(old["cells"])
    added = [  # a trained tier's model trained again for the new sweep (on another host) may score otherwise
        dict(c, own_eager_acc1=_eager_acc1([c])) if _eager_acc1([c]) not in (None, old_eager) else c
        for c in new["cells"]
    ]
    return dict(
        old,
        cells=[c for c in old["cells"] if c["name"] not in names] + added,
        seconds=(old.get("seconds") or 0) + (new.get("seconds") or 0),
        status="failed" if "failed" in (old.get("status"), new.get("status")) else old.get("status"),
        floor={**(new.get("floor") or {}), **(old.get("floor") or {})} or None,
        outcome="stopped" if "stopped" in (old["outcome"], new["outcome"]) else "built",
    )


def _eager_acc1(cells: list[dict]) -> float | None:
    return next(((c.get("accuracy") or {}).get("eager_acc1") for c in cells if c.get("accuracy")), None)


def _tools(docs) -> dict:
    """The tools' versions; a tool the files differ on shows each version."""
    names = dict.fromkeys(k for _, d in docs for k in (d.get("tools") or {}))
    merged = {}
    for name in names:
        versions = dict.fromkeys(v for _, d in docs for v in str((d.get("tools") or {}).get(name)).split(" / "))
        merged[name] = " / ".join(v for v in versions if v != "None") or None
    return merged


def merge(paths, command: str) -> dict:
    """One document from several coverage JSON files (or directories holding them, e.g. CI shard artifacts).
    A weight x target present in several files keeps the last one read, unless that one was skipped for size; a
    file swept for a few formats adds its cells to the row (`_with_columns`)."""
    docs = []
    for path, named in _row_files(paths):
        doc = _coverage_doc(path)
        if doc is not None:
            problem = _doc_problem(doc)  # a table's own rows are checked wherever it was found
            if problem:
                raise UsageError(f"--merge: {path} is not a valid coverage table: {problem}")
            docs.append((path, doc))
        elif named:  # a directory may hold other JSON; a file named on the command line must be a table
            raise UsageError(f"--merge: {path} is not a coverage JSON file (from `exporter coverage`)")
    if not docs:
        raise UsageError(f"--merge: no coverage JSON files (from `exporter coverage`) in {', '.join(map(str, paths))}")
    first = docs[0][1]

    def comparable(settings):  # the time limit only decides whether a build finished; targets and formats only
        # select; a classifier built at another size says so in its row
        return {k: v for k, v in settings.items() if k not in ("time_limit", "targets", "formats", "classifier_size")}

    for path, doc in docs[1:]:
        if comparable(doc["settings"]) != comparable(first["settings"]):
            raise UsageError(
                f"--merge: {path} was made with other settings than {docs[0][0]}; "
                f"merge rows of one sweep (same targets, formats, sizes)"
            )
    rows = {}
    for _, doc in docs:
        columns_only = bool(doc["settings"].get("formats"))
        for row in map(reclassify, doc["rows"]):  # by today's rules, before one row stands in for another
            key = (row["weight"], row["target"])
            if columns_only and key in rows:
                rows[key] = _with_columns(rows[key], row)
            elif _kept(rows.get(key), row):
                rows[key] = row
    targets = {t for _, d in docs for t in d["settings"].get("targets") or ()}
    settings = dict(first["settings"], targets=sorted(targets, key=lambda t: (_order(t, TARGET_ORDER), t)))
    merged = new_document(command, settings, dict(first.get("selection") or {}, shard=None), _tools(docs))
    hosts = {json.dumps(h, sort_keys=True) for _, d in docs for h in d.get("hosts") or [d.get("host")]}
    merged["host"] = first.get("host")
    merged["exporter_commit"] = None  # each file's own, in merged_from: sweeps merged may come from several commits
    if len(hosts) > 1:
        merged["hosts"] = [json.loads(h) for h in sorted(hosts)]
    plans = [_planned(d) for _, d in docs]
    known = all(p is not None for p in plans)
    if known:
        keys = set().union(*plans) | set(rows)
        merged["planned"], merged["planned_rows"] = sorted_keys(keys), len(keys)
    else:
        merged["planned_rows"] = sum(d.get("planned_rows", 0) for _, d in docs)
    merged["rows"] = sorted_rows(list(rows.values()))
    # an interrupted sweep is completed by another run's rows when the plans are known
    merged["complete"] = (known or all(d.get("complete") for _, d in docs)) and len(merged["rows"]) >= merged[
        "planned_rows"
    ]
    # a merged file brings the files it was merged from (their selections and commands), not only its first's
    merged["merged_from"] = [
        entry
        for p, d in docs
        for entry in (
            d.get("merged_from")
            or [
                {
                    "file": str(p),
                    "created": d.get("created"),
                    "command": d.get("command"),
                    "exporter_commit": d.get("exporter_commit"),
                    "host": d.get("host"),
                    "selection": d.get("selection"),
                    "shard": (d.get("selection") or {}).get("shard"),
                    "rows": len(d["rows"]),
                    "complete": d.get("complete"),
                    "run": d.get("run"),
                }
            ]
        )
    ]
    # a merged file's own shards stay shards (its wall_s is only their longest)
    walls = [
        w
        for _, d in docs
        for w in (d.get("run") or {}).get("shards_wall_s")
        or [(d.get("run") or {}).get("total_wall_s") or (d.get("run") or {}).get("wall_s") or 0]
    ]
    merged["run"] = {
        "wall_s": max(walls),
        "shards_wall_s": walls,
        "started": min(((d.get("run") or {}).get("started") or "") for _, d in docs) or None,
    }
    return merged


def merged(paths, command: str) -> tuple[dict, tuple[str, str]]:
    """The merged document and its JSON and Markdown texts, every file read and checked and both texts made before
    anything is written."""
    doc = merge(paths, command)
    return doc, render(doc)


def _planned(doc: dict) -> set | None:
    """The (weight, target) builds a document's selection plans (a sweep of a few models merged into a whole one
    plans nothing new), or None where they cannot be listed again as they were (another torchvision)."""
    from . import select

    if doc.get("planned"):
        return {tuple(key) for key in doc["planned"]}
    if doc.get("merged_from") and doc.get("complete"):  # an earlier merge: it planned what it holds
        return {(r["weight"], r["target"]) for r in doc.get("rows", [])}
    selection = doc.get("selection") or {}
    try:
        found = select.candidates(
            selection.get("models") or (),
            selection.get("tasks") or (),
            bool(selection.get("one_per_builder")),
            selection.get("max_params"),
        )
        found = select.shard(found, select.parse_shard(selection.get("shard")))
    except UsageError:
        return None
    keys = {(c.weight, target) for c in found for target in (doc.get("settings") or {}).get("targets") or ()}
    return keys if len(keys) == doc.get("planned_rows") else None


# --- Markdown ------------------------------------------------------------------------------------------------


def _esc(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def _mb(size) -> str:
    return f"{size / 1e6:.1f} MB" if size else ""


def _host_line(host: dict) -> str:
    return f"{host.get('cpu')}, {host.get('cores')} cores, {host.get('platform')}, Python {host.get('python')}"


def _provenance(merged_file: dict, root: str | None) -> str:
    commit, host = merged_file.get("exporter_commit"), merged_file.get("host") or {}
    return (
        f"`{_portable(merged_file.get('command'), root) or '?'}`"
        + (f" at `{commit[:12]}`" if commit else "")
        + (f" on {host['cpu']}" if host.get("cpu") else "")
        + f" ({(merged_file.get('created') or '?')[:10]})"
    )


def _short_reason(reason: str, record: dict | None) -> str:
    """A failed cell's first reason, short: a broken threshold's key and value (its JSON `record`), else the start
    of its text."""
    if record and Reason.from_json(record).kind is Kind.THRESHOLD:
        return _measured(Reason.from_json(record))
    return (reason or "")[:40]


def _acc1(cell: dict) -> str:
    acc1 = (cell.get("accuracy") or {}).get("acc1")
    own = f" (its own eager {cell['own_eager_acc1']:.1f})" if cell.get("own_eager_acc1") is not None else ""
    return f" · acc@1 {acc1:.1f}{own}" if isinstance(acc1, (int, float)) else ""


def _arm(cell: dict) -> str:
    cpus = cell.get("aarch64") or {}
    return f" · ✅ on {', '.join(cpus)}" if cpus and all(v == "passed" for v in cpus.values()) else ""


def _outliers(cell: dict) -> str:
    o = cell.get("outlier_inputs")
    return f" · {o['count']} of {o['of']} inputs" if o and o["thresholds_met_without"] else ""


def cell_text(cell: dict) -> str:
    symbol = SYMBOLS[cell["outcome"]]
    kind = cell.get("kind")
    if cell["outcome"] == "passed":
        return f"{symbol} {_mb(cell.get('size_bytes'))}{_acc1(cell)}{_arm(cell)}".strip()
    if cell["outcome"] == "failed":
        if kind == "degenerate reference":
            return f"{symbol} degenerate"
        if kind == "runtime error":  # "does not run …: <Error>: <message>": the error's name says most
            error = (cell.get("reason") or "").partition(": ")[2].partition(":")[0]
            return f"{symbol} runtime error ({error})" if error else f"{symbol} runtime error"
        suffix = {
            "ill-conditioned reference": " · ill-conditioned",
            "quantized weight": " · the int8 weight's own",
        }.get(kind, "")
        reason, where = cell.get("reason") or "", ""
        first = (cell.get("reasons") or [{}])[0]
        if first.get("cpu"):  # found on an emulated aarch64 CPU: the CPU, then what its text says there
            where = f"{first['cpu']}: "
            reason = reason.removeprefix(f"aarch64 {first['cpu']} (emulated): ")
        return f"{symbol} {where}{_short_reason(reason, first)}{suffix}{_outliers(cell)}{_acc1(cell)}{_arm(cell)}"
    if cell["outcome"] == "export":
        return f"{symbol} {kind}"
    if cell["outcome"] == "time" and cell.get("aarch64"):
        return f"{symbol} qemu on {', '.join(c for c, v in cell['aarch64'].items() if v != 'passed')}"
    if cell["outcome"] == "unavailable":
        return f"{symbol} {_mb(cell.get('size_bytes'))}".strip()
    return symbol


def _measured(reason: Reason) -> str:
    """A broken threshold as its key and the value measured, e.g. 'top1_agreement 0.75'; another reason's text."""
    if reason.kind is not Kind.THRESHOLD:
        return reason.text
    return f"{reason.metric} {'nan' if reason.value is None else format(reason.value, '.4g')}"


def floor_text(row: dict, cell: dict) -> str:
    """What eager rounded to the cell's precision reached (coverage.conditioning), e.g. 'eager rounded to int8:
    top1_agreement 0.5, psnr_db 29.6'."""
    weight = (row.get("floor") or {}).get(WEIGHT_FLOOR)
    if cell.get("kind") == "quantized weight" and weight:
        return "the int8 weight in eager PyTorch: " + ", ".join(map(_measured, revived(weight.get("reasons"))))
    parts = []
    for name in FLOORS.get(cell.get("precision"), (cell.get("precision"),)):
        measured = (row.get("floor") or {}).get(name) or {}
        found = {
            k: (measured.get(THRESHOLD_KEYS[k][0][0]) or {}).get(THRESHOLD_KEYS[k][0][1])
            for k in broken_keys(cell.get("reasons"))
            if k in THRESHOLD_KEYS
        }
        values = ", ".join(f"{k} {_number(v)}" for k, v in sorted(found.items()) if v is not None)
        if values:
            parts.append(f"{FLOOR_NAMES.get(name, 'eager rounded to ' + name)}: {values}")
    moved = (cell.get("quantization") or {}).get("perturbation") or {}
    if moved.get("output_psnr_db") is not None:
        parts.append(
            f"eager, its input perturbed at {_number(moved['input_snr_db'])} dB SNR: "
            f"psnr_db {_number(moved['output_psnr_db'])}"
        )
    margins = (row.get("floor") or {}).get("margins")
    rms = ((row.get("floor") or {}).get(cell.get("precision")) or {}).get("rms")
    flips = [r["row"] for r in cell.get("flipped_rows") or [] if margins and rms and r["row"] < len(margins)]
    if flips:
        parts.append(
            "top-1 flipped where eager's margin was "
            + ", ".join(f"{_number(margins[i])} (rounding's RMS error there {_number(rms[i])})" for i in flips)
        )
    return "; ".join(parts)


FLOOR_NAMES = {"int8_static": "with static int8 ranges"}


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _outside_xnnpack(cells: list[dict]) -> str:
    parts = []
    for cell in cells:
        delegation = cell.get("delegation")
        if not delegation:
            continue
        ops = delegation.get("ops_outside_on_tensors") or {}
        text = ", ".join(f"{op}×{n}" for op, n in sorted(ops.items())) or "none"
        parts.append(f"{cell['precision']}: {text}")
    return "; ".join(dict.fromkeys(parts)) or "—"


def _time_limit_line(settings: dict, rows: list[dict]) -> str:
    """The time limit, or the range of the limits its rows were built under (a merge of sweeps run with several)."""
    limits = {r["time_limit_s"] for r in rows if r.get("outcome") in ("built", "stopped") and r.get("time_limit_s")}
    limits |= {settings["time_limit"]} if settings.get("time_limit") and not limits else set()
    if len(limits) > 1:
        return f"time limit {min(limits):g} to {max(limits):g} s per build (each row's own sweep's)"
    return f"time limit {limits.pop():g} s per build" if limits else "no time limit"


def _settings_line(settings: dict, rows: list[dict]) -> str:
    parts = [
        f"targets {', '.join(settings['targets'])}",
        f"formats {', '.join(settings['formats'])}" if settings.get("formats") else "every artifact of each target",
        (
            f"{settings['calib_size']} calibration + {settings['val_size']} validation synthetic images"
            if settings.get("weights") != "digits"
            else "held-out digits, labeled: the target's calibration and validation sizes"
            + (
                f" ({settings['calib_size']} + {settings['val_size']})"
                if settings.get("calib_size") is not None
                else ""
            )
            + f"; trained {settings.get('train_epochs')} epochs"
            + (
                f", then more while under {100 * settings['train_until']:g} % acc@1 on its training digits (up to "
                f"{settings['train_max_epochs']})"
                if settings.get("train_until")
                else ""
            )
        ),
        f"latency {settings['warmup']} warm-up + {settings['iterations']} timed iterations",
        f"{settings['threads']} thread{'s' if settings['threads'] != 1 else ''}",
        *(
            ["classifiers at their weights' crop, or at the size their row names"]
            if any(r.get("classifier_size") for r in rows)
            else []
        ),
        "segmentation, RetinaNet, FCOS and video-frame input "
        + (
            "×".join(map(str, settings["input_size"]))
            + ", or the weight's own where that is smaller or its minimum larger"
            if settings.get("input_size")
            else "the weight's"
        ),
        _time_limit_line(settings, rows),
        *(
            [
                "every .pte, .tflite, .ptl and ONNX also validated on emulated aarch64 ("
                + ("each target's own CPUs" if settings["cpus"] == ["target"] else ", ".join(settings["cpus"]))
                + "): a cell passes only where it passes on every CPU"
            ]
            if settings.get("cpus")
            else []
        ),
    ]
    return "; ".join(parts)


def _selection_line(selection: dict) -> str:
    if not selection:
        return "every weight"
    parts = []
    parts.append("each builder's DEFAULT weight" if selection.get("one_per_builder") else "every weight")
    if selection.get("tasks"):
        parts.append(f"tasks {', '.join(selection['tasks'])}")
    if selection.get("models"):
        parts.append(f"models {', '.join(selection['models'])}")
    if selection.get("max_params"):
        parts.append(f"at most {selection['max_params'] / 1e6:g}M parameters built (larger: ⏭)")
    if selection.get("shard"):
        parts.append(f"shard {selection['shard']}")
    return "; ".join(parts)


LEGEND = (
    "✅ passed · ❎ built, failed validation (first reason) · ❌ export failed (kind: unsupported op, delegate "
    "fallback, converter crash, out of memory, degenerate reference, killed from outside the sweep, …) · "
    "⚪ unavailable on this host (Core ML "
    "predicts only on macOS, TensorRT needs a CUDA GPU; the size when it was built) · ⛔ refused by design · "
    "⏱ time limit · · not reached (the build stopped earlier) · ⏭ skipped for size"
)

HOW = """## How this table is made

`exporter coverage` ([cli.md](cli.md#exporter-coverage)) builds each chosen weight for each target with the real
`exporter build` pipeline, one build per process (a crash or an out-of-memory kill costs one row, and a build
past the time limit (its CPU time; ⏱ rows made before 2026-11-26 afternoon were stopped on the wall clock) is killed
and marked ⏱), offline and without `--data`:

- **Random weights, nothing downloaded.** The model is constructed as the exporter constructs it, with the
  weight's category count. Linear/Conv layers that torchvision zero-initialises (ViT's `heads.head`: every logit
  0 for every input) are re-initialised with PyTorch's default init; every BatchNorm's statistics are then
  settled (momentum=None, reset, no-grad passes) on synthetic images preprocessed like the weight's own
  transforms. A model whose outputs still barely vary across those images (RetinaNet v1's head: std-0.01 convs
  with no normalisation between them, so every image gets the prior bias) has each Linear/Conv scaled, in
  forward order, to unit output variance on them (LSUV), and is settled again. The state dict goes to a temporary file the build loads with `--checkpoint … --no-verify`.
  Quantized weights get their float model (the eager reference) and that model quantized as torchvision does.
- **Small on purpose.** Synthetic calibration and validation images, few latency iterations, one thread,
  segmentation at a small fixed input size: the table answers "does it export, and does the artifact agree
  with eager", not "how fast" ([benchmarks.md](benchmarks.md)) and not "how accurate" (random weights have
  no accuracy; no labeled metric is measured).
- **A precision floor tells a random model's conditioning from an export bug.** A random classifier's 1000
  logits are close together, so rounding flips its top-1 far more often than a trained model's confident one
  (measured: a random MobileNetV3-Small's int8 `.pte` is 32 dB from eager yet agrees on top-1 for 3 of 8
  images; with a head fitted to real digits on its random features, still 0.875 and 26.9 dB). So for every
  build with a ❎, eager itself is run on the same inputs in float64, with weights and every layer's output
  rounded to float16, and rounded to 8 bits (per-channel weights, per-tensor outputs from each tensor's own
  max; and again with each output's range fixed beforehand from the calibration images, as a static int8
  runtime does, which clips a random model's outliers that move from image to image), and judged with the
  same thresholds (`exporter/coverage/conditioning.py`). An artifact whose broken
  thresholds eager's own rounding also breaks, and whose PSNR is within 6 dB of that rounding's, is "❎ … ·
  ill-conditioned": its failure says nothing about the exporter. So is one that flips decisions (top-1, masks,
  matched boxes) the rounding kept while closer to eager than that rounding, its other broken thresholds broken
  by the rounding too: on near-tied margins any rounding flips some, and the floor's single sample may flip none.
  So, last, is one whose every flipped top-1 sat on a near-tie (eager's margin there under 2√2 times the
  rounding's RMS error on that image, with the artifact's PSNR within 6 dB of the rounding's). A torchvision
  int8 weight is judged against its float model: when the weight itself, run as it is in eager PyTorch, breaks
  the thresholds its artifact broke (its PSNR within 6 dB), the cell reads "❎ … · the int8 weight's own": what
  the weight's quantization loses, which no export of it wins back. A ❎ without either is ours to explain.
- **"· k of N inputs"**: the artifact's error sits in k of the N validation inputs (each over 10× the median
  input's RMS error) and the other inputs meet the fidelity thresholds; its report names them (`outlier_inputs` in
  the manifest). In an int8 artifact these may be inputs whose activations go past the ranges the calibration
  images set (measured so on the trained EfficientNet-B2). Where the search had met its budget on the check
  images, the build makes such a `.pte` again with ranges chosen per inference and keeps it if it passes on the
  same inputs (`validation_retry` in the manifest and in the row's JSON; docs/int8.md).
- **⛔ is the exporter's own refusal** (Mask and Keypoint R-CNN: the one-line error `exporter build` exits 2
  with), asked without building. A format that cannot take an eager-quantized model, a clip (the `.pte`: no 3-D
  convolution in XNNPACK), a frame pair (RAFT: the `.pte` and Core ML) or a two-stage detector (Android, iOS) is
  ⛔ per artifact, with its reason.
- **⚪ is not a failure**: the artifact cannot be run (Core ML off macOS) or built (TensorRT without a GPU) on
  this host; a Core ML package that converted shows its size.
- **Resumable.** Each build's row is cached in `$EXPORTER_CACHE/coverage/` keyed on the weight, the target and
  its profile (`targets/*.toml`), these settings, the exporter's version and source and the tools' versions: an
  interrupted sweep continues, a re-run rebuilds nothing, and a change to the exporter's code or to a target's
  thresholds builds every row again (as does a row stopped at a shorter time limit, or by the wall clock alone).
  With `--builds DIR` a stopped build's exports and validations are kept (its build cache): building the row again
  goes on where it stopped, with the time limit for what is left; its "build s" then reads "N (+M earlier)", and
  its JSON row lists the earlier builds (`earlier_runs`) and each cell what it reused (`reused`).
- **A column added later** (the `.tflite`'s, 2026-12-04) comes from a sweep of that format alone (`--format
  litert:fp32`, its commands under "Merged from"), merged into the rows the whole sweeps made: its cells join the
  row, its seconds add to "build s", and a weight it skipped for size keeps its row without the cell.
- "ops outside XNNPACK" lists the `.pte` graphs' ops that touch tensors and were left outside the XNNPACK
  delegate (the manifest's `details.delegation.ops_outside_on_tensors`; scalar casts are not counted).
"""  # noqa: E501  (the page's text, as written to docs)


HOW_TRAINED = """## How this table is made

`exporter coverage --weights digits` ([cli.md](cli.md#exporter-coverage)) builds each chosen weight for each target
with the real `exporter build` pipeline, one build per process, as the random sweep does ([coverage.md](coverage.md)),
but on a trained model:

- **Trained, nothing downloaded.** The weight's architecture (10 classes) is trained from scratch on scikit-learn's
  8×8 digits, preprocessed by the weight's own transforms (so at its own crop, or at the size its row names: a
  classifier trained and built at N×N by `--classifier-size N`, the resize scaled with it), by the recipe of the digits
  stand-ins the tests use (`exporter/standins/digits.py`: AdamW, one-cycle, batch-norm statistics recomputed; a run
  that did not learn is made again from the same start at a tenth of the learning rate, then with its classifier
  scaled by √(10/1000), EfficientNet's initial scale at ImageNet's 1000 classes, then with each residual branch's last
  batch norm also started at zero, so that a deep stack starts shallow), and cached in `$EXPORTER_CACHE/digits`. A quantized
  weight's float model is trained and then quantized as torchvision made its int8 weights.
- **Judged on labels.** The build gets the 300 held-out digits (never trained on) as `--data`: the target's own
  calibration and validation sizes, the int8 budget (`accuracy_drop`) checked as in a user's build. "eager acc@1"
  is eager's on the validation digits; each cell shows the artifact's.
- **Why a second table.** A random classifier's logits are so close together that rounding alone flips its
  top-1: most int8 rows of the random table are "ill-conditioned", no verdict. A trained model's are not, so a
  ❎ here is a real failure of the artifact, unless eager itself, rounded to int8, breaks the same thresholds:
  here the floor is judged on the labels too (acc@1 lost), and "ill-conditioned" means the trained model
  amplifies small errors (the int8 report's `perturbation` shows how much). "· k of N inputs": the error sits in
  k inputs and the rest meet the fidelity thresholds (as in the random table).
- Not covered: segmentation and detection (no digits recipe for most of their builders: ⏭, saying so).
"""


def _earlier_s(row: dict) -> float:
    """The seconds of the row's earlier builds whose exports or validations it reused (sweep --builds)."""
    return sum(run.get("seconds") or 0 for run in row.get("earlier_runs") or ())


def _build_s_text(row: dict) -> str:
    earlier = _earlier_s(row)
    return f"{row.get('seconds') or 0:.0f}" + (f" (+{earlier:.0f} earlier)" if row.get("earlier_runs") else "")


def markdown(doc: dict) -> str:
    """The page for `doc`: title and introduction, what made it, the legend, the summary, a table per target, the
    rows refused and skipped, the failures, the stopped builds, the files it was merged from, and how it is made."""
    rows = doc["rows"]
    trained = doc["settings"].get("weights") == "digits"
    root = _paths_root(doc)
    lines = [
        _title(doc["settings"], trained),
        "",
        _intro(doc["settings"], trained) + " [How this table is made](#how-this-table-is-made).",
        "",
        *_made_by(doc, rows, root),
        "",
        LEGEND,
        *_summary_section(rows),
    ]
    for target in sorted({r["target"] for r in rows}, key=lambda t: (_order(t, TARGET_ORDER), t)):
        lines += _target_section(target, rows, trained)
    lines += _refused_and_skipped_sections(rows)
    lines += _failures_section(rows)
    lines += _stopped_section(rows)
    lines += _merged_from_section(doc, root)
    lines += ["", HOW_TRAINED if trained else HOW]
    return "\n".join(lines).rstrip() + "\n"


def _title(settings: dict, trained: bool) -> str:
    return (
        "# torchvision coverage"
        + (", trained on the digits" if trained else "")
        + (", on x86 and emulated aarch64" if settings.get("cpus") else "")
    )


def _intro(settings: dict, trained: bool) -> str:
    intro = (
        (
            "Every chosen classifier's architecture **trained from scratch on scikit-learn's digits** (nothing "
            "downloaded), built for each target by the real `exporter build` and validated against its eager reference "
            "and the labels of held-out digits; a cell shows the artifact's acc@1."
        )
        if trained
        else (
            "Every chosen torchvision weight with **random weights** (nothing downloaded), built for each target by the "
            "real `exporter build` and validated against its eager reference on synthetic inputs."
        )
    )
    if settings.get("cpus"):
        intro += (
            " Every `.pte`, `.tflite`, `.ptl` and ONNX artifact also ran on **emulated aarch64 cores** (qemu-user, the "
            "aarch64 wheels of the same versions), judged by the same contract: a cell passes only where it "
            "passes on every core, and names them."
        )
    return intro


# --- the header table: what made the page ----------------------------------------------------------------------


def _made_by(doc: dict, rows: list[dict], root: str | None) -> list[str]:
    """The two-column table under the introduction: when, by which command, how far, on what, with what."""
    tools = doc.get("tools") or {}
    return [
        "| | |",
        "|---|---|",
        f"| made | {_esc(doc.get('created'))} |",
        f"| command | `{_esc(_portable(doc.get('command'), root))}`{_at_commit(doc.get('exporter_commit'))} |",
        *(
            [f"| merged from | {len(doc['merged_from'])} file(s): [the commands that made them](#merged-from) |"]
            if doc.get("merged_from")
            else []
        ),
        f"| status | {_status(doc, rows)} |",
        f"| run time | {_run_time(doc, rows)} |",
        "| host | " + "; ".join(_esc(_host_line(h)) for h in (doc.get("hosts") or [doc.get("host") or {}])) + " |",
        "| tools | " + ", ".join(f"{name} {tools.get(name) or '—'}" for name in SHOWN_TOOLS) + " |",
        f"| settings | {_esc(_settings_line(doc['settings'], rows))} |",
        "| selection | "
        + (
            "each merged file's, [with its command](#merged-from)"
            if doc.get("merged_from")
            else _esc(_selection_line(doc.get("selection") or {}))
        )
        + " |",
    ]


def _at_commit(commit: str | None) -> str:
    if not commit:
        return ""
    return f" at exporter commit `{commit[:12]}{'-dirty' if commit.endswith('-dirty') else ''}`"


def _status(doc: dict, rows: list[dict]) -> str:
    """Complete, or how many builds are done of those planned, and (when few) which are not."""
    done = len(rows)
    if doc.get("complete"):
        return f"complete: {done} of {doc.get('planned_rows', done)} builds (weight × target)"
    have = {(r["weight"], r["target"]) for r in rows}
    missing = [f"{weight} × {target}" for weight, target in doc.get("planned") or () if (weight, target) not in have]
    return (
        f"**partial**: {done} of {doc.get('planned_rows', '?')} builds (weight × target) done"
        + (" — the sweep was interrupted" if doc.get("interrupted") else " — the sweep is running or was stopped")
        + (f"; not built: {', '.join(missing)}" if 0 < len(missing) <= 10 else "")
    )


def _run_time(doc: dict, rows: list[dict]) -> str:
    """The sweep's wall clock (over its runs, when resumed) and the builds' time in all."""
    run = doc.get("run") or {}
    built_s = sum((r.get("seconds") or 0) + _earlier_s(r) for r in rows)
    return (
        f"{_duration(run.get('total_wall_s', run.get('wall_s')))} wall clock"
        + (
            f" over {len(run['earlier_runs']) + 1} runs (resumed after an interruption; this one "
            f"{_duration(run.get('wall_s'))})"
            if run.get("earlier_runs")
            else ""
        )
        + (" (merged: the longest of its files' runs)" if doc.get("merged_from") else "")
        + f"; {_duration(built_s)} of builds in all"
        + (
            f" ({run.get('rows_from_cache')} rows from the row cache, timed when first built)"
            if run.get("rows_from_cache")
            else ""
        )
    )


# --- the sections under it -------------------------------------------------------------------------------------


def _summary_section(rows: list[dict]) -> list[str]:
    """Builds by how they ended and artifacts by outcome, per target and task; then the failures by kind."""
    groups = summary(rows)
    lines = [
        "",
        "## Summary",
        "",
        "Builds (weight × target) by how they ended, and artifacts by outcome.",
        "",
        "| target | task | built | stopped | ⛔ refused | ⏭ skipped | "
        + " | ".join(SYMBOLS[k] for k in ORDER if k != "skipped")
        + " |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * (len(ORDER) - 1),
    ]
    for g in groups:
        a = g["artifacts"]
        lines.append(
            f"| {g['target']} | {g['task']} | {g['built']} | {g['stopped']} | {g['refused']} | {g['skipped']} | "
            + " | ".join(str(a[k]) for k in ORDER if k != "skipped")
            + " |"
        )
    return lines + _failure_kinds(groups)


def _failure_kinds(groups: list[dict]) -> list[str]:
    """Per target, the failed artifacts by kind (summary's groups), the commonest first."""
    kinds = Counter()
    for g in groups:
        for kind, n in g["failures"].items():
            kinds[(g["target"], kind)] += n
    if not kinds:
        return []
    lines = [
        "",
        "Failures by kind (❎ validation: a threshold broken; ❎ ill-conditioned reference: eager itself, its "
        "tensors rounded to the artifact's precision, breaks the same thresholds, so the failure is the random "
        "model's, not the export's; ❎ quantized weight: a torchvision int8 weight, run as it is in eager PyTorch, "
        "breaks the same thresholds against its float model; ❎ degenerate reference: eager's outputs barely "
        "vary across the inputs, so agreement with it proves nothing; ❎ runtime error: made, but its runtime fails on "
        "a validation input):",
        "",
        "| target | kind | artifacts |",
        "|---|---|---:|",
    ]
    for (target, kind), n in sorted(kinds.items(), key=lambda kv: (_order(kv[0][0], TARGET_ORDER), -kv[1], kv[0][1])):
        lines.append(f"| {target} | {kind} | {n} |")
    return lines


def _target_section(target: str, rows: list[dict], trained: bool) -> list[str]:
    """A target's table: a row per weight built (or stopped), a column per artifact; none when nothing was built."""
    built = [r for r in rows if r["target"] == target and r["outcome"] in ("built", "stopped")]
    if not built:
        return []
    format_of = {c["name"]: c.get("format") for r in built for c in r["cells"]}
    formats = list(dict.fromkeys(format_of.values()))  # a format's precisions side by side, also where a later
    # sweep added its column (`_with_columns`)
    columns = sorted(format_of, key=lambda name: formats.index(format_of[name]))
    has_pte = any(c.get("delegation") for r in built for c in r["cells"])
    lines = [
        "",
        f"## {target}",
        "",
        "| weight | task | params (M) | build s | "
        + ("eager acc@1 | " if trained else "")
        + " | ".join(columns)
        + (" | ops outside XNNPACK |" if has_pte else " |"),
        "|---|---|---:|---:|" + ("---:|" if trained else "") + "---|" * len(columns) + ("---|" if has_pte else ""),
    ]
    for r in built:
        by_name = {c["name"]: c for c in r["cells"]}
        cells = [cell_text(by_name[name]) if name in by_name else "" for name in columns]
        eager = _eager_acc1(r["cells"])
        size = r.get("classifier_size")
        lines.append(
            f"| {_esc(r['weight'])}{f' ({size[0]}×{size[1]})' if size else ''} | {r['task']} | {_params(r)} | "
            f"{_build_s_text(r)} | "
            + ((f"{eager:.1f} | " if eager is not None else "— | ") if trained else "")
            + " | ".join(_esc(c) for c in cells)
            + (f" | {_esc(_outside_xnnpack(r['cells']))} |" if has_pte else " |")
        )
    return lines


def _params(row: dict) -> str:
    return f"{row['params'] / 1e6:.1f}" if row.get("params") else "—"


def _refused_and_skipped_sections(rows: list[dict]) -> list[str]:
    """The weights refused by design (⛔) and skipped for size (⏭), each once, with why."""
    lines = []
    for outcome, heading in (("refused", "Refused by design (⛔)"), ("skipped", "Skipped (⏭)")):
        seen = {}
        for r in rows:
            if r["outcome"] == outcome:
                seen.setdefault(r["weight"], r)
        if seen:
            lines += ["", f"## {heading}", "", "| weight | task | params (M) | why |", "|---|---|---:|---|"]
            for r in seen.values():
                lines.append(f"| {_esc(r['weight'])} | {r['task']} | {_params(r)} | {_esc(r['reason'])} |")
    return lines


def _failures_section(rows: list[dict]) -> list[str]:
    """Every ❎, ❌ and ⏱ artifact with the first line of its reason and, for ❎, its floor."""
    failures = [(r, c) for r in rows for c in r["cells"] if c["outcome"] in ("failed", "export", "time")]
    if not failures:
        return []
    lines = [
        "",
        "## Failures",
        "",
        "Every ❎, ❌ and ⏱ artifact with the first line of its reason and, for ❎, what "
        "eager reaches with its tensors rounded to the artifact's precision (its floor).",
        "",
        "| weight | target | artifact | | kind | first line | floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, c in failures:
        lines.append(
            f"| {_esc(r['weight'])} | {r['target']} | {c['name']} | {SYMBOLS[c['outcome']]} | "
            f"{_esc(c.get('kind') or '')} | {_esc((c.get('reason') or '')[:240])} | {_esc(floor_text(r, c))} |"
        )
    return lines


def _stopped_section(rows: list[dict]) -> list[str]:
    """The builds stopped (time limit, killed), after how long and why."""
    stopped = [r for r in rows if r["outcome"] == "stopped"]
    if not stopped:
        return []
    lines = ["", "## Stopped builds", "", "| weight | target | after | why |", "|---|---|---:|---|"]
    for r in stopped:
        lines.append(
            f"| {_esc(r['weight'])} | {r['target']} | {r.get('seconds') or 0:.0f} s | "
            f"{_esc((r.get('reason') or '')[:240])} |"
        )
    return lines


def _merged_from_section(doc: dict, root: str | None) -> list[str]:
    """Each sweep whose rows a merged table holds, once: its command, commit, host and day, and what it selected."""
    if not doc.get("merged_from"):
        return []
    lines = [
        "",
        "## Merged from",
        "",
        "Each sweep whose rows this table holds (a row built again later replaces "
        "the earlier one), with what it selected:",
        "",
    ]
    made = dict.fromkeys((_provenance(m, root), _selection_line(m.get("selection") or {})) for m in doc["merged_from"])
    return lines + [f"- {_esc(command)}: {_esc(selection)}" for command, selection in made]


# --- paths on the page -------------------------------------------------------------------------------------------


def _commands(doc: dict) -> list[str]:
    """The commands the page shows: the document's own and each merged file's."""
    return [c for c in (doc.get("command"), *((m.get("command") for m in doc.get("merged_from") or ()))) if c]


def _paths_root(doc: dict) -> str | None:
    """The deepest folder holding every absolute path in the page's commands (the sweep machine's own folders), or
    None when they name none: the page shows each path relative to it, which says the same on any machine."""
    found = [word for command in _commands(doc) for word in _words(command) if word.startswith("/")]
    return posixpath.commonpath([posixpath.dirname(path) for path in found]) if found else None


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # unbalanced quotes: not a command line shlex made; shown as it is
        return []


def _portable(command: str | None, root: str | None) -> str | None:
    """`command` with each absolute path in it shown relative to `root` (_paths_root)."""
    words = _words(command) if command and root else []
    if not any(word.startswith("/") for word in words):
        return command
    return shlex.join(posixpath.relpath(word, root) if word.startswith("/") else word for word in words)
