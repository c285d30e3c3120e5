"""scripts/heldout_boxes.py's box comparison, on hand-made evaluation rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vlm_grpo_ma.task_api import Sample

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "heldout_boxes.py"
spec = importlib.util.spec_from_file_location("heldout_boxes", SCRIPT)
heldout_boxes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heldout_boxes)


def scene(scene_id, box, reference_thought):
    return Sample("grounding", scene_id, "Locate: it.", (), box, {"reference_thought": reference_thought})


def row(scene_id, thought, box, iou):
    return {"id": scene_id, "thought": f"<think>{thought}</think>", "prediction": {"box": box}, "parts": {"iou": iou}}


def test_size_ratio_and_centre_distance_over_the_right_thoughts_only():
    truth = {
        "a": scene("a", [10, 10, 30, 50], "the red square is at the top left"),
        "b": scene("b", [100, 100, 120, 120], "the blue circle is in the centre"),
    }
    rows = [
        row("a", "the red square is at the top left", [0, 0, 40, 60], 0.33),  # 2x wide, 1.5x tall, same centre
        row("b", "the red square is at the top left", [100, 100, 120, 120], 1.0),  # wrong thought: not measured
    ]
    report = heldout_boxes.box_report(rows, truth)
    assert report["right_thoughts"] == 1
    assert report["size_ratio"] == pytest.approx((2.0 + 1.5) / 2)
    assert report["centre_distance"] == pytest.approx(0.0)
    assert report["iou"] == pytest.approx((0.33 + 1.0) / 2)  # IoU over every row


def test_a_shifted_box_counts_its_centre_distance():
    truth = {"a": scene("a", [10, 10, 30, 30], "t")}
    report = heldout_boxes.box_report([row("a", "t", [13, 14, 33, 34], 0.5)], truth)
    assert report["size_ratio"] == pytest.approx(1.0) and report["centre_distance"] == pytest.approx(5.0)


def test_a_scene_without_a_reference_thought_has_no_right_thoughts():
    truth = {"a": Sample("grounding", "a", "Locate: it.", (), [10, 10, 30, 30], {})}
    report = heldout_boxes.box_report([row("a", "", [10, 10, 30, 30], 1.0)], truth)  # an empty thought is not "right"
    assert report["right_thoughts"] == 0
