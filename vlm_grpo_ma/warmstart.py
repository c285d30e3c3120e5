"""Supervised warm start of the embedded tiny model: ``python -m vlm_grpo_ma.warmstart``.

Trains the randomly initialised tiny Qwen2.5-VL (``vlm_grpo_ma.tiny``) to write
``<think>{reference thought}</think><answer>[x1,y1,x2,y2]</answer>`` on the embedded grounding train split
(box in the model's coordinate frame, converted by ``coords.from_original_pixels``: the same single
conversion rewards use in reverse). It stops early on purpose: the RL run should start from a policy
that has learned the format and gets boxes partly right, so that GRPO-MA has room to improve it.
The committed weights in ``vlm_grpo_ma/assets/tiny-qwen2.5-vl`` were made by this script with its defaults.
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path

import torch

from vlm_grpo_ma.coords import from_original_pixels
from vlm_grpo_ma.policy import Policy, encode_prompt, load_policy, sequence_logprobs
from vlm_grpo_ma.registry import Sample, get_task
from vlm_grpo_ma.tiny import TINY_MODEL_DIR, build_untrained


def target_text(policy: Policy, sample: Sample, input_size, original_size) -> str:
    box = from_original_pixels(sample.answer, policy.frame, input_size, original_size)
    coords = ",".join(str(round(v)) for v in box)
    return f"<think>{sample.meta['reference_thought']}</think><answer>[{coords}]</answer>"


def supervised_step(policy: Policy, samples: list[Sample], instruction: str) -> torch.Tensor:
    prompts = [encode_prompt(policy, s, instruction) for s in samples]
    eos = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    targets = [
        policy.tokenizer.encode(target_text(policy, s, p.input_sizes[0], p.original_sizes[0]), add_special_tokens=False)
        + [eos]
        for s, p in zip(samples, prompts, strict=False)
    ]
    logprobs = sequence_logprobs(policy, prompts, list(range(len(samples))), targets, temperature=1.0)
    return -logprobs.sum() / sum(len(t) for t in targets)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=0, help="also save out-stepN folders")
    parser.add_argument("--image-side", type=int, default=84, help="images are resized to at most side x side")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--train-vision", action="store_true", help="also train the vision tower (default: frozen at its random init)"
    )
    parser.add_argument("--init", type=Path, help="continue from this model folder instead of a fresh random model")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    init_dir = args.init or build_untrained(
        args.out.with_name(args.out.name + "-init"), seed=args.seed, image_side=args.image_side
    )
    policy = load_policy(str(init_dir), attn_implementation="sdpa")
    policy.model.train()
    if not args.train_vision:
        # Trained from scratch together with the decoder, the tiny vision tower collapsed to a near-constant
        # output within a few hundred steps (token features alike, the decoder then ignored the image:
        # log-probs unchanged when images were swapped). Frozen at its random init it stays a random
        # projection of the pixels that keeps each patch distinct, and the decoder learns to read it.
        policy.model.model.visual.requires_grad_(False)
    task = get_task("grounding")
    samples = task.load("train")
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = supervised_step(policy, rng.sample(samples, args.batch_size), task.instruction)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 10 == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - started:.0f}s", flush=True)
        if args.snapshot_every and step % args.snapshot_every == 0:
            snap = args.out.with_name(f"{args.out.name}-step{step}")
            policy.model.save_pretrained(snap)
            policy.processor.save_pretrained(snap)
    args.out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(args.out)
    policy.processor.save_pretrained(args.out)
    if args.init is None:
        shutil.rmtree(init_dir, ignore_errors=True)
    print(f"wrote the warm-started tiny model to {args.out}")


if __name__ == "__main__":
    main()
