"""PT2E static int8 (torchao) with a format's PT2E quantizer, and layers kept in float on request.

The quantizer is the backend's parameter (`Pt2eQuantizer`): ExecuTorch's XNNPACK quantizer by default (`XNNPACK`);
a format that lowers elsewhere passes its own (LiteRT's PT2EQuantizer, exporter/formats/litert.py), and the search,
the float fallback and the report stay the same. Histogram-calibrated activations and per-channel symmetric
weights come from that quantizer's own symmetric config.

Keeping a layer in float means its weights, its input and its output stay float: both quantizers annotate an op's
output on the producer's side, so the annotation of the producer (through view-like and elementwise ops that carry
no annotation of their own) is dropped too; other consumers of that tensor still quantize it on their own input
edge. The XNNPACK partitioner takes the mixed graph into its delegate."""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx import Node

from .calibration import STATIC_RANGES
from .fold import fold_constants, unread_writes
from .sensitivity import quantizable_layers
from .threads import one_thread

LAYER_TARGETS = {torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.linear.default}
KEY = "quantization_annotation"
# ops that only move or reshape data: whether they are "float" says nothing about where the time or error goes
DATA_MOVEMENT = {
    "view",
    "reshape",
    "_unsafe_view",
    "permute",
    "transpose",
    "t",
    "flatten",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "clone",
    "contiguous",
    "alias",
    "detach",
    "dropout",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "unflatten",
    "cat",
    "stack",
    "sym_size",
    "_assert_tensor_metadata",
    "lift_fresh_copy",
    "_to_copy",
    "to",
    "arange",
    "zeros",
    "ones",
    "full",
    "empty",
    "scalar_tensor",
    "index",
    "gather",
    "roll",
    "pad",
    "constant_pad_nd",
}
# Op kinds the search can keep in float as a whole (every such op), when plain PTQ misses its budget. Adds: the
# XNNPACK quantizer gives every add's output a per-tensor int8 range, and a residual stream that grows block by
# block (EfficientNetV2-S trained on digits: ±9 in stage 1, ±300 in the last) is requantized at every block: its
# 35 adds cost it 6.6 dB (26.5 → 33.1 dB, eager's tensors otherwise as int8), no one of them more than 1.9 dB, so
# no layer the search could float recovers it. ONNX Q/DQ leaves adds float already (Q/DQ on layer inputs only).
OP_KINDS = {"add": {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}}
MAX_WALK = 6  # ops between a layer and the producer whose output annotation quantizes its input
TRANSPOSES = {"transpose", "permute", "t"}
PADS = {torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default}
# set by a format's rewrite on an op that stands for one the quantizer shares its input's range through (the plain
# pool that replaced an adaptive one: formats.rewrites.adaptive_pools_as_pools)
SHARES_INPUT_RANGE = "exporter_shares_input_range"
BATCH_NORMS = {torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit_no_training.default}
FOLDED_CONVS = {
    torch.ops.aten.conv1d.default,
    torch.ops.aten.conv2d.default,
    torch.ops.aten.conv3d.default,
    torch.ops.aten.conv_transpose1d.default,
    torch.ops.aten.conv_transpose2d.input,
}


def layer_name(node: Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def _float_input(node: Node, floated: set[str]) -> None:
    """Leave the activation feeding `node` in float: clear the nearest producer's output annotation.
    XNNPACK delegates a quantized op only with quantized inputs *and* output, so the op whose output
    goes float goes float whole (a conv's pattern reaches back through its BatchNorm and activation)."""
    producer = node.args[0]
    for _ in range(MAX_WALK):
        if not isinstance(producer, Node) or producer.op != "call_function":
            return
        annotation = producer.meta.get(KEY)
        if annotation is not None and annotation.output_qspec is not None:
            annotation.output_qspec = None
            if _is_propagated(annotation):  # a view-like op sharing its producer's quantization
                annotation.input_qspec_map = {}
                producer = producer.args[0]
                continue
            _float_pattern(producer, floated)
            return
        producer = producer.args[0] if producer.args else None


def _float_output(node: Node) -> None:
    """Leave a float layer's output float too: clear the output annotation at the end of its pattern
    (the layer itself, or the BatchNorm/activation fused after it). Consumers that are quantized ops
    quantize it on their own input edge."""
    for _ in range(MAX_WALK):
        annotation = node.meta.get(KEY)
        if annotation is not None and annotation.output_qspec is not None:
            annotation.output_qspec = None
            return
        users = list(node.users)
        if len(users) != 1 or (users[0].meta.get(KEY) is not None and users[0].meta[KEY].input_qspec_map):
            return  # the next op is annotated on its own: it starts a pattern of its own
        node = users[0]


def _is_propagated(annotation) -> bool:
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    specs = list(annotation.input_qspec_map.values())
    return bool(specs) and all(isinstance(s, SharedQuantizationSpec) for s in specs)


def _float_pattern(node: Node, floated: set[str]) -> None:
    for _ in range(MAX_WALK):
        annotation = node.meta.get(KEY)
        if annotation is not None and annotation.input_qspec_map:
            annotation.input_qspec_map = {}
            if node.target in LAYER_TARGETS:
                floated.add(layer_name(node))
            return
        if not node.args or not isinstance(node.args[0], Node):
            return
        node = node.args[0]


def _share_through_zero_pads(model, propagate_annotation) -> None:
    """A zero pad of an int8 tensor shares its input's quantization, as XNNPACK's quantizer does for views (and so
    does an op a rewrite marked SHARES_INPUT_RANGE, as the op it replaced did).
    Left unannotated, the XNNPACK delegate still takes the pad with its int8 input but a float output when the
    next op is float (a LayerNorm after Swin's window and patch-merging pads), and the program then fails to
    load (StaticConstantPad: xnn_status_invalid_parameter). Padding with zeros is exact at the input's scale."""
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, SharedQuantizationSpec

    shared = False
    for node in model.graph.nodes:
        if (
            node.op != "call_function"
            or node.meta.get(KEY) is not None
            or node.target not in PADS
            and not node.meta.get(SHARES_INPUT_RANGE)
        ):
            continue
        producer = node.args[0]
        if node.target == torch.ops.aten.pad.default:
            mode, value = _arg(node, 2, "mode", "constant"), _arg(node, 3, "value", None)
        elif node.target in PADS:
            mode, value = "constant", _arg(node, 2, "value", 0)
        else:
            mode, value = "constant", None
        annotation = producer.meta.get(KEY) if isinstance(producer, Node) else None
        if mode != "constant" or value not in (None, 0) or annotation is None or annotation.output_qspec is None:
            continue
        spec = SharedQuantizationSpec(producer)
        node.meta[KEY] = QuantizationAnnotation(input_qspec_map={producer: spec}, output_qspec=spec, _annotated=True)
        shared = True
    if shared:
        propagate_annotation(model)  # the views after a pad (Swin's patch-merging slices) share it in turn


def _arg(node: Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _drop_dangling_shares(graph) -> None:
    """A SharedQuantizationSpec that points at a tensor left in float has nothing to share."""
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    def live(spec) -> bool:
        if not isinstance(spec, SharedQuantizationSpec):
            return True
        target = spec.edge_or_node
        if isinstance(target, Node):
            annotation = target.meta.get(KEY)
            return annotation is not None and annotation.output_qspec is not None
        producer, consumer = target
        annotation = consumer.meta.get(KEY)
        return annotation is not None and annotation.input_qspec_map.get(producer) is not None

    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            annotation = node.meta.get(KEY)
            if annotation is None:
                continue
            if not live(annotation.output_qspec):
                annotation.output_qspec, changed = None, True
            for arg, spec in list(annotation.input_qspec_map.items()):
                if not live(spec):
                    del annotation.input_qspec_map[arg]
                    changed = True


def _float_kinds(model, float_kinds) -> None:
    """Leave every op of `float_kinds` (OP_KINDS) in float: inputs and output (through an activation fused
    after it, add + ReLU). Its consumers quantize it on their own input edge."""
    targets = set().union(*(OP_KINDS[kind] for kind in float_kinds))
    for node in list(model.graph.nodes):
        annotation = node.meta.get(KEY) if node.op == "call_function" and node.target in targets else None
        if annotation is not None and (annotation.input_qspec_map or annotation.output_qspec is not None):
            annotation.input_qspec_map = {}
            _float_output(node)


def _dynamic_convs_before_relu(model, config) -> None:
    """Annotate a conv whose only user is a ReLU as XNNPACK's dynamic conv pattern annotates the others: its input
    quantized per inference, per-channel int8 weights, its output (and the ReLU) float. The quantizer leaves such a
    conv to its conv+ReLU pattern, which is static only, so in dynamic mode every conv of a ReLU network (once
    BatchNorm is folded) stayed float. Depthwise convs stay float: XNNPACK has no dynamic depthwise kernel."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils import is_relu_node
    from executorch.backends.xnnpack.utils.utils import is_depthwise_conv
    from torchao.quantization.pt2e.quantizer import (
        QuantizationAnnotation,
        get_bias_qspec,
        get_input_act_qspec,
        get_weight_qspec,
    )

    for node in model.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.conv2d.default or KEY in node.meta:
            continue
        users, weight = list(node.users), node.args[1]
        bias = _arg(node, 2, "bias", None)
        shape = getattr(weight.meta.get("val"), "shape", None)
        if (
            len(users) != 1
            or not is_relu_node(users[0])
            or shape is None
            or len(shape) != 4
            or is_depthwise_conv(shape, 1, False)
            or KEY in weight.meta
        ):
            continue
        qspecs = {node.args[0]: get_input_act_qspec(config), weight: get_weight_qspec(config)}
        if isinstance(bias, Node):
            qspecs[bias] = get_bias_qspec(config)
        node.meta[KEY] = QuantizationAnnotation(input_qspec_map=qspecs, output_qspec=None, _annotated=True)
        for constant in (weight, bias):
            if isinstance(constant, Node):
                constant.meta[KEY] = QuantizationAnnotation(_annotated=True)


def _float_dynamic_after_transpose(model) -> None:
    """Leave float a dynamically quantized conv whose input comes through a transpose (ShuffleNetV2's channel
    shuffle: view, transpose, view). XNNPACK's lowering gets that input wrong: a toy's .pte was garbage against its
    own int8 graph, ShuffleNetV2's failed at run time (Propagating input shapes failed). Static int8 is not affected."""
    for node in model.graph.nodes:
        annotation = node.meta.get(KEY)
        if (
            node.op != "call_function"
            or node.target not in (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default)
            or not getattr(annotation, "input_qspec_map", None)
        ):
            continue
        producer = node.args[0]
        for _ in range(MAX_WALK):
            if not isinstance(producer, Node) or producer.op != "call_function" or not producer.args:
                break
            kind = getattr(producer.target, "_schema", None) and producer.target._schema.name.split("::")[-1]
            if kind in TRANSPOSES:
                annotation.input_qspec_map = {}
                break
            if kind not in DATA_MOVEMENT:
                break
            producer = producer.args[0]


def _own_dynamic_quantize(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give each layer reading a dynamically quantized tensor a quantize chain of its own (choose_qparams, quantize,
    dequantize). convert_pt2e makes one per tensor, and XNNPACK lowers a chain shared by a 3x3 and a 1x1 conv wrong:
    random ResNet50 and SqueezeNet 1.1 .pte files 6-7 dB from their own int8 graphs (a toy: the 3x3's output 6 dB,
    the 1x1's 40), and it cuts the delegate at each one."""
    graph = module.graph
    for dequantize in list(graph.nodes):
        if (
            dequantize.target != torch.ops.quantized_decomposed.dequantize_per_tensor.tensor
            or len(dequantize.users) < 2
        ):
            continue
        quantize = dequantize.args[0]
        scale, zero_point = quantize.args[1:3]
        choose = scale.args[0] if isinstance(scale, Node) and isinstance(zero_point, Node) else None
        if (
            getattr(choose, "target", None) != torch.ops.quantized_decomposed.choose_qparams.tensor
            or zero_point.args[0] is not choose
        ):
            continue
        for user in list(dequantize.users)[1:]:
            copies = {}
            with graph.inserting_before(user):
                for node in (choose, scale, zero_point, quantize, dequantize):
                    copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
            user.replace_input_with(dequantize, copies[dequantize])
    module.recompile()
    return module


class Pt2eQuantizer:
    """Which PT2E quantizer annotates the graph, for the runtime that lowers it. The default is ExecuTorch's
    XNNPACK quantizer (`XNNPACK`); a format lowering to another runtime subclasses this with its own. A subclass
    whose quantizer has no annotation helpers like XNNPACK's (`propagate_annotation`: views sharing their
    producer's quantization) names its own; only XNNPACK has the dynamic (qd8) patterns of ranges per inference."""

    name = "XNNPACKQuantizer"
    dynamic_ranges = True  # ranges chosen per inference (XNNPACK's qd8 kernels) as the search's fallback
    fold_quantize = True  # convert_pt2e stores int8 weights (False: float weights and their quantize ops kept)

    def quantizer_class(self) -> type:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer

        return XNNPACKQuantizer

    def config(self, dynamic: bool = False):
        """The quantizer's symmetric config: per-channel int8 weights, histogram activations (dynamic: per inference)."""
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import get_symmetric_quantization_config

        return get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)

    def propagate_annotation(self, model) -> None:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils import propagate_annotation

        propagate_annotation(model)


XNNPACK = Pt2eQuantizer()


def _quantizer(
    float_layers: set[str], float_kinds: tuple[str, ...] = (), dynamic: bool = False, kind: Pt2eQuantizer = XNNPACK
):
    """kind's quantizer (XNNPACK's by default), annotating as it does, then leaving `float_layers` and every op of
    `float_kinds` in float. dynamic (XNNPACK only): activations quantized per inference from their own range
    (XNNPACK's qd8 kernels), for the convolutions and linear layers XNNPACK lowers correctly so (not depthwise convs,
    nor a conv reading a transpose: those stay float, and count as float layers); every other op computes in float."""
    if dynamic and not kind.dynamic_ranges:
        raise ValueError(f"{kind.name} has no ranges chosen per inference")

    class FloatFallbackQuantizer(kind.quantizer_class()):
        floated: set[str] = set()  # the layers in float in the end: those asked for and their producers

        def annotate(self, model):
            model = super().annotate(model)
            if dynamic:
                _dynamic_convs_before_relu(model, self.global_config)
                _float_dynamic_after_transpose(model)
            _share_through_zero_pads(model, kind.propagate_annotation)
            self.floated = set(float_layers)
            for node in list(model.graph.nodes):
                if node.op == "call_function" and node.target in LAYER_TARGETS and layer_name(node) in float_layers:
                    annotation = node.meta.get(KEY)
                    if annotation is not None:
                        annotation.input_qspec_map = {}
                    _float_input(node, self.floated)
                    _float_output(node)
            _float_kinds(model, float_kinds)
            _drop_dangling_shares(model.graph)
            if dynamic:  # layers left float: depthwise convs, convs reading a transpose
                self.floated |= {
                    layer_name(n)
                    for n in model.graph.nodes
                    if n.op == "call_function"
                    and n.target in LAYER_TARGETS
                    and not getattr(n.meta.get(KEY), "input_qspec_map", None)
                }
            return model

    return FloatFallbackQuantizer().set_global(kind.config(dynamic))


def _conv_per_batchnorm(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give a BatchNorm whose conv's output is also read elsewhere a conv of its own. prepare_pt2e folds every
    BatchNorm into the conv before it without asking who else reads that conv: MaxViT's stem conv feeds both the
    first block's pre-norm BatchNorm and its AvgPool shortcut, so the shortcut got the normalised tensor and the
    int8 graph (as PyTorch ran it, and the .pte with it) was 11.9 dB from eager with nothing quantized yet. The copy
    computes the same conv once more for the BatchNorm; `_unshare_weights` then gives it weights of its own."""
    graph = module.graph
    for node in list(graph.nodes):
        conv = node.args[0] if node.op == "call_function" and node.target in BATCH_NORMS else None
        if (
            isinstance(conv, Node)
            and conv.op == "call_function"
            and conv.target in FOLDED_CONVS
            and len(conv.users) > 1
        ):
            with graph.inserting_after(conv):
                own = graph.call_function(conv.target, conv.args, conv.kwargs)
            own.meta = dict(conv.meta)
            node.replace_input_with(conv, own)
    module.recompile()
    return module


def _unshare_weights(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give every use of a weight or bias its own copy. The XNNPACK quantizer annotates a layer together with its
    weight node and skips a layer whose weight is already annotated, so a module applied more than once
    (RetinaNet's and FCOS's heads, run on every FPN level) was int8 at its first call only: its later calls stayed
    float on the int8 weight, which XNNPACK refuses at load (convolution: xnn_status_invalid_parameter). A copy
    needs a name of its own too: XNNPACK packs a layer's bias with its weights, under the constant's name, and a
    shared name gave every call the first call's bias, quantized at that call's input scale."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "get_attr" or len(node.users) < 2:
            continue
        is_parameter = node.target in dict(module.named_parameters())
        value = module.get_parameter(node.target) if is_parameter else module.get_buffer(node.target)
        for k, user in enumerate(list(node.users)[1:], start=1):
            name = f"_unshared_{node.target.replace('.', '_')}_{k}"
            copy = value.detach().clone()
            if is_parameter:  # as the original: prepare_pt2e folds BatchNorm into a conv weight as a parameter
                module.register_parameter(name, torch.nn.Parameter(copy, requires_grad=False))
            else:
                module.register_buffer(name, copy)
            with graph.inserting_before(user):
                own = graph.get_attr(name)
            own.meta = dict(node.meta)
            user.replace_input_with(node, own)
    module.recompile()
    return module


def _functional_if_written(exported):
    """PT2E observes a tensor where it is made: a write into it afterwards (`out = x.new_zeros(...); out[:, :3] = x`,
    the copy's own result read by nobody) reaches no observer, and the int8 model quantized the tensor as it was
    before the write (a toy: its zeros' range, the written channels lost, 1.25 off eager). Such a graph, once its
    constants are folded, is made functional: each write becomes an op whose result is read. Graphs without one
    (every torchvision classifier: in-place ReLUs and adds are read through their own results) are left as they are."""
    if not unread_writes(fold_constants(exported.module())[0]):
        return exported
    with torch.no_grad():
        return exported.run_decompositions({})


# Activation ranges chosen per inference, tried only when the histogram's static ranges miss the budget: a model
# whose activations' ranges move from image to image more than one static range can hold. Measured 2026-11-29 on
# EfficientNet-B2 and B1 trained on the digits (96 px, 300 held-out digits): static 25.1 and 27.1 dB from eager,
# dynamic 37.2 and 34.6 dB, top-1 agreement 0.967 → 0.990 and 0.980 → 0.997, p50 the same (1 thread, x86).
DYNAMIC = "dynamic"


class Pt2eBackend:
    range_methods = ("histogram",)
    fallback_range_methods = (DYNAMIC,)
    settings = ("dynamic_ranges", STATIC_RANGES)
    op_fallbacks = tuple(OP_KINDS)

    def __init__(
        self, model: torch.nn.Module, example: torch.Tensor, exported=None, quantizer: Pt2eQuantizer = XNNPACK
    ):
        """exported: `model`'s ExportedProgram as the format rewrote it (by default, exported here); quantizer: the
        PT2E quantizer of the runtime that lowers the result (ExecuTorch's XNNPACK by default)."""
        self.model = model
        self.quantizer = quantizer
        if not quantizer.dynamic_ranges:  # static ranges only: no fallback ranges, no setting that asks for them
            self.fallback_range_methods = ()
            self.settings = ()
        if exported is None:
            with torch.no_grad():
                exported = torch.export.export(model, (example,))
        self.exported = _functional_if_written(exported)
        exported_layers = {
            layer_name(n) for n in self.exported.graph.nodes if n.op == "call_function" and n.target in LAYER_TARGETS
        }
        self._layers = [name for name in quantizable_layers(model) if name in exported_layers]
        self._floated: dict[tuple, list[str]] = {}

    def _graph_module(self) -> torch.fx.GraphModule:
        return _unshare_weights(_conv_per_batchnorm(fold_constants(self.exported.module())[0]))

    def layers(self) -> list[str]:
        return list(self._layers)

    def describe(self, method: str) -> str:
        if method == DYNAMIC:
            return (
                "dynamic activation ranges (the input of each convolution and linear layer XNNPACK has a dynamic "
                "int8 kernel for quantized per inference from its own range; other layers and every other op in "
                "float), per-channel symmetric weights (PT2E, XNNPACKQuantizer is_dynamic)"
            )
        return f"histogram activation ranges (HistogramObserver), per-channel symmetric weights (PT2E, {self.quantizer.name})"

    def quantize(
        self, float_layers: list[str], range_images: list[torch.Tensor], method: str, float_kinds: tuple[str, ...] = ()
    ) -> torch.fx.GraphModule:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        quantizer = _quantizer(set(float_layers), float_kinds, dynamic=method == DYNAMIC, kind=self.quantizer)
        prepared = prepare_pt2e(self._graph_module(), quantizer)
        self._floated[(tuple(float_layers), method)] = [name for name in self._layers if name in quantizer.floated]
        with torch.no_grad(), one_thread():
            for x in range_images[:1] if method == DYNAMIC else range_images:  # nothing to observe but the graph
                prepared(x)
        converted = convert_pt2e(prepared, fold_quantize=self.quantizer.fold_quantize)
        return _own_dynamic_quantize(converted) if method == DYNAMIC else converted

    def float_closure(self, float_layers: list[str], method: str = "histogram") -> list[str]:
        return self._floated.get((tuple(float_layers), method), list(float_layers))

    def float_ops(
        self, float_layers: list[str], float_kinds: tuple[str, ...] = (), method: str | None = None
    ) -> dict[str, int]:
        """Compute ops, by aten name, that the quantizer leaves in float when `float_layers` and `float_kinds` are
        float: those it has no int8 pattern for (LayerNorm, softmax, GELU, …) and those kept in float."""
        from torchao.quantization.pt2e.utils import _fuse_conv_bn_

        module = self._graph_module()
        if (
            method == DYNAMIC
        ):  # as prepare_pt2e does before annotating: which convs the dynamic patterns take depends on it
            _fuse_conv_bn_(module)
        annotated = _quantizer(set(float_layers), float_kinds, method == DYNAMIC, self.quantizer).annotate(module)
        counts = Counter()
        for node in annotated.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            name = node.target._schema.name.split("::")[-1]
            if name in DATA_MOVEMENT:
                continue
            annotation = node.meta.get(KEY)
            if annotation is None or not (annotation.input_qspec_map or annotation.output_qspec is not None):
                counts[name] += 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
