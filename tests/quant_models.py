"""What the int8 tests quantize: fake backends whose candidates the budget search can judge without
exporting anything (exporter.quant.search), and toy models each holding one graph a real network broke a backend
on (named in each test that uses it)."""

from __future__ import annotations

import torch


class FakeBackend:
    """Quantizes nothing: its candidate is the model plus an error that only keeping `culprit` in float
    removes, so the search can be checked without exporting anything."""

    range_methods = ("coarse", "fine")
    LAYERS = [f"layer{i}" for i in range(8)]

    def __init__(self, model, culprit: str | None):
        self.model, self.culprit = model, culprit

    @classmethod
    def given(cls, *args, **kwargs):
        """This backend for the model the search is run on: `KindsBackend.given("layer1", add_error=0.2, ...)`."""
        return lambda model: cls(model, *args, **kwargs)

    def layers(self):
        return list(self.LAYERS)

    def describe(self, method):
        return method

    def float_closure(self, float_layers):
        return list(float_layers)

    def float_ops(self, float_layers):
        return {"linear": len(float_layers)} if float_layers else {}

    def quantize(self, float_layers, range_images, method):
        return FakeCandidate(
            self.model,
            0.0 if self.culprit in float_layers else (0.5 if method == "coarse" else 0.2),
            list(float_layers),
            method,
        )


class FakeCandidate:
    alive = most_alive = 0  # candidates in memory now / at most during a search

    def __init__(self, model, error, float_layers, method):
        self.model, self.error, self.float_layers, self.method = model, error, float_layers, method
        FakeCandidate.alive += 1
        FakeCandidate.most_alive = max(FakeCandidate.most_alive, FakeCandidate.alive)

    def __del__(self):
        FakeCandidate.alive -= 1

    def __call__(self, x):
        out = self.model(x)
        return out + self.error * torch.linspace(-1, 1, out.numel()).reshape(out.shape)


class KindsBackend(FakeBackend):
    """A backend that also quantizes adds: its candidate's error is `add_error` unless every add is float, plus
    `layer_error` unless the culprit layer is float."""

    range_methods = ("histogram",)
    op_fallbacks = ("add",)

    def __init__(self, model, culprit, add_error, layer_error):
        super().__init__(model, culprit)
        self.add_error, self.layer_error = add_error, layer_error

    def float_ops(self, float_layers, float_kinds=()):
        return {**super().float_ops(float_layers), **({"add": 3} if "add" in float_kinds else {})}

    def quantize(self, float_layers, range_images, method, float_kinds=()):
        error = (0.0 if "add" in float_kinds else self.add_error) + (
            0.0 if self.culprit in float_layers else self.layer_error
        )
        candidate = FakeCandidate(self.model, error, list(float_layers), method)
        candidate.kinds = tuple(float_kinds)
        return candidate


class DynamicBackend(FakeBackend):
    """A backend with a fallback range method: its candidates' error is `static_error` with static ranges and
    `dynamic_error` with ranges chosen per inference, plus `layer_error` unless the culprit layer is float."""

    range_methods = ("histogram",)
    fallback_range_methods = ("dynamic",)
    settings = ("dynamic_ranges", "static_ranges")

    def __init__(self, model, culprit, static_error, dynamic_error, layer_error=0.0, unquantized=()):
        super().__init__(model, culprit)
        self.errors, self.layer_error = {"histogram": static_error, "dynamic": dynamic_error}, layer_error
        self.unquantized = list(unquantized)  # layers the dynamic method leaves float whatever is asked

    def float_closure(self, float_layers, method="histogram"):
        return list(dict.fromkeys([*float_layers, *(self.unquantized if method == "dynamic" else [])]))

    def float_ops(self, float_layers, float_kinds=(), method=None):
        return {"linear": len(float_layers), **({"add": 3} if method == "dynamic" else {})}

    def quantize(self, float_layers, range_images, method):
        if self.errors[method] is None:
            raise RuntimeError("no dynamic kernel for this graph\nsecond line")
        error = self.errors[method] + (0.0 if self.culprit in float_layers else self.layer_error)
        return FakeCandidate(self.model, error, list(float_layers), method)


class ResidualBlocks(torch.nn.Module):
    """Two ResNet basic blocks: each add is followed by a ReLU, which the XNNPACK quantizer fuses with it."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)) for _ in range(2)
        )

    def forward(self, x):
        x = self.stem(x).relu()
        for block in self.blocks:
            x = (x + block(x)).relu()
        return x


class TinyTransformer(torch.nn.Module):
    """Patch embedding, pre-norm attention and a GELU MLP: the ops a ViT has, at toy size."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.patch, self.norm = nn.Conv2d(3, 16, 4, 4), nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        h = self.norm(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.mlp(self.norm(t))
        return self.head(t.mean(1))


class PatchMerging(torch.nn.Module):
    """A convolution, Swin's pad of its odd-sized map (zeros, or nothing at an even size), then a float op
    (LayerNorm) or an int8 one (a convolution)."""

    def __init__(self, pad, then):
        super().__init__()
        self.pad, self.then = pad, then
        self.conv, self.norm, self.conv2 = torch.nn.Conv2d(3, 8, 3), torch.nn.LayerNorm(8), torch.nn.Conv2d(8, 8, 3)

    def forward(self, x):
        y = torch.nn.functional.pad(self.conv(x), self.pad)
        return self.norm(y.permute(0, 2, 3, 1)) if self.then == "norm" else self.conv2(y)


class ReluNet(torch.nn.Module):
    """Conv, BatchNorm, ReLU as ResNet's and VGG's layers are (BatchNorm folded into the conv before annotating
    leaves a conv whose only user is a ReLU), a depthwise conv, and a linear head."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )

    def forward(self, x):
        return self.body(x)


class SharedInput(torch.nn.Module):
    """A ReLU's output read by a 3x3 and a 1x1 conv, as ResNet50's blocks and SqueezeNet's fire modules read theirs;
    or (shuffle) read by a 1x1 conv through ShuffleNetV2's channel shuffle."""

    def __init__(self, shuffle: bool):
        super().__init__()
        nn = torch.nn
        self.shuffle = shuffle
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.wide, self.narrow = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)

    def forward(self, x):
        y = self.stem(x)
        if self.shuffle:
            b, c, h, w = y.shape
            return self.narrow(y.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w))
        return self.wide(y) + self.narrow(y)


class SharedHead(torch.nn.Module):
    """One head (conv tower and output conv) applied to two feature levels, as RetinaNet and FCOS apply theirs."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem, self.down = nn.Conv2d(3, 64, 3, 2, 1), nn.Conv2d(64, 64, 3, 2, 1)
        self.tower = nn.Sequential(
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()
        )
        self.out = nn.Conv2d(64, 8, 3, padding=1)

    def forward(self, x):
        a = self.stem(x)
        return torch.cat([self.out(self.tower(level)).flatten(2) for level in (a, self.down(a))], 2)


class ComputedBias(torch.nn.Module):
    """Swin V2's attention projection: its bias is cloned and a third of it zeroed on every call."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv, self.head = torch.nn.Conv2d(3, 24, 4, 4), torch.nn.Linear(24, 72), torch.nn.Linear(72, 5)

    def forward(self, x):
        bias = self.qkv.bias.clone()
        bias[24:48].zero_()
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(torch.nn.functional.linear(tokens, self.qkv.weight, bias).relu()).mean(1)


class ConvReadTwice(torch.nn.Module):
    """MaxViT's stem and first block: one conv's output read by a pre-norm BatchNorm and by an AvgPool shortcut."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem, self.norm = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.body, self.shortcut = nn.Conv2d(16, 16, 3, padding=1), nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(16, 16, 1))
        with torch.no_grad():  # statistics far from identity, as a trained or settled model's are
            self.norm.running_mean.uniform_(2, 4), self.norm.running_var.uniform_(0.02, 0.1)

    def forward(self, x):
        y = self.stem(x)
        return torch.nn.functional.avg_pool2d(self.body(self.norm(y)), 2) + self.shortcut(y)


class UntraceableConvBn(torch.nn.Module):
    """A Conv and its BatchNorm right under a module torch.fx cannot trace (a branch on a value), beside a child
    it can: folding by parts folds the child's pair only, and the TorchScript exporter folds the other itself,
    naming the folded weight onnx::Conv_<n>, a name no module has."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.child = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8))

    def forward(self, x):
        y = self.bn(self.conv(x))
        if y.mean() > 1e9:  # never, but torch.fx cannot know
            y = -y
        return self.child(y).mean((2, 3))


class SharedOutlierInput(torch.nn.Module):
    """A stem whose one outlier channel feeds two convs (a ResNet block's conv1 and downsample, Inception's
    branches); only `a` matters to the output."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = (
            torch.nn.Conv2d(3, 8, 1),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.Conv2d(8, 8, 1),
        )
        self.fc = torch.nn.Linear(8, 10)
        with torch.no_grad():
            self.stem.weight[0] *= 1000
            self.stem.bias[0] *= 1000
            self.a.weight[:, 0] /= 1000
            self.b.weight[:, 0] /= 1000

    def forward(self, x):
        y = torch.relu(self.stem(x))
        return self.fc(torch.relu(self.a(y)).mean((2, 3)) + 0.01 * torch.relu(self.b(y)).mean((2, 3)))
