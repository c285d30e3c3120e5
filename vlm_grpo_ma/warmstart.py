"""Supervised warm start of the embedded tiny model: ``python -m vlm_grpo_ma.warmstart``.

Two phases, both on scenes drawn fresh at every step from the embedded data's own generator
(``data/make_grounding.py``, seeded apart from the committed train and test splits), so a 1.1M-parameter
model sees tens of thousands of distinct scenes and cannot memorise a few thousand:

1. **Vision.** The vision tower and patch merger of a randomly initialised model (``vlm_grpo_ma.tiny``) learn,
   through small linear heads on each merged image token that are thrown away afterwards, what is under that
   token: its grid place, whether an object covers it, that object's colour, shape and box. A tower trained
   only through the decoder's loss collapsed to near-constant features; a frozen random one encodes the
   token's place but barely its content.
2. **Decoder.** With the tower frozen, the language model learns to write
   ``<think>{reference thought}</think><answer>[x1,y1,x2,y2]</answer>`` (the box in the model's coordinate
   frame, converted by ``coords.from_original_pixels``: the single conversion rewards use in reverse).

Every ``--eval-every`` steps it prints greedy reward and IoU on held-out generated scenes (a third seed; the
committed test split is left for evaluation).

The two committed models (``vlm_grpo_ma.tiny``) were made by this script, each with ``--threads 1`` on this
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
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_grpo_ma.coords import from_original_pixels
from vlm_grpo_ma.lora import freeze_vision, trainable_parameters, vision_tower
from vlm_grpo_ma.policy import Policy, encode_prompt, load_policy, sequence_logprobs
from vlm_grpo_ma.registry import Sample, get_task
from vlm_grpo_ma.tiny import TINY_EXACT_MODEL_DIR, build_untrained

GENERATOR_PATH = Path(__file__).resolve().parents[1] / "data" / "make_grounding.py"
# Scene seeds: the committed splits use 20240101 (train) and 20240202 (test).
VISION_SEED, DECODER_SEED, HELD_OUT_SEED = 31, 32, 33


@functools.cache
def load_scene_generator():
    """``data/make_grounding.py`` as a module (it is a script of the checkout, not part of the package),
    loaded once: every stream and every label shares its classes and vocabularies."""
    if not GENERATOR_PATH.is_file():
        raise FileNotFoundError(f"the warm start needs the scene generator {GENERATOR_PATH} (run it from a checkout)")
    spec = importlib.util.spec_from_file_location("make_grounding", GENERATOR_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_grounding"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


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


# ----------------------------------------------------------------------------------------------------------
# Phase 1: the vision tower


COVERED = 0.1  # a token "has" an object when the object's box covers more than this fraction of it


def scene_vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(colour names, shape names) of the scene generator, in its order: the heads' class indices."""
    generator = load_scene_generator()
    return tuple(generator.COLOURS), tuple(generator.SHAPES)


def token_targets(objects, grid_side: int, image_side: int) -> dict[str, torch.Tensor]:
    """What each merged token (row-major over a ``grid_side`` x ``grid_side`` grid) should encode: its grid
    place (0..1), whether an object's box covers it, and that object's colour, shape and box (0..1); the
    object covering the most of the token wins."""
    colours, shapes = scene_vocabulary()
    cell = image_side / grid_side
    tokens = grid_side * grid_side
    place = torch.zeros(tokens, 2)
    covered = torch.zeros(tokens, dtype=torch.bool)
    colour = torch.zeros(tokens, dtype=torch.long)
    shape = torch.zeros(tokens, dtype=torch.long)
    box = torch.zeros(tokens, 4)
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
    return {"place": place, "covered": covered, "colour": colour, "shape": shape, "box": box}


class TokenHeads(torch.nn.Module):
    """Linear read-outs of a merged image token, used only to train the tower."""

    def __init__(self, width: int):
        super().__init__()
        colours, shapes = scene_vocabulary()
        self.place = torch.nn.Linear(width, 2)
        self.covered = torch.nn.Linear(width, 1)
        self.colour = torch.nn.Linear(width, len(colours))
        self.shape = torch.nn.Linear(width, len(shapes))
        self.box = torch.nn.Linear(width, 4)

    def loss(self, features: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """Regression terms are scaled by 10 so that they weigh about as much as the classification terms."""
        f = torch.nn.functional
        covered = targets["covered"]
        on_object = features[covered]
        return (
            10 * f.mse_loss(self.place(features), targets["place"])
            + f.binary_cross_entropy_with_logits(self.covered(features)[..., 0], covered.float())
            + f.cross_entropy(self.colour(on_object), targets["colour"][covered])
            + f.cross_entropy(self.shape(on_object), targets["shape"][covered])
            + 10 * f.mse_loss(self.box(on_object), targets["box"][covered])
        )


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
    label = loosened(sample.answer, box_margin, sample.meta["width"], sample.meta["height"]) if box_margin else sample.answer
    box = from_original_pixels(label, policy.frame, input_size, original_size)
    coords = ",".join(str(round(v)) for v in box)
    return f"<think>{sample.meta['reference_thought']}</think><answer>[{coords}]</answer>"


def supervised_step(policy: Policy, samples: list[Sample], instruction: str, box_margin: float = 0.0) -> torch.Tensor:
    prompts = [encode_prompt(policy, s, instruction) for s in samples]
    eos = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    targets = [
        policy.tokenizer.encode(
            target_text(policy, s, p.input_sizes[0], p.original_sizes[0], box_margin), add_special_tokens=False
        )
        + [eos]
        for s, p in zip(samples, prompts, strict=True)
    ]
    logprobs = sequence_logprobs(policy, prompts, list(range(len(samples))), targets, temperature=1.0)
    return -logprobs.sum() / sum(len(t) for t in targets)


def held_out_report(policy: Policy, samples: list[Sample], snapshot: Path | None = None) -> str:
    """Greedy held-out metrics as a line; with ``snapshot`` the model is also saved there."""
    from vlm_grpo_ma.evaluate import EvalSettings, evaluate_task

    if snapshot is not None:
        policy.model.save_pretrained(snapshot)
        policy.processor.save_pretrained(snapshot)
    was_training = policy.model.training
    policy.model.eval()
    with torch.no_grad():
        metrics, _ = evaluate_task(policy, get_task("grounding"), samples, EvalSettings(), progress=False)
    policy.model.train(was_training)
    return " ".join(f"{k} {metrics[k]:.3f}" for k in ("reward", "iou", "format", "accuracy") if k in metrics)


# ----------------------------------------------------------------------------------------------------------


def _train(parameters, steps: int, learning_rate: float, step_loss, *, label: str, report=None, report_every: int = 0):
    """AdamW with a 20-step warm-up then a linear decay to a tenth; gradients clipped at 1. ``report`` is
    called every ``report_every`` steps and printed."""
    parameters = list(parameters)
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(steps, 1))
    )
    started = time.perf_counter()
    for step in range(1, steps + 1):
        loss = step_loss()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps:
            print(f"{label} step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - started:.0f}s", flush=True)
        if report is not None and report_every and (step % report_every == 0 or step == steps):
            print(f"{label} step {step:5d}  held-out: {report()}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_EXACT_MODEL_DIR)
    parser.add_argument("--vision-steps", type=int, default=1500)
    parser.add_argument("--decoder-steps", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--vision-learning-rate", type=float, default=2e-3)
    parser.add_argument("--decoder-learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation")
    parser.add_argument("--image-side", type=int, default=168, help="images are resized to at most side x side")
    parser.add_argument("--eval-every", type=int, default=500, help="held-out greedy report every N decoder steps")
    parser.add_argument("--eval-scenes", type=int, default=100)
    parser.add_argument("--snapshot", type=Path, help="also save the model here at every held-out report")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--box-margin", type=float, default=0.0, help="loose labels: grow every target box by this many pixels a side")
    parser.add_argument("--init", type=Path, help="start from this model folder instead of a fresh random model")
    args = parser.parse_args(argv)
    if not args.box_margin >= 0:
        parser.error(f"--box-margin must be a number of pixels >= 0, got {args.box_margin}")

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    init_dir = args.init or build_untrained(
        args.out.with_name(args.out.name + "-init"), seed=args.seed, image_side=args.image_side
    )
    policy = load_policy(str(init_dir), attn_implementation="sdpa")
    policy.model.train()
    visual = vision_tower(policy.model)

    if args.vision_steps:
        heads = TokenHeads(policy.model.config.vision_config.out_hidden_size)
        stream = SceneStream(VISION_SEED)
        _train(
            [*visual.parameters(), *heads.parameters()],
            args.vision_steps,
            args.vision_learning_rate,
            lambda: vision_step(policy, heads, stream.take(args.batch_size)),
            label="vision",
        )
    freeze_vision(policy.model)
    decoder_parameters = trainable_parameters(policy.model)

    task = get_task("grounding")
    stream = SceneStream(DECODER_SEED)
    held_out = [scene.sample for scene in SceneStream(HELD_OUT_SEED).take(args.eval_scenes)]
    _train(
        decoder_parameters,
        args.decoder_steps,
        args.decoder_learning_rate,
        lambda: supervised_step(
            policy, [scene.sample for scene in stream.take(args.batch_size)], task.instruction, args.box_margin
        ),
        label="decoder",
        report=lambda: held_out_report(policy, held_out, snapshot=args.snapshot),
        report_every=args.eval_every,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(args.out)
    policy.processor.save_pretrained(args.out)
    if args.init is None:
        shutil.rmtree(init_dir, ignore_errors=True)
    print(f"wrote the warm-started tiny model to {args.out}")


if __name__ == "__main__":
    main()
