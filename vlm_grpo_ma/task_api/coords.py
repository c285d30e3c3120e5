"""The coordinate frame in which a model writes boxes and points, and the one conversion to image pixels.

Qwen2.5-VL was trained to write absolute pixel coordinates on the *resized* image it was given (sides
multiples of 28); Qwen2-VL and Qwen3-VL write coordinates relative to the image, scaled to 0-1000.
The frame is decided once per model (``loading.coordinate_frame_for``), recorded on every Completion, and
every reward and metric converts through the two functions here, so a box is never converted twice or
in two different ways.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum


class CoordinateFrame(str, Enum):
    ABSOLUTE_INPUT = "absolute_input"  # pixels on the resized image the model saw (Qwen2.5-VL)
    RELATIVE_1000 = "relative_1000"  # 0..1000 relative to the image sides (Qwen2-VL, Qwen3-VL)


Size = tuple[int, int]  # (width, height)


def _scales(frame: CoordinateFrame, input_size: Size, original_size: Size) -> tuple[float, float]:
    """Factors that take a model-frame x and y to original-image pixels."""
    frame = CoordinateFrame(frame)
    orig_w, orig_h = original_size
    if frame is CoordinateFrame.ABSOLUTE_INPUT:
        in_w, in_h = input_size
        return orig_w / in_w, orig_h / in_h
    return orig_w / 1000.0, orig_h / 1000.0


def to_original_pixels(
    values: Sequence[float], frame: CoordinateFrame, input_size: Size, original_size: Size
) -> list[float]:
    """Model-frame coordinates ``[x, y, x, y, ...]`` -> pixels of the original image.

    Non-finite values pass through unchanged (they become NaN/inf pixels), so callers decide how to score them.
    """
    if len(values) % 2:
        raise ValueError(f"coordinates come in (x, y) pairs, got {len(values)} values")
    sx, sy = _scales(frame, input_size, original_size)
    return [float(v) * (sx if i % 2 == 0 else sy) for i, v in enumerate(values)]


def from_original_pixels(
    values: Sequence[float], frame: CoordinateFrame, input_size: Size, original_size: Size
) -> list[float]:
    """Original-image pixels ``[x, y, x, y, ...]`` -> the model's frame (inverse of ``to_original_pixels``)."""
    if len(values) % 2:
        raise ValueError(f"coordinates come in (x, y) pairs, got {len(values)} values")
    sx, sy = _scales(frame, input_size, original_size)
    return [float(v) / (sx if i % 2 == 0 else sy) for i, v in enumerate(values)]


def is_finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)
