"""largest_colour: "What colour is the largest shape?", a task written from scratch (docs/TASKS.md, "Will my task learn?").

Every scene is drawn here from a seed, in memory, so nothing but this file is needed: 168x168 pictures on a light
background holding 2-4 flat shapes (circle, square, triangle) of distinct colours (red, green, blue, yellow), one
large (38-50 px) and the others small (16-26 px). The answer is the large shape's colour, one word.

- ``load(split)``: ``train`` 400 scenes, ``test`` 100 (other seeds); the same scenes at every call.
- ``reward``: ``accuracy`` (the right colour word in the single ``<answer>`` tag) + 0.5 x ``format``.
- ``target(sample)``: the completion to imitate, ``<think>the large red circle is at the top left</think><answer>red</answer>``
  (the shape and where it is, then the colour), which ``python -m vlm_grpo_ma.warmstart`` trains on.

The embedded model scores 0 on every picture (stray tags, then a box), so RL gets no signal; a short warm
start on this task's own training split gives it one, and RL takes it from there (figures in docs/TASKS.md):

    python -m vlm_grpo_ma.warmstart --task largest_colour --task-module docs/examples/largest_colour.py \
        --steps 200 --threads 1 --out runs/largest_colour-warm
    python -m vlm_grpo_ma.train --task largest_colour "data.task_modules=[docs/examples/largest_colour.py]" \
        model.name_or_path=runs/largest_colour-warm rollout.max_answer_tokens=8 train.steps=100 train.eval_every=25 \
        train.num_threads=1
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from vlm_grpo_ma.task_api import (
    Sample,
    Task,
    extract_tag,
    has_think_answer_format,
    normalise_answer,
    register_task,
    weighted_reward,
)

NAME = "largest_colour"
SIDE = 168
COLOURS = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 90, 215), "yellow": (235, 190, 20)}
SHAPES = ("circle", "square", "triangle")
SPLITS = {"train": (400, 101), "test": (100, 202)}  # scenes, seed
WEIGHTS = {"accuracy": 1.0, "format": 0.5}
QUESTION = "What colour is the largest shape?"


def _free_corner(rng: random.Random, side: int, taken: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """A top-left corner for a ``side`` square that keeps 4 px from the others and 3 px from the border."""
    for _ in range(200):
        x, y = rng.randint(3, SIDE - 3 - side), rng.randint(3, SIDE - 3 - side)
        if all(x + side + 4 <= tx or tx + ts + 4 <= x or y + side + 4 <= ty or ty + ts + 4 <= y for tx, ty, ts in taken):
            return x, y
    return None


def _region(x: int, y: int, side: int) -> str:
    """Where a shape's centre is on a 3x3 grid: "at the top left", ..., "in the centre"."""
    vertical = ("top", "middle", "bottom")[min(int(3 * (y + side / 2) / SIDE), 2)]
    horizontal = ("left", "centre", "right")[min(int(3 * (x + side / 2) / SIDE), 2)]
    return "in the centre" if (vertical, horizontal) == ("middle", "centre") else f"at the {vertical} {horizontal}"


def _background(shade: int) -> Image.Image:
    """A light background whose red falls from left to right and blue from top to bottom, as the embedded scenes'."""
    ramp = [round(shade - 120 * i / (SIDE - 1)) for i in range(SIDE)]
    red, blue = Image.new("L", (SIDE, 1)), Image.new("L", (1, SIDE))
    red.putdata(ramp)
    blue.putdata([value - 5 for value in ramp])
    size = (SIDE, SIDE)
    return Image.merge("RGB", (red.resize(size), Image.new("L", size, shade - 3), blue.resize(size)))


def make_scene(rng: random.Random) -> tuple[Image.Image, dict]:
    """One picture and what its large shape is: {"colour", "shape", "region"}."""
    while True:
        count = rng.randint(2, 4)
        sides = [rng.randint(38, 50)] + [rng.randint(16, 26) for _ in range(count - 1)]
        taken: list[tuple[int, int, int]] = []
        for side in sides:
            corner = _free_corner(rng, side, taken)
            if corner is None:
                break
            taken.append((*corner, side))
        if len(taken) == count:
            break
    image = _background(rng.randint(232, 250))
    draw = ImageDraw.Draw(image)
    colours = rng.sample(sorted(COLOURS), count)
    shapes = [rng.choice(SHAPES) for _ in range(count)]
    for (x, y, side), colour, shape in zip(taken, colours, shapes, strict=True):
        corners = (x, y, x + side - 1, y + side - 1)
        if shape == "circle":
            draw.ellipse(corners, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(corners, fill=COLOURS[colour])
        else:  # apex up
            draw.polygon([(x, y + side - 1), (x + side - 1, y + side - 1), (x + (side - 1) / 2, y)], fill=COLOURS[colour])
    x, y, side = taken[0]
    return image, {"colour": colours[0], "shape": shapes[0], "region": _region(x, y, side)}


def load(split="train", source=None):
    if source is not None:
        raise ValueError(f"task {NAME} draws its own scenes and reads no file (got source={source!r})")
    if split not in SPLITS:
        raise ValueError(f"task {NAME} has the splits {', '.join(SPLITS)}, not {split!r}")
    count, seed = SPLITS[split]
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        image, large = make_scene(rng)
        samples.append(Sample(NAME, f"{split}-{index:03d}", QUESTION, (image,), large["colour"], meta=large))
    return samples


def reward(completion, sample):
    answer = extract_tag(completion.text, "answer")  # None unless exactly one complete <answer> tag
    parts = {
        "accuracy": float(answer is not None and normalise_answer(answer) == sample.answer),
        "format": float(answer is not None and has_think_answer_format(completion.text)),
    }
    parts["reward"] = weighted_reward(parts, WEIGHTS)
    return parts


def target(sample):
    """The large shape, where it is, then its colour: what a model that sees the picture would write."""
    meta = sample.meta
    return f"<think>the large {meta['colour']} {meta['shape']} is {meta['region']}</think><answer>{meta['colour']}</answer>"


TASK = register_task(Task(
    name=NAME, load=load, reward=reward, target=target,
    instruction="Think in <think></think>, then answer with one colour word in <answer></answer>.",
    metrics=("accuracy", "format"), reward_weights=dict(WEIGHTS), success="accuracy",
))
