"""Route each completion to its task's reward; a raising reward is caught, scored 0 and counted."""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vlm_grpo_ma.registry import Task, get_task, weighted_reward
from vlm_grpo_ma.rollout import Rollout

log = logging.getLogger(__name__)


@dataclass
class ScoredRollout:
    rewards: torch.Tensor  # [B, K, M]
    parts: dict[str, torch.Tensor]  # name -> [B, K, M] (NaN where a completion's task has no such part)
    per_answer_parts: list[dict[str, float]]  # [B * K * M], answer-row order (for rollout dumps)
    counters: Counter = field(default_factory=Counter)  # reward_errors, thought_ended_turn, thought_truncated


def reward_weights_for(task: Task, overrides: dict[str, float]) -> dict[str, float]:
    """The task's default part weights with the overrides that name one of its parts (in a task mixture an
    override like ``format`` applies to every task that has that part)."""
    known = set(task.reward_weights) | set(task.metrics)
    return {**task.reward_weights, **{name: w for name, w in overrides.items() if name in known}}


def check_reward_overrides(tasks: list[Task], overrides: dict[str, float]) -> None:
    """Raise ValueError, naming the valid parts, when an override names a part no task of the run has."""
    known = {name for task in tasks for name in (*task.reward_weights, *task.metrics)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        names = ", ".join(task.name for task in tasks)
        raise ValueError(f"data.reward_weights names unknown parts {unknown} of task(s) {names}; valid: {sorted(known)}")


def task_reward(task: Task, weights: dict[str, float], completion, sample) -> tuple[dict[str, float], float, Exception | None]:
    """(parts, weighted reward, None), or ({}, 0.0, the error) when the task's reward raised."""
    try:
        parts = dict(task.reward(completion, sample))
        return parts, weighted_reward(parts, weights), None
    except Exception as error:  # a reward must never stop training: scored 0 and counted by the caller
        return {}, 0.0, error


def score_rollout(
    rollout: Rollout,
    *,
    weight_overrides: dict[str, float] | None = None,
    truncated_thoughts: str = "close",
    workers: int = 1,
) -> ScoredRollout:
    """Score every answer. A thought that ended the turn scores 0; so does a truncated thought when
    ``truncated_thoughts == "zero"``. With ``workers > 1`` the task rewards run in that many threads (code
    rewards wait on sandboxed processes); the result does not depend on it."""
    counters: Counter = Counter()
    flat_rewards: list[float] = []
    flat_parts: list[dict[str, float]] = []
    tree = rollout.tree
    jobs = []
    for a, completion in enumerate(rollout.completions):
        sample = rollout.samples[rollout.indices(a)[0]]
        task = get_task(sample.task)
        jobs.append((task, reward_weights_for(task, weight_overrides or {}), completion, sample))
    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            results = list(pool.map(lambda job: task_reward(*job), jobs))
    else:
        results = [task_reward(*job) for job in jobs]
    for a, (parts, reward, error) in enumerate(results):
        task, _, _, sample = jobs[a]
        t = a // rollout.num_answers
        if error is not None:
            counters["reward_errors"] += 1
            if counters["reward_errors"] == 1:
                log.warning("reward of task %s raised %r on sample %s; scored 0", task.name, error, sample.id)
        if rollout.answers_void(t, truncated_thoughts):  # scored 0 by rule (and not trained on: batch.py)
            reward = 0.0
            counters["answers_after_ended_turn"] += int(tree.thought_ended_turn[t])
        parts["reward"] = reward
        flat_rewards.append(reward)
        flat_parts.append(parts)
    for t in range(len(tree.thought_ids)):
        counters["thought_truncated"] += int(tree.thought_truncated[t])
        counters["thought_ended_turn"] += int(tree.thought_ended_turn[t])
    shape = (rollout.num_prompts, rollout.num_thoughts, rollout.num_answers)
    names = sorted({name for parts in flat_parts for name in parts})
    parts_tensors = {
        name: torch.tensor([p.get(name, float("nan")) for p in flat_parts], dtype=torch.float32).view(shape)
        for name in names
    }
    rewards = torch.tensor(flat_rewards, dtype=torch.float32).view(shape)
    return ScoredRollout(rewards=rewards, parts=parts_tensors, per_answer_parts=flat_parts, counters=counters)
