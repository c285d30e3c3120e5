"""FSDP2 pieces against an unsharded copy of the same model, on CPU processes over gloo (run by
tests/test_sharding.py under ``torch.distributed.run --nproc_per_node 2``):

    python -m torch.distributed.run --nproc_per_node 2 tests/fsdp_parts.py MODEL_DIR [--hybrid-model DIR] [VARIANT ...]

VARIANT is a ``+``-joined set of flags (``full`` for none): ``lora``, ``freeze-vision``,
``gradient-checkpointing``, ``mixed``, ``hybrid`` (the model of --hybrid-model, a Qwen3.5, instead of
MODEL_DIR), ``video`` (rank 0's prompts hold videos); e.g. ``full lora mixed+lora hybrid+lora``. Each variant runs in turn in the same
launch (one start of the processes for all of them). Each rank samples its own prompts with the sharded model
(under ``sharding.gathered``) and the unsharded copy, scores its rows with the sharded scorer (tree-shared
forward and re-encoding) and backpropagates its share of a loss, and clips; the unsharded copy computes the
same on every rank's rows. Rank 0 prints one JSON line: per variant, the largest differences."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from tasks import grounding  # noqa: F401  (registers the task)
from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators, sample_tree
from vlm_grpo_ma.model import lora
from vlm_grpo_ma.model.loading import load_policy
from vlm_grpo_ma.model.logprobs import CompletionScorer
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.run import sharding
from vlm_grpo_ma.task_api.registry import get_task

PROMPTS_PER_RANK, K, M = 2, 2, 2


def settings_for(rank: int) -> SamplingSettings:
    # thought_stop "e": an untrained model's thoughts stop at uneven lengths
    return SamplingSettings(
        temperature=1.0, max_thought_tokens=10, max_answer_tokens=6, thought_stop="e",
        generators=prompt_generators(7, rank * PROMPTS_PER_RANK, PROMPTS_PER_RANK),
    )


def rows_of(tree, one_token_answers: bool = False):
    """Training rows of a tree: (row_prompt, completion ids, thought lengths); ``one_token_answers`` keeps each
    answer's first token only (the shared-prefix forward then has no answer tokens to feed after the thought)."""
    row_prompt, completions, thought_lengths = [], [], []
    for a, answer in enumerate(tree.answer_ids):
        t = a // M
        row_prompt.append(t // K)
        completions.append(tree.thought_ids[t] + (answer[:1] if one_token_answers else answer))
        thought_lengths.append(len(tree.thought_ids[t]))
    return row_prompt, completions, thought_lengths


def loss_of(logprobs: torch.Tensor) -> torch.Tensor:
    # a fixed, row-dependent weighting so that the gradient is not a plain sum
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).reshape(logprobs.shape)
    return (logprobs * weights).sum()


# lora: LoRA adapters on q and v; freeze-vision: the vision tower frozen; gradient-checkpointing: as the 7B FSDP
# preset trains; mixed: the last rank's prompts are text-only and its answers one token long (a task mixture's
# worst case); hybrid: the --hybrid-model (linear-attention states in the cache; LoRA on its projections too);
# video: rank 0's first prompt holds a video instead of its image, its second a video beside its image (with
# mixed, the last rank is text-only: the tower sees frames on one process and a blank image on the other)
FLAGS = ("lora", "freeze-vision", "gradient-checkpointing", "mixed", "hybrid", "video")


def parse_variant(variant: str) -> argparse.Namespace:
    flags = [] if variant == "full" else variant.split("+")
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise SystemExit(f"variant {variant!r}: unknown flags {unknown}; valid: full or a +-joined set of {list(FLAGS)}")
    return argparse.Namespace(**{flag.replace("-", "_"): flag in flags for flag in FLAGS})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("variants", nargs="*", default=["full"])
    parser.add_argument("--hybrid-model", help="the model folder of the hybrid variants (a Qwen3.5)")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(1)
    # a collective one rank skips fails in a minute (gloo's default would wait half an hour)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    found = {}
    for variant in args.variants:
        gathered = [None] * world
        flags = parse_variant(variant)
        if flags.hybrid and not args.hybrid_model:
            raise SystemExit(f"variant {variant!r} needs --hybrid-model")
        model_dir = args.hybrid_model if flags.hybrid else args.model_dir
        dist.all_gather_object(gathered, run_variant(model_dir, flags, rank, world))
        found[variant] = {"ranks": [r for r, _ in gathered], "memory": [m for _, m in gathered]}
    if rank == 0:
        print(json.dumps(found), flush=True)
    # both processes leave the last collective before either tears the group down: a process that destroyed
    # its gloo pairs while the other still read from them aborted ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_variant(model_dir: str, args: argparse.Namespace, rank: int, world: int) -> tuple[dict, dict]:
    """This rank's differences and the bytes it holds, for one variant."""

    def make_policy():
        policy = load_policy(model_dir, attn_implementation="sdpa")
        if args.lora:
            torch.manual_seed(1)  # the same adapter initialisation in both copies
            targets = ["q_proj", "v_proj"] + (["in_proj_qkv", "out_proj"] if args.hybrid else [])
            policy.adapter = lora.apply_lora(
                policy.model, rank=4, alpha=8, dropout=0.0, target_modules=targets, base_model_name_or_path=model_dir
            )
            # LoRA B starts at zero: move it so the adapters change the output
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.data.normal_(0, 0.05)
        if args.freeze_vision:
            lora.freeze_vision(policy.model)
        if args.gradient_checkpointing:
            policy.model.train()
            policy.model.activation_checkpointing_enable()
        return policy

    plain, sharded = make_policy(), make_policy()
    samples = get_task("grounding").load("train", None)[: PROMPTS_PER_RANK * world]
    text_only_rank = world - 1 if args.mixed else None
    if args.mixed:  # the last rank's share: the same questions without their images
        samples = samples[: PROMPTS_PER_RANK * text_only_rank] + [
            dataclasses.replace(s, images=()) for s in samples[PROMPTS_PER_RANK * text_only_rank :]
        ]
    if args.video:
        import tempfile

        from video_clips import write_clip  # tests/ is this script's folder

        folder = tempfile.mkdtemp(prefix=f"fsdp-video-{rank}-")  # each rank writes the same clips for itself
        clips = [str(write_clip(os.path.join(folder, f"{n}.mp4"), frames=n, fps=4)) for n in (8, 12)]
        samples[0] = dataclasses.replace(samples[0], images=(), videos=(clips[0],))
        samples[1] = dataclasses.replace(samples[1], videos=(clips[1],))
    prompts = [encode_prompt(plain, s, "Think.") for s in samples]
    mine = prompts[rank * PROMPTS_PER_RANK : (rank + 1) * PROMPTS_PER_RANK]
    result = {}

    scorers = {}
    for share in (True, False):
        scorers[share] = CompletionScorer(sharded, share_prefixes=share)
    # one sharded module tree: the tree-shared scorer is the FSDP root; the re-encoding one reuses the model
    scorer = sharding.shard(scorers[True], sharding.FSDPSettings(), torch.device("cpu"))

    # 1. sampling: the sharded model (gathered once) samples what the unsharded one samples
    with torch.no_grad():
        reference_trees = [sample_tree(plain, prompts[r * PROMPTS_PER_RANK : (r + 1) * PROMPTS_PER_RANK], num_thoughts=K, num_answers=M, settings=settings_for(r)) for r in range(world)]
        with sharding.gathered(scorer):
            tree = sample_tree(sharded, mine, num_thoughts=K, num_answers=M, settings=settings_for(rank))
    same_tokens = tree.thought_ids == reference_trees[rank].thought_ids and tree.answer_ids == reference_trees[rank].answer_ids
    result["sampled_same_tokens"] = same_tokens
    result["sampling_logprob_difference"] = max(
        abs(a - b)
        for x, y in ((tree.thought_logprobs, reference_trees[rank].thought_logprobs), (tree.answer_logprobs, reference_trees[rank].answer_logprobs))
        for row_a, row_b in zip(x, y, strict=True) for a, b in zip(row_a, row_b, strict=True)
    )  # fmt: skip

    # 2. the training forward/backward, tree-shared and re-encoding; gradients averaged over processes
    trainable = lora.trainable_parameters(sharded.model)
    names = [n for n, p in sharded.model.named_parameters() if p.requires_grad]
    plain_params = dict(plain.model.named_parameters())
    # transformers drops the KV cache under gradient checkpointing: the trainer then re-encodes only
    for share in (False,) if args.gradient_checkpointing else (True, False):
        scorer.share_prefixes = share
        for p in trainable:
            p.grad = None
        for p in plain.model.parameters():
            p.grad = None
        row_prompt, completions, thought_lengths = rows_of(tree, rank == text_only_rank)
        logprobs = scorer(mine, row_prompt, completions, thought_lengths, temperature=1.0)
        # as update_policy: each rank's loss times the number of processes (policy_loss's total_weight 1/N),
        # which FSDP's averaging of gradients over processes turns into the sum of the ranks' losses
        (loss_of(logprobs) * world).backward()
        # the unsharded reference: the sum over ranks of each rank's loss
        reference_logprobs = None
        for r in range(world):
            rp, comp, tl = rows_of(reference_trees[r], r == text_only_rank)
            lp = CompletionScorer(plain, share_prefixes=share)(
                prompts[r * PROMPTS_PER_RANK : (r + 1) * PROMPTS_PER_RANK], rp, comp, tl, temperature=1.0
            )
            loss_of(lp).backward()
            if r == rank:
                reference_logprobs = lp.detach()
        key = "shared" if share else "reencode"
        result[f"{key}_logprob_difference"] = float((logprobs.detach() - reference_logprobs).abs().max())
        grad_difference, grad_scale = 0.0, 0.0
        for name, p in zip(names, trainable, strict=True):
            full = p.grad.full_tensor() if p.grad is not None else None
            ref = plain_params[name].grad
            if ref is None and full is None:
                continue
            grad_difference = max(grad_difference, float((full - ref).abs().max()))
            grad_scale = max(grad_scale, float(ref.abs().max()))
        result[f"{key}_grad_difference"] = grad_difference
        result[f"{key}_grad_max"] = grad_scale
        plain_trainable = [plain_params[n] for n in names]
        reference_norm = float(torch.nn.utils.clip_grad_norm_(plain_trainable, 1e9))  # 1e9: measures, clips nothing
        result[f"{key}_grad_norm"] = [sharding.clip_grad_norm_(trainable, 1e9), reference_norm]
    result["trainable_parameters"] = len(trainable)
    return result, sharding.state_bytes(sharded.model, torch.optim.SGD(trainable, lr=0.1), rank)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
