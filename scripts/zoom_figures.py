"""The zoom preset's figures from its runs' metrics.jsonl: held-out greedy accuracy, the share of held-out
thoughts that looked and whose crop held the target (``crop_hit``: a useful look), at the first and the last
evaluation; and in the training rollouts (sampled, temperature 1), the share of answers after a useful look and
of thoughts that got a crop back, each averaged over the first and the last five steps; the largest log-prob gap
between the sampler and the trainer over the run.

    python scripts/zoom_figures.py runs/zoom-s0 runs/zoom-s1 runs/zoom-s2 runs/zoom-control
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    held_out = [r for r in rows if "eval/zoom/accuracy" in r]
    steps = [r for r in rows if "tools/looked_share" in r]
    if not held_out or not steps:
        raise SystemExit(f"{run}: no held-out zoom evaluation or no training step in metrics.jsonl")
    first, last = held_out[0], held_out[-1]

    def mean(key: str, part: list) -> float:
        return sum(r[key] for r in part) / len(part)

    return {
        "run": run.name,
        "steps": f"{first['step']} -> {last['step']}",
        "accuracy": f"{first['eval/zoom/accuracy']:.2f} -> {last['eval/zoom/accuracy']:.2f}",
        "useful looks (crop_hit)": f"{first['eval/zoom/crop_hit']:.2f} -> {last['eval/zoom/crop_hit']:.2f}",
        "looked": f"{first['eval/zoom/looked']:.2f} -> {last['eval/zoom/looked']:.2f}",
        "sampled: useful looks": f"{mean('reward/crop_hit', steps[:5]):.2f} -> {mean('reward/crop_hit', steps[-5:]):.2f}",
        "sampled: looked": f"{mean('tools/looked_share', steps[:5]):.2f} -> {mean('tools/looked_share', steps[-5:]):.2f}",
        "log-prob gap max": f"{max(r['rollout/logprob_gap_max'] for r in steps):.2e}",
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    table = [figures(Path(arg)) for arg in argv]
    columns = list(table[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in table:
        print("| " + " | ".join(row[c] for c in columns) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
