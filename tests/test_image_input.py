"""uint8-nhwc artifacts: an app's RGB bytes in, the weight's preprocessing after the resize inside the graph, judged on
the same images against the same eager reference as the float path."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from exporter.errors import UsageError
from exporter.tasks.image_input import ImageBytesInput, as_bytes

from .helpers import INT8_SLACK, assert_clean_refusal, assert_device_reproduces_the_build, build_args, run_cli

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _photo(seed: int, size=(347, 261)) -> Image.Image:
    """Smooth colour fields with texture and hard edges: what resizing and cropping round differently."""
    rng = np.random.default_rng(seed)
    h, w = size[1], size[0]
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    channels = [
        np.sin(6 * x * rng.uniform(0.5, 2) + rng.uniform(0, 6)) * np.cos(5 * y * rng.uniform(0.5, 2)) for _ in range(3)
    ]
    pixels = (np.stack(channels, -1) * 90 + 128 + rng.normal(0, 12, (h, w, 3))).clip(0, 255)
    pixels[h // 3 : h // 2, w // 4 : w // 2] = rng.integers(0, 256, 3)  # a flat patch with hard edges
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def _transforms():
    """torchvision's own transforms, as a build feeds eager: a classifier's preset (v1, divides by 255) and the
    segmentation and detection tasks' (v2, multiplies by 1/255), each with the bytes an app's bitmap would hold
    after the same resize (and crop)."""
    from torchvision.models import get_weight
    from torchvision.transforms import v2

    from exporter.tasks import Detection, Segmentation

    classifier = get_weight("ResNet18_Weights.IMAGENET1K_V1").transforms()

    def resized_and_cropped(image):
        resized = v2.functional.resize(image, classifier.resize_size, classifier.interpolation, antialias=True)
        return v2.functional.center_crop(resized, classifier.crop_size)

    segmenter = get_weight("LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1")
    detector = get_weight("SSDLite320_MobileNet_V3_Large_Weights.COCO_V1")
    segmentation = Segmentation(21, (200, 200)).transform(segmenter)
    detection = Detection(91, (320, 320)).transform(detector)
    return [
        ("classifier", classifier, resized_and_cropped, IMAGENET_MEAN, IMAGENET_STD),
        ("segmenter", segmentation, lambda im: im.resize((200, 200), Image.BILINEAR), IMAGENET_MEAN, IMAGENET_STD),
        ("detector", detection, lambda im: im.resize((320, 320), Image.BILINEAR), (0.5,) * 3, (0.5,) * 3),
    ]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["classifier", "segmenter", "detector"])
def test_the_bytes_are_the_apps_bitmap_and_eager_on_them_is_eager_on_torchvisions_output(which):
    """as_bytes recovers from torchvision's output exactly the pixels the app's resized bitmap holds, and a model
    behind ImageBytesInput computes on them what it computes on torchvision's output (to float32 rounding)."""
    from torchvision.models import mobilenet_v3_small

    name, transform, bitmap, mean, std = _transforms()[which]
    images = [_photo(seed) for seed in range(3)]
    floats = torch.stack([transform(image) for image in images])
    pixels = as_bytes(floats, mean, std)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, *floats.shape[2:], 3)
    expected = np.stack([np.asarray(bitmap(image)) for image in images])
    # PIL's resize of a PIL image is what torchvision's transform resized: the same bytes (at most one grey level
    # apart where torchvision resized a tensor)
    assert np.abs(pixels.numpy().astype(int) - expected.astype(int)).max() <= 1
    torch.manual_seed(0)
    model = mobilenet_v3_small(num_classes=7).eval()
    with torch.no_grad():
        on_floats, on_bytes = model(floats), ImageBytesInput(model, mean, std).eval()(pixels)
    assert torch.allclose(on_bytes, on_floats, rtol=0, atol=1e-4 * on_floats.abs().max().item())


def test_inputs_that_are_not_whole_bytes_are_refused():
    """A transform that scales before it resizes makes values between two bytes: no app's bitmap holds them."""
    floats = torch.rand(1, 3, 8, 8)
    with pytest.raises(UsageError, match="not whole bytes"):
        as_bytes(floats, IMAGENET_MEAN, IMAGENET_STD)


@pytest.fixture(scope="module")
def uint8_build(tmp_path_factory, digits_model):
    """The digits classifier for android and jetson with uint8-nhwc inputs: the int8 .pte, the int8 .tflite (its
    int8 interface rewritten) and ONNX at fp16 (the normalisation kept float32) and int8. (The fp32 .pte and .tflite
    and the .ptl take the same wrapped graph: measured passing, left out of the suite for its minutes.)"""
    out = tmp_path_factory.mktemp("uint8") / "build"
    result = run_cli(
        *build_args(digits_model, out, "--target", "android", "--target", "jetson", "--input-format", "uint8-nhwc"),
        *INT8_SLACK,
        *["--format", "executorch:int8", "--format", "litert:int8"],
        *["--format", "onnx:fp16", "--format", "onnx:int8"],
    )
    return out, result


def test_every_uint8_artifact_passes_against_eager_and_says_what_it_takes(uint8_build):
    out, result = uint8_build
    assert result.exit_code == 0, result.output
    names = set()
    for target in ("android", "jetson"):
        doc = json.loads((out / target / "manifest.json").read_text())
        assert doc["target"]["input"] == {"format": "uint8-nhwc"}
        for artifact in doc["artifacts"]:
            if artifact["format"] == "tensorrt":
                continue
            names.add(artifact["name"])
            assert artifact["status"] == "passed", (artifact["name"], artifact["reasons"])
            side = doc["task"]["input_size"]
            assert artifact["input"]["format"] == "uint8-nhwc"
            assert artifact["input"]["shape"] == [1, *side, 3] and artifact["input"]["dtype"] == "uint8"
            assert artifact["fidelity"]["top1_agreement"] >= artifact["thresholds"]["top1_agreement"]
    assert names == {"executorch_int8", "litert_int8", "onnx_fp16", "onnx_int8"}


def test_the_files_take_bytes_and_an_app_feeding_the_golden_bytes_gets_eagers_answers(uint8_build):
    """The ONNX and .tflite files' own input is uint8 N x H x W x 3; golden/inputs_uint8.npy is golden/inputs.npy as
    bytes; ONNX Runtime fed those bytes names eager's top-1 exactly as often as the build recorded for the file on
    its golden inputs (an int8 file is held to its threshold, not to every image: CI once had 6 of 8 here)."""
    import onnxruntime as ort
    from ai_edge_litert.interpreter import Interpreter

    out, _ = uint8_build
    golden = out / "jetson" / "golden"
    pixels, floats = np.load(golden / "inputs_uint8.npy"), np.load(golden / "inputs.npy")
    assert pixels.dtype == np.uint8
    assert np.array_equal(pixels, as_bytes(torch.from_numpy(floats), IMAGENET_MEAN, IMAGENET_STD).numpy())
    eager = np.load(golden / "eager_logits.npy")
    doc = json.loads((out / "jetson" / "manifest.json").read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = doc["host"]["threads"]  # int8 outputs move with the thread count
    for entry in (a for a in doc["artifacts"] if a["format"] == "onnx"):
        session = ort.InferenceSession(str(out / "jetson" / entry["path"]), options, ["CPUExecutionProvider"])
        (feed,) = session.get_inputs()
        assert feed.type == "tensor(uint8)" and feed.shape[1:] == list(pixels.shape[1:])
        logits = np.concatenate([session.run(None, {feed.name: pixels[i : i + 1]})[0] for i in range(len(pixels))])
        agreement = float((logits.argmax(1) == eager.argmax(1)).mean())
        assert agreement == pytest.approx(entry["golden_fidelity"]["top1_agreement"]), entry["name"]
    (tflite,) = (out / "android").glob("*_litert_int8.tflite")
    interpreter = Interpreter(model_path=str(tflite))
    (detail,) = interpreter.get_input_details()
    assert detail["dtype"] == np.uint8 and list(detail["shape"]) == [1, *pixels.shape[1:]]


def test_the_device_kit_feeds_the_golden_bytes_and_the_bundle_says_what_each_artifact_takes(uint8_build):
    """device_validate.py feeds each uint8-nhwc ONNX file golden/inputs_uint8.npy and reproduces what the build
    recorded for it; bundle.json carries those bytes and each artifact's input."""
    out, _ = uint8_build
    assert_device_reproduces_the_build(out / "jetson")
    result = run_cli("bundle", out)
    assert result.exit_code == 0, result.output
    described = out / "bundle" / "android" / "bundle.json"
    bundle = json.loads(described.read_text())
    assert bundle["golden"]["inputs_uint8"] == "golden/inputs_uint8.npy"
    assert (described.parent / "golden" / "inputs_uint8.npy").is_file()
    assert {a["name"]: a["input"]["format"] for a in bundle["artifacts"]} == dict.fromkeys(
        (a["name"] for a in bundle["artifacts"]), "uint8-nhwc"
    )


def test_the_jetson_app_feeds_a_uint8_bundle_bytes_and_agrees_with_eager(uint8_build, digits_model):
    """The reference Jetson app on the uint8-nhwc bundle: its golden check passes, and on digit photos it names the
    class eager names on torchvision's transform of them."""
    from exporter import weights

    from .test_bundle import _app

    out, _ = uint8_build
    if not (out / "bundle" / "jetson").is_dir():
        assert run_cli("bundle", out).exit_code == 0
    directory = out / "bundle" / "jetson"
    checked = _app(directory, "--golden")
    assert checked.returncode == 0 and "PASSED" in checked.stdout, checked.stdout + checked.stderr
    loaded = weights.load(digits_model.weight, digits_model.checkpoint, verify=False)
    labels = (directory / "labels.txt").read_text().splitlines()
    photos = [p for p in sorted(digits_model.data_dir.rglob("*.png"))][::97][:4]
    for photo in photos:
        result = _app(directory, photo)
        assert result.returncode == 0, result.stdout + result.stderr
        with Image.open(photo) as image, torch.no_grad():
            eager = loaded.eager(loaded.weights.transforms()(image.convert("RGB"))[None])
        app_top1 = result.stdout.splitlines()[2].split(maxsplit=1)[1]
        assert app_top1 == labels[int(eager.argmax())], (photo, result.stdout)


def test_exporter_validate_judges_a_uint8_build_again_on_its_bytes(uint8_build, tmp_path):
    """`exporter validate` reads the input format from the manifest: the ONNX files are fed bytes again and pass with
    the same fidelity (a float feed would not even run on a uint8 input)."""
    import shutil

    out, _ = uint8_build
    again = tmp_path / "jetson"
    shutil.copytree(out / "jetson", again)
    before = json.loads((again / "manifest.json").read_text())
    result = run_cli("validate", again, "--quiet")
    assert result.exit_code == 0, result.output
    after = json.loads((again / "manifest.json").read_text())
    assert after["target"]["input"] == {"format": "uint8-nhwc"}
    for first, second in zip(before["artifacts"], after["artifacts"]):
        if first.get("path"):
            assert second["status"] == "passed" and second["input"] == first["input"]
            assert second["fidelity"]["psnr_db"] == pytest.approx(first["fidelity"]["psnr_db"], rel=1e-6)


def test_a_video_weight_with_uint8_input_is_refused_before_it_writes(tmp_path):
    out = tmp_path / "out"
    result = run_cli("build", "R3D_18_Weights.KINETICS400_V1", "--input-format", "uint8-nhwc", "--out", out)
    assert_clean_refusal(result, out, "--input-format uint8-nhwc: a video classifier takes clips")


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            lambda t: ["--target", _profile(t, '[input]\nformat = "rgb"\n')],
            "[input]: format must be one of float32-nchw, uint8-nhwc, got 'rgb'",
        ),
        (lambda t: ["--target", _profile(t, "[input]\nlayout = 1\n")], "[input]: unknown key(s) layout"),
    ],
)
def test_a_bad_input_format_is_refused_in_one_line(tmp_path, digits_model, args, needle):
    out = tmp_path / "out"
    result = run_cli(
        "build", digits_model.weight, "--checkpoint", digits_model.checkpoint, "--out", out, *args(tmp_path)
    )
    assert_clean_refusal(result, out, needle)


def test_an_unknown_input_format_on_the_command_line_is_a_usage_error(tmp_path, digits_model):
    """click's own refusal (as for every option with choices): exit 2, the choices named, nothing written."""
    out = tmp_path / "out"
    result = run_cli("build", digits_model.weight, "--input-format", "uint8-nchw", "--out", out)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "'uint8-nchw' is not one of 'float32-nchw', 'uint8-nhwc'" in result.stderr
    assert not out.exists()


def _profile(tmp_path, extra: str):
    path = tmp_path / "u8.toml"
    path.write_text('name = "u8"\n[[artifacts]]\nformat = "onnx"\nprecision = "fp32"\n' + extra)
    return path


def assert_uint8_build_passes(out, result, formats: set[str]) -> None:
    """Every artifact of a uint8-nhwc build (a target per directory) passed, fed the bytes it records it takes."""
    assert result.exit_code == 0, result.output
    seen = set()
    for path in [out / "manifest.json"] if (out / "manifest.json").is_file() else out.glob("*/manifest.json"):
        doc = json.loads(path.read_text())
        for artifact in doc["artifacts"]:
            seen.add(artifact["name"])
            assert artifact["status"] == "passed", (artifact["name"], artifact["reasons"])
            assert artifact["input"]["format"] == "uint8-nhwc"
            assert artifact["input"]["shape"] == [1, *doc["task"]["input_size"], 3]
        if doc["target"]["name"] == "jetson":  # device_validate.py fed the golden bytes
            assert_device_reproduces_the_build(path.parent)
    assert seen == formats


def test_the_android_app_reads_the_uint8_golden_program_and_feeds_each_artifact_what_it_takes(
    uint8_build, android_app_code, tmp_path
):
    """The app's own code, compiled (tests/kotlin_app.py): its .bpte reader gives the uint8 inputs, float outputs
    and program the exporter's reader gives, and bundle.json makes it feed every artifact bytes."""
    from exporter.formats import bundled_program

    from . import kotlin_app

    out, _ = uint8_build
    (bpte,) = (out / "android").glob("*.bpte")
    theirs = bundled_program.read(bpte.read_bytes())
    mine = kotlin_app.read_bpte(android_app_code, bpte, tmp_path / "bpte")
    assert (mine["version"], mine["method"], mine["program"]) == (
        theirs["version"],
        theirs["method"],
        theirs["program"],
    )
    assert len(mine["cases"]) == len(theirs["cases"]) > 0
    for a, b in zip(mine["cases"], theirs["cases"]):
        for role in ("inputs", "expected"):
            assert [x.dtype for x in a[role]] == [x.dtype for x in b[role]]
            assert all(np.array_equal(x, y) for x, y in zip(a[role], b[role], strict=True))
    assert theirs["cases"][0]["inputs"][0].dtype == np.uint8
    if not (out / "bundle" / "android").is_dir():
        assert run_cli("bundle", out).exit_code == 0
    bundle = json.loads((out / "bundle" / "android" / "bundle.json").read_text())
    fed = kotlin_app.takes(android_app_code, bundle, tmp_path / "takes")
    assert fed == {a["name"]: "uint8" for a in bundle["artifacts"]}
