"""Held-out evaluation during training: the samples, and greedy evaluation with the evaluate CLI's code."""

from __future__ import annotations

import json
from pathlib import Path

from accelerate.utils import gather_object

from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.run import sharding, survive
from vlm_grpo_ma.run.config import Config, ConfigError
from vlm_grpo_ma.run.evaluation import EvalSettings, draw_predictions, generate_records, summarize_records
from vlm_grpo_ma.task_api.registry import Sample, Task, load_samples


def load_eval_sets(cfg: Config, tasks: dict[str, Task]) -> dict[str, tuple[Task, list[Sample]]]:
    """The held-out samples evaluated every ``train.eval_every`` steps: the first ``train.eval_samples`` of
    each task's ``data.eval_sources`` file, else of its embedded ``data.eval_split``."""
    if not cfg.train.eval_every:
        return {}
    sets = {}
    for name, task in tasks.items():
        source = cfg.data.eval_sources.get(name)
        try:
            samples = load_samples(task, cfg.data.eval_split, source)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(
                f"evaluation data of task {name} (data.eval_split={cfg.data.eval_split} data.eval_sources: {source}): {error}"
            ) from error
        sets[name] = (task, samples[: cfg.train.eval_samples])
    return sets


def evaluate_held_out(policy: Policy, eval_sets: dict, cfg: Config, folder: Path, accelerator, judge=None) -> dict[str, float]:
    """Greedy evaluation with the evaluate CLI's code, shared by the processes: each set is cut into the
    batches one process would generate, dealt round-robin, and the records gathered, so every process returns
    the figures one process computes (the same batches, the same seeds). Per-sample records go to
    ``folder/<task>.jsonl`` and, for tasks that draw, the first ``logging.eval_drawings`` samples with truth and
    prediction drawn to ``folder/draw/<task>/`` (the CLI's ``draw_predictions``; the trackers log them), by the
    main process."""
    settings = EvalSettings(
        max_thought_tokens=cfg.rollout.max_thought_tokens, max_answer_tokens=cfg.rollout.max_answer_tokens, seed=cfg.train.seed,
        max_turns=cfg.rollout.max_turns,
    )
    rank, processes = accelerator.process_index, accelerator.num_processes
    batch_size = cfg.train.prompts_per_step * cfg.rollout.num_thoughts
    metrics = {}
    for name, (task, samples) in eval_sets.items():
        positions = {sample.id: i for i, sample in enumerate(samples)}  # each sample's seed: as one process
        batches = [samples[start : start + batch_size] for start in range(0, len(samples), batch_size)]
        mine = []
        # One agreement per round of batches (every process has the same number of rounds), not per set: a stop
        # on any process (an error, Ctrl-C, SIGTERM) is acted on within one batch, before a launcher that
        # forwarded the signal loses patience and kills the processes.
        for first in range(0, len(batches), processes):
            with survive.together(accelerator):
                index = first + rank
                if index < len(batches):
                    records = generate_records(policy, task, batches[index], settings, batch_size=batch_size, positions=positions, judge=judge)
                    mine.append((index, [record for batch in records for record in batch]))
        shares = gather_object(mine) if processes > 1 else mine
        records = [record for _, batch in sorted(shares, key=lambda share: share[0]) for record in batch]
        if accelerator.is_main_process:
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as sink:
                sink.writelines(json.dumps(record) + "\n" for record in records)
            draw_predictions(
                task, samples, records, folder / "draw" / name, cfg.logging.eval_drawings,
                video_budget=policy.video_budget, patch_factor=policy.patch_factor,
            )
        task_metrics = summarize_records(task, records, settings.samples)
        metrics.update({f"eval/{name}/{key}": value for key, value in task_metrics.items()})
    return metrics


def evaluate_during_training(policy: Policy, scorer, accelerator, eval_sets: dict, cfg: Config, folder: Path, judge=None) -> dict[str, float]:
    """``evaluate_held_out`` with the weights gathered (FSDP: every process holds them whole for it), under
    ``train.mixed_precision`` as the rollout computes."""
    with sharding.gathered(scorer), accelerator.autocast():
        return evaluate_held_out(policy, eval_sets, cfg, folder, accelerator, judge)
