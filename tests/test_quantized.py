"""torchvision's quantized weights: resolved, listed, loaded as torchvision builds them, exported as int8 .ptl."""

import copy
import json
import shutil
import zipfile

import pytest
import torch
from torchvision.models import get_model, get_model_weights, get_weight, list_models
from torchvision.models import quantization as tv_quantization

from exporter import files, weights
from exporter.errors import UsageError
from exporter.formats import FORMATS

from exporter.results import jsonable
from exporter.thresholds import breaches

from .helpers import FAST, assert_clean_refusal, run_cli


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "MobileNet_V3_Large_QuantizedWeights.IMAGENET1K_QNNPACK_V1",
            "MobileNet_V3_Large_QuantizedWeights.IMAGENET1K_QNNPACK_V1",
        ),
        ("quantized_mobilenet_v3_large", "MobileNet_V3_Large_QuantizedWeights.IMAGENET1K_QNNPACK_V1"),
        ("quantized_resnet50:IMAGENET1K_FBGEMM_V2", "ResNet50_QuantizedWeights.IMAGENET1K_FBGEMM_V2"),
        ("quantized_shufflenet_v2_x0_5", "ShuffleNet_V2_X0_5_QuantizedWeights.IMAGENET1K_FBGEMM_V1"),
    ],
)
def test_quantized_names_resolve(name, expected):
    w = weights.resolve(name)
    assert weights.canonical_name(w) == expected
    assert weights.task_of(weights.model_name_of(w)) == "quantization" and weights.is_quantized(w)


def test_unknown_quantized_name_suggests():
    with pytest.raises(UsageError, match="quantized_mobilenet_v3_large"):
        weights.resolve("quantized_mobilenet_v3_larg")


def _tsv(result):
    assert result.exit_code == 0, result.output
    header, *rows = [line.split("\t") for line in result.stdout.splitlines()]
    return header, rows


def test_list_quantization_has_every_weight_with_its_engine():
    header, rows = _tsv(run_cli("list", "--task", "quantization"))
    expected = {
        f"{type(w).__name__}.{w.name}": w.meta["backend"]
        for m in list_models(module=tv_quantization)
        for w in get_model_weights(m)
    }
    assert {r[0]: r[header.index("backend")] for r in rows} == expected


def test_list_piped_prints_whole_names():
    """Piped, `exporter list | grep Weights` sees every weight's whole name in its own row."""
    header, rows = _tsv(run_cli("list"))
    assert header[0] == "weight" and all(len(r) == len(header) for r in rows)
    names = [r[0] for r in rows]
    assert names == [row["weight"] for row in weights.list_weights("classification")]
    assert "MobileNet_V3_Large_Weights.IMAGENET1K_V2" in names
    assert all(name.count(".") == 1 and "Weights." in name for name in names)


@pytest.mark.parametrize(
    "task, metric", [("segmentation", "miou"), ("detection", "box_map"), ("classification", "acc@1")]
)
def test_list_tasks_show_their_metric(task, metric):
    header, rows = _tsv(run_cli("list", "--task", task))
    assert rows and {r[header.index("metric")] for r in rows} == {metric}


def test_formats_declare_whether_they_take_an_eager_quantized_model():
    takes = {name for name, spec in FORMATS.items() if spec.no_quantized_eager is None}
    assert takes == {"torchscript_lite"}


def _held_out(model, count: int = 64):
    from exporter import data

    inputs = data.from_imagefolder(model.data_dir, get_weight(model.weight).transforms(), 0, count, 0, num_classes=10)
    return inputs.validation


def test_converted_checkpoint_loads_as_the_model_that_wrote_it(quantized_digits, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))  # no float model at hand
    loaded = weights.load(quantized_digits.weight, quantized_digits.checkpoint)
    assert loaded.quantized and loaded.num_classes == 10
    assert torch.backends.quantized.engine == get_weight(quantized_digits.weight).meta["backend"]
    assert loaded.reference["kind"] == "quantized eager" and loaded.eager is loaded.model
    assert loaded.reference["looked_for"].startswith(str(tmp_path / "hub" / "checkpoints"))

    # the int8 model holds exactly the checkpoint's quantized weights, scales and zero points
    saved = torch.load(quantized_digits.checkpoint, weights_only=True)
    state = loaded.model.state_dict()
    assert state.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, tuple):  # packed (weight, bias)
            assert all(torch.equal(a, b) for a, b in zip(state[key], value) if a is not None), key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key


def test_qat_checkpoint_is_prepared_loaded_then_converted(quantized_digits, tmp_path):
    """torchvision's MobileNetV3 int8 checkpoint is a quantization-aware-training state, converted after loading."""
    name = weights.model_name_of(get_weight(quantized_digits.weight))
    backend = get_weight(quantized_digits.weight).meta["backend"]
    model = get_model(name, weights=None, num_classes=10)
    model.load_state_dict(torch.load(quantized_digits.float_checkpoint, weights_only=True))
    model.train()
    model.fuse_model(is_qat=True)
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig(backend)
    torch.ao.quantization.prepare_qat(model, inplace=True)
    x = _held_out(quantized_digits)
    with torch.no_grad():
        model(x[:32])  # observers see real data
    path = tmp_path / "qat.pth"
    torch.save(model.state_dict(), path)
    expected = torch.ao.quantization.convert(copy.deepcopy(model).eval())

    loaded = weights.load(quantized_digits.weight, path)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), expected(x))


def test_float_reference_from_the_hub_cache_is_verified(quantized_digits, tmp_path, monkeypatch):
    unquantized = get_weight(quantized_digits.weight).meta["unquantized"]
    checkpoints = tmp_path / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copy(quantized_digits.float_checkpoint, checkpoints / unquantized.url.rsplit("/", 1)[1])
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    # the trained file sits under torchvision's name, whose hash prefix it cannot match
    with pytest.raises(UsageError, match="hash check"):
        weights.load(quantized_digits.weight, quantized_digits.checkpoint)
    loaded = weights.load(quantized_digits.weight, quantized_digits.checkpoint, verify=False)
    assert loaded.reference["kind"] == "unquantized float"
    assert loaded.reference["checkpoint"].source == "torch-hub-cache"
    assert loaded.eager is loaded.reference_model and not any(
        p.is_quantized for p in loaded.eager.state_dict().values() if isinstance(p, torch.Tensor)
    )


def _build(model, out, *extra, env=None):
    return run_cli(
        "build",
        model.weight,
        "--checkpoint",
        model.checkpoint,
        "--data",
        model.data_dir,
        "--labels",
        model.labels_file,
        "--out",
        out,
        "--target",
        "android",
        "--quiet",
        *FAST,
        *extra,
        env=env,
    )


@pytest.fixture(scope="module")
def android_int8(tmp_path_factory, quantized_digits):
    out = tmp_path_factory.mktemp("quantized") / "android"
    result = _build(quantized_digits, out, "--float-checkpoint", quantized_digits.float_checkpoint)
    return out, result


def test_android_build_writes_a_validated_int8_ptl(android_int8, quantized_digits):
    out, result = android_int8
    doc = json.loads((out / "manifest.json").read_text())
    assert result.exit_code == (1 if doc["status"] == "failed" else 0), result.output
    by_name = {a["name"]: a for a in doc["artifacts"]}
    assert set(by_name) == {"executorch_int8", "litert_int8", "torchscript_lite_int8"}
    assert by_name["litert_int8"]["status"] == "unavailable" and by_name["litert_int8"]["path"] is None
    pte = by_name["executorch_int8"]
    assert pte["status"] == "unavailable" and "PT2E" in pte["reasons"][0]["text"] and pte["path"] is None

    ptl = by_name["torchscript_lite_int8"]
    assert ptl["precision"] == "int8" and ptl["thresholds"] == doc["target"]["thresholds"]["int8"]
    assert files.sha256(out / ptl["path"]) == ptl["sha256"]
    # the lite interpreter runs int8 kernels: the bytecode calls quantized convolutions and linear layers
    with zipfile.ZipFile(out / ptl["path"]) as ptl_zip:
        bytecode = next(ptl_zip.read(n) for n in ptl_zip.namelist() if n.endswith("/bytecode.pkl"))
    assert b"quantized::conv2d" in bytecode and b"quantized::linear" in bytecode
    assert ptl["details"]["quantized_engine_on_host"] == get_weight(quantized_digits.weight).meta["backend"]
    # measured against the weight's own float model, the accuracy the int8 model gave up is on record
    reference = doc["eager"]["reference"]
    assert reference["kind"] == "unquantized float"
    assert reference["checkpoint"]["sha256"] == files.sha256(quantized_digits.float_checkpoint)
    assert doc["eager"]["accuracy"]["acc1"] >= 90.0  # the float model really learned (94-99 on the hosts seen)
    # judged on the int8 thresholds alone: how much a stand-in's PTQ gives up is not the product's promise
    # (a model loaded wrongly is caught below, where the .ptl must reproduce the quantized eager model)
    assert ptl["status"] in ("passed", "failed")
    # beside the breaches, the build may say the reference is ill-conditioned at int8 (a note, never alone)
    broken = [r for r in ptl["reasons"] if r["kind"] != "ill_conditioned_reference"]
    assert broken or len(broken) == len(ptl["reasons"]), ptl["reasons"]
    assert all(r.get("metric") in ("top1_agreement", "psnr_db", "accuracy_drop") for r in broken), ptl["reasons"]
    assert broken == jsonable(breaches(ptl, ptl["thresholds"]))  # the verdict follows the thresholds, whatever PTQ cost
    assert ptl["latency_ms"]["p50"] > 0 and ptl["eager_latency_ms"]["p50"] > 0
    assert "unquantized float" in (out / "report.md").read_text()


def test_without_float_model_the_quantized_eager_is_the_reference(tmp_path, quantized_digits):
    """The .ptl runs the same int8 kernels as the eager model; once the float model appears in the hub
    cache, the whole-build record no longer answers, and the float model becomes the reference."""
    home = tmp_path / "torch_home"
    env = {"TORCH_HOME": str(home)}
    result = _build(quantized_digits, tmp_path / "a", "--format", "torchscript_lite", "--no-verify", env=env)
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert doc["eager"]["reference"]["kind"] == "quantized eager"
    assert "--float-checkpoint" in (tmp_path / "a" / "report.md").read_text()
    (ptl,) = doc["artifacts"]
    # the same int8 kernels on the same packed weights as the eager model
    assert ptl["status"] == "passed" and ptl["fidelity"]["top1_agreement"] == 1.0
    assert ptl["fidelity"]["psnr_db"] == "inf" or ptl["fidelity"]["psnr_db"] >= 60

    unquantized = get_weight(quantized_digits.weight).meta["unquantized"]
    (home / "hub" / "checkpoints").mkdir(parents=True)
    shutil.copy(quantized_digits.float_checkpoint, home / "hub" / "checkpoints" / unquantized.url.rsplit("/", 1)[1])
    result = _build(quantized_digits, tmp_path / "b", "--format", "torchscript_lite", "--no-verify", env=env)
    assert result.exit_code in (0, 1), result.output
    again = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert again["eager"]["reference"]["kind"] == "unquantized float"
    assert not any("whole build reused" in e for e in again["cache"]["events"])


def test_float_checkpoint_for_the_quantized_weight_is_refused(tmp_path, quantized_digits):
    out = tmp_path / "out"
    result = run_cli("build", quantized_digits.weight, "--checkpoint", quantized_digits.float_checkpoint, "--out", out)
    assert_clean_refusal(result, out, "does not fit")


def test_float_checkpoint_option_on_a_float_weight_is_refused(tmp_path, digits_model):
    out = tmp_path / "out"
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        digits_model.checkpoint,
        "--float-checkpoint",
        digits_model.checkpoint,
        "--out",
        out,
    )
    assert_clean_refusal(result, out, "--float-checkpoint is for quantized weights")
