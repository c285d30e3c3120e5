"""Route each completion to its task's reward, run in a worker process under a deadline (``reward_pool``): a
reward that raises is scored 0 and counted (``reward_errors``), one past its deadline is killed, scored 0 and
counted (``reward_timeouts``)."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vlm_grpo_ma.algorithm.advantages import overlong_penalty
from vlm_grpo_ma.engines.rollout import Rollout
from vlm_grpo_ma.task_api.judge import Judge
from vlm_grpo_ma.task_api.registry import Sample, Task, get_task, weighted_reward
from vlm_grpo_ma.task_api.reward_pool import DEFAULT_TIMEOUT_S, RewardTimeout, shared_pool

log = logging.getLogger(__name__)


@dataclass
class ScoredRollout:
    rewards: torch.Tensor  # [B, K, M]
    parts: dict[str, torch.Tensor]  # name -> [B, K, M] (NaN where a completion's task has no such part)
    per_answer_parts: list[dict[str, float]]  # [B * K * M], answer-row order (for rollout dumps)
    # reward_errors, reward_timeouts, thought_ended_turn, thought_truncated, answers_after_ended_turn, judge_* (JudgeStats)
    counters: Counter = field(default_factory=Counter)
    judge_seconds: float = 0.0  # waiting for the served judge's verdicts


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


def _weighed(outcome, weights: dict[str, float]) -> tuple[dict[str, float], float, Exception | None]:
    parts, error = outcome
    if error is not None:
        return {}, 0.0, error
    try:
        return parts, weighted_reward(parts, weights), None
    except Exception as error:  # a part the weights name is missing or not a number
        return {}, 0.0, error


Job = tuple[Task, dict[str, float], object, object]  # (task, part weights, completion, sample)


def with_judgements(jobs: list[Job], judge: Judge | None, *, deadline_s: float) -> tuple[list[Job], Counter, float]:
    """``jobs`` with the served judge's verdict in each completion of a task that has ``judge_query``
    (``Completion.judgement``; task_api/judge.py), the call's counts (``judge_*``) and its seconds. Every query
    goes out in one ``Judge.verdicts`` call (concurrent, deduplicated, cached) within ``deadline_s``. Without a
    judge, or a task without ``judge_query``, the jobs are returned as they are. A ``judge_query`` that raises
    asks nothing (counted as ``judge_query_errors``, logged once)."""
    counters: Counter = Counter()
    if judge is None or not any(task.judge_query is not None for task, *_ in jobs):
        return jobs, counters, 0.0
    queries = []
    for task, _, completion, sample in jobs:
        query = None
        if task.judge_query is not None:
            try:
                query = task.judge_query(completion, sample)
            except Exception as error:  # noqa: BLE001 - model output is never worth a crash
                counters["judge_query_errors"] += 1
                if counters["judge_query_errors"] == 1:
                    log.warning("judge_query of task %s raised %r on sample %s; nothing asked", task.name, error, sample.id)
        queries.append(query)
    verdicts, stats = judge.verdicts(queries, deadline_s=deadline_s)
    judged = [
        (task, weights, dataclasses.replace(completion, judgement=verdict) if query is not None else completion, sample)
        for (task, weights, completion, sample), query, verdict in zip(jobs, queries, verdicts, strict=True)
    ]
    return judged, counters + stats.counters(), stats.seconds


def score_answers(
    jobs: list[Job], *, workers: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[tuple[dict[str, float], float, Exception | None]]:
    """``(parts, weighted reward, None)`` per ``(task, weights, completion, sample)`` job, in order, or
    ``({}, 0.0, error)`` when the reward raised (``RewardError``) or ran past ``timeout_s`` seconds
    (``RewardTimeout``). The rewards run in ``workers`` worker processes; the result does not depend on it.
    A reward gets the sample without its images and videos: pickling a lazily opened image decodes it (a 0.7 MB JPEG sent
    as 3.7 MB, once per answer) and leaves it decoded in the trainer's sample; rewards read the truth, not
    pixels (image sizes a reward needs travel in ``Sample.meta``)."""
    outcomes = shared_pool().run(
        [(task.reward, completion, _without_images(sample)) for task, _, completion, sample in jobs],
        workers=workers, timeout_s=timeout_s,
    )  # fmt: skip
    return [_weighed(outcome, weights) for outcome, (_, weights, _, _) in zip(outcomes, jobs, strict=True)]


def _without_images(sample):
    """The sample without its images and videos (a video's frame list may hold images too)."""
    if isinstance(sample, Sample) and (sample.images or sample.videos):
        return dataclasses.replace(sample, images=(), videos=())
    return sample


def task_reward(
    task: Task, weights: dict[str, float], completion, sample, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[dict[str, float], float, Exception | None]:
    """(parts, weighted reward, None), or ({}, 0.0, the error) when the task's reward raised or timed out
    (one job of ``score_answers``)."""
    return score_answers([(task, weights, completion, sample)], timeout_s=timeout_s)[0]


def score_rollout(
    rollout: Rollout,
    *,
    weight_overrides: dict[str, float] | None = None,
    truncated_thoughts: str = "close",
    workers: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    judge: Judge | None = None,
) -> ScoredRollout:
    """Score every answer. A thought that ended the turn scores 0; so does a truncated thought when
    ``truncated_thoughts == "zero"``. The task rewards run in ``workers`` worker processes, each call under a
    deadline of ``timeout_s`` seconds (``rollout.reward_timeout_s``); the result does not depend on ``workers``.
    Tasks with ``judge_query`` get ``judge``'s verdicts first, all of the step's within that deadline too."""
    flat_parts: list[dict[str, float]] = []
    tree = rollout.tree
    jobs = []
    for a, completion in enumerate(rollout.completions):
        sample = rollout.samples[rollout.indices(a)[0]]
        task = get_task(sample.task)
        jobs.append((task, reward_weights_for(task, weight_overrides or {}), completion, sample))
    jobs, counters, judge_seconds = with_judgements(jobs, judge, deadline_s=timeout_s)
    results = score_answers(jobs, workers=workers, timeout_s=timeout_s)
    for a, (parts, reward, error) in enumerate(results):
        task, _, _, sample = jobs[a]
        t = a // rollout.num_answers
        if isinstance(error, RewardTimeout):
            counters["reward_timeouts"] += 1
            if counters["reward_timeouts"] == 1:
                log.warning("reward of task %s on sample %s: %s; scored 0", task.name, sample.id, error)
        elif error is not None:
            counters["reward_errors"] += 1
            if counters["reward_errors"] == 1:
                log.warning("reward of task %s raised %r on sample %s; scored 0", task.name, error, sample.id)
        if rollout.answers_void(t, truncated_thoughts):  # scored 0 by rule (and not trained on: batch.py)
            reward = 0.0
            counters["answers_after_ended_turn"] += int(tree.thought_ended_turn[t])
        parts["reward"] = reward
        flat_parts.append(parts)
    for t in range(len(tree.thought_ids)):
        counters["thought_truncated"] += int(tree.thought_truncated[t])
        counters["thought_ended_turn"] += int(tree.thought_ended_turn[t])
        if tree.thought_turns[t] or tree.thought_over_turns[t]:  # tool use: counted only where it happened
            counters["invalid_tool_calls"] += sum(turn.error for turn in tree.thought_turns[t])
            counters["over_turn_thoughts"] += int(tree.thought_over_turns[t])
    shape = (rollout.num_prompts, rollout.num_thoughts, rollout.num_answers)
    return dataclasses.replace(_scored(flat_parts, shape, counters), judge_seconds=judge_seconds)


def _scored(flat_parts: list[dict[str, float]], shape: tuple[int, int, int], counters: Counter) -> ScoredRollout:
    """A ScoredRollout from each answer's parts (``"reward"`` among them), in answer-row order."""
    names = sorted({name for parts in flat_parts for name in parts})
    parts_tensors = {
        name: torch.tensor([p.get(name, float("nan")) for p in flat_parts], dtype=torch.float32).view(shape)
        for name in names
    }
    return ScoredRollout(rewards=parts_tensors["reward"].clone(), parts=parts_tensors, per_answer_parts=flat_parts, counters=counters)


def gather_scored_groups(groups: Sequence[tuple[ScoredRollout, int]], counters: Counter) -> ScoredRollout:
    """The scores of prompt groups ``(scored, b)`` in that order (``rollout.gather_groups``'s order), with
    ``counters`` (the step's, over every draw, kept or not)."""
    rewards = groups[0][0].rewards
    K, M = rewards.shape[1], rewards.shape[2]
    flat_parts = [scored.per_answer_parts[(b * K + k) * M + m] for scored, b in groups for k in range(K) for m in range(M)]
    draws = {id(scored): scored for scored, _ in groups}.values()
    gathered = _scored(flat_parts, (len(groups), K, M), counters)
    return dataclasses.replace(gathered, judge_seconds=sum(scored.judge_seconds for scored in draws))


def add_overlong_penalty(
    scored: ScoredRollout, rollout: Rollout, *, max_thought_tokens: int, max_answer_tokens: int,
    thought_buffer: int, answer_buffer: int, penalty: float, truncated_thoughts: str,
) -> ScoredRollout:  # fmt: skip
    """DAPO's soft overlong punishment (``advantages.overlong_penalty``) added to every answer's reward: for the
    answer's length and for its thought's. An answer void by rule (``Rollout.answers_void``: after a thought that
    ended the turn, say) gets none for its own length: it is text past the end, not the policy's answer, and
    it would value the thought by it. The penalty is also a part, ``overlong`` (<= 0), so it is logged. A
    no-op when both buffers are 0."""
    if thought_buffer == 0 and answer_buffer == 0:
        return scored
    tree, M = rollout.tree, rollout.num_answers
    thought_lengths = torch.tensor([len(tree.thought_ids[a // M]) for a in range(len(tree.answer_ids))])
    answer_lengths = torch.tensor([len(ids) for ids in tree.answer_ids])
    shaping = overlong_penalty(thought_lengths, max_tokens=max_thought_tokens, buffer_tokens=thought_buffer, penalty=penalty)
    counted = torch.tensor([not rollout.answers_void(a // M, truncated_thoughts) for a in range(len(tree.answer_ids))])
    shaping += counted * overlong_penalty(answer_lengths, max_tokens=max_answer_tokens, buffer_tokens=answer_buffer, penalty=penalty)
    flat_parts = [
        {**parts, "overlong": float(extra), "reward": parts["reward"] + float(extra)}
        for parts, extra in zip(scored.per_answer_parts, shaping.tolist(), strict=True)
    ]
    shaped = _scored(flat_parts, tuple(scored.rewards.shape), scored.counters)
    return dataclasses.replace(shaped, judge_seconds=scored.judge_seconds)
