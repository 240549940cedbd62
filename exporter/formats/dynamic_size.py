"""A graph exported for a dynamic height and width (a segmentation target's [input] size_range): the option's
`MIN:MAX`, and the input dims torch.export is told may vary, shared by the formats that take one."""

from __future__ import annotations

import torch

from ..errors import UsageError


def bounds(size_range) -> tuple[int, int] | None:
    """`MIN:MAX`, the sides of a graph with a dynamic height and width, or None (one size)."""
    if size_range is None:
        return None
    try:
        low, high = (int(v) for v in str(size_range).split(":"))
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise UsageError(f"size_range {size_range!r}: expected MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def input_dims(example: torch.Tensor, sides: tuple[int, int] | None) -> dict:
    """The input's height and width as torch.export dims within `sides` (dims 1 and 2 of a uint8 image, which is
    N x H x W x 3 by the uint8-nhwc contract; 2 and 3 of an N x C x H x W tensor); none for one size."""
    if not sides:
        return {}
    height, width = (1, 2) if example.dtype == torch.uint8 else (2, 3)
    return {
        height: torch.export.Dim("height", min=sides[0], max=sides[1]),
        width: torch.export.Dim("width", min=sides[0], max=sides[1]),
    }


def described(sides: tuple[int, int]) -> dict:
    """The artifact's `details.dynamic_size`."""
    return {"height": list(sides), "width": list(sides)}
