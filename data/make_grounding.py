"""Generate the embedded grounding data set: synthetic shape scenes with unique referring expressions.

``python data/make_grounding.py`` rewrites ``data/grounding/{train,test}.jsonl`` and the PNGs under
``data/grounding/images/``. Everything follows from two fixed seeds, so the files are reproducible.

A scene is a 168x168 RGB image on a light background (with a colour ramp, see RAMP) holding 2-4 non-overlapping flat shapes
(circle / square / triangle; red / green / blue / yellow; small 18-26 px or large 36-50 px). One object
is the target. Its expression names the shape plus the fewest attributes that single it out
("the circle", "the red circle", "the small square", "the large blue triangle"); when no attribute set
is unique, a spatial relation to a uniquely named landmark object is added
("the green triangle left of the yellow circle"). Distractors are drawn to share attributes with the
target, so that colour alone or shape alone is often not enough.

One JSONL row per scene (extra keys beyond the loader's: ``objects`` and ``target`` record the scene so
that tests can check that each expression picks out exactly the target)::

    {"id": "train_00012", "image": "images/train_00012.png", "expression": "the small red circle",
     "box": [x1, y1, x2, y2], "width": 168, "height": 168,
     "reference_thought": "the small red circle is at the top left",
     "objects": [{"shape": ..., "colour": ..., "size": ..., "box": [...]}, ...], "target": 0}

Boxes are tight integer pixel-edge boxes: the object covers pixel columns x1..x2-1 and rows y1..y2-1
(COCO's x + w convention), measured from the rendered mask, not from the drawing call.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image, ImageDraw

IMAGE_SIZE = 168
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 90, 215),
    "yellow": (235, 190, 20),
}
SIDE_RANGES = {"small": (18, 26), "large": (36, 50)}  # inclusive side lengths in pixels

# Layout: keep objects this far from the border and from each other, so that boxes never touch and a
# spatial relation ("left of": wholly to the left) is visible at a glance.
BORDER = 3
GAP = 4
PLACEMENT_TRIES = 200

# How many of (shape, colour, size) each distractor copies from the target. Copies make attributes
# ambiguous on purpose; copying all three forces a spatial relation.
COPIED_ATTRIBUTE_WEIGHTS = {0: 0.2, 1: 0.35, 2: 0.3, 3: 0.15}

# Attribute sets tried in order, shortest first; the shape noun is always named. Colour before size
# because it is the more natural word to add.
ATTRIBUTE_SETS: tuple[tuple[str, ...], ...] = ((), ("colour",), ("size",), ("size", "colour"))

Box = tuple[int, int, int, int]  # x1, y1, x2, y2 (x2, y2 exclusive pixel edges)

# A spatial relation has a strict reading (A lies wholly on that side of B) and a loose one (A's centre
# is on that side of B's centre). The target must satisfy the strict reading and every other object
# fitting the target phrase must fail even the loose one, so the expression is unique under either
# reading a person (or a checker) might take.
RELATIONS: dict[str, Callable[[Box, Box], bool]] = {
    "left of": lambda a, b: a[2] <= b[0],
    "right of": lambda a, b: a[0] >= b[2],
    "above": lambda a, b: a[3] <= b[1],
    "below": lambda a, b: a[1] >= b[3],
}
LOOSE_RELATIONS: dict[str, Callable[[Box, Box], bool]] = {
    "left of": lambda a, b: a[0] + a[2] < b[0] + b[2],
    "right of": lambda a, b: a[0] + a[2] > b[0] + b[2],
    "above": lambda a, b: a[1] + a[3] < b[1] + b[3],
    "below": lambda a, b: a[1] + a[3] > b[1] + b[3],
}

SPLIT_SIZES_AND_SEEDS = {"train": (2000, 20240101), "test": (200, 20240202)}


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str  # "small" | "large"
    box: Box


def matches(candidate: SceneObject, target: SceneObject, attributes: Sequence[str]) -> bool:
    """Whether ``candidate`` fits the noun phrase naming ``target``'s shape and ``attributes``."""
    return candidate.shape == target.shape and all(
        getattr(candidate, name) == getattr(target, name) for name in attributes
    )


def noun_phrase(obj: SceneObject, attributes: Sequence[str]) -> str:
    words = [obj.size] if "size" in attributes else []
    words += [obj.colour] if "colour" in attributes else []
    return "the " + " ".join([*words, obj.shape])


def unique_attributes(objects: Sequence[SceneObject], index: int) -> tuple[str, ...] | None:
    """The shortest attribute set that names ``objects[index]`` alone, or None when none does."""
    for attributes in ATTRIBUTE_SETS:
        if sum(matches(o, objects[index], attributes) for o in objects) == 1:
            return attributes
    return None


def referring_expression(objects: Sequence[SceneObject], target_index: int, rng: random.Random) -> str | None:
    """The shortest expression that picks out ``objects[target_index]`` alone, or None when none exists.

    Attributes alone first; otherwise "<target phrase> <relation> <landmark phrase>", where the landmark
    is named uniquely by its own attributes and does not itself fit the target phrase, the relation holds
    strictly for the target, and not even loosely for any other object fitting the target phrase. Among equally short choices
    the relation and landmark are drawn from ``rng`` so that all four relations occur.
    """
    target = objects[target_index]
    attributes = unique_attributes(objects, target_index)
    if attributes is not None:
        return noun_phrase(target, attributes)
    landmarks = [
        (j, unique_attributes(objects, j))
        for j in range(len(objects))
        if j != target_index and unique_attributes(objects, j) is not None
    ]
    for attributes in ATTRIBUTE_SETS:
        fitting = [o for o in objects if matches(o, target, attributes)]
        options = [
            (relation, j, landmark_attributes)
            for relation, holds in RELATIONS.items()
            for j, landmark_attributes in landmarks
            if not matches(objects[j], target, attributes)
            and holds(target.box, objects[j].box)
            and not any(LOOSE_RELATIONS[relation](o.box, objects[j].box) for o in fitting if o is not target)
        ]
        if options:
            relation, j, landmark_attributes = rng.choice(options)
            return (
                f"{noun_phrase(target, attributes)} {relation} {noun_phrase(objects[j], landmark_attributes)}"
            )
    return None


def region(box: Box, width: int, height: int) -> str:
    """Coarse place of a box's centre on a 3x3 grid: "at the top left", ..., "in the centre"."""
    centre_x, centre_y = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    vertical = ("top", "middle", "bottom")[min(int(3 * centre_y / height), 2)]
    horizontal = ("left", "centre", "right")[min(int(3 * centre_x / width), 2)]
    if (vertical, horizontal) == ("middle", "centre"):
        return "in the centre"
    return f"at the {vertical} {horizontal}"


def reference_thought(target: SceneObject, width: int, height: int) -> str:
    """A short reasoning text for the target: all of its attributes and where it is."""
    return f"the {target.size} {target.colour} {target.shape} is {region(target.box, width, height)}"


def _draw_mask(shape: str, x: int, y: int, side: int) -> Image.Image:
    """A binary mask of one shape whose drawing square is [x, x + side) x [y, y + side)."""
    mask = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    draw = ImageDraw.Draw(mask)
    last_x, last_y = x + side - 1, y + side - 1
    if shape == "circle":
        draw.ellipse((x, y, last_x, last_y), fill=255)
    elif shape == "square":
        draw.rectangle((x, y, last_x, last_y), fill=255)
    else:  # triangle, apex up
        draw.polygon([(x, last_y), (last_x, last_y), ((x + last_x) / 2, y)], fill=255)
    return mask


def _sample_attributes(rng: random.Random, num_objects: int) -> list[tuple[str, str, str]]:
    """(shape, colour, size) of the target (first) and of distractors that copy some of its attributes."""
    target = (rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(SIDE_RANGES)))
    chosen = [target]
    counts, weights = zip(*COPIED_ATTRIBUTE_WEIGHTS.items(), strict=True)
    for _ in range(num_objects - 1):
        copied = set(rng.sample(range(3), rng.choices(counts, weights)[0]))
        fresh = (rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(SIDE_RANGES)))
        chosen.append(tuple(target[i] if i in copied else fresh[i] for i in range(3)))
    return chosen


def _place(rng: random.Random, sides: Sequence[int]) -> list[tuple[int, int]] | None:
    """Top-left corners for squares of ``sides`` keeping BORDER and GAP, or None when packing fails."""
    corners: list[tuple[int, int]] = []
    for side in sides:
        for _ in range(PLACEMENT_TRIES):
            x = rng.randint(BORDER, IMAGE_SIZE - BORDER - side)
            y = rng.randint(BORDER, IMAGE_SIZE - BORDER - side)
            if all(
                x + side + GAP <= px or px + pside + GAP <= x or y + side + GAP <= py or py + pside + GAP <= y
                for (px, py), pside in zip(corners, sides, strict=False)
            ):
                corners.append((x, y))
                break
        else:
            return None
    return corners


# The background carries a colour ramp: red falls from left to right, blue from top to bottom (RAMP
# levels over the image), so that "where" is in the pixels every patch embedding sees, not only in mRoPE
# (RoPE shapes attention scores, not the values a box is read from). It was meant to let a 1M-parameter
# model learn boxes in minutes; in our runs (README, "What the embedded run shows") it was not enough.
# Kept because it costs nothing and a larger model may use it; real photographs do not need it.
RAMP = 120


def _background(red: int, green: int, blue: int) -> Image.Image:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    step = RAMP / (IMAGE_SIZE - 1)
    image.putdata(
        [
            (round(red - step * x), green, round(blue - step * y))
            for y in range(IMAGE_SIZE)
            for x in range(IMAGE_SIZE)
        ]
    )
    return image


def make_scene(rng: random.Random) -> tuple[Image.Image, list[SceneObject], int, str]:
    """One scene: (image, objects, target index, expression). Draws again until the target is nameable."""
    while True:
        num_objects = rng.randint(2, 4)
        attributes = _sample_attributes(rng, num_objects)
        sides = [rng.randint(*SIDE_RANGES[size]) for _, _, size in attributes]
        corners = _place(rng, sides)
        if corners is None:
            continue
        shade = rng.randint(232, 250)
        image = _background(shade, shade - rng.randint(0, 6), shade - rng.randint(0, 10))
        objects = []
        for (shape, colour, size), side, (x, y) in zip(attributes, sides, corners, strict=True):
            mask = _draw_mask(shape, x, y, side)
            image.paste(COLOURS[colour], mask=mask)
            objects.append(SceneObject(shape, colour, size, tuple(mask.getbbox())))
        # The target was sampled first; shuffle so that its position in `objects` carries no signal.
        order = list(range(num_objects))
        rng.shuffle(order)
        objects = [objects[i] for i in order]
        target_index = order.index(0)
        expression = referring_expression(objects, target_index, rng)
        if expression is not None:
            return image, objects, target_index, expression


def generate(out_dir: Path, n: int, seed: int, split: str = "train") -> list[dict]:
    """Write ``n`` scenes' PNGs to ``out_dir/images/{split}_NNNNN.png`` and return their JSONL rows.

    Scene i depends only on ``seed`` and the scenes before it, so a smaller ``n`` gives a prefix.
    """
    rng = random.Random(seed)
    image_dir = Path(out_dir) / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        image, objects, target_index, expression = make_scene(rng)
        name = f"{split}_{i:05d}"
        image.save(image_dir / f"{name}.png", optimize=True)
        target = objects[target_index]
        rows.append(
            {
                "id": name,
                "image": f"images/{name}.png",
                "expression": expression,
                "box": list(target.box),
                "width": IMAGE_SIZE,
                "height": IMAGE_SIZE,
                "reference_thought": reference_thought(target, IMAGE_SIZE, IMAGE_SIZE),
                "objects": [{**asdict(o), "box": list(o.box)} for o in objects],
                "target": target_index,
            }
        )
    return rows


def write_split(out_dir: Path, split: str, n: int, seed: int, generate_rows=None) -> list[dict]:
    """Regenerate one split: remove its old PNGs, write new ones and ``out_dir/{split}.jsonl``. ``generate_rows``:
    another generator's ``generate(out_dir, n, seed, split)`` (make_zoom's), else this one's."""
    out_dir = Path(out_dir)
    for old in (out_dir / "images").glob(f"{split}_*.png"):
        old.unlink()
    rows = (generate_rows or generate)(out_dir, n, seed, split)
    with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "grounding")
    args = parser.parse_args(argv)
    for split, (n, seed) in SPLIT_SIZES_AND_SEEDS.items():
        rows = write_split(args.out_dir, split, n, seed)
        relational = sum(any(r in row["expression"] for r in RELATIONS) for row in rows)
        print(f"{split}: {len(rows)} scenes, {relational} with a spatial relation -> {args.out_dir}")


if __name__ == "__main__":
    main()
