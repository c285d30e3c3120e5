"""Generate the embedded math data set: counting arithmetic on pictures of shapes, and text-only word problems.

``python data/make_math.py`` rewrites ``data/math/{train,test}.jsonl`` and the PNGs under
``data/math/images/``. Everything follows from two fixed seeds, so the files are reproducible.
``python data/make_math.py --counting`` writes ``data/counting/`` the same way: picture problems only, from
two other seeds (COUNTING_SPLIT_SIZES_AND_SEEDS), the long-thought regime the study trains with the math
task's correctness reward.

Picture rows (IMAGE_SHARE of each split): a 112x112 RGB image on a plain light background holding 3-8
non-overlapping flat shapes (circle / square / triangle in red / green / blue / yellow, 14-20 px; each scene
draws from 2-3 colours and 2-3 shapes so that kinds repeat), and one question of a kind in IMAGE_KINDS:
  ``total``       "How many shapes are there in total?"
  ``sum``         "How many red circles plus blue squares are there?"
  ``add``         "If you add 3 more green triangles, how many green triangles will there be?"
  ``difference``  "How many more circles than squares are there?" (never negative)
  ``colour``      "How many blue shapes are there?"
Text rows: seeded word-problem templates (TEXT_KINDS) with integer answers, plus one fraction template
(answer "1/4": graded by equivalence, so "0.25" and "\\frac{1}{4}" are right too) and one decimal template
with ``"precision": 2``.

One JSONL row per problem; ``objects`` (pictures) and ``program`` (both) record how the answer was made, so
that tests can recompute every answer independently::

    {"id": "train_00012", "images": ["images/train_00012.png"], "question": "How many shapes ...?",
     "answer": "7", "reference_thought": "I see 3 red circles, 2 blue squares and 2 red triangles, so there are 7 shapes.",
     "objects": [{"shape": "circle", "colour": "red", "box": [x1, y1, x2, y2]}, ...],
     "program": {"kind": "total"}}
    {"id": "train_00013", "images": [], "question": "A ribbon 7.5 m long ...", "answer": "1.88",
     "precision": 2, "reference_thought": "7.5 / 4 = 1.875, which is 1.88 to 2 decimal places.",
     "program": {"kind": "share_decimal", "length": "7.5", "pieces": 4}}

Boxes are tight integer pixel-edge boxes measured from the rendered mask (x2, y2 exclusive).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path

from PIL import Image, ImageDraw

IMAGE_SIZE = 112
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 90, 215),
    "yellow": (235, 190, 20),
}
SIDE_RANGE = (14, 20)  # inclusive side lengths in pixels
OBJECT_COUNT_RANGE = (3, 8)
BORDER = 3
GAP = 3  # objects never touch, so that each is one connected blob of its colour
PLACEMENT_TRIES = 300

IMAGE_SHARE = 0.75  # the rest are text-only word problems
IMAGE_KINDS = ("total", "sum", "add", "difference", "colour")
TEXT_KINDS = ("buy_groups", "change", "boxes", "speed", "fraction", "share_decimal")

SPLIT_SIZES_AND_SEEDS = {"train": (600, 20240505), "test": (100, 20240606)}
# ``--counting``: picture problems only, the long-thought regime of the study (``data/counting/``), its own
# seeds; a larger test split so that held-out accuracy moves in steps of 0.005.
COUNTING_SPLIT_SIZES_AND_SEEDS = {"train": (800, 20240707), "test": (200, 20240808)}

Box = tuple[int, int, int, int]


def plural(shape: str) -> str:
    return f"{shape}s"


def counted(n: int, *words: str) -> str:
    """ "1 red circle", "3 red circles", "0 circles": the last word is the noun."""
    *adjectives, noun = words
    return " ".join([str(n), *adjectives, noun if n == 1 else plural(noun)])


# ---------------------------------------------------------------------------------------------- pictures


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


def make_scene(rng: random.Random) -> tuple[Image.Image, list[dict]]:
    """One picture and its objects [{"shape", "colour", "box"}] in drawing order."""
    while True:
        colours = rng.sample(list(COLOURS), rng.randint(2, 3))
        shapes = rng.sample(SHAPES, rng.randint(2, 3))
        kinds = [(rng.choice(colours), rng.choice(shapes)) for _ in range(rng.randint(*OBJECT_COUNT_RANGE))]
        sides = [rng.randint(*SIDE_RANGE) for _ in kinds]
        corners = _place(rng, sides)
        if corners is not None:
            break
    shade = rng.randint(236, 250)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (shade, shade, shade))
    objects = []
    for (colour, shape), side, (x, y) in zip(kinds, sides, corners, strict=True):
        mask = _draw_mask(shape, x, y, side)
        image.paste(COLOURS[colour], mask=mask)
        objects.append({"shape": shape, "colour": colour, "box": list(mask.getbbox())})
    return image, objects


def count(objects: Sequence[dict], colour: str | None = None, shape: str | None = None) -> int:
    return sum(
        (colour is None or o["colour"] == colour) and (shape is None or o["shape"] == shape) for o in objects
    )


def _inventory(objects: Sequence[dict]) -> str:
    """ "3 red circles, 1 blue square and 2 blue triangles" in a fixed (colour, shape) order."""
    parts = []
    for colour in COLOURS:
        for shape in SHAPES:
            n = count(objects, colour, shape)
            if n:
                parts.append(counted(n, colour, shape))
    return _join(parts)


def _join(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def image_problem(rng: random.Random, objects: Sequence[dict]) -> tuple[str, int, str, dict]:
    """(question, answer, reference thought, program) for one picture."""
    kind = rng.choice(IMAGE_KINDS)
    present = sorted({(o["colour"], o["shape"]) for o in objects})
    if kind == "total":
        total = len(objects)
        thought = f"I see {_inventory(objects)}, so there are {total} shapes."
        return "How many shapes are there in total?", total, thought, {"kind": kind}
    if kind == "sum":
        # The first kind is present; the second may be absent (an answer that needs a zero).
        first = rng.choice(present)
        others = [(c, s) for c in COLOURS for s in SHAPES if (c, s) != first]
        present_others = [k for k in others if k in present]
        second = rng.choice(present_others if present_others and rng.random() < 0.8 else others)
        a, b = count(objects, *first), count(objects, *second)
        question = f"How many {first[0]} {plural(first[1])} plus {second[0]} {plural(second[1])} are there?"
        thought = f"I count {counted(a, *first)} and {counted(b, *second)}: {a} + {b} = {a + b}."
        return question, a + b, thought, {"kind": kind, "terms": [list(first), list(second)]}
    if kind == "add":
        colour, shape = rng.choice(present)
        added = rng.randint(1, 5)
        n = count(objects, colour, shape)
        question = (
            f"If you add {added} more {colour} {plural(shape) if added > 1 else shape}, "
            f"how many {colour} {plural(shape)} will there be?"
        )
        thought = f"I count {counted(n, colour, shape)} now; {n} + {added} = {n + added}."
        return question, n + added, thought, {"kind": kind, "colour": colour, "shape": shape, "add": added}
    if kind == "difference":
        first, second = rng.sample(SHAPES, 2)
        a, b = count(objects, shape=first), count(objects, shape=second)
        if a < b:
            first, second, a, b = second, first, b, a
        question = f"How many more {plural(first)} than {plural(second)} are there?"
        thought = f"I count {counted(a, first)} and {counted(b, second)}: {a} - {b} = {a - b}."
        return question, a - b, thought, {"kind": kind, "more": first, "fewer": second}
    colour = rng.choice(sorted({o["colour"] for o in objects}))
    n = count(objects, colour=colour)
    by_shape = [counted(count(objects, colour, s), s) for s in SHAPES if count(objects, colour, s)]
    thought = f"The {colour} shapes are {_join(by_shape)}: {n} in all."
    return f"How many {colour} shapes are there?", n, thought, {"kind": kind, "colour": colour}


# ---------------------------------------------------------------------------------------------- word problems

NAMES = ("Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemi", "Leo")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "stamps")
THINGS = ("notebook", "sandwich", "ticket", "toy car", "comic book")


def round_half_up(value: Fraction, places: int) -> Decimal:
    exact = Decimal(value.numerator) / Decimal(value.denominator)
    return exact.quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP)


def text_problem(rng: random.Random) -> tuple[str, str, str, dict, int | None]:
    """(question, answer, reference thought, program, precision) of one word problem."""
    kind = rng.choice(TEXT_KINDS)
    name = rng.choice(NAMES)
    if kind == "buy_groups":
        item = rng.choice(ITEMS)
        a, b, c = rng.randint(2, 30), rng.randint(2, 6), rng.randint(2, 12)
        question = (
            f"{name} has {a} {item}. {name} buys {b} bags with {c} {item} in each bag. "
            f"How many {item} does {name} have now?"
        )
        thought = f"{b} bags of {c} is {b} × {c} = {b * c}; {a} + {b * c} = {a + b * c}."
        return question, str(a + b * c), thought, {"kind": kind, "have": a, "bags": b, "per_bag": c}, None
    if kind == "change":
        thing = rng.choice(THINGS)
        price, number = rng.randint(2, 15), rng.randint(2, 6)
        bill = next(b for b in (20, 50, 100) if b >= price * number)
        question = (
            f"A {thing} costs ${price}. {name} buys {number} of them and pays with a ${bill} bill. "
            f"How much change, in dollars, does {name} get?"
        )
        cost = price * number
        thought = f"{number} × {price} = {cost}; {bill} - {cost} = {bill - cost}."
        program = {"kind": kind, "price": price, "number": number, "paid": bill}
        return question, str(bill - cost), thought, program, None
    if kind == "boxes":
        item = rng.choice(ITEMS)
        per_box, total = rng.randint(3, 12), rng.randint(10, 90)
        boxes = -(-total // per_box)
        question = f"A box holds {per_box} {item}. How many boxes are needed to pack {total} {item}?"
        thought = f"{total} / {per_box} = {total / per_box:.2f}, and a part-filled box still counts, so {boxes} boxes."
        return question, str(boxes), thought, {"kind": kind, "per_box": per_box, "total": total}, None
    if kind == "speed":
        hours, speed, later = rng.randint(2, 5), rng.randint(3, 20) * 5, rng.randint(2, 7)
        distance = hours * speed
        question = (
            f"A train travels {distance} km in {hours} hours. At the same speed, how many km does it travel "
            f"in {later} hours?"
        )
        thought = f"{distance} / {hours} = {speed} km per hour; {speed} × {later} = {speed * later}."
        program = {"kind": kind, "distance": distance, "hours": hours, "later": later}
        return question, str(speed * later), thought, program, None
    if kind == "fraction":
        slices = rng.choice((4, 6, 8, 10, 12))
        eaten = rng.randint(1, slices - 1)
        part = Fraction(eaten, slices)
        question = (
            f"A pizza is cut into {slices} equal slices and {name} eats {eaten} of them. "
            f"What fraction of the pizza does {name} eat?"
        )
        thought = f"{eaten} of {slices} slices is {eaten}/{slices} = {part.numerator}/{part.denominator}."
        answer = f"{part.numerator}/{part.denominator}"
        return question, answer, thought, {"kind": kind, "slices": slices, "eaten": eaten}, None
    # share_decimal
    length = Fraction(rng.randint(11, 99), 10)
    pieces = rng.choice((3, 4, 6, 7, 8))
    share = round_half_up(length / pieces, 2)
    length_text = f"{float(length):g}"
    question = (
        f"A ribbon {length_text} m long is cut into {pieces} equal pieces. How long is each piece, in metres? "
        f"Round to 2 decimal places."
    )
    thought = (
        f"{length_text} / {pieces} ≈ {float(length / pieces):.4f}, which is {share} to 2 decimal places."
    )
    program = {"kind": "share_decimal", "length": length_text, "pieces": pieces}
    return question, str(share), thought, program, 2


# ---------------------------------------------------------------------------------------------- splits


def generate(out_dir: Path, n: int, seed: int, split: str = "train", image_share: float = IMAGE_SHARE) -> list[dict]:
    """Write the PNGs of ``n`` problems to ``out_dir/images/{split}_NNNNN.png`` and return their JSONL rows;
    ``image_share`` of them (in expectation) are picture problems, the rest word problems.

    Problem i depends only on ``seed`` and the problems before it, so a smaller ``n`` gives a prefix.
    """
    rng = random.Random(seed)
    image_dir = Path(out_dir) / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = f"{split}_{i:05d}"
        if rng.random() < image_share:
            image, objects = make_scene(rng)
            question, answer, thought, program = image_problem(rng, objects)
            image.save(image_dir / f"{name}.png", optimize=True)
            row = {"id": name, "images": [f"images/{name}.png"], "question": question, "answer": str(answer),
                   "reference_thought": thought, "objects": objects, "program": program}  # fmt: skip
        else:
            question, answer, thought, program, precision = text_problem(rng)
            row = {"id": name, "images": [], "question": question, "answer": answer}
            if precision is not None:
                row["precision"] = precision
            row.update({"reference_thought": thought, "program": program})
        rows.append(row)
    return rows


def write_split(out_dir: Path, split: str, n: int, seed: int, image_share: float = IMAGE_SHARE) -> list[dict]:
    """Regenerate one split: remove its old PNGs, write new ones and ``out_dir/{split}.jsonl``."""
    out_dir = Path(out_dir)
    for old in (out_dir / "images").glob(f"{split}_*.png"):
        old.unlink()
    rows = generate(out_dir, n, seed, split, image_share)
    with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counting", action="store_true",
                        help="write the picture-only counting splits (default folder data/counting) instead")
    parser.add_argument("--out-dir", type=Path, help="default: data/math, or data/counting with --counting")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent
    out_dir = args.out_dir or here / ("counting" if args.counting else "math")
    splits = COUNTING_SPLIT_SIZES_AND_SEEDS if args.counting else SPLIT_SIZES_AND_SEEDS
    for split, (n, seed) in splits.items():
        rows = write_split(out_dir, split, n, seed, 1.0 if args.counting else IMAGE_SHARE)
        with_image = sum(bool(row["images"]) for row in rows)
        print(f"{split}: {len(rows)} problems, {with_image} with a picture -> {out_dir}")


if __name__ == "__main__":
    main()
