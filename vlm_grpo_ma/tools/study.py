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
import json
import sys
from pathlib import Path

from vlm_grpo_ma.tools.study_report import write_report
from vlm_grpo_ma.tools.study_runs import (
    DEFAULT_GRID,
    QUICK_GRID,
    Grid,
    Setting,
    run_grid,
    run_variance,
    variance_setting,
)

# ----------------------------------------------------------------------------------------------------------
# CLI


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo_ma.study",
        description="Run a grid of K x M settings over seeds on the same prompts and write report.md with plots.",
        epilog="Extra train overrides (section.key=value) apply to every run of the grid. Run the same command again "
        "to resume: finished runs are kept.",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny grid (2 settings, 2 seeds, 2 steps) for tests")
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
