"""Held-out evaluation during training: the samples, and greedy evaluation with the evaluate CLI's code."""

from __future__ import annotations

from pathlib import Path

from vlm_grpo_ma import sharding
from vlm_grpo_ma.config import Config, ConfigError
from vlm_grpo_ma.evaluate import EvalSettings, draw_predictions, evaluate_task
from vlm_grpo_ma.policy import Policy
from vlm_grpo_ma.registry import Sample, Task


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
    """Greedy evaluation with the evaluate CLI's code; per-sample records go to ``folder/<task>.jsonl`` and,
    for tasks that draw, the first ``logging.eval_drawings`` samples with truth and prediction drawn to
    ``folder/draw/<task>/`` (the CLI's ``draw_predictions``; the trackers log them)."""
    settings = EvalSettings(
        max_thought_tokens=cfg.rollout.max_thought_tokens, max_answer_tokens=cfg.rollout.max_answer_tokens, seed=cfg.train.seed
    )
    folder.mkdir(parents=True, exist_ok=True)
    metrics = {}
    for name, (task, samples) in eval_sets.items():
        task_metrics, records = evaluate_task(
            policy, task, samples, settings, batch_size=cfg.train.prompts_per_step * cfg.rollout.num_thoughts,
            records_path=folder / f"{name}.jsonl", progress=False,
        )
        draw_predictions(task, samples, records, folder / "draw" / name, cfg.logging.eval_drawings)
        metrics.update({f"eval/{name}/{key}": value for key, value in task_metrics.items()})
    return metrics


def evaluate_during_training(policy: Policy, scorer, accelerator, eval_sets: dict, cfg: Config, folder: Path) -> dict[str, float]:
    """``evaluate_held_out`` on the main process; every process takes part in gathering the weights (FSDP),
    the others return no metrics. Computes under ``train.mixed_precision`` as the rollout does."""
    with sharding.gathered(scorer), accelerator.autocast():
        return evaluate_held_out(policy, eval_sets, cfg, folder) if accelerator.is_main_process else {}
