"""The ios target on the trained digits model: Core ML packages built and checked on Linux,
reported unavailable (Core ML predicts only on macOS) with labelled proxy measurements."""

from __future__ import annotations

import copy
import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image

from exporter import data, weights
from exporter.formats import coreml

from .helpers import ROOT, assert_clean_refusal, build_args, hide_module, run_cli

ct = pytest.importorskip("coremltools")

# The shipped profile's thresholds, with only the packages these tests look at: building all
# eight artifacts takes several minutes on two cores.
KEPT = ("coreml_fp16", "coreml_fp16_w8", "coreml_fp16_palettized4")
IOS_PROFILE = tomllib.loads((ROOT / "targets" / "ios.toml").read_text())
EAGER_FP16_IMAGES: list[int] = []


@pytest.fixture(scope="module")
def ios_build(tmp_path_factory, digits_model):
    root = tmp_path_factory.mktemp("ios")
    profile = dict(IOS_PROFILE, artifacts=[a for a in IOS_PROFILE["artifacts"] if a.get("name") in KEPT])
    lines = [f"name = {json.dumps(profile['name'])}"]
    for art in profile["artifacts"]:
        lines += ["[[artifacts]]", *(f"{k} = {json.dumps(v)}" for k, v in art.items() if k != "options")]
        lines += [f"options = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in art.get('options', {}).items())} }}"]
    for precision, table in profile["thresholds"].items():
        lines += [f"[thresholds.{precision}]", *(f"{k} = {v}" for k, v in table.items())]
    path = root / "ios.toml"
    path.write_text("\n".join(lines) + "\n")
    out = root / "build"
    original = coreml.EagerFp16.__call__
    with pytest.MonkeyPatch.context() as patch:  # count the fp16 proxy's images: its outputs are every package's
        patch.setattr(
            coreml.EagerFp16, "__call__", lambda self, x: EAGER_FP16_IMAGES.append(len(x)) or original(self, x)
        )
        result = run_cli(*build_args(digits_model, out, "--target", path))
    doc = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else None
    return out, result, doc


def _entry(doc, name):
    return next(a for a in doc["artifacts"] if a["name"] == name)


def test_build_exits_0_with_core_ml_unavailable_and_proxies(ios_build):
    out, result, doc = ios_build
    assert result.exit_code == 0, (result.output, result.exception)
    assert [a["name"] for a in doc["artifacts"]] == list(KEPT)
    for entry in doc["artifacts"]:
        assert entry["status"] == "unavailable"
        assert entry["reasons"] == [
            {
                "kind": "unavailable_here",
                "text": f"not validated: Core ML predict needs macOS; this host is {sys.platform}",
            }
        ]
        # nothing is reported as Core ML's own numbers
        assert entry["fidelity"] is None and entry["latency_ms"] is None
        assert set(entry["proxy"]) == {"weights", "fp16"}
        for proxy in entry["proxy"].values():
            assert proxy["fidelity"]["samples"] == doc["data"]["validation"]
            assert proxy["accuracy"]["acc1"] > 90
        assert entry["proxy"]["fp16"] == doc["artifacts"][0]["proxy"]["fp16"]
    # eager in fp16 is the same for the three packages: run once over the validation images, not three times
    assert sum(EAGER_FP16_IMAGES) == doc["data"]["validation"], EAGER_FP16_IMAGES


def test_packages_pass_the_structural_checks(ios_build, digits_model):
    out, _, doc = ios_build
    labels = [line.strip() for line in Path(digits_model.labels_file).read_text().splitlines() if line.strip()]
    for entry in doc["artifacts"]:
        details = entry["details"]
        assert details["deployment_target"] == "iOS17" and details["compute_precision"] == "fp16"
        assert details["input"] == {"name": "image", "type": "image", "color_space": "RGB", "width": 224, "height": 224}
        assert details["outputs"]["logits"] == [1, 10] and details["labels"] == 10
        package = ct.models.MLModel(str(out / entry["path"]), skip_model_load=True)
        assert package.user_defined_metadata["exporter.weight"] == digits_model.weight
        assert coreml._classify_labels(package.get_spec()) == labels
    plain = _entry(doc, "coreml_fp16")["details"]["compression"]
    w8 = _entry(doc, "coreml_fp16_w8")["details"]["compression"]
    p4 = _entry(doc, "coreml_fp16_palettized4")["details"]["compression"]
    assert plain["compressed_weights"] == 0
    # coremltools leaves weights of at most 2048 elements uncompressed; they hold < 1% of the parameters
    assert w8["compressed_by_op"] == {"constexpr_affine_dequantize": w8["compressed_weights"]}
    assert w8["compressed_parameters"] > 0.99 * w8["parameters"] and w8["max_distinct_values"] <= 256
    assert p4["compressed_by_op"] == {"constexpr_lut_to_dense": p4["compressed_weights"]}
    assert p4["compressed_parameters"] > 0.99 * p4["parameters"] and p4["max_distinct_values"] <= 16


def test_w8_proxy_within_profile_thresholds(ios_build):
    _, _, doc = ios_build
    entry = _entry(doc, "coreml_fp16_w8")
    assert entry["thresholds"] == IOS_PROFILE["thresholds"]["fp16"]
    for label in ("weights", "fp16"):
        assert entry["proxy"][label]["status"] == "passed", entry["proxy"][label]["reasons"]


def test_compressed_package_sizes(ios_build):
    _, _, doc = ios_build
    fp16 = _entry(doc, "coreml_fp16")["size_bytes"]
    # measured on this model: 0.52 and 0.28 (small weights and the graph stay uncompressed)
    assert 0.45 < _entry(doc, "coreml_fp16_w8")["size_bytes"] / fp16 < 0.58
    assert 0.22 < _entry(doc, "coreml_fp16_palettized4")["size_bytes"] / fp16 < 0.33


def test_folded_normalization_reproduces_eager_preprocessing(digits_model, ios_build):
    loaded = weights.load(digits_model.weight, digits_model.checkpoint, True, None)
    t = loaded.weights.transforms()
    image_path = next(Path(digits_model.data_dir).rglob("*.png"))
    with Image.open(image_path) as im:
        rgb = im.convert("RGB")
    eager_input = t(rgb)
    crop = TF.center_crop(
        TF.resize(rgb, t.resize_size, interpolation=t.interpolation, antialias=t.antialias), t.crop_size
    )
    unnormalized = TF.convert_image_dtype(TF.pil_to_tensor(crop), torch.float32)

    wrapper = coreml.ImageClassifier(loaded.model, t.mean, t.std).eval()
    first_conv = next(m for m in loaded.model.modules() if isinstance(m, torch.nn.Conv2d))
    seen = []
    hook = first_conv.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        wrapper(unnormalized[None])
        loaded.model(eager_input[None])
    hook.remove()
    assert torch.equal(seen[0], seen[1])
    # Core ML multiplies the 8-bit image by the scale 1/255 where torchvision divides by 255:
    # the graph's input differs by at most one float32 rounding step
    scaled = TF.pil_to_tensor(crop).float() * (1 / 255.0)
    assert (scaled - unnormalized).abs().max() <= 2**-24

    # and the package applies the same constants in front of its first conv (in fp16 here)
    from coremltools.optimize.coreml import get_weights_metadata

    package = ct.models.MLModel(str(ios_build[0] / _entry(ios_build[2], "coreml_fp16")["path"]), skip_model_load=True)
    ops = [op for op in coreml._main_ops(package.get_spec()) if op.type in ("mul", "sub", "conv")][:4]
    assert [op.type for op in ops] == ["mul", "sub", "mul", "conv"]  # * 1/255, - mean, * 1/std, first conv
    values = {
        name: torch.from_numpy(m.val.astype("float32")).flatten()
        for name, m in get_weights_metadata(package, weight_threshold=0).items()
    }
    torch.testing.assert_close(values[coreml._argument(ops[1], "y")], torch.tensor(t.mean), rtol=1e-3, atol=0)
    torch.testing.assert_close(values[coreml._argument(ops[2], "y")], 1 / torch.tensor(t.std), rtol=1e-3, atol=0)


# Bad inputs: one line on stderr, exit 2, no traceback, nothing written.


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--deployment-target", "iOS14"], "ML programs need iOS15 or later"),
        (["--option", "nbits=9"], "nbits must be one of 1, 2, 3, 4, 6, 8"),
        (["--option", "compression=zip"], "unknown compression 'zip'"),
    ],
)
def test_bad_coreml_options(tmp_path, digits_model, args, needle):
    out = tmp_path / "out"
    result = run_cli(*build_args(digits_model, out, "--target", "ios", "--format", "coreml", *args))
    assert_clean_refusal(result, out, needle)


def test_labels_count_differs_from_classes(tmp_path, digits_model):
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"d{i}\n" for i in range(9)))
    out = tmp_path / "out"
    args = build_args(digits_model, out, "--target", "ios", "--format", "coreml")
    args[args.index("--labels") + 1] = labels
    assert_clean_refusal(run_cli(*args), out, "has 9 labels but the model has 10 classes")


def test_missing_ios_extra(tmp_path, digits_model, monkeypatch):
    hide_module(monkeypatch, "coremltools")
    out = tmp_path / "out"
    result = run_cli(*build_args(digits_model, out, "--target", "ios"))
    assert_clean_refusal(result, out, "pip install 'exporter[ios]'")


def test_known_deployment_targets_match_coremltools():
    assert coreml.IOS_TARGETS == tuple(int(t.name[3:]) for t in ct.target if t.name.startswith("iOS"))


class _Aliased(torch.nn.Module):  # Swin's window shifts, decomposed
    def forward(self, x):
        return torch.ops.aten.alias.default(x * 2) + 1


class _Zeroed(torch.nn.Module):  # Swin V2's attention mask
    def forward(self, x):
        return x + torch.ops.aten.zero.default(x)


class _EmptyWrite(torch.nn.Module):  # Swin3D's attention mask where a window covers every frame
    def forward(self, x):
        mask = x.new_zeros(3, 4, 4)
        mask[1:2, :, :2] = 3.0
        mask[0:-3, :, 1:] = 5.0  # an empty slice
        return x + mask


@pytest.mark.parametrize("module", [_Aliased, _Zeroed, _EmptyWrite], ids=lambda m: m.__name__)
def test_nodes_coremltools_cannot_take_are_replaced_so_core_ml_converts_the_program(module, tmp_path):
    """Decomposed graphs hold nodes coremltools 9 does not convert ("alias", "zero", a reshape to an empty
    slice's shape); replaced, it converts and the program computes the same."""
    import coremltools as ct

    from exporter.formats.coreml import _convertible

    x = torch.randn(1, 3, 4, 4)
    with pytest.raises(Exception, match="alias|zero|reshape|0 in shape"):
        ct.convert(
            torch.export.export(module(), (x,)).run_decompositions({}),
            convert_to="mlprogram",
            inputs=[ct.TensorType(name="x", shape=x.shape)],
        )
    replaced = _convertible(torch.export.export(module(), (x,)).run_decompositions({}))
    assert not any(
        n.target in (torch.ops.aten.alias.default, torch.ops.aten.zero.default) for n in replaced.graph.nodes
    )
    torch.testing.assert_close(replaced.module()(x), module()(x))
    ct.convert(replaced, convert_to="mlprogram", inputs=[ct.TensorType(name="x", shape=x.shape)]).save(
        str(tmp_path / "m.mlpackage")
    )
    assert (tmp_path / "m.mlpackage").is_dir()


def test_the_weights_proxy_pairs_layers_applied_through_their_weights():
    """Swin's attention calls F.linear(x, qkv.weight): no call_module for torch.fx, so pairing the package's 53
    layers with the model's 29 traced ones failed, and with it the whole iOS build."""
    import numpy as np
    import torch

    from exporter.formats.coreml import _with_package_weights

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.qkv, self.head = torch.nn.Conv2d(3, 8, 4, 4), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, x):
            t = self.norm(self.embed(x).flatten(2).transpose(1, 2))
            return self.head(torch.nn.functional.linear(t, self.qkv.weight, self.qkv.bias).mean(1))

    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 3, 16, 16)
    layers = [
        {
            "op": type(m).__name__,
            "weight": (m.weight.detach() * 0.5).numpy().astype(np.float16),
            "bias": m.bias.detach().numpy(),
        }
        for m in (model.embed, model.qkv, model.head)
    ]  # the package's, halved
    expected = Attention().eval()
    expected.load_state_dict(model.state_dict())
    with torch.no_grad():
        for m in (expected.embed, expected.qkv, expected.head):
            m.weight.copy_(torch.from_numpy((m.weight * 0.5).numpy().astype(np.float16).astype(np.float32)))
        torch.testing.assert_close(_with_package_weights(model, layers)(x), expected(x))


def test_a_vit_package_is_read_back_and_its_weights_proxy_matches_eager(tmp_path):
    """ViT-B/16 converted, then every iOS artifact failed reading the package back: coremltools'
    get_weights_metadata raises on a const feeding an op with a list input (the class token into a concat). And
    the weights proxy must pair nn.MultiheadAttention's in_proj_weight, which no nn.Linear holds."""
    import torch
    from torchvision.models.vision_transformer import VisionTransformer

    from exporter.formats import coreml

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5
    ).eval()
    torch.nn.init.normal_(model.heads.head.weight)
    x = torch.randn(1, 3, 32, 32)
    meta = {
        "preprocessing": {"mean": [0.5] * 3, "std": [0.25] * 3, "crop_size": [32]},
        "labels": list("abcde"),
        "model": "vit",
        "weight": "tiny",
        "exporter_version": "0",
    }
    details = coreml.FORMAT.export(model, x, "fp32", None, tmp_path / "vit.mlpackage", meta, input="tensor")
    matrices = [p for name, p in model.named_parameters() if name.endswith("weight") and p.dim() >= 2]
    assert len(matrices) == 6  # the patch conv, attention's in_proj_weight and out_proj, the MLP's two, the head
    assert details["compression"]["weights"] == 6
    assert details["compression"]["parameters"] == sum(p.numel() for p in matrices)
    proxy = coreml.FORMAT.proxies(tmp_path / "vit.mlpackage", model)["weights"]
    with torch.no_grad():
        torch.testing.assert_close(proxy(x), model(x), rtol=1e-4, atol=1e-4)


def test_coremltools_progress_bars_are_dropped_and_its_warnings_kept(capsys):
    """coremltools' tqdm bars (with a total, and the 'N passes' ones without) would bury the build's own progress."""
    from exporter.formats import coreml

    from tqdm import tqdm

    with coreml._without_progress_bars():
        print(
            "Running MIL frontend_milinternal pipeline: 0 passes [00:00, ? passes/s]\r"
            "Running MIL default pipeline:  30%|███       | 28/92 [00:00<00:00, 276.53 passes/s]",
            file=sys.stderr,
        )
        print("WARNING: a real warning", file=sys.stderr)
        sys.stderr.write("\r⠋ export coreml_fp16 …")
        assert capsys.readouterr().err == "WARNING: a real warning\n\r⠋ export coreml_fp16 …"  # as they come
        for _ in tqdm(range(3), desc="Running MIL default pipeline", unit=" passes", mininterval=0):
            pass
        for _ in tqdm(iter(range(3)), desc="Running MIL frontend_milinternal pipeline", unit=" passes", mininterval=0):
            pass
    assert capsys.readouterr().err == ""


def _psnr(reference: torch.Tensor, output: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.abs().max() ** 2 / ((reference - output) ** 2).mean()))


def test_fp16_proxy_rounds_like_half_precision_arithmetic(digits_model):
    """The fp16 proxy emulates half-precision storage in float32 (half-precision matrix products are ~90x slower
    on CPUs without AVX-512 FP16): on the trained digits model it lands no farther from float32 than running the model
    in half precision does, with the same top-1 on every held-out digit."""
    loaded = weights.load(digits_model.weight, digits_model.checkpoint, verify=False)
    images = data.from_imagefolder(
        digits_model.data_dir, loaded.weights.transforms(), 0, 32, 0, num_classes=10
    ).validation
    model = loaded.model.eval()
    with torch.no_grad():
        fp32 = model(images)
        half = copy.deepcopy(model).half()(images.half()).float()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    emulated = coreml.EagerFp16(model)(images)
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    assert torch.equal(emulated, emulated.half().float())  # every value is a float16
    assert not torch.equal(emulated, fp32)
    # no farther from float32 than this host's half kernels (one-sided: kernels that accumulate in float16, as
    # some ARM ones may, land farther)
    assert _psnr(fp32, emulated) > _psnr(fp32, half) - 3.0, (_psnr(fp32, emulated), _psnr(fp32, half))
    assert torch.equal(emulated.argmax(1), half.argmax(1))
    with torch.no_grad():
        assert torch.equal(model(images), fp32)  # the model itself is left as it was


def test_fp16_proxy_rounds_every_op_in_place_results_and_through_views():
    class Chain(torch.nn.Module):
        def forward(self, x):
            y = x * 1.0
            y.mul_(1 / 3)  # in place: rounded where it lies
            y.view(-1)[1:].mul_(1 / 5)  # in place through a view: the viewed tensor changes, rounded
            return y.view(-1).add(y.flatten().mul(1 / 7))  # each op's result rounded before the next uses it

    x = torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    half = lambda t: t.half().float()  # noqa: E731
    y = half(x / 3)
    y[0, 1:] = half(y[0, 1:] * (1 / 5))
    expected = half(y.flatten() + half(y.flatten() * (1 / 7)))
    assert torch.equal(coreml.EagerFp16(Chain())(x), expected)
    exact = (x / 3).flatten()
    exact[1:] /= 5
    assert not torch.equal(half(exact + exact / 7), expected)  # rounding the result alone would not give it


def test_fp16_proxy_rounds_inside_attention():
    """Attention runs as its ops, so its scores and softmax are rounded too, not computed inside one fused kernel."""
    seen = []
    original = coreml._RoundedToHalf.__torch_dispatch__

    def record(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return original(self, func, types, args, kwargs)

    attention = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    module = type(
        "SelfAttention", (torch.nn.Module,), {"forward": lambda self, x: attention(x, x, x, need_weights=False)[0]}
    )()
    module.attention = attention
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coreml._RoundedToHalf, "__torch_dispatch__", record)
        out = coreml.EagerFp16(module)(torch.randn(1, 5, 16))
    assert any("softmax" in name for name in seen), seen
    assert not any("flash_attention" in name or "_native_multi_head_attention" in name for name in seen), seen
    assert torch.equal(out, out.half().float())


def test_core_ml_leaves_no_package_in_the_temporary_directory(tmp_path, monkeypatch, capsys):
    """coremltools keeps a package in the temporary directory for every model it makes (a conversion, a
    compression, a decompression) until Python exits: RegNetY-128GF's iOS build filled the disk with 20 GB of
    them. Export and proxies leave none there, nor anything beside the artifact; nor progress bars on stderr
    (reading a package back draws them too)."""
    import tempfile

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3),  # palettized
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 5),
    ).eval()
    x = torch.randn(1, 3, 16, 16)
    meta = {
        "preprocessing": {"mean": [0.5] * 3, "std": [0.25] * 3, "crop_size": [16]},
        "labels": list("abcde"),
        "model": "tiny",
        "weight": "tiny",
        "exporter_version": "0",
    }
    out = tmp_path / "out"
    out.mkdir()
    coreml.FORMAT.export(model, x, "fp16", None, out / "m.mlpackage", meta, compression="palettize", nbits=4)
    coreml.FORMAT.proxies(out / "m.mlpackage", model)
    assert [p.name for p in temporary.iterdir()] == [] and [p.name for p in out.iterdir()] == ["m.mlpackage"]
    assert tempfile.tempdir == str(temporary)
    assert "passes/s" not in capsys.readouterr().err
