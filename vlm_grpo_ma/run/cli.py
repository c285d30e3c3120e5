"""``python -m vlm_grpo_ma.train``: arguments, dotted overrides, exit codes. ``main`` calls ``loop.train``; with
``--resume`` the settings are the run's own, the command line over them (``run_dir.resumed_settings``)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from vlm_grpo_ma.model.loading import checked_model_path
from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run import survive
from vlm_grpo_ma.run.bridge import PeerLost
from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.config_files import describe_config, load_config
from vlm_grpo_ma.run.distributed import launch_rank, process_group_left_at_the_end, quiet_other_processes
from vlm_grpo_ma.run.engine_process import run_engine_process
from vlm_grpo_ma.run.loop import train
from vlm_grpo_ma.run.run_dir import resumed_settings
from vlm_grpo_ma.run.split_launch import split_launch, stopped_engines
from vlm_grpo_ma.task_api.registry import get_task, import_task_modules


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo_ma.train",
        description="Train a Qwen-VL model with GRPO-MA (K thoughts x M answers per prompt).",
        epilog="Overrides: section.key=value, e.g. rollout.num_answers=1 rollout.num_thoughts=16 train.steps=50",
    )
    parser.add_argument("--config", help="YAML config file (sections: model rollout algorithm data train logging)")
    parser.add_argument("--task", help="task name (same as data.task=NAME)")
    parser.add_argument("--output-dir", help="run directory (same as train.output_dir=DIR)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the run directory")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete the outputs of an earlier run in the run directory first"
    )
    parser.add_argument(
        "--allow-changes", action="store_true",
        help="with --resume: let the command line change what the run is (task, model, K, M, estimator, seed ...)",
    )  # fmt: skip
    parser.add_argument(
        "--print-config", action="store_true",
        help="print every setting with its value (after --config, --resume and the overrides) and what it is, then exit",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted overrides section.key=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    # intermixed: dotted overrides may come before, between or after the options
    args = build_arg_parser().parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.task:
        overrides.append(f"data.task={args.task}")
    if args.output_dir is not None:  # "" too: validate refuses it, rather than the default folder taking its place
        overrides.append(f"train.output_dir={args.output_dir}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rank = launch_rank()
    quiet_other_processes(rank)  # before --resume's notes: a launch says them once
    try:
        cfg = load_config(args.config, overrides)
        if args.resume:  # the run's own settings, the command line over them
            cfg = resumed_settings(cfg, args.config, overrides, allow_changes=args.allow_changes)
        elif args.allow_changes:
            raise ConfigError("--allow-changes goes with --resume (a new run has nothing to change)")
        if args.print_config:
            print(describe_config(cfg))
            return 0
        if args.task and cfg.data.tasks:
            raise ConfigError(f"--task {args.task} and data.tasks {cfg.data.tasks} both name the tasks; give one")
        import_task_modules(cfg.data.task_modules)
        for name in cfg.task_weights:
            get_task(name)
        if not args.resume and args.config is None:
            cfg = with_task_preset(cfg, overrides, rank)
        if not args.resume:  # a resume loads its checkpoint's model
            checked_model_path(cfg.model.name_or_path, "model.name_or_path")  # a mistyped path: now, in one line
    # ValueError: a ConfigError, or a model folder whose config is broken; KeyError: an unknown task name. Every
    # process of a launch reads the same command line: the main process says it.
    except (ValueError, KeyError, FileNotFoundError) as error:
        if rank == 0:
            print(f"error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    split = None
    try:
        if args.resume and args.overwrite:
            raise ConfigError("--resume continues the run in the run directory and --overwrite deletes it; give one")
        if cfg.rollout.engine_processes:  # the last processes of the launch only sample (split_launch.py)
            split = split_launch(cfg)
            if split[0].is_engine:
                return run_engine_process(cfg, *split)
        with process_group_left_at_the_end():
            train(cfg, resume=args.resume, overwrite=args.overwrite, split=split)
    except ConfigError as error:  # found when loading the data or the model
        say_error(error, rank)
        return 2
    except (survive.NonFiniteError, survive.StoppedByAnotherProcess) as error:  # the message names the quantity / process
        say_error(error, rank)
        return 1
    except PeerLost as error:  # an engine process of a split launch stopped: the trainers saved what they had
        say_error(error, rank)
        if rank == 0:
            print(how_to_continue(Path(cfg.train.output_dir), split_launch=split is not None), file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # train() saved a checkpoint of the steps done
        if rank == 0:
            if (line := stopped_engines(split)) is not None:  # the launcher stops the trainers when an engine dies
                print(line, file=sys.stderr)
            print(how_to_continue(Path(cfg.train.output_dir), split_launch=split is not None), file=sys.stderr)
        return interrupt.exit_code if isinstance(interrupt, survive.Terminated) else 130
    return 0


def with_task_preset(cfg, overrides: list[str], rank: int):
    """The config of a one-task run without ``--config`` whose task has a preset (``Task.default_config``): that
    preset with the command line's keys on top, said in one line; else ``cfg`` as it is."""
    names = list(cfg.task_weights)
    preset = get_task(names[0]).default_config if len(names) == 1 else None
    if preset is None:
        return cfg
    if rank == 0:
        print(f"task {names[0]} runs with its preset {preset} (--config names another)", file=sys.stderr)
    return load_config(preset, overrides)


def say_error(error: Exception, rank: int) -> None:
    """The error line of a run that stops, said once by a launch: the main process (rank 0) speaks for the run
    (its own error, or ``process N stopped the run: ...``); another process says only a failure of its own: not
    a ConfigError (every process meets the same one; one that a process meets alone, a folder it does not share,
    stops every process together, and the main process names it) nor another process's (StoppedByAnotherProcess)."""
    if rank == 0 or not isinstance(error, (ConfigError, survive.StoppedByAnotherProcess)):
        print(f"error: {error}", file=sys.stderr)


def how_to_continue(run_dir: Path, split_launch: bool = False) -> str:
    """The line a run stopped by Ctrl-C or SIGTERM ends with: the checkpoint it continues from and the command
    (the run's own config.yaml holds its settings), or, with none saved yet, how to start again. A split launch
    (``rollout.engine_processes``) continues under a launch of as many processes: its engines are some of them."""
    last = ckpt.latest_checkpoint(run_dir)
    if last is None:
        return "stopped before the first checkpoint, so there is nothing to continue; to start again, add --overwrite to the same command"
    command = f"python -m vlm_grpo_ma.train --output-dir {shlex.quote(str(run_dir))} --resume"
    if split_launch:
        command = f"the same launch (accelerate launch <its options> -m vlm_grpo_ma.train --output-dir {shlex.quote(str(run_dir))} --resume)"
    return f"stopped; checkpoint {last} holds step {ckpt.checkpoint_step(last)}. Continue with: {command}"
