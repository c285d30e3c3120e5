"""Generate the embedded video data set: short synthetic clips of flat shapes, with questions that need more than
one frame to answer.

``python data/make_video.py`` rewrites ``data/video/{train,test}.jsonl`` and the clips
``data/video/clips/{train,test}_NNNNN.mp4``. Everything follows from two fixed seeds and the encoder runs
single-threaded at a fixed quality, so a second run writes the same bytes (same PyAV/FFmpeg build).

A clip is 84x84 RGB, 8 frames at 2 fps (4 s), on a flat dark or light background, holding 1-2 flat shapes
(circle / square / triangle; red / green / blue / yellow; side 16-22 px; the shapes of one clip differ in colour,
so "the red square" names one shape). Three kinds of question, in equal numbers:

  ``direction``  one shape moves in a straight line from one side to the other (a second, still shape may stand
                 off its path): "Which way does the red square move?" with the options left / right / up / down
                 in that order; the answer is the letter;
  ``first``      two still shapes; one is there from frame 0, the other appears at frame 2-5 and stays: "Which
                 shape appears first?" with the two shapes as options in random order; the answer is the letter;
  ``crossings``  a grey vertical line in the middle (x = 42); one shape moves horizontally and turns around so
                 that it crosses the line 0-3 times between frames. Its centre is at least CROSSING_CLEARANCE px
                 from the line in every frame, and it stays at least 2 frames on each side it visits, so every
                 crossing shows at 2 fps: "How many times does the green circle cross the line?"; the answer is
                 the number.

One JSONL row per clip (``question`` is the question without its options; the task puts the options under it)::

    {"id": "train_00012", "video": "clips/train_00012.mp4", "question": "Which way does the red square move?",
     "choices": ["left", "right", "up", "down"], "answer": "B", "kind": "direction",
     "reference_thought": "the red square starts at the left and ends at the right", "fps": 2, "frames": 8}

``make_clip(rng, kind)`` is the pure part (frames as arrays, nothing written) for other code and the tests;
``write_clip(path, frames, fps)`` encodes a list of frames to mp4 (H.264, yuv420p).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 84  # frame side in pixels (a multiple of Qwen-VL's 28-pixel patch factor: decoded without resizing)
FRAMES = 8
FPS = 2
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 90, 215),
    "yellow": (235, 190, 20),
}
BACKGROUNDS = {"dark": (25, 25, 30), "light": (235, 235, 230)}
LINE_COLOURS = {"dark": (150, 150, 150), "light": (110, 110, 110)}  # the crossings line: grey, never a shape colour
SIDE_RANGE = (16, 22)  # inclusive side lengths
KINDS = ("direction", "first", "crossings")
DIRECTIONS = ("left", "right", "up", "down")  # the direction options, always in this order
LETTERS = "ABCD"

LINE_X = SIZE // 2  # the crossings line's centre column (drawn over columns 41 and 42)
CROSSING_CLEARANCE = 14  # the shape's centre is at least this far from LINE_X in every frame
MARGIN = 2  # pixels kept between a shape and the frame's edge
GAP = 4  # pixels kept between two shapes (over the moving shape's whole path)
MIN_TRAVEL = 30  # a moving shape's centre moves at least this far between the first and the last frame

# x264 options that make the bytes reproducible: one thread (frame threads reorder work), fixed quality.
ENCODER_OPTIONS = {"crf": "12", "threads": "1"}

SPLIT_SIZES_AND_SEEDS = {"train": (600, 20240303), "test": (150, 20240404)}

Centre = tuple[int, int]


@dataclass
class Shape:
    """One drawn shape: what it is and its centre in every frame (None where it is not shown)."""

    shape: str
    colour: str
    side: int
    centres: list[Centre | None]

    @property
    def name(self) -> str:
        return f"the {self.colour} {self.shape}"


@dataclass
class Clip:
    """A generated clip and its question. ``frames``: FRAMES arrays HxWx3 uint8 in time order; ``question``: the
    question with its option lines ("A. left" ...) when multiple choice, ``stem`` without them; ``choices``: the
    option texts (empty for a number answer); ``answer``: the letter or the number as a string;
    ``objects``: the shapes drawn (``Shape``); ``line_x``: the line's column for ``crossings``, else None."""

    frames: list[np.ndarray]
    fps: int
    kind: str
    question: str
    stem: str
    choices: tuple[str, ...]
    answer: str
    reference_thought: str
    objects: list[Shape] = field(default_factory=list)
    background: str = "dark"
    line_x: int | None = None


def with_options(stem: str, choices: Sequence[str]) -> str:
    """The question as the model reads it: the stem, then one "A. option" line per option (vqa's layout)."""
    return "\n".join([stem, *(f"{LETTERS[i]}. {choice}" for i, choice in enumerate(choices))])


# ---------------------------------------------------------------------------------------------- drawing


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, centre: Centre, side: int, colour: tuple[int, int, int]) -> None:
    x, y = centre
    half = side / 2
    box = (x - half, y - half, x + half - 1, y + half - 1)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:  # an upward triangle filling the box
        draw.polygon([(x, box[1]), (box[2], box[3]), (box[0], box[3])], fill=colour)


def render(objects: Sequence[Shape], background: str, line_x: int | None = None) -> list[np.ndarray]:
    """The FRAMES frames of a clip: the background, the line if any, then each shape where it is shown."""
    frames = []
    for t in range(FRAMES):
        image = Image.new("RGB", (SIZE, SIZE), BACKGROUNDS[background])
        draw = ImageDraw.Draw(image)
        if line_x is not None:
            draw.rectangle((line_x - 1, 0, line_x, SIZE - 1), fill=LINE_COLOURS[background])
        for obj in objects:
            if obj.centres[t] is not None:
                _draw_shape(draw, obj.shape, obj.centres[t], obj.side, COLOURS[obj.colour])
        frames.append(np.asarray(image, dtype=np.uint8).copy())
    return frames


# ---------------------------------------------------------------------------------------------- layout


def _box(centre: Centre, side: int, pad: int = 0) -> tuple[float, float, float, float]:
    half = side / 2 + pad
    return centre[0] - half, centre[1] - half, centre[0] + half, centre[1] + half


def _overlaps(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _clear_of(centre: Centre, side: int, others: Sequence[Shape]) -> bool:
    """Whether a still shape at ``centre`` keeps GAP from every other shape in every frame it is drawn."""
    mine = _box(centre, side, GAP)
    return not any(
        _overlaps(mine, _box(c, other.side)) for other in others for c in other.centres if c is not None
    )


def _random_centre(rng: random.Random, side: int) -> Centre:
    low, high = side // 2 + MARGIN, SIZE - side // 2 - MARGIN
    return rng.randint(low, high), rng.randint(low, high)


def _new_shapes(rng: random.Random, count: int) -> list[tuple[str, str, int]]:
    """``count`` (shape, colour, side) triples of different colours."""
    colours = rng.sample(sorted(COLOURS), count)
    return [(rng.choice(SHAPES), colour, rng.randint(*SIDE_RANGE)) for colour in colours]


def _place_still(rng: random.Random, side: int, others: Sequence[Shape]) -> Centre | None:
    for _ in range(200):
        centre = _random_centre(rng, side)
        if _clear_of(centre, side, others):
            return centre
    return None


# ---------------------------------------------------------------------------------------------- kinds


def _direction(rng: random.Random, background: str) -> Clip:
    (shape, colour, side), (other_shape, other_colour, other_side) = _new_shapes(rng, 2)
    direction = rng.choice(DIRECTIONS)
    low, high = side // 2 + MARGIN, SIZE - side // 2 - MARGIN
    start, end = rng.randint(low, low + 6), rng.randint(high - 6, high)
    if direction in ("left", "up"):
        start, end = end, start
    across = rng.randint(low, high)  # the fixed coordinate across the motion
    along = [round(start + (end - start) * t / (FRAMES - 1)) for t in range(FRAMES)]
    centres: list[Centre | None] = [
        (a, across) if direction in ("left", "right") else (across, a) for a in along
    ]
    moving = Shape(shape, colour, side, centres)
    objects = [moving]
    if rng.random() < 0.5:  # a still distractor of another colour, off the moving shape's path
        spot = _place_still(rng, other_side, objects)
        if spot is not None:
            objects.append(Shape(other_shape, other_colour, other_side, [spot] * FRAMES))
    ends = {"left": ("right", "left"), "right": ("left", "right"), "up": ("bottom", "top"), "down": ("top", "bottom")}
    begin, finish = ends[direction]
    stem = f"Which way does {moving.name} move?"
    return Clip(
        frames=render(objects, background),
        fps=FPS,
        kind="direction",
        question=with_options(stem, DIRECTIONS),
        stem=stem,
        choices=DIRECTIONS,
        answer=LETTERS[DIRECTIONS.index(direction)],
        reference_thought=f"{moving.name} starts at the {begin} and ends at the {finish}",
        objects=objects,
        background=background,
    )


def _first(rng: random.Random, background: str) -> Clip:
    for _ in range(100):
        (shape_a, colour_a, side_a), (shape_b, colour_b, side_b) = _new_shapes(rng, 2)
        early = Shape(shape_a, colour_a, side_a, [_random_centre(rng, side_a)] * FRAMES)
        spot = _place_still(rng, side_b, [early])
        if spot is not None:
            break
    else:  # pragma: no cover - two shapes of at most 22 px always fit in 84x84
        raise RuntimeError("could not place two shapes")
    appears = rng.randint(2, 5)
    late = Shape(shape_b, colour_b, side_b, [None] * appears + [spot] * (FRAMES - appears))
    options = [early, late]
    rng.shuffle(options)
    choices = tuple(obj.name for obj in options)
    stem = "Which shape appears first?"
    return Clip(
        frames=render([early, late], background),
        fps=FPS,
        kind="first",
        question=with_options(stem, choices),
        stem=stem,
        choices=choices,
        answer=LETTERS[options.index(early)],
        reference_thought=f"{early.name} is there from the start; {late.name} comes later",
        objects=[early, late],
        background=background,
    )


_COUNT_WORDS = {0: "never", 1: "once", 2: "twice", 3: "three times"}


def _side_runs(rng: random.Random, crossings: int) -> list[int]:
    """Lengths of the runs of frames spent on one side (crossings + 1 runs, each at least 2 frames)."""
    runs = [2] * (crossings + 1)
    for _ in range(FRAMES - sum(runs)):
        runs[rng.randrange(len(runs))] += 1
    return runs


def _crossings(rng: random.Random, background: str) -> Clip:
    ((shape, colour, side),) = _new_shapes(rng, 1)
    crossings = rng.randint(0, 3)
    runs = _side_runs(rng, crossings)
    first_side = rng.choice((-1, 1))  # -1: left of the line, +1: right
    near, far = CROSSING_CLEARANCE, SIZE // 2 - side // 2 - MARGIN  # distances of the centre from the line
    row = rng.randint(side // 2 + MARGIN, SIZE - side // 2 - MARGIN)
    xs: list[int] = []
    sides: list[int] = []
    for index, length in enumerate(runs):
        sign = first_side * (-1) ** index
        # Within a run the shape goes out from the line and back (a turn), so the crossings look like a motion:
        # a tent of distances from `near` to `far`; the first run may start out far, the last may end far.
        peak = rng.randint(near + (far - near) // 2, far)
        for step in range(length):
            position = step / (length - 1)
            if index == 0 and crossings > 0:
                distance = peak + (near - peak) * position  # heading for the line
            elif index == len(runs) - 1 and crossings > 0:
                distance = near + (peak - near) * position  # leaving it
            else:  # out from the line and back to it (no crossing: a turn on one side)
                distance = near + (peak - near) * (1 - abs(2 * position - 1))
            distance = max(near, min(far, round(distance)))
            xs.append(LINE_X + sign * distance)
            sides.append(sign)
    moving = Shape(shape, colour, side, [(x, row) for x in xs])
    words = [("left" if s < 0 else "right") for s in sides]
    visited = [w for i, w in enumerate(words) if i == 0 or w != words[i - 1]]
    if crossings == 0:
        thought = f"{moving.name} stays on the {visited[0]}: it never crosses"
    else:
        thought = f"{moving.name} goes {', '.join(visited)}: it crosses {_COUNT_WORDS[crossings]}"
    stem = f"How many times does {moving.name} cross the line?"
    return Clip(
        frames=render([moving], background, LINE_X),
        fps=FPS,
        kind="crossings",
        question=stem,
        stem=stem,
        choices=(),
        answer=str(crossings),
        reference_thought=thought,
        objects=[moving],
        background=background,
        line_x=LINE_X,
    )


_MAKERS = {"direction": _direction, "first": _first, "crossings": _crossings}


def make_clip(rng: random.Random, kind: str | None = None) -> Clip:
    """One clip of ``kind`` (one of KINDS; None: drawn from ``rng``); everything follows from ``rng``'s state."""
    if kind is None:
        kind = rng.choice(KINDS)
    if kind not in _MAKERS:
        raise ValueError(f"unknown clip kind {kind!r}; kinds: {', '.join(KINDS)}")
    background = rng.choice(sorted(BACKGROUNDS))
    return _MAKERS[kind](rng, background)


# ---------------------------------------------------------------------------------------------- writing


def write_clip(path: Path | str, frames: Sequence[np.ndarray], fps: int = FPS) -> Path:
    """Encode ``frames`` (HxWx3 uint8, time order, even sides) to an H.264 mp4 at ``fps``; returns the path."""
    import av

    path = Path(path)
    height, width = frames[0].shape[:2]
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options=dict(ENCODER_OPTIONS))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)
    return path


def clip_row(clip: Clip, clip_id: str, video: str) -> dict:
    """The JSONL row of a clip (see the module docstring)."""
    return {
        "id": clip_id,
        "video": video,
        "question": clip.stem,
        "choices": list(clip.choices),
        "answer": clip.answer,
        "kind": clip.kind,
        "reference_thought": clip.reference_thought,
        "fps": clip.fps,
        "frames": len(clip.frames),
    }


def write_split(out_dir: Path, split: str, n: int, seed: int) -> list[dict]:
    """``n`` clips of ``split``, the kinds in equal numbers (shuffled order), written under ``out_dir``."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    clips_dir = out_dir / "clips"
    clips_dir.mkdir(parents=True, exist_ok=True)
    for old in clips_dir.glob(f"{split}_*.mp4"):  # a smaller rerun leaves no stale clips behind
        old.unlink()
    rows = []
    for index, kind in enumerate(kinds):
        clip = make_clip(rng, kind)
        clip_id = f"{split}_{index:05d}"
        write_clip(clips_dir / f"{clip_id}.mp4", clip.frames, clip.fps)
        rows.append(clip_row(clip, clip_id, f"clips/{clip_id}.mp4"))
    with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "video")
    args = parser.parse_args(argv)
    for split, (n, seed) in SPLIT_SIZES_AND_SEEDS.items():
        rows = write_split(args.out_dir, split, n, seed)
        counts = {kind: sum(row["kind"] == kind for row in rows) for kind in KINDS}
        print(f"{split}: {len(rows)} clips {counts} -> {args.out_dir}")


if __name__ == "__main__":
    main()
