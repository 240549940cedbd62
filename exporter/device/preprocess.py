"""The resize (and crop) an app does before a build's artifacts, in numpy alone: what torchvision's transform does to a
PIL image, as preprocessing.json names it.

    pixels = resize_and_crop(rgb, preprocessing)   # H x W x 3 uint8 photo -> the input size, uint8
    x = normalized(pixels, preprocessing)          # for float32-nchw artifacts: 1 x 3 x H x W float32

A uint8-nhwc artifact takes `pixels[None]` as it is. torchvision resizes a PIL image with PIL's own resampling
(a separable filter scaled to the reduction, so it antialiases, in 22-bit fixed point, rounded to bytes after each
pass, in the order Pillow 13 takes them); this file computes the same integers, so its bytes are torchvision's (measured:
tests/test_preprocess_reference.py). An app's platform resize (Android's Bitmap.createScaledBitmap, Core Image) is
another filter; how far it lands from these bytes is the app's to measure, with this file as the reference.
"""

from __future__ import annotations

import math

import numpy as np

SHIPPED_AS = "preprocess.py"  # its name in a build and a bundle
PRECISION_BITS = 32 - 8 - 2  # PIL's fixed point for 8-bit images (libImaging/Resample.c)


def _bilinear(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _bicubic(x: np.ndarray) -> np.ndarray:
    a, x = -0.5, np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


FILTERS = {"bilinear": (_bilinear, 1.0), "bicubic": (_bicubic, 2.0)}  # name -> (filter, support)


def _coefficients(size_in: int, size_out: int, interpolation: str) -> tuple[np.ndarray, np.ndarray]:
    """Per output pixel, the first input pixel it reads and its fixed-point weights (out x taps, zero-padded)."""
    function, support = FILTERS[interpolation]
    scale = size_in / size_out
    filterscale = max(scale, 1.0)
    support *= filterscale
    taps = int(math.ceil(support)) * 2 + 1
    first = np.zeros(size_out, dtype=np.int64)
    weights = np.zeros((size_out, taps))
    for i in range(size_out):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size_in)
        w = function((np.arange(lo, hi) - center + 0.5) * (1.0 / filterscale))
        total = w.sum()
        first[i], weights[i, : hi - lo] = lo, w / total if total != 0.0 else w
    scaled = weights * (1 << PRECISION_BITS)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    return first, fixed


def _pass(image: np.ndarray, size_out: int, axis: int, interpolation: str) -> np.ndarray:
    """One separable pass along `axis` (0: rows, vertical; 1: columns, horizontal), rounded to bytes as PIL does."""
    size_in = image.shape[axis]
    first, fixed = _coefficients(size_in, size_out, interpolation)
    moved = np.moveaxis(image.astype(np.int64), axis, 0)  # size_in x other x channels
    padded = np.concatenate([moved, np.zeros((fixed.shape[1], *moved.shape[1:]), dtype=np.int64)])
    total = np.full((size_out, *moved.shape[1:]), 1 << (PRECISION_BITS - 1), dtype=np.int64)
    for tap in range(fixed.shape[1]):
        total += padded[first + tap] * fixed[:, tap, None, None]
    out = np.clip(total >> PRECISION_BITS, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize(rgb: np.ndarray, height: int, width: int, interpolation: str = "bilinear") -> np.ndarray:
    """`rgb` (H x W x 3 uint8) resized to height x width as PIL resizes it (antialiased)."""
    if interpolation not in FILTERS:
        raise ValueError(f"interpolation {interpolation!r}: this reference has {', '.join(FILTERS)}")
    image = np.asarray(rgb, dtype=np.uint8)
    shrink_h, shrink_w = image.shape[0] - height, image.shape[1] - width
    # Pillow 13 runs the vertical pass first when the height shrinks by more than twice what the width does (its
    # passes round to bytes in between, so the order shows in the last bit); earlier Pillows, always horizontal first
    order = (0, 1) if shrink_h > 0 and shrink_h > 2 * shrink_w else (1, 0)
    for axis in order:
        size = (height, width)[axis]
        if image.shape[axis] != size:
            image = _pass(image, size, axis, interpolation)
    return image


def resized_size(height: int, width: int, resize_size: list[int]) -> tuple[int, int]:
    """torchvision's output size: one number is the shorter side (the longer in proportion, rounded down)."""
    if len(resize_size) == 2:
        return int(resize_size[0]), int(resize_size[1])
    short, long = sorted((height, width))
    new_short, new_long = int(resize_size[0]), int(int(resize_size[0]) * long / short)
    return (new_long, new_short) if height > width else (new_short, new_long)


def center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    top, left = int(round((image.shape[0] - height) / 2.0)), int(round((image.shape[1] - width) / 2.0))
    if top < 0 or left < 0:
        raise ValueError(f"a {image.shape[0]}x{image.shape[1]} image is smaller than the {height}x{width} crop")
    return image[top : top + height, left : left + width]


def resize_and_crop(rgb: np.ndarray, preprocessing: dict) -> np.ndarray:
    """The app's step before every artifact: preprocessing.json's resize, then its crop (if any)."""
    height, width = resized_size(rgb.shape[0], rgb.shape[1], list(preprocessing["resize_size"]))
    image = resize(rgb, height, width, preprocessing["interpolation"])
    crop = preprocessing.get("crop_size")  # [side] or [height, width]
    return center_crop(image, crop[0], crop[-1]) if crop else image


def normalized(pixels: np.ndarray, preprocessing: dict) -> np.ndarray:
    """What a float32-nchw artifact takes for these pixels: / 255, mean/std, 1 x 3 x H x W."""
    mean = np.asarray(preprocessing["mean"], dtype=np.float32)
    std = np.asarray(preprocessing["std"], dtype=np.float32)
    x = (pixels.astype(np.float32) / np.float32(255) - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])
