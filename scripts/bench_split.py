"""Speed of the split launch on this machine (issue 49), side by side: two-process launches, one thread each.

For each task, in interleaved rounds (so that the machine's drift falls on every placement alike):
- ``split S=1``: one engine process and one trainer process, the engine one step ahead;
- ``split S=0``: the same placement, the engine waiting for each update (no overlap);
- ``today``: the ordinary two-process launch (DDP: each process samples its half, then trains it).
A run's figure is its seconds per step after ``--warmup`` steps (``time/step_seconds``: the trainer's wait for its
trees plus its update; start-up and evaluation excluded). Ratios are taken round by round and given as mean and
range. The bound the overlap can reach, from the S=0 runs' own parts (rollout r = the trainer's wait, update u =
the rest of its step), is max(r, u) / (r + u).

    python scripts/bench_split.py                       # the default grounding run and the zoom preset
    python scripts/bench_split.py --tasks grounding --rounds 2 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The tasks: the default run (thoughts of similar lengths) and a long-tailed one (zoom: a thought calls the tool
# 0 to 3 times, and each call adds a turn and a crop, so thought lengths spread widely).
TASKS = {"grounding": ["--task", "grounding"], "zoom": ["--config", "configs/tiny-zoom.yaml"]}
PLACEMENTS = {
    "split S=1": ["rollout.engine_processes=1", "rollout.max_staleness=1"],
    "split S=0": ["rollout.engine_processes=1", "rollout.max_staleness=0"],
    "today": [],
}


def run(task: list[str], placement: list[str], steps: int, folder: Path) -> list[dict]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/cpu-2proc.yaml"),
               "-m", "vlm_grpo_ma.train", *task, f"train.steps={steps}", "train.eval_every=0", "train.num_threads=1",
               "logging.progress_bar=false", "logging.report_to=[]", f"train.checkpoint_every={steps}", "--output-dir", str(folder),
               *placement]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} (range {min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (start-up, first allocations)")
    args = parser.parse_args()
    for task in args.tasks:
        per_step = {name: [] for name in PLACEMENTS}
        bounds = []
        for round_index in range(args.rounds):
            for name, placement in PLACEMENTS.items():
                with tempfile.TemporaryDirectory() as folder:
                    records = run(TASKS[task], placement, args.steps, Path(folder) / "run")[args.warmup :]
                seconds = sum(r["time/step_seconds"] for r in records) / len(records)
                per_step[name].append(seconds)
                print(f"{task} round {round_index + 1} {name}: {seconds:.3f} s/step", flush=True)
                if name == "split S=0":
                    rollout = sum(r["time/rollout_seconds"] for r in records)
                    update = sum(r["time/step_seconds"] for r in records) - rollout
                    bounds.append(max(rollout, update) / (rollout + update))
        print(f"\n{task}: {args.rounds} rounds of {args.steps} steps (first {args.warmup} left out), seconds per step")
        for name, values in per_step.items():
            print(f"  {name:10s} {spread(values)}")
        pairs = list(zip(per_step["split S=1"], per_step["split S=0"], per_step["today"], strict=True))
        print(f"  S=1 / S=0 (same placement): {spread([a / b for a, b, _ in pairs])}")
        print(f"  S=1 / today's launch:       {spread([a / c for a, _, c in pairs])}")
        print(f"  bound max(r, u) / (r + u):  {spread(bounds)}\n", flush=True)


if __name__ == "__main__":
    main()
