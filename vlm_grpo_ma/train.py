"""GRPO-MA training: ``python -m vlm_grpo_ma.train --task grounding`` (see ``--help``).

The loop in ``train()`` reads top to bottom: draw prompts, sample K thoughts x M answers, score, compute
advantages, build the batch, update over micro-batches, log, checkpoint. Helpers are called, not inherited.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_grpo_ma import checkpoint as ckpt
from vlm_grpo_ma import lora, sharding, survive
from vlm_grpo_ma.advantages import grpo_ma_advantages
from vlm_grpo_ma.batch import TrainBatch, build_train_batch
from vlm_grpo_ma.config import Config, ConfigError, load_config, save_config
from vlm_grpo_ma.data import PromptStream, TaskMixture
from vlm_grpo_ma.diagnostics import GradSpikeMonitor, thought_value_noise, zero_signal_shares
from vlm_grpo_ma.evaluate import EvalSettings, evaluate_task
from vlm_grpo_ma.loss import aggregation_weights, policy_loss
from vlm_grpo_ma.metrics import RunLogger, drop_records_after, format_summary, read_metrics, summarize
from vlm_grpo_ma.policy import (
    CompletionScorer,
    EncodedPrompt,
    ImageLoadError,
    Policy,
    SamplingSettings,
    count_parameters,
    encode_prompt,
    load_policy,
    prompt_generators,
)
from vlm_grpo_ma.registry import Sample, Task, count_load_skips, get_task, import_task_modules
from vlm_grpo_ma.rewards import ScoredRollout, check_reward_overrides, score_rollout
from vlm_grpo_ma.rollout import Rollout, generate_rollout

log = logging.getLogger("vlm_grpo_ma.train")


def make_optimizer(parameters, cfg: Config) -> torch.optim.Optimizer:
    if cfg.train.optimizer == "sgd":  # plain SGD: the update is the gradient times the learning rate
        return torch.optim.SGD(parameters, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    return torch.optim.AdamW(
        parameters, lr=cfg.train.learning_rate, betas=(cfg.train.adam_beta1, cfg.train.adam_beta2), weight_decay=cfg.train.weight_decay
    )


def make_scheduler(optimizer, cfg: Config):
    """The learning rate of step s (0-based) is learning_rate * factor(s): linear warmup over warmup_steps,
    then constant, linear decay to 0 at train.steps, or cosine decay."""
    total, warmup = cfg.train.steps, cfg.train.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if cfg.train.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.train.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def draw_prompts(
    policy: Policy, stream: PromptStream, count: int, instruction_of, counters: Counter
) -> tuple[list, list[EncodedPrompt]]:
    """Next ``count`` samples that encode; a broken or missing image is skipped and counted, never fatal."""
    samples, prompts = [], []
    attempts = 0
    while len(samples) < count:
        sample = stream.next()
        attempts += 1
        try:
            prompts.append(encode_prompt(policy, sample, instruction_of(sample.task)))
            samples.append(sample)
        except ImageLoadError as error:
            counters["skipped_broken_images"] += 1
            log.warning("skipping sample %s: %s", sample.id, error)
            if attempts > 10 * count + 100:
                raise RuntimeError("too many unreadable images in a row; check data.source") from error
    return samples, prompts


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
        logprobs = scorer(prompts, micro.row_prompt, micro.completion_ids, micro.thought_lengths(), temperature=temperature)
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
    }
    micro_batches = [batch.rows(start, start + cfg.train.micro_batch_rows) for start in range(0, batch.num_rows, cfg.train.micro_batch_rows)]
    loss_weights = [
        aggregation_weights(cfg.algorithm.loss_aggregation, micro.token_mask, micro.is_thought, **totals).float()
        for micro in micro_batches
    ]
    temperature = cfg.rollout.temperature
    old_logprobs = None
    if cfg.algorithm.num_iterations > 1:  # the rollout is reused: freeze the sampling policy's log-probs first
        with torch.no_grad():
            old_logprobs = [score_rows(scorer, micro, prompts, accelerator, temperature) for micro in micro_batches]
    stats, grad_norms = Counter(), []
    for iteration in range(cfg.algorithm.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for index, micro in enumerate(micro_batches):
            sharding.sync_gradients(scorer, now=index == len(micro_batches) - 1)  # one reduction per update (DDP, FSDP2)
            logprobs = score_rows(scorer, micro, prompts, accelerator, temperature)
            device = logprobs.device
            # With one update per rollout the policy is exactly the sampling policy: ratio 1 by construction.
            old = logprobs.detach() if old_logprobs is None else old_logprobs[index]
            ref = reference(micro, prompts, accelerator, temperature) if reference is not None else None
            weights = loss_weights[index].to(device)
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
            stats["loss"] += float(loss.detach())
            for key, value in micro_stats.items():
                stats[key] += float(value)
            mismatch = ((logprobs.detach().cpu() - micro.sampling_logprobs).abs() * (micro.token_mask > 0)).max()
            stats["logprob_mismatch_max"] = max(stats["logprob_mismatch_max"], float(mismatch))
        trainable = lora.trainable_parameters(scorer_model(scorer))
        if sharding.is_sharded(scorer):  # FSDP2: the norm over every process's gradient shards
            grad_norms.append(sharding.clip_grad_norm_(trainable, cfg.train.max_grad_norm))
        else:
            grad_norms.append(float(accelerator.clip_grad_norm_(trainable, cfg.train.max_grad_norm)))
        survive.check_update_finite(stats["loss"], grad_norms[-1])
        if guard is not None:
            guard.weights_changed = True
        optimizer.step()
    iterations = cfg.algorithm.num_iterations
    weight_sum = max(stats["weight_sum"], 1e-30)  # summed over every iteration
    return {
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
        "train/logprob_mismatch_max": stats["logprob_mismatch_max"],
    }


def scorer_model(scorer: torch.nn.Module) -> torch.nn.Module:
    """The model inside a (possibly DDP-wrapped) CompletionScorer."""
    return getattr(scorer, "module", scorer).model


def _nan_mean(values: torch.Tensor) -> float:
    return float(values[~values.isnan()].mean())


def rollout_metrics(
    rollout: Rollout, scored: ScoredRollout, thought_adv: torch.Tensor, answer_adv: torch.Tensor, tasks: dict[str, Task]
) -> dict:
    """Step metrics. Each task's logged parts are averaged over the answers that have them
    (``reward/iou``); with several tasks every task also gets ``reward/<task>/mean`` and
    ``reward/<task>/<part>`` over its own prompts of the step."""
    tree = rollout.tree
    metrics = {"reward/mean": float(scored.rewards.mean()), "reward/std": float(scored.rewards.std())}
    part_names = sorted({name for task in tasks.values() for name in task.metrics} & set(scored.parts))
    for name in part_names:
        metrics[f"reward/{name}"] = _nan_mean(scored.parts[name])
    if len(tasks) > 1:
        prompt_task = [sample.task for sample in rollout.samples]
        for task_name, task in tasks.items():
            rows = torch.tensor([t == task_name for t in prompt_task])
            if not rows.any():
                continue
            metrics[f"reward/{task_name}/mean"] = float(scored.rewards[rows].mean())
            for name in sorted(set(task.metrics) & set(scored.parts)):
                metrics[f"reward/{task_name}/{name}"] = _nan_mean(scored.parts[name][rows])
    per_thought_mean = scored.rewards.mean(-1)  # [B, K]
    metrics["advantage/thought_reward_spread"] = float(per_thought_mean.std(-1).mean())
    metrics["advantage/thought_abs_mean"] = float(thought_adv.abs().mean())
    metrics.update({f"grpo_ma/{k}": v for k, v in thought_value_noise(scored.rewards).items()})
    metrics.update({f"signal/zero_{k}": v for k, v in zero_signal_shares(scored.rewards, thought_adv, answer_adv).items()})
    metrics["rollout/thought_tokens"] = sum(map(len, tree.thought_ids)) / len(tree.thought_ids)
    metrics["rollout/answer_tokens"] = sum(map(len, tree.answer_ids)) / len(tree.answer_ids)
    metrics["rollout/thought_truncated_rate"] = sum(tree.thought_truncated) / len(tree.thought_truncated)
    return metrics


def timing_metrics(rollout: Rollout, batch: TrainBatch, step_seconds: float, rollout_seconds: float) -> dict:
    trained_tokens = float(batch.num_trained_tokens())
    generated_tokens = sum(map(len, rollout.tree.thought_ids)) + sum(map(len, rollout.tree.answer_ids))
    metrics = {
        "time/step_seconds": step_seconds,
        "time/rollout_seconds": rollout_seconds,
        "time/trained_tokens_per_second": trained_tokens / (step_seconds - rollout_seconds),
        "time/generated_tokens_per_second": generated_tokens / rollout_seconds,
        "rollout/generated_tokens": generated_tokens,  # this process's, thoughts once + answers
    }
    if torch.cuda.is_available():  # a running maximum, in GiB
        metrics["time/peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics


def sampling_settings(cfg: Config, step: int, first_prompt: int, num_prompts: int) -> SamplingSettings:
    """How step ``step`` samples prompts ``first_prompt ..`` of the step. The randomness is a function of
    (seed, step, prompt): a resumed run samples the same trees, and so does a run split over processes."""
    return SamplingSettings(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_thought_tokens=cfg.rollout.max_thought_tokens,
        max_answer_tokens=cfg.rollout.max_answer_tokens,
        thought_stop=cfg.rollout.thought_stop,
        answer_stop=cfg.rollout.answer_stop,
        generators=prompt_generators(cfg.train.seed * 1_000_003 + step, first_prompt, num_prompts),
    )


def rollout_records(step: int, rollout: Rollout, scored: ScoredRollout, how_many: int) -> list[dict]:
    """A readable dump of the first ``how_many`` prompts of the step: thought, answers and their rewards."""
    records = []
    for b in range(min(how_many, rollout.num_prompts)):
        sample = rollout.samples[b]
        thoughts = []
        for k in range(rollout.num_thoughts):
            answers = []
            for m in range(rollout.num_answers):
                a = rollout.answer_row(b, k, m)
                answers.append({"answer": rollout.completions[a].answer, **scored.per_answer_parts[a]})
            thoughts.append({"thought": rollout.completions[rollout.answer_row(b, k, 0)].thought, "answers": answers})
        images = [img if isinstance(img, str) else "<in-memory image>" for img in sample.images]
        records.append(
            {"step": step, "task": sample.task, "sample_id": sample.id, "images": images, "question": sample.question,
             "thoughts": thoughts}
        )
    return records


def sum_over_processes(accelerator, counts: Counter) -> Counter:
    """Counters summed over the processes (every process gets the total)."""
    if accelerator.num_processes == 1:
        return counts
    from accelerate.utils import gather_object

    total = Counter()
    for part in gather_object([dict(counts)]):
        total.update(part)
    return total


def mean_over_processes(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Step metrics averaged over the processes that logged them (each holds an equal share of the step's
    prompts), except ``*_max`` (the maximum) and ``count/*`` (already the same everywhere). ``reward/std``
    becomes the mean of the per-process standard deviations."""
    if accelerator.num_processes == 1:
        return metrics
    from accelerate.utils import gather_object

    parts = gather_object([metrics])
    merged = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        values = [part[key] for part in parts if key in part]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.startswith("count/"):
            merged[key] = values[0]
        else:
            merged[key] = sum(values) / len(values)
    return merged


def configure_trainable(policy: Policy, cfg: Config) -> None:
    """LoRA adapters (unless the loaded checkpoint already has them) and the frozen vision tower."""
    if cfg.model.lora_rank > 0 and policy.adapter is None:
        name = cfg.model.name_or_path
        base = name if name == "tiny" or not Path(name).exists() else str(Path(name).resolve())
        policy.adapter = lora.apply_lora(
            policy.model,
            rank=cfg.model.lora_rank,
            alpha=cfg.model.lora_alpha,
            dropout=cfg.model.lora_dropout,
            target_modules=cfg.model.lora_target_modules,
            base_model_name_or_path=base,
        )
    elif cfg.model.lora_rank == 0 and policy.adapter is not None:
        raise ConfigError("the checkpoint holds a LoRA adapter but model.lora_rank=0; resume with its LoRA settings")
    if cfg.model.freeze_vision:
        lora.freeze_vision(policy.model)
    log.info("trainable: %s", lora.describe_parameters(policy.model))


def shares_prefixes(cfg: Config) -> bool:
    """Training forwards encode each prompt and thought once (through the KV cache) unless gradient
    checkpointing is on: transformers drops the cache under checkpointing, so those rows are re-encoded."""
    return not cfg.model.gradient_checkpointing


def make_reference(policy: Policy, scorer: torch.nn.Module, cfg: Config, device, fsdp=None):
    """``reference(micro, prompts, accelerator, temperature)`` -> log-probs of the frozen reference policy (KL
    term), or None without KL; computed by ``score_rows`` like the trained log-probs. With LoRA the reference
    is the trained scorer with its adapters switched off (no second copy in memory); otherwise a frozen copy of
    ``model.name_or_path``, loaded as the policy was, sharded like the policy under FSDP (``fsdp``: its
    settings) and then ``reference.module``."""
    if cfg.algorithm.kl_coef == 0:
        return None
    if policy.adapter is not None:
        reference_scorer, switch = scorer, lambda: lora.adapters_disabled(policy)
    else:
        frozen = load_model_policy(cfg, cfg.model.name_or_path, device)
        frozen.model.eval().requires_grad_(False)
        reference_scorer, switch = CompletionScorer(frozen, share_prefixes=shares_prefixes(cfg)), contextlib.nullcontext
        if fsdp is not None:
            reference_scorer = sharding.shard(reference_scorer, fsdp, device, trains=False)

    def reference(micro: TrainBatch, prompts, accelerator, temperature: float) -> torch.Tensor:
        with torch.no_grad(), switch():
            return score_rows(reference_scorer, micro, prompts, accelerator, temperature)

    reference.module = None if reference_scorer is scorer else reference_scorer  # a model of its own
    return reference


def load_prompt_stream(cfg: Config) -> tuple[dict[str, Task], PromptStream | TaskMixture]:
    """The run's tasks and their seeded prompt stream (a TaskMixture when data.tasks mixes several).
    Raises ConfigError naming the task, split and source when data cannot be loaded."""
    import_task_modules(cfg.data.task_modules)
    tasks = {name: get_task(name) for name in cfg.task_weights}
    try:  # fail now, not mid-run, on an unknown part name
        check_reward_overrides(list(tasks.values()), cfg.data.reward_weights)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    streams = {}
    for name, task in tasks.items():
        source = cfg.task_source(name)
        try:
            streams[name] = PromptStream(task.load(cfg.data.split, source), seed=cfg.train.seed)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"data.task={name} data.split={cfg.data.split} data.source={source}: {error}") from error
    if not cfg.data.tasks:
        return tasks, streams[cfg.data.task]
    return tasks, TaskMixture(streams, cfg.data.tasks, seed=cfg.train.seed)


def load_eval_sets(cfg: Config, tasks: dict[str, Task]) -> dict[str, tuple[Task, list[Sample]]]:
    """The held-out samples evaluated every ``train.eval_every`` steps: the first ``train.eval_samples`` of
    each task's ``data.eval_sources`` file, else of its embedded ``data.eval_split``."""
    if not cfg.train.eval_every:
        return {}
    sets = {}
    for name, task in tasks.items():
        source = cfg.data.eval_sources.get(name)
        try:
            samples = task.load(cfg.data.eval_split, source)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(
                f"evaluation data of task {name} (data.eval_split={cfg.data.eval_split} data.eval_sources: {source}): {error}"
            ) from error
        sets[name] = (task, samples[: cfg.train.eval_samples])
    return sets


def evaluate_held_out(policy: Policy, eval_sets: dict, cfg: Config, folder: Path) -> dict[str, float]:
    """Greedy evaluation with the evaluate CLI's code; per-sample records go to ``folder/<task>.jsonl``."""
    settings = EvalSettings(
        max_thought_tokens=cfg.rollout.max_thought_tokens, max_answer_tokens=cfg.rollout.max_answer_tokens, seed=cfg.train.seed
    )
    folder.mkdir(parents=True, exist_ok=True)
    metrics = {}
    for name, (task, samples) in eval_sets.items():
        task_metrics, _ = evaluate_task(
            policy, task, samples, settings, batch_size=cfg.train.prompts_per_step * cfg.rollout.num_thoughts,
            records_path=folder / f"{name}.jsonl", progress=False,
        )
        metrics.update({f"eval/{name}/{key}": value for key, value in task_metrics.items()})
    return metrics


def make_accelerator(cfg: Config):
    """accelerate's Accelerator for this run (DDP when launched with several processes). Refuses what the
    trainer cannot run and a step that does not split into whole prompt groups per process."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    # train() may run several times in one process (a notebook, a sweep) with another mixed precision:
    # accelerate keeps it in a process-wide singleton, so forget that (not the process group, PartialState).
    AcceleratorState._reset_state(reset_partial_state=False)
    sharding.launch_settings()  # an FSDP launch config the trainer does not run fails here, before any work
    with sharding.accelerate_without_fsdp():  # FSDP: the trainer shards itself (vlm_grpo_ma/sharding.py)
        accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision=cfg.train.mixed_precision,
            # a process whose prompts of a step have no image leaves the vision tower unused: DDP must then
            # look for unused parameters (a graph walk every backward), but only if the tower trains
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=cfg.model.lora_rank == 0 and not cfg.model.freeze_vision)],
        )
    if accelerator.distributed_type.value == "DEEPSPEED":
        raise ConfigError(
            "accelerate distributed_type DEEPSPEED is not supported; use FSDP2 (configs/accelerate/fsdp.yaml) "
            "or data parallelism (configs/accelerate/ddp.yaml)"
        )
    if cfg.train.prompts_per_step % accelerator.num_processes:
        raise ConfigError(
            f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the "
            f"{accelerator.num_processes} processes: each process takes an equal share of the step's prompts "
            "(whole K x M groups)"
        )
    return accelerator


def load_model_policy(cfg: Config, model_path: str, device) -> Policy:
    """A model as ``cfg.model`` says to load it (dtype, attention, image bounds): the trained policy and the
    frozen KL reference load through here, so they compute alike."""
    try:
        return load_policy(
            model_path,
            dtype=cfg.model.dtype,
            attn_implementation=cfg.model.attn_implementation,
            min_pixels=cfg.model.min_pixels,
            max_pixels=cfg.model.max_pixels,
            device=device,
        )
    except (FileNotFoundError, ValueError) as error:  # a missing folder, an unsupported model family
        raise ConfigError(f"model.name_or_path={model_path}: {error}") from error


def load_training_policy(cfg: Config, run_dir: Path, resume: bool, device) -> tuple[Policy, Path | None]:
    """The policy to train: ``model.name_or_path``, or with ``resume`` the newest checkpoint's model (which
    may be a LoRA adapter over its base); LoRA and frozen parts configured. Returns it and that checkpoint."""
    last = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume and last is None:
        log.info("--resume: no checkpoint in %s, starting from step 0", run_dir)
    model_path = str(last / "model") if last is not None else cfg.model.name_or_path
    policy = load_model_policy(cfg, model_path, device)
    policy.model.train()
    policy.model.config.use_cache = True
    if cfg.model.gradient_checkpointing:
        policy.model.activation_checkpointing_enable()
    configure_trainable(policy, cfg)
    return policy, last


RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "rollouts.jsonl", "summary.json", "eval", "tensorboard", "config.yaml")


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, delete: bool = True) -> None:
    """A fresh run must not append to another run's metrics or leave its checkpoints behind (the newest would
    be picked up by --resume and by evaluation): refuse a directory that holds a run, unless ``resume``
    continues it or ``overwrite`` deletes its outputs first (``delete``: this process is the one that does).
    Every process checks, so all of them stop on the same error."""
    if resume:
        return
    found = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not found:
        return
    if not overwrite:
        raise ConfigError(
            f"train.output_dir={run_dir} already holds a run ({', '.join(found)}); continue it with --resume, "
            "start over with --overwrite (deletes those outputs), or choose another --output-dir"
        )
    if not delete:  # another process of the same run deletes them
        return
    for name in found:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    log.info("--overwrite: deleted %s from %s", ", ".join(found), run_dir)


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False) -> dict:
    from accelerate.utils import set_seed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    accelerator = make_accelerator(cfg)
    num_processes, rank = accelerator.num_processes, accelerator.process_index
    prompts_per_process = cfg.train.prompts_per_step // num_processes
    set_seed(cfg.train.seed)
    run_dir = Path(cfg.train.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    claim_run_dir(run_dir, resume=resume, overwrite=overwrite, delete=accelerator.is_main_process)
    accelerator.wait_for_everyone()

    # --- tasks and data ---------------------------------------------------------------------------------
    with count_load_skips() as load_skips:  # rows dropped at load (an unreadable image), counted below
        tasks, stream = load_prompt_stream(cfg)
    eval_sets = load_eval_sets(cfg, tasks)

    # --- model, reference, optimiser ----------------------------------------------------------------------
    policy, last = load_training_policy(cfg, run_dir, resume, accelerator.device)
    history_state = ckpt.load_training_state(last) if last is not None else None
    start_step = history_state["step"] if history_state is not None else 0
    scorer = CompletionScorer(policy, share_prefixes=shares_prefixes(cfg))
    fsdp = sharding.launch_settings() if num_processes > 1 else None
    if fsdp is not None:  # FSDP2: sharded here, before the optimizer sees the parameters; not DDP-wrapped
        scorer = sharding.shard(scorer, fsdp, accelerator.device)
    optimizer = make_optimizer(lora.trainable_parameters(policy.model), cfg)
    # The scheduler stays out of accelerator.prepare: a prepared scheduler steps once per process at every
    # step() (N processes: the schedule runs N times too fast). It is stepped once per training step here.
    scheduler = make_scheduler(optimizer, cfg)
    if fsdp is None:
        scorer, optimizer = accelerator.prepare(scorer, optimizer)
    else:
        optimizer = accelerator.prepare(optimizer)
    reference = make_reference(policy, scorer, cfg, accelerator.device, fsdp)
    if history_state is not None:
        if history_state["optimizer"] == sharding.SHARDED_OPTIMIZER:
            sharding.load_optimizer(scorer, optimizer, last)
        else:
            optimizer.load_state_dict(history_state["optimizer"])
        scheduler.load_state_dict(history_state["scheduler"])
        stream.load_state_dict(history_state["data"])
        ckpt.set_rng_state(history_state["rng"])
        log.info("resumed from %s at step %d", last, start_step)

    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")
        drop_records_after(run_dir, start_step)  # a resumed run logs the steps after its checkpoint again
        log.info(
            "model %s (%s, %d parameters, attention %s, coordinate frame %s); tasks %s with %d samples; "
            "K=%d thoughts x M=%d answers; %d process(es) of %d prompts each",
            cfg.model.name_or_path,
            type(policy.model).__name__,
            count_parameters(policy.model),
            policy.model.config._attn_implementation,
            policy.frame.value,
            ", ".join(f"{name} ({weight:g})" for name, weight in cfg.task_weights.items()),
            len(stream.samples),
            cfg.rollout.num_thoughts,
            cfg.rollout.num_answers,
            num_processes,
            prompts_per_process,
        )
    logger = RunLogger(
        run_dir,
        tensorboard=cfg.logging.tensorboard and accelerator.is_main_process,
        progress_bar=cfg.logging.progress_bar and accelerator.is_main_process,
        total_steps=cfg.train.steps,
        start_step=start_step,
    )
    counters = Counter(history_state["counters"]) if history_state else Counter()
    for reason, n in load_skips.items():  # set, not added: a resumed run has loaded (and skipped) them again
        counters[f"skipped_{reason}_at_load"] = n
    instruction_of = lambda name: get_task(name).instruction  # noqa: E731

    def save(step: int) -> None:
        if fsdp is not None:  # collective: every process writes its optimizer shard
            training_state = {"scheduler": scheduler.state_dict(), **completed}
            sharding.save_checkpoint(
                scorer, policy, optimizer, run_dir, step, training_state=training_state, keep=cfg.train.keep_checkpoints,
                is_main=accelerator.is_main_process,
            )  # fmt: skip
            return
        if accelerator.is_main_process:
            def write_model(folder: Path) -> None:
                lora.save_model(policy, folder)
                policy.processor.save_pretrained(folder)

            ckpt.save_checkpoint(
                run_dir,
                step,
                write_model=write_model,
                training_state={
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    **completed,  # data position and counters as they were when step `step` ended
                },
                keep=cfg.train.keep_checkpoints,
            )

    if eval_sets and start_step == 0:
        # the start of the held-out curve: greedy on the same samples as every later evaluation
        policy.model.eval()
        with sharding.gathered(scorer), accelerator.autocast():  # gathered: every process takes part (FSDP)
            if accelerator.is_main_process:
                logger.log_step(0, evaluate_held_out(policy, eval_sets, cfg, run_dir / "eval" / "step-000000"), advance=False)

    # --- the loop -----------------------------------------------------------------------------------------
    step = start_step
    spikes = GradSpikeMonitor()
    if history_state is not None and "spikes" in history_state:
        spikes.load_state_dict(history_state["spikes"])
    completed = {"data": stream.state_dict(), "counters": dict(counters), "spikes": spikes.state_dict()}
    guard = UpdateGuard()
    restore_sigterm = survive.raise_on_sigterm()  # SIGTERM saves and stops like Ctrl-C (exit code 143)
    try:
        while step < cfg.train.steps:
            started = time.perf_counter()
            # every process draws the whole step (same stream, same skips), then keeps its own share
            samples, prompts = draw_prompts(policy, stream, cfg.train.prompts_per_step, instruction_of, counters)
            first_prompt = rank * prompts_per_process
            samples = samples[first_prompt : first_prompt + prompts_per_process]
            prompts = prompts[first_prompt : first_prompt + prompts_per_process]
            settings = sampling_settings(cfg, step, first_prompt, len(samples))
            policy.model.eval()  # dropout off while sampling (the tiny model has none; real ones may)
            # bf16 compute when train.mixed_precision=bf16 (weights may be fp32); FSDP: gathered once for it
            with sharding.gathered(scorer), accelerator.autocast():
                rollout = generate_rollout(
                    policy,
                    samples,
                    prompts,
                    num_thoughts=cfg.rollout.num_thoughts,
                    num_answers=cfg.rollout.num_answers,
                    settings=settings,
                )
            rollout_seconds = time.perf_counter() - started
            scored = score_rollout(
                rollout,
                weight_overrides=cfg.data.reward_weights,
                truncated_thoughts=cfg.rollout.truncated_thoughts,
                workers=cfg.rollout.reward_workers,
                timeout_s=cfg.rollout.reward_timeout_s,
            )
            counters.update(sum_over_processes(accelerator, scored.counters))
            thought_adv, answer_adv = grpo_ma_advantages(
                scored.rewards,
                answer_baseline=cfg.algorithm.answer_baseline,
                scale_by_std=cfg.algorithm.scale_by_std,
                eps=cfg.algorithm.eps,
                unbiased=cfg.algorithm.std_unbiased,
            )
            batch = build_train_batch(rollout, thought_adv, answer_adv, truncated_thoughts=cfg.rollout.truncated_thoughts)
            policy.model.train()
            learning_rate = scheduler.get_last_lr()[0]  # the rate this step's update uses
            survive.check_inputs_finite(step + 1, scored.rewards, (thought_adv, answer_adv), learning_rate)
            update = update_policy(scorer, batch, prompts, cfg, accelerator, optimizer, reference, guard)
            survive.check_weights_finite(step + 1, policy.model)  # before anything of this step is checkpointed
            scheduler.step()
            step += 1
            guard.weights_changed = False
            completed = {"data": stream.state_dict(), "counters": dict(counters), "spikes": spikes.state_dict()}

            metrics = rollout_metrics(rollout, scored, thought_adv, answer_adv, tasks)
            metrics.update(update)
            metrics["train/grad_norm_spike_ratio"] = spikes.observe(update["train/grad_norm"])
            metrics.update(sharding.state_bytes(policy.model, optimizer, rank, getattr(reference, "module", None)))
            metrics.update(timing_metrics(rollout, batch, time.perf_counter() - started, rollout_seconds))
            metrics.update(
                {
                    "train/learning_rate": learning_rate,
                    "data/epoch": stream.epoch,
                    **{f"count/{k}": v for k, v in counters.items()},
                }
            )
            metrics = mean_over_processes(accelerator, metrics)
            evaluate_now = bool(eval_sets) and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)
            if evaluate_now:
                with sharding.gathered(scorer), accelerator.autocast():
                    if accelerator.is_main_process:
                        metrics.update(evaluate_held_out(policy, eval_sets, cfg, run_dir / "eval" / f"step-{step:06d}"))
            if accelerator.is_main_process:
                if step % cfg.logging.log_every == 0 or step == cfg.train.steps or evaluate_now:
                    logger.log_step(step, metrics)
                logger.log_rollouts(rollout_records(step, rollout, scored, cfg.logging.rollout_samples_per_step))
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                save(step)
                accelerator.wait_for_everyone()
    except BaseException:
        # Nothing lost on a crash or Ctrl-C: keep the steps done since the last checkpoint.
        last_saved = ckpt.latest_checkpoint(run_dir)
        if guard.weights_changed:  # an optimiser step of the unfinished step ran: the weights match no step
            log.error("interrupted while updating step %d: keeping the last checkpoint (%s)", step + 1, last_saved)
        elif fsdp is not None:  # saving is collective: a process that failed alone would leave the others waiting
            log.error("interrupted after step %d: FSDP run, no checkpoint on the way out (last: %s)", step, last_saved)
        elif step > start_step and (last_saved is None or not last_saved.name.endswith(f"{step:06d}")):
            log.error("interrupted after step %d: saving a checkpoint before exiting", step)
            save(step)
        raise
    finally:
        restore_sigterm()
        logger.close()

    headline = ["reward/mean"] + [f"reward/{t.metrics[0]}" for t in tasks.values() if t.metrics]
    if len(tasks) > 1:
        headline += [f"reward/{name}/mean" for name in tasks]
    summary = summarize(read_metrics(run_dir), keys=tuple(dict.fromkeys(headline)))
    summary["counters"] = dict(counters)
    if accelerator.is_main_process:
        (run_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2))
        print(format_summary(summary), flush=True)
        print(f"run directory: {run_dir}", flush=True)
    return summary


def _json_safe(value):
    """NaN (e.g. a noise estimate from a single step) becomes null: summary.json stays strict JSON."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo_ma.train",
        description="Train a Qwen-VL model with GRPO-MA (K thoughts x M answers per prompt).",
        epilog="Overrides: section.key=value, e.g. rollout.num_answers=1 rollout.num_thoughts=16 train.steps=50",
    )
    parser.add_argument("--config", help="YAML config file (sections: model rollout algorithm data train logging)")
    parser.add_argument("--task", help="task name (same as data.task=NAME)")
    parser.add_argument("--output-dir", help="run directory (same as train.output_dir=DIR)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the run directory")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete the outputs of an earlier run in the run directory first"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides section.key=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    # intermixed: dotted overrides may come before, between or after the options
    args = build_arg_parser().parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.task:
        overrides.append(f"data.task={args.task}")
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = load_config(args.config, overrides)
        if args.task and cfg.data.tasks:
            raise ConfigError(f"--task {args.task} and data.tasks {cfg.data.tasks} both name the tasks; give one")
        import_task_modules(cfg.data.task_modules)
        for name in cfg.task_weights:
            get_task(name)
    except (ConfigError, KeyError, FileNotFoundError) as error:  # KeyError: an unknown task name
        print(f"error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    try:
        if args.resume and args.overwrite:
            raise ConfigError("--resume continues the run in the run directory and --overwrite deletes it; give one")
        train(cfg, resume=args.resume, overwrite=args.overwrite)
    except ConfigError as error:  # found when loading the data or the model
        print(f"error: {error}", file=sys.stderr)
        return 2
    except survive.NonFiniteError as error:  # the last checkpoint is kept; the message names the quantity
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # train() saved a checkpoint of the steps done
        return interrupt.exit_code if isinstance(interrupt, survive.Terminated) else 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
