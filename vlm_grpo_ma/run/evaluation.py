"""Scoring a task's samples with a policy: records per answer (greedy, or N samples with pass@k), their
metrics, and drawings. ``python -m vlm_grpo_ma.evaluate`` (tools/evaluate.py) and the held-out evaluation
during training (held_out.py) both call it, so the two score alike."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from vlm_grpo_ma.engines.decode import SamplingSettings, prompt_generators
from vlm_grpo_ma.engines.rollout import generate_rollout
from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.prompts import encode_prompt, open_image
from vlm_grpo_ma.run.rewards import score_answers, with_judgements
from vlm_grpo_ma.task_api.drawing import with_legend
from vlm_grpo_ma.task_api.images import ImageLoadError
from vlm_grpo_ma.task_api.registry import Sample, Task
from vlm_grpo_ma.task_api.reward_pool import DEFAULT_TIMEOUT_S, RewardTimeout
from vlm_grpo_ma.task_api.videos import VideoBudget, decode_video, frame_strip

log = logging.getLogger("vlm_grpo_ma.evaluate")


@dataclass(frozen=True)
class EvalSettings:
    """How answers are produced. Part of an evaluation's identity: resuming with other settings is refused."""

    samples: int = 1  # answers per prompt, each from its own thought; 1 = greedy decoding
    temperature: float = 1.0  # used when samples > 1
    max_thought_tokens: int = 40
    max_answer_tokens: int = 24
    seed: int = 0
    max_turns: int = 3  # tool calls a thought may make (tasks with tools, rollout.max_turns)

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f"samples={self.samples} must be >= 1")
        if self.samples > 1 and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 when sampling (samples={self.samples})")

    @property
    def greedy(self) -> bool:
        return self.samples == 1


# ----------------------------------------------------------------------------------------------------------
# Metrics (pure)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two up to n, and n."""
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= n]
    return ks if ks[-1] == n else [*ks, n]


def summarize_records(task: Task, records: Sequence[dict], samples_per_prompt: int) -> dict[str, float]:
    """Task metrics over per-answer records: the mean of every logged part and of the reward, the format
    rate, mean thought/answer lengths (tokens), accuracy (the mean of ``task.success``) and pass@k."""
    if not records:
        return {"prompts": 0}
    metrics: dict[str, float] = {"prompts": len({r["id"] for r in records}), "answers": len(records)}
    for name in ("reward", *task.metrics):
        values = [r["parts"][name] for r in records if name in r["parts"]]
        if not values and name != "reward" and any(not r.get("error") for r in records):
            continue  # a part the task writes only for some sources (right_thought needs a reference thought)
        metrics[name] = sum(values) / len(records) if values else 0.0  # a missing part (error) counts as 0
    metrics["thought_tokens"] = sum(r["thought_tokens"] for r in records) / len(records)
    metrics["answer_tokens"] = sum(r["answer_tokens"] for r in records) / len(records)
    metrics["errors"] = sum(1 for r in records if r.get("error")) / len(records)
    if task.success is not None:
        correct_by_prompt: dict[str, list[float]] = {}
        for r in records:
            correct_by_prompt.setdefault(r["id"], []).append(float(r["parts"].get(task.success, 0.0)))
        metrics["accuracy"] = sum(sum(v) / len(v) for v in correct_by_prompt.values()) / len(correct_by_prompt)
        if samples_per_prompt > 1:
            for k in pass_at_k_values(samples_per_prompt):
                metrics[f"pass@{k}"] = sum(
                    pass_at_k(len(v), int(sum(v)), k) for v in correct_by_prompt.values()
                ) / len(correct_by_prompt)
    return metrics


# ----------------------------------------------------------------------------------------------------------
# Scoring one task


def _score_all(task: Task, completions: Sequence, samples: Sequence[Sample], judge) -> list[tuple[dict[str, float], object, str | None]]:
    """(reward parts, parsed prediction, error kind) per answer, the answers' judge queries asked together
    (``rewards.with_judgements``); a raising reward or parser scores 0."""
    jobs = [(task, task.reward_weights, completion, sample) for completion, sample in zip(completions, samples, strict=True)]
    jobs, _, _ = with_judgements(jobs, judge, deadline_s=DEFAULT_TIMEOUT_S)
    scored = []
    for (_, _, completion, sample), (parts, reward, error) in zip(jobs, score_answers(jobs), strict=True):
        if error is not None:
            timed_out = isinstance(error, RewardTimeout)
            log.warning("reward of task %s on sample %s %s; scored 0", task.name, sample.id,
                        error if timed_out else f"raised {error!r}")
            scored.append(({"reward": 0.0}, None, "reward_timeout" if timed_out else "reward"))
            continue
        parts["reward"] = reward
        try:
            prediction = task.parse(completion, sample) if task.parse is not None else None
        except Exception as error:  # noqa: BLE001 - a dump field is never worth a crash
            log.warning("parse of task %s raised %r on sample %s", task.name, error, sample.id)
            prediction = None
        scored.append((parts, prediction, None))
    return scored


def generate_records(
    policy: Policy,
    task: Task,
    samples: Sequence[Sample],
    settings: EvalSettings,
    *,
    batch_size: int,
    positions: dict[str, int] | None = None,
    judge=None,
) -> Iterable[list[dict]]:
    """Per batch of prompts, one record per answer: {id, sample_index, thought, answer, prediction, parts,
    thought_tokens, answer_tokens, error}. A sample whose image cannot be read gets records with reward 0
    and ``error: "image"`` (counted in the ``errors`` metric), never an exception. ``positions`` (sample id
    -> its index in the whole benchmark; default: in ``samples``) seeds each sample's sampling generator. ``judge``:
    the served judge (``task_api.judge.Judge``) of a task with ``judge_query``."""
    position = positions if positions is not None else {sample.id: i for i, sample in enumerate(samples)}
    was_training = policy.model.training
    policy.model.eval()
    try:
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            records, encodable, prompts = [], [], []
            for sample in chunk:
                try:
                    prompts.append(encode_prompt(policy, sample, task.instruction))
                    encodable.append(sample)
                except ImageLoadError as error:
                    log.warning("sample %s: %s; scored 0", sample.id, error)
                    records += [_failed_record(sample, j, "image") for j in range(settings.samples)]
            if encodable:
                sampling = SamplingSettings(
                    temperature=0.0 if settings.greedy else settings.temperature,
                    max_thought_tokens=settings.max_thought_tokens,
                    max_answer_tokens=settings.max_answer_tokens,
                    max_turns=settings.max_turns,
                    # per sample: what a sample gets does not depend on the batch size or on resuming
                    generators=[prompt_generators(settings.seed, position[s.id], 1)[0] for s in encodable],
                )
                rollout = generate_rollout(
                    policy, encodable, prompts, num_thoughts=settings.samples, num_answers=1, settings=sampling
                )
                answer_samples = [encodable[rollout.indices(a)[0]] for a in range(len(rollout.completions))]
                scored = _score_all(task, rollout.completions, answer_samples, judge)
                for a, completion in enumerate(rollout.completions):
                    b, k, _ = rollout.indices(a)
                    parts, prediction, error = scored[a]
                    if rollout.tree.thought_ended_turn[a]:  # as in training: no answer after an ended turn
                        parts = {name: 0.0 for name in parts}
                    records.append(
                        {
                            "id": encodable[b].id,
                            "sample_index": k,
                            "thought": completion.thought,
                            "answer": completion.answer,
                            "prediction": prediction,
                            "parts": parts,
                            "thought_tokens": len(rollout.tree.thought_ids[a]),
                            "answer_tokens": len(rollout.tree.answer_ids[a]),
                            "error": error,
                        }
                    )
            yield records
    finally:
        policy.model.train(was_training)


def _failed_record(sample: Sample, index: int, error: str) -> dict:
    return {
        "id": sample.id, "sample_index": index, "thought": "", "answer": "", "prediction": None,
        "parts": {"reward": 0.0}, "thought_tokens": 0, "answer_tokens": 0, "error": error,
    }


def evaluate_task(
    policy: Policy,
    task: Task,
    samples: Sequence[Sample],
    settings: EvalSettings,
    *,
    batch_size: int = 16,
    records_path: Path | None = None,
    progress: bool = True,
    description: str = "",
    judge=None,
) -> tuple[dict[str, float], list[dict]]:
    """Score ``samples``; returns (metrics, records). With ``records_path`` the records are appended there as
    each batch finishes and samples already recorded in it are not generated again (resume)."""
    records: list[dict] = []
    if records_path is not None and records_path.is_file():
        records = _read_complete_records(records_path, settings.samples)
    done = {r["id"] for r in records}
    todo = [s for s in samples if s.id not in done]
    bar = tqdm(total=len(samples), initial=len(samples) - len(todo), desc=description or task.name, disable=not progress)
    sink = open(records_path, "a", encoding="utf-8") if records_path is not None else None  # noqa: SIM115
    try:
        positions = {sample.id: i for i, sample in enumerate(samples)}  # a resumed sample samples as before
        for batch in generate_records(policy, task, todo, settings, batch_size=batch_size, positions=positions, judge=judge):
            records += batch
            if sink is not None:
                sink.writelines(json.dumps(r) + "\n" for r in batch)
                sink.flush()
            bar.update(len({r["id"] for r in batch}))
            metrics = summarize_records(task, records, settings.samples)
            bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("reward", "accuracy") if k in metrics})
    finally:
        bar.close()
        if sink is not None:
            sink.close()
    wanted = {s.id for s in samples}
    records = [r for r in records if r["id"] in wanted]
    return summarize_records(task, records, settings.samples), records


def _read_complete_records(path: Path, per_sample: int) -> list[dict]:
    """Records of samples that have all their answers; a torn last line (a crash mid-write) is dropped and
    the file is rewritten without it."""
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["id"]] = counts.get(r["id"], 0) + 1
    complete = [r for r in rows if counts[r["id"]] == per_sample]
    if len(complete) != len(lines):
        path.write_text("".join(json.dumps(r) + "\n" for r in complete), encoding="utf-8")
    return complete


_said_no_draw: set[str] = set()  # tasks whose missing draw was logged


def draw_predictions(
    task: Task,
    samples: Sequence[Sample],
    records: Sequence[dict],
    folder: Path,
    count: int,
    *,
    video_budget: VideoBudget | None = None,
    patch_factor: int = 28,
) -> int:
    """PNG files of the first ``count`` samples with the first answer's prediction and the truth drawn, and a
    legend of the two colours below. A sample with images is drawn on its first image; one with videos only,
    on a strip of its first video's frames as the model saw them (decoded under ``video_budget``, sides a
    multiple of ``patch_factor``: pass the policy's ``video_budget`` and ``patch_factor``)."""
    if count <= 0:
        return 0
    if task.draw is None:
        if task.name not in _said_no_draw:  # once a process: every evaluation would say it again
            _said_no_draw.add(task.name)
            log.info("task %s has no draw function: no drawings of its predictions (docs/TASKS.md, Task.draw)", task.name)
        return 0
    by_id = {r["id"]: r for r in records if r["sample_index"] == 0}
    folder.mkdir(parents=True, exist_ok=True)
    drawn = 0
    for index, sample in enumerate(s for s in samples if (s.images or s.videos) and s.id in by_id):
        if drawn == count:
            break
        try:
            picture = _picture(sample, video_budget or VideoBudget(), patch_factor)
            image = task.draw(picture, sample, by_id[sample.id]["prediction"])
        except Exception as error:  # noqa: BLE001 - a picture is never worth a crash (a broken image or video: none)
            log.warning("could not draw sample %s: %s", sample.id, error)
            continue
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in sample.id)
        with_legend(image).save(folder / f"{index:03d}-{safe_id}.png")
        drawn += 1
    return drawn


def _picture(sample: Sample, video_budget: VideoBudget, patch_factor: int):
    """What a sample's prediction is drawn on: its first image, or a strip of its first video's frames."""
    if sample.images:
        return open_image(sample.images[0])
    return frame_strip(decode_video(sample.videos[0], video_budget, factor=patch_factor))
