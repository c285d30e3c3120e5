"""The policy update of one training step: the one log-prob path (``score_rows``) and ``update_policy``.

Every log-prob the loss uses comes through ``score_rows``: the trained ones, the old (sampling-policy) ones
when a rollout is reused (``algorithm.num_iterations > 1``), and the KL reference's (``setup.make_reference``:
a frozen copy, or LoRA's adapters switched off). One function, one precision (``train.mixed_precision``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from vlm_grpo_ma.algorithm.loss import (
    aggregation_weights,
    policy_loss,
    segment_ids,
    truncated_importance_weights,
)
from vlm_grpo_ma.model import lora
from vlm_grpo_ma.model.prompts import EncodedPrompt
from vlm_grpo_ma.run import sharding, survive
from vlm_grpo_ma.run.batch import TrainBatch
from vlm_grpo_ma.run.config import Config


@dataclass
class UpdateGuard:
    """Set when an optimiser step of the current training step has run (until the step is complete): a crash
    then must not checkpoint weights that belong to no step."""

    weights_changed: bool = False


def score_rows(scorer: torch.nn.Module, micro: TrainBatch, prompts: list[EncodedPrompt], accelerator, temperature: float) -> torch.Tensor:
    """Log-probs [n, T] (fp32) of a micro-batch's rows: the one path for the trained, the old (sampling-policy)
    and the reference log-probs, so all three are computed by the same code under the same precision
    (``train.mixed_precision``). Old and reference log-probs call it under ``torch.no_grad()``."""
    with accelerator.autocast():
        logprobs = scorer(
            prompts, micro.row_prompt, micro.completion_ids, micro.thought_lengths(), temperature=temperature, thought_turns=micro.thought_turns
        )
    return logprobs.float()


def update_policy(
    scorer: torch.nn.Module,
    batch: TrainBatch,
    prompts: list[EncodedPrompt],
    cfg: Config,
    accelerator,
    optimizer,
    reference,
    guard: UpdateGuard | None = None,
) -> dict[str, float]:
    """``algorithm.num_iterations`` optimiser steps on one rollout, each over micro-batches.

    ``scorer`` is ``CompletionScorer(policy)`` as ``accelerator.prepare`` returned it (DDP-wrapped with
    several processes, which then average gradients). Token weights come from the loss aggregation normalised
    over the whole step on every process; each process's loss is scaled by 1 / num_processes, so the averaged
    gradient is the one-process gradient of the global batch."""
    num_processes = accelerator.num_processes
    local_tokens = torch.tensor(batch.num_trained_tokens(), dtype=torch.float64, device=accelerator.device)
    totals = {
        "num_tokens": float(accelerator.reduce(local_tokens, reduction="sum")),
        "num_thoughts": cfg.train.prompts_per_step * cfg.rollout.num_thoughts,
        "num_answers": cfg.train.prompts_per_step * cfg.answers_per_prompt,
        "max_thought_tokens": cfg.rollout.max_thought_tokens,
        "max_answer_tokens": cfg.rollout.max_answer_tokens,
    }
    micro_batches = [batch.rows(start, start + cfg.train.micro_batch_rows) for start in range(0, batch.num_rows, cfg.train.micro_batch_rows)]
    loss_weights = [
        aggregation_weights(cfg.algorithm.loss_aggregation, micro.token_mask, micro.is_thought, flat=batch.flat, **totals).float()
        for micro in micro_batches
    ]
    segments = [segment_ids(micro.token_mask, micro.is_thought, flat=batch.flat) for micro in micro_batches]
    temperature = cfg.rollout.temperature
    old_logprobs = None
    if cfg.algorithm.num_iterations > 1:  # the rollout is reused: freeze the sampling policy's log-probs first
        with torch.no_grad():
            old_logprobs = [score_rows(scorer, micro, prompts, accelerator, temperature) for micro in micro_batches]
    # The reference is frozen, so its log-probs are the same in every iteration: computed once per step.
    ref_logprobs = [reference(micro, prompts, accelerator, temperature) for micro in micro_batches] if reference is not None else None
    stats, grad_norms = Counter(), []
    for iteration in range(cfg.algorithm.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for index, micro in enumerate(micro_batches):
            sharding.sync_gradients(scorer, now=index == len(micro_batches) - 1)  # one reduction per update (DDP, FSDP2)
            logprobs = score_rows(scorer, micro, prompts, accelerator, temperature)
            device = logprobs.device
            # With one update per rollout the policy is exactly the sampling policy: ratio 1 by construction.
            old = logprobs.detach() if old_logprobs is None else old_logprobs[index]
            ref = ref_logprobs[index] if ref_logprobs is not None else None
            weights = loss_weights[index].to(device)
            engine = micro.sampling_logprobs.to(device)  # what the sampling engine reported for these tokens
            importance = None
            if corrected(cfg):
                importance = truncated_importance_weights(old.to(device), engine, cap=cfg.algorithm.rollout_correction_cap)
            loss, micro_stats = policy_loss(
                logprobs,
                old.to(device),
                micro.advantages.to(device),
                weights,
                clip_low=cfg.algorithm.clip_low,
                clip_high=cfg.algorithm.clip_high,
                total_weight=1.0 / num_processes,
                kl_coef=cfg.algorithm.kl_coef,
                ref_logprobs=ref,
                surrogate=cfg.algorithm.policy_loss,
                segments=segments[index].to(device),
                importance_weights=importance,
            )
            accelerator.backward(loss)
            log_ratio_max = float(micro_stats.pop("log_ratio_abs_max"))  # a maximum, not a sum
            if iteration == 0:  # what the update of the fresh rollout saw (the sampling policy's view)
                stats["first_update_log_ratio_max"] = max(stats["first_update_log_ratio_max"], log_ratio_max)
                thought = micro.is_thought.to(device)
                # at ratio 1, |d loss / d log-prob| = weight * |advantage|: the gradient each token gets
                push = weights * micro.advantages.to(device).abs()
                stats["thought_weight_sum"] += float((weights * thought).sum())
                stats["thought_push_sum"] += float((push * thought).sum())
                stats["push_sum"] += float(push.sum())
                # the engine's log-probs against the trainer's of the same (sampling) policy, on trained tokens
                trained = micro.token_mask.to(device) > 0
                gap = (old.to(device) - engine).abs()[trained]
                stats["logprob_gap_sum"] += float(gap.sum())
                stats["logprob_gap_count"] += int(gap.numel())
                stats["logprob_gap_max"] = max(stats["logprob_gap_max"], float(gap.max()) if gap.numel() else 0.0)
                if importance is not None:
                    importance_stats(stats, importance, trained, thought)
                if micro.row_staleness is not None:  # the gap of each staleness: the trained policy's drift from the sampler
                    row_age = torch.tensor(micro.row_staleness, device=device)[:, None].expand_as(trained)[trained]
                    for age in row_age.unique().tolist():
                        stats[f"gap_sum_{age}"] += float(gap[row_age == age].sum())
                        stats[f"gap_count_{age}"] += int((row_age == age).sum())
            stats["loss"] += float(loss.detach())
            for key, value in micro_stats.items():
                stats[key] += float(value)
        trainable = lora.trainable_parameters(scorer_model(scorer))
        if sharding.is_sharded(scorer):  # FSDP2: the norm over every process's gradient shards
            grad_norms.append(sharding.clip_grad_norm_(trainable, cfg.train.max_grad_norm))
        else:
            grad_norms.append(float(accelerator.clip_grad_norm_(trainable, cfg.train.max_grad_norm)))
        # the loss is this process's; the norm is every process's. After the first iteration's optimizer step
        # the weights have changed: a stop signal waits for the end of the step (survive.together)
        with survive.together(accelerator, act_on_signals=guard is None or not guard.weights_changed):
            survive.check_update_finite(stats["loss"], grad_norms[-1])
        if guard is not None:
            guard.weights_changed = True
        optimizer.step()
    iterations = cfg.algorithm.num_iterations
    weight_sum = max(stats["weight_sum"], 1e-30)  # summed over every iteration
    return staleness_figures(stats) | {
        # per process: the loss is scaled by num_processes and pg_loss_sum is not; the mean over processes
        # (mean_over_processes) of both is then the whole step's figure
        "train/loss": stats["loss"] / iterations,
        "train/pg_loss": stats["pg_loss_sum"] * num_processes / iterations,
        "train/nll": stats["nll_sum"] / weight_sum,
        "train/grad_norm": grad_norms[-1],
        "train/clip_fraction": stats["clip_fraction_sum"] / weight_sum,
        "train/kl": stats["kl_sum"] / weight_sum,
        "train/first_update_log_ratio_max": stats["first_update_log_ratio_max"],
        "train/thought_weight_share": stats["thought_weight_sum"] / max(stats["weight_sum"] / iterations, 1e-30),
        "train/thought_gradient_share": stats["thought_push_sum"] / stats["push_sum"] if stats["push_sum"] > 0 else math.nan,
        # |trainer - engine| log-prob of the sampled tokens under the sampling policy (one update: the trainer's
        # first forward); fp32 with either engine: ~1e-6 on the embedded model.
        "rollout/logprob_gap_mean": stats["logprob_gap_sum"] / max(stats["logprob_gap_count"], 1),
        "rollout/logprob_gap_max": stats["logprob_gap_max"],
    }


def scorer_model(scorer: torch.nn.Module) -> torch.nn.Module:
    """The model inside a (possibly DDP-wrapped) CompletionScorer."""
    return getattr(scorer, "module", scorer).model


def corrected(cfg: Config) -> bool:
    """Whether the loss re-weights each token by its truncated importance ratio (``truncated_importance_weights``):
    ``algorithm.rollout_correction=tis``, and always where engines may sample with older weights
    (``rollout.max_staleness`` > 0), thought tokens and answer tokens alike."""
    return cfg.algorithm.rollout_correction == "tis" or cfg.rollout.max_staleness > 0


def importance_stats(stats: Counter, importance: torch.Tensor, trained: torch.Tensor, thought: torch.Tensor) -> None:
    """Adds the importance weights' sums over the trained thought and answer tokens (for ``staleness_figures``)."""
    for level, tokens in (("thought", trained & thought), ("answer", trained & ~thought)):
        weights = importance[tokens].double()
        stats[f"is_{level}_sum"] += float(weights.sum())
        stats[f"is_{level}_square_sum"] += float((weights**2).sum())
        stats[f"is_{level}_count"] += int(weights.numel())


def staleness_figures(stats: Counter) -> dict[str, float]:
    """The importance weights' effective sample size on each level, (sum w)^2 / (n sum w^2) in (0, 1] (1: every
    weight equal), and the mean log-prob gap of each staleness's trees (``rollout/logprob_gap_mean_staleness_S``)."""
    figures = {}
    for level in ("thought", "answer"):
        if stats[f"is_{level}_count"]:
            total, squares = stats[f"is_{level}_sum"], stats[f"is_{level}_square_sum"]
            figures[f"rollout/importance_ess_{level}"] = total**2 / (stats[f"is_{level}_count"] * squares) if squares else 1.0
    for key in [key for key in stats if key.startswith("gap_sum_")]:
        age = key.removeprefix("gap_sum_")
        figures[f"rollout/logprob_gap_mean_staleness_{age}"] = stats[key] / max(stats[f"gap_count_{age}"], 1)
    return figures
