"""quant.fold: what depends on constants alone is computed once, and a folded graph computes what the model did."""

import pytest
import torch
from torch import nn

from exporter.quant import Calibration
from exporter.quant.fold import fold_constants


def folded(model, x):
    return fold_constants(torch.export.export(model.eval(), (x,)).module())


def assert_same_as_eager(module, model, shape, calls=2):
    for _ in range(calls):  # inputs other than the export example: nothing of the example may be baked in
        y = torch.randn(shape)
        torch.testing.assert_close(module(y), model(y))


class Masked(nn.Module):
    """Swin's shifted-window mask: built from the input's shape alone (new_zeros, filled slice by slice), read before
    and after a later in-place change; and a tensor whose fill value is the input's (not a constant)."""

    def forward(self, x):
        mask = x.new_zeros((x.shape[-2], x.shape[-1]))
        mask[:2] = 1.0
        mask[2:, :3] = 2.0
        before = (x + mask) * mask.masked_fill(mask != 0, -3.0)
        mask[0, 0] = 7.0  # a later in-place change: `before` read the mask without it
        scaled = x.new_full((x.shape[-1],), 0.5) * torch.arange(x.shape[-1])
        return before * mask + scaled + x.new_full((1,), 1.0) * x.amax()


def test_what_depends_on_constants_and_shapes_alone_is_computed_once_with_the_same_output():
    model, x = Masked().eval(), torch.randn(2, 3, 5, 4)
    module, folded = fold_constants(torch.export.export(model, (x,)).module())
    assert folded >= 4, folded  # the mask as `before` reads it and as the product does, the filled mask, the range
    targets = {n.target for n in module.graph.nodes if n.op == "call_function"}
    assert not targets & {
        torch.ops.aten.new_zeros.default,
        torch.ops.aten.arange.default,
        torch.ops.aten.masked_fill.Scalar,
    }, targets
    assert torch.ops.aten.amax.default in targets  # what reads the input's values stays
    for _ in range(2):  # the folded mask is not changed by running the graph
        y = torch.randn(2, 3, 5, 4)
        torch.testing.assert_close(module(y), model(y))


def test_folded_constants_lower_into_xnnpack_with_the_same_output(tmp_path):
    from exporter.formats import executorch

    model, x = Masked().eval(), torch.randn(1, 3, 5, 4)
    details = executorch.FORMAT.export(model, x, "fp32", None, tmp_path / "m.pte", {})
    assert details["rewrites"]["constants_folded"] >= 4, details
    assert not {"slice_scatter", "fill", "where", "arange"} & set(details["delegation"]["ops_outside_on_tensors"])
    with torch.no_grad():
        torch.testing.assert_close(executorch.FORMAT.load(tmp_path / "m.pte", 1)(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_graph_that_changes_its_own_buffer_is_left_as_it_is():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x):
            self.calls.add_(1)
            return x + self.calls

    module = torch.export.export(Counter().eval(), (torch.zeros(2),)).module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module, folded = fold_constants(module)
    assert folded == 0
    torch.testing.assert_close(module.state_dict(), before)  # folding did not run the buffer's update


class WrittenChannels(nn.Module):
    """Channels zero-padded by writing the input into a new tensor: the tensor is not a constant once written."""

    def __init__(self, add=False):
        super().__init__()
        self.add, self.conv = add, nn.Conv2d(8, 4, 1)

    def forward(self, x):
        out = torch.zeros(1, 8, 5, 4) if self.add else x.new_zeros((x.shape[0], 8, x.shape[2], x.shape[3]))
        out[:, 5:] = 1.0  # a constant fill first: still not a constant once the input is written in
        if self.add:
            out[:, :3] += x
        else:
            out[:, :3] = x
        return self.conv(out)


@pytest.mark.parametrize("add", [False, True], ids=["copy", "add"])
def test_a_tensor_the_input_is_written_into_is_not_folded(add):
    torch.manual_seed(0)
    model = WrittenChannels(add).eval()
    module, _ = folded(model, torch.randn(1, 3, 5, 4))
    stored = [b.shape for name, b in module.named_buffers() if name.startswith("_folded_constant")]
    assert all(shape.numel() == 1 for shape in stored), stored  # at most the fill value, not the tensor written
    assert_same_as_eager(module, model, (1, 3, 5, 4))


def test_a_pte_of_a_tensor_the_input_is_written_into_is_eager(tmp_path):
    from exporter.formats import executorch

    torch.manual_seed(0)
    model, x = WrittenChannels().eval(), torch.randn(1, 3, 5, 4)
    executorch.FORMAT.export(model, x, "fp32", None, tmp_path / "m.pte", {})
    with torch.no_grad():
        torch.testing.assert_close(executorch.FORMAT.load(tmp_path / "m.pte", 1)(x), model(x), rtol=1e-5, atol=1e-5)


class CatChannels(nn.Module):
    """WrittenChannels' function, built by concatenation: no tensor written after it is made."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        n, _, h, w = x.shape
        return self.conv(torch.cat([x, x.new_zeros((n, 2, h, w)), x.new_ones((n, 3, h, w))], 1))


def test_an_int8_pte_of_a_tensor_the_input_is_written_into_is_the_int8_of_the_same_function_without_writes(tmp_path):
    """PT2E observes a tensor where it is made: without the graph made functional, the write was not observed and
    the int8 .pte was off by about its whole output range."""
    from exporter.formats import executorch

    torch.manual_seed(0)
    written = WrittenChannels().eval()
    x, calibration = torch.randn(4, 3, 5, 4), Calibration([torch.randn(1, 3, 5, 4) for _ in range(8)])
    outputs = []
    for model in (written, CatChannels(written.conv).eval()):
        executorch.FORMAT.export(model, x[:1], "int8", calibration, tmp_path / "m.pte", {})
        runner = executorch.FORMAT.load(tmp_path / "m.pte", 1)
        with torch.no_grad():
            outputs.append(torch.cat([runner(x[i : i + 1]) for i in range(len(x))]))
    with torch.no_grad():
        scale = written(x).abs().max()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0.05 * scale)


class UnbindCounter(nn.Module):
    def __init__(self, split):
        super().__init__()
        self.split = split
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, x):
        first = self.calls.split(1)[0] if self.split else self.calls.unbind(0)[0]  # a view reached through getitem
        first.add_(1)
        return x + self.calls


@pytest.mark.parametrize("split", [False, True], ids=["unbind", "split"])
def test_a_buffer_changed_through_a_getitem_view_is_left_as_it_is(split):
    model = UnbindCounter(split).eval()
    module = torch.export.export(model, (torch.zeros(2),)).module()
    graph = [str(n.target) for n in module.graph.nodes]
    module, count = fold_constants(module)
    assert count == 0
    assert [str(n.target) for n in module.graph.nodes] == graph
    assert module.calls.tolist() == model.calls.tolist() == [0.0, 0.0]  # folding did not run the update
    assert [module(torch.zeros(2)).tolist() for _ in range(3)] == [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]


class ReadAsNumber(nn.Module):
    def forward(self, x):
        m = x.new_zeros((4,))
        m[:2] = 3.0
        return x * m.sum().item()


class ReturnedMask(nn.Module):
    def forward(self, x):  # a graph whose only output is built from the input's shape
        mask = x.new_zeros((2, 4))
        mask[0] = 1.0
        return mask


@pytest.mark.parametrize("model", [ReadAsNumber(), ReturnedMask()], ids=["number", "output"])
def test_a_constant_read_as_a_python_number_or_returned_keeps_its_fills(model):
    module, count = folded(model, torch.randn(2, 4))
    assert count == 1
    assert_same_as_eager(module, model, (2, 4))


class Broadcast(nn.Module):
    """A parameter broadcast to the activation's shape, a position table through eval-mode dropout, and a mask."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 3, 1, 1))
        self.pos = nn.Parameter(torch.randn(1, 3, 1, 8))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        mask = x.new_zeros((x.shape[-2], x.shape[-1]))
        mask[:2] = -1.0
        return x + self.bias.expand(x.shape) + self.drop(self.pos) + mask


def test_a_broadcast_parameter_is_not_stored_broadcast_and_eval_dropout_folds():
    torch.manual_seed(0)
    model, x = Broadcast().eval(), torch.randn(1, 3, 16, 8)
    module, count = folded(model, x)
    assert count == 1  # the mask: eval dropout (the identity) does not stop the fold as a random draw would
    stored = [b.numel() for name, b in module.named_buffers() if name.startswith("_folded_constant")]
    assert stored == [128]  # not the (1, 3, 16, 8) broadcast of the bias, nor a copy of the table
    assert torch.ops.aten.expand.default in {n.target for n in module.graph.nodes}
    assert_same_as_eager(module, model, (1, 3, 16, 8))


class SharedTable(nn.Module):
    """A relative-position bias read before and after an in-place change of another folded tensor."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 2))
        self.register_buffer("index", torch.randint(0, 9, (16,)))

    def forward(self, x):
        bias = self.table[self.index].view(4, 4, 2).permute(2, 0, 1)
        y = x + bias
        mask = x.new_zeros((4, 4))
        mask[:1] = -100.0
        return (y + mask) + bias


def test_a_tensor_read_around_another_ones_change_is_stored_once():
    torch.manual_seed(0)
    model = SharedTable().eval()
    module, count = folded(model, torch.randn(1, 2, 4, 4))
    assert count == 2  # the bias once, the filled mask
    assert_same_as_eager(module, model, (1, 2, 4, 4))


class WrittenThroughDropout(nn.Module):
    def forward(self, x):  # eval dropout hands back its input: the add lands in `m`, made anew on every call
        m = x.new_ones(4)
        d = nn.functional.dropout(m, 0.1, training=False)
        d.add_(x)
        return d * 1.0


class FilledThroughTypeAs(nn.Module):
    def forward(self, x):  # type_as to the same dtype is `m`: `m` read before and after the fill
        m = x.new_zeros(4)
        before = x + m
        m.type_as(x).fill_(2.0)
        return before + x * m


class WrittenThroughOut(nn.Module):
    def forward(self, x):  # add(out=t) returns t, not its first argument
        t, ones = x.new_zeros(4), x.new_ones(4)
        view = t[:]
        r = torch.add(ones, ones, out=t)
        before = x + r
        view.mul_(3.0)
        return before + x * r


class Grid(nn.Module):
    def forward(self, x):  # meshgrid's outputs are views of its inputs, whatever its schema says
        a = torch.arange(4.0)
        rows, _ = torch.meshgrid(a, a, indexing="ij")
        before = x + rows
        a.mul_(10.0)
        return before + x * rows


class CountedInNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):  # a call of a subgraph (higher-order op): what it writes is not looked into
        with torch.no_grad():
            self.calls.add_(1)
        m = x.new_zeros(4)
        with torch.no_grad():
            m[:2] = x[:2]
        return x + self.calls + m


@pytest.mark.parametrize(
    "model, shape",
    [
        (WrittenThroughDropout(), (4,)),
        (FilledThroughTypeAs(), (4,)),
        (WrittenThroughOut(), (4,)),
        (Grid(), (4, 4)),
        (CountedInNoGrad(), (4,)),
    ],
    ids=["dropout", "type_as", "out", "meshgrid", "no_grad"],
)
def test_writes_through_ops_that_hand_back_their_input_are_seen(model, shape):
    import copy

    reference = copy.deepcopy(model.eval())
    module = torch.export.export(model, (torch.randn(shape),)).module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module, _ = fold_constants(module)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())  # folding ran no update
    for _ in range(3):  # the buffer counts calls: eager and the folded module see the same ones
        y = torch.randn(shape)
        torch.testing.assert_close(module(y), reference(y))


def test_a_returned_constant_is_a_copy():
    class ReturnsMask(nn.Module):
        def forward(self, x):
            mask = x.new_zeros(4)
            mask[:2] = 1.0
            return x * mask, mask

    module, count = folded(ReturnsMask(), torch.randn(4))
    assert count >= 1
    _, mask = module(torch.randn(4))
    mask.add_(100)  # a caller post-processing its outputs in place
    assert module(torch.randn(4))[1].tolist() == [1.0, 1.0, 0.0, 0.0]


class WrittenThroughBroadcast(nn.Module):
    def forward(self, x):  # a live op handing back a constant it takes: the add lands in the constant
        c = x.new_zeros(4)
        view, _ = torch.broadcast_tensors(c, x)
        view.add_(x)
        return c * 1.0


class SignedZeros(nn.Module):
    def forward(self, x):  # 0.0 and -0.0 are equal but not the same constant
        zero, negative = x.new_zeros(4), -x.new_zeros(4)
        return torch.atan2(negative, x - 10) - torch.atan2(zero, x - 10)


@pytest.mark.parametrize("model", [WrittenThroughBroadcast(), SignedZeros()], ids=["broadcast", "signed_zero"])
def test_constants_a_live_op_may_hand_back_or_that_differ_in_sign_alone_stay_apart(model):
    module, _ = folded(model, torch.randn(4))
    assert_same_as_eager(module, model, (4,), calls=3)
