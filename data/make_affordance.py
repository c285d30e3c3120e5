"""Generate the embedded affordance data set: synthetic scenes with the region where an action applies.

``python data/make_affordance.py`` rewrites ``data/affordance/{train,test}.jsonl``, the scene PNGs under
``data/affordance/images/`` and one 1-bit target mask PNG per scene under ``data/affordance/masks/``.
Everything follows from two fixed seeds, so the files are reproducible.

A scene is a 168x168 RGB image on a light flat background. Three kinds, drawn with equal probability:

``grasp``  1-3 mugs of different colours (a body with a ring handle on its left or right), plus 0-2 plain
           boxes. "Where would you grasp the red mug?" -> the handle of that mug (the ring pixels outside
           the body; the hole of the ring is not the handle).
``press``  1-2 dark devices holding 2-3 round buttons of different colours, plus sometimes a mug.
           "Where would you press the blue button?" -> that button's disc.
``place``  a table holding 1-3 boxes/mugs of different colours. "Where would you place a cup on the
           table?" -> the free space: table pixels at least MARGIN px from the table's edge and from every
           object's box. Or, relative to a landmark, "Where would you place a cup left of the green box?"
           -> the free space strictly on that side of the landmark, within a band of BAND px around it
           (left/right: the landmark's rows +- BAND; in front of, i.e. below in the image: its columns
           +- BAND).
Distractors share colours or nouns with the target, so neither the colour nor the noun alone is enough.

One JSONL row per scene (the fields the project loader reads, plus ``kind``)::

    {"id": "train_00012", "image": "images/train_00012.png", "mask": "masks/train_00012.png",
     "question": "Where would you grasp the red mug?", "box": [x1, y1, x2, y2], "point": [x, y],
     "width": 168, "height": 168, "kind": "grasp",
     "reference_thought": "the red mug is at the top left; its handle is on its right"}

``mask`` is the target (nonzero = where the action applies); ``box`` is the mask's tight pixel-edge box
(pixels x1..x2-1, y1..y2-1) and ``point`` a reference pixel (x, y) deep inside the mask, chosen by eroding
the mask as far as it stays non-empty and taking the remaining pixel nearest that remainder's centroid.
A pixel (x, y) covers [x, x + 1) x [y, y + 1), so the integer point lies in pixel (x, y) of the mask.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

IMAGE_SIZE = 168
KINDS = ("grasp", "press", "place")
COLOURS = {
    "red": (210, 45, 45),
    "green": (45, 155, 65),
    "blue": (45, 90, 210),
    "yellow": (230, 185, 25),
}
BOX_COLOURS = {"grey": (150, 150, 150), "brown": (150, 105, 60), **COLOURS}
DEVICE_SHADES = ((60, 60, 66), (80, 78, 86))
TABLE_COLOUR = (196, 160, 112)

BORDER = 3  # objects keep this far from the image border
GAP = 5  # and this far from each other, so that masks never touch
PLACEMENT_TRIES = 200
HANDLE_WIDTH = 5  # the ring's line width: thick enough to keep a pixel after one erosion
MARGIN = 6  # free space for a cup: this far from the table edge and from every object
BAND = 10  # a relational placement region reaches this far beyond the landmark's sides
MIN_REGION_PIXELS = 40  # a target smaller than this is redrawn

SPLIT_SIZES_AND_SEEDS = {"train": (600, 20240303), "test": (100, 20240404)}

Box = tuple[int, int, int, int]  # x1, y1, x2, y2 (x2, y2 exclusive pixel edges)


def region(x: float, y: float, width: int = IMAGE_SIZE, height: int = IMAGE_SIZE) -> str:
    """Coarse place of a point on a 3x3 grid: "at the top left", ..., "in the centre"."""
    vertical = ("top", "middle", "bottom")[min(int(3 * y / height), 2)]
    horizontal = ("left", "centre", "right")[min(int(3 * x / width), 2)]
    if (vertical, horizontal) == ("middle", "centre"):
        return "in the centre"
    return f"at the {vertical} {horizontal}"


def reference_point(mask: np.ndarray) -> tuple[int, int]:
    """A pixel (x, y) deep inside a non-empty boolean mask [H, W] (see the module docstring)."""
    image = Image.fromarray(mask.astype(np.uint8) * 255)
    while True:
        eroded = image.filter(ImageFilter.MinFilter(3))
        if eroded.getbbox() is None:
            break
        image = eroded
    ys, xs = np.nonzero(np.asarray(image))
    nearest = int(np.argmin((xs - xs.mean()) ** 2 + (ys - ys.mean()) ** 2))
    return int(xs[nearest]), int(ys[nearest])


def tight_box(mask: np.ndarray) -> Box:
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def _place(
    rng: random.Random, sizes: Sequence[tuple[int, int]], area: Box, gap: int = GAP
) -> list[tuple[int, int]] | None:
    """Top-left corners for rectangles of ``sizes`` (w, h) inside ``area``, ``gap`` apart; None on failure."""
    placed: list[Box] = []
    for w, h in sizes:
        if area[2] - w < area[0] or area[3] - h < area[1]:
            return None
        for _ in range(PLACEMENT_TRIES):
            x, y = rng.randint(area[0], area[2] - w), rng.randint(area[1], area[3] - h)
            if all(
                x + w + gap <= b[0] or b[2] + gap <= x or y + h + gap <= b[1] or b[3] + gap <= y
                for b in placed
            ):
                placed.append((x, y, x + w, y + h))
                break
        else:
            return None
    return [(b[0], b[1]) for b in placed]


def _blank_mask() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    mask = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    return mask, ImageDraw.Draw(mask)


def _mug_size(rng: random.Random) -> tuple[int, int, int, int]:
    """(body width, body height, handle width, handle height)."""
    body_w, body_h = rng.randint(18, 26), rng.randint(22, 30)
    return body_w, body_h, rng.randint(10, 13), rng.randint(14, body_h - 4)


def _draw_mug(
    image: Image.Image,
    x: int,
    y: int,
    size: tuple[int, int, int, int],
    side: str,
    colour: tuple[int, int, int],
) -> tuple[np.ndarray, Box]:
    """Draw a mug whose footprint (body + handle) starts at (x, y). Returns (handle mask, body box)."""
    body_w, body_h, handle_w, handle_h = size
    body_x = x + handle_w if side == "left" else x
    body = (body_x, y, body_x + body_w, y + body_h)
    centre_y = y + body_h // 2
    # The ring starts HANDLE_WIDTH px inside the body, so that it joins the body without a gap.
    if side == "right":
        ring = (
            body[2] - HANDLE_WIDTH,
            centre_y - handle_h // 2,
            body[2] + handle_w - 1,
            centre_y + handle_h // 2,
        )
    else:
        ring = (
            body[0] - handle_w,
            centre_y - handle_h // 2,
            body[0] + HANDLE_WIDTH - 1,
            centre_y + handle_h // 2,
        )
    ring_mask, draw = _blank_mask()
    draw.ellipse(ring, outline=255, width=HANDLE_WIDTH)
    body_mask, body_draw = _blank_mask()
    body_draw.rectangle((body[0], body[1], body[2] - 1, body[3] - 1), fill=255)
    image.paste(colour, mask=ring_mask)
    image.paste(colour, mask=body_mask)
    # A darker rim on top so that a mug reads as a mug and not as a box with a ring.
    ImageDraw.Draw(image).rectangle(
        (body[0], body[1], body[2] - 1, body[1] + 2), fill=tuple(int(c * 0.6) for c in colour)
    )
    handle = (np.asarray(ring_mask) > 0) & ~(np.asarray(body_mask) > 0)
    return handle, body


def _draw_box(image: Image.Image, box: Box, colour: tuple[int, int, int]) -> None:
    ImageDraw.Draw(image).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=colour)


def _background(rng: random.Random) -> Image.Image:
    shade = rng.randint(228, 246)
    return Image.new(
        "RGB", (IMAGE_SIZE, IMAGE_SIZE), (shade, shade - rng.randint(0, 6), shade - rng.randint(0, 10))
    )


def _grasp_scene(rng: random.Random) -> tuple[Image.Image, np.ndarray, str, str] | None:
    num_mugs = rng.randint(1, 3)
    colours = rng.sample(list(COLOURS), num_mugs)
    mug_sizes = [_mug_size(rng) for _ in range(num_mugs)]
    box_sizes = [(rng.randint(16, 30), rng.randint(14, 28)) for _ in range(rng.randint(0, 2))]
    footprints = [(s[0] + s[2], s[1]) for s in mug_sizes] + box_sizes
    corners = _place(rng, footprints, (BORDER, BORDER, IMAGE_SIZE - BORDER, IMAGE_SIZE - BORDER))
    if corners is None:
        return None
    image = _background(rng)
    handles, bodies, sides = [], [], []
    for (x, y), size, colour in zip(corners, mug_sizes, colours, strict=False):
        side = rng.choice(("left", "right"))
        handle, body = _draw_mug(image, x, y, size, side, COLOURS[colour])
        handles.append(handle)
        bodies.append(body)
        sides.append(side)
    for (x, y), (w, h) in zip(corners[num_mugs:], box_sizes, strict=True):
        _draw_box(image, (x, y, x + w, y + h), BOX_COLOURS[rng.choice(list(BOX_COLOURS))])
    target = rng.randrange(num_mugs)
    body = bodies[target]
    thought = (
        f"the {colours[target]} mug is {region((body[0] + body[2]) / 2, (body[1] + body[3]) / 2)}; "
        f"its handle is on its {sides[target]}"
    )
    return image, handles[target], f"Where would you grasp the {colours[target]} mug?", thought


def _press_scene(rng: random.Random) -> tuple[Image.Image, np.ndarray, str, str] | None:
    num_devices = rng.randint(1, 2)
    num_buttons = rng.randint(2, 3)
    device_sizes = [(rng.randint(38, 58), rng.randint(30, 46)) for _ in range(num_devices)]
    with_mug = rng.random() < 0.4
    mug_size = _mug_size(rng)
    sizes = device_sizes + ([(mug_size[0] + mug_size[2], mug_size[1])] if with_mug else [])
    corners = _place(rng, sizes, (BORDER, BORDER, IMAGE_SIZE - BORDER, IMAGE_SIZE - BORDER))
    if corners is None:
        return None
    devices = [(x, y, x + w, y + h) for (x, y), (w, h) in zip(corners, device_sizes, strict=False)]
    # Each button goes on a device (every device gets at least one), placed like objects, inside a margin.
    owners = list(range(num_devices)) + [rng.randrange(num_devices) for _ in range(num_buttons - num_devices)]
    rng.shuffle(owners)
    radii = [rng.randint(5, 8) for _ in range(num_buttons)]
    button_corners: list[tuple[int, int] | None] = [None] * num_buttons
    for d, device in enumerate(devices):
        mine = [b for b in range(num_buttons) if owners[b] == d]
        inner = (device[0] + 4, device[1] + 4, device[2] - 4, device[3] - 4)
        placed = _place(rng, [(2 * radii[b] + 1, 2 * radii[b] + 1) for b in mine], inner, gap=3)
        if placed is None:
            return None
        for b, corner in zip(mine, placed, strict=True):
            button_corners[b] = corner
    image = _background(rng)
    for device in devices:
        _draw_box(image, device, rng.choice(DEVICE_SHADES))
    colours = rng.sample(list(COLOURS), num_buttons)
    buttons = []
    for (x, y), r, colour in zip(button_corners, radii, colours, strict=True):
        disc, draw = _blank_mask()
        draw.ellipse((x, y, x + 2 * r, y + 2 * r), fill=255)
        image.paste(COLOURS[colour], mask=disc)
        buttons.append(np.asarray(disc) > 0)
    if with_mug:
        x, y = corners[-1]
        _draw_mug(image, x, y, mug_size, rng.choice(("left", "right")), COLOURS[rng.choice(list(COLOURS))])
    target = rng.randrange(num_buttons)
    ys, xs = np.nonzero(buttons[target])
    thought = f"the {colours[target]} button is {region(xs.mean(), ys.mean())}"
    return image, buttons[target], f"Where would you press the {colours[target]} button?", thought


def _place_scene(rng: random.Random) -> tuple[Image.Image, np.ndarray, str, str] | None:
    table = (
        rng.randint(4, 24),
        rng.randint(36, 70),
        IMAGE_SIZE - rng.randint(4, 24),
        IMAGE_SIZE - rng.randint(4, 20),
    )
    num_objects = rng.randint(1, 3)
    kinds = [rng.choice(("box", "mug")) for _ in range(num_objects)]
    colours = rng.sample(list(COLOURS), num_objects)
    mug_sizes = [_mug_size(rng) for _ in range(num_objects)]
    box_sizes = [(rng.randint(16, 30), rng.randint(14, 26)) for _ in range(num_objects)]
    sizes = [
        (m[0] + m[2], m[1]) if kind == "mug" else b
        for kind, m, b in zip(kinds, mug_sizes, box_sizes, strict=True)
    ]
    inner = (table[0] + MARGIN, table[1] + MARGIN, table[2] - MARGIN, table[3] - MARGIN)
    corners = _place(rng, sizes, inner, gap=2 * MARGIN + 8)
    if corners is None:
        return None
    image = _background(rng)
    _draw_box(image, table, TABLE_COLOUR)
    free = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    free[inner[1] : inner[3], inner[0] : inner[2]] = True
    footprints = []
    for (x, y), kind, size, mug, colour in zip(corners, kinds, sizes, mug_sizes, colours, strict=True):
        footprint = (x, y, x + size[0], y + size[1])
        if kind == "mug":
            _draw_mug(image, x, y, mug, rng.choice(("left", "right")), COLOURS[colour])
        else:
            _draw_box(image, footprint, COLOURS[colour])
        footprints.append(footprint)
        free[
            max(footprint[1] - MARGIN, 0) : footprint[3] + MARGIN,
            max(footprint[0] - MARGIN, 0) : footprint[2] + MARGIN,
        ] = False
    options = [("on the table", free, None)]
    for (x1, y1, x2, y2), kind, colour in zip(footprints, kinds, colours, strict=True):
        for relation in ("left of", "right of", "in front of"):
            band = np.zeros_like(free)
            if relation == "left of":
                band[max(y1 - BAND, 0) : y2 + BAND, :x1] = True
            elif relation == "right of":
                band[max(y1 - BAND, 0) : y2 + BAND, x2:] = True
            else:  # in front of: nearer the camera, lower in the image
                band[y2:, max(x1 - BAND, 0) : x2 + BAND] = True
            options.append((f"{relation} the {colour} {kind}", free & band, (x1, y1, x2, y2)))
    options = [option for option in options if option[1].sum() >= MIN_REGION_PIXELS]
    if not options:
        return None
    # Half of the place questions are relational when a relation has room; the rest use the whole table.
    relational = [option for option in options if option[2] is not None]
    phrase, target, _ = rng.choice(relational) if relational and rng.random() < 0.5 else options[0]
    if target.sum() < MIN_REGION_PIXELS:
        return None
    x, y = reference_point(target)
    if phrase == "on the table":
        thought = f"the table has free space {region(x, y)}"
    else:
        thought = f"{phrase} there is free space {region(x, y)}"
    return image, target, f"Where would you place a cup {phrase}?", thought


SCENES = {"grasp": _grasp_scene, "press": _press_scene, "place": _place_scene}


def make_scene(rng: random.Random) -> tuple[str, Image.Image, np.ndarray, str, str]:
    """One scene: (kind, image, target mask [H, W] bool, question, reference thought). Redraws on failure."""
    kind = rng.choice(KINDS)
    while True:
        scene = SCENES[kind](rng)
        if scene is not None and scene[1].sum() >= MIN_REGION_PIXELS:
            return (kind, *scene)


def generate(out_dir: Path, n: int, seed: int, split: str = "train") -> list[dict]:
    """Write ``n`` scenes' images and masks under ``out_dir`` and return their JSONL rows.

    Scene i depends only on ``seed`` and the scenes before it, so a smaller ``n`` gives a prefix.
    """
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    (out_dir / "masks").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        kind, image, mask, question, thought = make_scene(rng)
        name = f"{split}_{i:05d}"
        # Few flat colours: a palette PNG is lossless here and a third of the size of RGB.
        image.quantize(colors=256, method=Image.Quantize.MAXCOVERAGE, dither=Image.Dither.NONE).save(
            out_dir / "images" / f"{name}.png", optimize=True
        )
        Image.fromarray(mask).convert("1").save(out_dir / "masks" / f"{name}.png", optimize=True)
        x, y = reference_point(mask)
        rows.append(
            {
                "id": name,
                "image": f"images/{name}.png",
                "mask": f"masks/{name}.png",
                "question": question,
                "box": list(tight_box(mask)),
                "point": [x, y],
                "width": IMAGE_SIZE,
                "height": IMAGE_SIZE,
                "kind": kind,
                "reference_thought": thought,
            }
        )
    return rows


def write_split(out_dir: Path, split: str, n: int, seed: int) -> list[dict]:
    """Regenerate one split: remove its old PNGs, write new ones and ``out_dir/{split}.jsonl``."""
    out_dir = Path(out_dir)
    for folder in ("images", "masks"):
        for old in (out_dir / folder).glob(f"{split}_*.png"):
            old.unlink()
    rows = generate(out_dir, n, seed, split)
    with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "affordance")
    args = parser.parse_args(argv)
    for split, (n, seed) in SPLIT_SIZES_AND_SEEDS.items():
        rows = write_split(args.out_dir, split, n, seed)
        kinds = {kind: sum(row["kind"] == kind for row in rows) for kind in KINDS}
        print(f"{split}: {len(rows)} scenes {kinds} -> {args.out_dir}")


if __name__ == "__main__":
    main()
