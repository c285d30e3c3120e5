"""GRPO-MA's claims, measured: ``python -m vlm_grpo_ma.study`` (see ``--help``).

Runs a grid of K x M settings at a fixed answer budget per prompt (default T16A1, T8A2, T4A4, T2A8: 16
answers each) over several seeds, every run on the same prompts in the same order (the prompt stream and the
sampling randomness are functions of the seed), then writes ``report.md`` and PNG plots:

- reward and the held-out greedy figure (the task's main metric: IoU for grounding) against steps, wall time
  and generated tokens, with a band over seeds;
- the thought advantage's estimation noise (``grpo_ma/thought_value_noise_var``) against M on log-log axes,
  with the 1/M line through the measured within-thought reward variance;
- step time per setting, split into sampling and update;
- the gradient spike score per setting (``diagnostics.spike_score``);
- a table: the wall time and generated tokens each setting needs to reach the reference setting's (T16A1's)
  final reward level (its seed-mean reward smoothed over its last 10 steps), as ratios.

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
import statistics
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
            *self.extra,
        ]


# The default run's regime (its warm start, learning rate and 16 prompts a step), where held-out IoU rises; 300
# of its 400 steps. T4A1 is GRPO with GRPO-MA's number of thoughts: the baseline at equal thought count.
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
                   "--resume" if resume else "--overwrite", *grid.overrides(setting, seed)]  # fmt: skip
        log(f"{label}: {'resuming' if resume else 'running'} ({time.perf_counter() - started:.0f} s into the study)")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            failures.append(
                f"{label} failed (exit {done.returncode}); its run directory is {run_dir}. Last output:\n"
                + (done.stdout[-2000:] + done.stderr[-3000:])
            )

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for future in [pool.submit(run_one, index, setting, seed) for index, (setting, seed) in enumerate(runs, 1)]:
            future.result()
    if failures:
        raise RuntimeError(failures[0])


# ----------------------------------------------------------------------------------------------------------
# Reading the runs


def _value(record: dict, key: str) -> float:
    value = record.get(key)
    return math.nan if value is None else float(value)


@dataclass
class RunCurves:
    """One run's per-step series (training steps only; held-out evaluations separately)."""

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
    eval_steps: list[int]
    eval_value: list[float]  # the task's main held-out metric


def held_out_metric(task: str) -> str:
    """The held-out figure the study plots: the task's main metric (grounding: iou; math: accuracy)."""
    from vlm_grpo_ma.registry import get_task

    return get_task(task).metrics[0]


def read_run(run_dir: Path, task: str, metric: str) -> RunCurves:
    records = read_metrics(run_dir)
    training = [r for r in records if r["step"] > 0 and "reward/mean" in r]
    evaluations = [r for r in records if f"eval/{task}/{metric}" in r]
    step_seconds = [_value(r, "time/step_seconds") for r in training]
    tokens = [_value(r, "rollout/generated_tokens") for r in training]
    return RunCurves(
        steps=[r["step"] for r in training],
        reward=[_value(r, "reward/mean") for r in training],
        seconds=_cumulative(step_seconds),
        tokens=_cumulative(tokens),
        rollout_seconds=[_value(r, "time/rollout_seconds") for r in training],
        step_seconds=step_seconds,
        noise_var=[_value(r, "grpo_ma/thought_value_noise_var") for r in training],
        answer_var=[_value(r, "grpo_ma/answer_reward_var") for r in training],
        spike_ratios=[_value(r, "train/grad_norm_spike_ratio") for r in training],
        thought_tokens=[_value(r, "rollout/thought_tokens") for r in training],
        answer_tokens=[_value(r, "rollout/answer_tokens") for r in training],
        eval_steps=[r["step"] for r in evaluations],
        eval_value=[_value(r, f"eval/{task}/{metric}") for r in evaluations],
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


def first_crossing(values: list[float], target: float, start: int = SMOOTHING_STEPS - 1) -> int | None:
    """The index of the first value >= target from ``start`` on (the first index with a full smoothing
    window: a trailing mean over fewer steps is one noisy step), or None."""
    return next((i for i in range(start, len(values)) if values[i] >= target), None)


@dataclass
class SettingSummary:
    setting: Setting
    runs: list[RunCurves]

    def smoothed_reward(self) -> list[float]:
        return smooth(seed_mean([r.reward for r in self.runs]))

    def final_reward(self) -> float:
        """The seed-mean reward over the last fifth of the steps."""
        reward = seed_mean([r.reward for r in self.runs])
        return _mean(reward[-max(1, len(reward) // 5) :])

    def reward_gain(self) -> tuple[float, float]:
        """(last-fifth minus first-fifth seed-mean reward, the standard error of that difference)."""
        reward = seed_mean([r.reward for r in self.runs])
        fifth = max(1, len(reward) // 5)
        first, last = reward[:fifth], reward[-fifth:]
        spread = statistics.pstdev(first + last) if len(first + last) > 1 else math.nan
        return _mean(last) - _mean(first), spread * math.sqrt(1 / len(first) + 1 / len(last))

    def noise_var(self) -> float:
        return _mean(v for r in self.runs for v in r.noise_var)

    def answer_var(self) -> float:
        return _mean(v for r in self.runs for v in r.answer_var)

    def rollout_seconds(self) -> float:
        return _mean(v for r in self.runs for v in r.rollout_seconds)

    def update_seconds(self) -> float:
        return _mean(s - g for r in self.runs for s, g in zip(r.step_seconds, r.rollout_seconds, strict=True))

    def held_out_change(self) -> str:
        """The seed-mean held-out metric at the first and the last evaluation."""
        values = seed_mean([r.eval_value for r in self.runs])
        return f"{values[0]:.3f} -> {values[-1]:.3f}" if values else "n/a"

    def thought_tokens(self) -> float:
        return _mean(v for r in self.runs for v in r.thought_tokens)

    def answer_tokens(self) -> float:
        return _mean(v for r in self.runs for v in r.answer_tokens)

    def spike_score(self) -> float:
        return _mean(spike_score(r.spike_ratios) for r in self.runs)

    def to_reach(self, target: float) -> tuple[int | None, float, float]:
        """(step, seed-mean wall seconds, seed-mean generated tokens) at which the smoothed seed-mean reward
        first reaches ``target``; (None, nan, nan) when it never does."""
        index = first_crossing(self.smoothed_reward(), target)
        if index is None:
            return None, math.nan, math.nan
        return (self.runs[0].steps[index], _mean(r.seconds[index] for r in self.runs), _mean(r.tokens[index] for r in self.runs))


# ----------------------------------------------------------------------------------------------------------
# The report


def write_report(grid: Grid, root: Path, *, task: str, command: str) -> Path:
    metric = held_out_metric(task)
    summaries = [
        SettingSummary(s, [read_run(grid.run_dir(root, s, seed), task, metric) for seed in grid.seeds]) for s in grid.settings
    ]
    reference = next((s for s in summaries if s.setting.name == "T16A1"), summaries[0])
    plots = {
        "reward.png": plot_curves(summaries, root / "reward.png", "reward", "mean reward (smoothed)"),
        "heldout.png": plot_curves(summaries, root / "heldout.png", "eval", f"held-out greedy {task} {metric}"),
        "noise_vs_m.png": plot_noise(summaries, root / "noise_vs_m.png"),
        "step_time.png": plot_step_time(summaries, root / "step_time.png"),
        "spike_score.png": plot_spikes(summaries, root / "spike_score.png"),
    }
    target = reference.smoothed_reward()[-1]  # where the reference ends: it reaches it by its last step
    ref_step, ref_seconds, ref_tokens = reference.to_reach(target)
    gain, gain_error = reference.reward_gain()
    learned = gain > 2 * gain_error
    lines = [
        "# GRPO-MA study",
        "",
        f"Command: `{command}`",
        "",
        f"Task {task}; settings {', '.join(s.setting.name for s in summaries)}; seeds {', '.join(map(str, grid.seeds))}; "
        f"{grid.steps} steps of {grid.prompts_per_step} prompts; held-out greedy evaluation of {grid.eval_samples} "
        f"samples every {grid.eval_every} steps. Every run sees the same prompts in the same order.",
        "",
        f"## Time and tokens to reach {reference.setting.name}'s reward level",
        "",
        f"Target: {reference.setting.name}'s final seed-mean reward, smoothed over its last {SMOOTHING_STEPS} steps, {target:.3f}. "
        "A setting reaches it at the "
        f"first step (from step {SMOOTHING_STEPS} on) where its seed-mean reward, smoothed over {SMOOTHING_STEPS} steps, is at "
        f"least the target. {reference.setting.name} gained {gain:+.3f} from its first to its last fifth (standard error "
        f"{gain_error:.3f}). "
        + ("" if learned else "**That gain is within two standard errors of 0: the reward did not rise measurably in this "
           "grid, so the time and tokens to reach the target below compare noise, not learning.**"),
        "",
        f"| setting | final reward | step reached | wall time (s) | ratio | generated tokens | ratio | sampling s/step | update s/step | spike score | thought-value noise var | within-thought reward var | held-out {metric}, start -> end | thought / answer tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        step, seconds, tokens = s.to_reach(target)
        lines.append(
            f"| {s.setting.name} | {s.final_reward():.3f} | {step if step is not None else 'not reached'} | "
            f"{_fmt(seconds, '.0f')} | {_ratio(seconds, ref_seconds)} | {_fmt(tokens, ',.0f')} | {_ratio(tokens, ref_tokens)} | "
            f"{s.rollout_seconds():.3f} | {s.update_seconds():.3f} | {_fmt(s.spike_score(), '.3f')} | "
            f"{_fmt(s.noise_var(), '.4f')} | {_fmt(s.answer_var(), '.4f')} | {s.held_out_change()} | "
            f"{_fmt(s.thought_tokens(), '.1f')} / {_fmt(s.answer_tokens(), '.1f')} |"
        )
    lines += [
        "",
        "Noise columns: `grpo_ma/thought_value_noise_var` (the sampling variance of a thought's mean reward, s2 / M) "
        "and `grpo_ma/answer_reward_var` (s2, the variance of single rewards within a thought), averaged over steps "
        "and seeds; M = 1 cannot estimate either. The thought advantage's noise falls like 1/M exactly when s2 does "
        "not change with M: in noise_vs_m.png the 1/M line is anchored at the smallest M, and the other settings' "
        "points sit on it as far as their s2 agree. "
        "Spike score: the share of steps whose grad norm exceeds twice the median of the previous 10 steps.",
        "",
        *[f"![{name}]({name})" for name, made in plots.items() if made],
        "",
    ]
    report = root / "report.md"
    report.write_text("\n".join(lines))
    return report


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


def plot_curves(summaries: list[SettingSummary], path: Path, kind: str, ylabel: str) -> bool:
    """Three panels (against steps, wall time, generated tokens); a line per setting (seed mean) and a band
    from the lowest to the highest seed."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    drawn = False
    for s in summaries:
        if kind == "reward":
            ys = [smooth(r.reward) for r in s.runs]
            xs_steps = s.runs[0].steps
        else:
            ys = [r.eval_value for r in s.runs]
            xs_steps = s.runs[0].eval_steps
        length = min(map(len, ys)) if ys else 0
        if length == 0:
            continue
        ys = [y[:length] for y in ys]
        mean = seed_mean(ys)
        low = [min(y[i] for y in ys) for i in range(length)]
        high = [max(y[i] for y in ys) for i in range(length)]
        at = [_x_positions(s, step) for step in xs_steps[:length]]
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


def _x_positions(s: SettingSummary, step: int) -> tuple[float, float, float]:
    """(step, seed-mean cumulative seconds, seed-mean cumulative tokens) at ``step`` (0: the start)."""
    if step == 0:
        return 0.0, 0.0, 0.0
    index = s.runs[0].steps.index(step)
    return float(step), _mean(r.seconds[index] for r in s.runs), _mean(r.tokens[index] for r in s.runs)


def noise_points(summaries: list[SettingSummary]) -> list[tuple[str, int, float]]:
    """(setting, M, thought-value noise variance) of the settings with M >= 2, by M."""
    points = [(s.setting.name, s.setting.num_answers, s.noise_var()) for s in summaries if s.setting.num_answers > 1]
    return sorted((p for p in points if not math.isnan(p[2]) and p[2] > 0), key=lambda p: p[1])


def plot_noise(summaries: list[SettingSummary], path: Path) -> bool:
    """Each setting's thought-value noise (its own s2 / M) against M, log-log, with the 1/M line anchored at the
    smallest M: the other points sit on it when the within-thought variance s2 does not change with M, that is
    when more answers per thought shrink the thought advantage's noise like 1/M."""
    points = noise_points(summaries)
    if not points:
        return False
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(5.5, 4))
    anchor_name, anchor_m, anchor_noise = points[0]
    ms = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= 2 * points[-1][1]]
    axis.plot(ms, [anchor_noise * anchor_m / m for m in ms], "--", color="grey", label=f"1/M through {anchor_name}")
    axis.plot([p[1] for p in points], [p[2] for p in points], "o", markersize=8, label="measured: s2 / M per setting")
    for name, m, noise in points:
        axis.annotate(name, (m, noise), textcoords="offset points", xytext=(6, 4))
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("M (answers per thought)")
    axis.set_ylabel("variance of a thought's mean reward")
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    _save(figure, path)
    return True


def plot_step_time(summaries: list[SettingSummary], path: Path) -> bool:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(5.5, 4))
    names = [s.setting.name for s in summaries]
    sampling = [s.rollout_seconds() for s in summaries]
    update = [s.update_seconds() for s in summaries]
    axis.bar(names, sampling, label="sampling")
    axis.bar(names, update, bottom=sampling, label="update (scoring, loss, backward, step)")
    axis.set_ylabel("seconds per step (mean over steps and seeds)")
    axis.legend()
    _save(figure, path)
    return True


def plot_spikes(summaries: list[SettingSummary], path: Path) -> bool:
    scores = [s.spike_score() for s in summaries]
    if all(math.isnan(v) for v in scores):
        return False
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(5.5, 4))
    axis.bar([s.setting.name for s in summaries], [0.0 if math.isnan(v) else v for v in scores])
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
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1; give each train.num_threads=1 "
                        "with --jobs 2 on 2 cores, so that every run has one core and the step times stay comparable)")
    parser.add_argument("--output-dir", default="runs/study", help="where runs, report.md and plots go (default runs/study)")
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
    return Grid(settings, tuple(range(values["seeds"])), values["steps"], values["prompts_per_step"],
                values["eval_every"], values["eval_samples"], tuple(args.overrides))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_intermixed_args(argv)
    try:
        grid = grid_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "grid.json").write_text(json.dumps({"task": args.task, **{k: str(v) for k, v in vars(grid).items()}}, indent=2))
    command = "python -m vlm_grpo_ma.study " + " ".join(argv if argv is not None else sys.argv[1:])
    if not args.report_only:
        try:
            run_grid(grid, root, task=args.task, jobs=args.jobs, log=lambda line: print(line, flush=True))
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted: run the same command again to continue", file=sys.stderr)
            return 130
    report = write_report(grid, root, task=args.task, command=command.strip())
    print(f"report: {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
