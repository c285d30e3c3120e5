"""Table tests for the shared parsers in vlm_grpo_ma/task_api/: well-formed and malformed model output."""

import math
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlm_grpo_ma.task_api import (
    clip_box,
    extract_tag,
    has_think_answer_format,
    iou,
    normalise_answer,
    order_corners,
    parse_box,
    parse_numbers,
    parse_points,
)

EXACT = 1e-9


@pytest.mark.parametrize(
    ("text", "tag", "expected"),
    [
        ("<answer>[1,2,3,4]</answer>", "answer", "[1,2,3,4]"),
        ("<think>a</think>\n<answer> B </answer>", "answer", " B "),  # content is not stripped
        ("<think>a</think><answer></answer>", "answer", ""),
        ("<think>a</think><answer>x</answer>", "think", "a"),
        ("no tags at all", "answer", None),
        ("<think>only a thought</think>", "answer", None),
        ("<answer>cut off by the token limit", "answer", None),
        ("</answer>closed before<answer>", "answer", None),
        ("<answer>1</answer><answer>2</answer>", "answer", None),  # two answers: neither is picked
        ("<answer>a\nb</answer>", "answer", "a\nb"),
    ],
)
def test_extract_tag(text, tag, expected):
    assert extract_tag(text, tag) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>x</think><answer>y</answer>", True),
        ("  \n<think>multi\nline</think>\n\n<answer>y</answer>\n", True),
        ("<think></think><answer></answer>", True),
        ("Sure! <think>x</think><answer>y</answer>", False),  # text before
        ("<think>x</think><answer>y</answer> done", False),  # text after
        ("<think>x</think> so <answer>y</answer>", False),  # text between
        ("<answer>y</answer><think>x</think>", False),  # wrong order
        ("<think>x</think>", False),
        ("<answer>y</answer>", False),
        ("<think>x</think><answer>y</answer><answer>z</answer>", False),
        ("<think>x<think>x</think><answer>y</answer>", False),
        ("<think>x</think><answer>y", False),  # truncated
        ("", False),
    ],
)
def test_has_think_answer_format(text, expected):
    assert has_think_answer_format(text) is expected


def test_parse_numbers_reads_signs_decimals_exponents_and_skips_identifiers():
    assert parse_numbers("x1=12, y1=-3.5, w=+.25, h=1e2, bbox_2d") == [12.0, -3.5, 0.25, 100.0]
    assert parse_numbers("12px wide") == [12.0]  # a unit after a number does not hide it
    assert parse_numbers("no numbers; information, banana") == []


def test_parse_numbers_non_finite_words_come_out_non_finite():
    values = parse_numbers("nan, -inf, Infinity, NaN, 1e999")
    assert math.isnan(values[0]) and math.isnan(values[3])
    assert values[1] == -math.inf and values[2] == math.inf and values[4] == math.inf


BOX = [12.0, 30.0, 80.0, 95.0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[12, 30, 80, 95]", BOX),
        ("(12,30,80,95)", BOX),
        ("12 30 80 95", BOX),
        (" 12, 30, 80, 95 ", BOX),
        ("[[12, 30, 80, 95]]", BOX),
        ("The box is [12, 30, 80, 95].", BOX),
        ("[12, 30, 80, 95] (the red circle)", BOX),  # bracketed words are not a second box
        ('{"bbox_2d": [12, 30, 80, 95]}', BOX),
        ('[{"bbox_2d": [12, 30, 80, 95], "label": "circle 2"}]', BOX),
        ('```json\n[\n  {"bbox_2d": [12, 30, 80, 95], "label": "the red circle"}\n]\n```', BOX),
        ('{"bbox_2d": [12, 30, 80, 95], "label": "x"', BOX),  # broken JSON still holds one bracketed box
        ("[80, 95, 12, 30]", [80.0, 95.0, 12.0, 30.0]),  # corners kept as written
        ("[-5, -3.5, 1e2, 2E1]", [-5.0, -3.5, 100.0, 20.0]),
        ("[12.5,30.25,80,95]", [12.5, 30.25, 80.0, 95.0]),
        # malformed
        ("", None),
        ("the red circle", None),
        ("[x1, y1, x2, y2]", None),
        ("[12, 30, eighty, 95]", None),
        ("[12, 30, 80]", None),
        ("[12, 30, 80, 95, 100]", None),
        ("[12, 30, 80, 95] [1, 2, 3, 4]", None),
        ("[[12, 30, 80, 95], [1, 2, 3, 4]]", None),
        ('[{"bbox_2d": [12, 30, 80, 95]}, {"bbox_2d": [1, 2, 3, 4]}]', None),
        ('{"bbox_2d": [12, 30, 80]}', None),
        ('{"label": "circle"}', None),
        ('{"bbox_2d": ["12", "30", "80", "95"]}', None),
        ('{"bbox_2d": [true, 30, 80, 95]}', None),
        ("[nan, 30, 80, 95]", None),
        ("[12, inf, 80, 95]", None),
        ("[12, 30, -Infinity, 95]", None),
        ('{"bbox_2d": [NaN, 30, 80, 95]}', None),
        ("[1e999, 30, 80, 95]", None),
        ("[1" + "0" * 400 + ", 30, 80, 95]", None),
        ('{"bbox_2d": [1' + "0" * 400 + ", 30, 80, 95]}", None),  # JSON int beyond float range
        ("box: 12, 30, 80, 95", None),  # bare numbers must be the whole text
        ("42", None),
        ("[12 30 80 95 px]", None),
    ],
)
def test_parse_box(text, expected):
    assert parse_box(text) == expected


def test_parse_box_is_total_on_odd_input():
    for text in ["[" * 5000, "(" * 3000 + ")" * 3000, "[" * 100000 + "]" * 100000, "\x00[1,2,3,4", None, 5]:
        parse_box(text)  # must not raise
    assert parse_box("\x00[1,2,3,4]") == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("(10, 20)", [(10.0, 20.0)]),
        ("[10, 20]", [(10.0, 20.0)]),
        ("10 20", [(10.0, 20.0)]),
        ("[(10, 20), (30.5, 40)]", [(10.0, 20.0), (30.5, 40.0)]),
        ("[[10, 20], [30, 40]]", [(10.0, 20.0), (30.0, 40.0)]),
        ('{"point_2d": [10, 20]}', [(10.0, 20.0)]),
        ('[{"point_2d": [10, 20], "label": "a"}, {"point_2d": [30, 40]}]', [(10.0, 20.0), (30.0, 40.0)]),
        ("", None),
        ("the cup handle", None),
        ("[10, 20, 30, 40]", None),  # a box, not two points
        ("[(10, 20), (30)]", None),
        ("[(10, nan)]", None),
        ("(x, y)", None),
        ('[{"point_2d": [10, 20]}, {"label": "a"}]', None),
    ],
)
def test_parse_points(text, expected):
    assert parse_points(text) == expected


@pytest.mark.parametrize(
    ("box_a", "box_b", "expected"),
    [
        ([0, 0, 10, 10], [5, 5, 15, 15], 25 / 175),
        ([0, 0, 10, 10], [0, 0, 10, 10], 1.0),
        ([10, 10, 0, 0], [0, 0, 10, 10], 1.0),  # corners sorted first
        ([10, 0, 0, 10], [5, 5, 15, 15], 25 / 175),
        ([0, 0, 10, 10], [0, 0, 10, 20], 100 / 200),
        ([0, 0, 10, 10], [2, 2, 4, 4], 4 / 100),  # contained
        ([0, 0, 10, 10], [10, 0, 20, 10], 0.0),  # touching edges
        ([0, 0, 10, 10], [20, 20, 30, 30], 0.0),
        ([-10, -10, 0, 0], [-5, -5, 5, 5], 25 / 175),
        ([0, 0, 0.5, 0.5], [0.25, 0.25, 0.75, 0.75], 0.0625 / 0.4375),
        ([0, 0, 0, 10], [0, 0, 0, 10], 0.0),  # zero area
        ([5, 5, 5, 5], [0, 0, 10, 10], 0.0),
        ([0, 0, math.nan, 10], [0, 0, 10, 10], 0.0),
        ([0, 0, math.inf, 10], [0, 0, 10, 10], 0.0),
        ([0, 0, 1e308, 1e308], [0, 0, 1e308, 1e308], 0.0),  # area overflows to inf
        ([0, 0, 10], [0, 0, 10, 10], 0.0),
    ],
)
def test_iou(box_a, box_b, expected):
    assert iou(box_a, box_b) == pytest.approx(expected, abs=EXACT, rel=0)
    assert iou(box_b, box_a) == pytest.approx(expected, abs=EXACT, rel=0)


def test_order_corners_and_clip_box():
    assert order_corners([80, 95, 12, 30]) == [12.0, 30.0, 80.0, 95.0]
    assert clip_box([-5, -3, 200, 90], 168, 100) == [0.0, 0.0, 168.0, 90.0]
    assert clip_box([200, 300, 250, 400], 168, 168) == [168.0, 168.0, 168.0, 168.0]  # zero area
    assert clip_box([1.5, 2.5, 3.5, 4.5], 168, 168) == [1.5, 2.5, 3.5, 4.5]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Red Circle.", "red circle"),
        ("  a   dog ", "dog"),
        ("An apple!", "apple"),
        ("2.5", "2.5"),
        ("It costs 2.5.", "it costs 2.5"),
        ("1,000", "1000"),
        ("Yes", "yes"),
        ("theatre", "theatre"),  # article only as a whole word
        ("", ""),
        ("(B)", "b"),
    ],
)
def test_normalise_answer(text, expected):
    assert normalise_answer(text) == expected


# ---------------------------------------------------------------------------------------------- linear time
# Every parser must take time linear in its input. Each case below is long adversarial model output that made
# an earlier regex backtrack (the box with three 150-space gaps took 15 s; 1,000-space gaps never ended). A
# regex does not release the GIL, so a thread cannot time it out: the cases run in one child process, one
# after another, and a case that prints no result within CASE_LIMIT_S is killed and reported. Linear code
# takes at most ~30 ms on any of them; the old code took seconds to forever.

CASE_LIMIT_S = 1.0
REPO = Path(__file__).resolve().parents[1]
N = 10_000  # a gap of spaces
LONG = 100_000  # a run of characters

ADVERSARIAL = {
    # the case, at 10,000 spaces per gap, with brackets and bare
    "box_three_gaps": "parse_box('[1' + (' ' * N + '2') * 2 + ' ' * N + 'x]')",
    "box_three_gaps_bare": "parse_box('1' + (' ' * N + '2') * 2 + ' ' * N + 'x')",
    "points_three_gaps": "parse_points('(1' + ' ' * N + ',' + ' ' * N + '2' + ' ' * N + ',x)')",
    "box_digit_run": "parse_box('[' + '1' * LONG + ']')",
    "box_digit_space_run": "parse_box('[' + '1 ' * (LONG // 2) + ']')",
    "box_digit_comma_space_run": "parse_box('[' + '1, ' * (LONG // 3) + ']')",
    "points_comma_run": "parse_points('(' + ',' * LONG + ')')",
    "nested_brackets": "parse_box('[' * (LONG // 2) + '1, 2, 3, 4' + ']' * (LONG // 2))",
    "open_brackets": "parse_points('([' * (LONG // 2))",
    "fence_then_spaces": "parse_box('```' + ' ' * LONG + 'x')",
    "fence_both_sides": "parse_box('```json' + ' ' * LONG + '[1, 2, 3, 4' + ' ' * LONG + '```')",
    "numbers_exponents": "parse_numbers('1e' * (LONG // 2))",
    "numbers_dots": "parse_numbers('1.1.' * (LONG // 4))",
    "think_answer_spaces": "has_think_answer_format('<think>' + ' ' * LONG + '</think>' + ' ' * LONG + '<answer>x</answer>' + ' ' * LONG + 'y')",
    "normalise_long": "normalise_answer('a. the ' * (LONG // 7))",
    "code_fence_blanks": "extract_program('<answer>```' + ' \\t' * (LONG // 2) + '</answer>')",
    "code_fence_tag_run": "extract_program('<answer>' + '```py' * (LONG // 5) + '</answer>')",
    "math_unit_text": "plain_number('5 \\\\text{' + ' ' * LONG)",
    "math_equals_spaces": "plain_number('x =' + ' ' * LONG + 'a')",
    "math_dollar_spaces": "plain_number('$' + ' ' * LONG + 'a')",
    "math_degree_spaces": "plain_number('5^' + ' ' * N + '{' + ' ' * N)",
    "math_units": "plain_number('5' + ' cm' * (LONG // 3) + '!')",
    "math_reward_long_answer": "is_equivalent('1 ' * (LONG // 2), '2')",
    "math_screen_factorials": "safe_for_math_verify('1 ' * 90 + '!' * 20)",
    "vqa_number": "as_number('1' * LONG + '/')",
    "vqa_fraction_spaces": "as_number('1' + ' ' * LONG + '/' + ' ' * LONG + 'x')",
    "vqa_options": "chosen_options('(B) ' + ' ' * LONG + 'x', ['a', 'b'])",
}

_RUNNER = """
import sys, time
from vlm_grpo_ma.task_api import parse_box, parse_points, parse_numbers, has_think_answer_format, normalise_answer
from tasks.code import extract_program
from tasks.math import plain_number, is_equivalent, safe_for_math_verify
from tasks.vqa import as_number, chosen_options
N, LONG = {N}, {LONG}
print("ready", 0, flush=True)
for name, expression in {cases!r}:
    started = time.perf_counter()
    eval(expression)
    print(name, time.perf_counter() - started, flush=True)
"""


def _time_cases(cases: dict[str, str]) -> dict[str, float]:
    """Seconds each case took, or inf for one killed after CASE_LIMIT_S (the rest then run in a new child)."""
    times: dict[str, float] = {}
    pending = list(cases.items())
    while pending:
        code = _RUNNER.format(N=N, LONG=LONG, cases=pending)
        child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            # the imports are not timed ("ready" follows them); each case then has CASE_LIMIT_S (plus a margin)
            ready_line = child.stdout.readline() if select.select([child.stdout], [], [], 30.0)[0] else ""
            assert ready_line.startswith("ready"), "the parser modules did not import"
            deadline = time.monotonic() + CASE_LIMIT_S + 0.5
            while pending:
                ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = child.stdout.readline() if ready else ""
                if not line:
                    times[pending.pop(0)[0]] = float("inf")
                    break
                name, seconds = line.split()
                times[name] = float(seconds)
                pending.pop(0)
                deadline = time.monotonic() + CASE_LIMIT_S + 0.5
        finally:
            child.kill()
            child.wait()
    return times


@pytest.fixture(scope="module")
def adversarial_times():
    return _time_cases(ADVERSARIAL)


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_parsers_take_linear_time_on_adversarial_input(case, adversarial_times):
    assert adversarial_times[case] < CASE_LIMIT_S, (case, ADVERSARIAL[case], adversarial_times[case])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the group grammar read by tokens: whitespace and/or one comma between numbers, one trailing comma
        ("[1" + " " * 500 + "2" + " " * 500 + "3" + " " * 500 + "4]", [1.0, 2.0, 3.0, 4.0]),
        ("[1 ,2 , 3,4 ,]", [1.0, 2.0, 3.0, 4.0]),
        ("[ 1,\n2,\t3, 4 ]", [1.0, 2.0, 3.0, 4.0]),
        ("[1,,2,3,4]", None),  # two commas in one gap
        ("[,1,2,3,4]", None),  # a leading comma
        ("[1,2,3,4,,]", None),
        ("[1-2,3,4]", None),  # "1" and "-2" with no separator
        ("[1.5.5,2,3,4]", None),
        ("[1,2,3,4,5]", None),
        ("[1e2, -2.5, +3, .5]", [100.0, -2.5, 3.0, 0.5]),
        ("```json   [1, 2, 3, 4]   ```", [1.0, 2.0, 3.0, 4.0]),
        ("```[1, 2, 3, 4]```", [1.0, 2.0, 3.0, 4.0]),
        ("```", None),
    ],
)
def test_box_group_grammar(text, expected):
    assert parse_box(text) == expected
