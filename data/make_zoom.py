"""Generate the embedded zoom data set: a colour that cannot be read at the model's resolution, only in a crop.

``python data/make_zoom.py`` rewrites ``data/zoom/{train,test}.jsonl`` and the PNGs under ``data/zoom/images/``.
Everything follows from two fixed seeds, so the files are reproducible; ``--check`` only measures the committed
splits (``legibility`` below) and prints the worst scene of each.

A scene is a 672x672 RGB image: a light background with grey clutter (thin lines and rings), ONE frame (a dark
square outline FRAME_STROKE px thick, FRAME_SIDES px wide) and inside it one small filled shape (TARGET_SIDES px;
circle / square / triangle) in one of the grounding generator's colours (``make_grounding.COLOURS``: red, green,
blue, yellow). Outside the frame lie small shapes of the same sizes and colours, as many of each colour as makes
every colour's count in the scene (the target included) equal: the count and area of each colour in the image
say nothing about which one is in the frame. Question: "What colour is the small shape inside the frame?";
answer: the colour word.

Why these sizes: the embedded model's processor shrinks every image to at most 28,224 pixels (168x168; 14-px
patches merged 2x2, 28 px a token), a 4x downscale of these scenes. The frame (112 px, 8-px stroke, at the centre of one of nine grid cells) stays a
clear 22-32 px outline there; the target (10-16 px) becomes a 2-4 px speck, under 2% of the frame's interior and
of a token, whose colour is diluted into the background (``legibility``: the mean colour of the frame's interior
at 168x168 is far from the target's colour: it carries under 6% of it). Not erased: the speck keeps a pixel or four of nearly its own colour,
which a reader of single pixels could still name (``legibility``'s ``low_res_nearest``). A zoom on the frame (a crop of about 130 px, which the processor
takes at its own resolution) shows the shape 10-16 px wide, a solid patch of its colour.

One JSONL row per scene (the fields the zoom task's loader reads, plus ``shape`` and ``distractors``)::

    {"id": "train_00012", "image": "images/train_00012.png", "question": "What colour is the small shape inside
     the frame?", "answer": "red", "width": 672, "height": 672, "frame_box": [x1, y1, x2, y2],
     "target_box": [x1, y1, x2, y2], "shape": "circle", "distractors": 15}

Boxes are tight integer pixel-edge boxes in original pixels (pixels x1..x2-1, y1..y2-1): the frame's outer edge,
and the target measured from its rendered mask.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def _sibling(name: str):
    """The generator module ``data/{name}.py`` (this folder is no package), imported once under its own name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


_grounding = _sibling("make_grounding")
COLOURS: dict[str, tuple[int, int, int]] = _grounding.COLOURS  # one colour list for the generated sets
SHAPES: tuple[str, ...] = _grounding.SHAPES

IMAGE_SIZE = 672
MODEL_SIDE = 168  # the side the embedded model sees a square image at (28,224 pixels at most)
QUESTION = "What colour is the small shape inside the frame?"

FRAME_SIDES = (112, 112)  # outer side, inclusive range
# The frame sits at the centre of one cell of a 3 x 3 grid (nine places, as the grounding scenes' "top left" ...
# "bottom right"): finding it is a choice among nine for the embedded model, reading the colour is the zoom's job
GRID = 3
FRAME_STROKE = 8  # 2 px at 168x168: a clear outline at the model's resolution
FRAME_COLOUR = (45, 45, 55)
TARGET_SIDES = (10, 16)  # the target's and the distractors' sides, inclusive range
# Every colour appears this many times in a scene (the target included): 3-5 each, so 11-19 distractors
COLOUR_COUNTS = (3, 5)

BORDER = 6  # shapes keep this far from the image border,
GAP = 8  # from each other and from the frame's outer edge
TARGET_MARGIN = 6  # the target keeps this far from the frame's stroke
PLACEMENT_TRIES = 200
CLUTTER_LINES = (6, 12)
CLUTTER_RINGS = (3, 6)

# legibility thresholds: what `--check` and the tests hold every scene to
# at most this share of the target's colour in the 168x168 interior's mean: a 10-16 px target in a 96 px
# interior is 1-5% of it; a 30 px one would be 7% or more
MAX_LOW_RES_SHARE = 0.06
MIN_CROP_PIXELS = 50  # pixels within CROP_COLOUR_TOLERANCE of the target's colour in the crop of the frame
CROP_COLOUR_TOLERANCE = 40.0

SPLIT_SIZES_AND_SEEDS = {"train": (400, 20250101), "test": (100, 20250202)}

Box = tuple[int, int, int, int]


def _shape_mask(shape: str, side: int) -> Image.Image:
    """A ``side`` x ``side`` binary mask of one shape filling its square (triangle: apex up)."""
    mask = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(mask)
    last = side - 1
    if shape == "circle":
        draw.ellipse((0, 0, last, last), fill=255)
    elif shape == "square":
        draw.rectangle((0, 0, last, last), fill=255)
    else:
        draw.polygon([(0, last), (last, last), (last / 2, 0)], fill=255)
    return mask


def _apart(box: Box, others: Sequence[Box], gap: int) -> bool:
    return all(
        box[2] + gap <= o[0] or o[2] + gap <= box[0] or box[3] + gap <= o[1] or o[3] + gap <= box[1]
        for o in others
    )


def _clutter(image: Image.Image, rng: random.Random, shade: int) -> None:
    """Thin grey lines and rings: structure a reader has to look past, in no colour a target has."""
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(*CLUTTER_LINES)):
        grey = shade - rng.randint(25, 50)
        points = [(rng.randint(0, IMAGE_SIZE), rng.randint(0, IMAGE_SIZE)) for _ in range(2)]
        draw.line(points, fill=(grey, grey, grey), width=rng.randint(1, 3))
    for _ in range(rng.randint(*CLUTTER_RINGS)):
        grey = shade - rng.randint(25, 50)
        radius = rng.randint(20, 90)
        x, y = rng.randint(0, IMAGE_SIZE), rng.randint(0, IMAGE_SIZE)
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), outline=(grey, grey, grey), width=2)


def make_scene(rng: random.Random) -> tuple[Image.Image, dict]:
    """One scene: (image, row fields without id/image). Draws again until every shape finds a place."""
    while True:
        shade = rng.randint(228, 248)
        image = Image.new(
            "RGB", (IMAGE_SIZE, IMAGE_SIZE), (shade, shade - rng.randint(0, 6), shade - rng.randint(0, 8))
        )
        _clutter(image, rng, shade)
        side = rng.randint(*FRAME_SIDES)
        cell = IMAGE_SIZE // GRID
        fx, fy = (rng.randrange(GRID) * cell + (cell - side) // 2, rng.randrange(GRID) * cell + (cell - side) // 2)
        frame: Box = (fx, fy, fx + side, fy + side)
        colour = rng.choice(list(COLOURS))
        per_colour = rng.randint(*COLOUR_COUNTS)
        others = [c for c in COLOURS for _ in range(per_colour - (c == colour))]
        rng.shuffle(others)
        # the target: anywhere in the frame's interior, TARGET_MARGIN from the stroke
        target_side = rng.randint(*TARGET_SIDES)
        low, high = FRAME_STROKE + TARGET_MARGIN, side - FRAME_STROKE - TARGET_MARGIN - target_side
        tx, ty = fx + rng.randint(low, high), fy + rng.randint(low, high)
        target_shape = rng.choice(SHAPES)
        placed: list[Box] = [frame]
        drawn: list[tuple[str, str, Box]] = []
        for other in others:
            other_side = rng.randint(*TARGET_SIDES)
            for _ in range(PLACEMENT_TRIES):
                x = rng.randint(BORDER, IMAGE_SIZE - BORDER - other_side)
                y = rng.randint(BORDER, IMAGE_SIZE - BORDER - other_side)
                box = (x, y, x + other_side, y + other_side)
                if _apart(box, placed, GAP):
                    placed.append(box)
                    drawn.append((rng.choice(SHAPES), other, box))
                    break
            else:
                break
        if len(drawn) < len(others):
            continue
        pen = ImageDraw.Draw(image)
        # clutter runs through the frame's inside too: the frame is not the one plain region of the scene
        pen.rectangle((fx, fy, fx + side - 1, fy + side - 1), outline=FRAME_COLOUR, width=FRAME_STROKE)
        for shape, name, box in drawn:
            image.paste(COLOURS[name], box[:2], _shape_mask(shape, box[2] - box[0]))
        mask = _shape_mask(target_shape, target_side)
        image.paste(COLOURS[colour], (tx, ty), mask)
        bx1, by1, bx2, by2 = mask.getbbox()
        fields = {
            "question": QUESTION,
            "answer": colour,
            "width": IMAGE_SIZE,
            "height": IMAGE_SIZE,
            "frame_box": list(frame),
            "frame_place": _grounding.region(frame, IMAGE_SIZE, IMAGE_SIZE),
            "target_box": [tx + bx1, ty + by1, tx + bx2, ty + by2],
            "shape": target_shape,
            "distractors": len(drawn),
        }
        return image, fields


def _chroma(rgb: np.ndarray) -> np.ndarray:
    """A colour less its grey part (each channel less the channels' mean): greys (the frame, the clutter) are 0."""
    return rgb - rgb.mean(axis=-1, keepdims=True)


def legibility(image: Image.Image, frame_box: Sequence[int], colour: str) -> dict[str, float]:
    """How readable the target's colour is, at the model's resolution and in a crop of the frame.

    ``low_res_share``: how much of the target's colour the mean of the frame's interior carries once the image
    is shrunk to MODEL_SIDE (bicubic, as the processor shrinks it): 0 for the background's colour, 1 for the
    target's; measured on the colours' chroma (less their grey part), so the clutter's greys count as background
    and the share is about the target's area over the interior's. Small means the mean colour is far from the
    target's: what a token of the frame's inside carries is diluted away. ``low_res_nearest``: the RGB distance of
    the interior's closest pixel at that size to the target's colour, reported and not required: a 10-16 px shape
    leaves a 2-4 px speck of nearly its own colour, which a reader of single pixels could still name.
    ``crop_pixels``: pixels of the crop of ``frame_box`` (at its own resolution: the crop is under the
    processor's budget) within CROP_COLOUR_TOLERANCE of the target's colour: a solid patch to read."""
    rgb = image.convert("RGB")
    target = np.array(COLOURS[colour], dtype=np.float64)
    background = np.array(
        max(rgb.getcolors(IMAGE_SIZE * IMAGE_SIZE))[1], dtype=np.float64
    )  # the commonest colour
    scale = MODEL_SIDE / rgb.width
    small = rgb.resize((MODEL_SIDE, round(rgb.height * scale)), Image.BICUBIC)
    inner = [
        round((v + sign * FRAME_STROKE) * scale) for v, sign in zip(frame_box, (1, 1, -1, -1), strict=True)
    ]
    interior = np.asarray(small.crop(tuple(inner)), dtype=np.float64).reshape(-1, 3)
    direction = _chroma(target) - _chroma(background)
    share = (_chroma(interior.mean(axis=0)) - _chroma(background)) @ direction / (direction @ direction)
    crop = np.asarray(rgb.crop(tuple(frame_box)), dtype=np.float64).reshape(-1, 3)
    return {
        "low_res_share": float(share),
        "low_res_nearest": float(np.linalg.norm(interior - target, axis=1).min()),
        "crop_pixels": float((np.linalg.norm(crop - target, axis=1) <= CROP_COLOUR_TOLERANCE).sum()),
    }


def _save_png(image: Image.Image, path: Path) -> None:
    """A palette PNG when that is lossless (a scene holds a few dozen flat colours: nothing is antialiased), about
    a third of the RGB file's size; RGB otherwise."""
    paletted = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    exact = image.getcolors(256) is not None and paletted.convert("RGB").tobytes() == image.tobytes()
    (paletted if exact else image).save(path, optimize=True)


def generate(out_dir: Path, n: int, seed: int, split: str = "train") -> list[dict]:
    """Write ``n`` scenes' PNGs to ``out_dir/images/{split}_NNNNN.png`` and return their JSONL rows.

    Scene i depends only on ``seed`` and the scenes before it, so a smaller ``n`` gives a prefix."""
    rng = random.Random(seed)
    image_dir = Path(out_dir) / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        image, fields = make_scene(rng)
        name = f"{split}_{i:05d}"
        _save_png(image, image_dir / f"{name}.png")
        rows.append({"id": name, "image": f"images/{name}.png", **fields})
    return rows


def write_split(out_dir: Path, split: str, n: int, seed: int) -> list[dict]:
    """Regenerate one split: remove its old PNGs, write new ones and ``out_dir/{split}.jsonl`` (the grounding
    generator's writer, with these scenes)."""
    return _grounding.write_split(out_dir, split, n, seed, generate_rows=generate)


def check_split(out_dir: Path, split: str) -> dict[str, float]:
    """The worst legibility over a written split: the largest share, the fewest crop pixels, the nearest pixel."""
    worst = {"low_res_share": -float("inf"), "low_res_nearest": float("inf"), "crop_pixels": float("inf")}
    for line in (Path(out_dir) / f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        with Image.open(Path(out_dir) / row["image"]) as image:
            measured = legibility(image, row["frame_box"], row["answer"])
        worst = {key: (max if key == "low_res_share" else min)(worst[key], measured[key]) for key in worst}
    return worst


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "zoom")
    parser.add_argument("--check", action="store_true", help="only measure the written splits' legibility")
    args = parser.parse_args(argv)
    for split, (n, seed) in SPLIT_SIZES_AND_SEEDS.items():
        if not args.check:
            rows = write_split(args.out_dir, split, n, seed)
            colours = {colour: sum(row["answer"] == colour for row in rows) for colour in COLOURS}
            print(f"{split}: {len(rows)} scenes {colours} -> {args.out_dir}")
        worst = check_split(args.out_dir, split)
        ok = worst["low_res_share"] <= MAX_LOW_RES_SHARE and worst["crop_pixels"] >= MIN_CROP_PIXELS
        print(
            f"{split}: worst share of the colour in the {MODEL_SIDE}x{MODEL_SIDE} interior {worst['low_res_share']:.3f} "
            f"(need <= {MAX_LOW_RES_SHARE}), "
            f"worst crop pixels {worst['crop_pixels']:.0f} (need >= {MIN_CROP_PIXELS}): {'ok' if ok else 'FAILS'}; "
            f"closest single pixel at {MODEL_SIDE}x{MODEL_SIDE}: {worst['low_res_nearest']:.0f} from the colour"
        )


if __name__ == "__main__":
    main()
