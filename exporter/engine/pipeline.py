"""The work behind `exporter build` and `exporter validate`: export, validate, write.

Imported only when a build is not served whole from the cache (it needs torch)."""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import datetime
import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..precision import CALIBRATED, Precision
from .. import __version__, data, files, validation, weights
from ..release import html_report, manifest, previews, recommend, report
from ..results import ArtifactResult, CacheUse, Eager, Kind, Manifest, Reason, Status, Weight, kinds, texts
from . import bundled_program_step, cache, conditioning, default_out, memory_profile, profiles, validate_on_arm
from . import validate_sizes
from .plan import ArtifactSpec, Plan, export_order, make_all, make as make_plan
from ..tasks import Task, image_input
from ..quant import Calibration
from ..quant.calibration import BACKEND_SETTINGS
from .request import BuildRequest, Overrides
from .cache import BuildCache
from .context import BuildContext, SharedContext, digests_of, inputs_as_bytes
from ..errors import UsageError
from ..thresholds import MIN_INPUTS
from ..formats import FORMATS, RuntimeUnavailable
from ..formats.interface import SharedProxy
from ..progress import Progress


def _check_enough(inputs: data.Inputs, path: Path | None, calibrated: list[str], calib_size: int) -> None:
    """A --data folder too small to split into validation inputs (and calibration ones, for int8) is refused
    before anything is written, rather than judged on one input or calibrated on none."""
    validation_inputs, calibration_inputs = len(inputs.validation), len(inputs.calibration)
    if validation_inputs >= MIN_INPUTS and (calibration_inputs or not calibrated):
        return
    needed, why = MIN_INPUTS, f"{MIN_INPUTS} to validate on"
    if calib_size:  # the split sets one aside for calibration whenever calibration images are asked for
        needed += 1
        why += (
            f", 1 to calibrate {', '.join(calibrated)}"
            if calibrated
            else "; --calib-size 0 sets none aside to calibrate"
        )
    raise UsageError(
        f"--data {path} has {validation_inputs + calibration_inputs} usable item(s); "
        f"this build needs at least {needed} ({why})"
    )


def _start_session(
    loaded: weights.LoadedModel,
    task: Task,
    inputs: data.Inputs,
    plans: list[Plan],
    progress: Progress,
    build_cache: BuildCache | None = None,
) -> SharedContext:
    """Eager's reference on the validation inputs (from the cache when it was run before), and the inputs as bytes
    where any of `plans` takes them: what those targets share."""
    torch.set_num_threads(plans[0].latency.threads)
    build_cache = build_cache or BuildCache(None)
    digests = digests_of(loaded, task, inputs)
    reference_key = cache.key(
        kind="eager", **{k: digests[k] for k in ("checkpoint", "reference", "model", "task", "validation", "tools")}
    )
    with progress.step("eager reference"):
        reference = build_cache.fetch_tensor(reference_key)
        if reference is None:
            reference = validation.run_all(loaded.eager, inputs.validation)
            build_cache.store_tensor(reference_key, reference)
        else:
            build_cache.events.append("eager reference reused from the cache")
    broken = validation.non_finite_inputs(reference)
    if broken:  # nothing can be judged against it: refused before any artifact (or file) is made
        raise UsageError(
            f"checkpoint {loaded.checkpoint.path}: eager's outputs are NaN or infinite on {broken} of "
            f"{len(reference)} validation inputs; no artifact can be validated against them"
        )
    takes_bytes = any(plan.input_format == image_input.BYTES for plan in plans)
    return SharedContext(
        loaded=loaded,
        task=task,
        inputs=inputs,
        byte_inputs=inputs_as_bytes(loaded, task, inputs) if takes_bytes else None,  # refused now if not whole bytes
        reference=reference,
        eager_accuracy=task.labeled(reference, inputs.labels) if inputs.labels is not None else None,
        digests=digests,
        cache=build_cache,
    )


def _evaluate(
    session: BuildContext, runner, thresholds: dict, fed: torch.Tensor, timed: bool = True
) -> tuple[dict, torch.Tensor]:
    """The contract for `runner`, fed `fed` (the validation inputs as it takes them)."""
    reference = validation.EagerReference(
        session.task,
        session.eager,
        session.inputs.validation,
        session.reference,
        session.inputs.labels,
        session.eager_accuracy,
        session.latency["warmup"],
        session.latency["iterations"],
        session.eager_baseline,
    )
    metrics, outputs = validation.evaluate(reference, runner, thresholds, timed, fed=fed)
    # a runtime's own thread setting may have changed torch's; restore it for eager
    torch.set_num_threads(session.latency["threads"])
    return metrics, outputs


VALIDATION_FIELDS = (  # what a validation sets on an artifact (and the cache keeps of it)
    "status",
    "reasons",
    "fidelity",
    "outlier_inputs",
    "golden_fidelity",
    "accuracy",
    "latency_ms",
    "eager_latency_ms",
    "speedup_vs_eager",
    "latency_conditions",
    "proxy",
    "proxy_unavailable",
    "preview",
    "preview_rows",
)
GOLDEN_BYTES = "inputs_uint8.npy"  # golden/'s inputs as a uint8-nhwc artifact takes them


def _validate(session: BuildContext, entry: ArtifactResult, step: str = "") -> None:
    """Validation, reusing an earlier identical one (same artifact bytes, inputs, thresholds, host
    and thread settings) from the cache; the manifest says when it did. A cached latency judged unreliable
    (hostload: a busy host) is never served: its fidelity is, and the latency is timed again."""
    from .. import hostload

    out = session.out
    # a format whose stand-ins for an unavailable runtime changed says so, and is not served the older ones
    proxies = FORMATS[entry.format].format().proxies_version
    digest = cache.key(
        kind="validation",
        artifact=entry.sha256,
        thresholds=entry.thresholds,
        latency=session.latency,
        golden=session.golden_rows,
        preview=previews.VERSION,
        contract=validation.CONTRACT,
        **({"proxies": proxies} if proxies else {}),
        cpu=manifest.host(session.latency["threads"])["cpu"],
        **{k: session.digests[k] for k in ("validation", "labels", "tools", "checkpoint", "reference", "task")},
    )
    cached = session.cache.fetch_json("validations", digest)
    if cached is not None:
        picture = cached.pop("preview_png", None)
        if picture is not None:
            (out / "previews").mkdir(exist_ok=True)
            with files.atomic_path(out / cached["preview"]) as tmp:
                tmp.write_bytes(base64.b64decode(picture))
        entry.update(cached, validation_reused_from_cache=True)  # its reasons stored as JSON records
        noisy = hostload.summary(entry.latency_conditions or {})
        if entry.latency_ms and not noisy:  # its speedup against this build's eager baseline, judged with it
            entry.update(_against_baseline(session, entry))
            noisy = hostload.summary(entry.latency_conditions)
        if not noisy:
            session.cache.events.append(f"{entry.name}: validation results reused from the cache")
            return
        # fidelity is settled; a latency taken on a busy host is not: timed again, and the record replaced
        with session.progress.step(f"{session.prefix}time {entry.name}{step} again"):
            runner = FORMATS[entry.format].format().load(out / entry.path, session.latency["threads"])
            entry.update(
                validation.latency_against_eager(
                    runner,
                    session.eager,
                    session.inputs.validation[:1],
                    session.latency["warmup"],
                    session.latency["iterations"],
                    session.latency["threads"],
                    session.latency.get("max_spread"),
                    fed=session.fed_to(entry.format).validation[:1],
                    baseline=session.eager_baseline(),
                )
            )
        torch.set_num_threads(session.latency["threads"])
        session.cache.events.append(
            f"{entry.name}: validation results reused from the cache, latency measured "
            f"again (the cached one was unreliable: {noisy})"
        )
    else:
        if not _run_validation(session, entry, step):
            return  # not kept: what stopped it may be this host's (memory), not the artifact's
        if entry.latency_conditions:  # judged again with this profile's max_spread
            entry.latency_conditions = hostload.judged(
                entry.latency_conditions, session.latency["threads"], session.latency.get("max_spread")
            )
    record = entry.fields(VALIDATION_FIELDS)
    if entry.preview is not None:
        record["preview_png"] = base64.b64encode((out / entry.preview).read_bytes()).decode()
    session.cache.store_json("validations", digest, record)


def _against_baseline(session: BuildContext, entry: ArtifactResult) -> dict:
    """A cached validation's latency restated against this build's eager baseline (validation.against_baseline)."""
    fields = entry.fields(("latency_ms", "latency_conditions"))
    return validation.against_baseline(
        fields, session.eager_baseline(), session.latency["threads"], session.latency.get("max_spread")
    )


def _run_validation(session: BuildContext, entry: ArtifactResult, step: str = "") -> bool:
    """Whether the artifact was run (or, unavailable here, said why); one that loads or runs on no or only some
    validation inputs has failed, with the runtime's error."""
    fmt = FORMATS[entry.format].format()
    with session.progress.step(f"{session.prefix}validate {entry.name}{step}") as shown:
        try:
            runner = fmt.load(session.out / entry.path, session.latency["threads"])
        except UsageError:
            raise
        except RuntimeUnavailable as e:
            shown.unavailable(str(e))
            entry.update(status=Status.UNAVAILABLE, reasons=[Reason(Kind.UNAVAILABLE_HERE, f"not validated: {e}")])
            if fmt.proxies is not None:
                # Stand-ins (e.g. the package's weights put back into eager): labelled proxy, never
                # reported as the runtime's own numbers, and they do not decide the status. Not timed:
                # eager in fp16 on a CPU says nothing about Core ML's speed (and takes seconds per image).
                try:
                    proxies = fmt.proxies(session.out / entry.path, session.loaded.model)
                except ValueError as e:  # a stand-in that cannot be made says why; the artifact is not failed
                    entry.proxy_unavailable = str(e)
                    return True
                entry.update(
                    proxy={label: _proxy_metrics(session, p, entry.thresholds) for label, p in proxies.items()}
                )
            return True
        except Exception as e:  # made, but its runtime refuses it: a finding about this artifact, as an export's is
            entry.update(status=Status.FAILED, reasons=[Reason(Kind.DOES_NOT_LOAD, f"does not load: {_first_line(e)}")])
            return False
        try:
            fed = session.fed_to(entry.format).validation
            metrics, outputs = _evaluate(session, _reporting_failures(runner), entry.thresholds, fed)
        except ArtifactRunFailed as e:  # e.g. ONNX Runtime failing on one image's shapes
            torch.set_num_threads(session.latency["threads"])
            reason = Reason(Kind.DOES_NOT_RUN, f"does not run on every validation input: {e}")
            entry.update(status=Status.FAILED, reasons=[reason])
            return False
        entry.update(metrics)
        conditioning.note_ill_conditioned(session, entry)  # a failed fidelity: is eager that far off at this precision?
        if session.plan.validate.aarch64_cpus:
            session.x86_outputs[entry.name] = outputs
        # what a device's run of this artifact on golden/ is held to (device_validate.py)
        rows = session.golden_rows
        entry.golden_fidelity = session.task.fidelity(session.reference[rows], outputs[rows])
        _write_preview(session, entry, outputs)
        return True


class ArtifactRunFailed(Exception):
    """The artifact's runtime raised (not the exporter's own metrics or eager): its error's first line."""


def _reporting_failures(runner):
    def run(x):
        try:
            return runner(x)
        except Exception as e:
            raise ArtifactRunFailed(_first_line(e)) from e

    return run


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def _proxy_metrics(session: BuildContext, proxy, thresholds: dict) -> dict:
    """A proxy's metrics; one every artifact shares (eager in fp16 for each fp16 Core ML package: about 2 s an
    SSDlite image on this CPU's half-precision convolutions) is evaluated once per build."""
    if not isinstance(proxy, SharedProxy):
        return _evaluate(session, proxy, thresholds, session.inputs.validation, timed=False)[0]
    key = (proxy.shared_key, json.dumps(thresholds, sort_keys=True))
    if key not in session.shared_proxies:
        session.shared_proxies[key] = _evaluate(session, proxy, thresholds, session.inputs.validation, timed=False)[0]
    return copy.deepcopy(session.shared_proxies[key])


def _write_preview(session: BuildContext, entry: ArtifactResult, outputs: torch.Tensor) -> None:
    """The task's pictures of the validation inputs where this artifact departs most from eager (eager beside
    the artifact), with `preview_rows` naming them; `preview_rows: []` and no picture when the artifact's
    outputs are bit-identical to eager's on every input."""
    entry.clear("preview", "preview_rows")  # `exporter validate` re-draws over an earlier run's entry
    picture, rows = previews.draw(
        session.task,
        session.inputs.validation,
        session.reference,
        outputs,
        session.task.preprocessing(session.loaded.weights),
        list(session.loaded.labels),
    )
    if picture is None and rows:  # the task draws no pictures
        return
    entry.preview_rows = rows
    if picture is None:
        return
    path = Path("previews") / f"{entry.name}.png"
    (session.out / "previews").mkdir(exist_ok=True)
    with files.atomic_path(session.out / path) as tmp:
        picture.save(tmp, format="PNG")
    entry.preview = path.as_posix()


def _new_entry(session: BuildContext, spec: ArtifactSpec) -> ArtifactResult:
    return ArtifactResult(
        spec.label, spec.format, spec.precision, thresholds=session.plan.thresholds_for(spec.precision)
    )


def _export(session: BuildContext, spec: ArtifactSpec) -> ArtifactResult:
    fmt = FORMATS[spec.format].format()
    model_name = session.loaded.model_name
    name = spec.label
    filename = f"{model_name}_{name}{fmt.suffix}"
    entry = _new_entry(session, spec)
    refusal = _refused_by_design(spec, session.loaded.quantized, type(session.task))
    if refusal:
        entry.update(status=Status.UNAVAILABLE, reasons=[refusal])
        return entry
    if spec.precision not in fmt.precisions:
        offers = f"{spec.format} does not offer {spec.precision} (it offers {', '.join(fmt.precisions)})"
        entry.reasons = [Reason(Kind.NOT_OFFERED, offers)]
        return entry
    calibration = session.calibration(spec.precision, spec.format, session.progress.note)
    if not _export_into(session, spec, fmt, entry, calibration, session.out / filename):
        return entry
    _validate(session, entry)
    remade = fmt.per_inference_ranges
    calibration = remade(calibration, entry.details) if remade and _ranges_did_not_hold(entry) else None
    if calibration is not None:
        entry = _remake_with_per_inference_ranges(session, spec, fmt, entry, calibration)
    validate_sizes.add_rows(session, spec, entry)
    bundled_program_step.add_golden_program(session, entry)
    memory_profile.measure(session, entry)
    return entry


def _export_into(
    session: BuildContext,
    spec: ArtifactSpec,
    fmt,
    entry: ArtifactResult,
    calibration: Calibration | None,
    path: Path,
    step: str = "",
) -> bool:
    """Export (or fetch from the cache) the artifact into `path`; whether it was made (if not, `entry` says why)."""
    label = f"{session.prefix}export {entry.name}{step}"
    example = session.fed_to(spec.format).example
    byte_input = {"input": image_input.BYTES} if session.format_takes_bytes(spec.format) else {}
    digest = cache.key(
        kind="artifact",
        format=spec.format,
        precision=spec.precision,
        options=dict(spec.options),
        example=list(example.shape),
        example_values=cache.tensors_digest([example]),
        **byte_input,
        # every setting, whichever format reads it (without dynamic_ranges, a static .pte was
        # reused for a build that asked for dynamic ranges)
        quantization=calibration.describe(BACKEND_SETTINGS) if calibration is not None else None,
        # what an export reads: not the validation inputs or their labels beyond the example (the same artifact
        # serves a build that validates on more or fewer of them)
        **{k: v for k, v in session.digests.items() if k not in ("validation", "labels")},
    )
    try:
        with session.progress.step(label, unavailable=RuntimeUnavailable), files.atomic_path(path) as tmp:
            details = session.cache.fetch_artifact(digest, tmp)
            if details is not None:
                entry.details, entry.artifact_reused_from_cache = details, True
                session.cache.events.append(f"{entry.name}: artifact reused from the cache")
            else:
                entry.details = fmt.export(
                    session.graph_for(spec.format),
                    example,
                    spec.precision,
                    calibration,
                    tmp,
                    session.meta,
                    **dict(spec.options),
                )
                session.cache.store_artifact(digest, tmp, entry.details)
    except UsageError:
        raise
    except RuntimeUnavailable as e:
        entry.update(status=Status.UNAVAILABLE, reasons=[Reason(Kind.UNAVAILABLE_HERE, f"not built on this host: {e}")])
        memory_profile.measure(session, entry)  # not measured either: says why
        return False
    except Exception as e:  # a conversion failure is a finding about this artifact, not a crash
        kind = Kind.DISK_FULL if cache.disk_full(e) else Kind.EXPORT_FAILED  # a full disk: the host's, not the model's
        entry.reasons = [Reason(kind, f"export failed: {_first_line(e)}")]
        return False
    entry.export_s = session.progress.timings.get(label)
    entry.update(path=path.name, sha256=files.sha256(path), size_bytes=files.size(path))
    entry.input = session.describe_fed(spec.format, example)
    if bounds := validate_sizes.bounds_of(spec):  # any height and width within them
        entry.input = dataclasses.replace(entry.input, size_range=list(bounds))
    return True


def _ranges_did_not_hold(entry: ArtifactResult) -> bool:
    """An int8 artifact whose search met its budget on the check images broke only thresholds on the validation
    inputs (not a degenerate reference, too few inputs or non-finite outputs, which no ranges change)."""
    quantization = entry.details.get("quantization") or {}
    return (
        entry.precision == Precision.INT8
        and entry.status is Status.FAILED
        and entry.fidelity is not None
        and bool(quantization.get("meets_budget"))
        and bool(entry.reasons)
        and all(
            r.kind is Kind.THRESHOLD and r.metric in entry.thresholds
            for r in entry.reasons
            if r.kind is not Kind.ILL_CONDITIONED_REFERENCE  # a finding about eager, which ranges may still beat
        )
    )


REMADE = " (ranges per inference)"  # the remade artifact's steps in the progress and timings


def _remake_with_per_inference_ranges(
    session: BuildContext,
    spec: ArtifactSpec,
    fmt,
    first: ArtifactResult,
    calibration,
) -> ArtifactResult:
    """The artifact made again with ranges chosen per inference (beside the first, under a staging name), validated
    on the same inputs and moved over the first only if it passes. Either way the manifest has both verdicts
    (details.validation_retry)."""
    session.progress.note(
        f"  {first.name}: calibrated int8 ranges met the budget on the check images and failed on the "
        f"validation inputs ({'; '.join(texts(first.reasons))}): made again with ranges chosen per inference"
    )
    staged = session.out / f".per-inference-{first.path}"
    kept = _FirstValidation.set_aside(session, first)
    try:
        remade = _remade(session, spec, fmt, calibration, staged)
        if remade.passed():
            os.replace(staged, session.out / first.path)
            remade.path = first.path
            remade.details["validation_retry"] = {
                "kept": "per-inference ranges",
                "first": _retry_summary(first),
                "note": "the calibrated ranges met the budget on the search's check images and not on the validation "
                "inputs (inputs the calibration images did not cover); the artifact was made again with ranges "
                "chosen per inference and judged on the same inputs",
            }
            return remade
    finally:
        staged.unlink(missing_ok=True)
    kept.restore(session, first)
    first.details["validation_retry"] = {
        "kept": "calibrated ranges",
        "per_inference": {"status": remade.status, "reasons": remade.reasons, "fidelity": remade.fidelity},
        "note": "made again with ranges chosen per inference after the calibrated ranges failed validation; that "
        "artifact did not pass either, so the first is kept",
    }
    return first


def _remade(session: BuildContext, spec: ArtifactSpec, fmt, calibration, staged: Path) -> ArtifactResult:
    """The artifact exported into `staged` with the per-inference calibration and validated (unless its program was
    lowered wrong: then it is not one to keep)."""
    remade = _new_entry(session, spec)
    if not _export_into(session, spec, fmt, remade, calibration, staged, REMADE):
        return remade
    if (remade.details.get("quantization") or {}).get("lowering_fault"):
        why = "its program with ranges chosen per inference was lowered wrong (details.quantization.lowering_fault)"
        remade.update(status=Status.FAILED, reasons=[Reason(Kind.LOWERING_FAULT, why)], fidelity=None)
    else:
        _validate(session, remade, REMADE)
    return remade


def _retry_summary(first: ArtifactResult) -> dict:
    """The first (calibrated) artifact's verdict, kept in the remade one's details."""
    summary = {
        "ranges": (first.details["quantization"].get("after") or {}).get("ranges"),
        "status": first.status,
        "reasons": first.reasons,
        "fidelity": first.fidelity,
        "export_s": first.export_s,
    }
    return {**summary, "outlier_inputs": first.outlier_inputs} if first.outlier_inputs else summary


@dataclass
class _FirstValidation:
    """What validating the remade artifact overwrites of the first one's (its preview picture, its outputs for the
    aarch64 rows), set aside and put back if the first is kept."""

    preview: Path
    picture: bytes | None
    outputs: torch.Tensor | None

    @classmethod
    def set_aside(cls, session: BuildContext, first: ArtifactResult) -> _FirstValidation:
        preview = session.out / "previews" / f"{first.name}.png"
        picture = preview.read_bytes() if preview.is_file() else None
        # popped: a cached validation of the remade one stores no outputs, and must not leave the first's
        return cls(preview, picture, session.x86_outputs.pop(first.name, None))

    def restore(self, session: BuildContext, first: ArtifactResult) -> None:
        if self.picture is not None:
            with files.atomic_path(self.preview) as tmp:
                tmp.write_bytes(self.picture)
        elif first.preview is None:
            self.preview.unlink(missing_ok=True)
        session.x86_outputs.pop(first.name, None)
        if self.outputs is not None:
            session.x86_outputs[first.name] = self.outputs


def _refused_by_design(spec: ArtifactSpec, quantized: bool, task_class: type[Task]) -> Reason | None:
    """Why this artifact is not made from the weight, by design (its format cannot take an eager-quantized model,
    or the task's graph), or None."""
    why = FORMATS[spec.format].no_quantized_eager if quantized else None
    if why:
        return Reason(Kind.NOT_MADE, f"cannot take an eager-quantized model: {why}")
    why = task_class.format_refusal(spec.format, spec.precision)
    return Reason(Kind.NOT_MADE, f"cannot take {_a(task_class.name)} graph: {why}") if why else None


def _artifacts(plan: Plan, quantized: bool) -> tuple[ArtifactSpec, ...]:
    return (plan.for_eager_quantized() if quantized else plan).artifacts


def whole_target_refusal(resolved, task_class: type[Task], plan: Plan) -> str | None:
    """Why the target would make none of its artifacts from this weight (every one refused by design), or None:
    such a build would pass with nothing to ship."""
    quantized = weights.is_quantized(resolved)
    reasons = {}
    for spec in _artifacts(plan, quantized):
        why = _refused_by_design(spec, quantized, task_class)
        if not why:
            return None
        reasons.setdefault(f"{spec.format}: {why.text}")
    return "; ".join(reasons)


def _preflight(plan: Plan) -> None:
    """Missing extras and impossible options fail here, before anything is written."""
    if plan.post_build:
        _post_build_function(plan)
    for spec in plan.artifacts:
        try:
            FORMATS[spec.format].format().preflight(spec.precision, **spec.options)
        except RuntimeUnavailable:
            pass  # reported per artifact by export
        except TypeError as e:
            raise UsageError(f"target {plan.target}: bad options for {spec.format}: {e}") from None


def _write_device_files(out: Path, task) -> None:
    for name, text in task.device_files().items():
        files.write_text(out / name, text)


def _write_golden(session: BuildContext) -> None:
    """The task's golden validation inputs and what eager made of them (the task says which files), for on-device checks."""
    import numpy as np

    golden = session.out / "golden"
    golden.mkdir(exist_ok=True)
    rows = session.golden_rows
    labels = session.inputs.labels[rows] if session.inputs.labels is not None else None
    contents = session.task.golden(session.inputs.validation[rows], session.reference[rows], labels)
    if session.takes_bytes:  # the same images as a uint8-nhwc artifact takes them
        contents[GOLDEN_BYTES] = session.fed.validation[rows].numpy()
    for name, content in contents.items():
        if name.endswith(".json"):
            files.write_text(golden / name, json.dumps(content) + "\n")
            continue
        with files.atomic_path(golden / name) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, content)


def _post_build(session: BuildContext, doc: Manifest) -> None:
    if not session.plan.post_build:
        return
    _post_build_function(session.plan)(session.out, doc, session)


def _post_build_function(plan: Plan):
    import importlib

    module_name, _, name = plan.post_build.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UsageError(f"target {plan.target}: post_build {plan.post_build!r} cannot be loaded ({e})") from None
    if not callable(function):
        raise UsageError(f"target {plan.target}: post_build {plan.post_build!r} is not a function")
    return function


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _timings(progress: Progress, prefix: str) -> dict:
    """Shared steps plus this target's own (labels of other targets carry their prefix)."""
    return {k: v for k, v in progress.timings.items() if k.startswith(prefix) or ": " not in k}


def _finish(out: Path, doc: Manifest, progress: Progress, prefix: str = "") -> dict:
    """Write the manifest and the reports; the manifest as its JSON file holds it (what a build returns)."""
    doc.status = doc.overall_status()
    doc.timings_s = _timings(progress, prefix)
    doc.recommended = recommend.recommendation(doc)
    manifest.write(out, doc)
    files.write_text(out / "report.md", report.markdown(doc))
    files.write_text(out / "report.html", html_report.render([doc], [out]))
    return manifest.record(doc)


@dataclass(frozen=True)
class CheckedRequest:
    """A request found buildable on its targets (check_request): what to build, and where."""

    resolved: weights.WeightsEnum
    task_class: type[Task]
    plans: list[Plan]
    classes: list[type[Task]]  # the task class each plan builds (a detector's decode in the graph has its own)
    calibrated: list[str]  # the artifacts calibrated on the --data images, on any target
    base: Path
    outs: list[Path]  # each plan's output directory: `base` itself for one target

    @property
    def single(self) -> bool:
        return len(self.plans) == 1


def check_request(
    request: BuildRequest, targets: list[dict], cache_root: Path | None, progress: Progress
) -> CheckedRequest:
    """Everything that can be wrong with the request, refused (UsageError) before anything is written, and what
    needs no checkpoint before one is downloaded."""
    resolved = weights.resolve(request.weight)
    task_class = weights.task_class(resolved)
    plans, classes = _plans_by_decode(request, resolved, task_class, targets)
    refusals = [whole_target_refusal(resolved, cls, plan) for cls, plan in zip(classes, plans)]
    if all(refusals):  # a target that makes nothing beside one that does says why in its manifest
        why = refusals[0] if len(plans) == 1 else "; ".join(f"{p.target}: {r}" for p, r in zip(plans, refusals))
        raise UsageError(
            f"{weights.canonical_name(resolved)} makes no artifact for target "
            f"{', '.join(p.target for p in plans)}: {why}"
        )
    if task_class.image_bytes_refusal and any(plan.input_format == image_input.BYTES for plan in plans):
        raise UsageError(f"--input-format {image_input.BYTES}: {task_class.image_bytes_refusal}")
    calibrated = _check_calibration(plans, classes, weights.is_quantized(resolved))
    input_size = task_class.input_size_of(resolved, weights.model_name_of(resolved), request.input_size)
    for plan in plans:
        _check_size_range(plan, task_class, input_size)
    if request.data is not None and not Path(request.data).is_dir():
        raise UsageError(f"--data {request.data} is not a directory")
    base = Path(request.out or default_out(weights.canonical_name(resolved), [p.target for p in plans]))
    outs = [base] if len(plans) == 1 else [base / p.target for p in plans]
    for out in [base] if len(plans) == 1 else [base, *outs]:
        files.check_out_dir(out, request.force)
    problem = files.unwritable(cache_root) if cache_root is not None else None
    if problem:  # found now, not when the first result is stored
        raise UsageError(
            f"the exporter's cache {cache_root} ($EXPORTER_CACHE or ~/.cache/exporter) is not writable ({problem}); "
            "set EXPORTER_CACHE to a writable folder or pass --no-cache"
        )
    if _on_aarch64(plans):  # offline with no counting qemu cached: refused before any file
        from .count_on_arm import check_before_build

        check_before_build(plans, request, progress)  # no counts here: said now, not after the build
    return CheckedRequest(resolved, task_class, plans, classes, calibrated, base, outs)


def _check_calibration(plans: list[Plan], classes: list[type[Task]], quantized: bool) -> list[str]:
    """Each target's options checked (_preflight), and its int8 artifacts refused when --calib-size 0 leaves them no
    calibration images; returns the artifacts calibrated on the --data images, on any target."""
    calibrated = []
    for plan, cls in zip(plans, classes):
        _preflight(plan)
        labels = (
            []
            if quantized
            else [
                a.label
                for a in plan.artifacts
                if a.precision in CALIBRATED and not _refused_by_design(a, quantized, cls)
            ]
        )
        if labels and plan.data.calib_size == 0:
            raise UsageError(
                f"target {plan.target}: {', '.join(labels)} need calibration images; --calib-size 0 gives none"
            )
        calibrated += [label for label in labels if label not in calibrated]
    return calibrated


def _on_aarch64(plans: list[Plan]) -> bool:
    return any("aarch64" in plan.validate.arches for plan in plans)


def run(
    request: BuildRequest, targets: list[dict], cache_root: Path | None, progress: Progress
) -> tuple[Path, list[dict]]:
    """Build the target profiles in `targets`, sharing one model load, one calibration set and one eager run;
    returns the output directory and the manifests. See build.build_targets."""
    checked = check_request(request, targets, cache_root, progress)
    if _on_aarch64(checked.plans):
        from .. import aarch64

        with progress.step("aarch64 runner"):
            aarch64.prepare(request.cache_dir, progress, offline=request.offline or None, root=request.aarch64_runners)
    loaded, inputs = _load_weight_and_data(request, checked, progress)
    sessions = _shared_sessions(request, checked, loaded, inputs, cache_root, progress)
    docs = []
    for plan, cls, out in zip(checked.plans, checked.classes, checked.outs):
        prefix = "" if checked.single else f"{plan.target}: "
        session = BuildContext.for_target(sessions[cls], plan, out, progress, prefix)
        docs.append(_whole_or_none(out, functools.partial(_build_one, request, session)))
    if not checked.single:
        typed = [Manifest.from_json(doc) for doc in docs]  # each target's manifest as its JSON file holds it
        files.write_text(checked.base / "report.html", html_report.render(typed, checked.outs))
    return checked.base, docs


def _load_weight_and_data(
    request: BuildRequest, checked: CheckedRequest, progress: Progress
) -> tuple[weights.LoadedModel, data.Inputs]:
    """The weight (the checkpoint downloaded if need be) and the calibration and validation inputs, refused when
    too few; a checkpoint without class names takes the --data folder's when they are as many."""
    with progress.step("load weights"):
        loaded = weights.load(
            request.weight,
            request.checkpoint,
            request.verify,
            request.labels,
            request.offline,
            progress,
            request.float_checkpoint,
        )
    task = checked.task_class.bind(loaded.weights, loaded.model_name, loaded.num_classes, request.input_size)
    with progress.step("load data"):
        inputs = data.load_inputs(request.data, task, loaded.weights, checked.plans[0].data, loaded.labels)
    _check_enough(inputs, request.data, checked.calibrated, checked.plans[0].data.calib_size)
    if request.labels is None and inputs.classes and len(inputs.classes) == loaded.num_classes:
        if loaded.labels == [f"class_{i}" for i in range(loaded.num_classes)]:
            loaded.labels = list(inputs.classes)
    return loaded, inputs


def _shared_sessions(
    request: BuildRequest,
    checked: CheckedRequest,
    loaded: weights.LoadedModel,
    inputs: data.Inputs,
    cache_root: Path | None,
    progress: Progress,
) -> dict[type[Task], SharedContext]:
    """Task class -> what its targets share (eager reference included): a detector's decode in the graph has its own
    eager."""
    sessions = {}
    for cls in dict.fromkeys(checked.classes):
        graph = loaded if cls is checked.task_class else _decoding_in_graph(loaded, cls)
        bound = cls.bind(loaded.weights, loaded.model_name, loaded.num_classes, request.input_size)
        sessions[cls] = _start_session(graph, bound, inputs, checked.plans, progress, BuildCache(cache_root))
    return sessions


def _whole_or_none(out: Path, build):
    """`build()`, one target's build into `out`; when it fails, what it wrote there is removed, its manifest first, so
    that `out` never holds half a build (only a killed build leaves its manifest, with status "building"). A full
    disk or a folder that refuses writes is then one line (exit 2), not a traceback."""
    existed = set(out.iterdir()) if out.is_dir() else None
    try:
        return build()
    except Exception as e:
        _discard(out, existed)
        problem = files.environment_problem(e) or (f"{e} (free some space)" if cache.disk_full(e) else None)
        if problem:
            raise UsageError(f"{problem}; {out} holds no build: what this one wrote was removed") from None
        raise


def _discard(out: Path, existed: set[Path] | None) -> None:
    """Remove what a failed build wrote into `out` (its manifest first, then its own files and whatever was not
    there before it started, `existed`; `out` itself if it made it). Best effort: the disk may be the problem."""
    import shutil

    with contextlib.suppress(OSError):
        (out / "manifest.json").unlink(missing_ok=True)
        manifest.clear_build_files(out)
        for entry in sorted(out.iterdir()):
            if existed is not None and entry in existed:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        if existed is None:
            out.rmdir()


def _plans_by_decode(request: BuildRequest, resolved, task_class: type[Task], targets: list[dict]):
    """Each target's Plan and the task class it builds: a detector whose target asks for its decode in the graph
    ([detection] decode, --detections) builds DetectionsInGraph where a format of the target takes that graph,
    and keeps the raw heads (the plan says why) where none does; refused in one line if no target can."""
    plans = make_all(targets, task_class.name, request.options, task_class.format_options())
    in_graph = task_class.for_decode("graph")
    if in_graph is None:
        if request.detections == "graph":
            raise UsageError(
                f"--detections graph: {weights.canonical_name(resolved)} is {_a(task_class.name)} model; "
                "it returns no detections to decode"
            )
        return plans, [task_class] * len(plans)
    if in_graph is task_class or all(plan.detection_decode == "host" for plan in plans):
        return plans, [task_class] * len(plans)
    plans = make_all(targets, task_class.name, request.options, in_graph.format_options())
    classes, kept = [], {}
    for i, plan in enumerate(plans):
        why = _decode_refusal(in_graph, plan) if plan.detection_decode == "graph" else None
        if why:
            kept[plan.target] = why
            plans[i] = dataclasses.replace(plan, detection_decode="host", decode_kept=why)
        classes.append(in_graph if plans[i].detection_decode == "graph" else task_class)
    if in_graph not in classes:
        raise UsageError(
            f"--detections graph: no format of target {', '.join(kept)} takes it ({'; '.join(kept.values())})"
        )
    return plans, classes


def _note_fixed_size(session: BuildContext, spec: ArtifactSpec, entry: ArtifactResult) -> None:
    """A target that asks for a dynamic size: each artifact whose format keeps the fixed one says so, and why."""
    if not session.plan.size_range or validate_sizes.bounds_of(spec):
        return
    if kinds(entry.reasons) & {Kind.NOT_MADE, Kind.NOT_OFFERED}:
        return
    size = "x".join(map(str, session.task.input_size))
    entry.reasons = [
        *entry.reasons,
        Reason(Kind.NOTE, f"keeps the fixed {size} input: {FORMATS[spec.format].fixed_size}"),
    ]


def _check_size_range(plan: Plan, task_class: type[Task], input_size) -> None:
    """A dynamic size range the task's graph cannot take, or that leaves out the build's own input size, is refused."""
    if not plan.size_range:
        return
    low, high = plan.size_range
    where = f"target {plan.target}: input size range {low}..{high}"
    if task_class.dynamic_size_refusal:
        raise UsageError(f"{where}: {task_class.dynamic_size_refusal}")
    if low < task_class.min_side:
        raise UsageError(
            f"{where}: below this model's smallest side, {task_class.min_side} px (its backbone downsamples by up "
            "to 32)"
        )
    if not all(low <= side <= high for side in input_size):
        raise UsageError(
            f"{where} leaves out the input size {input_size[0]}x{input_size[1]} (--input-size: the calibration and "
            "golden size)"
        )


def _decode_refusal(in_graph: type[Task], plan: Plan) -> str | None:
    """Why no artifact of the plan can end in final detections (formats with one reason named together), or None."""
    by_reason = {}
    for spec in plan.artifacts:
        why = in_graph.format_refusal(spec.format, spec.precision)
        if not why:
            return None
        by_reason.setdefault(why, []).append(spec.format)
    return "; ".join(f"{', '.join(dict.fromkeys(names))}: {why}" for why, names in by_reason.items())


def _decoding_in_graph(loaded: weights.LoadedModel, task_class: type[Task]) -> weights.LoadedModel:
    """The weight with the graph `task_class` exports (the detector's own post-processing inside it)."""
    return dataclasses.replace(loaded, model=task_class.graph(loaded.model), task_class=task_class)


def _note_eager_latency(session: BuildContext, doc: Manifest) -> None:
    """The build's one eager baseline in the manifest (eager.latency), with its spread over the build's rounds."""
    baseline = session.eager_latency(doc.artifacts)
    if baseline is not None:
        doc.eager = dataclasses.replace(doc.eager, latency=baseline)


def _build_one(request: BuildRequest, session: BuildContext) -> dict:
    loaded, inputs, plan, out = session.loaded, session.inputs, session.plan, session.out
    out.mkdir(parents=True, exist_ok=True)
    manifest.clear_build_files(out)
    doc = Manifest(
        schema_version=manifest.SCHEMA_VERSION,
        exporter_version=__version__,
        exporter_commit=manifest.exporter_commit(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=list(sys.argv),
        status=Status.BUILDING,
        weight=Weight(
            name=loaded.weight_name,
            model=loaded.model_name,
            num_classes=loaded.num_classes,
            meta=weights.meta_summary(loaded.weights),
        ),
        task=session.task.describe(),
        checkpoint=loaded.checkpoint,
        preprocessing=image_input.preprocessing(session.task, loaded.weights, plan.input_format),
        labels={
            "file": "labels.txt",
            "count": len(loaded.labels),
            "from_file": str(request.labels) if request.labels else None,
        },
        target=plan.describe(),
        tools=manifest.tool_versions(),
        host=manifest.host(plan.latency.threads),
        data=inputs.description,
        eager=Eager(accuracy=session.eager_accuracy, reference=loaded.reference),
    )
    files.write_text(out / "labels.txt", "".join(f"{label}\n" for label in loaded.labels))
    files.write_text(out / "preprocessing.json", json.dumps(doc.preprocessing, indent=2) + "\n")
    manifest.write(out, doc)
    _write_golden(session)
    _write_device_files(out, session.task)
    specs, made = _artifacts(plan, loaded.quantized), {}
    for i in export_order([spec.precision for spec in specs]):
        made[i] = _export(session, specs[i])
        _note_fixed_size(session, specs[i], made[i])
        doc.artifacts = [made[k] for k in sorted(made)]
        doc.timings_s = _timings(session.progress, session.prefix)
        manifest.write(out, doc)  # only complete artifacts are ever listed
    validate_on_arm.add_rows(
        session,
        doc,
        request.cache_dir,
        request.offline,
        runners=request.aarch64_runners,
        write=lambda: manifest.write(out, doc),
        runner_shown=True,
    )
    _post_build(session, doc)
    _note_eager_latency(session, doc)
    doc.cache = CacheUse(
        root=str(session.cache.root) if session.cache.root else None, events=list(session.cache.events)
    )
    return _finish(out, doc, session.progress, session.prefix)


def _check_before_validating(out: Path, doc: Manifest) -> None:
    """What `validate` refuses before it writes anything: a file the manifest names or promises that is missing,
    outside the build folder or no regular file (manifest.check_build_files), an artifact without a file that does
    not say why it has none, an artifact whose file changed since its build, and a format unknown to this exporter
    or whose extra is not installed. Every artifact is then judged again or keeps the reason it has no file."""
    manifest.check_build_files(out, manifest.record(doc))
    for entry in doc.artifacts:
        if entry.format not in FORMATS:
            raise UsageError(f"artifact {entry.name}: unknown format {entry.format!r} (known: {', '.join(FORMATS)})")
        if entry.path is None:
            continue
        FORMATS[entry.format].format()  # a missing extra, said now rather than after golden/ is rewritten
        path = out / entry.path
        if files.sha256(path) != entry.sha256:
            raise UsageError(f"{path} does not match the sha256 in its manifest (changed or truncated)")


def validate(
    out: Path, data_dir: Path | None, thresholds: list[str], progress: Progress, checkpoint: Path | None
) -> dict:
    """See build.validate_build."""
    doc = manifest.read(out)
    _check_before_validating(out, doc)
    profile = {
        "name": doc.target["name"],
        "path": doc.target["profile"],
        "artifacts": doc.target["artifacts"],
        "thresholds": doc.target["thresholds"],
        "data": doc.target["data"],
        "latency": doc.target["latency"],
        "task": doc.task["name"],
        "validate": doc.target.get("validate", {}),
        "input": doc.target.get("input", {}),
        "detection": {k: v for k, v in doc.target.get("detection", {}).items() if k == "decode"},
    }
    profile = profiles.with_overrides(profile, Overrides(thresholds=tuple(thresholds)))
    profiles.check_precisions([profile], thresholds)
    plan = make_plan(profile, doc.task["name"])
    _preflight(plan)
    with progress.step("load weights"):
        recorded = doc.checkpoint
        reference = doc.eager.reference.checkpoint
        loaded = weights.load(
            doc.weight.name, checkpoint or recorded.path, verify=False, float_checkpoint=reference and reference.path
        )
        if loaded.checkpoint.sha256 != recorded.sha256:
            raise UsageError(f"checkpoint {loaded.checkpoint.path} is not the one this build used (sha256 differs)")
    in_graph = loaded.task_class.for_decode(plan.detection_decode)
    if in_graph is not loaded.task_class:
        loaded = _decoding_in_graph(loaded, in_graph)
    task = loaded.task_class.bind(
        loaded.weights, loaded.model_name, doc.task["num_classes"], tuple(doc.task["input_size"])
    )
    source = data_dir or (None if doc.data["source"] == "synthetic" else Path(doc.data["source"]))
    if source is not None:  # the build's labels, which its class folders were read by
        loaded.labels = weights.read_labels(out / "labels.txt", task.num_classes)
    with progress.step("load data"):
        inputs = data.load_inputs(source, task, loaded.weights, plan.data, loaded.labels)
    session = BuildContext.for_target(_start_session(loaded, task, inputs, [plan], progress), plan, out, progress)
    _write_device_files(out, task)  # what this validation decodes with is what the build ships
    _write_golden(session)  # the inputs golden_fidelity is measured on, whatever --data says now
    doc.task = task.describe()
    doc.target["thresholds"] = plan.describe()["thresholds"]
    doc.data = inputs.description
    doc.eager = Eager(accuracy=session.eager_accuracy, reference=loaded.reference)
    for entry in doc.artifacts:
        entry.thresholds = plan.thresholds_for(entry.precision)
        if entry.path is not None:  # checked above; an artifact without a file keeps why it has none
            entry.clear(*VALIDATION_FIELDS, "aarch64", "bundled_program")
            entry.update(reasons=[], status=Status.FAILED)
            _validate(session, entry)
            spec = next((a for a in plan.artifacts if a.label == entry.name), None)
            if spec is not None:
                validate_sizes.add_rows(session, spec, entry)
            bundled_program_step.add_golden_program(session, entry)
    validate_on_arm.add_rows(session, doc, None, False)
    _note_eager_latency(session, doc)
    doc.validated = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return _finish(out, doc, progress)
