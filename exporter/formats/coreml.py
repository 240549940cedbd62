"""Core ML ML program (.mlpackage): an image classifier that returns label, probabilities and logits,
or, for a model whose output is per-pixel class scores (layout "NCHW" in meta["task"]), an image
model with that one multi-array output and no classifier.

The package takes an RGB image (or, with input="tensor", the normalized NCHW tensor) and carries
the weight's mean/std inside the graph. Core ML's image preprocessing has one scale for all
channels, so it only maps 0..255 to 0..1; a wrapper module then applies (x - mean) / std in the
graph, the same arithmetic as torchvision's Normalize. Folding std into the first conv instead
would not be exact: its zero padding would then pad raw pixels, not normalized ones.

Core ML runs only on macOS. Elsewhere `load` raises RuntimeUnavailable and `proxies` offers
labelled stand-ins: the package's own (decompressed) weights put back into eager PyTorch, and
the eager model computed in half precision.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..errors import UsageError
from ..precision import Precision
from . import RuntimeUnavailable
from .interface import Format, SharedProxy
from .rewrites import global_pool3d_as_mean, rel_pos_within_rank5

INPUTS = ("image", "tensor")
COMPRESSIONS = ("none", "w8", "palettize")
PALETTE_NBITS = (1, 2, 3, 4, 6, 8)  # what coremltools' palettizer accepts
DEFAULT_TARGET = "iOS17"
LABEL_OUTPUT = "classLabel"
PROBS_OUTPUT = "classLabel_probs"
LOGITS_OUTPUT = "logits"
# class scores (a classifier package), per-pixel class scores, per-anchor box deltas + class scores
LAYOUTS = {"NC": "classifier", "NCHW": "per-pixel classifier", "NAK": "detector (raw SSD heads, decoded outside)"}
METADATA_PREFIX = "exporter."
CONVERSION_DATE_KEY = "com.github.apple.coremltools.conversion_date"


class ImageInput(nn.Module):
    """Takes RGB in [0, 1] (Core ML scales the 0..255 image), normalizes as the weight's
    transforms do, and returns the model's output."""

    def __init__(self, model: nn.Module, mean, std):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def forward(self, x):
        return self.model(self.normalize(x))


class ImageClassifier(ImageInput):
    """ImageInput that returns (logits, probabilities)."""

    def forward(self, x):
        logits = self.model(self.normalize(x))
        return logits, torch.softmax(logits, 1)


class TensorClassifier(nn.Module):
    """Takes the already normalized tensor and returns (logits, probabilities)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        logits = self.model(x)
        return logits, torch.softmax(logits, 1)


# coremltools 9's ct.target iOS members, listed here so that checking a request does not cost
# the multi-second coremltools import (a test keeps the list equal to ct.target)
IOS_TARGETS = (13, 14, 15, 16, 17, 18, 26)


def _ios_version(deployment_target: str) -> int:
    match = re.fullmatch(r"ios(\d+)", str(deployment_target).strip().lower())
    if not match or int(match.group(1)) not in IOS_TARGETS:
        known = ", ".join(f"iOS{v}" for v in IOS_TARGETS)
        raise UsageError(f"coreml: unknown deployment target {deployment_target!r}; choose from {known}")
    return int(match.group(1))


def _output(meta) -> dict:
    """The model's output as meta["task"] describes it; builds without a task are classifiers."""
    output = (meta.get("task") or {}).get("output") or {"name": LOGITS_OUTPUT, "layout": "NC"}
    if output["layout"] not in LAYOUTS:
        raise ValueError(f"coreml: output layout {output['layout']!r} is not supported (only {', '.join(LAYOUTS)})")
    return output


def _multiarray(meta) -> bool:
    """Every output but class scores is one multi-array, with no classify op."""
    return _output(meta)["layout"] != "NC"


def _image_size(pre: dict, example: torch.Tensor) -> tuple[int, int]:
    """(height, width) the app feeds: the preprocessing's input size (its crop for older specs)."""
    if pre.get("input_size"):
        size = tuple(pre["input_size"])
        if size != tuple(example.shape[-2:]):
            raise ValueError(
                f"coreml: preprocessing input_size {list(size)} differs from the example's {list(example.shape[-2:])}"
            )
        return size
    size = pre.get("crop_size")
    return (size[0], size[-1]) if size else tuple(example.shape[-2:])


def _convertible(exported):
    """The program in ops coremltools 9 converts: `aten.alias` (Swin's window shifts leave it after
    decomposition; the identity in inference) bypassed; `aten.zero` (Swin V2's attention mask; "Unsupported
    fx node zero") as `aten.zeros_like`, which it converts; and a `slice_scatter` that writes an empty slice
    (Swin3D's attention mask, where a window covers all frames: "Invalid target shape in `reshape` op ([0] to
    [0, 21, 28])") as its input, which it is."""
    graph = exported.graph_module.graph
    changed = False
    for node in list(graph.nodes):
        if node.target == torch.ops.aten.alias.default and all(user.op != "output" for user in node.users):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed = True
        elif node.target == torch.ops.aten.zero.default:
            node.target, node.args, node.kwargs = torch.ops.aten.zeros_like.default, node.args[:1], {}
            changed = True
        elif node.target == torch.ops.aten.slice_scatter.default and _writes_nothing(node.args[1]):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed = True
    if changed:
        graph.eliminate_dead_code()
        exported.graph_module.recompile()
    return exported


def _writes_nothing(source) -> bool:
    value = getattr(source, "meta", {}).get("val")
    return isinstance(value, torch.Tensor) and value.numel() == 0


def _convert(model, example, precision, meta, deployment_target, input):
    import coremltools as ct

    pre = meta["preprocessing"]
    per_pixel = _multiarray(meta)
    if input == "image":
        wrapper = (ImageInput if per_pixel else ImageClassifier)(model, pre["mean"], pre["std"])
        input_type = ct.ImageType(
            name="image",
            shape=tuple(example.shape),
            scale=1 / 255.0,
            bias=[0.0, 0.0, 0.0],
            color_layout=ct.colorlayout.RGB,
        )
    else:
        wrapper = model if per_pixel else TensorClassifier(model)
        input_type = ct.TensorType(name="input", shape=tuple(example.shape), dtype=np.float32)
    wrapper.eval()
    with torch.no_grad():
        exported = _convertible(torch.export.export(wrapper, (example,)).run_decompositions({}))
    target = getattr(ct.target, f"iOS{_ios_version(deployment_target)}")
    compute_precision = ct.precision.FLOAT16 if precision == Precision.FP16 else ct.precision.FLOAT32
    if per_pixel:
        return ct.convert(
            exported,
            convert_to="mlprogram",
            inputs=[input_type],
            outputs=[ct.TensorType(name=_output(meta)["name"])],
            minimum_deployment_target=target,
            compute_precision=compute_precision,
            skip_model_load=True,
        )
    # Two steps because coremltools 9 fails (IndexError in get_func_output) when a classifier
    # keeps a second output (the logits) in one ct.convert call with torch.export input.
    program = ct.convert(
        exported,
        convert_to="milinternal",
        inputs=[input_type],
        outputs=[ct.TensorType(name=LOGITS_OUTPUT), ct.TensorType(name="probabilities")],
        minimum_deployment_target=target,
        compute_precision=compute_precision,
    )
    program.functions["main"].set_output_types(None)
    return ct.convert(
        program,
        convert_to="mlprogram",
        minimum_deployment_target=target,
        pass_pipeline=ct.PassPipeline.EMPTY,  # the passes already ran in the first step
        classifier_config=ct.ClassifierConfig(
            list(meta["labels"]), predicted_feature_name=LABEL_OUTPUT, predicted_probabilities_output="probabilities"
        ),
        skip_model_load=True,  # nothing here predicts with it; on macOS loading compiles it into the system's temp
    )


def _compress(mlmodel, compression, nbits):
    from coremltools.optimize import coreml as cto

    if compression == "w8":
        config = cto.OptimizationConfig(global_config=cto.OpLinearQuantizerConfig(mode="linear_symmetric"))
        return cto.linear_quantize_weights(mlmodel, config=config)
    if compression == "palettize":
        config = cto.OptimizationConfig(global_config=cto.OpPalettizerConfig(mode="kmeans", nbits=nbits))
        # k-means (scikit-learn, fixed random_state) adds its per-thread partial sums in the
        # order the OpenMP threads finish; one thread keeps the palettes independent of the core
        # count. The digits model's palettes came out identical at 1, 2, 4 and 8 threads, so this
        # is a guarantee, not a fix for a difference observed.
        with _one_openmp_thread():
            return cto.palettize_weights(mlmodel, config=config)
    return mlmodel


# a tqdm bar: "Running MIL default pipeline:  13%|█▎   | 12/95 [00:00<00:00, 116.81 passes/s]"
_PROGRESS_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+ \[|: \d+ passes \[")  # with a total, and without one


class _BarsDropped:
    """A stream passing on every write but tqdm's bars (one write per redraw) and the line end closing one. Other
    writes go through as they come: warnings, and the build's own live spinner, which looks the stream up at each
    frame (held back until the export ended, its frames came out as lines of escape codes)."""

    def __init__(self, stream):
        self._stream, self._after_bar = stream, False

    def write(self, text: str) -> int:
        bar = bool(_PROGRESS_BAR.search(text))
        if not bar and not (self._after_bar and not text.strip()):
            self._stream.write(text)
        self._after_bar = bar
        return len(text)

    def __getattr__(self, name):  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def _without_progress_bars():
    """coremltools draws a tqdm bar on stderr for every pass pipeline of every package, which buries exporter's
    own progress lines; whatever else it writes there (warnings, log records) is passed on."""
    with contextlib.redirect_stderr(_BarsDropped(sys.stderr)):
        yield


@contextlib.contextmanager
def _scratch_beside(path: Path):
    """coremltools writes every model it makes (a conversion, a compression, a decompression) to a package of its
    own in the temporary directory, deleted only when Python exits: RegNetY-128GF's iOS build had 20 GB of them in
    /tmp by its fifth package and failed for want of disk, and builds that were killed had left 30 GB there for
    good. Here they go to a hidden `.partial` folder beside `path`, removed on the way out (one a killed build left
    in a build folder is removed by the next build into it: release.manifest.clear_build_files)."""
    scratch = tempfile.mkdtemp(prefix=f".{path.name}.coreml-", suffix=".partial", dir=path.parent)
    previous = tempfile.tempdir
    tempfile.tempdir = scratch  # coremltools takes no directory for them: tempfile's default is the way in
    try:
        yield
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(scratch, ignore_errors=True)


def _one_openmp_thread():
    try:
        from threadpoolctl import threadpool_limits  # scikit-learn's own dependency
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="openmp")


def _describe(mlmodel, precision, meta, options, image_size, output_shape) -> None:
    classes = len(meta["labels"])
    kind = LAYOUTS[_output(meta)["layout"]]
    mlmodel.short_description = f"{meta['model']} {kind} from {meta['weight']} ({classes} classes)"
    mlmodel.version = meta["exporter_version"]
    pre = meta["preprocessing"]
    if options["input"] == "image":
        h, w = image_size
        resized = "resized and center-cropped" if pre.get("crop_size") else "resized to exactly that size"
        mlmodel.input_description["image"] = (
            f"RGB image, {w}x{h}, {resized} as the weight's transforms do; "
            "mean/std normalization happens inside the model"
        )
    else:
        mlmodel.input_description["input"] = (
            f"NCHW float32 tensor, RGB in [0, 1] normalized with mean {pre['mean']} and std {pre['std']}"
        )
    user = mlmodel.user_defined_metadata
    extra = {}
    if _multiarray(meta):
        output = _output(meta)
        if output["layout"] == "NCHW":
            _, c, h, w = output_shape
            text = (
                f"per-pixel class scores (logits, before softmax), 1x{c}x{h}x{w} at the input's resolution; "
                f"the argmax over the {c} classes (axis 1) is the class of each pixel, named in exporter.labels"
            )
        else:
            text = f"{'x'.join(map(str, output_shape))}: {output.get('meaning', '')}"
        mlmodel.output_description[output["name"]] = text
        # without a classify op the class names would not be in the package
        extra = {
            "output": output["name"],
            "output_layout": output["layout"],
            "labels": json.dumps(list(meta["labels"])),
        }
    else:
        mlmodel.output_description[LABEL_OUTPUT] = "most likely class"
        mlmodel.output_description[PROBS_OUTPUT] = "softmax probability of every class"
        mlmodel.output_description[LOGITS_OUTPUT] = "raw class scores, before softmax"
    # coremltools stamps the day of conversion: two builds of the same inputs on different days
    # would differ. The build's manifest records when it was made.
    if CONVERSION_DATE_KEY in user:  # (a protobuf map's pop would create a missing key first)
        del user[CONVERSION_DATE_KEY]
    for key, value in {
        "weight": meta["weight"],
        "model": meta["model"],
        "accuracy": json.dumps(meta.get("accuracy")),
        "recipe": meta.get("recipe") or "",
        "exporter_version": meta["exporter_version"],
        "preprocessing": json.dumps(pre),
        "input": options["input"],
        "compute_precision": precision,
        "compression": options["compression"],
        "nbits": str(options["nbits"] or ""),
        **extra,
    }.items():
        user[METADATA_PREFIX + key] = str(value)


def _main_ops(spec):
    function = spec.mlProgram.functions["main"]
    return function.block_specializations[function.opset].operations


def _argument(op, name):
    arguments = op.inputs[name].arguments if name in op.inputs else []
    return arguments[0].name if arguments and arguments[0].name else None


def _classify_labels(spec) -> list[str]:
    for op in _main_ops(spec):
        if op.type == "classify":
            values = op.inputs["classes"].arguments[0].value.immediateValue.list.values
            return [label for v in values for label in v.immediateValue.tensor.strings.values]
    raise ValueError("the package has no classify op")


def _all_ops(block):
    for op in block.operations:
        for inner in op.blocks:
            yield from _all_ops(inner)
        yield op


def _layer_weights(mlmodel) -> list[dict]:
    """Every conv/linear op of the package in program order, with its dense (decompressed) weights."""
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_to_pymil
    from coremltools.optimize.coreml import decompress_weights

    dense = decompress_weights(mlmodel)
    # every const by name, read from the program as get_weights_metadata does, without that function's map of
    # each const's consumers: it raises ("'list' object has no attribute 'val'") on a const feeding an op with a
    # list input, such as ViT's class token going into a concat
    program = milproto_to_pymil(
        model_spec=dense.get_spec(),
        specification_version=dense.get_spec().specificationVersion,
        file_weights_dir=dense.weights_dir,
    )
    values = {
        op.name: op.val.val
        for function in program.functions.values()
        for op in _all_ops(function)
        if op.op_type == "const"
    }
    layers = []
    for op in _main_ops(dense.get_spec()):
        if op.type in ("conv", "linear"):
            bias = _argument(op, "bias")
            layers.append(
                {
                    "op": op.outputs[0].name,
                    "type": op.type,
                    "weight": values[_argument(op, "weight")],
                    "bias": values[bias] if bias else None,
                }
            )
    return layers


def _distinct(values: np.ndarray) -> int:
    """Distinct values, counted in float32: numpy 2.4's float16 sort (its AVX-512 path) misorders
    some arrays, so np.unique on float16 weights counted 26 values in a 16-entry palette on an
    AMD EPYC host; the same weights give 16 in float32."""
    return len(np.unique(np.asarray(values, dtype=np.float32)))


def _compression_check(mlmodel, layers, compression, nbits) -> dict:
    """What compression the weights really carry; raises when the one asked for is absent."""
    ops = _main_ops(mlmodel.get_spec())
    producers = {out.name: op.type for op in ops for out in op.outputs}
    weight_producer = {
        op.outputs[0].name: producers.get(_argument(op, "weight"), "const")
        for op in ops
        if op.type in ("conv", "linear")
    }
    constexpr_ops: dict[str, int] = {}
    compressed = []
    for layer in layers:
        producer = weight_producer[layer["op"]]
        if producer.startswith("constexpr_"):
            constexpr_ops[producer] = constexpr_ops.get(producer, 0) + 1
            compressed.append(layer["weight"])
    check = {
        "requested": compression,
        "weights": len(layers),
        "compressed_weights": len(compressed),
        "compressed_by_op": constexpr_ops,
        "compressed_parameters": int(sum(w.size for w in compressed)),
        "parameters": int(sum(layer["weight"].size for layer in layers)),
    }
    if compression == "none":
        if compressed:
            raise ValueError(f"{len(compressed)} weights are compressed although no compression was asked for")
        return check
    if not compressed:
        raise ValueError(f"compression={compression} asked for, but no weight in the package is compressed")
    if compression == "w8":
        # linear 8-bit: at most 256 levels in every output channel
        levels = max(_distinct(channel) for w in compressed for channel in w.reshape(w.shape[0], -1))
        limit = 256
    else:
        levels = max(_distinct(w) for w in compressed)
        limit = 2**nbits
        check["nbits"] = nbits
    check["max_distinct_values"] = int(levels)
    if levels > limit:
        raise ValueError(f"compressed weights hold {levels} distinct values, more than {compression} allows ({limit})")
    return check


def _check_outputs(spec, meta, output_shape) -> tuple[dict, int]:
    """The package's outputs against the model's: (what the manifest records, number of labels)."""
    description = spec.description
    outputs = {o.name: o.type.WhichOneof("Type") for o in description.output}
    num_classes = (meta.get("task") or {}).get("num_classes") or output_shape[1]
    if _multiarray(meta):
        name = _output(meta)["name"]
        if outputs != {name: "multiArrayType"} or description.predictedFeatureName:
            raise ValueError(f"package outputs are {outputs}, expected one multi-array {name!r} and no classifier")
        scores = list(description.output[0].type.multiArrayType.shape)
        labels = json.loads(description.metadata.userDefined[METADATA_PREFIX + "labels"])
        if scores != list(output_shape) or len(labels) != num_classes:
            raise ValueError(
                f"package has {len(labels)} labels and output {scores}; the model's output is {list(output_shape)}"
            )
        if labels != list(meta["labels"]):
            raise ValueError("package class labels differ from the build's labels")
        return {name: scores}, len(labels)
    if outputs != {LABEL_OUTPUT: "stringType", PROBS_OUTPUT: "dictionaryType", LOGITS_OUTPUT: "multiArrayType"}:
        raise ValueError(f"package outputs are {outputs}")
    logits = next(o for o in description.output if o.name == LOGITS_OUTPUT).type.multiArrayType
    labels = _classify_labels(spec)
    if list(logits.shape) != [1, num_classes] or len(labels) != num_classes:
        raise ValueError(
            f"package has {len(labels)} labels and logits {list(logits.shape)}; the model has {num_classes} classes"
        )
    if labels != list(meta["labels"]):
        raise ValueError("package class labels differ from the build's labels")
    return {LABEL_OUTPUT: "label", PROBS_OUTPUT: "probabilities", LOGITS_OUTPUT: list(logits.shape)}, len(labels)


def _spec_check(path: Path, precision, meta, options, output_shape) -> dict:
    """Reads the saved package back as a spec (works without the Core ML runtime) and checks it."""
    import coremltools as ct

    mlmodel = ct.models.MLModel(str(path), skip_model_load=True)
    spec = mlmodel.get_spec()
    description = spec.description
    (model_input,) = description.input
    expected_input = "image" if options["input"] == "image" else "input"
    if model_input.name != expected_input:
        raise ValueError(f"package input is {model_input.name!r}, expected {expected_input!r}")
    if options["input"] == "image":
        image = model_input.type.imageType
        input_info = {
            "name": model_input.name,
            "type": "image",
            "color_space": ct.proto.FeatureTypes_pb2.ImageFeatureType.ColorSpace.Name(image.colorSpace),
            "width": image.width,
            "height": image.height,
        }
        if input_info["color_space"] != "RGB":
            raise ValueError(f"package image input is {input_info['color_space']}, expected RGB")
    else:
        array = model_input.type.multiArrayType
        input_info = {
            "name": model_input.name,
            "type": "multiarray",
            "shape": list(array.shape),
            "dtype": ct.proto.FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(array.dataType),
        }
    outputs, labels = _check_outputs(spec, meta, output_shape)
    layers = _layer_weights(mlmodel)
    return {
        "spec_version": spec.specificationVersion,
        "deployment_target": f"iOS{_ios_version(options['deployment_target'])}",
        "compute_precision": precision,
        "input": input_info,
        "outputs": outputs,
        "labels": labels,
        "compression": _compression_check(mlmodel, layers, options["compression"], options["nbits"]),
        "weights_bytes": sum(f.stat().st_size for f in Path(path).rglob("*.bin")),
        "runtime": "Core ML (macOS/iOS only)",
    }


def _make_reproducible(package: Path) -> None:
    """Rewrites the two files of a saved package that differ between identical conversions.

    model.mlmodel: protobuf serializes map fields (metadata, op inputs, program attributes) in
    hash-table order, which changes from process to process; deterministic serialization sorts
    them. Same message, so the same model.
    Manifest.json: the package library names each item with a random UUID. They become UUIDs
    derived from the package's content and the item's path, written in the library's own layout
    (sorted keys, 4-space indent).
    """
    from coremltools.proto import Model_pb2

    manifest_path = package / "Manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entries = manifest["itemInfoEntries"]
    root = entries[manifest["rootModelIdentifier"]]
    spec_path = package / "Data" / root["path"]
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_path.read_bytes())
    spec_path.write_bytes(spec.SerializeToString(deterministic=True))

    content = hashlib.sha256()
    for file in sorted(f for f in package.rglob("*") if f.is_file() and f != manifest_path):
        content.update(file.relative_to(package).as_posix().encode() + b"\0")
        content.update(hashlib.sha256(file.read_bytes()).digest())
    renamed = {
        old: str(uuid.uuid5(uuid.NAMESPACE_URL, f"mlpackage:{content.hexdigest()}:{entry['path']}"))
        for old, entry in entries.items()
    }
    manifest["itemInfoEntries"] = {renamed[old]: entry for old, entry in entries.items()}
    manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    manifest_path.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")


def _user_metadata(path: Path) -> dict:
    import coremltools as ct

    user = ct.models.MLModel(str(path), skip_model_load=True).user_defined_metadata
    return {k[len(METADATA_PREFIX) :]: v for k, v in user.items() if k.startswith(METADATA_PREFIX)}


def _with_package_weights(model: nn.Module, layers: list[dict]) -> nn.Module:
    """A copy of `model` with BatchNorm folded into its convs (as Core ML does) and every
    conv/linear weight replaced by the package's. Layers are paired in execution order by shape."""
    from torch.fx.experimental.optimization import fuse

    fused = fuse(copy.deepcopy(model).eval())
    modules = dict(fused.named_modules())
    free = [
        (modules[n.target], "weight")
        for n in fused.graph.nodes
        if n.op == "call_module" and isinstance(modules[n.target], (nn.Conv2d, nn.Linear))
    ]
    if len(free) != len(layers) and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        # layers applied through their weights (Swin's attention: F.linear(x, qkv.weight); ViT's
        # nn.MultiheadAttention: its in_proj_weight) are no call_module; with no BatchNorm to fold, the model's own
        # matrix and kernel weights, in definition order, are the ones to pair
        fused = copy.deepcopy(model).eval()
        free = [
            (m, name)
            for m in fused.modules()
            for name, p in m.named_parameters(recurse=False)
            if name.endswith("weight") and p.dim() >= 2
        ]
    if len(free) != len(layers):
        raise ValueError(f"the package has {len(layers)} conv/linear layers, the model {len(free)}")
    with torch.no_grad():
        for layer in layers:
            shape = tuple(layer["weight"].shape)
            match = next((f for f in free if tuple(getattr(*f).shape) == shape), None)
            if match is None:
                raise ValueError(f"no layer of the model matches package op {layer['op']} {shape}")
            free.remove(match)
            module, name = match
            getattr(module, name).copy_(torch.from_numpy(layer["weight"].astype(np.float32)))
            bias = getattr(module, name.removesuffix("weight") + "bias", None)
            if bias is not None:
                package_bias = layer["bias"]
                bias.copy_(
                    torch.zeros_like(bias)
                    if package_bias is None
                    else torch.from_numpy(package_bias.astype(np.float32))
                )
    return fused


class EagerFp16(SharedProxy):
    """The eager model with half-precision storage: its weights, its input and every op's result rounded to
    float16, each op computed in float32 from those (as CPU half-precision kernels compute, rounding once at
    the end). Emulated rather than run in half precision: this host's half-precision matrix products can be
    ~90x slower than float32 (no AVX-512 FP16; measured 0.8 against 71 GFLOP/s on an AMD EPYC): ViT-H-14 at 518 px
    needs about 5 min an image in half precision, 29 s emulated (one of its 32 blocks timed). The same for every
    fp16 package of one model."""

    shared_key = "eager fp16"

    def __init__(self, model: nn.Module):
        self.model, self.rounded = model, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounded is None:  # made at the first input: the copy is not needed where the result is shared
            self.rounded = copy.deepcopy(self.model).float().eval()
            with torch.no_grad():
                for t in (*self.rounded.parameters(), *self.rounded.buffers()):
                    if t.dtype == torch.float32:
                        t.copy_(t.half())
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fastpath = torch.backends.mha.get_fastpath_enabled()
        # attention as its ops (matmuls, softmax), each rounded, not one fused kernel computing inside in float32
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), _RoundedToHalf():
                return self.rounded(x.float().half().float())
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)


class _RoundedToHalf(TorchDispatchMode):
    """Rounds the float32 result of every aten op to float16 (kept in float32). A view aliases a result that is
    rounded already; an in-place op's result is rounded where it lies."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return out
        if any(r.alias_info is not None for r in returns):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    t.copy_(t.half())
            return out
        return tree_map(
            lambda t: t.half().float() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, out
        )


class CoreMLFormat(Format):
    """A Core ML ML program package: preflight, export, load (macOS only) and the proxies that stand in for it
    elsewhere."""

    name, suffix = "coreml", ".mlpackage"
    precisions = (Precision.FP16, Precision.FP32)  # Core ML compute precision
    options = ("deployment_target", "input", "compression", "nbits")
    proxies_version = 2  # 2: the fp16 proxy emulates half precision in float32 (1: ran it in CPU half kernels)

    def preflight(
        self, precision, deployment_target=DEFAULT_TARGET, input="image", compression="none", nbits=None
    ) -> None:
        version = _ios_version(deployment_target)
        if version < 15:
            raise UsageError(
                f"coreml: deployment target {deployment_target} is too old; ML programs need iOS15 or later"
            )
        if input not in INPUTS:
            raise UsageError(f"coreml: input must be one of {', '.join(INPUTS)}, got {input!r}")
        if compression not in COMPRESSIONS:
            raise UsageError(f"coreml: unknown compression {compression!r}; choose from {', '.join(COMPRESSIONS)}")
        if nbits is not None and (isinstance(nbits, bool) or nbits not in PALETTE_NBITS):
            raise UsageError(f"coreml: nbits must be one of {', '.join(map(str, PALETTE_NBITS))}, got {nbits!r}")
        if compression == "palettize" and nbits is None:
            raise UsageError("coreml: compression=palettize needs nbits")
        # coremltools would silently raise the package's deployment target instead of refusing
        if compression != "none" and version < 16:
            raise UsageError(
                f"coreml: compression={compression} needs deployment target iOS16 or later, got {deployment_target}"
            )
        if compression == "palettize" and nbits == 3 and version < 18:
            raise UsageError(
                f"coreml: 3-bit palettization needs deployment target iOS18 or later, got {deployment_target}"
            )

    def export(
        self,
        model,
        example,
        precision,
        calib,
        path: Path,
        meta: dict,
        deployment_target=DEFAULT_TARGET,
        input="image",
        compression="none",
        nbits=None,
    ) -> dict:
        self.preflight(precision, deployment_target, input, compression, nbits)
        if input == "image" and example.dim() != 4:  # an image input is one frame: a clip (N, 3, T, H, W) is a tensor
            input = "tensor"
        options = {
            "deployment_target": deployment_target,
            "input": input,
            "compression": compression,
            "nbits": nbits if compression == "palettize" else None,
        }
        image_size = _image_size(meta["preprocessing"], example)
        model, pooled = global_pool3d_as_mean(model)
        with _scratch_beside(Path(path)), _without_progress_bars():  # reading the package back draws bars too
            with rel_pos_within_rank5(model) as rel_pos:
                mlmodel = _compress(
                    _convert(model, example, precision, meta, deployment_target, input), compression, nbits
                )
            with torch.no_grad():  # after _convert, which put the model in eval mode
                output_shape = list(model(example).shape)
            _describe(mlmodel, precision, meta, options, image_size, output_shape)
            mlmodel.save(str(path))
            _make_reproducible(Path(path))
            details = _spec_check(path, precision, meta, options, output_shape)
        rewritten = {"adaptive_avg_pool3d_as_mean": pooled, "relative_positions_within_rank5": rel_pos}
        if any(rewritten.values()):
            details["rewrites"] = {name: done for name, done in rewritten.items() if done}
        return details

    def load(self, path: Path, threads: int):
        """On macOS: feeds what an app feeds (an 8-bit RGB image, or the tensor) and returns the
        package's scores output (`logits`: (1, C), or (1, C, H, W) per pixel), compared with eager's
        like every other format. Core ML has no thread setting; `threads` does not apply."""
        if sys.platform != "darwin":
            raise RuntimeUnavailable(f"Core ML predict needs macOS; this host is {sys.platform}")
        import coremltools as ct
        from PIL import Image

        info = _user_metadata(path)
        mlmodel = ct.models.MLModel(str(path), compute_units=ct.ComputeUnit.ALL)
        output = info.get("output", LOGITS_OUTPUT)
        if info["input"] == "tensor":
            return lambda x: torch.from_numpy(
                np.asarray(mlmodel.predict({"input": x.numpy()})[output], dtype=np.float32)
            )
        pre = json.loads(info["preprocessing"])
        mean = torch.tensor(pre["mean"]).view(-1, 1, 1)
        std = torch.tensor(pre["std"]).view(-1, 1, 1)

        def run(x):
            pixels = ((x[0] * std + mean) * 255).round().clamp(0, 255).to(torch.uint8)
            image = Image.fromarray(pixels.permute(1, 2, 0).numpy(), mode="RGB")
            return torch.from_numpy(np.asarray(mlmodel.predict({"image": image})[output], dtype=np.float32))

        return run

    def proxies(self, path: Path, model: nn.Module) -> dict:
        """Numerical stand-ins on hosts without Core ML; they are not Core ML's results.

        weights: eager PyTorch (fp32) with the package's decompressed weights, so the effect of
                 fp16 storage and of the compression is measured, not fp16 arithmetic.
        fp16:    the eager model with every weight and op result rounded to float16 (fp16 packages only).
        """
        import coremltools as ct

        mlmodel = ct.models.MLModel(str(path), skip_model_load=True)
        with _scratch_beside(Path(path)), _without_progress_bars():
            weighted = _with_package_weights(model, _layer_weights(mlmodel))
        runners = {"weights": lambda x: weighted(x)}
        if _user_metadata(path)["compute_precision"] == Precision.FP16:
            runners[Precision.FP16] = EagerFp16(model)
        return runners


FORMAT = CoreMLFormat()
