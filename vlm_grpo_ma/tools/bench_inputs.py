"""What the benchmarks run on: the models (the embedded one, or untrained ones of each size of
``model/tiny.py``), their prompts, and the tree and repeat settings (``BenchTree``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
from PIL import Image

from vlm_grpo_ma.model.loading import Policy, load_policy
from vlm_grpo_ma.model.prompts import EncodedPrompt, encode_prompt, open_image
from vlm_grpo_ma.model.tiny import SIZES, TINY_MODEL_NAME, build_untrained
from vlm_grpo_ma.run.config import RolloutConfig
from vlm_grpo_ma.task_api.registry import get_task, load_samples

EMBEDDED = "embedded"  # the shipped warm-started model (what `model.name_or_path: tiny` loads elsewhere)
RANDOM = "random-"  # random-<size>: an untrained model of a size of vlm_grpo_ma.model.tiny (not the embedded one)
BENCH_MODELS = (EMBEDDED, *(RANDOM + size for size in SIZES))


def load_bench_policy(name: str, workdir: Path, *, image_size: int | None = None) -> Policy:
    """``embedded``: the shipped model, loaded as the default run loads it. ``random-<size>``, a size of
    ``vlm_grpo_ma.model.tiny``: an untrained model of that size, saved to ``workdir`` and loaded as the trainer loads it.
    A model folder (any supported family, e.g. a Qwen3.5 that ``scripts/check_real_size.py --keep-models`` kept):
    loaded as it is. With ``image_size`` the processor's pixel budget is raised so that a ``image_size`` x
    ``image_size`` image is not shrunk."""
    if name not in BENCH_MODELS and not Path(name).is_dir():
        raise ValueError(f"unknown benchmark model {name!r}; choose from: {', '.join(BENCH_MODELS)}, or a model folder")
    if name == EMBEDDED:
        path = TINY_MODEL_NAME
    elif name in BENCH_MODELS:
        path = str(build_untrained(Path(workdir) / name, size=name.removeprefix(RANDOM)))
    else:
        path = name
    policy = load_policy(path, dtype="float32", attn_implementation="sdpa")
    policy.model.eval()
    if image_size:
        # Set on the image processor, not through load_policy(max_pixels=...): transformers 5.24 warns that
        # min_pixels / max_pixels processor kwargs are deprecated in favour of size={...}.
        image_processor = policy.processor.image_processor
        longest = max(image_processor.size["longest_edge"], image_size * image_size)
        image_processor.size = {
            "shortest_edge": image_processor.size["shortest_edge"],
            "longest_edge": longest,
        }
    return policy


def bench_prompts(policy: Policy, num_prompts: int, *, image_size: int | None = None) -> list[EncodedPrompt]:
    """The first ``num_prompts`` samples of the embedded grounding test split, encoded; with ``image_size``
    each scene is resized (bicubic) to a square of that side first."""
    task = get_task("grounding")
    return [encode_prompt(policy, s, task.instruction) for s in bench_samples(num_prompts, image_size=image_size)]


def bench_samples(num_prompts: int, *, image_size: int | None = None) -> list:
    """The samples ``bench_prompts`` encodes."""
    task = get_task("grounding")
    samples = load_samples(task, "test")[:num_prompts]
    if len(samples) < num_prompts:
        raise ValueError(f"the grounding test split has {len(samples)} samples, fewer than {num_prompts}")
    if image_size:
        samples = [
            dataclasses.replace(
                s,
                images=tuple(open_image(i).resize((image_size, image_size), Image.BICUBIC) for i in s.images),
            )
            for s in samples
        ]
    return samples


@dataclasses.dataclass(frozen=True)
class BenchTree:
    """The tree and repeat settings both benchmarks take: K x M per prompt, token limits, timed repeats after
    ``warmup`` unrecorded rounds, the sampling seed."""

    num_thoughts: int = 4
    num_answers: int = 4
    max_thought_tokens: int = RolloutConfig.max_thought_tokens
    max_answer_tokens: int = RolloutConfig.max_answer_tokens
    repeats: int = 3
    warmup: int = 1
    seed: int = 0


# ----------------------------------------------------------------------------------------------------------
# The command line's shared parts (bench.py and bench_engines.py)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def check_models(args: argparse.Namespace) -> list[str]:
    names = [s.strip() for s in args.models.split(",") if s.strip()]
    unknown = [s for s in names if s not in BENCH_MODELS and not Path(s).is_dir()]
    if unknown:
        raise SystemExit(f"unknown benchmark model(s) {unknown}; choose from: {', '.join(BENCH_MODELS)}, or a model folder")
    if args.threads:
        torch.set_num_threads(args.threads)
    return names


def shared_settings(args: argparse.Namespace) -> BenchTree:
    """The tree and repeat settings both benchmarks take from the command line."""
    return BenchTree(
        num_thoughts=args.thoughts,
        num_answers=args.answers,
        max_thought_tokens=args.thought_tokens,
        max_answer_tokens=args.answer_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
    )


def each_model(names: list[str], args: argparse.Namespace, measure) -> list[dict]:
    """``measure(name, policy, prompts)`` for each model, loaded in turn (one in memory at a time)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="vlm-grpo-ma-bench-") as workdir:
        for name in names:
            policy = load_bench_policy(name, Path(workdir), image_size=args.image_size)
            prompts = bench_prompts(policy, args.prompts, image_size=args.image_size)
            result = measure(name, policy, prompts)
            result["model"] = name
            rows.append(result)
            del policy
    return rows


def write_results(out: Path | None, benchmark: str, rows: list[dict]) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({benchmark: rows}, indent=2) + "\n")
        print(f"wrote {out}")
