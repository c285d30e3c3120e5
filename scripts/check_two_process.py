"""Two processes train what one process trains: the data-parallel equivalence check (CPU, gloo).

Runs the same short GRPO-MA run (same seed, same global batch of prompts) twice on a freshly initialised
tiny model: once as one process, once as two processes under ``accelerate launch`` (DDP over gloo), then
prints the largest difference between the two runs' final weights, next to how far training moved them.

    .venv/bin/python scripts/check_two_process.py [--steps 3] [--keep DIR]

Exit status 0 when the difference is at most --tolerance (1e-5), else 1. The run uses a reward every
untrained sample varies on (answer length), so the weights do move and the comparison means something.
The launch uses ``configs/accelerate/cpu-2proc.yaml`` (its header says why it names MULTI_GPU: in
accelerate 1.16 a MULTI_CPU launch goes through mpirun; with no GPU the torchrun workers run on the CPU, gloo).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_MODULE = ROOT / "tests" / "fixtures" / "answer_length_task.py"


def run_overrides(model_dir: Path, steps: int) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        f"train.steps={steps}",
        "train.prompts_per_step=4",
        "train.micro_batch_rows=4",
        "train.num_threads=1",
        "train.checkpoint_every=1000",
        "rollout.num_thoughts=2",
        "rollout.num_answers=2",
        "rollout.max_thought_tokens=8",
        "rollout.max_answer_tokens=6",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "train.eval_every=0",
        "data.task=answer_length",
        f"data.task_modules=[{TASK_MODULE}]",
    ]


def launch(out_dir: Path, overrides: list[str], processes: int, *, resume: bool = False) -> None:
    python = sys.executable
    if processes == 1:
        command = [python, "-m", "vlm_grpo_ma.train"]
    else:
        command = [
            python, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/cpu-2proc.yaml"),
            "--num_processes", str(processes), "-m", "vlm_grpo_ma.train",
        ]
    command += ["--output-dir", str(out_dir), *overrides] + (["--resume"] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"training with {processes} process(es) failed (exit {done.returncode})")


def final_weights(run_dir: Path):
    from safetensors.torch import load_file

    from vlm_grpo_ma.checkpoint import latest_checkpoint

    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def max_abs_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (>= 2)")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--keep", help="keep the runs in this folder (default: a temporary folder)")
    args = parser.parse_args(argv)
    from safetensors.torch import load_file

    from vlm_grpo_ma.tiny import build_untrained

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        model_dir = build_untrained(work / "untrained", seed=0)
        overrides = run_overrides(model_dir, args.steps)
        launch(work / "one-process", overrides, 1)
        launch(work / "two-processes", overrides, 2)
        # resuming with the same number of processes: stop one step early, then --resume to the end
        launch(work / "two-processes-resumed", run_overrides(model_dir, args.steps - 1), 2)
        launch(work / "two-processes-resumed", overrides, 2, resume=True)
        one, two = final_weights(work / "one-process"), final_weights(work / "two-processes")
        resumed = final_weights(work / "two-processes-resumed")
        start = load_file(Path(model_dir) / "model.safetensors")
        difference, moved = max_abs_difference(one, two), max_abs_difference(one, start)
        resume_difference = max_abs_difference(two, resumed)
    print(f"steps: {args.steps}, global batch: 4 prompts x 2 thoughts x 2 answers, seed 0")
    print(f"largest weight change from the start (one process): {moved:.3e}")
    print(f"largest weight difference, one vs two processes:    {difference:.3e}  (tolerance {args.tolerance:g})")
    print(f"two processes, straight vs stopped and resumed:     {resume_difference:.3e}")
    ok = max(difference, resume_difference) <= args.tolerance and moved > 10 * args.tolerance  # weights moved
    print("equivalent" if ok else "NOT equivalent")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
