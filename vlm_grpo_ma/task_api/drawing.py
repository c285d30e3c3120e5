"""Drawings of predictions against the truth, for ``Task.draw``: prediction in red, truth in green."""

from __future__ import annotations

from collections.abc import Sequence

from vlm_grpo_ma.task_api.parsing import order_corners

PREDICTION_COLOUR = (230, 40, 40)  # red: what the model said
TRUTH_COLOUR = (40, 200, 60)  # green: the ground truth


def draw_marks(
    image,
    *,
    boxes: Sequence[tuple[Sequence[float], tuple[int, int, int]]] = (),
    points: Sequence[tuple[Sequence[float], tuple[int, int, int]]] = (),
    min_side: int = 336,
):
    """A copy of ``image`` with ``(box, colour)`` rectangles and ``(point, colour)`` crosses drawn on it, in
    the image's pixel coordinates. Small images are upscaled (nearest) to ``min_side`` first so the marks are
    visible."""
    from PIL import ImageDraw

    scale = max(1.0, min_side / max(1, min(image.size)))
    canvas = image.convert("RGB").resize(
        (round(image.size[0] * scale), round(image.size[1] * scale)), resample=0
    )
    pen = ImageDraw.Draw(canvas)
    width = max(1, round(scale))
    for box, colour in boxes:
        x1, y1, x2, y2 = (v * scale for v in order_corners(box))
        pen.rectangle([x1, y1, x2, y2], outline=colour, width=width)
    arm = 3 * width
    for (x, y), colour in points:
        x, y = x * scale, y * scale
        pen.line([x - arm, y, x + arm, y], fill=colour, width=width)
        pen.line([x, y - arm, x, y + arm], fill=colour, width=width)
    return canvas


def with_legend(image, labels: Sequence[tuple[str, tuple[int, int, int]]] = (("prediction", PREDICTION_COLOUR), ("truth", TRUTH_COLOUR))):
    """``image`` with a strip below it that says what each colour marks (a swatch and its label each)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    height = 18
    canvas = Image.new("RGB", (image.width, image.height + height), (255, 255, 255))
    canvas.paste(image.convert("RGB"), (0, 0))
    pen = ImageDraw.Draw(canvas)
    x = 4
    for label, colour in labels:
        pen.rectangle([x, image.height + 4, x + 10, image.height + 14], fill=colour)
        pen.text((x + 14, image.height + 3), label, fill=(0, 0, 0), font=font)
        x += 14 + int(pen.textlength(label, font=font)) + 12
    return canvas
