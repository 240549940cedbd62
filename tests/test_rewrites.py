"""formats.rewrites: each rewrite computes what the original did, and lowers the way it is meant to."""

import random

import torch
from torch import nn

from exporter.quant import Calibration
from exporter.formats.rewrites import (
    DEPTHWISE_TAPS,
    GlobalMean3d,
    RegionConv,
    SplitDepthwise,
    drop_padding_taps,
    global_pool3d_as_mean,
    input_transform_as_affine,
    kernel_parts,
    padded_avg_pools_as_pad,
    split_large_depthwise,
)


class Head(nn.Module):
    """An ASPP-like head: a backbone conv, then dilated branches summed."""

    def __init__(self, dilations=(1, 12, 24), channels=8):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, stride=2, padding=1)
        self.branches = nn.ModuleList(
            nn.Conv2d(channels, channels, 3, padding=d, dilation=d, bias=False) for d in dilations
        )

    def forward(self, x):
        x = self.stem(x)
        return sum(branch(x) for branch in self.branches)


def test_branches_reaching_past_the_input_become_1x1_and_the_output_is_unchanged():
    torch.manual_seed(0)
    model, x = Head().eval(), torch.randn(2, 3, 16, 16)  # the branches see 8x8
    trimmed, done = drop_padding_taps(model, x)
    assert [d["module"] for d in done] == ["branches.1", "branches.2"]
    assert trimmed.branches[1].kernel_size == (1, 1) and trimmed.branches[1].padding == (0, 0)
    assert trimmed.branches[0].kernel_size == (3, 3)  # dilation 1 reads the input with every tap
    assert model.branches[1].kernel_size == (3, 3)  # the caller's model is not touched
    with torch.no_grad():
        torch.testing.assert_close(trimmed(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_model_with_nothing_to_trim_is_returned_as_it_is():
    model = Head(dilations=(1, 2)).eval()
    same, done = drop_padding_taps(model, torch.randn(1, 3, 16, 16))
    assert same is model and done == []


def test_taps_that_read_the_input_near_the_edges_only_are_computed_there_only():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=12, dilation=12)  # on 16x20, the outer taps read the input near the edges
    model, x = nn.Sequential(conv).eval(), torch.randn(1, 4, 16, 20)
    split, done = drop_padding_taps(model, x)
    assert isinstance(split[0], RegionConv) and done[0]["kernel"] == [3, 3]
    # rows: [0, 4) taps 1-2, [4, 12) tap 1, [12, 16) taps 0-1; columns: [0, 8) 1-2, [8, 12) 1, [12, 20) 0-1
    assert [r.stop for r in split[0].rows] == [4, 12, 16] and [c.stop for c in split[0].cols] == [8, 12, 20]
    assert sorted(map(tuple, done[0]["parts"])) == sorted(
        [(2, 2), (2, 1), (2, 2), (1, 2), (1, 1), (1, 2), (2, 2), (2, 1), (2, 2)]
    )
    with torch.no_grad():
        torch.testing.assert_close(split(x), model(x), rtol=1e-5, atol=1e-5)


def test_depthwise_and_ordinary_convolutions_are_not_split():
    depthwise = nn.Conv2d(8, 8, 3, padding=12, dilation=12, groups=8)  # only trimmed whole, never split
    resnet_like = nn.Conv2d(8, 8, 3, padding=1)  # on 7x7: 33% of its work reads padding, below MIN_SAVED
    assert drop_padding_taps(nn.Sequential(depthwise).eval(), torch.randn(1, 8, 16, 20))[1] == []
    assert drop_padding_taps(nn.Sequential(resnet_like).eval(), torch.randn(1, 8, 7, 7))[1] == []


def test_a_conv_called_at_two_sizes_is_left_alone():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=12, dilation=12)

        def forward(self, x):
            return self.conv(x).mean() + self.conv(nn.functional.interpolate(x, scale_factor=4.0)).mean()

    model = Twice().eval()
    assert drop_padding_taps(model, torch.randn(1, 2, 8, 8))[1] == []


def test_any_trim_gives_the_same_output():
    """Random shapes, strides, dilations, paddings, groups and rectangular kernels and inputs: whatever is trimmed,
    the output (shape and values) is the original's."""
    trims = 0
    for seed in range(120):
        rng = random.Random(seed)
        groups = rng.choice([1, 1, 2])
        kernel = (rng.randint(1, 7), rng.randint(1, 7))
        dilation = (rng.randint(1, 20), rng.randint(1, 20))
        padding = tuple(rng.randint(0, d * (k - 1)) for k, d in zip(kernel, dilation))
        stride = (rng.randint(1, 3), rng.randint(1, 3))
        size = tuple(max(d * (k - 1) + 1 - 2 * p, rng.randint(1, 24)) for k, d, p in zip(kernel, dilation, padding))
        torch.manual_seed(seed)
        conv = nn.Conv2d(
            2 * groups,
            2 * groups,
            kernel,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            bias=rng.random() < 0.5,
        )
        model, x = nn.Sequential(conv).eval(), torch.randn(1, 2 * groups, *size)
        trimmed, done = drop_padding_taps(model, x)
        with torch.no_grad():
            expected, got = model(x), trimmed(x)
        assert got.shape == expected.shape, (seed, conv, size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{seed} {conv} {size}: {m}")
        if done:
            trims += 1
    assert trims > 12  # the draw does exercise the rewrite


def test_a_split_convolution_lowers_whole_into_xnnpack(tmp_path):
    """The regions' slices and concatenations are all XNNPACK's (no alias of a full-axis slice left outside it),
    and the .pte computes what eager does."""
    from exporter.formats import executorch

    torch.manual_seed(0)
    model, x = Head(dilations=(12, 24)).eval(), torch.randn(1, 3, 66, 66)  # the branches see 33x33: split
    details = executorch.FORMAT.export(model, x, "fp32", None, tmp_path / "m.pte", {})
    assert [len(r["parts"]) for r in details["rewrites"]["padding_taps_dropped"]] == [9, 9]
    assert details["delegation"]["delegated_subgraphs"] == 1
    assert set(details["delegation"]["ops_outside_delegate"]) <= {"dim_order_ops__to_dim_order_copy_default", "getitem"}
    with torch.no_grad():
        torch.testing.assert_close(executorch.FORMAT.load(tmp_path / "m.pte", 1)(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_global_3d_pool_becomes_a_mean_with_the_same_output_and_other_pools_stay():
    """What Core ML converts in place of adaptive_avg_pool3d (R3D-18's clip pooling): same outputs; a pool to more
    than one output, and a model without one, are left as they are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(3, 8, 3), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 3, 6, 9, 7)
    rewritten, done = global_pool3d_as_mean(model)
    assert done == ["1"] and isinstance(rewritten[1], GlobalMean3d) and isinstance(model[1], nn.AdaptiveAvgPool3d)
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), model(x), rtol=1e-5, atol=1e-6)
    partial = nn.Sequential(nn.AdaptiveAvgPool3d((1, 2, 2)))
    assert global_pool3d_as_mean(partial) == (partial, [])


def test_googlenets_input_transform_is_one_multiply_and_add_delegated_whole_with_the_same_output(tmp_path):
    """GoogLeNet's transform_input (set by its torchvision weight) selects and unsqueezes each channel: XNNPACK left
    three select_copy and three unsqueeze_copy outside the delegate. As one affine over the channels it takes them,
    and eager's output is the same to the bit."""
    from torchvision.models import get_model

    from exporter.formats import executorch

    torch.manual_seed(0)
    model, x = (
        get_model("googlenet", weights=None, transform_input=True, init_weights=True).eval(),
        torch.rand(2, 3, 64, 64),
    )
    rewritten, changed = input_transform_as_affine(model)
    assert changed == [""] and model._transform_input.__func__ is not rewritten._transform_input.__func__
    with torch.no_grad():
        assert torch.equal(rewritten(x), model(x))
    assert input_transform_as_affine(get_model("googlenet", weights=None, init_weights=True))[1] == []

    details = executorch.FORMAT.export(model, x[:1], "fp32", None, tmp_path / "m.pte", {})
    assert details["rewrites"]["input_transform_as_affine"] == [""]
    assert set(details["delegation"]["ops_outside_delegate"]) <= {"getitem"}  # before: aten_select_copy_int×3, ...
    with torch.no_grad():
        torch.testing.assert_close(
            executorch.FORMAT.load(tmp_path / "m.pte", 1)(x[:1]), model(x[:1]), rtol=1e-4, atol=1e-5
        )


class DenseStart(nn.Module):
    """A DenseNet block's first layer: torch.cat over a list holding one tensor, between two convs."""

    def __init__(self):
        super().__init__()
        self.stem, self.layer = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        return torch.cat([self.layer(torch.cat([x], 1)), x], 1)  # the second cat has two: it stays


def test_a_concatenation_of_one_tensor_is_dropped_and_the_pte_is_one_delegate(tmp_path):
    """XNNPACK takes concatenations of 2 tensors or more: DenseNet's one-tensor cats (4 in DenseNet-121) were left
    outside the delegate, splitting the .pte in 5. Dropped, fp32 and int8 lower whole, with eager's output."""
    from exporter.formats import executorch

    torch.manual_seed(0)
    model, x = DenseStart().eval(), torch.randn(1, 3, 16, 16)
    kept = executorch.FORMAT.export(model, x, "fp32", None, tmp_path / "kept.pte", {}, rewrites=False)
    assert kept["delegation"]["ops_outside_delegate"].get("aten_cat_default") == 1  # what the rewrite is for
    for precision in ("fp32", "int8"):
        path = tmp_path / f"{precision}.pte"
        calibration = Calibration([torch.randn(1, 3, 16, 16) for _ in range(8)]) if precision == "int8" else None
        details = executorch.FORMAT.export(model, x, precision, calibration, path, {})
        assert details["rewrites"]["single_tensor_cats_dropped"] == 1, details
        assert details["delegation"]["delegated_subgraphs"] == 1 and set(
            details["delegation"]["ops_outside_delegate"]
        ) <= {"getitem"}
        if precision == "fp32":
            with torch.no_grad():
                torch.testing.assert_close(executorch.FORMAT.load(path, 1)(x), model(x), rtol=1e-4, atol=1e-5)


class Pool(nn.Module):
    def __init__(self, **pool):
        super().__init__()
        self.pool = pool

    def forward(self, x):
        return torch.nn.functional.avg_pool2d(x, **self.pool)


def test_any_padded_pool_that_counts_its_padding_becomes_a_pad_and_an_unpadded_pool_with_the_same_output():
    """Every padded pool counting its padding is rewritten, square or not, any stride; those XNNPACK can run as
    they are (no padding, or padding not counted) and those a pad would not reproduce (ceil mode, a divisor) are
    left alone."""
    random.seed(0)
    rewritten = 0
    for _ in range(40):
        kernel = (random.randint(1, 5), random.randint(1, 5))
        pool = {
            "kernel_size": kernel if random.random() < 0.5 else kernel[0],
            "stride": random.choice([None, 1, 2, (1, 2)]),
            "padding": random.choice([0, 1, (kernel[0] // 2, kernel[1] // 2)]),
            "ceil_mode": random.random() < 0.2,
            "count_include_pad": random.random() < 0.8,
            "divisor_override": random.choice([None] * 4 + [3]),
        }
        square = isinstance(pool["kernel_size"], int)
        padding = (pool["padding"],) * 2 if isinstance(pool["padding"], int) else pool["padding"]
        if any(p > (pool["kernel_size"] if square else k) // 2 for p, k in zip(padding, kernel)):
            continue  # torch refuses padding over half the kernel
        x = torch.randn(2, 3, random.randint(6, 12), random.randint(6, 12))
        model = Pool(**pool).eval()
        exported, changed = padded_avg_pools_as_pad(torch.export.export(model, (x,)))
        expected = int(
            any(padding) and pool["count_include_pad"] and not pool["ceil_mode"] and pool["divisor_override"] is None
        )
        assert changed == expected, pool
        ops = [n.target for n in exported.graph.nodes if n.op == "call_function"]
        assert (torch.ops.aten.constant_pad_nd.default in ops) == bool(expected), pool
        torch.testing.assert_close(exported.module()(x), model(x), rtol=1e-6, atol=1e-6)
        rewritten += changed
    assert rewritten >= 5


class InceptionBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return torch.cat([self.a(x), self.b(torch.nn.functional.avg_pool2d(x, 3, 1, 1))], 1)


def test_inceptions_padded_pool_lowers_into_xnnpack_with_the_same_output(tmp_path):
    """Inception v3's branches pool with F.avg_pool2d(x, 3, 1, 1), which counts its zero padding; XNNPACK does not,
    so ExecuTorch left the pool outside the delegate (9 in Inception v3, each splitting the .pte). As a zero pad and
    an unpadded pool, fp32 and int8 lower whole; fp32 gives eager's output, int8 the unrewritten int8's."""
    from exporter.formats import executorch

    torch.manual_seed(0)
    model, x = InceptionBranch().eval(), torch.randn(1, 3, 16, 16)
    calibration = Calibration([torch.randn(1, 3, 16, 16) for _ in range(8)])
    kept = {}
    for precision in ("fp32", "int8"):
        path = tmp_path / f"kept_{precision}.pte"
        details = executorch.FORMAT.export(model, x, precision, calibration, path, {}, rewrites=False)
        assert details["delegation"]["ops_outside_on_tensors"] == {"avg_pool2d": 1}  # what the rewrite is for
        kept[precision] = executorch.FORMAT.load(path, 1)(x)
    for precision in ("fp32", "int8"):
        path = tmp_path / f"{precision}.pte"
        details = executorch.FORMAT.export(model, x, precision, calibration, path, {})
        assert details["rewrites"]["padded_avg_pools_as_pad"] == 1, details
        assert details["delegation"]["delegated_subgraphs"] == 1 and set(
            details["delegation"]["ops_outside_delegate"]
        ) <= {"getitem"}
        with torch.no_grad():
            if precision == "fp32":
                torch.testing.assert_close(executorch.FORMAT.load(path, 1)(x), model(x), rtol=1e-4, atol=1e-5)
            else:  # the same int8 graph; the pool's float kernel differs (portable, XNNPACK): one step at most
                step = (kept["int8"].max() - kept["int8"].min()).item() / 255
                assert (executorch.FORMAT.load(path, 1)(x) - kept["int8"]).abs().max() <= step * 1.01


def test_every_kernel_part_is_centred_within_the_tile_and_the_parts_cover_each_tap_once():
    for height in range(1, 14):
        for width in range(1, 14):
            parts = kernel_parts(height, width)
            if parts is None:
                assert height < 3 or width < 3 or max(height, width) > 12, (height, width)
                continue
            taps = [(r, c) for part in parts for r in part.rows for c in part.cols]
            assert sorted(taps) == [(r, c) for r in range(height) for c in range(width)], (height, width)
            for part in parts:
                assert len(part.rows) * len(part.cols) <= DEPTHWISE_TAPS
                assert part.rows[0] + part.rows[-1] == height - 1 and part.cols[0] + part.cols[-1] == width - 1
                assert len({b - a for a, b in zip(part.rows, part.rows[1:])}) <= 1  # evenly spaced: one dilation


def test_any_split_depthwise_convolution_gives_the_same_output():
    """Random depthwise convolutions over XNNPACK's 25-tap tile (kernels up to 11, dilations, strides, paddings,
    channel multipliers, rectangular inputs): split or not, the output is the original's."""
    split = 0
    for seed in range(80):
        rng = random.Random(seed)
        kernel = (rng.randint(3, 11), rng.randint(3, 11))
        dilation = (rng.randint(1, 3), rng.randint(1, 3))
        same = rng.random() < 0.5  # "same" padding (ConvNeXt's), else any
        padding = tuple(d * (k - 1) // 2 if same else rng.randint(0, d * (k - 1)) for k, d in zip(kernel, dilation))
        stride = (rng.randint(1, 3), rng.randint(1, 3))
        size = tuple(max(d * (k - 1) + 1 - 2 * p, rng.randint(1, 20)) for k, d, p in zip(kernel, dilation, padding))
        channels, multiplier = rng.choice([2, 4]), rng.choice([1, 1, 2])
        torch.manual_seed(seed)
        conv = nn.Conv2d(
            channels,
            channels * multiplier,
            kernel,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=channels,
            bias=rng.random() < 0.5,
        )
        model, x = nn.Sequential(conv).eval(), torch.randn(2, channels, *size)
        rewritten, done = split_large_depthwise(model)
        with torch.no_grad():
            expected, got = model(x), rewritten(x)
        assert got.shape == expected.shape, (seed, conv, size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{seed} {conv} {size}: {m}")
        if same and kernel[0] * kernel[1] > DEPTHWISE_TAPS:
            # with a channel multiplier XNNPACK runs it as a grouped GEMM anyway: not split
            assert bool(done) == (multiplier == 1), (seed, conv)
        if done:
            split += 1
            assert isinstance(rewritten[0], SplitDepthwise) and model[0] is conv  # the caller's model is untouched
            assert all(p.kernel_size[0] * p.kernel_size[1] <= DEPTHWISE_TAPS for p in rewritten[0].parts)
        else:
            assert rewritten is model
    assert split > 15  # the draw does exercise the rewrite


def test_a_split_keeps_the_weights_dtype_and_a_model_that_is_the_convolution_is_split_too():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 3, 7, padding=3, groups=3, dtype=torch.float64)
    x = torch.randn(1, 3, 9, 9, dtype=torch.float64)
    rewritten, done = split_large_depthwise(conv)
    assert isinstance(rewritten, SplitDepthwise) and done[0]["module"] == ""
    assert all(part.weight.dtype == torch.float64 for part in rewritten.parts)
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), conv(x), rtol=1e-12, atol=1e-12)


def test_small_and_ordinary_convolutions_are_not_split():
    model = nn.Sequential(
        nn.Conv2d(4, 4, 5, padding=2, groups=4),
        nn.Conv2d(4, 4, 7, padding=3),
        nn.Conv2d(4, 4, 7, padding=3, groups=2),
        nn.Conv2d(4, 4, 7, padding=0, groups=4),
    )
    assert split_large_depthwise(model) == (model, [])  # the last: no padding to give its centre


def test_a_7x7_depthwise_runs_on_xnnpacks_depthwise_kernels_with_eagers_output(tmp_path):
    """ConvNeXt's 7x7 depthwise convolution: 49 taps, more than XNNPACK's largest depthwise tile, lowered as a
    grouped GEMM. Split, the .pte runs depthwise kernels only (its own profiler names them), fp32 and int8."""
    from exporter.formats import executorch

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 4, stride=4), nn.Conv2d(16, 16, 7, padding=3, groups=16), nn.Conv2d(16, 8, 1)
    ).eval()
    x = torch.randn(1, 3, 32, 32)
    kept = executorch.FORMAT.export(model, x, "fp32", None, tmp_path / "kept.pte", {}, rewrites=False)
    assert "large_depthwise_split" not in kept.get("rewrites", {})
    assert _convolutions(tmp_path / "kept.pte", x) == {"IGEMM": 2}  # the 7x7 too: what the split is for
    for precision in ("fp32", "int8"):
        path = tmp_path / f"{precision}.pte"
        calibration = Calibration([torch.randn(1, 3, 32, 32) for _ in range(8)]) if precision == "int8" else None
        details = executorch.FORMAT.export(model, x, precision, calibration, path, {})
        assert details["rewrites"]["large_depthwise_split"] == [
            {"module": "1", "kernel": [7, 7], "parts": [[5, 5], [2, 7], [5, 2]]}
        ]
        assert details["delegation"]["delegated_subgraphs"] == 1
        assert _convolutions(path, x) == {"IGEMM": 1, "DWConv": 3}, precision  # the stem; the 7x7's three parts
        if precision == "fp32":
            with torch.no_grad():
                torch.testing.assert_close(executorch.FORMAT.load(path, 1)(x), model(x), rtol=1e-4, atol=1e-5)


def _convolutions(path, x) -> dict[str, int]:
    """How many XNNPACK convolution operators of each kind one run of the .pte ran, from its own profiler
    ("Convolution (NHWC, F32) IGEMM" -> "IGEMM")."""
    import pytest

    from exporter.formats import executorch

    profile = executorch.FORMAT.profile(path, x, 1, 1)
    if not profile.get("available"):
        pytest.skip(f"no operator profile: {profile.get('reason')}")
    kinds: dict[str, int] = {}
    for op in profile["ops"]:
        if op["op"].startswith("Convolution"):
            kind = op["op"].rsplit(" ", 1)[-1]
            kinds[kind] = kinds.get(kind, 0) + op["count"]
    return kinds


def test_a_channels_last_example_exports_a_pte_that_computes_the_model(tmp_path):
    """The classification task's calibration images are channels-last views; exported from one as the example, the
    program took its input dim order from it and, fed contiguous inputs as the runner does, gave wrong outputs."""
    from exporter.formats import executorch

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, 2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    ).eval()
    x = torch.randn(1, 3, 16, 16)
    executorch.FORMAT.export(model, x.to(memory_format=torch.channels_last), "fp32", None, tmp_path / "m.pte", {})
    with torch.no_grad():
        torch.testing.assert_close(executorch.FORMAT.load(tmp_path / "m.pte", 1)(x), model(x), rtol=1e-4, atol=1e-5)


class ShuffleTail(nn.Module):
    """ShuffleNetV2's halved channels (chunk), VGG's adaptive pool at a size its input divides (pool=6 on 12x12,
    or to 12x12: the identity) and MNASNet's mean over height and width, each left outside XNNPACK as exported."""

    def __init__(self, pool: int):
        super().__init__()
        self.stem, self.branch = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.pool, self.head = nn.AdaptiveAvgPool2d(pool), nn.Linear(8, 5)

    def forward(self, x):
        kept, passed = torch.relu(self.stem(x)).chunk(2, dim=1)
        x = self.pool(torch.cat([kept, torch.relu(self.branch(passed))], 1))
        return self.head(x.mean([2, 3]))


def test_chunks_adaptive_pools_and_means_lower_into_xnnpack_with_the_same_output(tmp_path):
    from exporter.formats import executorch

    torch.manual_seed(0)
    x = torch.randn(1, 3, 12, 12)
    calibration = Calibration([torch.randn(1, 3, 12, 12) for _ in range(8)])
    expected = {"chunks_as_slices": 1, "adaptive_pools_as_pools": 1, "means_keeping_dims": 1}
    for pool in (6, 12):
        model = ShuffleTail(pool).eval()
        kept = {}
        for precision in ("fp32", "int8"):
            path = tmp_path / f"kept_{pool}_{precision}.pte"
            details = executorch.FORMAT.export(model, x, precision, calibration, path, {}, rewrites=False)
            outside = details["delegation"]["ops_outside_on_tensors"]  # what the rewrites are for
            assert outside == {"split_with_sizes_copy": 1, "_adaptive_avg_pool2d": 1, "mean": 1}, outside
            kept[precision] = executorch.FORMAT.load(path, 1)(x)
        for precision in ("fp32", "int8"):
            path = tmp_path / f"{pool}_{precision}.pte"
            details = executorch.FORMAT.export(model, x, precision, calibration, path, {})
            assert details["rewrites"] == expected, details
            assert details["delegation"]["delegated_subgraphs"] == 1, details["delegation"]
            assert set(details["delegation"]["ops_outside_delegate"]) <= {"getitem"}, details["delegation"]
            out = executorch.FORMAT.load(path, 1)(x)
            with torch.no_grad():
                if precision == "fp32":
                    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
                else:  # the pool and the mean give the int8 left as is; the slices move it by a step here (the
                    # split's pieces were float between the delegate's parts; bit-identical on the trained
                    # ShuffleNetV2): as close to eager as the int8 left as is, within 2 steps
                    step = (kept["int8"].max() - kept["int8"].min()).item() / 255
                    error, kept_error = (out - model(x)).abs().max(), (kept["int8"] - model(x)).abs().max()
                    assert error <= kept_error + 2 * step, (out, kept["int8"], model(x))


def test_an_adaptive_pool_whose_windows_overlap_is_left_as_it_is():
    from exporter.formats.rewrites import adaptive_pools_as_pools

    model, x = ShuffleTail(5).eval(), torch.randn(1, 3, 12, 12)  # 12 to 5: windows of 3 that overlap
    exported, done = adaptive_pools_as_pools(torch.export.export(model, (x,)))
    assert done == 0
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), model(x))


class Pieces(nn.Module):
    """Uneven chunks and splits on negative and keyword dims, a rectangular adaptive pool, a mean over negative
    dims and over everything, on a batch of two; two rewritten nodes are the program's outputs."""

    def forward(self, x):
        a, b, c = x.chunk(3, dim=-1)  # 8 columns: 3, 3, 2
        d, e, f = torch.split(x, 5, dim=2)  # 12 rows: 5, 5, 2
        pooled = torch.nn.functional.adaptive_avg_pool2d(x, (3, 2))
        mean = (a[..., :2] * 2 + b[..., 1:] + c).mean([-1, -2]) + e.mean(dim=None) + f.sum()
        return mean, pooled, d


def test_the_rewrites_compute_what_the_graph_did_on_uneven_pieces_and_keep_the_programs_outputs():
    from exporter.formats.rewrites import adaptive_pools_as_pools, chunks_as_slices, means_keeping_dims

    model, x = Pieces().eval(), torch.randn(2, 3, 12, 8)
    exported = torch.export.export(model, (x,))
    done = {}
    for rewrite in (adaptive_pools_as_pools, means_keeping_dims, chunks_as_slices):
        exported, done[rewrite.__name__] = rewrite(exported)
    assert done == {"adaptive_pools_as_pools": 1, "means_keeping_dims": 1, "chunks_as_slices": 2}, done
    exported.validate()  # the output signature still names the program's outputs
    targets = {n.target for n in exported.graph.nodes if n.op == "call_function"}
    assert not targets & {
        torch.ops.aten.chunk.default,
        torch.ops.aten.split.Tensor,
        torch.ops.aten._adaptive_avg_pool2d.default,
        torch.ops.aten.adaptive_avg_pool2d.default,
    }
    with torch.no_grad():
        for got, want in zip(exported.module()(x), model(x)):
            torch.testing.assert_close(got, want)
    views = [n.args[1] for n in exported.graph.nodes if n.target == torch.ops.aten.view.default]
    assert views == [[-1, 3]], views  # not tied to the example's batch (int8 calibrates one image at a time)


class Tokens(nn.Module):
    """A ViT block's attention: patches as tokens through nn.MultiheadAttention (scaled_dot_product_attention)."""

    def __init__(self):
        super().__init__()
        self.patches, self.attention = nn.Conv2d(3, 16, 4, stride=4), nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        attended, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head((tokens + attended).mean(1))


def test_attention_without_a_mask_lowers_into_xnnpack_with_the_same_output(tmp_path):
    from exporter.formats import executorch

    torch.manual_seed(0)
    model, x = Tokens().eval(), torch.randn(1, 3, 16, 16)
    calibration = Calibration([torch.randn(1, 3, 16, 16) for _ in range(8)])
    guard = {"eq", "logical_not", "any", "where"}  # the math path's guard for rows of -inf
    kept = {}
    for precision in ("fp32", "int8"):
        path = tmp_path / f"kept_{precision}.pte"
        details = executorch.FORMAT.export(model, x, precision, calibration, path, {}, rewrites=False)
        assert guard | {"expand_copy"} <= set(details["delegation"]["ops_outside_on_tensors"]), details["delegation"]
        kept[precision] = executorch.FORMAT.load(path, 1)(x)
    for precision in ("fp32", "int8"):
        path = tmp_path / f"{precision}.pte"
        details = executorch.FORMAT.export(model, x, precision, calibration, path, {})
        assert details["rewrites"]["attention_as_matmuls"] == 1 and details["rewrites"]["matmuls_as_bmm"] == 2, details
        outside = set(details["delegation"]["ops_outside_on_tensors"])
        assert not outside & (guard | {"expand_copy"}), details["delegation"]  # matmuls lowered as one bmm each
        out = executorch.FORMAT.load(path, 1)(x)
        with torch.no_grad():
            if precision == "fp32":
                torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
            else:  # the attention is float in both int8 graphs: within a step of the int8 left as is
                step = (kept["int8"].max() - kept["int8"].min()).item() / 255
                torch.testing.assert_close(out, kept["int8"], rtol=0, atol=step)


def test_attention_with_a_mask_or_causal_is_left_alone_and_a_scale_is_kept():
    from exporter.formats.rewrites import attention_as_matmuls

    class Variants(nn.Module):
        def forward(self, q, k, v, mask):
            sdpa = nn.functional.scaled_dot_product_attention
            return sdpa(q, k, v, attn_mask=mask), sdpa(q, k, v, is_causal=True), sdpa(q, k, v, scale=0.3), sdpa(q, k, v)

    model = Variants().eval()
    inputs = (torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 7), torch.randn(6, 6))
    exported, done = attention_as_matmuls(torch.export.export(model, inputs))
    assert done == 2, done  # the scaled one and the plain one
    left = [n for n in exported.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(left) == 2, left  # the masked one and the causal one
    exported.validate()
    with torch.no_grad():
        for got, want in zip(exported.module()(*inputs), model(*inputs)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class Pyramid(nn.Module):
    """An FPN's top-down step: the coarser level upsampled (nearest) to the finer one's size and added."""

    def __init__(self, size=None, scale=None):
        super().__init__()
        self.size, self.scale = size, scale
        self.fine, self.coarse = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        fine = self.fine(x).relu()
        coarse = self.coarse(fine).relu()
        if self.scale is not None:
            up = nn.functional.interpolate(coarse, scale_factor=self.scale, mode="nearest")
        else:
            up = nn.functional.interpolate(coarse, size=self.size or fine.shape[-2:], mode="nearest")
        return self.out(nn.functional.interpolate(up, size=fine.shape[-2:], mode="bilinear") + fine)


def test_nearest_upsampling_by_whole_factors_lowers_into_xnnpack_with_the_same_output(tmp_path):
    from exporter.formats import executorch

    torch.manual_seed(0)
    model, x = Pyramid().eval(), torch.randn(3, 3, 32, 24)
    calibration = Calibration([torch.randn(1, 3, 32, 24) for _ in range(16)])
    outputs = {}
    for precision in ("fp32", "int8"):
        for rewrites in (False, True):
            details = executorch.FORMAT.export(
                model, x[:1], precision, calibration, tmp_path / "m.pte", {}, rewrites=rewrites
            )
            outside = details["delegation"]["ops_outside_on_tensors"]
            assert ("upsample_nearest2d" in outside) != rewrites, outside
            runner = executorch.FORMAT.load(tmp_path / "m.pte", 1)
            with torch.no_grad():
                outputs[precision, rewrites] = torch.cat([runner(x[i : i + 1]) for i in range(len(x))])
        assert details["rewrites"]["nearest_upsamples_as_deconvs"] == 1
    with torch.no_grad():
        eager = model(x)
    torch.testing.assert_close(outputs["fp32", True], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["int8", True], outputs["int8", False], rtol=0, atol=0.02 * eager.abs().max())


def test_nearest_upsampling_by_other_factors_is_left_as_it_is():
    from exporter.formats.rewrites import nearest_upsamples_as_deconvs

    torch.manual_seed(0)
    # (whole factors, 2x3) counts; 4 -> 7 is not whole; a scale of 2.05 makes 10 -> 20 but picks pixels by 1/2.05
    for model, shape, count in (
        (Pyramid(size=(8, 9)), (1, 3, 16, 12), 1),
        (Pyramid(size=(7, 7)), (1, 3, 16, 16), 0),
        (Pyramid(scale=2.05), (1, 3, 40, 40), 0),
        (Pyramid(scale=2.0), (1, 3, 40, 40), 1),
    ):
        model.eval()
        x = torch.randn(shape)
        module, changed = nearest_upsamples_as_deconvs(torch.export.export(model, (x,)).module())
        assert changed == count, (model.size, model.scale)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)

    class Mask(nn.Module):
        def forward(self, x):  # an integer tensor: there is no integer convolution to write it with
            return nn.functional.interpolate((x > 0).to(torch.uint8), scale_factor=2).float()

    x = torch.randn(1, 3, 4, 4)
    module, changed = nearest_upsamples_as_deconvs(torch.export.export(Mask(), (x,)).module())
    assert changed == 0
    torch.testing.assert_close(module(x), Mask()(x))
