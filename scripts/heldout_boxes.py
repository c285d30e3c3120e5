"""How a run's held-out boxes compare with the truth, at each held-out evaluation of a grounding run:
``python scripts/heldout_boxes.py runs/grounding-tiny``.

Prints, per evaluated step: the mean IoU, how many thoughts match the reference thought word for word (the model
named the right object and region; ``vlm_grpo_ma.task_api.right_thought``), and over those with a box, the median ratio of the predicted box's size to the true
box's (mean of the width and height ratios; 1.0 is the true size) and the median distance between the centres.
Reads the run's ``eval/step-N/grounding.jsonl`` and takes the truth from the held-out samples the run
evaluated (its ``config.yaml``: ``data.eval_split`` or ``data.eval_sources``), loaded by the grounding task.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.run.held_out import load_eval_sets
from vlm_grpo_ma.task_api import Sample, get_task, right_thought


def box_report(rows: list[dict], truth: dict[str, Sample]) -> dict[str, float]:
    """Mean IoU, right thoughts, and the median size ratio and centre distance over the right thoughts."""
    sizes, centres, right = [], [], 0
    for row in rows:
        sample = truth[row["id"]]
        reference = sample.meta.get("reference_thought")
        if reference is None or not right_thought(row["thought"], reference):  # without a reference nothing is right
            continue
        right += 1
        predicted = (row.get("prediction") or {}).get("box")
        if predicted is None:
            continue
        x1, y1, x2, y2 = sample.answer
        sizes.append(((predicted[2] - predicted[0]) / (x2 - x1) + (predicted[3] - predicted[1]) / (y2 - y1)) / 2)
        centres.append(math.dist(((predicted[0] + predicted[2]) / 2, (predicted[1] + predicted[3]) / 2), ((x1 + x2) / 2, (y1 + y2) / 2)))
    return {
        "iou": statistics.fmean(row["parts"]["iou"] for row in rows),
        "right_thoughts": right,
        "size_ratio": statistics.median(sizes) if sizes else math.nan,
        "centre_distance": statistics.median(centres) if centres else math.nan,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    evaluations = sorted(args.run_dir.glob("eval/step-*/grounding.jsonl"))
    if not evaluations:
        raise SystemExit(f"no held-out grounding evaluations under {args.run_dir}/eval (train.eval_every=0?)")
    cfg = load_config(args.run_dir / "config.yaml")
    _, samples = load_eval_sets(cfg, {"grounding": get_task("grounding")})["grounding"]
    truth = {sample.id: sample for sample in samples}
    print("step      IoU   right thoughts   box size / true size (median)   centre distance px (median)")
    for path in evaluations:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        report = box_report(rows, truth)
        step = int(path.parent.name.removeprefix("step-"))
        print(f"{step:5d}   {report['iou']:.3f}   {report['right_thoughts']:3d} of {len(rows):3d}"
              f"        {report['size_ratio']:.3f}                           {report['centre_distance']:.1f}")


if __name__ == "__main__":
    main()
