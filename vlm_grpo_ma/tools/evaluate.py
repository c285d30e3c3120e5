"""Score models on benchmarks side by side: ``python -m vlm_grpo_ma.evaluate --models tiny runs/NAME``.

A model is ``tiny`` (the embedded default), a run directory (its latest checkpoint, or ``--step N``), a
checkpoint folder (``.../checkpoints/step-NNNNNN``), or a Hugging Face id / local model folder. Each task is
scored on its embedded held-out split or on a benchmark file (``--source TASK=FILE``, any format the task
loads: RefCOCO parquet, ScienceQA, HumanEval ...), with the same parsers and rewards as training. A task out of
the tree is named as ``data.task_modules`` names it: ``--task-module path/to/task.py`` (or a dotted module).

Decoding is greedy by default; ``--samples N`` samples N answers per prompt (each from its own thought) at
``--temperature`` and reports pass@k with the unbiased estimator. Per sample, the records go to a JSONL as
they are made, so an interrupted evaluation resumes where it stopped when the same command is run again.

Outputs under ``--output-dir`` (default ``evals/<models>--<tasks>``): ``<model>/<task>-<split>/samples.jsonl`` (id, thought, answer, parsed
prediction, reward parts), ``.../draw/*.png`` (prediction in red, truth in green, for tasks that draw; a video
sample on a strip of its first video's frames, decoded under the run's own ``model.video_*``, each key
replaced by ``--video-fps`` / ``--video-max-frames`` / ``--video-max-pixels`` where given; a resumed video
benchmark keeps the budget it started with),
``results.json`` and ``results.md`` (one column per model). Training scores its held-out samples with the same
code (``run/evaluation.py``) every ``train.eval_every`` steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from vlm_grpo_ma.model.loading import Policy, checked_model_path, load_policy
from vlm_grpo_ma.model.tiny import TINY_MODEL_NAME
from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run.config import ConfigError, JudgeConfig, ModelConfig, check_video_max_pixels
from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.run.evaluation import EvalSettings, draw_predictions, evaluate_task
from vlm_grpo_ma.run.judge_setup import judge_for
from vlm_grpo_ma.run.run_dir import CONFIG_FILE, read_saved_config
from vlm_grpo_ma.task_api.registry import get_task, import_task_modules, load_samples
from vlm_grpo_ma.task_api.videos import VideoBudget
from vlm_grpo_ma.tools.harness import PROMPTS, run_harness
from vlm_grpo_ma.tools.harness import results_table as results_table_with_source

log = logging.getLogger("vlm_grpo_ma.evaluate")


# ----------------------------------------------------------------------------------------------------------
# Models and the command line


@dataclass(frozen=True)
class ModelSpec:
    label: str  # column name in the results
    path: str  # what load_policy gets
    video_budget: VideoBudget | None = None  # a run's model.video_* (its config.yaml); None: not a run's model


def run_video_budget(run_dir: Path) -> VideoBudget | None:
    """The video budget a run trained with (``model.video_*`` of its saved config.yaml), or None without one.
    The file is read as ``--resume`` reads it (``run_dir.read_saved_config``): a damaged one is a ConfigError."""
    config = run_dir / CONFIG_FILE
    if not config.is_file():
        return None
    try:
        model = read_saved_config(config).model
    except ConfigError as error:
        raise ConfigError(f"run {run_dir}: its {config}: {error}") from None
    return VideoBudget(model.video_fps, model.video_max_frames, model.video_max_pixels)


def resolve_model(spec: str, step: int | None = None) -> ModelSpec:
    """``tiny``, a run directory (latest checkpoint or ``step``), a checkpoint folder, or a model id/folder."""
    if spec == TINY_MODEL_NAME:
        return ModelSpec("tiny", spec)
    path = Path(spec)
    if (path / "checkpoints").is_dir() or (path / CONFIG_FILE).is_file():  # a run directory
        found = ckpt.list_checkpoints(path)
        if step is not None:
            found = [c for c in found if c.name == ckpt.checkpoint_dir(path, step).name]
            if not found:
                steps = ", ".join(c.name for c in ckpt.list_checkpoints(path)) or "none"
                raise FileNotFoundError(f"run {path} has no checkpoint for --step {step}; it has: {steps}")
        if not found:
            raise FileNotFoundError(
                f"run {path} has no checkpoint yet (a run writes one every train.checkpoint_every steps and at its"
                " end); evaluate it once one is written"
            )
        def passed_over(error):
            if step is None:  # an explicit --step is refused, not replaced
                log.warning("%s; evaluating the checkpoint before it", error)

        # the newest whose weights load, as a resume picks it
        checkpoint, _, failures = ckpt.newest_that_loads(found, lambda c: ckpt.check_weight_files(c / "model"), passed_over)
        if checkpoint is None:
            raise ValueError(f"no checkpoint of run {path} loads: " + "; ".join(failures))
        return ModelSpec(f"{path.resolve().name}@{checkpoint.name}", str(checkpoint / "model"), run_video_budget(path))
    if path.exists():
        checkpoint = path if (path / "model").is_dir() and (path / "state.pt").is_file() else None
        if checkpoint is None and path.name == "model" and (path.parent / "state.pt").is_file():
            checkpoint = path.parent  # a checkpoint's model/ folder: its run's model all the same
        if checkpoint is None:  # no config.json, no weights, weights cut short ...: one line, before any model loads
            checked_model_path(spec, "--models")
            return ModelSpec(path.resolve().name, str(path))
        model = checkpoint / "model"
        try:
            ckpt.check_weight_files(model)
        except ckpt.CheckpointLoadError as error:
            raise ValueError(str(error)) from None
        run_dir = checkpoint.resolve().parent.parent
        return ModelSpec(f"{run_dir.name}@{checkpoint.name}", str(model), run_video_budget(run_dir))
    checked_model_path(spec, "--models")  # a mistyped folder or an unknown hub id: one line, at once
    return ModelSpec(spec.replace("/", "__"), spec)


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
    video_overrides: dict[str, float | int] | None = None,
    judge_settings: JudgeConfig | None = None,
) -> dict:
    """Score every model on every task; write the outputs described in the module docstring. Videos are
    seen, scored and drawn under each model's budget: its run's (``ModelSpec.video_budget``), else training's
    default ``model.video_*``, with each key of ``video_overrides`` (a ``VideoBudget`` field -> its value: the
    ``--video-*`` flags given) over it. Tasks scored by a served judge get ``judge_settings``'s (the
    ``--judge-*`` flags; its verdict cache in ``output_dir``)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    data = {}
    for name in task_names:
        task = get_task(name)
        samples = load_samples(task, split, sources.get(name))
        data[name] = (task, samples[:limit] if limit else samples)
    judge = judge_for(judge_settings or JudgeConfig(), [task for task, _ in data.values()], output_dir)
    # the judge is part of what the numbers mean: a resume under another judge is refused
    judged_by = {"model": judge.model, "verdict": judge.verdict_format} if judge is not None else None
    budgets = {model.label: replace(model.video_budget or VideoBudget(), **(video_overrides or {})) for model in models}
    benches = {name: f"{name}-{_benchmark_name(split, sources.get(name))}" for name in data}
    for model in models:  # every resume is checked before any model loads: a refusal costs no evaluation
        for name, (_, samples) in data.items():
            folder = output_dir / model.label / benches[name]
            folder.mkdir(parents=True, exist_ok=True)
            # a video benchmark's budget is part of what it is: a resume continues under the same one
            video_budget = budgets[model.label] if any(s.videos for s in samples) else None
            _check_settings(folder / "settings.json", settings, model, video_budget, judged_by if data[name][0].judge_query is not None else None)
    results: dict[str, dict[str, dict[str, float]]] = {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for model in models:
        policy = load(model.path, dtype=dtype, device=device, video_budget=budgets[model.label])
        # a budget under one of this model's vision tokens holds no frame: refused before its first clip
        key = "--video-max-pixels" if "max_pixels" in (video_overrides or {}) else f"{model.label}'s model.video_max_pixels"
        check_video_max_pixels(budgets[model.label].max_pixels, policy.patch_factor, model.path, key)
        results[model.label] = {}
        for name, (task, samples) in data.items():
            bench = benches[name]
            folder = output_dir / model.label / bench
            metrics, records = evaluate_task(
                policy, task, samples, settings, batch_size=batch_size, records_path=folder / "samples.jsonl",
                progress=progress, description=f"{model.label} {bench}", judge=judge,
            )
            draw_predictions(
                task, samples, records, folder / "draw", draw, video_budget=policy.video_budget, patch_factor=policy.patch_factor
            )
            results[model.label][bench] = metrics
            log.info("%s %s: %s", model.label, bench, json.dumps(metrics))
        del policy
    if judge is not None:
        judge.close()
    payload = {"settings": asdict(settings), "models": {m.label: m.path for m in models}, "results": results}
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2))
    table = results_table(results)
    (output_dir / "results.md").write_text(table)
    return payload


def _check_settings(
    path: Path, settings: EvalSettings, model: ModelSpec, video_budget: VideoBudget | None, judged_by: dict | None = None
) -> None:
    """Resuming is only sound with the same model, settings, (for a benchmark with videos) video budget and (for
    a task a served judge scores) judge: refuse otherwise, naming what differs. A benchmark without videos
    records no budget (it changes nothing), one without a judge no judge."""
    identity = {"model": model.path, "settings": asdict(settings)}
    if video_budget is not None:
        identity["video_budget"] = asdict(video_budget)
    if judged_by is not None:
        identity["judge"] = judged_by
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != identity:
            changed = "; ".join(
                f"{key}: {saved.get(key)} there, {identity.get(key)} now"
                for key in dict.fromkeys([*saved, *identity]) if saved.get(key) != identity.get(key)
            )  # fmt: skip
            raise ValueError(
                f"{path.parent} holds an evaluation with other settings ({changed}). "
                "Use another --output-dir, or delete that folder to start it again"
            )
    else:
        path.write_text(json.dumps(identity, indent=2))


def default_output_dir(models: Sequence[ModelSpec], tasks: Sequence[str]) -> Path:
    """``evals/<model labels>--<tasks>``, each list joined by ``+``."""
    return Path("evals") / f"{'+'.join(m.label for m in models)}--{'+'.join(tasks)}"


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
    parser.add_argument("--max-turns", type=int, default=3, help="tool calls a thought may make (tasks with tools, e.g. zoom)")
    parser.add_argument("--max-answer-tokens", type=int, default=24)
    parser.add_argument("--limit", type=int, help="score only the first N samples of each benchmark")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draw", type=int, default=8, help="images to draw per model and task (default 8)")
    # The video budget (training's model.video_* keys, task_api/videos.py): a run's own (its config.yaml), else
    # training's defaults; each flag given replaces that one key.
    model_defaults = ModelConfig()
    parser.add_argument("--video-fps", type=float,
                        help=f"video frames sampled per second (model.video_fps; default: the run's, else {model_defaults.video_fps:g})")
    parser.add_argument("--video-max-frames", type=int,
                        help=f"most frames per video (model.video_max_frames; default: the run's, else {model_defaults.video_max_frames})")
    parser.add_argument("--video-max-pixels", type=int,
                        help=f"most pixels per video frame (model.video_max_pixels; default: the run's, else {model_defaults.video_max_pixels})")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--output-dir", help="where results go (default: evals/<models>--<tasks>, so an evaluation of"
                        " other models or tasks keeps the earlier results, and the same command resumes)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--harness", choices=("lmms-eval",), help="score through lmms-eval instead (--tasks are its task"
                        " names; scripts/setup.sh --harness installs it; docs/EVALUATION.md)")
    parser.add_argument("--prompt", choices=PROMPTS, default="training", help="with --harness: ask the way the model was"
                        " trained (default; the answer taken from <answer>), or lmms-eval's stock prompt")
    parser.add_argument("--judge", action="append", default=[], metavar="KEY=VALUE",
                        help="a judge.* setting, as train takes it, for tasks scored by a served judge (vqa_open):"
                        " --judge base_url=http://127.0.0.1:8000/v1 --judge model=NAME (docs/JUDGE.md)")
    return parser


def _run_harness(args) -> int:
    """``--harness lmms-eval``: every model on every lmms-eval task (tools/harness.py); the table printed."""
    if args.samples != 1:
        raise ValueError(f"--samples {args.samples} with --harness: the bridge scores greedy answers only")
    sources = _task_sources(args.source, args.tasks)
    models = [resolve_model(spec, args.step) for spec in args.models]
    output_dir = Path(args.output_dir) if args.output_dir else Path(f"{default_output_dir(models, args.tasks)}--lmms-eval")
    payload = run_harness(
        models, args.tasks, sources=sources, prompt=args.prompt, output_dir=output_dir, limit=args.limit,
        batch_size=args.batch_size, max_thought_tokens=args.max_thought_tokens, max_answer_tokens=args.max_answer_tokens,
        seed=args.seed,
    )  # fmt: skip
    print(results_table_with_source(payload["results"], payload["source"]), end="")
    print(f"results: {output_dir / 'results.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        for value, name in ((args.limit, "--limit"), (args.batch_size, "--batch-size")):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if args.max_turns < 0:
            raise ValueError(f"--max-turns={args.max_turns} must be >= 0 (0: thoughts call no tool)")
        # each flag given replaces that one key of a model's budget (its run's, else training's defaults)
        chosen = {"fps": args.video_fps, "max_frames": args.video_max_frames, "max_pixels": args.video_max_pixels}
        video_overrides = {key: value for key, value in chosen.items() if value is not None}
        if args.video_fps is not None and not args.video_fps > 0:
            raise ValueError(f"--video-fps={args.video_fps:g} must be positive")
        if args.video_max_pixels is not None:  # at least one vision token of the smallest family's
            check_video_max_pixels(args.video_max_pixels, key="--video-max-pixels")
        if args.video_max_frames is not None and args.video_max_frames < 2:  # the vision tower takes frames in pairs
            raise ValueError(f"--video-max-frames={args.video_max_frames} must be >= 2")
        settings = EvalSettings(
            samples=args.samples, temperature=args.temperature, max_thought_tokens=args.max_thought_tokens,
            max_answer_tokens=args.max_answer_tokens, seed=args.seed, max_turns=args.max_turns,
        )
        if args.harness:
            return _run_harness(args)
        import_task_modules(args.task_module)
        for name in args.tasks:
            get_task(name)
        sources = _task_sources(args.source, args.tasks)
        models = [resolve_model(spec, args.step) for spec in args.models]
        output_dir = Path(args.output_dir) if args.output_dir else default_output_dir(models, args.tasks)
        payload = evaluate_models(
            models, args.tasks, split=args.split, sources=sources, settings=settings,
            output_dir=output_dir, limit=args.limit, batch_size=args.batch_size, draw=args.draw,
            dtype=args.dtype, progress=not args.no_progress, video_overrides=video_overrides,
            judge_settings=load_config(None, [f"judge.{setting}" for setting in args.judge]).judge,
        )  # fmt: skip
    except (ValueError, KeyError, OSError) as error:  # bad arguments, unknown task, missing file or model
        if isinstance(error, OSError) and error.strerror:  # the OS's own (args[0] is its errno): the path and why
            print(f"error: {error.filename}: {error.strerror}", file=sys.stderr)
            return 2
        print(f"error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    except ImportError as error:  # a --task-module named as a dotted module that is not on the path
        print(f"error: --task-module: {error}", file=sys.stderr)
        return 2
    print(results_table(payload["results"]), end="")
    print(f"results: {output_dir / 'results.json'}")
    return 0
