"""A --data class folder is scored under the model's class its name says (data.class_names), not under its
position among the folders; a folder or image the build cannot trust is one line, exit 2, nothing written."""

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.models._meta import _IMAGENET_CATEGORIES
from torchvision.transforms.functional import pil_to_tensor

from exporter import data
from exporter.errors import UsageError
from exporter.release.report import scored_classes
from exporter.tasks import Classification
from exporter.data.class_names import imagenet_wnids

from .helpers import assert_clean_refusal, run_cli

IMAGENET = list(_IMAGENET_CATEGORIES)


def _colour(index: int) -> tuple[int, int, int]:
    """A colour that says which class an image was written for, so a test can tell it after the split."""
    return index % 256, index // 256, 77


def _imagefolder(root, folders: dict[str, int], per_folder: int = 2):
    """root/<folder>/<n>.png, every image of a folder in the colour of the class index it is meant to hold."""
    for folder, index in folders.items():
        (root / folder).mkdir(parents=True)
        for n in range(per_folder):
            Image.new("RGB", (6, 5), _colour(index)).save(root / folder / f"{n}.png")
    return root


def _pixel(image: Image.Image) -> torch.Tensor:
    return pil_to_tensor(image.resize((2, 2)))


def _written_for(inputs: data.Inputs) -> list[int]:
    """The class index each validation image's colour says it was written for."""
    red, green = inputs.validation[:, 0, 0, 0].tolist(), inputs.validation[:, 1, 0, 0].tolist()
    return [int(r) + 256 * int(g) for r, g in zip(red, green)]


def _load(root, num_classes: int, class_names=None, count: int = 6) -> data.Inputs:
    return data.from_imagefolder(root, _pixel, 0, count, 0, num_classes, class_names)


def test_the_wnid_table_is_imagenet_1k_in_torchvision_class_order():
    wnids = imagenet_wnids()
    assert len(wnids) == 1000 == len(set(wnids)) and list(wnids) == sorted(wnids)
    # torchvision's names for the classes these synsets are (WordNet: tench, goldfish, toilet tissue)
    for wnid, name in (("n01440764", "tench"), ("n01443537", "goldfish"), ("n15075141", "toilet tissue")):
        assert IMAGENET[wnids.index(wnid)] == name


def test_three_synset_folders_are_scored_under_their_true_imagenet_indices(tmp_path):
    folders = {"n01443537": 1, "n01484850": 2, "n15075141": 999}
    inputs = _load(_imagefolder(tmp_path, folders), 1000, IMAGENET)
    assert inputs.labels.tolist() == _written_for(inputs)
    assert sorted(set(inputs.labels.tolist())) == [1, 2, 999]
    assert inputs.description["class_folders"] == folders
    golden = Classification(1000, (2, 2)).golden(inputs.validation, torch.zeros(6, 1000), inputs.labels)
    assert golden["labels.json"] == _written_for(inputs)  # golden/labels.json: the true indices


def test_category_name_folders_and_a_labels_file_of_names(tmp_path):
    imagenet = _load(_imagefolder(tmp_path / "a", {"goldfish": 1, "tench": 0, "toilet tissue": 999}), 1000, IMAGENET)
    assert imagenet.labels.tolist() == _written_for(imagenet)
    own = _load(_imagefolder(tmp_path / "b", {"bird": 2, "cat": 0}), 3, ["cat", "dog", "bird"], count=4)
    assert own.labels.tolist() == _written_for(own) and set(own.labels.tolist()) == {0, 2}
    assert own.classes == ["cat", "bird"]  # in class-index order


def test_integer_folders_keep_their_index_whatever_folders_are_missing(tmp_path):
    only_three = _load(_imagefolder(tmp_path / "a", {"3": 3}), 10, count=2)
    assert only_three.labels.tolist() == [3, 3]  # by position it was 0
    no_zero = _load(_imagefolder(tmp_path / "b", {"1": 1, "2": 2}), 10, count=4)
    assert no_zero.labels.tolist() == _written_for(no_zero) and set(no_zero.labels.tolist()) == {1, 2}
    past_nine = _load(_imagefolder(tmp_path / "c", {"2": 2, "10": 10}), 12, count=4)  # "10" sorts before "2"
    assert past_nine.labels.tolist() == _written_for(past_nine)


def test_a_folder_holding_no_image_is_no_class_folder(tmp_path):
    root = _imagefolder(tmp_path, {"4": 4})
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not an image")
    inputs = _load(root, 10, count=2)
    assert inputs.labels.tolist() == [4, 4] and inputs.description["class_folders"] == {"4": 4}


def test_an_integer_label_that_is_its_own_index_is_no_ambiguity(tmp_path):
    names = [str(i) for i in range(10)]
    inputs = _load(_imagefolder(tmp_path, {"7": 7}), 10, names, count=2)
    assert inputs.labels.tolist() == [7, 7]


def test_the_report_says_how_many_classes_were_scored(tmp_path):
    inputs = _load(_imagefolder(tmp_path, {"n01443537": 1, "n15075141": 999}), 1000, IMAGENET, count=4)
    assert inputs.description["scored_classes"] == 2 and inputs.description["model_classes"] == 1000
    assert "2 of the model's 1000 classes scored" in scored_classes(inputs.description)
    assert scored_classes({"source": "synthetic", "labeled": False}) == ""


@pytest.mark.parametrize(
    "folders, names, num_classes, needles",
    [
        ({"n01443537": 1, "Goldfish": 0, "n99999999": 0}, IMAGENET, 1000, ["'Goldfish', 'n99999999'", "wnid"]),
        ({"0": 0, "10": 0}, None, 10, ["folder '10' names no class", "0..9", "--labels"]),
        ({"1": 1, "goldfish": 1, "n01443537": 1}, IMAGENET, 1000, ["'1', 'goldfish', 'n01443537'", "class 1"]),
        ({"3": 3}, ["3", "x", "y", "z"], 4, ["'3' is ambiguous", "class 0", "class 3"]),
        ({"crane": 0}, ["crane", "crane", "heron"], 3, ["'crane' is ambiguous", "class 0", "class 1"]),
        ({"cat": 0}, ["cat", "dog"], 3, ["2 classes", "3 outputs"]),
    ],
    ids=["unknown", "index-past-the-classes", "one-class-three-folders", "label-not-its-index", "label-twice", "count"],
)
def test_a_folder_set_that_cannot_be_read_by_name_is_refused_naming_it(tmp_path, folders, names, num_classes, needles):
    root = _imagefolder(tmp_path, folders)
    with pytest.raises(UsageError) as refused:
        _load(root, num_classes, names)
    message = str(refused.value)
    assert "\n" not in message and all(needle in message for needle in needles), message


def test_clip_folders_are_read_by_name_too(tmp_path):
    for folder, index in {"5": 5, "dog": 1}.items():
        for clip in ("a", "b"):
            (tmp_path / folder / clip).mkdir(parents=True)
            for frame in range(2):
                Image.new("RGB", (6, 5), _colour(index)).save(tmp_path / folder / clip / f"{frame}.png")
    frames = lambda images: torch.stack([_pixel(image) for image in images], 1)  # noqa: E731 - (3, T, H, W)
    names = ["cat", "dog", "bird", "3", "4", "5"]
    inputs = data.from_clipfolder(tmp_path, frames, 0, 4, 0, 6, names)
    assert inputs.labels.tolist() == [int(r) for r in inputs.validation[:, 0, 0, 0, 0].tolist()]
    assert set(inputs.labels.tolist()) == {1, 5}
    with pytest.raises(UsageError, match="folder 'dog' names no class"):
        data.from_clipfolder(tmp_path, frames, 0, 4, 0, 6, None)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header says width x height (1-bit grey): Pillow judges the size on open."""
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IEND", b"")


def _png_with_a_broken_chunk() -> bytes:
    """A PNG whose image data runs on into a chunk of no valid type: Pillow raises SyntaxError while decoding."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buf, "PNG")
    good = buf.getvalue()
    at = good.index(b"IDAT") - 4
    (size,) = struct.unpack(">I", good[at : at + 4])
    pixels, half = good[at + 8 : at + 8 + size], size // 2
    broken = struct.pack(">I", size - half) + b"\x18\xc6\xc5\x1f" + pixels[half:] + bytes(4)
    return good[:at] + _chunk(b"IDAT", pixels[:half]) + broken + _chunk(b"IEND", b"")


HOSTILE = {
    "bomb.png": (_png_claiming(15000, 15000), Image.DecompressionBombError),
    "broken.png": (_png_with_a_broken_chunk(), SyntaxError),
    "header.ppm": (b"P6\n4 a4\n255\n" + bytes(48), ValueError),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_an_image_pillow_refuses_with_more_than_oserror_is_one_line_naming_it(tmp_path, name):
    content, raised = HOSTILE[name]
    with pytest.raises(raised):  # the case is what it says: Pillow raises this, and it is no OSError
        Image.open(io.BytesIO(content)).convert("RGB")
    assert not issubclass(raised, OSError)
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / name).write_bytes(content)
    with pytest.raises(UsageError, match=f"cannot read image {tmp_path / '3' / name}: ") as refused:
        _load(tmp_path, 10, count=1)
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def imagenet_checkpoint(tmp_path_factory):
    """An untrained MobileNetV3-Small with ImageNet's 1000 outputs: a build's load steps, without training."""
    from torchvision.models import mobilenet_v3_small

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("checkpoint") / "mobilenet_v3_small.pth"
    torch.save(mobilenet_v3_small().state_dict(), path)
    return path


@pytest.mark.parametrize(
    "folder, image, needles",
    [
        ("mystery", None, ["folder 'mystery' names no class", "ImageNet-1K wnid"]),
        ("n01443537", _png_claiming(15000, 15000), ["cannot read image", "bomb.png", "exceeds limit"]),
    ],
    ids=["unknown-folder", "decompression-bomb"],
)
def test_the_build_refuses_in_one_line_exit_2_and_writes_nothing(tmp_path, imagenet_checkpoint, folder, image, needles):
    root = tmp_path / "data"
    rgb = np.full((5, 6, 3), 90, np.uint8)
    for wnid in ("n01440764", folder):
        (root / wnid).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb).save(root / wnid / "0.png")
    if image is not None:
        (root / folder / "bomb.png").write_bytes(image)
    out = tmp_path / "out"
    weight = "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    args = ["--checkpoint", imagenet_checkpoint, "--no-verify", "--data", root, "--target", "jetson"]
    result = run_cli("build", weight, *args, "--format", "onnx", "--calib-size", "2", "--val-size", "2", "--out", out)
    assert_clean_refusal(result, out, *needles)
