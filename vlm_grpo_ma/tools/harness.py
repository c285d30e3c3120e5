"""Scores through lmms-eval, beside this project's evaluator: ``python -m vlm_grpo_ma.evaluate --harness lmms-eval
--models MODEL_OR_RUN ... --tasks NAME ...`` (docs/EVALUATION.md).

lmms-eval lives in an environment of its own (``.venv-harness``, made by ``scripts/setup.sh --harness``): its pins
(``wandb==0.25.0``, ``av<16``) collide with the trackers extra and the video decoder here. This module, in the
trainer's environment, writes the task files, runs ``tools/harness_worker.py`` in the harness's environment once
per model, and gathers what it wrote.

Tasks. A name is lmms-eval's own (``refcoco_bbox_rec_testA``).
- ``--prompt training`` (the default) asks the model the way it was trained, through a task file of ours
  (``vgm_<name>``, written into ``<output>/lmms-eval/tasks/``): the row read as the project task reads it, its
  question and instruction, its
  ``<think>/<answer>`` format, its parsed answer handed to the harness (harness_worker.py says how), scored by the
  harness's own code on the same data. Offline: the data is a local file, ``--source NAME=FILE`` in lmms-lab's
  format (the hub's copy of the dataset, downloaded elsewhere), or, for ``refcoco_bbox_rec_testA`` and
  ``mathvista_testmini``, the shipped fixtures ``data/harness/refcoco_testA.parquet`` and
  ``data/harness/mathvista_testmini.parquet``. ``TRAINING_PROMPT_TASKS``
  lists the names it knows.
- ``--prompt stock`` runs lmms-eval's own task file as it is (its prompt, its extraction), the model's whole reply
  handed to it; its data from the Hugging Face cache, read offline, or from ``--source NAME=FILE`` (a task file
  that includes lmms-eval's and reads the split from the file).

Outputs, under ``--output-dir`` (default ``evals/<models>--<tasks>--lmms-eval``): ``lmms-eval/<model>.json`` (the
harness's results and per-sample replies, raw), ``results.json`` and ``results.md`` (one row per model, benchmark
and metric, with a column saying where the number came from). Several models (a run's checkpoints, say) give one
row each: a curve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS_PYTHON = ROOT / ".venv-harness" / "bin" / "python"
HARNESS_VERSION = "0.7.3"  # scripts/harness-requirements.txt pins it
PROMPTS = ("training", "stock")


class HarnessError(ValueError):
    """The harness cannot run as asked: one line naming the fix."""


@dataclass(frozen=True)
class TrainingPromptTask:
    """An lmms-eval benchmark asked with the project's prompt: the project tasks whose loaders read its rows, the
    file's split, the column of a row's id and of its truth, the lmms-eval functions of harness_worker.py
    (``<functions>_doc_to_visual``, ``<functions>_process_results``), the metrics, and the shipped fixture."""

    tasks: tuple[str, ...]
    split: str
    id_column: str
    target: str
    functions: str
    metrics: tuple[str, ...]
    fixture: str | None = None


def _refcoco(split: str, fixture: str | None = None) -> TrainingPromptTask:
    return TrainingPromptTask(("grounding",), split, "question_id", "bbox", "refcoco", ("iou", "acc_iou50"), fixture)


TRAINING_PROMPT_TASKS = {
    "refcoco_bbox_rec_val": _refcoco("val"),
    "refcoco_bbox_rec_test": _refcoco("test"),
    "refcoco_bbox_rec_testA": _refcoco("testA", "data/harness/refcoco_testA.parquet"),
    "refcoco_bbox_rec_testB": _refcoco("testB"),
    "refcoco+_bbox_rec_val": _refcoco("val"),
    "refcoco+_bbox_rec_testA": _refcoco("testA"),
    "refcoco+_bbox_rec_testB": _refcoco("testB"),
    "refcocog_bbox_rec_val": _refcoco("val"),
    "refcocog_bbox_rec_test": _refcoco("test"),
    # MathVista: the math task reads the free-form rows, the vqa task the multiple-choice ones
    "mathvista_testmini": TrainingPromptTask(("math", "vqa"), "testmini", "pid", "answer", "mathvista", ("accuracy",),
                                             "data/harness/mathvista_testmini.parquet"),  # fmt: skip
}

_TASK_FILE = """task: {name}
dataset_path: parquet
dataset_kwargs:
  data_files:
    {split}: {data}
test_split: {split}
output_type: generate_until
doc_to_visual: !function utils.{functions}_doc_to_visual
doc_to_text: !function utils.project_doc_to_text
doc_to_target: {target}
lmms_eval_specific_kwargs:
  default:
{settings}generation_kwargs:
{settings_generation}process_results: !function utils.{functions}_process_results
metric_list:
{metrics}metadata:
  version: 0.0
"""


def harness_python() -> Path:
    """The harness environment's interpreter (``VLM_GRPO_MA_HARNESS_PYTHON`` overrides it); HarnessError when it
    is missing or has no lmms-eval."""
    python = Path(os.environ.get("VLM_GRPO_MA_HARNESS_PYTHON", HARNESS_PYTHON))
    install = "run scripts/setup.sh --harness (it makes .venv-harness: lmms-eval beside the project's torch pair)"
    if not python.is_file():
        raise HarnessError(f"lmms-eval is not installed ({python} does not exist): {install}")
    found = subprocess.run([str(python), "-c", "import lmms_eval"], capture_output=True, text=True)
    if found.returncode != 0:
        raise HarnessError(f"lmms-eval does not import in {python}: {found.stderr.strip().splitlines()[-1:]}; {install}")
    return python


def task_files(folder: Path, names: Sequence[str], sources: dict[str, str], prompt: str) -> list[str]:
    """The lmms-eval task names to run for ``names`` under ``prompt``; with the training prompt, their task files
    written into ``folder``. HarnessError for a name without a training-prompt file, or without local data."""
    if prompt not in PROMPTS:
        raise HarnessError(f"--prompt {prompt}: valid: {', '.join(PROMPTS)}")
    folder.mkdir(parents=True, exist_ok=True)
    if prompt == "stock":
        return list(names)
    (folder / "utils.py").write_text("from vlm_grpo_ma.tools.harness_worker import *  # noqa: F403 - the task functions\n")
    run = []
    for name in names:
        spec = TRAINING_PROMPT_TASKS.get(name)
        if spec is None:
            raise HarnessError(
                f"no training-prompt task file for {name}; with the training prompt: {', '.join(TRAINING_PROMPT_TASKS)}; "
                "any other lmms-eval task runs with --prompt stock"
            )  # fmt: skip
        data = sources.get(name) or (str(ROOT / spec.fixture) if spec.fixture else None)
        if data is None:
            raise HarnessError(f"{name} needs a local copy of its data offline: --source {name}=FILE (lmms-lab's parquet of the split)")
        if not Path(data).is_file():
            raise HarnessError(f"--source {name}={data}: no such file")
        metrics = "".join(f"  - metric: {metric}\n    aggregation: mean\n    higher_is_better: true\n" for metric in spec.metrics)
        source = json.dumps(str(Path(data).resolve()))
        settings = f"vgm_tasks: {json.dumps(list(spec.tasks))}\nvgm_source: {source}\nvgm_id: {spec.id_column}\n"
        variant = f"vgm_{name}"
        (folder / f"{variant}.yaml").write_text(_TASK_FILE.format(
            name=variant, split=spec.split, data=source, functions=spec.functions, target=spec.target, metrics=metrics,
            settings="".join(f"    {line}\n" for line in settings.splitlines()),
            settings_generation="".join(f"  {line}\n" for line in settings.splitlines()),
        ))  # fmt: skip
        run.append(variant)
    return run


def run_harness(
    models: Sequence, names: Sequence[str], *, sources: dict[str, str], prompt: str, output_dir: Path,
    limit: int | None, batch_size: int, max_thought_tokens: int, max_answer_tokens: int, seed: int,
) -> dict:  # fmt: skip
    """Score every model (``evaluate.ModelSpec``) on every task through lmms-eval; write and return the results."""
    python = harness_python()
    output_dir = output_dir.resolve()  # the worker runs in the checkout, wherever this command was started
    run = task_files(output_dir / "lmms-eval" / "tasks", names, sources, prompt)
    source = f"lmms-eval {HARNESS_VERSION}, {prompt} prompt"
    results: dict[str, dict[str, dict[str, float]]] = {}
    for model in models:
        raw = output_dir / "lmms-eval" / f"{model.label.replace('/', '_')}.json"
        model_path = str(Path(model.path).resolve()) if Path(model.path).exists() else model.path  # a folder, or a hub id
        command = [str(python), "-m", "vlm_grpo_ma.tools.harness_worker", "--model", model_path, "--tasks", *run,
                   "--include-path", str(output_dir / "lmms-eval" / "tasks"), "--output", str(raw), "--batch-size", str(batch_size),
                   "--max-thought-tokens", str(max_thought_tokens), "--max-answer-tokens", str(max_answer_tokens), "--seed", str(seed)]  # fmt: skip
        if limit:
            command += ["--limit", str(limit)]
        if prompt == "stock":  # a stock task's local copy: the worker writes a task file that includes lmms-eval's
            command += [arg for name, data in sources.items() for arg in ("--local", f"{name}={Path(data).resolve()}")]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        # lmms-eval's MathVista module builds an OpenAI client when imported, which refuses to exist without a key;
        # the training prompt's scorer never calls it (a stock task that does fails offline, as it would anyway)
        env.setdefault("OPENAI_API_KEY", "unused-offline")
        finished = subprocess.run(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        if finished.returncode != 0:
            last = ([line for line in finished.stderr.splitlines() if line.strip()][-1:] or ["(no message)"])[0]
            if finished.returncode == 2:  # the worker's own one-line refusal
                raise HarnessError(last)
            sys.stderr.write(finished.stderr)
            raise HarnessError(f"lmms-eval on {model.label} failed: {last}")
        written = json.loads(raw.read_text())
        ran = dict(zip(names, (written["ran"][task] for task in run), strict=True))
        results[model.label] = {
            name: {key.split(",")[0]: value for key, value in written["results"][variant].items()
                   if "," in key and "stderr" not in key and isinstance(value, (int, float))}
            for name, variant in ran.items()
        }  # fmt: skip
    payload = {"source": source, "prompt": prompt, "models": {m.label: m.path for m in models}, "results": results}
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2))
    (output_dir / "results.md").write_text(results_table(results, source))
    return payload


def results_table(results: dict[str, dict[str, dict[str, float]]], source: str) -> str:
    """A markdown table: one row per model, benchmark and metric, with where the number came from."""
    lines = ["| model | benchmark | metric | value | source |", "|---|---|---|---|---|"]
    for model, benches in results.items():
        for bench, metrics in benches.items():
            lines += [f"| {model} | {bench} | {metric} | {value:.3f} | {source} |" for metric, value in metrics.items()]
    return "\n".join(lines) + "\n"
