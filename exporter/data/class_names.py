"""Which of the model's classes a --data class folder holds, read from the folder's name.

A folder name is read three ways, each giving a class index:
- a category name: exactly one of the labels in effect for the build (the weight's `meta["categories"]`, or the
  --labels file);
- an ImageNet-1K synset id (wnid, e.g. n01440764), when those labels are ImageNet-1K's 1000 categories: class i is
  line i of imagenet_wnids.txt, the 1000 wnids in sorted order, which is torchvision's class order;
- the class index itself, in decimal (0 ... N-1).

No reading outranks another: a folder whose readings name different classes (a label "3" that is class 0, a label
two classes share) is refused, as are a folder that names no class and two folders naming one class. Any precedence
would score a folder under the class its owner did not mean, and the build would still pass.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from ..errors import UsageError

WNIDS_FILE = Path(__file__).with_name("imagenet_wnids.txt")
IMAGENET_CLASSES = 1000
_SHOWN = 5  # folder names a refusal lists before "and N more"


@functools.cache
def imagenet_wnids() -> tuple[str, ...]:
    """The 1000 ImageNet-1K wnids, class i at position i (the file's '#' lines say where the table comes from)."""
    lines = WNIDS_FILE.read_text(encoding="ascii").splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))


@functools.cache
def _imagenet_categories() -> tuple[str, ...]:
    from torchvision.models._meta import _IMAGENET_CATEGORIES

    return tuple(_IMAGENET_CATEGORIES)


def unnamed(num_classes: int) -> list[str]:
    """The labels of a model whose classes have no names (exporter.weights.load's placeholders)."""
    return [f"class_{i}" for i in range(num_classes)]


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


class _Readings:
    """Every class index a folder name can stand for, by way of reading."""

    def __init__(self, class_names: Sequence[str]):
        self.class_names = list(class_names)
        self.by_name: dict[str, list[int]] = defaultdict(list)
        for index, name in enumerate(self.class_names):
            self.by_name[name].append(index)
        self.imagenet = len(self.class_names) == IMAGENET_CLASSES and tuple(self.class_names) == _imagenet_categories()
        self.by_wnid = {wnid: i for i, wnid in enumerate(imagenet_wnids())} if self.imagenet else {}

    def of(self, folder: str) -> dict[str, list[int]]:
        found = {}
        if folder in self.by_name:
            found["category name"] = self.by_name[folder]
        if folder in self.by_wnid:
            found["ImageNet wnid"] = [self.by_wnid[folder]]
        if folder.isascii() and folder.isdigit() and int(folder) < len(self.class_names):
            found["class index"] = [int(folder)]
        return found

    def accepted(self) -> str:
        n = len(self.class_names)
        ways = [f"a class index 0..{n - 1}"]
        if self.class_names == unnamed(n):
            return ways[0] + " (the model's classes have no names: --labels FILE names them)"
        ways.append(f"a category name of the model's labels (e.g. '{self.class_names[0]}')")
        if self.imagenet:
            ways.append(f"an ImageNet-1K wnid (e.g. {imagenet_wnids()[0]})")
        return ", ".join(ways[:-1]) + " or " + ways[-1]

    def named(self, index: int) -> str:
        return f"class {index} ('{self.class_names[index]}')"


def folder_classes(root: Path, folders: Sequence[str], class_names: Sequence[str], num_classes: int) -> dict[str, int]:
    """Folder name -> class index for every folder, in class-index order; a one-line refusal naming the folders
    when a folder names no class or several, or two name one class, or the labels do not fit the model's outputs."""
    if len(class_names) != num_classes:
        raise UsageError(
            f"--data {root}: the labels name {len(class_names)} classes but the model has {num_classes} outputs "
            "(--labels FILE: one name per output)"
        )
    readings = _Readings(class_names)
    chosen, unknown = {}, []
    for folder in folders:
        found = readings.of(folder)
        indices = sorted({i for way in found.values() for i in way})
        if not indices:
            unknown.append(folder)
        elif len(indices) > 1:
            how = "; ".join(
                f"as {way}: {', '.join(readings.named(i) for i in way_indices)}" for way, way_indices in found.items()
            )
            raise UsageError(
                f"--data {root}: folder '{folder}' is ambiguous ({how}); rename it to the class index it holds, or "
                "give --labels names that are unique and no other class's index"
            )
        else:
            chosen[folder] = indices[0]
    if unknown:
        raise UsageError(
            f"--data {root}: {'folder' if len(unknown) == 1 else 'folders'} {_listed(unknown)} "
            f"{'names' if len(unknown) == 1 else 'name'} no class of the model; a class folder's name is "
            f"{readings.accepted()}"
        )
    _refuse_shared(root, chosen, readings)
    return dict(sorted(chosen.items(), key=lambda item: item[1]))


def _refuse_shared(root: Path, chosen: dict[str, int], readings: _Readings) -> None:
    folders_of: dict[int, list[str]] = defaultdict(list)
    for folder, index in chosen.items():
        folders_of[index].append(folder)
    shared = {index: folders for index, folders in folders_of.items() if len(folders) > 1}
    if shared:
        index, folders = min(shared.items())
        raise UsageError(
            f"--data {root}: folders {_listed(folders)} name the same class, {readings.named(index)}; keep one "
            "folder per class" + (f" ({len(shared) - 1} more classes have several folders)" if len(shared) > 1 else "")
        )
