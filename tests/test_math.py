"""The math task: reward tables (equivalent forms, precision, units, malformed and hostile output), the
math-verify screen, answer forms (negations, hedges, lists; the grammar's own tables are in
tests/test_math_grammar.py), matrices, loaders for each public schema, the embedded data, the generator."""

import gc
import importlib.util
import itertools
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from PIL import Image

from tasks import math as math_task
from vlm_grpo_ma.task_api.registry import Completion, Sample, count_load_skips, get_task

EXACT = 1e-12
REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "math"
DATA_DIR = REPO / "data" / "math"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_math", REPO / "data" / "make_math.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


make_math = _load_generator()


def _sample(answer="5", precision=None, answer_type=None) -> Sample:
    meta = {"source": "project", "precision": precision}
    if answer_type is not None:
        meta["answer_type"] = answer_type
    return Sample(task="math", id="m0", question="q", images=(), answer=answer, meta=meta)


def _completion(text: str) -> Completion:
    # Split where the policy would: the thought runs up to and including "</think>".
    cut = text.index("</think>") + len("</think>") if "</think>" in text else len(text)
    return Completion(thought=text[:cut], answer=text[cut:])


def _expected(correct: bool, format_ok: bool) -> dict:
    return {
        "accuracy": float(correct),
        "format": float(format_ok),
        "reward": 1.0 * float(correct) + 0.5 * float(format_ok),
    }


def _assert_parts(parts, expected):
    assert set(parts) == set(expected)
    for name, value in expected.items():
        assert parts[name] == pytest.approx(value, abs=EXACT, rel=0), name


T = "<think>three and two make five</think>"


def _answer(text):
    return f"{T}<answer>{text}</answer>"


# ---------------------------------------------------------------------------------------------- reward tables

# (id, model answer, ground truth, precision, correct)
EQUIVALENCE_TABLE = [
    # equivalent forms
    ("integer", "5", "5", None, True),
    ("trailing zeros", "5.00", "5", None, True),
    ("explicit plus", "+5", "5", None, True),
    ("unicode minus", "−3", "-3", None, True),
    ("half as fraction", "1/2", "0.5", None, True),
    ("half as latex", "\\frac{1}{2}", "0.5", None, True),
    ("half as dfrac", "\\dfrac{1}{2}", "1/2", None, True),
    ("half as frac12", "\\frac12", "\\frac{1}{2}", None, True),
    ("decimal for fraction truth", "0.25", "1/4", None, True),
    ("surd forms", "\\sqrt{884}", "2\\sqrt{221}", None, True),
    ("pi over two", "\\pi/2", "\\frac{\\pi}{2}", None, True),
    ("thousands separator", "1,000", "1000", None, True),
    ("scientific notation", "1e3", "1000", None, True),
    ("equation", "x = 5", "5", None, True),
    ("latex equation", "x=\\frac{1}{2}", "0.5", None, True),
    ("list", "[1, 2, 3]", "[1,2,3]", None, True),
    ("set in another order", "3, 2, 1", "1, 2, 3", None, True),
    # \boxed and other wrappers
    ("boxed", "\\boxed{5}", "5", None, True),
    ("boxed fraction in dollars", "$\\boxed{\\frac{1}{2}}$", "0.5", None, True),
    ("inline math", "\\(5\\)", "5", None, True),
    ("display math", "$$\\frac{3}{4}$$", "0.75", None, True),
    ("final period", "5.", "5", None, True),
    # units and symbols are dropped
    ("unit word", "5 cm", "5", None, True),
    ("unit words", "12 apples", "12", None, True),
    ("squared unit", "5 cm^2", "5", None, True),
    ("text unit", "5\\text{ cm}", "5", None, True),
    ("mathrm unit", "5 \\mathrm{cm}^2", "5", None, True),
    ("degrees latex", "45^\\circ", "45", None, True),
    ("degree sign", "45°", "45", None, True),
    ("dollars", "$5", "5", None, True),
    ("escaped dollars", "\\$5", "5", None, True),
    ("percent", "50%", "50", None, True),
    # precision (MathVista's decimals): both sides rounded half-up
    ("precision: more decimals", "1.4523", "1.45", 2, True),
    ("precision: rounds up to truth", "1.449", "1.45", 2, True),
    ("precision: half rounds up", "1.445", "1.45", 2, True),
    ("precision: off by one unit", "1.444", "1.45", 2, False),
    ("precision: rounds away", "1.455", "1.45", 2, False),
    ("precision: exact fraction", "\\frac{29}{20}", "1.45", 2, True),
    ("precision: truth needs rounding", "1.88", "1.875", 2, True),
    ("precision: one decimal", "10.77", "10.8", 1, True),
    ("precision: fraction vs rounded", "20/3", "6.67", 2, True),
    ("no precision: rounded is wrong", "6.67", "20/3", None, False),
    ("no precision: decimals differ", "3.14159", "3.14", None, False),
    ("no precision: third not 0.3333", "0.3333", "1/3", None, False),
    # wrong answers
    ("wrong integer", "6", "5", None, False),
    ("wrong fraction", "1/3", "0.5", None, False),
    ("wrong surd", "3", "2\\sqrt{221}", None, False),
    ("wrong equation", "x = 6", "5", None, False),
    ("last number of a list is not the answer", "1, 2, 3", "3", None, False),
    ("missing element", "1, 2", "1, 2, 3", None, False),
    ("two numbers", "5 or 6", "5", None, False),
    ("prose with two numbers", "It is 5, not 6", "5", None, False),
    # text answers
    ("text", "Bread.", "bread", None, True),
    ("text wrong", "butter", "bread", None, False),
    # malformed and hostile: never right, never an error
    ("division by zero", "\\frac{1}{0}", "5", None, False),
    ("nan", "nan", "5", None, False),
    ("inf", "inf", "5", None, False),
    ("minus infinity", "-\\infty", "5", None, False),
    ("overflowing literal", "1e999", "5", None, False),
    ("10,000 digits", "9" * 10_000, "9", None, False),
    ("10,000 digits of the truth", "5" + "0" * 9_999, "5", None, False),
    ("unbalanced latex", "\\frac{1}{2}}{", "0.5", None, False),
    ("lone command", "\\frac", "5", None, False),
    ("empty boxed", "\\boxed{}", "5", None, False),
    ("dollar signs only", "$$$$", "5", None, False),
    ("carets", "^^^^", "5", None, False),
    ("control characters", "\x00\uffff", "5", None, False),
    ("power tower", "9^{9^{9^{9}}}", "5", None, False),
    ("huge factorial", "(10^{10})!", "5", None, False),
    ("huge binomial", "\\binom{10^{10}}{10^{5}}", "5", None, False),
    ("symbolic expansion", "(a+b+c+d)^{99}", "5", None, False),
    ("deep braces", "{" * 5000 + "5" + "}" * 5000, "5", None, False),
    ("deep parentheses", "(" * 2000 + "5" + ")" * 2000, "5", None, False),
    # refused by the screen, still read as the number in its redundant brackets (rule 5)
    ("nested parentheses fallback", "((((((5))))))", "5", None, True),
    # a lead phrase of the grammar (tasks/_math_grammar.py) before the answer
    ("prose fallback", "The answer is 12", "12", None, True),
    ("prose fallback wrong", "The answer is 13", "12", None, False),
    ("prose fallback with precision", "It is about 1.4523 cm", "1.45", 2, True),
]


@pytest.mark.parametrize(
    ("prediction", "truth", "precision", "correct"),
    [row[1:] for row in EQUIVALENCE_TABLE],
    ids=[row[0] for row in EQUIVALENCE_TABLE],
)
def test_reward_table(prediction, truth, precision, correct):
    parts = math_task.reward(_completion(_answer(prediction)), _sample(truth, precision))
    # every answer in the table is in one well-formed answer tag and is not blank
    _assert_parts(parts, _expected(correct, True))


# (id, model answer, ground truth, precision, correct): matrices, vectors and tuples. A matrix's environment name
# ("pmatrix") is not seven free variables, so math-verify compares the matrices.
I2 = "\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}"
STRUCTURE_TABLE = [
    ("identity matrix against itself", I2, I2, None, True),
    ("identity as bmatrix", I2.replace("pmatrix", "bmatrix"), I2, None, True),
    ("matrix with a fraction", "\\begin{pmatrix}\\frac{1}{2} & 0 \\\\ 0 & 1\\end{pmatrix}",
     "\\begin{pmatrix}0.5 & 0 \\\\ 0 & 1\\end{pmatrix}", None, True),
    ("different matrix", "\\begin{pmatrix}1 & 0 \\\\ 0 & 2\\end{pmatrix}", I2, None, False),
    ("permuted matrix", "\\begin{pmatrix}0 & 1 \\\\ 1 & 0\\end{pmatrix}", I2, None, False),
    ("column vector", "\\begin{pmatrix}1 \\\\ 2\\end{pmatrix}", "\\begin{pmatrix}1 \\\\ 2\\end{pmatrix}", None, True),
    ("column vector reversed", "\\begin{pmatrix}2 \\\\ 1\\end{pmatrix}", "\\begin{pmatrix}1 \\\\ 2\\end{pmatrix}", None, False),
    ("row for column", "\\begin{pmatrix}1 & 2\\end{pmatrix}", "\\begin{pmatrix}1 \\\\ 2\\end{pmatrix}", None, False),
    ("a number for a matrix", "1", I2, None, False),
    ("tuple", "(1, 2)", "(1, 2)", None, True),
    ("tuple spacing", "(1,2,3)", "(1, 2, 3)", None, True),
    ("tuple reversed", "(2, 1)", "(1, 2)", None, False),
    ("tuple with a fraction", "(\\frac{1}{2}, 3)", "(0.5, 3)", None, True),
    ("tuple for a number", "(6, 6)", "6", None, False),
]

# (id, model answer, ground truth, precision, correct): answers whose form says they are not the answer, and
# the accepted forms next to them that must keep passing.
FORM_TABLE = [
    ("negated in prose", "the answer is not 6", "6", None, False),
    ("negated", "not 6", "6", None, False),
    ("isn't", "it isn't 6", "6", None, False),
    ("neq", "x \\neq 6", "6", None, False),
    ("ne", "\\ne 6", "6", None, False),
    ("not-equal sign", "x ≠ 6", "6", None, False),
    ("repeated value", "6, 6", "6", None, False),
    ("repeated value, no space", "6,6", "6", None, False),
    ("repeated with and", "6 and 6", "6", None, False),
    ("two values with semicolon", "6; 6", "6", None, False),
    ("approx for an exact answer", "\\approx 6", "6", None, False),
    ("approx sign", "≈ 6", "6", None, False),
    # issue 23: negations, relations between values, logic and split math spans that graded as right
    ("neg", "\\neg 6", "6", None, False),
    ("not sign", "¬6", "6", None, False),
    ("text is wrong", "6 \\text{ is wrong}", "6", None, False),
    ("text is false", "6 \\text{ is false}", "6", None, False),
    ("logical or", "x=5 \\lor x=6", "6", None, False),
    ("equation between values", "5 = 6", "6", None, False),
    ("congruence", "5 \\equiv 6", "6", None, False),
    ("two math spans", "5$ $6", "6", None, False),
    ("about", "about 6", "6", None, False),
    ("tilde", "~6", "6", None, False),
    ("approximately after", "6 (approximately)", "6", None, False),
    ("approx of an irrational", "\\approx 6.28", "2\\pi", None, False),
    # accepted: an approximate truth (a precision, or a truth that hedges itself), and the plain forms
    ("approx with a precision", "\\approx 6.28", "6.28", 2, True),
    ("about with a precision", "about 1.4523", "1.45", 2, True),
    ("approx against an approx truth", "\\approx 6.28", "\\approx 6.28", None, True),
    ("plain", "6", "6", None, True),
    ("equation", "x = 6", "6", None, True),
    ("equation with a subscript", "x_1 = 6", "6", None, True),
    ("equation with a greek name", "\\theta = 6", "6", None, True),
    ("price", "$6", "6", None, True),
    ("equation truth", "y = 2x + 1", "y = 2x + 1", None, True),
    ("prose", "The answer is 6", "6", None, True),
    ("contraction in the lead", "it's 6", "6", None, True),  # "I think it's 6" hedges: tests/test_math_grammar.py
    ("unit", "6 apples", "6", None, True),
    ("thousands comma", "6,000", "6000", None, True),
    ("thousands comma in latex", "\\boxed{6,000}", "6000", None, True),
    ("tilde as a latex space", "6~\\text{cm}", "6", None, True),
    ("set of one", "\\{6\\}", "6", None, True),
    ("list truth listed", "6, 7", "6, 7", None, True),
    ("list truth in another order", "7, 6", "6, 7", None, True),
    ("negated truth", "x \\neq 6", "x \\neq 6", None, True),
    ("text truth no", "No", "no", None, True),
]


@pytest.mark.parametrize(
    ("prediction", "truth", "precision", "correct"),
    [row[1:] for row in STRUCTURE_TABLE + FORM_TABLE],
    ids=[row[0] for row in STRUCTURE_TABLE + FORM_TABLE],
)
def test_structure_and_form_table(prediction, truth, precision, correct):
    parts = math_task.reward(_completion(_answer(prediction)), _sample(truth, precision))
    _assert_parts(parts, _expected(correct, True))


FORMAT_TABLE = [
    ("perfect", _answer("5"), _expected(True, True)),
    ("whitespace around tags", "\n " + T + "\n<answer> 5 </answer>\n", _expected(True, True)),
    ("wrong but well formed", _answer("4"), _expected(False, True)),
    # graded without the think part or with text around, but the format part is lost
    ("answer without think", "<answer>5</answer>", _expected(True, False)),
    ("text before", "Sure! " + _answer("5"), _expected(True, False)),
    ("text after", _answer("5") + " Done.", _expected(True, False)),
    ("two think tags", T + _answer("5"), _expected(True, False)),
    # no single non-blank answer tag: nothing to grade, no format
    ("no tags", "5", _expected(False, False)),
    ("only think", "<think>5</think>", _expected(False, False)),
    ("empty answer", _answer(""), _expected(False, False)),
    ("blank answer", _answer("  \n "), _expected(False, False)),
    ("truncated answer", T + "<answer>5", _expected(False, False)),
    ("two answer tags", T + "<answer>5</answer><answer>5</answer>", _expected(False, False)),
    ("answer closed before opened", T + "</answer>5<answer>", _expected(False, False)),
    ("nested tags", "<think><answer>5</answer></think>", _expected(True, False)),
    ("empty", "", _expected(False, False)),
]


@pytest.mark.parametrize(
    ("text", "expected"), [row[1:] for row in FORMAT_TABLE], ids=[r[0] for r in FORMAT_TABLE]
)
def test_format_table(text, expected):
    _assert_parts(math_task.reward(_completion(text), _sample("5")), expected)


def test_text_answer_type_compares_text_even_for_numbers_in_words():
    sample = _sample("red", answer_type="text")
    assert math_task.reward(_completion(_answer("Red")), sample)["accuracy"] == 1.0
    assert math_task.reward(_completion(_answer("red circle")), sample)["accuracy"] == 0.0
    # a numeric-looking truth marked as text is still compared as text
    assert math_task.is_equivalent("1/2", "0.5", as_text=True) is False


def test_reward_never_raises_on_garbage():
    garbage = ["<answer>", "</answer><answer>", "<answer>" + "\\frac{" * 3000 + "</answer>", "[" * 10000]
    garbage += [_answer("\\" * 500), _answer("{" * 150 + "}" * 150), _answer("$" * 201), _answer("𝑥²=ⅈ")]
    garbage += [_answer("9" * 40 + "^{99}"), _answer("\\sin(" + "9" * 20 + "^{99})"), _answer("0^{-1}")]
    for text in garbage:
        parts = math_task.reward(_completion(text), _sample("5"))
        assert set(parts) == {"reward", "accuracy", "format"}
        assert parts["accuracy"] == 0.0 and parts["reward"] in (0.0, 0.5)


def test_prediction_is_the_stripped_answer():
    assert math_task.prediction(_completion(_answer("  \\frac{1}{2} ")), _sample()) == "\\frac{1}{2}"
    assert math_task.prediction(_completion(_answer("  ")), _sample()) is None
    assert math_task.prediction(_completion("5"), _sample()) is None


def test_task_is_registered():
    task = get_task("math")
    assert task is math_task.TASK
    assert task.load is math_task.load and task.reward is math_task.reward
    assert task.metrics == ("accuracy", "format", "right_thought")
    assert task.reward_weights == {"accuracy": 1.0, "format": 0.5}
    assert task.success == "accuracy" and task.parse is math_task.prediction
    assert "<think></think>" in task.instruction and "<answer></answer>" in task.instruction


# ---------------------------------------------------------------------------------------------- the guard

HOSTILE = [
    "9^{9^{9^{9}}}",
    "(10^{10})!",
    "\\binom{10^{10}}{10^{5}}",
    "(a+b+c+d)^{99}",
    "(a+b+c+d+e+f)^{9}",
    "(a+b+c+d+e+f)" * 9,
    "(a+b+c)" * 28,
    "\\sin(" + "9" * 20 + "^{99})",
    "((10^{99})^{99})^{99}",
    "9^9^9^9",
    "2**1000000000",
    "\\sum_{n=1}^{10^{9}} n!",
    "{" * 5000 + "1" + "}" * 5000,
    "(" * 2000 + "1" + ")" * 2000,
    "9" * 10_000,
    "\\frac{1}{0}",
    "99999999999999999999!",
    # numbers that sympy's simplify expands for seconds or minutes (each passes the screen)
    "\\cos(\\frac{4\\pi}{99})^{99}",  # 430 s
    "\\cos(\\frac{4\\pi}{99})^{30}",  # 9 s
    "(\\sqrt{2}+\\sqrt{3}+\\sqrt{5}+\\sqrt{7})^{99}",  # 50 s
    "(\\sin1+\\cos2+\\tan3+\\cot4+\\sec5+\\csc6)^{3}",  # 7 s
    "(\\pi+\\sqrt2+\\sqrt3)(\\pi+\\sqrt5+\\sqrt7)(\\pi+\\sqrt{11}+\\sqrt{13})(\\pi+\\sqrt{17}+\\sqrt{19})"
    "(\\pi+\\sqrt{23}+\\sqrt{29})(\\pi+\\sqrt{31}+\\sqrt{37})",  # 4 s
    # issue 23: passed the screen and ran until the reward's deadline
    "\\Gamma(\\Gamma(\\Gamma(5)))",
    "\\binom{99999999999999999999}{9999999999}",
    "\\lfloor\\exp(\\exp(22))\\rfloor",
]
# Issue 34: a fast-growing function of a power, a factorial or a product, or beside a power, passed the screen
# and ran for seconds or until the deadline. Each with a truth that has the same function, so that the grammar
# lets it through to the screen, which must refuse it.
GROWING_HOSTILE = [
    ("\\Gamma(10^{99})", "\\Gamma(4)"),  # (10^99 - 1)!: never finished
    ("\\Gamma(99!)", "\\Gamma(4)"),  # never finished
    ("\\Gamma(99 \\cdot 99 \\cdot 99)", "\\Gamma(4)"),  # 970298!
    ("\\exp(9^{99})", "\\exp(4)"),
    ("\\sinh(10^{10})", "\\sinh(4)"),  # never finished
    ("\\csch(10^{99})", "\\csch(4)"),  # never finished
    ("\\lfloor\\sinh(99)^{99}\\rfloor", "\\sinh(4)"),  # past 5 s
    ("\\cosh(99)^{99}", "\\cosh(4)"),  # 1.1-2.7 s
    ("\\Gamma(99)^{99}", "\\Gamma(4)"),
    ("\\lfloor\\exp(99)^{99}\\rfloor", "\\exp(4)"),  # in WORST_SCREENED before issue 34
    ("\\exp(99) \\cdot 99!", "\\exp(4)"),  # 0.9 s
    ("\\exp(\\sqrt{99})", "\\exp(4)"),  # 0.9 s
    ("\\operatorname{Gamma}(10^{99})", "\\operatorname{Gamma}(4)"),
]
# The slowest answers found that the screen lets through to math-verify (see the limits in
# tasks/_math_grammar.py).
WORST_SCREENED = [
    "\\exp(99)",
    "\\lfloor\\exp(\\frac{9}{2})\\rfloor",
    "\\Gamma(99)",
    "\\binom{9999}{5000}",
    "\\sin(999^{99})",
    # issue 34: the slowest we found under the new rules for fast-growing functions (0.1-0.5 s, busy 2 cores)
    "\\Gamma(99 99)",
    "\\lfloor\\sinh(99 99)\\rfloor",
    "\\tan(\\Gamma(99))",
    "\\sin(\\exp(99))",
    "\\frac{1}{\\sin(\\Gamma(99 99))}",
]


@pytest.fixture(scope="module")
def warm_math_verify():
    # import math-verify and load its LaTeX grammar (about a second), and evaluate numbers once (the first
    # numeric check costs 0.1 s more than the next), before anything is measured
    _warm()


def _warm() -> None:
    # import math-verify and load its LaTeX grammar (about a second), and evaluate numbers once (the first
    # numeric check costs 0.1 s more than the next), before anything is measured
    assert math_task.is_equivalent("\\frac{1}{2}", "0.5")
    assert not math_task.is_equivalent("\\pi+\\sqrt{2}", "5")


def _in_fresh_process(check) -> None:
    """Run ``check`` (a function of this module) in a fresh Python process, after ``_warm``: what grading costs
    there is its own, while in the test session one hostile product measured 0.45 s of CPU where it costs 0.015 s
    alone (the session's state: its millions of objects for the garbage collector, its threads)."""
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    code = f"import sys; sys.path[:0] = {paths!r}; import test_math; test_math._warm(); test_math.{check.__name__}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=paths[1])
    assert done.returncode == 0, done.stderr[-3000:]


# What grading costs is measured as the grading thread's CPU time (time.thread_time: the process's would count
# other threads of the test session, such as torch's OpenMP workers spinning), which other processes on a
# loaded machine do not stretch as they stretch wall-clock time, against a reference measured in the same
# test: an ordinary answer graded through math-verify (issue 45: no wall-clock limits). The costliest answers
# the guard lets through cost 10-40 ordinary ones (\cos(\frac{4\pi}{99})^{99}: 0.1 s, against 0.002-0.005 s);
# the cheapest blow-up it stops costs 1,000 (the product of roots in HOSTILE without _numerically_apart:
# 2.3 s; what the screen refuses never finishes, or for seconds). The limit sits between, 4 times from each.
ORDINARY = 150
_fresh = itertools.count(7)


def _parses() -> int:
    """How many texts math-verify has been asked to parse in this process (``_parsed``'s calls)."""
    info = math_task._parsed.cache_info()
    return info.hits + info.misses


def _ordinary_cost() -> float:
    """CPU seconds to grade one ordinary answer through math-verify: texts never graded before (no cache holds
    them), the least of 3 rounds of 5 (the first of a kind and garbage collection cost more)."""
    rounds = []
    for _ in range(3):
        answers = [f"\\frac{{3}}{{4}}+\\frac{{1}}{{{next(_fresh)}}}" for _ in range(5)]
        started = time.thread_time()
        for answer in answers:
            math_task.reward(_completion(_answer(answer)), _sample("5"))
        rounds.append((time.thread_time() - started) / len(answers))
    return min(rounds)


def _reward_accuracy(answer: str, truth: str) -> float:
    return math_task.reward(_completion(_answer(answer)), _sample(truth))["accuracy"]


def _grade(answers, truth, grade=_reward_accuracy) -> dict:
    """``{answer: (verdict, CPU seconds, texts parsed)}`` for each answer graded against ``truth`` by
    ``grade(answer, truth)``, and ``None: the ordinary cost`` measured alongside."""
    # The garbage collector's passes over the test session's objects (millions, once vLLM and the models have
    # loaded) would be charged to whichever answer allocates when one starts: 30x a grade's own cost on CI. The
    # session's objects are set aside (gc.freeze) while grading is measured, so only what grading makes is scanned.
    gc.collect()
    gc.freeze()
    try:
        graded = {None: _ordinary_cost()}
        for answer in answers:
            parses, started = _parses(), time.thread_time()
            verdict = grade(answer, truth)
            graded[answer] = (verdict, time.thread_time() - started, _parses() - parses)
    finally:
        gc.unfreeze()
    return graded


def _assert_wrong_and_cheap(graded: dict) -> None:
    """Every answer graded wrong (accuracy 0, or False: not None), one parse a side at most and none for an
    answer the screen refuses, at most ORDINARY ordinary answers' cost."""
    ordinary = graded.pop(None)
    assert {answer: verdict for answer, (verdict, _, _) in graded.items() if verdict is None or verdict != 0} == {}
    overparsed = {
        answer: parses
        for answer, (_, _, parses) in graded.items()
        if parses > 2 or (parses and not math_task.safe_for_math_verify(answer))
    }
    assert not overparsed
    costly = {answer: seconds for answer, (_, seconds, _) in graded.items() if seconds > ORDINARY * ordinary}
    assert not costly, (ordinary, costly)


def test_hostile_answers_cost_little_in_the_main_thread(warm_math_verify):
    """Planted, each alone (the answers that then never finish left out): math_verify_equal without
    _numerically_apart (the sums, products and powers of roots and cosines cost 1,000-10,000 ordinary
    answers); without the screen (the answers it refuses were parsed; (a+b+c+d+e+f)^{9} cost 4.8 s)."""
    _in_fresh_process(_hostile_answers_cost_little)


def _hostile_answers_cost_little():
    _assert_wrong_and_cheap(_grade(HOSTILE, "5"))


def test_slow_forms_are_refused_or_cost_little(warm_math_verify):
    """Planted: _numerically_apart evaluating to 30,000 digits, not 30 (\\sin(999^{99}): 0.7 s, 300 ordinary
    answers)."""
    _in_fresh_process(_slow_forms_cost_little)


def _slow_forms_cost_little():
    _assert_wrong_and_cheap(_grade(HOSTILE[-3:] + WORST_SCREENED, "6"))


def test_the_worst_screened_answers_reach_math_verify():
    assert [math_task.safe_for_math_verify(answer) for answer in WORST_SCREENED] == [True] * len(WORST_SCREENED)


def test_the_worst_screened_answers_cost_math_verify_little(warm_math_verify):
    """math-verify itself, past the grammar (which refuses \\Gamma and \\exp unless the truth has them). Planted:
    _numerically_apart evaluating to 30,000 digits, not 30 (four answers cost 280 ordinary ones)."""
    _in_fresh_process(_worst_screened_cost_little)


def _worst_screened_cost_little():
    graded = _grade(WORST_SCREENED, "6", grade=math_task.math_verify_equal)
    assert {answer: graded[answer][2] for answer in WORST_SCREENED} == dict.fromkeys(WORST_SCREENED, 2)
    _assert_wrong_and_cheap(graded)


@pytest.mark.parametrize(("answer", "truth"), GROWING_HOSTILE, ids=[row[0] for row in GROWING_HOSTILE])
def test_fast_growing_functions_of_powers_are_refused_by_the_screen(answer, truth, warm_math_verify):
    # the grammar lets it through (the truth has its function): the screen alone must refuse it, and the
    # reward then hands it to math-verify not at all (a count of the work, not a wall-clock limit: issue 45)
    assert math_task.refusal(math_task.read_answer(answer), math_task.read_answer(truth), False) is None
    assert math_task.safe_for_math_verify(answer) is False
    parses = _parses()
    parts = math_task.reward(_completion(_answer(answer)), _sample(truth))
    assert _parses() == parses
    _assert_parts(parts, _expected(False, True))
    assert parts["accuracy"] == 0.0


def test_hostile_answers_cost_little_in_another_thread(warm_math_verify):
    # no guard of the grader's may depend on the main thread (a SIGALRM timer did)
    _in_fresh_process(_hostile_answers_cost_little_in_a_thread)


def _hostile_answers_cost_little_in_a_thread():
    with ThreadPoolExecutor(max_workers=1) as pool:
        graded = pool.submit(_grade, HOSTILE, "5").result()
    _assert_wrong_and_cheap(graded)


def test_rewards_from_another_thread_equal_the_main_thread_ones(warm_math_verify):
    rows = [(row[1], row[2], row[3]) for row in EQUIVALENCE_TABLE if len(row[1]) < 100]

    def grade(row):
        prediction, truth, precision = row
        return math_task.reward(_completion(_answer(prediction)), _sample(truth, precision))

    main = [grade(row) for row in rows]
    with ThreadPoolExecutor(max_workers=2) as pool:
        threaded = list(pool.map(grade, rows))
    assert threaded == main


SAFE_TABLE = [
    ("\\frac{1}{2}", True),
    ("2\\sqrt{221}", True),
    ("6.02 \\times 10^{23}", True),
    ("999^{99}", True),  # 3 digits x 99 = 297 digits at most
    ("x^{3} + 1", True),
    ("\\binom{10}{3}", True),
    ("12!", True),
    ("((((1))))", True),  # nesting 4
    ("(((((1)))))", True),  # nesting 5
    ("((((((1))))))", False),  # nesting 6
    ("123!", False),  # factorial of more than 2 digits
    ("(3)!", False),  # factorial of a bracket
    ("10^{100}", False),  # exponent of 3 digits
    ("(10^{99})^{99}", False),  # 2 x 99 x 99 digits
    ("2^{3}^{4}", False),  # power of a power
    ("{2^{3}}^{4}", False),
    ("2^{3^{4}}", False),
    ("(x+1)^{3}", True),
    ("x^{4}", False),  # symbolic exponent above 3
    ("(a+b)(a+b)(a+b)(a+b)(a+b)", False),  # five brackets with variables
    ("The answer is 12", False),  # prose: more than three letters
    ("x^{2} + y^{2}", False),  # two symbolic powers
    ("(a+b+c+d)^{2}", False),  # four variables
    ("\\binom{10}{3}^{2}", False),
    ("\\binom{9999}{5000}", True),
    ("\\binom{99999}{50000}", False),  # more than 4 digits in a binomial
    ("\\Gamma(99)", True),
    ("\\Gamma(123)", False),  # a fast-growing function of more than 2 digits
    ("\\Gamma(\\Gamma(5))", False),  # two of them
    ("\\exp(\\exp(2))", False),
    ("2^{\\Gamma(5)}", False),  # one in an exponent
    ("\\operatorname{lcm}(4, 6)", True),
    # issue 34: one fast-growing function, of a short argument, with no power, factorial or binomial
    ("\\exp(\\frac{99}{2})", True),
    ("\\Gamma(99.5)", True),
    ("\\Gamma(x)", True),
    ("\\Gamma(10^{99})", False),  # of a power
    ("\\Gamma(99)^{99}", False),  # beside a power
    ("\\exp(99) \\cdot 99!", False),  # beside a factorial
    ("\\Gamma(99 \\cdot 99 \\cdot 99)", False),  # three numbers in its argument
    ("\\exp(\\sqrt{99})", False),  # a command in its argument
    ("\\exp 9 9 9", False),  # no bracket: the rest of the answer is its argument
    ("\\tanh(10^{99})", False),
    ("1" * 21, False),
    ("2**3", False),
    ("\\int_0^1 x", False),
    ("x" * 201, False),
]


@pytest.mark.parametrize(("text", "safe"), SAFE_TABLE, ids=[row[0] for row in SAFE_TABLE])
def test_safe_for_math_verify(text, safe):
    assert math_task.safe_for_math_verify(text) is safe


def test_the_module_name_does_not_shadow_the_standard_library():
    import math as stdlib_math

    import vlm_grpo_ma.task_api.parsing as common

    assert math_task.__name__ == "tasks.math"
    assert sys.modules["math"] is stdlib_math and stdlib_math.sqrt(16.0) == 4.0
    assert common.math is stdlib_math and math_task.math is stdlib_math
    # from the repository root, a fresh interpreter gets both
    check = "import tasks.math, math; assert math.sqrt(4.0) == 2.0 and tasks.math.NAME == 'math'"
    subprocess.run([sys.executable, "-c", check], cwd=REPO, check=True)
    # with the tasks folder on sys.path the file would shadow `math`: it refuses with a clear message
    shadowed = subprocess.run([sys.executable, "-c", "import math"], cwd=REPO / "tasks", capture_output=True)
    assert shadowed.returncode != 0 and b"run Python from the repository root" in shadowed.stderr


# ---------------------------------------------------------------------------------------------- loaders


def test_load_project_jsonl():
    samples = math_task.load(source=str(FIXTURES / "project.jsonl"))
    assert [s.id for s in samples] == ["p1", "2", "p3", "p4"]
    assert samples[0].images == (str(FIXTURES / "images" / "shapes.png"),)
    assert samples[0].answer == "4" and samples[0].question == "How many shapes are there in total?"
    assert samples[0].meta == {"source": "project", "precision": None, "reference_thought": "I see 4 shapes."}
    assert samples[1].images == () and samples[1].answer == "1.5"  # a JSON number becomes a string
    assert samples[2].images == (str(FIXTURES / "images" / "chart.png"),)  # the single "image" key
    assert samples[2].meta["precision"] == 2
    assert len(samples[3].images) == 2 and samples[3].meta["answer_type"] == "text"
    assert all(s.task == "math" for s in samples)
    # images relative to an explicit image_root instead of the file's folder
    rooted = math_task.load(source=str(FIXTURES / "project.jsonl"), image_root=str(REPO))
    assert rooted[0].images == (str(REPO / "images" / "shapes.png"),)


def test_a_nul_byte_in_an_image_path_skips_the_row(tmp_path):
    """Issue 45: a NUL byte in an image path ended the load in Path.resolve's bare "embedded null byte", naming
    no file or row. The row is skipped and counted. Planted: resolved_path without its NUL check; this failed."""
    rows = [json.loads(line) for line in (FIXTURES / "project.jsonl").read_text().splitlines()]
    source = tmp_path / "rows.jsonl"
    bad = {**rows[0], "id": "nul", "images": ["images/sha\x00pes.png"]}
    source.write_text("".join(json.dumps(row) + "\n" for row in [*rows, bad]))
    with count_load_skips() as skipped:
        samples = math_task.load(source=str(source), image_root=str(FIXTURES))
    assert [s.id for s in samples] == ["p1", "2", "p3", "p4"] and skipped == {"malformed_rows": 1}


def test_load_geometry3k_parquet():
    samples = math_task.load("test", str(FIXTURES / "geometry3k.parquet"))
    assert [s.id for s in samples] == ["7", "8"]
    assert samples[0].question == "Find x. Round to the nearest tenth."  # "<image>" removed
    assert samples[0].answer == "10.8" and samples[0].meta == {"source": "geometry3k", "precision": 1}
    assert samples[1].answer == "2\\sqrt{221}" and samples[1].meta["precision"] is None
    assert isinstance(samples[0].images[0], Image.Image) and samples[0].images[0].size == (20, 16)
    assert samples[1].images[0].size == (18, 18)
    # the nearest tenth: 10.77 rounds to the answer
    reward = math_task.reward(_completion(_answer("10.77")), samples[0])
    assert reward["accuracy"] == 1.0


@pytest.mark.parametrize("name", ["mathvista.parquet", "mathvista_testmini.json"])
def test_load_mathvista_free_form_rows_only(name):
    samples = math_task.load(source=str(FIXTURES / name))
    assert [s.id for s in samples] == ["1", "3"]  # pid 2 is multi_choice: the vqa task's
    first, second = samples
    assert first.question == "What is the length of AB? Answer with a number with 2 decimal places."
    assert second.question == "How many bars are there? Answer with an integer."
    assert first.answer == "1.45" and second.answer == "6"
    assert first.meta["precision"] == 2 and second.meta["precision"] is None
    assert first.meta["answer_type"] == "float" and first.meta["unit"] == "cm"
    assert first.meta["query"].startswith("Hint:")
    if name.endswith(".parquet"):
        assert isinstance(first.images[0], Image.Image) and first.images[0].size == (16, 16)
    else:
        assert first.images == (str(FIXTURES / "images" / "mathvista" / "1.png"),)
    assert math_task.reward(_completion(_answer("1.4523")), first)["accuracy"] == 1.0


def test_load_gsm8k_jsonl():
    samples = math_task.load(source=str(FIXTURES / "gsm8k.jsonl"))
    assert [s.id for s in samples] == ["gsm8k_0", "gsm8k_1"]
    assert [s.answer for s in samples] == ["10", "2500"]  # after "####", commas dropped
    assert all(s.images == () for s in samples)
    assert samples[0].meta == {
        "source": "gsm8k",
        "precision": None,
        "reference_thought": "She has 3 * 4 = 12 apples. She has 12 - 2 = 10 left.",  # no <<...>> annotations
    }
    assert math_task.reward(_completion(_answer("2,500")), samples[1])["accuracy"] == 1.0


def test_load_rejects_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"'validation'.*train, test"):
        math_task.load("validation")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.jsonl, \.json, \.parquet"):
        math_task.load(source=str(tmp_path / "problems.csv"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        math_task.load(source=str(tmp_path / "missing.jsonl"))
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"prompt": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(
        ValueError, match=r"unrecognised math columns prompt, solution.*gsm8k: question, answer"
    ):
        math_task.load(source=str(unknown))
    no_final = tmp_path / "gsm.jsonl"
    no_final.write_text(json.dumps({"question": "q", "answer": "It is 4."}) + "\n")
    with pytest.raises(ValueError, match=r"gsm.jsonl:1: a GSM8K answer must end with '#### <final answer>'"):
        math_task.load(source=str(no_final))
    bad_precision = tmp_path / "bad.jsonl"
    bad_precision.write_text(json.dumps({"id": 1, "question": "q", "answer": "1.5", "precision": 1.5}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'precision' must be a whole number.*1\.5"):
        math_task.load(source=str(bad_precision))
    empty_answer = tmp_path / "empty.jsonl"
    empty_answer.write_text(json.dumps({"id": 1, "question": "q", "answer": " "}) + "\n")
    with pytest.raises(ValueError, match=r"empty.jsonl:1: an answer must be a non-empty string"):
        math_task.load(source=str(empty_answer))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": 1,\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not JSON"):
        math_task.load(source=str(broken))
    choices_only = tmp_path / "mc.json"
    choices_only.write_text(
        json.dumps([{"pid": "9", "question": "q", "answer": "A", "question_type": "multi_choice"}])
    )
    with pytest.raises(ValueError, match=r"no MathVista rows with question_type 'free_form'.*vqa task"):
        math_task.load(source=str(choices_only))
    scalar = tmp_path / "scalar.json"
    scalar.write_text("3")
    with pytest.raises(ValueError, match=r"list of rows or a dict of rows keyed by id, got int"):
        math_task.load(source=str(scalar))


# ---------------------------------------------------------------------------------------------- embedded data


@pytest.fixture(scope="module")
def embedded():
    return {split: math_task.load(split) for split in ("train", "test")}


@pytest.fixture(scope="module")
def embedded_rows():
    return {
        split: [json.loads(line) for line in (DATA_DIR / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "test")
    }


def test_embedded_splits_load_with_and_without_images(embedded):
    assert len(embedded["train"]) == 600 and len(embedded["test"]) == 100
    for samples in embedded.values():
        assert len({s.id for s in samples}) == len(samples)
        with_image = [s for s in samples if s.images]
        without = [s for s in samples if not s.images]
        assert len(with_image) > 0.6 * len(samples) and len(without) > 0.1 * len(samples)
        assert all(s.images == () for s in without)
        assert all(len(s.images) == 1 and Path(s.images[0]).is_file() for s in with_image)
        assert all(s.meta["reference_thought"] and s.question.endswith(("?", ".")) for s in samples)


def test_embedded_data_is_small():
    total = sum(p.stat().st_size for p in DATA_DIR.rglob("*") if p.is_file())
    assert total < 5_000_000


def _count(objects, colour=None, shape=None):
    return len([o for o in objects if colour in (None, o["colour"]) and shape in (None, o["shape"])])


def _recomputed_answer(row) -> str:
    """An independent reading of the generator's programs."""
    program, objects = row["program"], row.get("objects")
    kind = program["kind"]
    if kind == "total":
        return str(len(objects))
    if kind == "sum":
        return str(sum(_count(objects, colour, shape) for colour, shape in program["terms"]))
    if kind == "add":
        return str(_count(objects, program["colour"], program["shape"]) + program["add"])
    if kind == "difference":
        difference = _count(objects, shape=program["more"]) - _count(objects, shape=program["fewer"])
        assert difference >= 0
        return str(difference)
    if kind == "colour":
        return str(_count(objects, colour=program["colour"]))
    if kind == "buy_groups":
        return str(program["have"] + program["bags"] * program["per_bag"])
    if kind == "change":
        return str(program["paid"] - program["price"] * program["number"])
    if kind == "boxes":
        return str(-(-program["total"] // program["per_box"]))
    if kind == "speed":
        assert program["distance"] % program["hours"] == 0
        return str(program["distance"] // program["hours"] * program["later"])
    if kind == "fraction":
        part = Fraction(program["eaten"], program["slices"])
        return f"{part.numerator}/{part.denominator}"
    assert kind == "share_decimal"
    exact = Decimal(program["length"]) / Decimal(program["pieces"])
    return str(exact.quantize(Decimal("0.01"), ROUND_HALF_UP))


def _question_names(row) -> list[str]:
    """Words the question must contain for its program."""
    program = row["program"]
    if program["kind"] == "sum":
        return [f"{colour} {shape}s" for colour, shape in program["terms"]]
    if program["kind"] == "add":
        return [f"add {program['add']} more {program['colour']} {program['shape']}"]
    if program["kind"] == "difference":
        return [f"more {program['more']}s than {program['fewer']}s"]
    if program["kind"] == "colour":
        return [f"{program['colour']} shapes"]
    return [str(v) for k, v in program.items() if k not in ("kind", "length")]


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_embedded_answer_is_recomputed_from_its_objects_or_numbers(embedded_rows, split):
    kinds = set()
    for row in embedded_rows[split]:
        kinds.add(row["program"]["kind"])
        assert row["answer"] == _recomputed_answer(row), row["id"]
        assert all(name in row["question"] for name in _question_names(row)), row["id"]
        assert bool(row["images"]) == ("objects" in row), row["id"]
        assert row.get("precision") == (2 if row["program"]["kind"] == "share_decimal" else None), row["id"]
    if split == "train":
        assert kinds == set(make_math.IMAGE_KINDS) | set(make_math.TEXT_KINDS)


def _blobs(image: Image.Image) -> list[tuple[tuple[int, int, int], tuple[int, int, int, int]]]:
    """(colour, box) of every 4-connected region of non-grey pixels."""
    width, height = image.size
    pixels = image.load()
    seen = set()
    blobs = []
    for y in range(height):
        for x in range(width):
            colour = pixels[x, y]
            if (x, y) in seen or colour[0] == colour[1] == colour[2]:
                continue
            stack, box = [(x, y)], [x, y, x + 1, y + 1]
            seen.add((x, y))
            while stack:
                px, py = stack.pop()
                box = [min(box[0], px), min(box[1], py), max(box[2], px + 1), max(box[3], py + 1)]
                for nx, ny in ((px + 1, py), (px - 1, py), (px, py + 1), (px, py - 1)):
                    if (
                        0 <= nx < width
                        and 0 <= ny < height
                        and (nx, ny) not in seen
                        and pixels[nx, ny] == colour
                    ):
                        seen.add((nx, ny))
                        stack.append((nx, ny))
            blobs.append((colour, tuple(box)))
    return blobs


def test_embedded_pictures_show_exactly_their_objects(embedded_rows):
    rows = [row for row in embedded_rows["test"] if row["images"]][:30]
    for row in rows:
        with Image.open(DATA_DIR / row["images"][0]) as image:
            assert image.mode == "RGB" and image.size == (112, 112)
            found = sorted(_blobs(image.convert("RGB")))
        expected = sorted((make_math.COLOURS[o["colour"]], tuple(o["box"])) for o in row["objects"])
        assert found == expected, row["id"]


def test_reference_answers_on_the_embedded_test_split_get_full_reward(embedded):
    for sample in embedded["test"]:
        text = f"<think>{sample.meta['reference_thought']}</think><answer>{sample.answer}</answer>"
        _assert_parts(math_task.reward(_completion(text), sample), {**_expected(True, True), "right_thought": 1.0})


def test_right_thought_is_logged_not_rewarded(embedded):
    sample = next(s for s in embedded["test"] if s.images)
    reference = sample.meta["reference_thought"]
    spaced = math_task.reward(_completion(f"<think>  {reference.replace(' ', '   ')} </think><answer>{sample.answer}</answer>"), sample)
    other = math_task.reward(_completion(f"<think>I see some shapes.</think><answer>{sample.answer}</answer>"), sample)
    assert spaced["right_thought"] == 1.0 and other["right_thought"] == 0.0  # word for word, spacing aside
    assert spaced["reward"] == other["reward"] == 1.5  # the thought is not paid for
    assert "right_thought" not in math_task.reward(_completion("<think>x</think><answer>5</answer>"), _sample())


COUNTING_DIR = REPO / "data" / "counting"


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_counting_splits_are_pictures_whose_answers_are_recomputed(split, tmp_path):
    rows = [json.loads(line) for line in (COUNTING_DIR / f"{split}.jsonl").read_text().splitlines()]
    assert len(rows) == make_math.COUNTING_SPLIT_SIZES_AND_SEEDS[split][0]
    assert {row["program"]["kind"] for row in rows} == set(make_math.IMAGE_KINDS)
    for row in rows:
        assert row["answer"] == _recomputed_answer(row), row["id"]
        assert len(row["images"]) == 1 and (COUNTING_DIR / row["images"][0]).is_file(), row["id"]
    if split == "test":  # the committed files are the generator's
        n, seed = make_math.COUNTING_SPLIT_SIZES_AND_SEEDS["test"]
        assert make_math.generate(tmp_path, 6, seed=seed, split="test", image_share=1.0) == rows[:6]
    samples = math_task.load(source=str(COUNTING_DIR / f"{split}.jsonl"))
    assert len(samples) == len(rows) and all(len(s.images) == 1 and s.meta["reference_thought"] for s in samples)


def test_embedded_fraction_answers_accept_equivalent_forms(embedded):
    fractions = [s for s in embedded["train"] if "/" in s.answer]
    terminating = next(s for s in fractions if Fraction(s.answer).denominator in (2, 4, 5, 8, 10))
    repeating = next(s for s in fractions if Fraction(s.answer).denominator in (3, 6, 12))
    for sample in (terminating, repeating):
        value = Fraction(sample.answer)
        latex = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
        assert math_task.reward(_completion(_answer(latex)), sample)["accuracy"] == 1.0, latex
    decimal = str(Decimal(terminating.answer.split("/")[0]) / Decimal(terminating.answer.split("/")[1]))
    assert math_task.reward(_completion(_answer(decimal)), terminating)["accuracy"] == 1.0, decimal
    # a rounded decimal of a repeating fraction is wrong without a precision
    rounded = f"{float(Fraction(repeating.answer)):.2f}"
    assert math_task.reward(_completion(_answer(rounded)), repeating)["accuracy"] == 0.0, rounded


# ---------------------------------------------------------------------------------------------- generator


def _pixels(path):
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


def test_generator_is_deterministic(tmp_path):
    first = make_math.generate(tmp_path / "a", 8, seed=11, split="train")
    second = make_math.generate(tmp_path / "b", 8, seed=11, split="train")
    other = make_math.generate(tmp_path / "c", 8, seed=12, split="train")
    assert first == second
    assert first != other
    for row in first:
        for image in row["images"]:
            assert _pixels(tmp_path / "a" / image) == _pixels(tmp_path / "b" / image)


def test_embedded_test_split_matches_the_generator(tmp_path, embedded_rows):
    n, seed = make_math.SPLIT_SIZES_AND_SEEDS["test"]
    rows = make_math.generate(tmp_path, 6, seed=seed, split="test")  # a prefix of the split
    assert rows == embedded_rows["test"][:6]
    for row in rows:
        for image in row["images"]:
            assert _pixels(tmp_path / image) == _pixels(DATA_DIR / image)
    assert len(embedded_rows["test"]) == n


def test_write_split_writes_jsonl_the_loader_reads(tmp_path):
    make_math.write_split(tmp_path, "test", 4, seed=5)
    samples = math_task.load(source=str(tmp_path / "test.jsonl"))
    assert [s.id for s in samples] == [f"test_{i:05d}" for i in range(4)]
    assert all(Path(image).is_file() for s in samples for image in s.images)
