"""Learning of the split launch (issue 49): the default grounding run, one engine process + one trainer process,
the engine one step ahead (``rollout.max_staleness=1``) against waiting for each update (``=0``), on 3 seeds.

Held-out greedy IoU (100 test scenes, every ``--eval-every`` steps) at equal steps, and at equal training time: the
S=0 run's last evaluation reached within the time the S=1 run took for all its steps. Training time is the sum of
``time/step_seconds`` (the trainer's wait for its trees plus its update; start-up and evaluations left out, as
they cost both runs alike).

    python scripts/split_learning.py                    # 6 launches of 300 steps (about 40 min on 2 cores)
    python scripts/split_learning.py --report runs/split-learning   # the table of runs already there
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(folder: Path, seed: int, staleness: int, steps: int, eval_every: int) -> None:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/cpu-2proc.yaml"),
               "-m", "vlm_grpo_ma.train", "--task", "grounding", "--output-dir", str(folder), f"train.seed={seed}", f"train.steps={steps}",
               f"train.eval_every={eval_every}", "train.num_threads=1", "rollout.engine_processes=1", f"rollout.max_staleness={staleness}",
               "logging.progress_bar=false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def curve(folder: Path) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, held-out IoU) at each evaluation."""
    points, seconds = [], 0.0
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        seconds += record.get("time/step_seconds", 0.0)
        if "eval/grounding/iou" in record:
            points.append((record["step"], seconds, record["eval/grounding/iou"]))
    return points


def report(root: Path, seeds: list[int]) -> None:
    print("| seed | S | held-out IoU at each evaluation (step: IoU) | training time | S=0 at S=1's time |")
    print("|---|---|---|---|---|")
    for seed in seeds:
        ahead, waiting = curve(root / f"s1-seed{seed}"), curve(root / f"s0-seed{seed}")
        for staleness, points in ((1, ahead), (0, waiting)):
            evaluations = ", ".join(f"{step}: {iou:.3f}" for step, _, iou in points)
            same_time = ""
            if staleness == 0:
                budget = ahead[-1][1]
                step, _, iou = max((p for p in waiting if p[1] <= budget), key=lambda p: p[0])
                same_time = f"step {step}: {iou:.3f} (S=1 at step {ahead[-1][0]}: {ahead[-1][2]:.3f})"
            print(f"| {seed} | {staleness} | {evaluations} | {points[-1][1] / 60:.1f} min | {same_time} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="print the table of the runs in this folder and stop")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "split-learning")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    args = parser.parse_args()
    if args.report is None:
        for seed in args.seeds:
            for staleness in (1, 0):
                folder = args.out / f"s{staleness}-seed{seed}"
                if not (folder / "summary.json").exists():
                    print(f"seed {seed}, max_staleness={staleness} -> {folder}", flush=True)
                    launch(folder, seed, staleness, args.steps, args.eval_every)
    report(args.report or args.out, args.seeds)


if __name__ == "__main__":
    main()
