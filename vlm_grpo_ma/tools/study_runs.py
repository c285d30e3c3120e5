"""The study's grid and its runs: the settings (``T16A1`` ...), running each (setting, seed) as a training
subprocess, and reading a finished run's curves (``RunCurves``, ``SettingSummary``)."""

from __future__ import annotations

import concurrent.futures
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlm_grpo_ma.algorithm.diagnostics import spike_score
from vlm_grpo_ma.run.metrics import read_metrics

SETTING = re.compile(r"^T(\d+)A(\d+)$")
SMOOTHING_STEPS = 10  # moving-average window of the reward curves and of the time-to-reward crossing


@dataclass(frozen=True)
class Setting:
    name: str  # "T4A4"
    num_thoughts: int
    num_answers: int

    @classmethod
    def parse(cls, name: str) -> Setting:
        match = SETTING.match(name)
        if not match or int(match[1]) < 1 or int(match[2]) < 1:
            raise ValueError(f"setting {name!r} is not of the form T<K>A<M> with K, M >= 1 (e.g. T4A4, T16A1)")
        return cls(name, int(match[1]), int(match[2]))

    def overrides(self) -> list[str]:
        # M = 1 rows are plain GRPO (each thought + answer one sequence of the objective); M >= 2 is GRPO-MA
        estimator = ["algorithm.advantage_estimator=grpo", "algorithm.answer_baseline=prompt"] if self.num_answers == 1 else []
        return [f"rollout.num_thoughts={self.num_thoughts}", f"rollout.num_answers={self.num_answers}", *estimator]


@dataclass(frozen=True)
class Grid:
    settings: tuple[Setting, ...]
    seeds: tuple[int, ...]
    steps: int
    prompts_per_step: int
    eval_every: int
    eval_samples: int
    extra: tuple[str, ...] = ()  # further train overrides, the same for every run
    config: str | None = None  # a train config file every run starts from (the grid's overrides apply on top)

    def loss_aggregation(self) -> str:
        """The grid's loss aggregation: GRID_LOSS_AGGREGATION unless an extra override names another."""
        named = [o.split("=", 1)[1] for o in self.extra if o.startswith("algorithm.loss_aggregation=")]
        return named[-1] if named else GRID_LOSS_AGGREGATION

    def run_dir(self, root: Path, setting: Setting, seed: int) -> Path:
        return root / "runs" / f"{setting.name}-seed{seed}"

    def overrides(self, setting: Setting, seed: int) -> list[str]:
        return [
            *setting.overrides(),
            f"train.seed={seed}",
            f"train.steps={self.steps}",
            f"train.prompts_per_step={self.prompts_per_step}",
            f"train.eval_every={self.eval_every}",
            f"train.eval_samples={self.eval_samples}",
            f"train.checkpoint_every={max(1, self.steps // 4)}",
            "train.keep_checkpoints=1",
            "logging.progress_bar=false",
            "logging.report_to=[]",
            "logging.rollout_samples_per_step=0",
            f"algorithm.loss_aggregation={GRID_LOSS_AGGREGATION}",  # the grid's, whatever the default; extra may override
            *self.extra,
        ]


# The default run's regime (its warm start, learning rate and 16 prompts a step), where held-out IoU rises, for
# 300 steps. The grid averages the loss over tokens, as the default did when the committed report was measured
# (the default run now averages over sequences: docs/TUNING.md); `algorithm.loss_aggregation=...` changes it.
# T4A1 is GRPO with GRPO-MA's number of thoughts: the baseline at equal thought count.
GRID_LOSS_AGGREGATION = "token"
DEFAULT_GRID = dict(settings="T16A1 T8A2 T4A4 T2A8 T4A1", seeds=3, steps=300, prompts_per_step=16, eval_every=25, eval_samples=100)
QUICK_GRID = dict(settings="T4A1 T2A2", seeds=2, steps=2, prompts_per_step=2, eval_every=2, eval_samples=2)


# ----------------------------------------------------------------------------------------------------------
# Running the grid


def run_grid(grid: Grid, root: Path, *, task: str, jobs: int = 1, python: str = sys.executable, log=print) -> None:
    """Every (setting, seed) run of the grid, ``jobs`` at a time, skipping finished ones and resuming
    interrupted ones. The first failure stops the grid once the runs under way have ended."""
    # seed by seed, every setting within a seed: a machine that slows down for a while slows every setting
    # alike, so the step-time comparison stays fair
    runs = [(setting, seed) for seed in grid.seeds for setting in grid.settings]
    started = time.perf_counter()
    failures: list[str] = []

    def run_one(index: int, setting: Setting, seed: int) -> None:
        run_dir = grid.run_dir(root, setting, seed)
        label = f"[{index}/{len(runs)}] {setting.name} seed {seed}"
        if (run_dir / "summary.json").is_file():
            log(f"{label}: done earlier, kept")
            return
        if failures:
            return
        resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step-*"))
        command = [python, "-m", "vlm_grpo_ma.train", "--task", task, "--output-dir", str(run_dir),
                   *(["--config", grid.config] if grid.config else []),
                   "--resume" if resume else "--overwrite", *grid.overrides(setting, seed)]  # fmt: skip
        log(f"{label}: {'resuming' if resume else 'running'} ({time.perf_counter() - started:.0f} s into the study)")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            failures.append(
                f"{label} failed (exit {done.returncode}); its run directory is {run_dir}. Last output:\n"
                + (done.stdout[-2000:] + done.stderr[-3000:])
            )

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(run_one, index, setting, seed) for index, (setting, seed) in enumerate(runs, 1)]
        try:
            for future in futures:
                future.result()
        except BaseException:  # Ctrl-C: the runs under way get it too and save; the queued ones must not start
            pool.shutdown(cancel_futures=True)
            raise
    if failures:
        raise RuntimeError(failures[0])


def variance_setting(grid: Grid, name: str | None) -> Setting:
    """The setting whose seed-0 run's final checkpoint the variance is measured from: ``name``, else T4A4 when
    the grid has it (the default run's setting), else the first setting with K >= 2."""
    if name is not None:
        chosen = next((s for s in grid.settings if s.name == name), None)
        if chosen is None or chosen.num_thoughts < 2:
            raise ValueError(f"--variance-from {name}: must be a setting of the grid with K >= 2; the grid has "
                             f"{', '.join(s.name for s in grid.settings)}")  # fmt: skip
        return chosen
    with_thoughts = [s for s in grid.settings if s.num_thoughts >= 2]
    if not with_thoughts:
        raise ValueError("the variance needs a setting with K >= 2 thoughts; the grid has none (or pass --variance-resamples 0)")
    return next((s for s in with_thoughts if s.name == "T4A4"), with_thoughts[0])


def run_variance(grid: Grid, root: Path, setting: Setting, *, resamples: int, answers: tuple[int, ...], prompts: int,
                 python: str = sys.executable, log=print) -> None:  # fmt: skip
    """``python -m vlm_grpo_ma.variance`` on the final checkpoint of ``setting``'s seed-0 run, into root/variance
    (kept when already there)."""
    out = root / "variance"
    if (out / "variance.json").is_file():
        log("variance: done earlier, kept")
        return
    run_dir = grid.run_dir(root, setting, grid.seeds[0])
    command = [python, "-m", "vlm_grpo_ma.variance", str(run_dir), "--out", str(out), "--resamples", str(resamples),
               "--prompts", str(prompts), "--thoughts", str(setting.num_thoughts), "--answers", *map(str, answers)]  # fmt: skip
    log(f"variance: redrawing answers of {run_dir.name}'s final checkpoint")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the variance measurement failed (exit {done.returncode}). Last output:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


# ----------------------------------------------------------------------------------------------------------
# Reading the runs


def _value(record: dict, key: str) -> float:
    value = record.get(key)
    return math.nan if value is None else float(value)


@dataclass(frozen=True)
class HeldOut:
    """The held-out figures the study reports, as ``eval/<task>/<name>`` keys of metrics.jsonl."""

    main: str  # the task's main metric (grounding: iou)
    accuracy: str = "accuracy"  # the mean of the task's success part (grounding: Acc@0.5)
    right_thought: str = "right_thought"  # the share of right thoughts (tasks with reference thoughts)


@dataclass
class RunCurves:
    """One run's per-step series (training steps only) and its held-out evaluations."""

    steps: list[int]
    reward: list[float]
    seconds: list[float]  # cumulative wall time of the training steps
    tokens: list[float]  # cumulative generated tokens
    rollout_seconds: list[float]
    step_seconds: list[float]
    noise_var: list[float]
    answer_var: list[float]
    spike_ratios: list[float]
    thought_tokens: list[float]  # mean per thought, per step
    answer_tokens: list[float]
    sampled_right_thought: list[float]  # per step, the share of sampled thoughts naming the target (nan: unknown)
    eval_steps: list[int]
    eval_values: dict[str, list[float]]  # HeldOut name -> one value per evaluation (nan where not logged)

    def position(self, step: float) -> tuple[float, float]:
        """(cumulative wall seconds, cumulative generated tokens) at a step, fractional steps interpolated (0: 0)."""
        steps, seconds, tokens = [0, *self.steps], [0.0, *self.seconds], [0.0, *self.tokens]
        index = next((i for i, s in enumerate(steps) if s >= step), len(steps) - 1)
        if index == 0 or steps[index] == step:
            return seconds[index], tokens[index]
        low = index - 1
        part = (step - steps[low]) / (steps[index] - steps[low])
        return seconds[low] + part * (seconds[index] - seconds[low]), tokens[low] + part * (tokens[index] - tokens[low])


    def held_out_at_seconds(self, name: str, seconds: float) -> float:
        """The held-out figure ``name`` after ``seconds`` of training wall time, interpolated between the
        evaluations around it; nan past the last evaluation."""
        times = [self.position(step)[0] for step in self.eval_steps]
        values = self.eval_values[name]
        for i in range(1, len(times)):
            if times[i] >= seconds:
                part = (seconds - times[i - 1]) / (times[i] - times[i - 1]) if times[i] > times[i - 1] else 1.0
                return values[i - 1] + part * (values[i] - values[i - 1])
        return values[0] if times and seconds <= times[0] else math.nan


def held_out_metrics(task: str) -> HeldOut:
    """The held-out figures of ``task``: its main metric (grounding: iou; math: accuracy) and the others."""
    from vlm_grpo_ma.task_api.registry import get_task

    return HeldOut(main=get_task(task).metrics[0])


def read_run(run_dir: Path, task: str, held_out: HeldOut) -> RunCurves:
    records = read_metrics(run_dir)
    training = [r for r in records if r["step"] > 0 and "reward/mean" in r]
    evaluations = [r for r in records if f"eval/{task}/{held_out.main}" in r]
    step_seconds = [_value(r, "time/step_seconds") for r in training]
    return RunCurves(
        steps=[r["step"] for r in training],
        reward=[_value(r, "reward/mean") for r in training],
        seconds=_cumulative(step_seconds),
        tokens=_cumulative([_value(r, "rollout/generated_tokens") for r in training]),
        rollout_seconds=[_value(r, "time/rollout_seconds") for r in training],
        step_seconds=step_seconds,
        noise_var=[_value(r, "grpo_ma/thought_value_noise_var") for r in training],
        answer_var=[_value(r, "grpo_ma/answer_reward_var") for r in training],
        spike_ratios=[_value(r, "train/grad_norm_spike_ratio") for r in training],
        thought_tokens=[_value(r, "rollout/thought_tokens") for r in training],
        answer_tokens=[_value(r, "rollout/answer_tokens") for r in training],
        sampled_right_thought=[_value(r, f"reward/{held_out.right_thought}") for r in training],
        eval_steps=[r["step"] for r in evaluations],
        eval_values={name: [_value(r, f"eval/{task}/{name}") for r in evaluations] for name in vars(held_out).values()},
    )


def _cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def smooth(values: list[float], window: int = SMOOTHING_STEPS) -> list[float]:
    """Trailing moving average (the first points average what is there so far)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def _mean(values) -> float:
    known = [v for v in values if not math.isnan(v)]
    return sum(known) / len(known) if known else math.nan


def seed_mean(series: list[list[float]]) -> list[float]:
    """Pointwise mean over seeds, over the steps every seed has."""
    length = min(len(s) for s in series)
    return [_mean(s[i] for s in series) for i in range(length)]


def crossing_step(steps: list[int], values: list[float], target: float) -> float | None:
    """The step at which the curve (``values`` at ``steps``) first reaches ``target``, linearly interpolated
    between the evaluation before and the first one at or above it; None when it never does."""
    index = next((i for i, v in enumerate(values) if v >= target), None)
    if index is None or index == 0:
        return None if index is None else float(steps[0])
    low, high = values[index - 1], values[index]
    return steps[index - 1] + (target - low) / (high - low) * (steps[index] - steps[index - 1])


@dataclass
class SettingSummary:
    setting: Setting
    runs: list[RunCurves]

    def eval_curve(self, name: str) -> list[float]:
        return seed_mean([r.eval_values[name] for r in self.runs])

    def eval_steps(self) -> list[int]:
        """The evaluation steps every seed has (``eval_curve``'s points)."""
        return self.runs[0].eval_steps[: min(len(r.eval_steps) for r in self.runs)]

    def eval_change(self, name: str, spec: str = ".3f") -> str:
        """'start -> end (lowest-highest seed at the end)' of the seed-mean held-out figure ``name``."""
        curve = self.eval_curve(name)
        if not curve or all(math.isnan(v) for v in curve):
            return "n/a"
        ends = [r.eval_values[name][len(curve) - 1] for r in self.runs]
        spread = f" ({format(min(ends), spec)}-{format(max(ends), spec)})" if len(ends) > 1 else ""
        return f"{format(curve[0], spec)} -> {format(curve[-1], spec)}{spread}"

    def final_reward(self) -> float:
        """The seed-mean reward over the last fifth of the steps."""
        reward = seed_mean([r.reward for r in self.runs])
        return _mean(reward[-max(1, len(reward) // 5) :])

    def reach(self, name: str, target: float) -> tuple[float | None, float, float]:
        """(step, seed-mean wall seconds, seed-mean generated tokens) where the seed-mean held-out curve of ``name``
        first reaches ``target``; (None, nan, nan) when it never does."""
        step = crossing_step(self.eval_steps(), self.eval_curve(name), target)
        if step is None:
            return None, math.nan, math.nan
        at = [r.position(step) for r in self.runs]
        return step, _mean(a[0] for a in at), _mean(a[1] for a in at)

    def reach_per_seed(self, name: str, target: float) -> list[float]:
        """Each seed's own wall seconds to reach ``target`` on its own held-out curve (nan: not reached)."""
        out = []
        for run in self.runs:
            step = crossing_step(run.eval_steps, run.eval_values[name], target)
            out.append(math.nan if step is None else run.position(step)[0])
        return out

    def end_seconds_per_seed(self) -> list[float]:
        """Each seed's training wall time at its last evaluation."""
        return [r.position(r.eval_steps[-1])[0] if r.eval_steps else math.nan for r in self.runs]

    def noise_var(self) -> float:
        return _mean(v for r in self.runs for v in r.noise_var)

    def noise_var_per_seed(self) -> list[float]:
        return [_mean(r.noise_var) for r in self.runs]

    def answer_var(self) -> float:
        return _mean(v for r in self.runs for v in r.answer_var)

    def rollout_seconds(self) -> float:
        return _mean(v for r in self.runs for v in r.rollout_seconds)

    def update_seconds(self) -> float:
        return _mean(s - g for r in self.runs for s, g in zip(r.step_seconds, r.rollout_seconds, strict=True))

    def step_seconds_per_seed(self) -> list[float]:
        return [_mean(r.step_seconds) for r in self.runs]

    def tokens_per_step(self) -> float:
        return _mean(r.tokens[-1] / len(r.tokens) for r in self.runs if r.tokens)

    def thought_tokens(self) -> float:
        return _mean(v for r in self.runs for v in r.thought_tokens)

    def answer_tokens(self) -> float:
        return _mean(v for r in self.runs for v in r.answer_tokens)

    def sampled_right_thought(self) -> tuple[float, float]:
        """The seed-mean share of sampled thoughts naming the target, first fifth and last fifth of the steps."""
        curve = seed_mean([r.sampled_right_thought for r in self.runs])
        fifth = max(1, len(curve) // 5)
        return _mean(curve[:fifth]), _mean(curve[-fifth:])

    def spike_scores(self) -> list[float]:
        return [spike_score(r.spike_ratios) for r in self.runs]

    def spike_score(self) -> float:
        return _mean(self.spike_scores())


def objective(setting: Setting) -> str:
    """What the setting trains (``Setting.overrides``): M = 1 is GRPO; M >= 2 GRPO-MA."""
    return "GRPO (flat, prompt baseline)" if setting.num_answers == 1 else "GRPO-MA (thought baseline)"
