"""Graph rewrites a format applies before lowering, each the same arithmetic by construction (where one splits a
sum, its parts are added in another order; validation checks every artifact as usual).

`drop_padding_taps`: a convolution whose dilation reaches far past its input has kernel taps that read only
zero padding for many output positions (DeepLabV3's ASPP: dilations 12, 24 and 36 on a 33x33 feature map at
520x520, 8x8 at 128x128). XNNPACK's indirect GEMM multiplies every tap at every position, padding included: at
128x128 the three ASPP branches took 10 of the `.pte`'s 12.8 ms; at 520x520 the `.pte` was slower than eager.
Each such convolution is replaced by convolutions over the regions of its output that read the same taps, each
with only those taps and no padding, joined by concatenation; when one region covers the whole output (every
output reads the same taps: at 128x128 only the centre one) that is a single smaller convolution, a 1x1 where
only the centre tap is left. The same non-zero products are summed, in another grouping.

`global_pool3d_as_mean`: coremltools 9 has no `adaptive_avg_pool3d` (R3D-18, MC3-18, R(2+1)D-18 and Swin3D pool
their clips' features with AdaptiveAvgPool3d(1)); to one output per channel that pool is the mean over time,
height and width, which Core ML converts.

`input_transform_as_affine`: GoogLeNet and Inception v3 re-normalize their input inside the model
(`transform_input`, which their torchvision weights set) one channel at a time: select, unsqueeze, scale, shift,
concatenate. XNNPACK takes the arithmetic but not the select and unsqueeze (`select_copy`×3, `unsqueeze_copy`×3
left outside the delegate in the `.pte`). The same per-channel scale and shift, as one multiply and one add over
all channels, is delegated; each element gets the same two float32 roundings, so eager's outputs are unchanged.

`single_tensor_cats`: DenseNet's dense layers concatenate their inputs, and the first layer of each block has one
(`torch.cat([x], 1)`); XNNPACK takes a concatenation of 2 or more tensors only, so those four were left outside
the delegate, each splitting the `.pte`'s graph. A concatenation of one tensor is that tensor: the node is dropped
from the exported graph (its users read its input).

`rel_pos_within_rank5`: Core ML takes tensors of rank 5 at most; MViT-V2's decomposed relative positions
(torchvision's `mvit._add_rel_pos`) reshape each query to (B, heads, T, H, W, C) and broadcast the three axes'
terms at rank 8 ("Layer view_8 outputs a rank 6 tensor"). The same sums, with batch and heads folded together
and each axis' term at rank 4, stay within rank 5.

`split_large_depthwise`: XNNPACK computes a depthwise convolution with its depthwise micro-kernels only up to 25
taps (its largest unipass tile, on x86 and ARM alike: `src/configs/dwconv-config.c`, multipass kernels are not
built by default); a larger one, ConvNeXt's 7x7 (49 taps), falls back to a grouped GEMM with one channel per group.
A 7x7 depthwise convolution over 96 channels at 56x56 took 17 ms in a `.pte` and 0.9 ms in eager PyTorch. The
kernel is split into centred parts of at most 25 taps, each a depthwise convolution of its own, summed: the 5x5
centre, the top and bottom rows (a 2x7 kernel dilated to span the 7 rows) and the left and right columns of the
rows between (a 5x2 kernel dilated to span the 7 columns). A centred part with the padding less its offset reads
exactly the input positions its taps read in the whole kernel, so the same products are summed, in another order.

`padded_avg_pools_as_pad`: XNNPACK's average pooling divides by the input pixels a window holds, so ExecuTorch
leaves a padded pool that counts its zero padding (torch's default; Inception v3's branches pool with
`F.avg_pool2d(x, 3, 1, 1)`, 9 of them) outside the delegate, splitting the `.pte`. A zero pad, then the pool
without padding, has the same windows holding the same zeros, and XNNPACK takes both. It works on the exported
graph (the pool is a function call, not a module), before quantization: an int8 pad shares its input's scale.

`adaptive_pools_as_pools`: ExecuTorch's XNNPACK partitioner takes an adaptive average pool only to one output per
channel (as a mean); VGG's and AlexNet's `AdaptiveAvgPool2d((7, 7))` / `((6, 6))` was left outside the delegate,
splitting the `.pte` in two, although at their 224x224 crop it pools 7x7 to 7x7 (6x6 to 6x6): nothing. Where the
input's height and width are multiples of the output's, each output reads exactly one k x k window, so the pool is
`avg_pool2d` with kernel and stride k, which XNNPACK takes; where they are equal it is the identity, dropped.
Other sizes (VGG at 128x128: 4x4 to 7x7, windows that overlap) are left as they are.

`chunks_as_slices`: XNNPACK has no split; ShuffleNetV2's blocks halve their channels with `x.chunk(2, dim=1)`, and
the 13 splits were left outside the delegate, cutting the `.pte` into 15 parts. Each piece is a slice of the input
along that dim (a copy of the same elements), which XNNPACK takes.

`means_keeping_dims`: XNNPACK takes a mean over height and width only with keepdim=True (its global average
pool); MNASNet and ShuffleNetV2 pool with `x.mean([2, 3])`, which was left outside the delegate. The same mean
with keepdim=True, then a reshape to N x C, is delegated; the reduction is the same one.

`attention_as_matmuls`: ExecuTorch has no XNNPACK attention; `scaled_dot_product_attention` (every ViT block, through
`nn.MultiheadAttention`) is decomposed when the graph is lowered into PyTorch's math path, whose softmax guards rows
that are all -inf (eq, logical_not, any, where over the whole score matrix), left outside the delegate: in
ViT-B/16's `.pte`, 62 of 488 ms (one thread). Without a mask no row can be all -inf for finite scores, so the same
attention is written as XNNPACK takes it: the scores' matmul scaled by one multiply, a softmax, the second matmul.

`matmuls_as_bmm`: a matmul of two tensors with the same batch dims (attention's, over batch and heads) is lowered as
an `expand` to the shape they already have (a copy, outside the delegate: 48 in ViT-B/16 and Swin-T), views and a
batched matmul. Reshaped to 3-d, multiplied with `bmm` and reshaped back, it is delegated whole: the same products.

`half_activations_as_arithmetic`: in an fp16 graph, ExecuTorch decomposes a hard sigmoid and a SiLU the way PyTorch
computes them for half tensors, in float32 between two casts; XNNPACK takes no dtype cast, so each one cut the
`.pte` (MobileNetV3-Small fp16: 20 casts outside the delegate, one per squeeze-and-excite gate and pool around
them). Written as the arithmetic they are (`clamp(x + 3, 0, 6) / 6`, `x * sigmoid(x)`), they stay in half and in
the delegate. The values are the same function in half precision; validation judges the fp16 artifact as usual.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn

# Splitting into regions pays only where the padded taps are a large share of a dense convolution's work: a
# 3x3 with padding 1 on a 7x7 map (every ResNet) would save 33% of its multiply-adds in nine slices and eight
# concatenations, and is left alone; DeepLabV3's dilation 12 on 33x33 saves 43%, 24 on 33x33 73%.
MIN_SAVED = 0.4


@dataclass(frozen=True)
class Region:
    """Outputs [start, stop) along one axis, all reading taps [first, last] of the kernel from input
    [begin, end) with no padding."""

    start: int
    stop: int
    first: int
    last: int
    begin: int
    end: int


def regions(size: int, kernel: int, stride: int, padding: int, dilation: int) -> list[Region] | None:
    """The output positions along one axis grouped by the taps that read the input (not padding); None when
    some output reads none."""
    outputs = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    found: list[Region] = []
    for y in range(outputs):
        useful = [k for k in range(kernel) if 0 <= y * stride - padding + k * dilation < size]
        if not useful:
            return None
        first, last = useful[0], useful[-1]
        if found and (found[-1].first, found[-1].last) == (first, last):
            found[-1] = Region(
                found[-1].start, y + 1, first, last, found[-1].begin, y * stride - padding + last * dilation + 1
            )
        else:
            found.append(
                Region(
                    y,
                    y + 1,
                    first,
                    last,
                    y * stride - padding + first * dilation,
                    y * stride - padding + last * dilation + 1,
                )
            )
    return found


def _replaced(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """`model` with its submodule `name` set to `module` (`module` itself where the name is "": the model is it)."""
    if not name:
        return module
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, module)
    return model


def _conv(conv: nn.Conv2d, rows: Region, cols: Region, padding=(0, 0)) -> nn.Conv2d:
    kernel = (rows.last - rows.first + 1, cols.last - cols.first + 1)
    dilation = tuple(1 if k == 1 else d for k, d in zip(kernel, conv.dilation))
    part = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        kernel,
        stride=conv.stride,
        padding=padding,
        dilation=dilation,
        groups=conv.groups,
        bias=conv.bias is not None,
        dtype=conv.weight.dtype,
        device=conv.weight.device,
    )
    with torch.no_grad():
        part.weight.copy_(conv.weight[:, :, rows.first : rows.last + 1, cols.first : cols.last + 1])
        if conv.bias is not None:
            part.bias.copy_(conv.bias)
    return part.train(conv.training)


class RegionConv(nn.Module):
    """A convolution computed region by region: each part reads its slice of the input with its own taps."""

    def __init__(self, conv: nn.Conv2d, rows: list[Region], cols: list[Region]):
        super().__init__()
        self.rows, self.cols = rows, cols
        self.parts = nn.ModuleList(_conv(conv, r, c) for r in rows for c in cols)

    def forward(self, x):
        height, width = x.shape[-2:]
        parts, rows = iter(self.parts), []
        for r in self.rows:
            # a slice spanning the whole axis exports as an alias, which XNNPACK does not take: not sliced
            band = x if (r.begin, r.end) == (0, height) else x[:, :, r.begin : r.end]
            rows.append(
                torch.cat(
                    [
                        next(parts)(band if (c.begin, c.end) == (0, width) else band[:, :, :, c.begin : c.end])
                        for c in self.cols
                    ],
                    dim=3,
                )
            )
        return torch.cat(rows, dim=2)


def _macs(axis: list[Region]) -> int:
    return sum((r.stop - r.start) * (r.last - r.first + 1) for r in axis)


def _replacement(conv: nn.Conv2d, spatial: tuple[int, int]) -> nn.Module | None:
    """What computes `conv` on inputs of `spatial` size without the taps that read padding, or None."""
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    axes = [regions(spatial[a], conv.kernel_size[a], conv.stride[a], conv.padding[a], conv.dilation[a]) for a in (0, 1)]
    if None in axes:
        return None
    rows, cols = axes
    full = [(rs[-1].stop) * conv.kernel_size[a] for a, rs in enumerate(axes)]
    if [_macs(rows), _macs(cols)] == full:
        return None  # every tap reads the input somewhere at every position
    if len(rows) == 1 and len(cols) == 1:
        # one smaller convolution: the same padding less what the dropped leading taps spanned, when the trim
        # is symmetric (the output keeps its size and every output reads the same input positions)
        r, c = rows[0], cols[0]
        padding = tuple(conv.padding[a] - reg.first * conv.dilation[a] for a, reg in enumerate((r, c)))
        symmetric = all(reg.first == conv.kernel_size[a] - 1 - reg.last for a, reg in enumerate((r, c)))
        if symmetric and min(padding) >= 0:
            return _conv(conv, r, c, padding)
    if conv.groups != 1 or 1 - _macs(rows) * _macs(cols) / (full[0] * full[1]) < MIN_SAVED:
        return None
    return RegionConv(conv, rows, cols)


def drop_padding_taps(model: nn.Module, example: torch.Tensor) -> tuple[nn.Module, list[dict]]:
    """`model`, or a copy of it in which every Conv2d skips the taps that read only padding at the spatial size
    `example` gives it; and what was changed. The model is returned as it is when nothing is (no artifact changes)."""
    seen: dict[nn.Module, set] = {}
    convs = [m for m in model.modules() if type(m) is nn.Conv2d]
    hooks = [
        m.register_forward_pre_hook(lambda module, args: seen.setdefault(module, set()).add(tuple(args[0].shape[-2:])))
        for m in convs
    ]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for hook in hooks:
            hook.remove()
    names = {module: name for name, module in model.named_modules()}
    plan = {}
    for conv in convs:
        sizes = seen.get(conv, set())
        if len(sizes) == 1:  # a convolution called at several sizes is left alone
            replacement = _replacement(conv, next(iter(sizes)))
            if replacement is not None:
                plan[names[conv]] = (replacement, next(iter(sizes)))
    if not plan:
        return model, []
    model = copy.deepcopy(model)
    done = []
    for name, (replacement, size) in plan.items():
        original = model.get_submodule(name)
        model = _replaced(model, name, replacement)
        kernels = (
            [list(p.kernel_size) for p in replacement.parts]
            if isinstance(replacement, RegionConv)
            else [list(replacement.kernel_size)]
        )
        done.append(
            {
                "module": name,
                "input": list(size),
                "kernel": list(original.kernel_size),
                "dilation": list(original.dilation),
                "parts": kernels,
            }
        )
    return model, done


class GlobalMean3d(nn.Module):
    """AdaptiveAvgPool3d(1), written as the mean over the last three dimensions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((-3, -2, -1), keepdim=True)


def global_pool3d_as_mean(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """`model`, or a copy of it with every AdaptiveAvgPool3d to a single output replaced by GlobalMean3d; and the
    modules replaced. The model is returned as it is when it has none (no artifact changes)."""
    names = [
        name
        for name, m in model.named_modules()
        if type(m) is nn.AdaptiveAvgPool3d and m.output_size in (1, (1, 1, 1), [1, 1, 1])
    ]
    if not names:
        return model, []
    model = copy.deepcopy(model)
    for name in names:
        model = _replaced(model, name, GlobalMean3d())
    return model, names


# torchvision's GoogLeNet and Inception3 `_transform_input`: ImageNet normalization -> (x - 0.5) / 0.5, per channel
INPUT_SCALE, INPUT_SHIFT = (
    (0.229 / 0.5, 0.224 / 0.5, 0.225 / 0.5),
    ((0.485 - 0.5) / 0.5, (0.456 - 0.5) / 0.5, (0.406 - 0.5) / 0.5),
)


def _affine_transform_input(self, x: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(INPUT_SCALE, dtype=x.dtype).view(1, 3, 1, 1)
    shift = torch.tensor(INPUT_SHIFT, dtype=x.dtype).view(1, 3, 1, 1)
    return x * scale + shift


def input_transform_as_affine(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """`model`, or a copy of it whose GoogLeNet/Inception3 modules with transform_input scale and shift their
    input's channels in one multiply and one add; and the modules changed. Returned as it is when it has none."""
    from torchvision.models.googlenet import GoogLeNet
    from torchvision.models.inception import Inception3

    names = [name for name, m in model.named_modules() if isinstance(m, (GoogLeNet, Inception3)) and m.transform_input]
    if not names:
        return model, []
    model = copy.deepcopy(model)
    for name in names:
        module = model.get_submodule(name)
        module._transform_input = _affine_transform_input.__get__(module)
    return model, names


def _relative_embeddings(table: torch.Tensor, q_size: int, k_size: int) -> torch.Tensor:
    """(q_size, k_size, C): per query and key position along one axis, the embedding of their distance, the
    table resampled to 2*max-1 distances and the coarser axis' positions scaled to the finer one's (MViT-V2)."""
    count = 2 * max(q_size, k_size) - 1
    if table.shape[0] != count:
        table = nn.functional.interpolate(table.T.unsqueeze(0), size=count, mode="linear").squeeze(0).T
    q_scale, k_scale = max(k_size / q_size, 1.0), max(q_size / k_size, 1.0)
    distance = torch.arange(q_size)[:, None] * q_scale - (torch.arange(k_size)[None, :] + (1.0 - k_size)) * k_scale
    return table[distance.long()]


def _rel_pos_rank5(attn, q, q_thw, k_thw, rel_pos_h, rel_pos_w, rel_pos_t):
    """mvit._add_rel_pos with no tensor above rank 5."""
    (q_t, q_h, q_w), (k_t, k_h, k_w) = q_thw, k_thw
    batch, heads, _, dim = q.shape
    n, queries = batch * heads, q_t * q_h * q_w
    r = q[:, :, 1:].reshape(n * q_t, q_h, q_w, dim)
    along_h = torch.einsum("nhwc,hkc->nhwk", r, _relative_embeddings(rel_pos_h, q_h, k_h))
    along_w = torch.einsum("nhwc,wkc->nhwk", r, _relative_embeddings(rel_pos_w, q_w, k_w))
    along_t = torch.einsum(
        "ntpc,tkc->ntpk", r.reshape(n, q_t, q_h * q_w, dim), _relative_embeddings(rel_pos_t, q_t, k_t)
    )
    rel = (
        along_t.reshape(n, queries, k_t, 1, 1)
        + along_h.reshape(n, queries, 1, k_h, 1)
        + along_w.reshape(n, queries, 1, 1, k_w)
    )
    attn[:, :, 1:, 1:] += rel.reshape(batch, heads, queries, k_t * k_h * k_w)
    return attn


@contextlib.contextmanager
def rel_pos_within_rank5(model: nn.Module):
    """While tracing `model`: MViT-V2's relative positions computed by `_rel_pos_rank5`; yields whether they
    were (a model without them is traced as it is)."""
    from torchvision.models.video import mvit

    uses = any(isinstance(m, mvit.MultiscaleAttention) and m.rel_pos_h is not None for m in model.modules())
    if not uses:
        yield False
        return
    original = mvit._add_rel_pos
    mvit._add_rel_pos = _rel_pos_rank5
    try:
        yield True
    finally:
        mvit._add_rel_pos = original


def single_tensor_cats(exported):
    """`exported` (a torch.export ExportedProgram) without its concatenations of one tensor; how many it had."""
    graph = exported.graph_module.graph
    outputs = {a for node in graph.nodes if node.op == "output" for a in torch.utils._pytree.tree_leaves(node.args)}
    dropped = 0
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target == torch.ops.aten.cat.default
            and len(node.args[0]) == 1
            and node not in outputs
        ):
            node.replace_all_uses_with(node.args[0][0])
            graph.erase_node(node)
            dropped += 1
    if dropped:
        graph.lint()
        exported.graph_module.recompile()
    return exported, dropped


DEPTHWISE_TAPS = 25  # XNNPACK's largest depthwise tile


@dataclass(frozen=True)
class KernelPart:
    """The taps of a kernel at rows `rows` and columns `cols` (kernel indices, evenly spaced)."""

    rows: tuple[int, ...]
    cols: tuple[int, ...]


def kernel_parts(height: int, width: int, taps: int = DEPTHWISE_TAPS) -> list[KernelPart] | None:
    """A height x width kernel as parts of at most `taps` taps, each centred in the kernel (so that it keeps the
    convolution's output positions) and evenly spaced (so that it is one dilated kernel): the centre, then a
    ring of two rows and two columns at a time. None when some part would still be larger."""
    parts, top, left, bottom, right = [], 0, 0, height - 1, width - 1
    while (bottom - top + 1) * (right - left + 1) > taps:
        if bottom - top < 2 or right - left < 2 or 2 * (right - left + 1) > taps or 2 * (bottom - top - 1) > taps:
            return None
        parts.append(KernelPart((top, bottom), tuple(range(left, right + 1))))
        parts.append(KernelPart(tuple(range(top + 1, bottom)), (left, right)))
        top, left, bottom, right = top + 1, left + 1, bottom - 1, right - 1
    return [KernelPart(tuple(range(top, bottom + 1)), tuple(range(left, right + 1)))] + parts


def _spacing(indices: tuple[int, ...]) -> int:
    return indices[1] - indices[0] if len(indices) > 1 else 1


class SplitDepthwise(nn.Module):
    """A depthwise convolution as the sum of depthwise convolutions over parts of its kernel (kernel_parts)."""

    def __init__(self, conv: nn.Conv2d, parts: list[KernelPart]):
        super().__init__()
        self.parts = nn.ModuleList()
        for i, part in enumerate(parts):
            dilation = tuple(_spacing(idx) * d for idx, d in zip((part.rows, part.cols), conv.dilation))
            padding = tuple(p - idx[0] * d for p, idx, d in zip(conv.padding, (part.rows, part.cols), conv.dilation))
            piece = nn.Conv2d(
                conv.in_channels,
                conv.out_channels,
                (len(part.rows), len(part.cols)),
                stride=conv.stride,
                padding=padding,
                dilation=dilation,
                groups=conv.groups,
                bias=conv.bias is not None and i == 0,
                dtype=conv.weight.dtype,
                device=conv.weight.device,
            )
            with torch.no_grad():
                piece.weight.copy_(conv.weight[:, :, list(part.rows)][:, :, :, list(part.cols)])
                if piece.bias is not None:
                    piece.bias.copy_(conv.bias)
            self.parts.append(piece.train(conv.training))

    def forward(self, x):
        out = self.parts[0](x)
        for part in self.parts[1:]:
            out = out + part(x)
        return out


def _split_plan(conv: nn.Module) -> list[KernelPart] | None:
    # XNNPACK's depthwise kernels take one input and one output channel per group: with a channel multiplier the
    # convolution is a grouped GEMM whatever its size, and splitting it would only add GEMMs
    if (
        type(conv) is not nn.Conv2d
        or conv.groups == 1
        or not conv.in_channels == conv.out_channels == conv.groups
        or conv.padding_mode != "zeros"
        or isinstance(conv.padding, str)
    ):
        return None
    height, width = conv.kernel_size
    if height * width <= DEPTHWISE_TAPS:
        return None
    parts = kernel_parts(height, width)
    if parts is None or any(
        p - idx[0] * d < 0 for part in parts for p, idx, d in zip(conv.padding, (part.rows, part.cols), conv.dilation)
    ):
        return None  # a part would need negative padding: the padding is smaller than the ring it drops
    return parts


def split_large_depthwise(model: nn.Module) -> tuple[nn.Module, list[dict]]:
    """`model`, or a copy of it whose depthwise Conv2d larger than XNNPACK's depthwise tile are SplitDepthwise;
    and what was changed. The model is returned as it is when it has none (no artifact changes)."""
    plan = {name: parts for name, m in model.named_modules() if (parts := _split_plan(m)) is not None}
    if not plan:
        return model, []
    model = copy.deepcopy(model)
    done = []
    for name, parts in plan.items():
        original = model.get_submodule(name)
        model = _replaced(model, name, SplitDepthwise(original, parts))
        done.append(
            {"module": name, "kernel": list(original.kernel_size), "parts": [[len(p.rows), len(p.cols)] for p in parts]}
        )
    return model, done


def _pool_args(node) -> tuple:
    """avg_pool2d's arguments with their defaults: (input, kernel, stride, padding, ceil_mode, count_include_pad,
    divisor_override); a one-number kernel, stride or padding stands for both axes, an empty stride is the kernel."""
    names = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    values = [None, None, [], [0], False, True, None]
    for i, name in enumerate(names):
        if i < len(node.args):
            values[i] = node.args[i]
        elif name in node.kwargs:
            values[i] = node.kwargs[name]
    x, kernel, stride, padding, ceil_mode, count_pad, divisor = values
    pair = lambda v: (list(v) * 2)[:2] if len(v) == 1 else list(v)  # noqa: E731
    kernel = pair(kernel)
    return x, kernel, pair(stride) if stride else kernel, pair(padding), ceil_mode, count_pad, divisor


def padded_avg_pools_as_pad(exported):
    """`exported` (an ExportedProgram) with each padded average pool that counts its padding as a zero pad and an
    unpadded pool; how many. Ceil mode and a divisor override are left alone (XNNPACK takes neither)."""
    graph = exported.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.avg_pool2d.default:
            continue
        x, kernel, stride, (ph, pw), ceil_mode, count_pad, divisor = _pool_args(node)
        if not (ph or pw) or not count_pad or ceil_mode or divisor is not None:
            continue
        with graph.inserting_before(node):
            padded = graph.call_function(torch.ops.aten.constant_pad_nd.default, (x, [pw, pw, ph, ph], 0.0))
        padded.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
        val = x.meta.get("val")
        if val is not None:
            with val.fake_mode:
                padded.meta["val"] = torch.ops.aten.constant_pad_nd.default(val, [pw, pw, ph, ph], 0.0)
        node.args, node.kwargs = (padded, kernel, stride, [0, 0], False, True), {}
        changed += 1
    if changed:
        graph.lint()
        exported.graph_module.recompile()
    return exported, changed


def _new_node(graph, before, target, args):
    """A call of `target` inserted before `before`, with its fake value computed from its inputs' as export would
    have recorded it."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
    fake = next((v for v in vals if isinstance(v, torch.Tensor)), None)
    if fake is not None:
        with fake.fake_mode:
            node.meta["val"] = target(*vals)
    return node


def _become(node, target, args) -> None:
    """`node` made a call of `target` in place (its name, which the program's output signature may hold, kept),
    no longer claiming the module it came from: the XNNPACK quantizer finds an adaptive pool by its module, and
    would take the plain pool that replaced it for one."""
    node.target, node.args, node.kwargs = target, tuple(args), {}
    for key in ("nn_module_stack", "source_fn_stack"):
        node.meta.pop(key, None)


def _arg(node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _static_shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return None
    return tuple(val.shape)


def _finish(exported, changed: int):
    if changed:
        exported.graph_module.graph.lint()
        exported.graph_module.recompile()
    return exported, changed


def adaptive_pools_as_pools(exported):
    """`exported` (an ExportedProgram) with each adaptive average pool whose input sizes are multiples of its
    output's (other than to 1x1, which lowers as a mean) as a plain pool, or dropped where the sizes are equal;
    how many. The plain pool keeps the adaptive one's int8 treatment (its output shares its input's range,
    quant.pt2e.SHARES_INPUT_RANGE)."""
    from ..quant.pt2e import SHARES_INPUT_RANGE

    graph = exported.graph_module.graph
    outputs = {a for node in graph.nodes if node.op == "output" for a in torch.utils._pytree.tree_leaves(node.args)}
    pools = (torch.ops.aten.adaptive_avg_pool2d.default, torch.ops.aten._adaptive_avg_pool2d.default)
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in pools:
            continue
        x, size = node.args[0], list(node.args[1])
        shape = _static_shape(x)
        if shape is None or len(shape) != 4 or not all(isinstance(v, int) and v > 0 for v in size):
            continue
        (h, w), (oh, ow) = shape[2:], size
        if (oh, ow) == (1, 1) or h % oh or w % ow:
            continue
        if (h, w) == (oh, ow):
            if node in outputs:
                continue
            node.replace_all_uses_with(x)
            graph.erase_node(node)
        else:
            kernel = [h // oh, w // ow]
            _become(node, torch.ops.aten.avg_pool2d.default, (x, kernel, kernel))
            node.meta[SHARES_INPUT_RANGE] = True
        changed += 1
    return _finish(exported, changed)


def means_keeping_dims(exported):
    """`exported` (an ExportedProgram) with each mean over the height and width of a 4-d tensor that drops those
    dims as the mean keeping them, reshaped to N x C; how many."""
    graph = exported.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.mean.dim or node.kwargs.get("dtype") is not None:
            continue
        x, dims = node.args[0], node.args[1]
        keepdim = len(node.args) > 2 and bool(node.args[2])
        shape = _static_shape(x)
        if (
            keepdim
            or shape is None
            or len(shape) != 4
            or not isinstance(dims, (list, tuple))
            or sorted(d % 4 for d in dims) != [2, 3]
        ):
            continue
        mean = _new_node(graph, node, torch.ops.aten.mean.dim, (x, list(dims), True))
        _become(node, torch.ops.aten.view.default, (mean, [-1, shape[1]]))
        changed += 1
    return _finish(exported, changed)


def chunks_as_slices(exported):
    """`exported` (an ExportedProgram) with each chunk or split of a tensor of static shape, all of whose users take
    one piece, as one slice per piece taken; how many."""
    import operator

    graph = exported.graph_module.graph
    splits = (torch.ops.aten.chunk.default, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in splits:
            continue
        pieces = node.meta.get("val")
        x, dim = node.args[0], (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
        shape = _static_shape(x)
        if (
            shape is None
            or not isinstance(pieces, (list, tuple))
            or not all(u.op == "call_function" and u.target is operator.getitem for u in node.users)
        ):
            continue
        dim %= len(shape)
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + int(piece.shape[dim]))
        for user in list(node.users):
            if not user.users:  # a piece nobody reads
                graph.erase_node(user)
                continue
            i = user.args[1]
            _become(user, torch.ops.aten.slice.Tensor, (x, dim, starts[i], starts[i + 1]))
        graph.erase_node(node)
        changed += 1
    return _finish(exported, changed)


def attention_as_matmuls(exported):
    """`exported` (an ExportedProgram) with each scaled dot-product attention that has no mask, no dropout, is not
    causal and does not group queries, as matmul, scale, softmax and matmul; how many."""
    import math

    graph = exported.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.scaled_dot_product_attention.default:
            continue
        q, k, v = node.args[:3]
        options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), node.args[3:]), **node.kwargs)
        shape = _static_shape(q)
        if (
            options.get("attn_mask") is not None
            or options.get("dropout_p", 0.0) != 0.0
            or options.get("is_causal")
            or options.get("enable_gqa")
            or shape is None
        ):
            continue
        scale = options.get("scale")
        scale = 1.0 / math.sqrt(shape[-1]) if scale is None else scale
        keys = _new_node(graph, node, torch.ops.aten.transpose.int, (k, -2, -1))
        scores = _new_node(graph, node, torch.ops.aten.matmul.default, (q, keys))
        scaled = _new_node(graph, node, torch.ops.aten.mul.Tensor, (scores, float(scale)))
        weights = _new_node(graph, node, torch.ops.aten.softmax.int, (scaled, -1))
        _become(node, torch.ops.aten.matmul.default, (weights, v))
        changed += 1
    return _finish(exported, changed)


def _dequantized(node) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and "dequantize" in getattr(node.target, "__name__", str(node.target))
    )


def matmuls_as_bmm(exported):
    """`exported` (an ExportedProgram) with each float matmul of two tensors of 3 or more dims and the same static
    batch dims as reshapes to 3-d around a bmm; how many. A matmul whose input is a dequantize is left as it is, a
    caution, not a measured need: only a direct dequantize is seen (a quantized toy ViT block, whose matmuls read
    dequantized tensors through views, lowers the same either way)."""
    graph = exported.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.matmul.default:
            continue
        a, b = node.args
        sa, sb = _static_shape(a), _static_shape(b)
        if (
            sa is None
            or sb is None
            or len(sa) < 3
            or len(sa) != len(sb)
            or sa[:-2] != sb[:-2]
            or _dequantized(a)
            or _dequantized(b)
        ):
            continue
        a3 = _new_node(graph, node, torch.ops.aten.reshape.default, (a, [-1, *sa[-2:]]))
        b3 = _new_node(graph, node, torch.ops.aten.reshape.default, (b, [-1, *sb[-2:]]))
        product = _new_node(graph, node, torch.ops.aten.bmm.default, (a3, b3))
        _become(node, torch.ops.aten.reshape.default, (product, [*sa[:-1], sb[-1]]))
        changed += 1
    return _finish(exported, changed)


NEAREST_UPSAMPLES = {torch.ops.aten.upsample_nearest2d.vec, torch.ops.aten.upsample_nearest2d.default}


def nearest_upsamples_as_deconvs(module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """`module` (an exported graph's module, changed in place) with each nearest upsampling by whole factors as a
    depthwise transposed convolution whose kernel is the factor and whose weights are ones (it writes each pixel
    into its factor's block, exactly what nearest does); how many. XNNPACK has no nearest resize in ExecuTorch's
    partitioner: the FPN of RetinaNet and FCOS left its two upsamplings outside, each splitting the delegate."""
    graph, changed = module.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in NEAREST_UPSAMPLES:
            continue
        source, shape = _static_shape(node.args[0]), _static_shape(node)
        if (
            source is None
            or shape is None
            or len(source) != 4
            or any(o % i for o, i in zip(shape[2:], source[2:]))
            or not node.meta["val"].dtype.is_floating_point
        ):  # no integer convolutions (a uint8 mask)
            continue
        factors = [o // i for o, i in zip(shape[2:], source[2:])]
        if node.target == torch.ops.aten.upsample_nearest2d.vec:
            scales = _arg(node, 2, "scale_factors")
        else:
            scales = [_arg(node, 2, "scales_h"), _arg(node, 3, "scales_w")]
        # given scales pick source pixels by 1/scale, not by the sizes' ratio: they must be the factors themselves
        if scales is not None and any(s is not None and s != f for s, f in zip(scales, factors)):
            continue
        name = f"_nearest_upsample_{changed}"
        module.register_buffer(name, torch.ones(source[1], 1, *factors, dtype=node.meta["val"].dtype))
        with graph.inserting_before(node):
            weight = graph.get_attr(name)
            deconv = graph.call_function(
                torch.ops.aten.conv_transpose2d.input,
                (node.args[0], weight, None, factors, [0, 0], [0, 0], source[1], [1, 1]),
            )
        deconv.meta = dict(node.meta)
        node.replace_all_uses_with(deconv)
        graph.erase_node(node)
        changed += 1
    if changed:
        graph.lint()
        module.recompile()
    return module, changed


class HardSigmoidArithmetic(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 3).clamp(0, 6) / 6


class SiLUArithmetic(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


_HALF_ARITHMETIC = {nn.Hardsigmoid: HardSigmoidArithmetic, nn.SiLU: SiLUArithmetic}


def half_activations_as_arithmetic(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """`model`, or a copy of it with every Hardsigmoid and SiLU module written as its arithmetic; and the modules
    replaced. Returned as it is when it has none."""
    # every place a module sits, an instance shared by two places included
    names = [name for name, m in model.named_modules(remove_duplicate=False) if type(m) in _HALF_ARITHMETIC]
    if not names:
        return model, []
    model = copy.deepcopy(model)
    for name in names:
        model = _replaced(model, name, _HALF_ARITHMETIC[type(model.get_submodule(name))]())
    return model, names
