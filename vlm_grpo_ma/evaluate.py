"""Score models on benchmarks side by side: ``python -m vlm_grpo_ma.evaluate --models tiny runs/NAME``.

A model is ``tiny`` (the embedded default), a run directory (its latest checkpoint, or ``--step N``), a
checkpoint folder (``.../checkpoints/step-NNNNNN``), or a Hugging Face id / local model folder. Each task is
scored on its embedded held-out split or on a benchmark file (``--source TASK=FILE``, any format the task
loads: RefCOCO parquet, ScienceQA, HumanEval ...), with the same parsers and rewards as training.

Decoding is greedy by default; ``--samples N`` samples N answers per prompt (each from its own thought) at
``--temperature`` and reports pass@k with the unbiased estimator. Per sample, the records go to a JSONL as
they are made, so an interrupted evaluation resumes where it stopped when the same command is run again.

Outputs under ``--output-dir``: ``<model>/<task>-<split>/samples.jsonl`` (id, thought, answer, parsed
prediction, reward parts), ``.../draw/*.png`` (prediction in red, truth in green, for tasks that draw),
``results.json`` and ``results.md`` (one column per model). Training calls ``evaluate_task`` (the same code)
every ``train.eval_every`` steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vlm_grpo_ma import checkpoint as ckpt
from vlm_grpo_ma.policy import (
    ImageLoadError,
    Policy,
    SamplingSettings,
    encode_prompt,
    load_policy,
    open_image,
    prompt_generators,
)
from vlm_grpo_ma.registry import Sample, Task, get_task, import_task_modules
from vlm_grpo_ma.reward_pool import RewardTimeout
from vlm_grpo_ma.rewards import task_reward
from vlm_grpo_ma.rollout import generate_rollout
from vlm_grpo_ma.tiny import TINY_MODEL_NAME

log = logging.getLogger("vlm_grpo_ma.evaluate")


@dataclass(frozen=True)
class EvalSettings:
    """How answers are produced. Part of an evaluation's identity: resuming with other settings is refused."""

    samples: int = 1  # answers per prompt, each from its own thought; 1 = greedy decoding
    temperature: float = 1.0  # used when samples > 1
    max_thought_tokens: int = 40
    max_answer_tokens: int = 24
    seed: int = 0

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


def _score(task: Task, completion, sample: Sample) -> tuple[dict[str, float], object, str | None]:
    """(reward parts, parsed prediction, error kind) for one answer; a raising reward or parser scores 0."""
    parts, reward, error = task_reward(task, task.reward_weights, completion, sample)
    if error is not None:
        timed_out = isinstance(error, RewardTimeout)
        log.warning("reward of task %s on sample %s %s; scored 0", task.name, sample.id,
                    error if timed_out else f"raised {error!r}")
        return {"reward": 0.0}, None, "reward_timeout" if timed_out else "reward"
    parts["reward"] = reward
    try:
        prediction = task.parse(completion, sample) if task.parse is not None else None
    except Exception as error:  # noqa: BLE001 - a dump field is never worth a crash
        log.warning("parse of task %s raised %r on sample %s", task.name, error, sample.id)
        prediction = None
    return parts, prediction, None


def generate_records(
    policy: Policy,
    task: Task,
    samples: Sequence[Sample],
    settings: EvalSettings,
    *,
    batch_size: int,
    positions: dict[str, int] | None = None,
) -> Iterable[list[dict]]:
    """Per batch of prompts, one record per answer: {id, sample_index, thought, answer, prediction, parts,
    thought_tokens, answer_tokens, error}. A sample whose image cannot be read gets records with reward 0
    and ``error: "image"`` (counted in the ``errors`` metric), never an exception. ``positions`` (sample id
    -> its index in the whole benchmark; default: in ``samples``) seeds each sample's sampling generator."""
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
                    # per sample: what a sample gets does not depend on the batch size or on resuming
                    generators=[prompt_generators(settings.seed, position[s.id], 1)[0] for s in encodable],
                )
                rollout = generate_rollout(
                    policy, encodable, prompts, num_thoughts=settings.samples, num_answers=1, settings=sampling
                )
                for a, completion in enumerate(rollout.completions):
                    b, k, _ = rollout.indices(a)
                    parts, prediction, error = _score(task, completion, encodable[b])
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
        for batch in generate_records(policy, task, todo, settings, batch_size=batch_size, positions=positions):
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


def draw_predictions(task: Task, samples: Sequence[Sample], records: Sequence[dict], folder: Path, count: int) -> int:
    """PNG files of the first ``count`` samples with the first answer's prediction and the truth drawn."""
    if task.draw is None or count <= 0:
        return 0
    by_id = {r["id"]: r for r in records if r["sample_index"] == 0}
    folder.mkdir(parents=True, exist_ok=True)
    drawn = 0
    for index, sample in enumerate(s for s in samples if s.images and s.id in by_id):
        if drawn == count:
            break
        try:
            image = task.draw(open_image(sample.images[0]), sample, by_id[sample.id]["prediction"])
        except Exception as error:  # noqa: BLE001 - a picture is never worth a crash
            log.warning("could not draw sample %s: %s", sample.id, error)
            continue
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in sample.id)
        image.save(folder / f"{index:03d}-{safe_id}.png")
        drawn += 1
    return drawn


# ----------------------------------------------------------------------------------------------------------
# Models and the command line


@dataclass(frozen=True)
class ModelSpec:
    label: str  # column name in the results
    path: str  # what load_policy gets


def resolve_model(spec: str, step: int | None = None) -> ModelSpec:
    """``tiny``, a run directory (latest checkpoint or ``step``), a checkpoint folder, or a model id/folder."""
    if spec == TINY_MODEL_NAME:
        return ModelSpec("tiny", spec)
    path = Path(spec)
    if (path / "checkpoints").is_dir():
        found = ckpt.list_checkpoints(path)
        if step is not None:
            found = [c for c in found if c.name == ckpt.checkpoint_dir(path, step).name]
            if not found:
                steps = ", ".join(c.name for c in ckpt.list_checkpoints(path)) or "none"
                raise FileNotFoundError(f"run {path} has no checkpoint for --step {step}; it has: {steps}")
        if not found:
            raise FileNotFoundError(f"run {path} has no checkpoint yet (checkpoints/ is empty)")
        return ModelSpec(f"{path.resolve().name}@{found[-1].name}", str(found[-1] / "model"))
    if (path / "model").is_dir() and (path / "state.pt").is_file():  # one checkpoint folder
        return ModelSpec(f"{path.resolve().parent.parent.name}@{path.name}", str(path / "model"))
    if path.exists():
        return ModelSpec(path.resolve().name, str(path))
    return ModelSpec(spec.replace("/", "__"), spec)  # a hub id: load_policy says if it cannot be found


def _task_sources(pairs: Sequence[str], tasks: Sequence[str]) -> dict[str, str]:
    sources = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--source {pair!r} must look like TASK=FILE (e.g. grounding=refcoco_val.parquet)")
        name, file = pair.split("=", 1)
        if name not in tasks:
            raise ValueError(f"--source names task {name!r}, which is not in --tasks {', '.join(tasks)}")
        sources[name] = file
    return sources


def _benchmark_name(split: str, source: str | None) -> str:
    return Path(source).name.split(".")[0] if source else split


def results_table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one row per (benchmark, metric), one column per model, and the last minus the first model."""
    models = list(results)
    benchmarks = list(dict.fromkeys(b for m in models for b in results[m]))
    header = ["benchmark", "metric", *models] + (["change"] if len(models) > 1 else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for bench in benchmarks:
        names = list(dict.fromkeys(k for m in models for k in results[m].get(bench, {})))
        for name in names:
            values = [results[m].get(bench, {}).get(name) for m in models]
            cells = [bench, name] + ["" if v is None else _fmt(name, v) for v in values]
            if len(models) > 1:
                first, last = values[0], values[-1]
                change = None if first is None or last is None else last - first
                cells.append("" if change is None else f"{int(change):+d}" if name in COUNTS else f"{change:+.3f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


COUNTS = ("prompts", "answers")


def _fmt(name: str, value: float) -> str:
    return str(int(value)) if name in COUNTS else f"{value:.3f}"


def evaluate_models(
    models: Sequence[ModelSpec],
    task_names: Sequence[str],
    *,
    split: str,
    sources: dict[str, str],
    settings: EvalSettings,
    output_dir: Path,
    limit: int | None,
    batch_size: int,
    draw: int,
    dtype: str = "float32",
    progress: bool = True,
    load: Callable[..., Policy] = load_policy,
) -> dict:
    """Score every model on every task; write the outputs described in the module docstring."""
    output_dir.mkdir(parents=True, exist_ok=True)
    data = {}
    for name in task_names:
        task = get_task(name)
        samples = task.load(split, sources.get(name))
        data[name] = (task, samples[:limit] if limit else samples)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for model in models:
        policy = load(model.path, dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu")
        results[model.label] = {}
        for name, (task, samples) in data.items():
            bench = f"{name}-{_benchmark_name(split, sources.get(name))}"
            folder = output_dir / model.label / bench
            folder.mkdir(parents=True, exist_ok=True)
            _check_settings(folder / "settings.json", settings, model, len(samples))
            metrics, records = evaluate_task(
                policy, task, samples, settings, batch_size=batch_size, records_path=folder / "samples.jsonl",
                progress=progress, description=f"{model.label} {bench}",
            )
            draw_predictions(task, samples, records, folder / "draw", draw)
            results[model.label][bench] = metrics
            log.info("%s %s: %s", model.label, bench, json.dumps(metrics))
        del policy
    payload = {"settings": asdict(settings), "models": {m.label: m.path for m in models}, "results": results}
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2))
    table = results_table(results)
    (output_dir / "results.md").write_text(table)
    return payload


def _check_settings(path: Path, settings: EvalSettings, model: ModelSpec, num_samples: int) -> None:
    """Resuming is only sound with the same model and settings: refuse otherwise."""
    identity = {"model": model.path, "settings": asdict(settings)}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != identity:
            raise ValueError(
                f"{path.parent} holds an evaluation with other settings ({saved}); this one is {identity}. "
                "Use another --output-dir, or delete that folder to start it again"
            )
    else:
        path.write_text(json.dumps(identity, indent=2))


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo_ma.evaluate",
        description="Score models (the embedded default, run directories, checkpoints, model ids or folders) "
        "on task benchmarks with the training rewards; writes results.json, results.md, per-sample JSONL and "
        "drawings. Re-running the same command resumes an interrupted evaluation.",
    )
    parser.add_argument("--models", nargs="+", default=[TINY_MODEL_NAME], help="models to compare (default: tiny)")
    parser.add_argument("--step", type=int, help="checkpoint step for run directories (default: their latest)")
    parser.add_argument("--tasks", nargs="+", default=["grounding"], help="task names (default: grounding)")
    parser.add_argument("--split", default="test", help="embedded split for tasks without --source (default: test)")
    parser.add_argument("--source", action="append", default=[], metavar="TASK=FILE", help="a benchmark file for a task")
    parser.add_argument("--task-module", action="append", default=[], help="extra task module (dotted name or .py)")
    parser.add_argument("--samples", type=int, default=1, help="answers per prompt; 1 = greedy (default), >1 = pass@k")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature when --samples > 1")
    parser.add_argument("--max-thought-tokens", type=int, default=40)
    parser.add_argument("--max-answer-tokens", type=int, default=24)
    parser.add_argument("--limit", type=int, help="score only the first N samples of each benchmark")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draw", type=int, default=8, help="images to draw per model and task (default 8)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--output-dir", default="evals/latest", help="where results go (default: evals/latest)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        for value, name in ((args.limit, "--limit"), (args.batch_size, "--batch-size")):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        settings = EvalSettings(
            samples=args.samples, temperature=args.temperature, max_thought_tokens=args.max_thought_tokens,
            max_answer_tokens=args.max_answer_tokens, seed=args.seed,
        )
        import_task_modules(args.task_module)
        for name in args.tasks:
            get_task(name)
        sources = _task_sources(args.source, args.tasks)
        models = [resolve_model(spec, args.step) for spec in args.models]
        payload = evaluate_models(
            models, args.tasks, split=args.split, sources=sources, settings=settings,
            output_dir=Path(args.output_dir), limit=args.limit, batch_size=args.batch_size, draw=args.draw,
            dtype=args.dtype, progress=not args.no_progress,
        )
    except (ValueError, KeyError, OSError) as error:  # bad arguments, unknown task, missing file or model
        print(f"error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    print(results_table(payload["results"]), end="")
    print(f"results: {Path(args.output_dir) / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
