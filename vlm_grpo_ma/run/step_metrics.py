"""What a training step logs about its rollout (rewards, advantages, tokens), its speed, and the readable
dump of its first prompts' trees. Plain functions of the step's objects; the update's figures come from
``update.update_policy``."""

from __future__ import annotations

from pathlib import Path

import torch

from vlm_grpo_ma.algorithm.diagnostics import thought_value_noise, zero_signal_shares
from vlm_grpo_ma.engines.rollout import Rollout
from vlm_grpo_ma.run.batch import TrainBatch
from vlm_grpo_ma.run.rewards import ScoredRollout
from vlm_grpo_ma.task_api.registry import Task


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
    logged = {name for task in tasks.values() for name in task.metrics} | {"overlong"}  # + the trainer's shaping
    part_names = sorted(logged & set(scored.parts))
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
    metrics.update(tool_metrics(rollout, tasks))
    return metrics


def tool_metrics(rollout: Rollout, tasks: dict[str, Task]) -> dict:
    """Tool use over the thoughts of prompts whose task has tools (none when no task of the run has any):
    calls per thought, the share that looked (got at least one image back), the share of calls that could not
    be served, the share closed for calling past ``rollout.max_turns`` and the tool-result tokens per thought."""
    if not any(task.tools for task in tasks.values()):
        return {}
    tree, K = rollout.tree, rollout.num_thoughts
    rows = [t for t in range(len(tree.thought_ids)) if tasks[rollout.samples[t // K].task].tools]
    if not rows:
        return {}
    turns = [tree.thought_turns[t] for t in rows]
    calls = sum(len(ts) + int(tree.thought_over_turns[t]) for ts, t in zip(turns, rows, strict=True))
    invalid = sum(turn.error for ts in turns for turn in ts)
    return {
        "tools/calls_per_thought": calls / len(rows),
        "tools/looked_share": sum(any(turn.num_images for turn in ts) for ts in turns) / len(rows),
        "tools/invalid_call_share": invalid / calls if calls else 0.0,
        "tools/over_turn_share": sum(tree.thought_over_turns[t] for t in rows) / len(rows),
        "tools/result_tokens_per_thought": sum(len(turn.ids) for ts in turns for turn in ts) / len(rows),
    }


def timing_metrics(batch: TrainBatch, step_seconds: float, rollout_seconds: float, generated_tokens: int) -> dict:
    """Speed figures; ``generated_tokens`` are those of every draw the rollout time was spent on."""
    trained_tokens = float(batch.num_trained_tokens())
    metrics = {
        "time/step_seconds": step_seconds,
        "time/rollout_seconds": rollout_seconds,
        "time/trained_tokens_per_second": trained_tokens / (step_seconds - rollout_seconds),
        "time/generated_tokens_per_second": generated_tokens / rollout_seconds,
        "rollout/generated_tokens": generated_tokens,  # this process's, thoughts once + answers, every draw
    }
    if torch.cuda.is_available():  # a running maximum, in GiB
        metrics["time/peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics


def rollout_records(
    step: int, rollout: Rollout, scored: ScoredRollout, how_many: int, thought_adv: torch.Tensor | None = None
) -> list[dict]:
    """A readable dump of the first ``how_many`` prompts of the step: thought, answers and their rewards, and
    with ``thought_adv`` ([B, K] or [B, K, M]) each thought's advantage (a number, or its M answers' list)."""
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
            t = rollout.thought_row(b, k)
            if rollout.tree.thought_turns[t] or rollout.tree.thought_over_turns[t]:  # each tool turn, as the model got it
                thoughts[-1]["tool_turns"] = [{"error": turn.error, "images": turn.num_images, "crop_boxes": [list(box) for box in turn.boxes]}
                                              for turn in rollout.tree.thought_turns[t]]  # fmt: skip
                thoughts[-1]["over_turn"] = rollout.tree.thought_over_turns[t]
            if thought_adv is not None:  # [B, K], or [B, K, M] where an estimator gives each answer its own
                value = thought_adv[b, k]
                thoughts[-1]["thought_advantage"] = float(value) if value.dim() == 0 else value.tolist()
        images = [img if isinstance(img, str) else "<in-memory image>" for img in sample.images]
        record = {"step": step, "task": sample.task, "sample_id": sample.id, "images": images, "question": sample.question,
                  "thoughts": thoughts}  # fmt: skip
        if sample.videos:
            record["videos"] = [str(v) if isinstance(v, (str, Path)) else f"<{len(v)} frames>" for v in sample.videos]
        records.append(record)
    return records


def headline_metrics(tasks: dict[str, Task]) -> list[str]:
    """The metrics the end-of-run summary reports: the mean reward, each task's first logged part and, with
    several tasks, each task's mean reward."""
    headline = ["reward/mean"] + [f"reward/{t.metrics[0]}" for t in tasks.values() if t.metrics]
    if len(tasks) > 1:
        headline += [f"reward/{name}/mean" for name in tasks]
    return headline
