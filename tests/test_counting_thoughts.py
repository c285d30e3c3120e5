"""scripts/counting_thoughts.py: how a counting thought's sum and first count compare with the picture."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "counting_thoughts.py"
spec = importlib.util.spec_from_file_location("counting_thoughts", SCRIPT)
counting_thoughts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(counting_thoughts)

OBJECTS = [
    {"shape": "circle", "colour": "red", "box": [0, 0, 5, 5]},
    {"shape": "circle", "colour": "red", "box": [10, 0, 15, 5]},
    {"shape": "square", "colour": "blue", "box": [20, 0, 25, 5]},
]
SUM_ROW = {"id": "t0", "objects": OBJECTS, "program": {"kind": "sum", "terms": [["red", "circle"], ["blue", "square"]]}}
ADD_ROW = {"id": "t1", "objects": OBJECTS, "program": {"kind": "add", "colour": "blue", "shape": "square", "add": 4}}
TOTAL_ROW = {"id": "t2", "objects": OBJECTS, "program": {"kind": "total"}}


def test_true_terms_come_from_the_pictures_objects():
    assert counting_thoughts.true_terms(SUM_ROW) == (2, 1)
    assert counting_thoughts.true_terms(ADD_ROW) == (1, 4)
    assert counting_thoughts.true_terms(TOTAL_ROW) is None


@pytest.mark.parametrize(("thought", "expected"), [
    ("<think>I count 2 red circles and 1 blue square: 2 + 1 = 3.</think>", ("right", "true")),
    ("<think>I count 2 red circles and 1 blue square: 2 + 1 = 2.</think>", ("slipped", "true")),
    ("<think>I count 3 red circles and 1 blue square: 3 + 1 = 3.</think>", ("slipped", "one high")),  # compensated
    ("<think>I count 5 red circles and 1 blue square: 5 + 1 = 9.</think>", ("wrong", "off")),
    ("<think>I count 1 red circle nowsss + 5 = 6.</think>", ("none", "none")),
])
def test_a_thought_is_classified_by_its_sum_and_its_first_count(thought, expected):
    assert counting_thoughts.classify(thought, (2, 1)) == expected


def test_the_report_covers_only_sum_and_add_problems():
    rows = {row["id"]: row for row in (SUM_ROW, ADD_ROW, TOTAL_ROW)}
    records = [
        {"id": "t0", "thought": "<think>I count 3 red circles and 1 blue square: 3 + 1 = 3.</think>", "parts": {"accuracy": 1.0}},
        {"id": "t1", "thought": "<think>I count 1 blue square now; 1 + 4 = 5.</think>", "parts": {"accuracy": 1.0}},
        {"id": "t2", "thought": "<think>I see 3 shapes.</think>", "parts": {"accuracy": 0.0}},
    ]
    figures = counting_thoughts.report(records, rows)
    assert figures["problems"] == 2 and figures["accuracy"] == 1.0
    assert figures["sum right"] == figures["sum slipped"] == 0.5
    assert figures["count true"] == figures["count one high"] == 0.5
