"""Supervised warm start before RL: ``python -m vlm_grpo_ma.warmstart --task NAME [--task-module PATH]``.

**Any registered task**, built-in or out of tree (``--task-module``, as ``data.task_modules`` names them): a
supervised cold start on its own training split, imitating ``Task.target`` (``tools/task_warmstart.py``); a task
without ``target`` is refused in one line.

**The embedded models' recipes** (``--task grounding|counting|video``) learn from generated scenes instead, in two
phases, both on scenes drawn fresh at every step from the embedded data's own generator
(``data/make_grounding.py``; with ``--task counting``, the picture problems of ``data/make_math.py``; with
``--task video``, the clips of ``data/make_video.py``, each a pair of frames per temporal patch), seeded
apart from the committed train and test splits, so a 1.1M-parameter model sees tens of thousands of distinct
scenes and cannot memorise a few thousand:

1. **Vision.** The vision tower and patch merger of a randomly initialised model (``vlm_grpo_ma.model.tiny``) learn,
   through small linear heads on each merged image token that are thrown away afterwards, what is under that
   token: its grid place, whether an object covers it, that object's colour, shape and box. A tower trained
   only through the decoder's loss collapsed to near-constant features; a frozen random one encodes the
   token's place but barely its content.
   Counting adds a head for the number of object centres under each token (two small shapes can share one).
   Video trains the heads on every temporal patch's tokens (``video_vision_step``).
2. **Decoder.** With the tower frozen, the language model learns to write
   ``<think>{reference thought}</think><answer>[x1,y1,x2,y2]</answer>`` (the box in the model's coordinate
   frame, converted by ``coords.from_original_pixels``: the single conversion rewards use in reverse); for
   counting, ``<think>{the inventory and the sum}</think><answer>{number}</answer>``.

Every ``--eval-every`` steps it prints greedy held-out metrics on generated scenes (a third seed, true labels;
the committed test split is left for evaluation).

The three committed models (``vlm_grpo_ma.model.tiny``) were made by this script, each with ``--threads 1`` on this
project's 2-core CPU machine:

- ``vlm_grpo_ma/assets/tiny-qwen2.5-vl-exact``: the defaults (about 90 minutes). It stops before convergence on
  purpose.
- ``vlm_grpo_ma/assets/tiny-qwen2.5-vl`` (``model.name_or_path: tiny``, where the RL run starts): the exact
  model, fine-tuned on **loose boxes**, ``--init vlm_grpo_ma/assets/tiny-qwen2.5-vl-exact --vision-steps 0
  --decoder-steps 150 --box-margin 10 --out vlm_grpo_ma/assets/tiny-qwen2.5-vl`` (a few minutes): every label
  box grown by 10 pixels a side (clipped to the image), thoughts unchanged; re-running it re-makes the
  committed weights to the byte. Loose boxes are a common flaw of real annotations. The model learns to draw
  boxes about 1.6 times the true size; the IoU reward pays for the true box, so RL has a real, measurable error
  to correct on scenes it never saw, rather than only sharpening what greedy decoding already does.
- ``vlm_grpo_ma/assets/tiny-qwen2.5-vl-count`` (``configs/tiny-counting.yaml``, the study's long-thought
  regime): the exact model's tower and decoder, trained on counting pictures with **arithmetic slips**,
  ``--task counting --init vlm_grpo_ma/assets/tiny-qwen2.5-vl-exact --vision-steps 400 --decoder-steps 300
  --slip-rate 0.6 --max-thought-tokens 64 --out vlm_grpo_ma/assets/tiny-qwen2.5-vl-count`` (about 6
  minutes): 60% of the ``sum`` and ``add`` labels end their thought one short ("1 + 1 = 1") and answer that.
  The model writes such thoughts and answers what they say: held-out greedy accuracy 0.25 on generated
  pictures (0.42 without slips, same command with ``--slip-rate 0``), a flaw in the reasoning that a
  correctness reward can pay to remove.
- ``vlm_grpo_ma/assets/tiny-qwen2.5-vl-video`` (``configs/tiny-video.yaml``, the video task): the exact model,
  its tower fine-tuned on the clips' frames (per temporal patch: the shapes either frame of the pair shows) and
  its decoder on clips with **miscounted crossings**, ``--task video --init vlm_grpo_ma/assets/tiny-qwen2.5-vl-exact
  --vision-steps 300 --decoder-steps 800 --slip-rate 0.6 --max-thought-tokens 40 --threads 2 --out
  vlm_grpo_ma/assets/tiny-qwen2.5-vl-video`` (about 17 minutes): 60% of the crossings labels with a crossing
  count one short. On the 150 test clips (greedy): direction 1.00; crossings 0.34, every slip as trained (its
  sides right, the count one short); which-first 0.52: its thought names the right shape on 0.96 of them but
  the option letter it then answers is chance (labels that were always right did not teach it in 800 steps).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_grpo_ma.model.loading import Policy, load_policy
from vlm_grpo_ma.model.lora import freeze_vision, trainable_parameters, vision_tower
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.model.tiny import (
    TINY_COUNT_MODEL_DIR,
    TINY_EXACT_MODEL_DIR,
    TINY_VIDEO_MODEL_DIR,
    build_untrained,
)
from vlm_grpo_ma.run.evaluation import EvalSettings
from vlm_grpo_ma.task_api.coords import from_original_pixels
from vlm_grpo_ma.task_api.registry import Sample, get_task, import_task_modules
from vlm_grpo_ma.tools.task_warmstart import (
    GENERIC_DEFAULTS,
    STREAM_DEFAULTS,
    completion_loss,
    held_out_metrics,
    metrics_line,
    refuse,
    train_supervised,
    warm_start_from_args,
)

DATA_SCRIPTS = Path(__file__).resolve().parents[2] / "data"
# Scene seeds: the committed grounding splits use 20240101 (train) and 20240202 (test), the math splits
# 20240505 and 20240606, the counting splits 20240707 and 20240808.
VISION_SEED, DECODER_SEED, HELD_OUT_SEED = 31, 32, 33


@functools.cache
def load_generator(name: str):
    """``data/{name}.py`` as a module (a script of the checkout, not part of the package), loaded once:
    every stream and every label shares its classes and vocabularies."""
    path = DATA_SCRIPTS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"the warm start needs the scene generator {path} (run it from a checkout)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def load_scene_generator():
    """The grounding scene generator, ``data/make_grounding.py``."""
    return load_generator("make_grounding")


@dataclass(frozen=True)
class Scene:
    sample: Sample
    objects: tuple  # make_grounding.SceneObject, in the scene's order


class SceneStream:
    """Fresh generated grounding scenes, as Samples the grounding task scores, reproducible from ``seed``."""

    def __init__(self, seed: int):
        # The grounding task writes the question ("Locate: <expression>."); its module is reached through the
        # registry, so the core imports no task by name.
        grounding = sys.modules[get_task("grounding").reward.__module__]

        self._generator = load_scene_generator()
        self._question_for = grounding.question_for
        self._rng = random.Random(seed)
        self._seed = seed
        self._count = 0

    def take(self, n: int) -> list[Scene]:
        scenes = []
        size = self._generator.IMAGE_SIZE
        for _ in range(n):
            image, objects, target_index, expression = self._generator.make_scene(self._rng)
            target = objects[target_index]
            sample = Sample(
                task="grounding",
                id=f"generated-{self._seed}-{self._count}",
                question=self._question_for(expression),
                images=(image,),
                answer=[float(v) for v in target.box],
                meta={"width": size, "height": size, "reference_thought": self._generator.reference_thought(target, size, size)},
            )
            scenes.append(Scene(sample, tuple(objects)))
            self._count += 1
        return scenes


class CountingStream:
    """Fresh counting pictures from the math data's generator (``data/make_math.py``: its picture kinds
    only, so every answer is read off the image), as Samples the math task scores.

    ``slip_rate``: the share of ``sum`` and ``add`` problems whose label carries an arithmetic slip, the last
    step of the thought and the answer one less than the truth ("2 + 3 = 4", answer 4). A model that learns
    from such labels writes a wrong sum in its thought, then answers what its thought says: a flaw of the
    reasoning, not of the answer, which RL with a correctness reward can find and fix (the counting regime's
    counterpart of the grounding warm start's loose boxes). The slips are drawn apart from the scenes, so
    any rate gives the same pictures and questions."""

    SLIPPED_KINDS = ("sum", "add")

    def __init__(self, seed: int, slip_rate: float = 0.0):
        self._generator = load_generator("make_math")
        self._rng = random.Random(seed)
        self._slips = random.Random(seed + 1_000_003)
        self._slip_rate = slip_rate
        self._seed = seed
        self._count = 0

    def take(self, n: int) -> list[Scene]:
        scenes = []
        for _ in range(n):
            image, objects = self._generator.make_scene(self._rng)
            question, answer, thought, program = self._generator.image_problem(self._rng, objects)
            if program["kind"] in self.SLIPPED_KINDS and self._slips.random() < self._slip_rate:
                thought, answer = slipped(thought, answer)
            sample = Sample(
                task="math",
                id=f"generated-{self._seed}-{self._count}",
                question=question,
                images=(image,),
                answer=str(answer),
                meta={"source": "project", "precision": None, "reference_thought": thought},
            )
            scenes.append(Scene(sample, tuple(SceneObject(o["shape"], o["colour"], tuple(o["box"])) for o in objects)))
            self._count += 1
        return scenes


class VideoStream:
    """Fresh clips from the video data's generator (``data/make_video.py::make_clip``), written as mp4 files (so
    the warm start reads them as the RL run does, through PyAV) into a scratch folder, as Samples the video task
    scores (its own row reader: one way to build a video sample).

    ``slip_rate``: the share of ``crossings`` clips (with at least one crossing) whose label miscounts: the
    thought lists the sides the shape visits as they are, then counts one crossing fewer ("left, right, left:
    it crosses once"), and the answer follows it. A model trained on such labels reads the clip and then
    counts short, a flaw of the reasoning that a correctness reward can pay to remove, as the counting warm
    start's slips are. The slips are drawn apart from the clips, so any rate gives the same clips."""

    def __init__(self, seed: int, slip_rate: float = 0.0):
        import tempfile

        self._generator = load_generator("make_video")
        self._rows = sys.modules[get_task("video").reward.__module__]
        self._rng = random.Random(seed)
        self._slips = random.Random(seed + 1_000_003)
        self._slip_rate = slip_rate
        self._folder = Path(tempfile.mkdtemp(prefix=f"warmstart-video-{seed}-"))
        self._seed = seed
        self._count = 0

    def take(self, n: int) -> list[Scene]:
        scenes = []
        for _ in range(n):
            clip = self._generator.make_clip(self._rng)
            # one file per slot of a batch: a batch's clips are encoded before the next batch overwrites them
            path = self._folder / f"{self._count % 4096}.mp4"
            self._generator.write_clip(path, clip.frames, clip.fps)
            row = self._generator.clip_row(clip, f"generated-{self._seed}-{self._count}", str(path))
            if clip.kind == "crossings" and int(row["answer"]) > 0 and self._slips.random() < self._slip_rate:
                row = miscounted(row)
            sample = self._rows._project_sample(row, row["id"], self._folder, f"generated clip {self._count}")
            scenes.append(Scene(sample, patch_objects(clip)))
            self._count += 1
        return scenes


COUNT_WORDS = ("never", "once", "twice", "three times")


def miscounted(row: dict) -> dict:
    """A ``crossings`` row (one or more crossings) whose thought counts one crossing fewer, and the answer that
    follows it; the sides listed are left as they are."""
    count = int(row["answer"])
    thought = row["reference_thought"]
    ending = f"it crosses {COUNT_WORDS[count]}"
    if count < 1 or not thought.endswith(ending):
        raise ValueError(f"a miscounted thought needs one or more crossings and to end with {ending!r}, got {thought!r}")
    fewer = "it never crosses" if count == 1 else f"it crosses {COUNT_WORDS[count - 1]}"
    return {**row, "reference_thought": thought[: -len(ending)] + fewer, "answer": str(count - 1)}


def patch_objects(clip) -> tuple:
    """What each temporal patch (a pair of frames, which the vision tower sees as one) shows: per pair, the
    shapes drawn in either frame, each with its box in the later frame it is drawn in."""
    pairs = []
    for first in range(0, len(clip.frames), 2):
        shown = []
        for obj in clip.objects:
            centres = [c for c in obj.centres[first : first + 2] if c is not None]
            if centres:
                x, y = centres[-1]
                half = obj.side / 2
                shown.append(SceneObject(obj.shape, obj.colour, (x - half, y - half, x + half, y + half)))
        pairs.append(tuple(shown))
    return tuple(pairs)


def slipped(thought: str, answer: int) -> tuple[str, int]:
    """A thought ending "... = {answer}." and its answer, with the result one less."""
    ending = f"= {answer}."
    if not thought.endswith(ending):
        raise ValueError(f"a slipped thought must end with {ending!r}, got {thought!r}")
    return thought[: -len(ending)] + f"= {answer - 1}.", answer - 1


@dataclass(frozen=True)
class SceneObject:
    """What the vision targets read of an object (the math generator writes its objects as dicts)."""

    shape: str
    colour: str
    box: tuple


# What each --task warm-starts: the stream of generated scenes and the registered task that scores them.
STREAMS = {"grounding": SceneStream, "counting": CountingStream, "video": VideoStream}
SCORED_BY = {"grounding": "grounding", "counting": "math", "video": "video"}


# ----------------------------------------------------------------------------------------------------------
# Phase 1: the vision tower


COVERED = 0.1  # a token "has" an object when the object's box covers more than this fraction of it


def scene_vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(colour names, shape names) of the scene generator, in its order: the heads' class indices."""
    generator = load_scene_generator()
    return tuple(generator.COLOURS), tuple(generator.SHAPES)


def token_targets(objects, grid_side: int, image_side: int) -> dict[str, torch.Tensor]:
    """What each merged token (row-major over a ``grid_side`` x ``grid_side`` grid) should encode: its grid
    place (0..1), whether an object's box covers it, and that object's colour, shape and box (0..1), the
    object covering the most of the token winning; and how many objects have their box centre in it (two
    small objects can share a token, which counting must see)."""
    colours, shapes = scene_vocabulary()
    cell = image_side / grid_side
    tokens = grid_side * grid_side
    place = torch.zeros(tokens, 2)
    covered = torch.zeros(tokens, dtype=torch.bool)
    colour = torch.zeros(tokens, dtype=torch.long)
    shape = torch.zeros(tokens, dtype=torch.long)
    box = torch.zeros(tokens, 4)
    centres = torch.zeros(tokens)
    for obj in objects:
        x, y = (obj.box[0] + obj.box[2]) / 2, (obj.box[1] + obj.box[3]) / 2
        row, col = min(int(y // cell), grid_side - 1), min(int(x // cell), grid_side - 1)
        centres[row * grid_side + col] += 1
    for row in range(grid_side):
        for col in range(grid_side):
            k = row * grid_side + col
            place[k] = torch.tensor([row, col]) / max(grid_side - 1, 1)
            x0, y0, x1, y1 = col * cell, row * cell, (col + 1) * cell, (row + 1) * cell
            best, best_object = COVERED, None
            for obj in objects:
                b = obj.box
                overlap = max(0, min(x1, b[2]) - max(x0, b[0])) * max(0, min(y1, b[3]) - max(y0, b[1])) / cell**2
                if overlap > best:
                    best, best_object = overlap, obj
            if best_object is not None:
                covered[k] = True
                colour[k] = colours.index(best_object.colour)
                shape[k] = shapes.index(best_object.shape)
                box[k] = torch.tensor(best_object.box, dtype=torch.float32) / image_side
    return {"place": place, "covered": covered, "colour": colour, "shape": shape, "box": box, "centres": centres}


class TokenHeads(torch.nn.Module):
    """Linear read-outs of a merged image token, used only to train the tower. ``count_centres`` adds a head
    for the number of object centres in the token (the counting warm start; the grounding one was made
    without it)."""

    def __init__(self, width: int, *, count_centres: bool = False):
        super().__init__()
        colours, shapes = scene_vocabulary()
        self.place = torch.nn.Linear(width, 2)
        self.covered = torch.nn.Linear(width, 1)
        self.colour = torch.nn.Linear(width, len(colours))
        self.shape = torch.nn.Linear(width, len(shapes))
        self.box = torch.nn.Linear(width, 4)
        self.centres = torch.nn.Linear(width, 1) if count_centres else None

    def loss(self, features: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """Regression terms are scaled by 10 so that they weigh about as much as the classification terms."""
        f = torch.nn.functional
        covered = targets["covered"]
        on_object = features[covered]
        loss = (
            10 * f.mse_loss(self.place(features), targets["place"])
            + f.binary_cross_entropy_with_logits(self.covered(features)[..., 0], covered.float())
            + f.cross_entropy(self.colour(on_object), targets["colour"][covered])
            + f.cross_entropy(self.shape(on_object), targets["shape"][covered])
            + 10 * f.mse_loss(self.box(on_object), targets["box"][covered])
        )
        if self.centres is not None:
            loss = loss + f.mse_loss(self.centres(features)[..., 0], targets["centres"])
        return loss


def video_vision_step(policy: Policy, heads: TokenHeads, scenes: list[Scene]) -> torch.Tensor:
    """The vision phase on clips: the tower runs on each clip's frames as the model sees them (pairs of frames
    per temporal patch) and every merged token of every pair learns what that pair shows there
    (``patch_objects``)."""
    prompts = [encode_prompt(policy, scene.sample, "") for scene in scenes]
    grid = torch.cat([p.video_grid_thw for p in prompts])
    merge = policy.model.config.vision_config.spatial_merge_size
    rows, cols = int(grid[0, 1]) // merge, int(grid[0, 2]) // merge
    if rows != cols or not bool((grid == grid[0]).all()):
        raise ValueError(f"the video vision warm start expects square clips of one size, got grids {grid.tolist()}")
    output = policy.model.model.get_image_features(torch.cat([p.pixel_values_videos for p in prompts]), grid, return_dict=True)
    features = torch.stack(list(output.pooler_output))  # [clips, pairs * tokens, width], pair-major
    side = rows * policy.patch_factor
    per_clip = []
    for scene in scenes:
        pairs = [token_targets(objects, rows, side) for objects in scene.objects]
        per_clip.append({key: torch.cat([pair[key] for pair in pairs]) for key in pairs[0]})
    targets = {key: torch.stack([t[key] for t in per_clip]) for key in per_clip[0]}
    return heads.loss(features, targets)


def vision_step(policy: Policy, heads: TokenHeads, scenes: list[Scene]) -> torch.Tensor:
    images = [scene.sample.images[0] for scene in scenes]
    encoded = policy.processor.image_processor(images=images, return_tensors="pt")
    grid = encoded["image_grid_thw"]
    merge = policy.model.config.vision_config.spatial_merge_size
    rows, cols = int(grid[0, 1]) // merge, int(grid[0, 2]) // merge
    if rows != cols or not bool((grid == grid[0]).all()):
        raise ValueError(f"the vision warm start expects square scenes of one size, got grids {grid.tolist()}")
    output = policy.model.model.get_image_features(encoded["pixel_values"], grid, return_dict=True)
    features = torch.stack(list(output.pooler_output))  # [scenes, tokens, width]
    side = images[0].size[0]
    per_scene = [token_targets(scene.objects, rows, side) for scene in scenes]
    targets = {key: torch.stack([t[key] for t in per_scene]) for key in per_scene[0]}
    return heads.loss(features, targets)


# ----------------------------------------------------------------------------------------------------------
# Phase 2: the decoder


def loosened(box, margin: float, width: int, height: int) -> list[float]:
    """``box`` grown by ``margin`` pixels on every side and clipped to the image: a loose annotation."""
    x1, y1, x2, y2 = box
    return [max(0.0, x1 - margin), max(0.0, y1 - margin), min(float(width), x2 + margin), min(float(height), y2 + margin)]


def target_text(policy: Policy, sample: Sample, input_size, original_size, box_margin: float = 0.0) -> str:
    """The supervised completion: the reference thought, then the answer (a grounding box in the model's
    frame, loosened by ``box_margin``; any other task's answer as written)."""
    if sample.task != "grounding":
        return f"<think>{sample.meta['reference_thought']}</think><answer>{sample.answer}</answer>"
    label = loosened(sample.answer, box_margin, sample.meta["width"], sample.meta["height"]) if box_margin else sample.answer
    box = from_original_pixels(label, policy.frame, input_size, original_size)
    coords = ",".join(str(round(v)) for v in box)
    return f"<think>{sample.meta['reference_thought']}</think><answer>[{coords}]</answer>"


def supervised_step(policy: Policy, samples: list[Sample], instruction: str, box_margin: float = 0.0) -> torch.Tensor:
    """The decoder phase's loss on generated samples, their completions written by ``target_text``."""
    prompts = [encode_prompt(policy, s, instruction) for s in samples]
    texts = [
        target_text(policy, s, p.input_sizes[0] if p.input_sizes else None, p.original_sizes[0] if p.original_sizes else None, box_margin)
        for s, p in zip(samples, prompts, strict=True)
    ]
    return completion_loss(policy, prompts, texts)


def held_out_report(policy: Policy, samples: list[Sample], settings: EvalSettings | None = None, snapshot: Path | None = None) -> str:
    """Greedy held-out metrics as a line; with ``snapshot`` the model is also saved there."""
    if snapshot is not None:
        policy.model.save_pretrained(snapshot)
        policy.processor.save_pretrained(snapshot)
    task = get_task(samples[0].task)
    return metrics_line(task, held_out_metrics(policy, task, samples, settings or EvalSettings(), "held-out"))


# ----------------------------------------------------------------------------------------------------------
# The command line


# Flags of one path only: the generated streams' vision phase and scene size, and the generic path's choices.
STREAM_ONLY = {"vision_steps": "--vision-steps", "vision_learning_rate": "--vision-learning-rate",
               "image_side": "--image-side", "snapshot": "--snapshot"}  # fmt: skip
GENERIC_ONLY = {"lora_rank": "--lora-rank", "train_vision": "--train-vision", "eval_split": "--eval-split", "dtype": "--dtype"}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo_ma.warmstart", description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="grounding",
                        help="the task to warm-start: grounding, counting (pictures scored by the math task) and video"
                             " learn from generated scenes (the committed models' recipes); any other registered task"
                             " from its own training split, imitating its Task.target")
    parser.add_argument("--task-module", action="append", default=[],
                        help="extra task module, as data.task_modules takes them (dotted name or .py path); repeatable")
    parser.add_argument("--model", "--init", dest="init", metavar="MODEL",
                        help="the model to start from: a model folder, a hub id or 'tiny' (default: 'tiny'; for the"
                             " generated streams a fresh random tiny model)")
    parser.add_argument("--out", type=Path,
                        help="model folder to write (default: the committed one of grounding, counting, video; else"
                             " runs/<task>-warm)")
    parser.add_argument("--vision-steps", type=int, help="generated streams: vision phase steps (default 1500)")
    parser.add_argument("--steps", "--decoder-steps", dest="decoder_steps", type=int, metavar="N",
                        help=f"supervised steps on the completions (default {GENERIC_DEFAULTS['decoder_steps']}; generated"
                             f" streams {STREAM_DEFAULTS['decoder_steps']})")
    parser.add_argument("--batch-size", type=int, help=f"samples a step (default {GENERIC_DEFAULTS['batch_size']};"
                                                        f" generated streams {STREAM_DEFAULTS['batch_size']})")
    parser.add_argument("--vision-learning-rate", type=float, help="generated streams: the vision phase's (default 2e-3)")
    parser.add_argument("--learning-rate", "--decoder-learning-rate", dest="decoder_learning_rate", type=float, metavar="RATE",
                        help=f"AdamW peak rate, 20 steps of warm-up then a linear decay to a tenth (default"
                             f" {GENERIC_DEFAULTS['decoder_learning_rate']:g}, for the embedded model; a real Qwen-VL"
                             f" model wants about 1e-5, or 1e-4 with --lora-rank; generated streams"
                             f" {STREAM_DEFAULTS['decoder_learning_rate']:g})")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank on the decoder and merge them into the saved weights"
                             " (default 0: train the weights themselves)")
    parser.add_argument("--train-vision", action="store_true", help="train the vision tower too (default: frozen)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the order of the training samples; for the generated streams, the model initialisation")
    parser.add_argument("--image-side", type=int, help="generated streams: images resized to at most side x side (168)")
    parser.add_argument("--eval-split", help="the held-out split scored before and after (default: test)")
    parser.add_argument("--eval-every", type=int, help="also a held-out greedy report every N steps (default: none;"
                                                       " generated streams 500)")
    parser.add_argument("--eval-samples", "--eval-scenes", dest="eval_scenes", type=int, default=100, metavar="N",
                        help="held-out samples scored (default 100)")
    parser.add_argument("--max-thought-tokens", type=int, default=40, help="thought limit of the held-out scoring")
    parser.add_argument("--max-answer-tokens", type=int, default=24, help="answer limit of the held-out scoring")
    parser.add_argument("--max-turns", type=int, default=3, help="tool calls a held-out thought may make (tasks with tools)")
    parser.add_argument("--snapshot", type=Path, help="generated streams: also save the model at every held-out report")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights while training and saved (default float32)")
    parser.add_argument("--box-margin", type=float, default=0.0, help="loose labels: grow every target box by this many pixels a side")
    parser.add_argument("--slip-rate", type=float, default=0.0,
                        help="counting: the share of sum and add labels with an arithmetic slip (see CountingStream);"
                             " video: the share of crossings labels counted one short (see VideoStream)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # as train and evaluate: a missing module file, an unknown task (listing the known ones), a duplicate name
        import_task_modules(args.task_module)
        get_task(SCORED_BY.get(args.task, args.task))  # counting is a stream the math task scores
    except ImportError as error:  # a dotted module that is not on the path
        refuse(f"--task-module: {error}")
    except KeyError as error:  # an unknown task: the registry lists the known ones
        refuse(f"{error.args[0]} (or counting, the generated counting pictures)")
    except (ValueError, FileNotFoundError) as error:
        refuse(error.args[0] if error.args else str(error))
    if args.task not in STREAMS:
        given = [flag for name, flag in STREAM_ONLY.items() if getattr(args, name) is not None]
        if given:
            refuse(f"{', '.join(given)} belong to the generated streams (grounding, counting, video); task {args.task!r}"
                   " warm-starts from its own training split (--train-vision trains its vision tower)")  # fmt: skip
    else:
        given = [flag for name, flag in GENERIC_ONLY.items() if getattr(args, name) not in (None, 0, False)]
        if given:
            refuse(f"{', '.join(given)}: --task {args.task} warm-starts from generated scenes with the committed models'"
                   " recipe; these flags are for any other task")  # fmt: skip
    if not args.box_margin >= 0:
        parser.error(f"--box-margin must be a number of pixels >= 0, got {args.box_margin}")
    if args.box_margin and args.task != "grounding":
        parser.error(f"--box-margin loosens grounding boxes; --task {args.task} has none")
    if not 0 <= args.slip_rate <= 1:
        parser.error(f"--slip-rate must be a share in [0, 1], got {args.slip_rate}")
    if args.slip_rate and args.task not in ("counting", "video"):
        parser.error(f"--slip-rate puts slips in counting and video labels; --task {args.task} has none")
    settings = EvalSettings(max_thought_tokens=args.max_thought_tokens, max_answer_tokens=args.max_answer_tokens, max_turns=args.max_turns)
    if args.task not in STREAMS:
        warm_start_from_args(args, settings)
        return
    for name, default in {**STREAM_DEFAULTS, "vision_steps": 1500, "vision_learning_rate": 2e-3, "image_side": 168,
                          "eval_every": 500}.items():  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, default)
    out = args.out or {"grounding": TINY_EXACT_MODEL_DIR, "counting": TINY_COUNT_MODEL_DIR, "video": TINY_VIDEO_MODEL_DIR}[args.task]
    make_stream = STREAMS[args.task]

    torch.manual_seed(args.seed)
    init_dir = args.init or build_untrained(
        out.with_name(out.name + "-init"), seed=args.seed, image_side=args.image_side
    )
    policy = load_policy(str(init_dir), attn_implementation="sdpa")
    policy.model.train()
    visual = vision_tower(policy.model)

    if args.vision_steps:
        heads = TokenHeads(policy.model.config.vision_config.out_hidden_size, count_centres=args.task == "counting")
        stream = make_stream(VISION_SEED)
        train_supervised(
            [*visual.parameters(), *heads.parameters()],
            args.vision_steps,
            args.vision_learning_rate,
            lambda: (video_vision_step if args.task == "video" else vision_step)(policy, heads, stream.take(args.batch_size)),
            label="vision",
        )
    freeze_vision(policy.model)
    decoder_parameters = trainable_parameters(policy.model)

    task = get_task(SCORED_BY[args.task])
    if args.task == "counting":
        stream = CountingStream(DECODER_SEED, args.slip_rate)
    elif args.task == "video":
        stream = VideoStream(DECODER_SEED, args.slip_rate)
    else:
        stream = make_stream(DECODER_SEED)
    held_out = [scene.sample for scene in make_stream(HELD_OUT_SEED).take(args.eval_scenes)]  # true labels
    train_supervised(
        decoder_parameters,
        args.decoder_steps,
        args.decoder_learning_rate,
        lambda: supervised_step(
            policy, [scene.sample for scene in stream.take(args.batch_size)], task.instruction, args.box_margin
        ),
        label="decoder",
        report=lambda: held_out_report(policy, held_out, settings, snapshot=args.snapshot),
        report_every=args.eval_every,
    )
    out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(out)
    policy.processor.save_pretrained(out)
    if args.init is None:
        shutil.rmtree(init_dir, ignore_errors=True)
    print(f"wrote the warm-started tiny model to {out}")
