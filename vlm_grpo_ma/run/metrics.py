"""Run outputs: metrics.jsonl + TensorBoard, rollouts.jsonl, the progress bar, and the final summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm

from vlm_grpo_ma.run.trackers import RunTrackers, completion_rows, drawings_in


class RunLogger:
    """Writes one JSON line per logged step and sends it to the run's trackers (``trackers.RunTrackers``:
    TensorBoard, W&B, MLflow, SwanLab, trackio as configured); only the main process makes one with trackers.
    The completions table goes to the trackers every ``rollout_every`` steps (0: never)."""

    def __init__(self, run_dir: Path, *, trackers: RunTrackers, progress_bar: bool, total_steps: int, start_step: int,
                 rollout_every: int = 0):  # fmt: skip
        self.run_dir = Path(run_dir)
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        self.rollouts_file = open(self.run_dir / "rollouts.jsonl", "a")
        self.trackers = trackers
        self.rollout_every = rollout_every
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not progress_bar, unit="step", dynamic_ncols=True)

    def log_step(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        """One metrics record (and the trackers' scalars); ``advance=False`` for a record that is not a
        training step (the held-out evaluation before the first step) leaves the progress bar alone."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self.metrics_file.write(json.dumps({"step": step, **clean}) + "\n")
        self.metrics_file.flush()
        self.trackers.log_metrics(step, metrics)
        if not advance:
            return
        postfix = {"reward": f"{metrics.get('reward/mean', float('nan')):.3f}"}
        if "reward/iou" in metrics:
            postfix["iou"] = f"{metrics['reward/iou']:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def log_rollouts(self, step: int, records: list[dict], images: list | None = None) -> None:
        """The step's readable trees to rollouts.jsonl, and every ``rollout_every`` steps to the trackers as the
        completions table (``images``: each record's prompt image, a path or PIL image, or None)."""
        for record in records:
            self.rollouts_file.write(json.dumps(record) + "\n")
        self.rollouts_file.flush()
        if records and self.rollout_every and step % self.rollout_every == 0 and self.trackers.trackers:
            self.trackers.log_completions(step, completion_rows(records, images or [None] * len(records)))

    def log_drawings(self, step: int, folder: Path) -> None:
        """The held-out drawings of the evaluation after ``step`` (``folder``: its draw/ folder) to the trackers."""
        if self.trackers.trackers and Path(folder).is_dir():
            self.trackers.log_images(step, drawings_in(folder))

    def close(self) -> None:
        self.bar.close()
        self.metrics_file.close()
        self.rollouts_file.close()
        self.trackers.close()


def drop_records_after(run_dir: Path, step: int) -> None:
    """Before a run resumes from its checkpoint of ``step``: delete the metrics.jsonl and rollouts.jsonl
    records of later steps (logged before a crash, and logged again now). From step 0 (no checkpoint) every
    record goes, the held-out evaluation of step 0 included. Each file is rewritten atomically."""
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        path = Path(run_dir) / name
        if not path.exists():
            continue
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if step > 0 and line.strip() and _step_of(line) <= step]
        if len(kept) != len(lines):
            tmp = path.with_name(name + ".tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)


def _step_of(line: str) -> float:
    """The record's step; a line cut short by a crash has none and is dropped (as infinitely late)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl, keeping the last record of each step (a resumed run may have re-logged some)."""
    by_step: dict[int, dict] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _std(values: list[float]) -> float:
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return float("nan")
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarize(records: list[dict], keys: tuple[str, ...] = ("reward/mean", "reward/iou")) -> dict:
    """Mean of each key over the first and the last fifth of the steps, their difference, the step-to-step
    noise (standard deviation of the per-step values within the last fifth) and the standard error of the
    difference of the two means (per-step values taken as independent)."""
    evaluated = [r for r in records if any(k.startswith("eval/") for k in r)]
    records = [r for r in records if r.get("step", 0) >= 1]  # step 0: the evaluation before training
    fifth = max(1, len(records) // 5)
    first, last = records[:fifth], records[-fifth:]
    summary: dict = {"steps": len(records), "steps_per_fifth": fifth}
    for key in keys:
        if not any(key in r for r in records):
            continue
        first_values = [r[key] for r in first if r.get(key) is not None]
        last_values = [r[key] for r in last if r.get(key) is not None]
        a, b = _mean(first_values), _mean(last_values)
        summary[key] = {
            "first_fifth": a,
            "last_fifth": b,
            "gain": b - a,
            "step_noise_std": _std(last_values),
            "gain_standard_error": math.sqrt(
                _std(first_values) ** 2 / max(len(first_values), 1) + _std(last_values) ** 2 / max(len(last_values), 1)
            ),
        }
    if evaluated:
        first_eval, last_eval = evaluated[0], evaluated[-1]
        summary["eval"] = {
            key: {"step": last_eval["step"], "value": value, "first_step": first_eval["step"], "first_value": first_eval.get(key)}
            for key, value in last_eval.items()
            if key.startswith("eval/")
        }
    return summary


def _shown(value, spec: str = ".4f") -> str:
    """A summary figure, or "n/a" where there is none: a spread of a fifth of one step, an evaluation figure that
    no sample had (None in metrics.jsonl)."""
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def format_summary(summary: dict) -> str:
    lines = [f"summary over {summary['steps']} steps (fifths of {summary['steps_per_fifth']} steps):"]
    for key, value in summary.items():
        if isinstance(value, dict) and "first_fifth" in value:
            lines.append(
                f"  {key:<14} first fifth {_shown(value['first_fifth'])}   last fifth {_shown(value['last_fifth'])}"
                f"   gain {_shown(value['gain'], '+.4f')} (standard error {_shown(value['gain_standard_error'])})"
                f"   step-to-step std {_shown(value['step_noise_std'])}"
            )
    for key, value in summary.get("eval", {}).items():
        if key.split("/")[-1] in ("prompts", "answers", "errors"):
            continue
        lines.append(
            f"  {key:<30} step {value['first_step']}: {_shown(value['first_value'])}"
            f"   step {value['step']}: {_shown(value['value'])}"
        )
    return "\n".join(lines)
