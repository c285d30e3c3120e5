"""The grammar of a math answer (tasks/_math_grammar.py, issue 34): a table of answers that must score
right, checked against math-verify wherever it can judge them, a table of answers that must score wrong, each
with the reason the grammar gives, what the grammar reads out of an answer, and linear time on long hostile
text."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import math as math_task
from tasks._math_grammar import read_answer, refusal, unwrap_answer

REPO = Path(__file__).resolve().parents[1]

# (id, answer, ground truth, precision, reference). The reference is MV where math-verify, the outside
# reference, must agree that the answer is right; otherwise it says why math-verify cannot judge the row.
I2 = "\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}"
MV = True  # math-verify agrees
PROSE = "math-verify reads prose as a product of letters"
GROUPED = "math-verify does not join digits grouped by spaces"
RIGHT_TABLE = [
    # the six labelled answers of issue 34 (Geometry3K and MathVista write answers like these)
    ("issue: segment", "AB = 5", "5", None, MV),
    ("issue: segment, no spaces", "BC=12", "12", None, MV),
    ("issue: function value", "f(2) = 6", "6", None, MV),
    ("issue: probability", "P(A) = 0.5", "0.5", None, MV),
    ("issue: measure of an angle", "m\\angle ABC = 30", "30", None, MV),
    ("issue: angle in degrees", "\\angle B = 30^\\circ", "30", None, MV),
    # more labels
    ("subscript in braces", "x_{1} = 6", "6", None, MV),
    ("subscript", "a_n = 7", "7", None, MV),
    ("greek name, degrees", "\\theta = 30^\\circ", "30", None, MV),
    ("numbered angle", "m \\angle 1 = 50", "50", None, MV),
    ("triangle", "\\triangle ABC = 12", "12", None, MV),
    ("segment with a bar", "\\overline{AB} = 5", "5", None, MV),
    ("arc", "m \\widehat{AB} = 60", "60", None, MV),
    ("sine of a name", "\\sin x = 0.5", "0.5", None, MV),
    ("inverse function", "f^{-1}(3) = 2", "2", None, MV),
    ("derivative", "g'(x) = 3", "3", None, MV),
    ("length", "|AB| = 5", "5", None, MV),
    ("probability of an intersection", "P(A \\cap B) = 0.2", "0.2", None, MV),
    ("area with a subscript", "S_{ABC} = 12", "12", None, MV),
    ("fraction value", "AB = \\frac{5}{2}", "2.5", None, MV),
    ("surd value", "BC = 2\\sqrt{221}", "\\sqrt{884}", None, MV),
    ("negative value", "x = -3", "-3", None, MV),
    ("boxed value", "x = \\boxed{5}", "5", None, MV),
    # labelled truths
    ("labelled truth, bare answer", "5", "x = 5", None, MV),
    ("labelled truth and answer", "x = 5", "x = 5", None, MV),
    ("labelled truth, another name", "AB = 5", "x = 5", None, "math-verify compares the names too"),
    ("equation", "y = 2x + 1", "y = 2x + 1", None, MV),
    ("equation's right side", "2x + 1", "y = 2x + 1", None, MV),
    # units (dropped on both sides)
    ("unit in the truth", "5", "5 cm", None, MV),
    ("unit on both sides", "5 cm", "5\\text{ cm}", None, MV),
    ("other unit", "6 cm", "6 m", None, MV),
    ("square units", "6 square units", "6", None, MV),
    ("degrees word", "30 degrees", "30", None, MV),
    ("degrees Celsius", "30^{\\circ}\\text{C}", "30", None, MV),
    ("percent", "50\\%", "50", None, MV),
    ("speed in text", "5 \\text{ m/s}", "5", None, MV),
    ("count noun", "12 apples", "12", None, MV),
    ("negative with a unit", "-5 cm", "-5", None, MV),
    ("speed", "5 m/s", "5", None, "math-verify reads m/s as variables"),
    ("squared unit", "5 cm^2", "5", None, "math-verify reads cm^2 as variables"),
    ("degree sign", "30°", "30", None, MV),
    ("dollars word", "5 dollars", "5", None, "math-verify does not drop dollars"),
    ("degree command", "45 \\degree", "45", None, MV),
    ("escaped dollar", "\\$5", "5", None, MV),
    ("thin space before a unit", "3\\,\\text{cm}", "3", None, MV),
    ("spaced unit in mathrm", "3 \\mathrm{~cm}", "3", None, MV),
    ("abbreviated unit", "3 sq. units", "3", None, MV),
    ("label and unit", "AB = 5\\text{ cm}", "5", None, MV),
    ("thousands comma", "6,000", "6000", None, MV),
    ("MATH's thousands comma", "10,\\!000", "10000", None, MV),
    ("MATH's thousands comma in the truth", "\\$10000", "10,\\!000", None, MV),
    # issue 45: digits grouped by the spaces LaTeX writers use (siunitx, ISO)
    ("thin-space thousands", "10\\,000", "10000", None, GROUPED),
    ("control-space thousands", "10\\ 000", "10000", None, GROUPED),
    ("negative thin space thousands", "10\\!000", "10000", None, MV),
    ("thin space in braces", "10{\\,}000", "10000", None, GROUPED),
    ("thinspace command", "10\\thinspace 000", "10000", None, GROUPED),
    ("thin-space millions", "1\\,000\\,000", "1000000", None, GROUPED),
    ("thin-space thousands in the truth", "\\$10000", "10\\,000", None, GROUPED),
    # issue 45: the quantity named in words as the label
    ("quantity label in text", "\\text{Area} = 24", "24", None, MV),
    ("quantity label", "Area = 24", "24", None, MV),
    ("two-word quantity label", "\\text{Total cost} = 24", "24", None, MV),
    ("quantity label and a unit", "\\text{Area} = 24\\text{ cm}^2", "24", None, "math-verify keeps a unit with a power"),
    ("quantity-labelled truth", "x = 24", "\\text{Area} = 24", None, "math-verify compares the names too"),
    ("hedged quantity label with a precision", "\\text{Perimeter} \\approx 24.5", "24.5", 1, MV),
    ("boxed value and a unit", "\\boxed{5}\\text{ cm}", "5", None, MV),
    # leads
    ("the answer is, in a math span", "The answer is $12$", "12", None, MV),
    ("final answer, boxed", "The final answer is $\\boxed{5}$", "5", None, MV),
    ("Markdown bold", "**5**", "5", None, "math-verify does not remove Markdown's bold"),
    ("math span then a unit", "$12$ cm", "12", None, MV),
    ("the answer is", "The answer is 12", "12", None, MV),
    ("therefore", "Therefore, x = \\frac{1}{2}", "0.5", None, PROSE),
    ("answer colon", "Answer: 12", "12", None, MV),
    ("so", "So 6", "6", None, PROSE),
    ("it's", "it's 6", "6", None, PROSE),
    # hedges with an approximate truth
    ("labelled hedge with a precision", "x \\approx 1.45", "1.45", 2, MV),
    ("approx with a precision", "\\approx 1.45", "1.45", 2, MV),
    ("about with a precision", "about 1.4523", "1.45", 2, PROSE),
    ("tilde with a precision", "~1.45", "1.45", 2, "math-verify reads ~ as nothing"),
    # what the truth has, the answer may have
    ("relation of the truth", "x \\neq 6", "x \\neq 6", None, MV),
    ("relation synonym", "x \\ne 6", "x \\neq 6", None, MV),
    ("plus-minus of the truth", "\\pm 2", "\\pm 2", None, MV),
    ("gamma truth, number answer", "24", "\\Gamma(5)", None, MV),
    ("list truth", "3, 2, 1", "1, 2, 3", None, MV),
    ("tuple", "(1, 2)", "(1, 2)", None, MV),
    ("matrix", I2, I2, None, MV),
    # symbols with a plain meaning
    ("unicode minus", "−3", "-3", None, MV),
    ("pi sign", "2π", "2\\pi", None, MV),
    ("times sign", "2×3", "6", None, MV),
    ("ratio", "3:4", "0.75", None, MV),
    ("non-breaking space before a unit", "5\u00a0cm", "5", None, MV),
]

# (id, answer, ground truth, precision, the grammar's reason: the names of tasks/_math_grammar.py, or None
# where the grammar lets the answer through and the comparison must find it wrong)
WRONG_TABLE = [
    # the cases of issue 34 that still scored right after the word lists
    ("issue: not-equivalent", "\\nequiv 6", "6", None, "command"),
    ("issue: text says bogus", "6 \\text{ is bogus}", "6", None, "word"),
    ("issue: crossed out", "\\cancel{6}", "6", None, "command"),
    ("issue: Cyrillic be for 6", "б", "6", None, "character"),
    ("issue: Greek Omicron for 0", "1Ο", "10", None, "character"),
    ("issue: fullwidth digit", "６", "6", None, "character"),
    ("issue: Cyrillic kha for x", "х = 6", "6", None, "character"),
    ("issue: trailing maybe", "6 maybe", "6", None, "word"),
    ("issue: leading perhaps", "perhaps 6", "6", None, "word"),
    # hedges and negations the word lists did not hold, and the ones they did
    ("I think", "I think it's 6", "6", None, "word"),
    ("probably", "probably 6", "6", None, "word"),
    ("question mark", "6?", "6", None, "character"),
    ("trailing wrong", "6 wrong", "6", None, "word"),
    ("is wrong", "6 is wrong", "6", None, "word"),
    ("text in brackets", "6 \\text{ (not really)}", "6", None, "word"),
    ("spaced text", "6 \\quad \\text{maybe}", "6", None, "word"),
    ("not", "not 6", "6", None, "word"),
    ("not command", "\\not 6", "6", None, "command"),
    ("neg", "\\neg 6", "6", None, "command"),
    ("not sign", "¬6", "6", None, "character"),
    ("zero-width space", "6\u200b", "6", None, "character"),
    ("number in words", "six", "6", None, "word"),
    ("word in a label", "P(wrong) = 6", "6", None, "word"),
    ("adjective before a unit", "6 red circles", "6", None, "word"),
    ("trailing hedge, even with a precision", "6 (approximately)", "6", 2, "word"),
    ("trailing approx, even with a precision", "6 approx", "6", 2, "word"),
    # relations: between two values, more than one, or another relation than "label ="
    ("neq", "x \\neq 6", "6", None, "relation"),
    ("not-equal sign", "x ≠ 6", "6", None, "relation"),
    ("equation between values", "5 = 6", "6", None, "relation"),
    ("two relations", "x = y = 6", "6", None, "relation"),
    ("two relations with names", "AB = CD = 5", "5", None, "relation"),
    ("an expression is not a label", "2x = 6", "3", None, "relation"),
    ("less than", "5 < 6", "6", None, "relation"),
    ("le", "x \\le 6", "6", None, "relation"),
    ("congruence", "5 \\equiv 6", "6", None, "relation"),
    # commands outside the grammar's list, unless the truth has them
    ("logical or", "x=5 \\lor x=6", "6", None, "command"),
    ("plus-minus", "\\pm 6", "6", None, "command"),
    ("gamma without a gamma truth", "\\Gamma(4)", "6", None, "command"),
    ("unknown function", "\\operatorname{round}(6.2)", "6", None, "command"),
    # several values where the truth is one
    ("repeated", "6, 6", "6", None, "several"),
    ("semicolon", "6; 6", "6", None, "several"),
    ("row break", "6 \\\\ 6", "6", None, "several"),
    ("cell break", "6 & 6", "6", None, "several"),
    ("and", "6 and 7", "6", None, "word"),
    ("or", "6 or 6", "6", None, "word"),
    ("or in text", "x = 6 \\text{ or } 7", "6", None, "word"),
    ("prose with two numbers", "It is 5, not 6", "5", None, "several"),
    ("two math spans", "5$ $6", "6", None, "spans"),
    ("two whole math spans", "$5$ $6$", "6", None, "spans"),
    # math-verify reads only what is boxed, wherever the box is
    ("a number, then the box", "7 \\boxed{6}", "6", None, "boxed"),
    ("the box, then a number", "\\boxed{6}\\quad 7", "6", None, "boxed"),
    ("the box in an expression", "\\boxed{6}^{-1}", "6", None, "boxed"),
    # the grammar lets these through; math-verify's unit stripping read them as 6 (it is off now)
    ("a second value in text", "6\\text{, 7}", "6", None, None),
    ("a difference in text", "6\\text{ - 7}", "6", None, None),
    ("letter and number after the value", "6 d 7", "6", None, None),
    ("letter and number after the value, s", "6 s 7", "6", None, None),
    # sympy's simplify calls powers of infinity equal to random numbers, by hash seed
    ("root of infinity", "\\sqrt{\\infty}", "6", None, "command"),
    ("infinity sign", "∞^{2}", "\\frac{1}{2}", None, "character"),
    # hedges with an exact truth
    ("approx", "\\approx 6", "6", None, "hedge"),
    ("labelled approx", "x \\approx 6", "6", None, "hedge"),
    ("sim", "\\sim 6", "6", None, "hedge"),
    ("tilde", "~6", "6", None, "hedge"),
    ("about", "about 6", "6", None, "hedge"),
    # malformed
    ("unbalanced", "\\frac{1}{2}}{", "0.5", None, "unbalanced"),
    ("no value", "=", "6", None, "empty"),
    ("another name for an equation", "z = 2x + 1", "y = 2x + 1", None, "label"),
    # issue 45: digit groups are three digits after a digit; anything else is two numbers, not one
    ("thin space before one digit", "1\\,2", "12", None, None),
    ("thin space before two digits", "1\\,23", "123", None, None),
    ("thin space before four digits", "1\\,0000", "10000", None, None),
    ("thin space, then a space", "1\\, 2", "12", None, None),
    ("a truth of two numbers", "12", "1\\,2", None, None),
    ("thin-space thousands are not ten", "10\\,000", "10", None, None),
    # issue 45: a label in words is a quantity's name, and the value after it is the whole rest
    ("a word that is no quantity", "\\text{wrong} = 24", "24", None, "relation"),
    ("negation as a label", "\\text{not} = 24", "24", None, "relation"),
    ("a quantity and a negation", "\\text{Area not} = 24", "24", None, "relation"),
    ("quantity label, two values", "\\text{Area} = 24 = 25", "24", None, "relation"),
    ("two labelled values", "x = 2, y = 3", "2", None, "relation"),
    ("equation between the truth and another number", "24 = 25", "24", None, "relation"),
    ("quantity label, several values", "\\text{Area} = 24, 25", "24", None, "several"),
    ("quantity label, or", "\\text{Area} = 24 \\text{ or } 25", "24", None, "word"),
    ("quantity label, trailing maybe", "Area = 24 maybe", "24", None, "word"),
    ("quantity label, negated value", "\\text{Area} = \\text{not } 24", "24", None, "word"),
    ("quantity label hedged, exact truth", "\\text{Area} \\approx 24", "24", None, "hedge"),
    ("quantity label for an equation", "\\text{Answer} = 2x + 1", "y = 2x + 1", None, "label"),
    ("the quantity alone", "\\text{Area}", "24", None, "word"),
    ("quantity label, wrong value", "\\text{Area} = 25", "24", None, None),
]


def _refusal(answer, truth, precision):
    answer_form, truth_form = read_answer(unwrap_answer(answer)), read_answer(unwrap_answer(truth))
    return refusal(answer_form, truth_form, precision is not None)


@pytest.fixture(scope="module")
def warm_math_verify():
    assert math_task.is_equivalent("\\frac{1}{2}", "0.5")


@pytest.fixture
def parsed(monkeypatch):
    """The texts math-verify parses (``tasks.math._parsed``), in order: a count of the grader's work, which no
    loaded machine can miss as it could a wall-clock limit (issue 45)."""
    texts = []
    parse = math_task._parsed

    def counted(text):
        texts.append(text)
        return parse(text)

    monkeypatch.setattr(math_task, "_parsed", counted)
    return texts


@pytest.mark.parametrize(("answer", "truth", "precision"), [r[1:4] for r in RIGHT_TABLE], ids=[r[0] for r in RIGHT_TABLE])
def test_right_answers_score_right(answer, truth, precision, warm_math_verify, parsed):
    assert _refusal(answer, truth, precision) is None
    assert math_task.is_equivalent(answer, truth, precision) is True
    assert len(parsed) <= 2  # one parse a side at most


MV_ROWS = [row for row in RIGHT_TABLE if row[4] is MV]


@pytest.mark.parametrize(("answer", "truth", "precision"), [r[1:4] for r in MV_ROWS], ids=[r[0] for r in MV_ROWS])
def test_math_verify_agrees_with_the_right_table(answer, truth, precision):
    import math_verify

    rounding = 6 if precision is None else precision
    gold, predicted = math_verify.parse(f"${truth}$"), math_verify.parse(f"${answer}$")
    assert math_verify.verify(gold, predicted, float_rounding=rounding)


def test_the_right_table_is_mostly_checked_by_math_verify():
    # a row without math-verify's agreement says why; they stay few
    assert len(MV_ROWS) >= 0.8 * len(RIGHT_TABLE)
    reasons = [row[4] for row in RIGHT_TABLE if row[4] is not MV]
    assert all(isinstance(reason, str) and reason.startswith("math-verify") for reason in reasons)


@pytest.mark.parametrize(
    ("answer", "truth", "precision", "reason"), [r[1:] for r in WRONG_TABLE], ids=[r[0] for r in WRONG_TABLE]
)
def test_wrong_answers_score_wrong_for_their_reason(answer, truth, precision, reason, warm_math_verify, parsed):
    assert _refusal(answer, truth, precision) == reason
    assert math_task.is_equivalent(answer, truth, precision) is False
    assert len(parsed) <= 2 and (reason is None or not parsed)  # an answer wrong by its form is not parsed


# (answer, label, value, hedged): what the grammar reads
READINGS = [
    ("AB = 5 cm", "AB", "5", False),
    ("m\\angle ABC = 30^\\circ", "m\\angleABC", "30", False),
    ("So the answer is $x = \\frac{1}{2}$", "x", "\\frac{1}{2}", False),
    ("x \\approx 6.28", "x", "6.28", True),
    ("approx. 6.28 \\text{ m/s}", "", "6.28", True),
    ("\\$12.50", "", "12.50", False),
    ("6~\\text{cm}^2", "", "6", False),
    ("30°C", "", "30", False),
    ("\\text{Total area} = 1\\,024\\text{ cm}^2", "\\text{Totalarea}", "1024", False),
    ("2x m", "", "2x m", False),  # a value with letters takes no unit: "m" is a variable there
    ("\\frac{1}{2} +", "", "\\frac{1}{2} +", False),  # nor does one that ends in an operator
]


@pytest.mark.parametrize(("answer", "label", "value", "hedged"), READINGS, ids=[row[0] for row in READINGS])
def test_the_grammar_reads_label_value_and_hedge(answer, label, value, hedged):
    form = read_answer(unwrap_answer(answer))
    assert (form.label, form.value, form.hedged) == (label, value, hedged)


# Long hostile text, past MAX_ANSWER_CHARS (is_equivalent never hands such text to the grammar, but every
# pattern is linear all the same). Each case is an expression of n; n = 10,000 makes about 20,000 characters.
LONG_CASES = [
    "' ' * 2 * n + 'x'",
    "'x' * 2 * n + '='",
    "'m ' * n + '= 5'",
    "'\\\\text{' * (n // 2)",
    "'\\\\text{ ' + 'a ' * n",
    "'^ ' * n",
    "'5' + ' cm' * (7 * n // 10) + ' maybe'",
    "'5' + ' cm/' * (n // 2)",
    "'(' * n + '5' + ')' * n",
    "'$' + ' ' * 2 * n + '$ ' + 'cm ' * (n // 2)",
    "'the answer is ' * (n // 5)",
    "'\\\\angle ' * (n // 2) + '= 5'",
    "'f(' + '1' * 2 * n + ') = 5'",
    "'f(' + '1 ' * (n // 2) + '= 5'",
    "'1,' * n",
    "'1{,}\\\\!' * (2 * n // 5)",
    "'1\\\\,' * n",
    "'\\\\text{Area ' * (n // 3) + '= 5'",
    "'\\\\exp(' + '1 ' * n",
]
# A plain answer of the same sizes: the reference each case is measured against, in the same process.
REFERENCE_CASE = "'1 + ' * (n // 2)"
# Linear work grows 20 times from n = SMALL to n = BIG, quadratic 400 times. A case may grow GROWTH times
# (measured: 19-21 where there is work to measure) plus the reference's cost at SMALL (for cases that take
# microseconds, where timer noise is the whole measurement). Costs are the process's CPU time, which other
# processes on a loaded machine do not stretch as they stretch wall-clock time.
SMALL, BIG, GROWTH = 250, 5000, 45


def test_the_grammar_and_screen_are_linear_on_long_hostile_text():
    """Each case's cost at BIG against its cost at SMALL, measured alike (the least CPU time of 3), not a
    wall-clock limit that a loaded machine can miss (issue 45). A regex holds the GIL, so the cases run in a
    child process, killed if one hangs (exponential backtracking). Planted: two adjacent quantifiers over the
    same characters in a label's argument (_ARGUMENT = r"\\([^()=<>]*[^()=<>]*\\)"); the "f(1 1 1 ... = 5"
    case grew 100-fold."""
    code = (
        "import json, time\n"
        "from tasks._math_grammar import read_answer, refusal, safe_for_math_verify\n"
        "from tasks.math import plain_number\n"
        "truth = read_answer('6')\n"
        "def cost(text):\n"
        "    best = float('inf')\n"
        "    for _ in range(3):\n"
        "        started = time.process_time()\n"
        "        refusal(read_answer(text), truth, False)\n"
        "        safe_for_math_verify(text[:200]); plain_number(text)\n"
        "        best = min(best, time.process_time() - started)\n"
        "    return best\n"
        f"for case in {[REFERENCE_CASE, *LONG_CASES]!r}:\n"
        f"    costs = [cost(eval(case, {{'n': n}})) for n in ({SMALL}, {BIG})]\n"
        "    print(json.dumps([case, costs]), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    costs = dict(json.loads(line) for line in done.stdout.splitlines())
    assert set(costs) == {REFERENCE_CASE, *LONG_CASES}
    reference = costs.pop(REFERENCE_CASE)[0]
    superlinear = {case: (small, big) for case, (small, big) in costs.items() if big > GROWTH * small + reference}
    assert not superlinear, (reference, superlinear)


def test_answers_past_the_caps_are_not_read_and_screened_ones_not_parsed(monkeypatch, parsed, warm_math_verify):
    """The bounds on the grader's work that keep hostile text cheap, counted rather than timed (issue 45): an
    answer longer than MAX_ANSWER_CHARS never reaches the grammar or math-verify, and one the screen refuses is
    never parsed. Planted, each alone: is_equivalent without its MAX_ANSWER_CHARS check (the 300-character
    answer was read); math_verify_equal without the screen (the refused answers were parsed)."""
    read, read_answer = [], math_task.read_answer

    def counted(text):
        read.append(text)
        return read_answer(text)

    monkeypatch.setattr(math_task, "read_answer", counted)
    for text in ["5" + " cm" * 100, *(eval(case, {"n": 10000}) for case in LONG_CASES)]:
        assert len(text) > math_task.MAX_ANSWER_CHARS
        assert math_task.is_equivalent(text, "5") is False
    assert read == [] and parsed == []
    # past the screen: nested deeper than MAX_NESTING (a number in redundant brackets: rule 5), more than
    # MAX_CARETS powers
    assert math_task.is_equivalent("((((((5))))))", "5") is True
    assert math_task.is_equivalent("2^{2} + 2^{2} + 2^{2}", "12") is False
    assert parsed == []
