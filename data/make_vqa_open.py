"""Generate the embedded open VQA data set: synthetic shape scenes with free-form questions a judge grades.

``python data/make_vqa_open.py`` rewrites ``data/vqa_open/{train,test}.jsonl`` and the PNGs under
``data/vqa_open/images/``. Everything follows from two fixed seeds, so the files are reproducible.

A scene is a 112x112 RGB image of flat shapes (circle / square / triangle; red / green / blue / yellow /
purple). Each scene asks one of four open questions, in turn (scene i asks KINDS[i % 4]), whose answer is free
text no rule can check, so the task scores it with a served judge against several reference phrasings:
  ``odd_one_out``  "What is unusual in this picture?": 4-6 shapes alike but one, which differs in colour or in
                   shape ("one circle is red while the others are blue");
  ``middle``       "Describe the object in the middle.": one large shape in the centre, small ones at the corners;
  ``in_common``    "What do the shapes have in common?": 3-5 shapes of one colour and different shapes, or of
                   one shape and different colours (the other attribute always varies, so one answer fits);
  ``background``   "What is the background like?": a plain colour, stripes or a checkerboard behind 1-2 shapes.
Every other kind draws on a plain near-white background.

One JSONL row per scene (``kind`` is extra: the loader keeps it in ``meta``)::

    {"id": "train_00000", "image": "images/train_00000.png", "question": "What is unusual in this picture?",
     "references": ["the red circle", "one circle is red while the others are blue", "a red circle among blue
     circles"], "thought": "there are 4 blue circles and 1 red circle", "kind": "odd_one_out"}
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw

IMAGE_SIZE = 112
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 90, 215),
    "yellow": (235, 190, 20),
    "purple": (130, 50, 170),
}
# Background patterns of the "background" question: (name, colour names and RGB of its two tones).
PLAIN_BACKGROUNDS = {
    "light grey": (205, 205, 205),
    "pale yellow": (250, 238, 180),
    "light blue": (195, 220, 250),
}
PATTERN_TONES = {
    "grey and white": ((170, 170, 170), (250, 250, 250)),
    "pink and white": ((245, 180, 200), (250, 250, 250)),
}
PATTERNS = ("plain", "horizontal stripes", "vertical stripes", "checkerboard")
STRIPE = 8  # pixels per stripe or checkerboard square

KINDS = ("odd_one_out", "middle", "in_common", "background")
QUESTIONS = {
    "odd_one_out": "What is unusual in this picture?",
    "middle": "Describe the object in the middle.",
    "in_common": "What do the shapes have in common?",
    "background": "What is the background like?",
}

# Layout: shapes keep this far from the border and from each other (non-overlapping drawing squares).
BORDER = 4
GAP = 4
PLACEMENT_TRIES = 200

SPLIT_SIZES_AND_SEEDS = {"train": (64, 20250301), "test": (24, 20250302)}

Shape = tuple[str, str, int, int, int]  # shape, colour name, x, y (top-left of its drawing square), side


def plural(shape: str) -> str:
    return f"{shape}s"


def listed(items: Sequence[str]) -> str:
    """The items joined as in "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    kind, colour, x, y, side = shape
    last_x, last_y = x + side - 1, y + side - 1
    fill = COLOURS[colour]
    if kind == "circle":
        draw.ellipse((x, y, last_x, last_y), fill=fill)
    elif kind == "square":
        draw.rectangle((x, y, last_x, last_y), fill=fill)
    else:  # triangle, apex up
        draw.polygon([(x, last_y), (last_x, last_y), ((x + last_x) / 2, y)], fill=fill)


def _fits(x: int, y: int, side: int, placed: Sequence[tuple[int, int, int]]) -> bool:
    return all(
        x + side + GAP <= px or px + pside + GAP <= x or y + side + GAP <= py or py + pside + GAP <= y
        for px, py, pside in placed
    )


def _place(
    rng: random.Random, sides: Sequence[int], placed: Sequence[tuple[int, int, int]] = ()
) -> list[tuple[int, int]] | None:
    """Top-left corners for squares of ``sides`` clear of ``placed`` and of each other, or None when packing fails."""
    taken = list(placed)
    corners = []
    for side in sides:
        for _ in range(PLACEMENT_TRIES):
            x = rng.randint(BORDER, IMAGE_SIZE - BORDER - side)
            y = rng.randint(BORDER, IMAGE_SIZE - BORDER - side)
            if _fits(x, y, side, taken):
                taken.append((x, y, side))
                corners.append((x, y))
                break
        else:
            return None
    return corners


def _scattered(rng: random.Random, attributes: Sequence[tuple[str, str]], low: int, high: int) -> list[Shape]:
    """``attributes`` (shape, colour) drawn at random places with sides in [low, high], placed again until they fit."""
    while True:
        sides = [rng.randint(low, high) for _ in attributes]
        corners = _place(rng, sides)
        if corners is not None:
            return [
                (s, c, x, y, side) for (s, c), (x, y), side in zip(attributes, corners, sides, strict=True)
            ]


def _plain(rng: random.Random) -> Image.Image:
    shade = rng.randint(240, 252)
    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (shade, shade, shade - rng.randint(0, 6)))


# ---------------------------------------------------------------------------------------------- the four kinds


def odd_one_out(rng: random.Random) -> tuple[Image.Image, list[Shape], list[str], str]:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    count = rng.randint(4, 6)
    if rng.random() < 0.5:  # one differs in colour
        odd_colour = rng.choice([c for c in COLOURS if c != colour])
        odd = (shape, odd_colour)
        references = [f"the {odd_colour} {shape}", f"one {shape} is {odd_colour} while the others are {colour}",
                      f"a {odd_colour} {shape} among {colour} {plural(shape)}"]  # fmt: skip
    else:  # one differs in shape
        odd_shape = rng.choice([s for s in SHAPES if s != shape])
        odd = (odd_shape, colour)
        references = [f"the {odd_shape}", f"one shape is a {odd_shape} while the others are {plural(shape)}",
                      f"a {colour} {odd_shape} among {colour} {plural(shape)}"]  # fmt: skip
    attributes = [(shape, colour)] * (count - 1) + [odd]
    rng.shuffle(attributes)
    thought = f"there are {count - 1} {colour} {plural(shape)} and 1 {odd[1]} {odd[0]}"
    return _plain(rng), _scattered(rng, attributes, 16, 22), references, thought


def middle(rng: random.Random) -> tuple[Image.Image, list[Shape], list[str], str]:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    side = rng.randint(38, 46)
    x = (IMAGE_SIZE - side) // 2 + rng.randint(-3, 3)
    y = (IMAGE_SIZE - side) // 2 + rng.randint(-3, 3)
    centre: Shape = (shape, colour, x, y, side)
    while True:  # small shapes around it, each of another shape or colour than the centre's
        others = [(rng.choice(SHAPES), rng.choice(list(COLOURS))) for _ in range(rng.randint(2, 4))]
        others = [o for o in others if o != (shape, colour)]
        sides = [rng.randint(10, 14) for _ in others]
        corners = _place(rng, sides, [(x, y, side)])
        if others and corners is not None:
            break
    shapes = [
        centre,
        *((s, c, cx, cy, sd) for (s, c), (cx, cy), sd in zip(others, corners, sides, strict=True)),
    ]
    references = [
        f"a large {colour} {shape}",
        f"a big {colour} {shape} in the centre",
        f"it is a {colour} {shape}",
    ]
    thought = f"in the centre there is a large {colour} {shape}, and {len(others)} small shapes lie around it"
    return _plain(rng), shapes, references, thought


def in_common(rng: random.Random) -> tuple[Image.Image, list[Shape], list[str], str]:
    count = rng.randint(3, 5)
    if rng.random() < 0.5:  # one colour, different shapes
        colour = rng.choice(list(COLOURS))
        kinds = [*rng.sample(SHAPES, 2), *(rng.choice(SHAPES) for _ in range(count - 2))]
        rng.shuffle(kinds)
        attributes = [(kind, colour) for kind in kinds]
        references = [f"they are all {colour}", f"every shape is {colour}", f"the same colour, {colour}"]
        thought = f"the shapes are {listed([f'a {colour} {kind}' for kind in kinds])}; every one is {colour}"
    else:  # one shape, different colours
        shape = rng.choice(SHAPES)
        colours = [*rng.sample(list(COLOURS), 2), *(rng.choice(list(COLOURS)) for _ in range(count - 2))]
        rng.shuffle(colours)
        attributes = [(shape, colour) for colour in colours]
        references = [f"they are all {plural(shape)}", f"every shape is a {shape}",
                      f"the same shape: {plural(shape)} of different colours"]  # fmt: skip
        thought = (
            f"the shapes are {listed([f'a {colour} {shape}' for colour in colours])}; every one is a {shape}"
        )
    return _plain(rng), _scattered(rng, attributes, 16, 28), references, thought


def background(rng: random.Random) -> tuple[Image.Image, list[Shape], list[str], str]:
    pattern = rng.choice(PATTERNS)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    if pattern == "plain":
        name, rgb = rng.choice(list(PLAIN_BACKGROUNDS.items()))
        image.paste(rgb, (0, 0, IMAGE_SIZE, IMAGE_SIZE))
        references = [
            f"plain {name}",
            f"a plain {name} background with no pattern",
            f"it is a uniform {name} colour",
        ]
        thought = f"behind the shapes the picture is one flat {name} colour"
    else:
        name, (dark, light) = rng.choice(list(PATTERN_TONES.items()))
        draw = ImageDraw.Draw(image)
        for row in range(0, IMAGE_SIZE, STRIPE):
            for column in range(0, IMAGE_SIZE, STRIPE):
                band = {"horizontal stripes": row, "vertical stripes": column}.get(pattern, row + column)
                tone = dark if band // STRIPE % 2 == 0 else light
                draw.rectangle((column, row, column + STRIPE - 1, row + STRIPE - 1), fill=tone)
        if pattern == "checkerboard":
            references = [f"a {name} checkerboard", f"a checkered pattern of {name} squares",
                          f"it looks like a chessboard in {name}"]  # fmt: skip
        else:
            direction = pattern.split()[0]
            references = [f"{name} {pattern}", f"the background has {direction} stripes of {name}",
                          f"{direction}ly striped in {name}"]  # fmt: skip
        thought = f"behind the shapes the picture is {references[0] if pattern == 'checkerboard' else f'covered in {references[0]}'}"
    attributes = [(rng.choice(SHAPES), rng.choice(list(COLOURS))) for _ in range(rng.randint(1, 2))]
    return image, _scattered(rng, attributes, 18, 26), references, thought


MAKERS = {"odd_one_out": odd_one_out, "middle": middle, "in_common": in_common, "background": background}


# ---------------------------------------------------------------------------------------------- writing


def generate(out_dir: Path, n: int, seed: int, split: str = "train") -> list[dict]:
    """Write ``n`` scenes' PNGs to ``out_dir/images/{split}_NNNNN.png`` and return their JSONL rows.

    Scene i depends only on ``seed`` and the scenes before it, so a smaller ``n`` gives a prefix.
    """
    rng = random.Random(seed)
    image_dir = Path(out_dir) / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        image, shapes, references, thought = MAKERS[kind](rng)
        draw = ImageDraw.Draw(image)
        for shape in shapes:
            _draw_shape(draw, shape)
        name = f"{split}_{i:05d}"
        image.save(image_dir / f"{name}.png", optimize=True)
        rows.append({"id": name, "image": f"images/{name}.png", "question": QUESTIONS[kind], "references": references,
                     "thought": thought, "kind": kind})  # fmt: skip
    return rows


def write_split(out_dir: Path, split: str, n: int, seed: int) -> list[dict]:
    """Regenerate one split: remove its old PNGs, write new ones and ``out_dir/{split}.jsonl``."""
    out_dir = Path(out_dir)
    for old in (out_dir / "images").glob(f"{split}_*.png"):
        old.unlink()
    rows = generate(out_dir, n, seed, split)
    with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "vqa_open")
    args = parser.parse_args(argv)
    for split, (n, seed) in SPLIT_SIZES_AND_SEEDS.items():
        rows = write_split(args.out_dir, split, n, seed)
        print(f"{split}: {len(rows)} scenes -> {args.out_dir}")


if __name__ == "__main__":
    main()
