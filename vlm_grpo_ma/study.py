"""GRPO-MA's claims, measured: ``python -m vlm_grpo_ma.study`` (see ``--help``).

Runs a grid of K x M settings over several seeds (default: T16A1, T8A2, T4A4, T2A8 at 16 answers per prompt,
and T4A1, GRPO with GRPO-MA's number of thoughts; 3 seeds; 300 steps of the default run's regime), every run on
the same prompts in the same order (the prompt stream and the sampling randomness are functions of the seed),
measures the thought advantage's variance against M on the final checkpoint of T4A4's seed 0
(``vlm_grpo_ma.variance``), then writes ``report.md`` and PNG plots:

- the held-out greedy figures (the task's main metric, its accuracy, the share of right thoughts) and the
  training reward against steps, wall time and generated tokens, with a band over seeds;
- a table: where each setting's seed-mean held-out curve reaches T16A1's final held-out figure, in wall time and
  generated tokens (ratios to T16A1), each seed's own time, the stage times and the spike score, and a verdict
  from those numbers;
- the measured variance of thought values and thought advantages against M, with the 1/M line and predictions;
- the per-step diagnostic s2 / M against M, the step time per setting (sampling and update), the spike score.

Each run is ``python -m vlm_grpo_ma.train`` in a subprocess with its own run directory under
``--output-dir``; a finished run (its ``summary.json`` exists) is not redone, and an interrupted one continues
from its last checkpoint, so the study is resumable by running the same command again.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlm_grpo_ma.diagnostics import spike_score
from vlm_grpo_ma.metrics import read_metrics

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
    from vlm_grpo_ma.registry import get_task

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


# ----------------------------------------------------------------------------------------------------------
# The report


def _spread(values: list[float], spec: str) -> str:
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return "not reached"
    text = "-".join(format(v, spec) for v in (min(known), max(known))) if len(known) > 1 else format(known[0], spec)
    return text + ("" if len(known) == len(values) else f"; {len(values) - len(known)} of {len(values)} seeds not reached")


def verdict(summaries: list[SettingSummary], reference: SettingSummary, name: str, target: float) -> list[str]:
    """One line per setting against the reference: how much of its wall time and tokens the setting needed to
    reach the target, and whether the seeds' own times separate (every seed of one faster than every seed of
    the other) or overlap."""
    _, ref_seconds, ref_tokens = reference.reach(name, target)
    ref_seeds = [v for v in reference.reach_per_seed(name, target) if not math.isnan(v)]
    lines = []
    for s in summaries:
        if s is reference:
            continue
        step, seconds, tokens = s.reach(name, target)
        if step is None:
            lines.append(f"- **{s.setting.name}** ({objective(s.setting)}) did not reach it on its seed mean within "
                         f"{s.runs[0].steps[-1]} steps. {equal_time(s, reference, name)}")  # fmt: skip
            continue
        seeds = [v for v in s.reach_per_seed(name, target) if not math.isnan(v)]
        if seeds and ref_seeds and len(seeds) == len(s.runs) and max(seeds) < min(ref_seeds):
            separation = "every seed of it reached the target before every seed of " + reference.setting.name
        elif seeds and ref_seeds and min(seeds) > max(ref_seeds) and len(ref_seeds) == len(reference.runs):
            separation = "every seed of " + reference.setting.name + " reached the target before every seed of it"
        else:
            separation = "the seeds' own times overlap, so the difference is within seed noise"
        lines.append(
            f"- **{s.setting.name}** ({objective(s.setting)}) reached it at step {step:.0f}, in {_ratio(seconds, ref_seconds)}x "
            f"{reference.setting.name}'s wall time and {_ratio(tokens, ref_tokens)}x its generated tokens; {separation}. "
            + equal_time(s, reference, name)
        )
    return lines


def _seed_order(pairs: list[tuple[float, float]], other: str) -> str:
    if all(a > b for a, b in pairs):
        return f"ahead of {other} on every seed"
    if all(a < b for a, b in pairs):
        return f"behind {other} on every seed"
    return "ahead on some seeds and behind on others: within seed noise"


def equal_thoughts(summaries: list[SettingSummary], reference: SettingSummary, name: str) -> list[str]:
    """GRPO at GRPO-MA's thought count (an M = 1 setting other than the reference) against the GRPO-MA settings
    with the same K: at equal steps (their ends), and at the M = 1 setting's end in wall time."""
    lines = []
    for grpo in (s for s in summaries if s.setting.num_answers == 1 and s is not reference):
        for ma in (s for s in summaries if s.setting.num_thoughts == grpo.setting.num_thoughts and s.setting.num_answers > 1):
            ma_end = [r.eval_values[name][-1] for r in ma.runs]
            grpo_end = [r.eval_values[name][-1] for r in grpo.runs]
            lines.append(
                f"- **{ma.setting.name} against {grpo.setting.name}** (the same {ma.setting.num_thoughts} thoughts, {ma.setting.num_answers} "
                f"answers each instead of 1): after the same {ma.runs[0].steps[-1]} steps {_fmt(_mean(ma_end), '.3f')} against "
                f"{_fmt(_mean(grpo_end), '.3f')}, {_seed_order(list(zip(ma_end, grpo_end, strict=True)), grpo.setting.name)}. "
                + equal_time(grpo, ma, name)
            )
    return lines


def claims(summaries: list[SettingSummary], reference: SettingSummary, measured, name: str) -> list[str]:
    """The paper's claims, each next to what this grid (and the variance measurement, when there) shows."""
    lines = ["## The paper's claims next to these numbers", ""]
    if measured is not None:
        results = {r.num_answers: r for r in measured[0]}
        low, high = min(results), max(results)
        if low != high:
            a, b = results[low], results[high]
            lines.append(
                f"- *The thought advantage's variance falls like 1/M.* From M = {low} to {high} (1/M: {high / low:.0f}x less) the "
                f"thought value's variance fell {a.value_var / b.value_var:.1f}x and the thought advantage's "
                f"{a.advantage_var / b.advantage_var:.1f}x (the variance section)."
            )
    ma = [s for s in summaries if s.setting.num_answers > 1]
    if ma:
        lines.append(
            f"- *GRPO-MA trains more steadily (fewer gradient spikes).* Spike score {reference.setting.name} "
            f"{_spread(reference.spike_scores(), '.3f')}; " + "; ".join(f"{s.setting.name} {_spread(s.spike_scores(), '.3f')}" for s in ma) + "."
        )
        lines.append("- *GRPO-MA reaches GRPO's quality with less time and compute.* See the verdict above.")
        for s in ma:
            step_ratio = (s.rollout_seconds() + s.update_seconds()) / (reference.rollout_seconds() + reference.update_seconds())
            thought, answer = s.thought_tokens(), s.answer_tokens()
            end, ref_end = _mean(s.eval_curve(name)[-1:]), _mean(reference.eval_curve(name)[-1:])
            lines.append(
                f"- *What a step buys ({s.setting.name}).* After the same {s.runs[0].steps[-1]} steps its held-out {name} is "
                f"{_fmt(end, '.3f')} against {reference.setting.name}'s {_fmt(ref_end, '.3f')}, and its step costs {step_ratio:.2f}x {reference.setting.name}'s: sampling "
                f"{_ratio(s.rollout_seconds(), reference.rollout_seconds())}x, the update {_ratio(s.update_seconds(), reference.update_seconds())}x "
                f"(every one of the K*M answers is trained; a shared thought is encoded once). Thoughts are {_fmt(thought, '.1f')} tokens against "
                f"{_fmt(answer, '.1f')} for an answer, so sharing a thought saves at most {_fmt(thought / (thought + answer), '.0%')} of an "
                "answer's sequence; the paper's regime is long thoughts and short answers."
            )
    return [*lines, ""]


def equal_time(s: SettingSummary, reference: SettingSummary, name: str) -> str:
    """The setting's held-out figure at its end against the reference's after the same training wall time, seed
    by seed (seed i of both saw the same prompts): ahead or behind on every seed, or mixed (seed noise)."""
    ends = s.end_seconds_per_seed()
    own = [r.eval_values[name][-1] if r.eval_values[name] else math.nan for r in s.runs]
    theirs = [ref.held_out_at_seconds(name, end) for ref, end in zip(reference.runs, ends, strict=True)]
    pairs = [(a, b) for a, b in zip(own, theirs, strict=True) if not (math.isnan(a) or math.isnan(b))]
    if not pairs:
        return f"Its {_fmt(_mean(ends), '.0f')} s of training are past {reference.setting.name}'s last evaluation."
    order = _seed_order(pairs, reference.setting.name)
    return (f"At equal training wall time ({_fmt(_mean(ends), '.0f')} s, {s.setting.name}'s end) {s.setting.name} stood at {_fmt(_mean(own), '.3f')} against "
            f"{reference.setting.name}'s {_fmt(_mean(theirs), '.3f')}: {order}"
            + ("" if len(pairs) == len(own) else f" ({len(pairs)} of {len(own)} seeds comparable)") + ".")


def write_report(grid: Grid, root: Path, *, task: str, command: str, report_dir: Path | None = None) -> Path:
    """report.md and its plots in ``report_dir`` (default: ``root``), from the runs under ``root``."""
    from vlm_grpo_ma import variance

    report_dir = report_dir or root
    report_dir.mkdir(parents=True, exist_ok=True)
    held_out = held_out_metrics(task)
    summaries = [SettingSummary(s, [read_run(grid.run_dir(root, s, seed), task, held_out) for seed in grid.seeds]) for s in grid.settings]
    reference = next((s for s in summaries if s.setting.name == "T16A1"), summaries[0])
    main = held_out.main
    has_thoughts = any(not all(math.isnan(v) for r in s.runs for v in r.eval_values[held_out.right_thought]) for s in summaries)
    measured = variance.read_outputs(root / "variance")
    plots = {
        "heldout.png": plot_curves(summaries, report_dir / "heldout.png", main, f"held-out greedy {task} {main}"),
        "accuracy.png": held_out.accuracy != main
        and plot_curves(summaries, report_dir / "accuracy.png", held_out.accuracy, f"held-out greedy {task} accuracy"),
        "right_thoughts.png": has_thoughts and plot_curves(summaries, report_dir / "right_thoughts.png", held_out.right_thought,
                                                           "held-out share of right thoughts"),  # fmt: skip
        "reward.png": plot_curves(summaries, report_dir / "reward.png", None, "mean training reward (smoothed)"),
        "variance.png": measured is not None and _plot_variance(measured[0], report_dir / "variance.png"),
        "noise_vs_m.png": plot_noise(summaries, report_dir / "noise_vs_m.png"),
        "step_time.png": plot_step_time(summaries, report_dir / "step_time.png"),
        "spike_score.png": plot_spikes(summaries, report_dir / "spike_score.png"),
    }
    target = reference.eval_curve(main)[-1] if reference.eval_curve(main) else math.nan
    _, ref_seconds, ref_tokens = reference.reach(main, target)
    link = lambda name: [f"![{name}]({name})", ""] if plots.get(name) else []  # noqa: E731
    accuracy_header = "" if held_out.accuracy == main else "held-out accuracy | "  # math's main metric is its accuracy
    lines = [
        "# GRPO-MA study",
        "",
        f"Command: `{command}`",
        "",
        f"Task {task}; settings {', '.join(s.setting.name for s in summaries)}; seeds {', '.join(map(str, grid.seeds))}; "
        f"{grid.steps} steps of {grid.prompts_per_step} prompts; held-out greedy evaluation of {grid.eval_samples} "
        f"samples before step 1 and every {grid.eval_every} steps. Every run sees the same prompts in the same order; "
        f"{f'config file: {grid.config}; ' if grid.config else ''}extra overrides: {' '.join(grid.extra) or 'none'}. Wall time is the training steps' own (evaluations excluded). "
        "Objectives: M = 1 rows train GRPO (`algorithm.advantage_estimator=grpo`, each thought + answer one sequence, "
        "the prompt's answers as baseline); M >= 2 rows train GRPO-MA (answer baseline: the thought's answers); the loss "
        f"is averaged with `algorithm.loss_aggregation={grid.loss_aggregation()}`.",
        "",
        f"## Time and tokens to reach {reference.setting.name}'s final held-out {main}",
        "",
        f"Target: {reference.setting.name}'s seed-mean held-out {main} at its last evaluation, {_fmt(target, '.3f')}. A setting "
        f"reaches it where its seed-mean held-out curve first does (linearly interpolated between evaluations); its "
        "wall time and tokens are the seed means at that step. Per seed: each seed's own curve against the same target.",
        "",
        f"| setting | objective | held-out {main}, start -> end (seeds at the end) | {accuracy_header}step reached | wall time (s) | "
        "ratio | generated tokens | ratio | per-seed wall time to reach (s) | sampling s/step | update s/step | tokens/step | spike score |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if accuracy_header else ""),
    ]
    for s in summaries:
        step, seconds, tokens = s.reach(main, target)
        accuracy_cell = f"{s.eval_change(held_out.accuracy, '.2f')} | " if accuracy_header else ""
        lines.append(
            f"| {s.setting.name} | {objective(s.setting)} | {s.eval_change(main)} | {accuracy_cell}"
            f"{'not reached' if step is None else f'{step:.0f}'} | {_fmt(seconds, '.0f')} | {_ratio(seconds, ref_seconds)} | "
            f"{_fmt(tokens, ',.0f')} | {_ratio(tokens, ref_tokens)} | {_spread(s.reach_per_seed(main, target), '.0f')} | "
            f"{s.rollout_seconds():.3f} | {s.update_seconds():.3f} | {_fmt(s.tokens_per_step(), ',.0f')} | "
            f"{_spread(s.spike_scores(), '.3f')} |"
        )
    lines += ["", "**Verdict** (from the table):", "", *verdict(summaries, reference, main, target),
              *equal_thoughts(summaries, reference, main), ""]  # fmt: skip
    lines += [*link("heldout.png"), *link("accuracy.png"), *link("reward.png"), *link("step_time.png")]
    lines += [
        "Spike score: the share of steps whose grad norm exceeds twice the median of the previous 10 steps "
        "(seed range in the table).",
        "",
        *link("spike_score.png"),
    ]
    if has_thoughts:
        lines += [
            "## Thoughts",
            "",
            "The share of thoughts that are the reference thought word for word (`right_thought`; on grounding scenes it "
            "names the target and its place, on counting pictures it lists the picture's inventory): held-out greedy "
            "thoughts, and sampled thoughts in training, first and last fifth of the steps.",
            "",
            "| setting | held-out right thoughts, start -> end (seeds at the end) | sampled right thoughts, first -> last fifth |",
            "|---|---|---|",
        ]
        for s in summaries:
            first, last = s.sampled_right_thought()
            lines.append(f"| {s.setting.name} | {s.eval_change(held_out.right_thought, '.2f')} | {_fmt(first, '.3f')} -> {_fmt(last, '.3f')} |")
        lines += ["", *link("right_thoughts.png")]
    if measured is not None:
        results, about = measured
        lines += [
            "## The thought advantage's variance against M, measured",
            "",
            f"`python -m vlm_grpo_ma.variance {about['run']} --out {root / 'variance'} --resamples {about['resamples']}` "
            f"({about['checkpoint']}): {about['prompts']} held-out prompts x {about['thoughts']} thoughts sampled once; "
            f"{about['answers_per_thought']} answers per thought from its KV cache, split into {about['resamples']} disjoint "
            "redraws of M answers. Variances across the redraws, averaged over the thoughts (95% bootstrap interval over "
            "thoughts); `x M` is the variance times M, constant where the variance falls like 1/M.",
            "",
            variance.table(results),
            "",
            *link("variance.png"),
        ]
        distinct = about.get("distinct_thoughts") or []
        if "differing" in about:
            lines += [
                f"{len(distinct) - about['differing']['prompts']} of the {len(distinct)} prompts drew {about['thoughts']} thoughts of one "
                "text: their true values are equal, so their normalised thought advantages are noise of a fixed scale at any M "
                "(the normalisation divides the noise by itself). Over the other "
                f"{about['differing']['prompts']} prompts alone:",
                "",
                variance.table(variance.differing_results(about)),
                "",
            ]
        signal = about.get("right_thoughts")
        if signal:
            lines += [
                f"Right against wrong thoughts on the same prompts ({signal['prompts_with_both']} of the {about['prompts']} prompts "
                f"hold both; {signal['right_thoughts']} right and {signal['wrong_thoughts']} wrong thoughts in all): mean value "
                f"{_fmt(signal['value_right'], '.3f')} against {_fmt(signal['value_wrong'], '.3f')}, and thought advantage at those "
                f"values (what an unlimited M would give) {_fmt(signal['advantage_right'], '+.2f')} against "
                f"{_fmt(signal['advantage_wrong'], '+.2f')}.",
                "",
            ]
    lines += claims(summaries, reference, measured, main)
    lines += [
        "## The per-step noise diagnostic",
        "",
        "`grpo_ma/thought_value_noise_var` is s2 / M computed from each step's own answers (s2: the variance of single "
        "rewards within a thought, `grpo_ma/answer_reward_var`). It falls like 1/M by its definition whenever s2 stays "
        "the same; it is a cheap per-step diagnostic of how noisy the thought values are, not a measurement of the law "
        + ("(the section above is)." if measured is not None else "(`python -m vlm_grpo_ma.variance`, redrawing answers for fixed thoughts, is)."),
        "",
        "| setting | s2 / M (mean over steps and seeds) | s2 | thought / answer tokens |",
        "|---|---|---|---|",
        *[f"| {s.setting.name} | {_fmt(s.noise_var(), '.4f')} | {_fmt(s.answer_var(), '.4f')} | "
          f"{_fmt(s.thought_tokens(), '.1f')} / {_fmt(s.answer_tokens(), '.1f')} |" for s in summaries],  # fmt: skip
        "",
        *link("noise_vs_m.png"),
    ]
    report = report_dir / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report


def _plot_variance(results, path: Path) -> bool:
    from vlm_grpo_ma import variance

    variance.plot(results, path)
    return True


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def _ratio(value: float, reference: float) -> str:
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return "n/a"
    return f"{value / reference:.2f}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    _pyplot().close(figure)


def plot_curves(summaries: list[SettingSummary], path: Path, name: str | None, ylabel: str) -> bool:
    """Three panels (against steps, wall time, generated tokens); a line per setting (seed mean) and a band
    from the lowest to the highest seed. ``name``: a held-out figure; None: the smoothed training reward."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    drawn = False
    for s in summaries:
        if name is None:
            ys, xs_steps = [smooth(r.reward) for r in s.runs], s.runs[0].steps
        else:
            ys, xs_steps = [r.eval_values[name] for r in s.runs], s.runs[0].eval_steps
        length = min(map(len, ys)) if ys else 0
        if length == 0 or all(math.isnan(v) for y in ys for v in y):
            continue
        ys = [y[:length] for y in ys]
        mean = seed_mean(ys)
        low = [min(y[i] for y in ys) for i in range(length)]
        high = [max(y[i] for y in ys) for i in range(length)]
        at = [(float(step), *_seed_mean_position(s, step)) for step in xs_steps[:length]]
        for axis, column in zip(axes, range(3), strict=True):
            xs = [a[column] for a in at]
            (line,) = axis.plot(xs, mean, label=s.setting.name)
            axis.fill_between(xs, low, high, alpha=0.2, color=line.get_color())
        drawn = True
    for axis, label in zip(axes, ("step", "wall time (s, seed mean)", "generated tokens (seed mean)"), strict=True):
        axis.set_xlabel(label)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
    axes[0].legend()
    if drawn:
        _save(figure, path)
    else:
        plt.close(figure)
    return drawn


def _seed_mean_position(s: SettingSummary, step: float) -> tuple[float, float]:
    at = [r.position(step) for r in s.runs]
    return _mean(a[0] for a in at), _mean(a[1] for a in at)


def _error_bars(per_seed: list[list[float]], means: list[float]) -> list[list[float]]:
    """matplotlib's yerr from each bar's seed values: [below, above] the mean, to the lowest and highest seed."""
    below = [max(0.0, m - min(v)) if v else 0.0 for m, v in zip(means, per_seed, strict=True)]  # max(): rounding
    above = [max(0.0, max(v) - m) if v else 0.0 for m, v in zip(means, per_seed, strict=True)]
    return [below, above]


def noise_points(summaries: list[SettingSummary]) -> list[tuple[str, int, float, list[float]]]:
    """(setting, M, thought-value noise variance, its per-seed values) of the settings with M >= 2, by M."""
    points = [(s.setting.name, s.setting.num_answers, s.noise_var(), s.noise_var_per_seed()) for s in summaries if s.setting.num_answers > 1]
    return sorted((p for p in points if not math.isnan(p[2]) and p[2] > 0), key=lambda p: p[1])


def plot_noise(summaries: list[SettingSummary], path: Path) -> bool:
    """Each setting's per-step s2 / M against M, log-log, with seed ranges and the 1/M line through the smallest M."""
    points = noise_points(summaries)
    if not points:
        return False
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(5.5, 4))
    anchor_name, anchor_m, anchor_noise, _ = points[0]
    ms = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= 2 * points[-1][1]]
    axis.plot(ms, [anchor_noise * anchor_m / m for m in ms], "--", color="grey", label=f"1/M through {anchor_name}")
    per_seed = [[v for v in p[3] if not math.isnan(v)] for p in points]
    axis.errorbar([p[1] for p in points], [p[2] for p in points], yerr=_error_bars(per_seed, [p[2] for p in points]),
                  fmt="o", capsize=3, label="s2 / M per step (seed range)")  # fmt: skip
    for name, m, noise, _ in points:
        axis.annotate(name, (m, noise), textcoords="offset points", xytext=(6, 4))
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("M (answers per thought)")
    axis.set_ylabel("s2 / M (per-step diagnostic)")
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    _save(figure, path)
    return True


def plot_step_time(summaries: list[SettingSummary], path: Path) -> bool:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6.5, 4))
    names = [s.setting.name for s in summaries]
    sampling = [s.rollout_seconds() for s in summaries]
    update = [s.update_seconds() for s in summaries]
    totals = [a + b for a, b in zip(sampling, update, strict=True)]
    per_seed = [[v for v in s.step_seconds_per_seed() if not math.isnan(v)] for s in summaries]
    axis.bar(names, sampling, label="sampling")
    axis.bar(names, update, bottom=sampling, label="update (scoring, loss, backward, step)",
             yerr=_error_bars(per_seed, totals), capsize=3)  # fmt: skip
    axis.set_ylabel("seconds per step (seed range of the total)")
    axis.legend()
    _save(figure, path)
    return True


def plot_spikes(summaries: list[SettingSummary], path: Path) -> bool:
    scores = [s.spike_score() for s in summaries]
    if all(math.isnan(v) for v in scores):
        return False
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6.5, 4))
    per_seed = [[v for v in s.spike_scores() if not math.isnan(v)] for s in summaries]
    means = [0.0 if math.isnan(v) else v for v in scores]
    axis.bar([s.setting.name for s in summaries], means, yerr=_error_bars(per_seed, means), capsize=3)
    axis.set_ylabel("spike score (share of steps > 2x running median)")
    _save(figure, path)
    return True


# ----------------------------------------------------------------------------------------------------------
# CLI


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo_ma.study",
        description="Run a grid of K x M settings over seeds on the same prompts and write report.md with plots.",
        epilog="Extra train overrides (section.key=value) apply to every run of the grid. Run the same command again "
        "to resume: finished runs are kept.",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny grid (2 settings, 2 seeds, 4 steps) for tests")
    parser.add_argument("--settings", nargs="+", help=f"T<K>A<M> settings (default: {DEFAULT_GRID['settings']})")
    parser.add_argument("--seeds", type=int, help=f"number of seeds, 0..N-1 (default {DEFAULT_GRID['seeds']})")
    parser.add_argument("--steps", type=int, help=f"training steps per run (default {DEFAULT_GRID['steps']})")
    parser.add_argument("--prompts-per-step", type=int, help=f"default {DEFAULT_GRID['prompts_per_step']}")
    parser.add_argument("--eval-every", type=int, help=f"held-out evaluation every N steps (default {DEFAULT_GRID['eval_every']})")
    parser.add_argument("--eval-samples", type=int, help=f"held-out samples (default {DEFAULT_GRID['eval_samples']})")
    parser.add_argument("--task", default="grounding", help="task name (default: grounding)")
    parser.add_argument("--config", help="train config file every run starts from, e.g. configs/tiny-counting.yaml "
                        "(the grid's settings and overrides apply on top)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1; give each train.num_threads=1 "
                        "with --jobs 2 on 2 cores, so that every run has one core and the step times stay comparable)")
    parser.add_argument("--output-dir", default="runs/study", help="where runs, report.md and plots go (default runs/study)")
    parser.add_argument("--report-dir", help="where report.md and its plots go (default: --output-dir)")
    parser.add_argument("--variance-from", help="the setting whose seed-0 final checkpoint the variance is measured from "
                        "(default: T4A4 when in the grid, else the first with K >= 2)")
    parser.add_argument("--variance-resamples", type=int, help="redraws per M of the variance measurement (default 32; "
                        "--quick 2; 0 skips it)")
    parser.add_argument("--report-only", action="store_true", help="write the report from the runs already there")
    parser.add_argument("overrides", nargs="*", help="train overrides applied to every run, e.g. train.num_threads=1")
    return parser


def grid_from_args(args: argparse.Namespace) -> Grid:
    base = QUICK_GRID if args.quick else DEFAULT_GRID
    names = args.settings or base["settings"].split()
    values = {
        "seeds": args.seeds if args.seeds is not None else base["seeds"],
        "steps": args.steps if args.steps is not None else base["steps"],
        "prompts_per_step": args.prompts_per_step if args.prompts_per_step is not None else base["prompts_per_step"],
        "eval_every": args.eval_every if args.eval_every is not None else base["eval_every"],
        "eval_samples": args.eval_samples if args.eval_samples is not None else base["eval_samples"],
    }
    for key, value in values.items():
        if value < (0 if key == "eval_every" else 1):
            raise ValueError(f"--{key.replace('_', '-')}={value} must be >= {0 if key == 'eval_every' else 1}")
    settings = tuple(Setting.parse(name) for name in names)
    budgets = {s.num_thoughts * s.num_answers for s in settings}
    if len(budgets) > 1:
        print(f"note: the settings spend different answer budgets per prompt ({sorted(budgets)})", file=sys.stderr)
    if args.jobs < 1:
        raise ValueError(f"--jobs={args.jobs} must be >= 1")
    for override in args.overrides:
        if "=" not in override:
            raise ValueError(f"override {override!r} is not section.key=value")
    if args.config is not None and not Path(args.config).is_file():
        raise ValueError(f"--config {args.config}: no such file")
    return Grid(settings, tuple(range(values["seeds"])), values["steps"], values["prompts_per_step"],
                values["eval_every"], values["eval_samples"], tuple(args.overrides), args.config)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_intermixed_args(argv)
    try:
        grid = grid_from_args(args)
        resamples = args.variance_resamples if args.variance_resamples is not None else (2 if args.quick else 32)
        if resamples == 1 or resamples < 0:
            raise ValueError(f"--variance-resamples={resamples} must be 0 (skip) or >= 2")
        measured_setting = variance_setting(grid, args.variance_from) if resamples else None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "grid.json").write_text(json.dumps({"task": args.task, **{k: str(v) for k, v in vars(grid).items()}}, indent=2))
    # the command that made the runs: --report-only rewrites the report of the same grid
    command = "python -m vlm_grpo_ma.study " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only")
    if not args.report_only:
        try:
            run_grid(grid, root, task=args.task, jobs=args.jobs, log=lambda line: print(line, flush=True))
            if resamples:
                run_variance(grid, root, measured_setting, resamples=resamples, prompts=2 if args.quick else 16,
                             answers=(1, 2) if args.quick else (1, 2, 4, 8, 16), log=lambda line: print(line, flush=True))  # fmt: skip
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted: run the same command again to continue", file=sys.stderr)
            return 130
    report = write_report(grid, root, task=args.task, command=command.strip(),
                          report_dir=Path(args.report_dir) if args.report_dir else None)  # fmt: skip
    print(f"report: {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
