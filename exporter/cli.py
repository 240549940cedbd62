"""The `exporter` command line: parse the request, call the Python API, map outcomes to exit codes."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .errors import UsageError
from .thresholds import MIN_INPUTS

if TYPE_CHECKING:
    from .build import BuildRequest
    from .results import Manifest

# 4096 px a side: past any torchvision weight's size (at most 1333), and 24 synthetic inputs already take 4.8 GB
INPUT_SIDE = click.IntRange(min=1, max=4096)
EXIT_CODES = """Exit codes: 0 every artifact passed; 1 an artifact broke its thresholds
(everything is still written); 2 bad input or environment (nothing is written); 3 the exporter itself
failed (a bug: its traceback is printed)."""
INTERNAL_ERROR = 3


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit, BrokenPipeError):
            raise  # click's own: usage errors, Ctrl-C, a closed pipe
        except Exception as e:  # not exit 1, which a CI job reads as "an artifact broke its thresholds"
            from .files import environment_problem

            problem = environment_problem(e)  # a full disk, a read-only folder: the host's, not a bug
            if problem:
                click.echo(f"error: {problem}", err=True)
                sys.exit(UsageError.exit_code)
            traceback.print_exc()
            first = (str(e).strip().splitlines() or [""])[0][:200]
            click.echo(
                f"error: the exporter failed (a bug; the traceback above is for its report): "
                f"{type(e).__name__}: {first}",
                err=True,
            )
            sys.exit(INTERNAL_ERROR)

    return wrapper


Fill = Callable[[dict, Any], None]  # puts a parameter's value into the keyword arguments of a request


def sets(field: str, convert: Callable[[Any], Any] = lambda value: value) -> Fill:
    """Sets the request's `field` to the parameter's value, converted."""

    def fill(fields: dict, value) -> None:
        fields[field] = convert(value)

    return fill


@dataclass(frozen=True)
class RequestParam:
    """A command's click parameter and where its value goes: into the request (`into`: the name of the field
    it sets, or a Fill) or, with no `into` (or with `to_body`), to the command's body as a parameter of its own."""

    param: click.Parameter
    into: str | Fill | None = None
    to_body: bool = False

    def fill(self, fields: dict, value) -> None:
        if isinstance(self.into, str):
            fields[self.into] = value
        else:
            self.into(fields, value)


def option(*decls: str, into: str | Fill | None = None, to_body: bool = False, **attrs) -> RequestParam:
    """One click option, declared as click.option takes it, and where its value goes (RequestParam)."""
    return RequestParam(click.Option(decls, **attrs), into, to_body)


def request_command(group: click.Group, params: tuple[RequestParam, ...], make_request, **attrs):
    """Makes the decorated body `group`'s command taking `params`; the body is called with the request that
    `make_request` builds from their values (a bad value is one line, exit 2), then the values no field takes."""

    def decorate(body):
        @functools.wraps(body)
        def command(**values):
            fields = {}
            for p in params:
                if p.into is not None:
                    p.fill(fields, values[p.param.name] if p.to_body else values.pop(p.param.name))
            return body(make_request(**fields), **values)

        return group.command(params=[p.param for p in params], **attrs)(one_line_errors(command))

    return decorate


@click.group(epilog=EXIT_CODES)
@click.version_option(package_name="exporter")
def main():
    """Turn a named torchvision weight into verified artifacts for phones and edge devices."""
    _quiet_libraries()


@main.command("list")
@click.option(
    "--task",
    default="classification",
    show_default=True,
    help="classification, segmentation, detection, quantization, video, optical_flow",
)
@click.option(
    "--max-params", type=click.IntRange(min=1), default=None, help="Only weights with at most this many parameters."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@one_line_errors
def list_cmd(task, max_params, as_json):
    """Models and their weights, with their headline metric (acc@1, mIoU, box mAP …), params, GFLOPS and
    file size from meta. Piped (not a terminal), one tab-separated row per weight with a header line."""
    from . import weights

    rows = weights.list_weights(task, max_params)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    columns = ["weight", "metric", "value", "params (M)", "GFLOPS", "MB"] + (
        ["backend"] if task == "quantization" else []
    )
    cells = [
        [
            r["weight"],
            r["metric"] or "—",
            f"{r['value']:.3f}" if r["value"] is not None else "—",
            f"{r['params'] / 1e6:.1f}" if r["params"] else "—",
            f"{r['gflops']:.2f}" if r["gflops"] is not None else "—",
            f"{r['size_mb']:.1f}" if r["size_mb"] is not None else "—",
        ]
        + ([r["backend"] or "—"] if task == "quantization" else [])
        for r in rows
    ]
    if not sys.stdout.isatty():
        for line in [columns, *cells]:
            click.echo("\t".join(line))
        return
    from rich.console import Console
    from rich.table import Table

    # whole weight names however narrow the terminal: the other columns give way
    accuracy = task in ("classification", "quantization")
    table = Table(columns[0], "acc@1" if accuracy else "metric", *columns[3:])
    table.columns[0].no_wrap, table.columns[0].min_width = True, max((len(c[0]) for c in cells), default=6)
    for name, metric, value, *rest in cells:
        table.add_row(name, value if accuracy else f"{metric} {value}", *rest)
    Console().print(table)


@main.command()
@click.argument("weight")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def inspect(weight, as_json):
    """Meta, categories, exact preprocessing and checkpoint (cached or not, where, size) of WEIGHT."""
    from . import weights

    w = weights.resolve(weight)
    checkpoint = weights.checkpoint_status(w)
    try:
        preprocessing = weights.preprocessing_spec(w)
    except UsageError as e:  # a task that cannot be exported: say why instead
        preprocessing = f"not exportable: {e}"
    info = {
        "weight": weights.canonical_name(w),
        "model": weights.model_name_of(w),
        "task": weights.task_of(weights.model_name_of(w)),
        "meta": weights.meta_summary(w),
        "categories": len(w.meta.get("categories") or []),
        "preprocessing": preprocessing,
        "transforms": repr(w.transforms()),
        "url": w.url,
        "checkpoint_path": checkpoint["path"],
        "checkpoint_cached": checkpoint["cached"],
        "checkpoint_size_bytes": checkpoint["size_bytes"],
        "quantization": weights.quantization_summary(w),
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if key == "checkpoint_size_bytes" and value is not None:
            value = f"{value} ({value / 1e6:.1f} MB)"
        elif key == "checkpoint_cached" and not value:
            value = "False (downloaded into checkpoint_path by the first build, unless --offline or EXPORTER_OFFLINE=1)"
        click.echo(f"{key:22} {value}")


def _threshold_help() -> str:
    from .thresholds import TASK_KEYS

    keys = "; ".join(f"{task}: {', '.join(names)}" for task, names in TASK_KEYS.items())
    return f"Override a threshold: [PRECISION.]KEY=VALUE, e.g. int8.psnr_db=35 (repeatable). Keys by task, {keys}."


def _parse_value(raw: str):
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _format_options(fields: dict, raw: tuple[str, ...]) -> None:
    """--option KEY=VALUE... into the request's format options."""
    options = fields.setdefault("options", {})
    for text in raw:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--option {text!r}: expected KEY=VALUE")
        options[key.strip()] = _parse_value(value)


def _format_option(key: str) -> Fill:
    """An option that sets one format option (when given), over an --option of the same key."""

    def fill(fields: dict, value) -> None:
        if value is not None:
            fields.setdefault("options", {})[key] = value

    return fill


def _emit(doc: dict, as_json: bool, quiet: bool, out: Path) -> None:
    """The manifest's JSON record `doc` (what a build returns) on stdout with --json, else its report; exits 1 when
    the build failed."""
    from .release import manifest, report
    from .results import Manifest, Status

    typed = Manifest.from_json(doc)
    if as_json:
        click.echo(manifest.dumps(doc), nl=False)
    elif not quiet:
        click.echo(report.markdown(typed))
        click.echo(f"report: {out / 'report.md'}\nmanifest: {out / 'manifest.json'}")
    if as_json or quiet:
        _say_failures([typed])
    sys.exit(1 if typed.status is Status.FAILED else 0)


def _say_failures(docs: list[Manifest]) -> None:
    """Without the report on the terminal (--quiet, --json), why a build exits 1: a line on stderr per failed
    artifact, with its reasons."""
    from .results import Status, texts

    for doc in docs:
        target = doc.target["name"]
        for artifact in doc.artifacts:
            if artifact.status is Status.FAILED:
                why = "; ".join(texts(artifact.reasons)) or "see the manifest"
                click.echo(f"failed: {target} {artifact.name}: {why}", err=True)


def _build_request(**fields):
    from .build import BuildRequest

    return BuildRequest(**fields)


# `exporter build`'s parameters in --help order, each with the BuildRequest field it fills; --option comes before the
# options that set one format option each, which win over it (as request.options is filled in this order).
BUILD_PARAMS = (
    RequestParam(click.Argument(["weight"]), "weight"),
    option(
        "--target",
        "targets",
        multiple=True,
        default=["android"],
        show_default=True,
        help="android, ios, jetson, all, or a profile .toml; repeat it to build several targets sharing one eager run",
        into=sets("target", lambda targets: targets[0]),
        to_body=True,
    ),
    option(
        "--out",
        type=click.Path(path_type=Path),
        default=None,
        help="Output directory [default: exports/<weight>/<target>]",
        into="out",
    ),
    option(
        "--checkpoint",
        type=click.Path(path_type=Path),
        default=None,
        help="State dict to load instead of the torch hub cache.",
        into="checkpoint",
    ),
    option(
        "--no-verify",
        is_flag=True,
        help="Skip the sha256 check of a local checkpoint whose file name carries one (downloads are always checked).",
        into=sets("verify", operator.not_),
    ),
    option(
        "--offline", is_flag=True, help="Never download a missing checkpoint (also EXPORTER_OFFLINE=1).", into="offline"
    ),
    option(
        "--float-checkpoint",
        type=click.Path(path_type=Path),
        default=None,
        help="A quantized weight's float model (its meta['unquantized']), the eager reference "
        "[default: from the torch hub cache if there].",
        into="float_checkpoint",
    ),
    option(
        "--labels",
        type=click.Path(path_type=Path),
        default=None,
        help="Class names, one per line (fine-tuned checkpoints).",
        into="labels",
    ),
    option(
        "--data",
        type=click.Path(path_type=Path),
        default=None,
        help="Calibration and labeled validation data: an ImageFolder (classification), or DIR/images + DIR/masks "
        "(segmentation, VOC-style: class index per pixel, 255 = ignore), DIR/annotations.json (detection, COCO), "
        "or DIR/<class>/<clip>/<frame image> (video).",
        into="data",
    ),
    option(
        "--input-size",
        type=(INPUT_SIDE, INPUT_SIDE),
        default=None,
        metavar="H W",
        help="Fixed input size of a segmentation graph (the weight's resize size, square), of a RetinaNet, "
        "FCOS or Faster R-CNN graph (multiples of 32; by default the weight's min_size square: 800 800, "
        "320 320) or of a video graph's frames (the weight's crop), or a classifier's square crop (at least the "
        "weight's min_size; the resize scaled with it; ViT, MaxViT and Swin take only their crop); SSD "
        "takes its own.",
        into="input_size",
    ),
    option("--calib-size", type=click.IntRange(min=0), default=None, into="calib_size"),
    option("--val-size", type=click.IntRange(min=MIN_INPUTS), default=None, into="val_size"),
    option(
        "--threads",
        type=click.IntRange(min=0),
        default=None,
        help="Threads for eager and every runtime alike (0: every core this process may use).",
        into="threads",
    ),
    option("--warmup", type=click.IntRange(min=0), default=None, into="warmup"),
    option(
        "--iterations",
        type=click.IntRange(min=1),
        default=None,
        help="Timed iterations per runner.",
        into="iterations",
    ),
    option("--threshold", "thresholds", multiple=True, help=_threshold_help(), into=sets("thresholds", list)),
    option(
        "--arch",
        "arches",
        multiple=True,
        type=click.Choice(["x86_64", "aarch64"]),
        help="Also validate on this architecture (repeatable): aarch64 re-runs every .pte, .tflite, .ptl and ONNX on "
        "emulated CPUs (qemu-user; the runner is set up on first use, see `exporter arm-setup`).",
        into=sets("arch", list),
    ),
    option(
        "--cpu",
        "cpus",
        multiple=True,
        metavar="NAME",
        help="Emulated aarch64 CPU (repeatable), replacing the profile's [validate] cpus (implies --arch aarch64), e.g. cortex-a53.",
        into=sets("cpus", list),
    ),
    option(
        "--must-run-on",
        "must_run_on",
        multiple=True,
        metavar="NAME",
        help='An aarch64 CPU the app must run on (repeatable; validated on, implies --arch aarch64): "ship this" '
        "never picks an artifact that failed there or was made for what it lacks (an fp16 .pte on cortex-a53).",
        into=sets("must_run_on", list),
    ),
    option(
        "--count/--no-count",
        "count",
        default=None,
        help="Count emulated instructions per inference on each aarch64 CPU (default: the profile's [validate] count; "
        "about a minute per CPU; a count is not time).",
        into="count",
    ),
    option(
        "--input-format",
        type=click.Choice(["float32-nchw", "uint8-nhwc"]),
        default=None,
        help="What every artifact takes (default: the profile's [input] format, else float32-nchw): uint8-nhwc is the "
        "RGB bytes of the resized (and cropped) image, N x H x W x 3, with the scaling, mean/std and layout change "
        "inside the graph; the resize stays in the app (preprocessing.json says how).",
        into="input_format",
    ),
    option(
        "--input-size-range",
        "size_range",
        type=(int, int),
        default=None,
        metavar="MIN MAX",
        help="Segmentation: artifacts that take any height and width from MIN to MAX (at most 4096), validated at three "
        "sizes in that range besides --input-size (which stays the calibration and golden size); formats that cannot "
        "take a dynamic size keep the fixed one and say why (default: the profile's [input] size_range).",
        into="size_range",
    ),
    option(
        "--detections",
        type=click.Choice(["host", "graph"]),
        default=None,
        help="Where a single-stage detector's boxes are decoded (default: the profile's [detection] decode, else host): "
        "host ends the graph in the raw heads (detection_decode.py decodes them); graph puts torchvision's "
        "post-processing (decode, score threshold, top-k, per-class NMS) inside it and returns final detections (ONNX "
        "and TensorRT; a target none of whose formats takes it keeps the raw heads and says why).",
        into="detections",
    ),
    option(
        "--quant-budget",
        "quant_budget",
        multiple=True,
        help="int8 budget KEY=VALUE (repeatable): a threshold key (default: the int8 thresholds) or "
        "max_float_fraction, psnr_margin_db, check_fraction, onnx_calibration, dynamic_ranges (true|false).",
        into=sets("quant_budget", list),
    ),
    option(
        "--no-fallback",
        is_flag=True,
        help="Plain PTQ: static ranges, no layer in float, whatever the budget says.",
        into=sets("fallback", operator.not_),
    ),
    option(
        "--format",
        "formats",
        multiple=True,
        help="Only these formats, e.g. executorch or executorch:int8 (repeatable); one the profile makes on request "
        "(executorch:fp16) only when named with its precision.",
        into=sets("formats", list),
    ),
    option(
        "--option",
        "raw_options",
        multiple=True,
        help="Format option KEY=VALUE for every artifact that takes it (repeatable).",
        into=_format_options,
    ),
    option(
        "--batch",
        default=None,
        help="Batch profile MIN:OPT:MAX of the ONNX files and their TensorRT engines.",
        into=_format_option("batch"),
    ),
    option(
        "--workspace",
        type=click.IntRange(min=1),
        default=None,
        help="TensorRT workspace limit in MB.",
        into=_format_option("workspace_mb"),
    ),
    option(
        "--dla-core",
        type=click.IntRange(min=0),
        default=None,
        help="Build TensorRT engines for this DLA core.",
        into=_format_option("dla_core"),
    ),
    option(
        "--require-engine",
        is_flag=True,
        default=None,
        help="Exit 2 instead of reporting engines unavailable.",
        into=_format_option("require_engine"),
    ),
    option(
        "--deployment-target",
        default=None,
        help="Core ML minimum deployment target, e.g. iOS17.",
        into=_format_option("deployment_target"),
    ),
    option(
        "--bundle",
        "make_bundle",
        is_flag=True,
        help="Also write app bundles (see `exporter bundle`) when every bundled artifact passed.",
    ),
    option(
        "--no-cache",
        is_flag=True,
        help="Rebuild and revalidate everything (cache: $EXPORTER_CACHE or ~/.cache/exporter).",
        into=sets("cache", operator.not_),
    ),
    option("--force", is_flag=True, help="Write into a non-empty output directory.", into="force"),
    option("--quiet", is_flag=True, help="No progress or report on the terminal."),
    option("--json", "as_json", is_flag=True, help="Print the manifest JSON on stdout."),
)


@request_command(main, BUILD_PARAMS, _build_request, epilog=EXIT_CODES)
def build(request: BuildRequest, targets: tuple[str, ...], make_bundle: bool, quiet: bool, as_json: bool):
    """Export WEIGHT for a target, validate every artifact against eager PyTorch, write manifest and report."""
    from .build import build_targets, default_out, expand_targets, profiles
    from .progress import Progress
    from .results import Manifest, Status

    if make_bundle:  # a target with no bundle selection is refused before the build, not after it
        from .release.bundle import check_target

        for target in expand_targets(targets):
            check_target(profiles.load(target)["name"])
    docs = build_targets(request, expand_targets(targets), Progress(quiet=quiet or as_json))
    typed = [Manifest.from_json(doc) for doc in docs]  # each target's manifest, from the JSON record a build returns
    base = request.out or default_out(typed[0].weight.name, [doc.target["name"] for doc in typed])
    if make_bundle and all(doc.status is Status.PASSED for doc in typed):
        from .release.bundle import make_bundles, zip_path

        for directory in make_bundles(base):
            click.echo(f"bundle: {directory}  zip: {zip_path(directory)}", err=True)
    if len(docs) == 1:
        _emit(docs[0], as_json, quiet, base)
    if as_json or quiet:
        _say_failures(typed)
    if as_json:
        from .release import manifest

        click.echo(manifest.dumps({"builds": docs}), nl=False)
    elif not quiet:
        from .release import report

        for doc in typed:
            click.echo(report.markdown(doc))
        click.echo(f"report: {base / 'report.html'} (all targets); manifests: {base}/<target>/manifest.json")
    sys.exit(1 if any(doc.status is Status.FAILED for doc in typed) else 0)


@main.command()
@click.option("--weight", "weight_names", multiple=True, required=True, help="A weight name (repeatable).")
@click.option(
    "--target", "targets", multiple=True, help="A target, `all` or a .toml profile (repeatable); default: every target."
)
@one_line_errors
def matrix(weight_names, targets):
    """Print a JSON build matrix (weights x targets) for a CI system's matrix feature. A pair that `build` would
    refuse (the target makes none of its artifacts from the weight) is left out, saying why on stderr."""
    from . import weights
    from .build import expand_targets, target_refusal

    names = list(dict.fromkeys(weights.canonical_name(weights.resolve(w)) for w in weight_names))
    include = []
    for name in names:
        for target in expand_targets(targets or ["all"]):
            why = target_refusal(name, target)
            if why:
                click.echo(f"left out: {name} on {target}: {why}", err=True)
            else:
                include.append({"weight": name, "target": target})
    if not include:
        raise UsageError("no weight in the matrix makes an artifact on any of its targets")
    click.echo(json.dumps({"include": include}))


@main.command(epilog=EXIT_CODES)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="Validate on this data (the task's own format, as build --data) instead of the build's.",
)
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path),
    default=None,
    help="The build's checkpoint, where it lives on this host.",
)
@click.option("--threshold", "thresholds", multiple=True, help=_threshold_help())
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def validate(out_dir, data, checkpoint, thresholds, quiet, as_json):
    """Re-run validation on an existing build directory and rewrite its manifest and report."""
    from .build import validate_build
    from .progress import Progress

    doc = validate_build(out_dir, data, list(thresholds), Progress(quiet=quiet or as_json), checkpoint)
    _emit(doc, as_json, quiet, out_dir)


@main.command("validate-device", epilog=EXIT_CODES)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--runtime",
    type=click.Choice(["auto", "tensorrt", "onnxruntime"]),
    default="auto",
    show_default=True,
    help="auto: a TensorRT engine where tensorrt is installed, else ONNX Runtime.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="ONNX Runtime's threads [default: its own]; the build's reproduce its numbers exactly.",
)
@one_line_errors
def validate_device(out_dir, runtime, threads):
    """Run a Jetson build's golden inputs through its ONNX (or engines) and compare to the golden eager logits."""
    from .device import device_validate

    try:
        results = device_validate.validate(out_dir, runtime, threads)
    except device_validate.BadInput as e:
        raise UsageError(str(e)) from None
    for result in results:
        click.echo(device_validate.summary(result))
    sys.exit(1 if any(r["status"] == "failed" for r in results) else 0)


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--allow-failed", is_flag=True, help="Bundle a build whose selected artifacts failed validation.")
@one_line_errors
def bundle(out_dir, allow_failed):
    """Write OUT_DIR/bundle/<target>/ and <target>.zip (each target of a several-target build): the
    artifacts an app needs, labels, preprocessing, golden data."""
    from .release.bundle import make_bundles, zip_path

    for directory in make_bundles(out_dir, allow_failed=allow_failed):
        click.echo(f"bundle: {directory}\nzip: {zip_path(directory)}")


@main.command("arm-setup")
@click.option("--rebuild", is_flag=True, help="Build the runner anew even when a complete one is cached.")
@click.option(
    "--offline", is_flag=True, help="Never download: use the cached runner or exit 2 (also EXPORTER_OFFLINE=1)."
)
@click.option("--json", "as_json", is_flag=True, help="Print what was set up as JSON.")
@click.option(
    "--counter/--no-counter",
    default=True,
    show_default=True,
    help="Also build the counting qemu (qemu-aarch64 with TCG plugins, from Debian's source package, and our "
    "instruction-counting plugin; a few minutes), first installing with apt-get what it is built with and the host "
    "lacks (gcc, ninja-build, pkg-config, libglib2.0-dev). Where it cannot be built, one line says why and what to "
    "install, and the runner is set up without it.",
)
@one_line_errors
def arm_setup(rebuild, offline, as_json, counter):
    """Set up (once) the aarch64 runner under $EXPORTER_AARCH64_CACHE or $EXPORTER_CACHE/aarch64: qemu-user, an arm64 Debian root with
    Python and the aarch64 wheels of the pinned versions, and the counting qemu (the Debian packages it is built with
    installed first where missing); print where each is, its size and set-up time."""
    from . import aarch64
    from .aarch64 import counter as counting_qemu
    from .errors import UsageError
    from .progress import Progress

    progress = Progress(quiet=as_json)
    runner = aarch64.prepare(progress=progress, rebuild=rebuild, offline=offline or None)
    info = runner.info
    summary = {
        "path": str(runner.path),
        "size_mb": round(info.get("size_bytes", 0) / 1e6),
        "setup_seconds": info.get("seconds"),
        "qemu": info.get("qemu_version"),
        "packages": info.get("packages"),
        "cpus": runner.cpus,
    }
    if counter:
        try:
            built = counting_qemu.prepare(
                progress=progress, rebuild=rebuild, offline=offline or None, install=counting_qemu.apt_install
            )
            summary["counter"] = {
                "path": str(built.path),
                "size_mb": round(built.info.get("size_bytes", 0) / 1e6, 1),
                "setup_seconds": built.info.get("seconds"),
                "qemu": built.version,
            }
        except UsageError as e:  # the runner stands without it: validation runs, instruction counts are unavailable
            summary["counter"] = {"unavailable": str(e)}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(
        f"aarch64 runner: {summary['path']}\nsize: {summary['size_mb']} MB, set up in "
        f"{summary['setup_seconds']} s\nqemu: {summary['qemu']}\n"
        f"packages: {', '.join(f'{k} {v}' for k, v in (summary['packages'] or {}).items())}\n"
        f"cpus: {', '.join(summary['cpus'])}"
    )
    built = summary.get("counter")
    if built and "unavailable" in built:
        click.echo(f"counting qemu: unavailable ({built['unavailable']}); instruction counts will not be taken")
    elif built:
        click.echo(
            f"counting qemu: {built['path']}\nsize: {built['size_mb']} MB, built in {built['setup_seconds']} s "
            f"({built['qemu']}, TCG plugins; counts emulated instructions, not time)"
        )


def _command_line(ctx: click.Context) -> str:
    """The command as given (options at their default left out), for the files a command writes."""
    import shlex

    words, arguments = ["exporter", ctx.info_name], []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if isinstance(param, click.Argument):
            arguments += [str(v) for v in (value if isinstance(value, tuple) else (value,)) if v is not None]
            continue
        default = param.default if isinstance(param.default, (str, int, float, tuple, list, Path)) else None
        if (
            value is None
            or value == ()
            or value is False
            or (
                default is not None
                and (tuple(value) == tuple(default) if isinstance(value, tuple) else value == default)
            )
        ):
            continue
        flag = param.opts[-1] if len(param.opts) > 1 and param.opts[-1].startswith("--") else param.opts[0]
        if param.is_flag:
            words.append(flag)
        elif param.multiple:
            for v in value:
                words += [flag, str(v)]
        elif isinstance(value, tuple):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words + arguments)


def _declared(param: click.Parameter):
    """A request field declared by its click parameter, of the same name (params_of)."""
    return dataclasses.field(metadata={"param": param})


def params_of(request_class) -> tuple[RequestParam, ...]:
    """The click parameters of a request whose every field is _declared, in field order, each filling its field."""
    return tuple(RequestParam(f.metadata["param"], f.name) for f in dataclasses.fields(request_class))


@dataclass(frozen=True)
class CoverageRequest:
    """What `exporter coverage` is asked, each field declared with its parameter."""

    merge_paths: tuple[Path, ...] = _declared(
        click.Argument(["merge_paths"], nargs=-1, type=click.Path(path_type=Path), metavar="[PATH]...")
    )
    targets: tuple[str, ...] = _declared(
        click.Option(["--target", "targets"], multiple=True, help="A target (repeatable) [default: every target].")
    )
    formats: tuple[str, ...] = _declared(
        click.Option(
            ["--format", "formats"],
            multiple=True,
            help="Only these artifacts, e.g. onnx:fp32 (repeatable); targets without one are left out.",
        )
    )
    models: tuple[str, ...] = _declared(
        click.Option(
            ["--models"],
            multiple=True,
            help="Builder or weight names or globs, e.g. 'resnet*' (repeatable, or comma-separated).",
        )
    )
    tasks: tuple[str, ...] = _declared(
        click.Option(
            ["--task", "tasks"],
            multiple=True,
            help="classification, segmentation, detection, quantization, video, optical_flow (repeatable) "
            "[default: all].",
        )
    )
    one_per_builder: bool = _declared(
        click.Option(["--one-per-builder"], is_flag=True, help="Each builder's DEFAULT weight instead of every weight.")
    )
    max_params: int | None = _declared(
        click.Option(
            ["--max-params"],
            type=click.IntRange(min=1),
            default=None,
            help="Skip (⏭) weights with more parameters than this.",
        )
    )
    time_limit: float = _declared(
        click.Option(
            ["--time-limit"],
            type=click.FloatRange(min=0),
            default=900,
            show_default=True,
            help="CPU seconds per build (weight x target), 3x on the wall clock; 0: none.",
        )
    )
    weight_source: str = _declared(
        click.Option(
            ["--weights", "weight_source"],
            type=click.Choice(["random", "digits"]),
            default="random",
            show_default=True,
            help="random: settled random weights, synthetic inputs. digits: each classifier trained on the digits "
            "(cached), validated on held-out labeled digits.",
        )
    )
    train_epochs: int | None = _declared(
        click.Option(
            ["--train-epochs"],
            type=click.IntRange(min=1),
            default=None,
            help="Epochs of the digits training [default: 4].",
        )
    )
    calib_size: int | None = _declared(
        click.Option(
            ["--calib-size"],
            type=click.IntRange(min=0),
            default=None,
            help="[default: 16 (random); the target's own (digits)]",
        )
    )
    val_size: int | None = _declared(
        click.Option(
            ["--val-size"],
            type=click.IntRange(min=MIN_INPUTS),
            default=None,
            help="[default: 8 (random); the target's own (digits)]",
        )
    )
    warmup: int = _declared(click.Option(["--warmup"], type=click.IntRange(min=0), default=1, show_default=True))
    iterations: int = _declared(
        click.Option(["--iterations"], type=click.IntRange(min=1), default=2, show_default=True)
    )
    threads: int = _declared(
        click.Option(["--threads"], type=click.IntRange(min=1), default=1, show_default=True, help="Threads per build.")
    )
    input_size: tuple[int, int] = _declared(
        click.Option(
            ["--input-size"],
            type=(INPUT_SIDE, INPUT_SIDE),
            default=(128, 128),
            show_default=True,
            metavar="H W",
            help="Input size of the graphs that take one: segmentation, RetinaNet, FCOS, video frames.",
        )
    )
    classifier_size: int | None = _declared(
        click.Option(
            ["--classifier-size"],
            type=click.IntRange(min=1),
            default=None,
            metavar="N",
            help="Build classifiers at N×N (with --weights digits, trained at it too) where their graph takes it "
            "and it is no larger than their crop (not ViT, MaxViT, Swin) [default: each weight's crop].",
        )
    )
    coverage_arch: str | None = _declared(
        click.Option(
            ["--arch", "coverage_arch"],
            type=click.Choice(["aarch64"]),
            default=None,
            help="Also validate each .pte, .tflite, .ptl and ONNX artifact on emulated aarch64 CPUs (the target's "
            "[validate] cpus); the table is coverage[-digits]-aarch64.",
        )
    )
    coverage_cpus: tuple[str, ...] = _declared(
        click.Option(
            ["--cpu", "coverage_cpus"],
            multiple=True,
            metavar="NAME",
            help="Emulated aarch64 CPU (repeatable), instead of the target's (implies --arch aarch64).",
        )
    )
    shard: str | None = _declared(
        click.Option(
            ["--shard"],
            default=None,
            metavar="I/N",
            help="Run only shard I of N (weights I, I+N, …); writes OUT/coverage-shard-I-of-N.json/.md.",
        )
    )
    out: Path = _declared(
        click.Option(
            ["--out"],
            type=click.Path(path_type=Path),
            default=Path("docs"),
            show_default=True,
            help="Where coverage.md and coverage.json go.",
        )
    )
    builds: Path | None = _declared(
        click.Option(
            ["--builds"],
            type=click.Path(path_type=Path),
            default=None,
            help="Keep every build under DIR/<weight>/<target> [default: temporary].",
        )
    )
    no_cache: bool = _declared(
        click.Option(["--no-cache"], is_flag=True, help="Rebuild rows cached in $EXPORTER_CACHE/coverage.")
    )
    matrix_shards: int | None = _declared(
        click.Option(
            ["--matrix", "matrix_shards"],
            type=int,
            default=None,
            metavar="N",
            help="Print a CI matrix of N shards as JSON and exit.",
        )
    )
    merge: bool = _declared(
        click.Option(
            ["--merge", "merge"],
            is_flag=True,
            help="Merge the coverage JSON files or directories PATH... into OUT instead of building.",
        )
    )


@request_command(main, params_of(CoverageRequest), CoverageRequest)
def coverage(request: CoverageRequest):
    """Sweep torchvision: build every weight (random weights, settled batch norms; or, with --weights digits,
    each classifier trained on the digits) for every target, validate, and write the weight x artifact table
    (OUT/coverage.md) and its JSON."""
    from . import coverage as sweep

    command = _command_line(click.get_current_context())
    if request.matrix_shards is not None:
        if request.merge or request.merge_paths:
            raise UsageError("--matrix prints the shards of a sweep; --merge joins their tables: give one of them")
        click.echo(json.dumps(sweep.matrix(request.matrix_shards)))
        return
    if request.merge:
        if not request.merge_paths:
            raise UsageError("--merge needs the coverage JSON files or directories to merge")
        doc = sweep.merge(request.merge_paths, request.out, command)
        json_path, md_path = sweep.output_paths(
            request.out, None, doc["settings"].get("weights", "random"), bool(doc["settings"].get("cpus"))
        )
    else:
        settings = _sweep_settings(request)
        sweep.run(
            settings,
            request.models,
            request.tasks,
            request.one_per_builder,
            request.max_params,
            request.shard,
            request.out,
            cache=not request.no_cache,
            builds_dir=request.builds,
            command=command,
        )
        json_path, md_path = sweep.output_paths(
            request.out, sweep.select.parse_shard(request.shard), request.weight_source, settings.on_aarch64
        )
    click.echo(f"table: {md_path}\njson: {json_path}", err=True)


def _sweep_settings(request: CoverageRequest):
    """The sweep's settings, a request that is not one (paths without --merge, --train-epochs without digits, an
    unknown CPU) refused."""
    from . import coverage as sweep

    if request.merge_paths:
        raise UsageError(f"unexpected argument {request.merge_paths[0]} (paths are for --merge)")
    trained = request.weight_source == "digits"
    if request.train_epochs is not None and not trained:
        raise UsageError("--train-epochs is for --weights digits")
    calib_size, val_size = request.calib_size, request.val_size
    if not trained:
        calib_size, val_size = (16 if calib_size is None else calib_size), (8 if val_size is None else val_size)
    if request.coverage_cpus:
        from .aarch64 import cpus as aarch64_cpus

        aarch64_cpus.check(request.coverage_cpus)
    return sweep.Settings(
        targets=tuple(request.targets) or ("all",),
        formats=tuple(request.formats),
        calib_size=calib_size,
        val_size=val_size,
        warmup=request.warmup,
        iterations=request.iterations,
        threads=request.threads,
        input_size=tuple(request.input_size),
        classifier_size=request.classifier_size,
        time_limit=request.time_limit or None,
        weights=request.weight_source,
        train_epochs=request.train_epochs or sweep.trained.EPOCHS,
        cpus=tuple(request.coverage_cpus) or (("target",) if request.coverage_arch else ()),
    )


if __name__ == "__main__":
    main()
