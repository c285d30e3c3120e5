"""Math word problems, with or without an image: the answer is checked for mathematical equivalence.

Reward parts (all in [0, 1]):
  ``accuracy``  1.0 when the single ``<answer>`` tag holds an answer equivalent to the ground truth (rules
                below), else 0.0;
  ``format``    1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer is not
                blank, else 0.0;
  ``right_thought``  only for samples with a reference thought (the embedded and counting rows): 1.0 when the
                think part is that thought word for word (on a counting picture, its inventory), else 0.0;
                logged, not rewarded;
  ``reward``    ``weighted_reward(parts, REWARD_WEIGHTS)``.

``accuracy`` does not require the format: an answer in a single ``<answer>`` tag is graded even when the
think part is missing or text surrounds the tags; the format part is what punishes those. No single complete
answer tag (absent, repeated, cut off) scores 0 on both parts. The reward never raises on model output.

Equivalence (``is_equivalent``), tried in this order:
  1. a ground truth without digits or LaTeX (MathVista ``text`` answers, ``meta["answer_type"] == "text"``)
     is compared as text after ``normalise_answer``;
  2. an answer whose form says it is not the answer is wrong, whatever its numbers (``refused_form``, below);
  3. when both sides are plain numbers (``1,000``, ``-2.5``, ``1e3``, ``$5``, ``x = 5``, ``12 cm``,
     ``45^\\circ``, ``50%``: a trailing unit is dropped) they are compared exactly as decimals, or, with
     ``meta["precision"] = p`` (MathVista's number of decimals), after rounding both half-up to p decimals;
  4. otherwise math-verify decides (``1/2`` == ``0.5`` == ``\\frac{1}{2}`` == ``\\boxed{\\frac12}``,
     ``2\\sqrt{221}`` == ``\\sqrt{884}``, ``5\\text{ cm}`` == ``5``, matrices, vectors and tuples element by
     element), rounding floats to p decimals when a precision is given (6 otherwise, math-verify's default);
  5. when math-verify cannot parse a side, or the screen below refuses it (prose such as "The answer is 12"
     has too many letters to be a formula), the answer is right when each side holds exactly one number and
     those match as in 3 ("5 or 6" and "1, 2, 3" hold several and are wrong), unless the answer applies a
     function the screen guards to its number (``\\Gamma(\\Gamma(5))``, refused by the screen, is not 5).
Answers longer than MAX_ANSWER_CHARS are wrong without being read: no ground truth is that long.

Answers that are not the answer (rule 2). Math-verify and the one-number fallback read the value out of an
answer and ignore what the words around it say, which made four kinds of wrong answer score as right. Each is
now wrong unless the ground truth has the same form:
  * a negation: "not 6", "the answer is not 6", "isn't 6", ``x \\neq 6``, ``\\ne 6``, "≠", ``\\neg 6``, "¬6",
    ``6 \\text{ is wrong}`` (the words not, no, never, none, cannot, wrong, false, incorrect, untrue, any "n't");
  * a relation between values: ``5 = 6``, ``5 \\equiv 6``, ``x = y = 6`` (math-verify grades one side); only
    "name = value" (``x = 6``, ``x_1 = 6``, ``\\theta = 6``) gives the answer;
  * a hedge when the truth is exact: ``\\approx 6``, "≈ 6", "~6", ``\\sim 6``, "about/approximately/around/
    roughly/nearly 6". A hedge is accepted when the truth is approximate: ``meta["precision"]`` is set (MathVista
    floats, Geometry3K's "round to the nearest tenth") or the truth hedges itself;
  * several values where the truth is one value: "6, 6", "6; 6", "6 and 6", ``x=5 \\lor x=6``, and what is
    left of several math spans, ``5$ $6`` (a ``$`` that does not start a number) ("6 or 7" already failed). "One
    value" means no comma, semicolon, matrix cell or row, "and"/"or" in the truth; the prediction lists values
    when it has a comma or semicolon outside every bracket (thousands commas such as ``6,000`` aside) or the
    word "and"/"or". A tuple ``(6, 6)`` is one value and is compared as a tuple (wrong against ``6``).

Guarding math-verify. Sympy can take minutes or exhaust memory on short hostile input (``9^{9^{9^{9}}}``,
``(10^{10})!``, ``\\binom{10^{10}}{10^{5}}``, ``(a+b+c+d)^{99}``, ``\\Gamma(\\Gamma(\\Gamma(5)))``), and much of
that time is spent inside single C-level big-integer operations that no timer can interrupt. So an answer
first has to pass a static screen (``safe_for_math_verify``: bounded length, nesting, digits, exponents,
factorials, binomials, nested or long arguments of ``\\Gamma``, ``\\exp``, ``\\sinh``, ``\\cosh``);
``\\begin{...}``/``\\end{...}`` environment names are not variables. What the screen
lets through unbounded is bounded by the reward's deadline: every task reward runs in a worker process that is
killed when it passes ``rollout.reward_timeout_s`` (``vlm_grpo_ma/task_api/reward_pool.py``), in training and
evaluation alike, from any thread. (A SIGALRM timer used to guard the main thread only; it is gone.) The
measurements behind each screen limit are in the comments at the limits. Every regex here is linear-time.

Sources for ``load``: the embedded synthetic set (``data/math``, made by ``data/make_math.py``: counting
questions about pictures of shapes plus text-only word problems), and local ``.jsonl``/``.json``/
``.parquet`` files whose columns pick the schema: the project's JSONL, Geometry3K (Hugging Face
``hiyouga/geometry3k``), MathVista (``free_form`` rows only) and GSM8K (``question``, ``answer`` ending in
``#### <number>``).
"""

from __future__ import annotations

if __name__ == "math":
    # The tasks folder itself is on sys.path (a script run from inside tasks/), so ``import math`` anywhere
    # found this file instead of the standard library. Fail loudly rather than half-work.
    raise ImportError(
        "tasks/math.py was imported as the top-level module 'math' because the tasks folder is on sys.path; "
        "run Python from the repository root (tasks are imported as 'tasks.math')"
    )

import functools

# This module is ``tasks.math``; ``import math`` here and in the other task modules is the standard library
# (imports are absolute). Only a tasks folder on sys.path would shadow it: see the check above.
import math
import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation, localcontext
from pathlib import Path
from typing import Any

from vlm_grpo_ma.task_api import (
    Completion,
    Sample,
    Task,
    checked_source_file,
    detect_schema,
    embedded_split_file,
    extract_tag,
    has_think_answer_format,
    image_from_cell,
    normalise_answer,
    read_rows,
    register_task,
    require_keys,
    right_thought,
    rows_to_samples,
    weighted_reward,
)

NAME = "math"

# Short on purpose: the default model is tiny and every prompt token costs CPU time.
INSTRUCTION = "Think in <think></think>, then put only the final answer in <answer></answer>."

# Accuracy is the goal; the format bonus is half of a right answer so that a well-formed wrong answer still
# beats malformed output early in training without outweighing correctness (the same balance as grounding).
REWARD_WEIGHTS = {"accuracy": 1.0, "format": 0.5}

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "math"
EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet")

# The columns that identify each file schema, checked in this order (the first whose columns are all present
# wins). Geometry3K rows carry an "id" too, but "problem" instead of "question"; GSM8K rows have no "id".
MATHVISTA_COLUMNS = ("pid", "question", "answer", "question_type")
GEOMETRY3K_COLUMNS = ("images", "problem", "answer")
PROJECT_COLUMNS = ("id", "question", "answer")
GSM8K_COLUMNS = ("question", "answer")
SCHEMAS = {
    "mathvista": MATHVISTA_COLUMNS,
    "geometry3k": GEOMETRY3K_COLUMNS,
    "project": PROJECT_COLUMNS,
    "gsm8k": GSM8K_COLUMNS,
}

# No benchmark answer comes near this; a longer answer is wrong without being parsed (a 10,000-digit number
# costs nothing to reject and would cost math-verify and Decimal real time).
MAX_ANSWER_CHARS = 200
# The longest digit run in a plain number: 40 digits is far past any benchmark answer and keeps Decimal work
# trivial.
MAX_NUMBER_DIGITS = 40


# ---------------------------------------------------------------------------------------------- numbers

# A unit after a number: "%", degrees, words ("cm", "square units", "m/s", "cm^2") or \text{...}/\mathrm{...}.
# Tokens are separated by at least one space or a slash, so a run of letters splits one way only (no
# catastrophic backtracking on long words).
_UNIT_TOKEN = r"(?:\\(?:text|mathrm|mbox)\s*\{[A-Za-z ]*\}|[A-Za-z]+)(?:\^\{?[23]\}?|[²³])?"
_UNIT = (
    rf"(?:\\?%|°|\^\s*(?:\{{\s*\\circ\s*\}}|\\circ)|\\circ|"
    rf"{_UNIT_TOKEN}(?:(?:\s*/\s*|\s+){_UNIT_TOKEN})*)"
)
# One plain number as a whole answer: optional "x =", optional currency sign, sign, digits (with optional
# thousands commas), decimals, exponent, then an optional unit. nan/inf are not numbers here: a non-finite
# answer matches nothing. No two unbounded whitespace runs are adjacent without a required character between
# them (each optional part owns the whitespace after it), so a run of spaces splits one way only and the
# match is linear in the length of the text.
_PLAIN_NUMBER = re.compile(
    rf"(?:[A-Za-z]\s*=)?\s*(?:\\?\$\s*)?(?:(?P<sign>[-+−])\s*)?"
    rf"(?P<digits>\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)"
    rf"(?:[eE](?P<exponent>[-+]?\d{{1,3}}))?"
    rf"\s*(?:{_UNIT})?"
)
# Any number inside a longer text, for the last-resort fallback.
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?![\w])")

# Wrappers a model puts around a final answer: $...$, $$...$$, \(...\), \[...\], \boxed{...}, \fbox{...}.
_WRAPPERS = (
    re.compile(r"\$\$(.*)\$\$", re.DOTALL),
    re.compile(r"\$(.*)\$", re.DOTALL),
    re.compile(r"\\\((.*)\\\)", re.DOTALL),
    re.compile(r"\\\[(.*)\\\]", re.DOTALL),
    re.compile(r"\\(?:boxed|fbox)\s*\{(.*)\}", re.DOTALL),
)


def _balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def unwrap_answer(text: str) -> str:
    """``text`` stripped of surrounding whitespace, a final period, and whole-answer wrappers (``$...$``,
    ``\\(...\\)``, ``\\[...\\]``, ``\\boxed{...}``), repeatedly: ``$\\boxed{5}$.`` -> ``5``."""
    text = text.strip()
    for _ in range(4):
        before = text
        if text.endswith(".") and not text.endswith(".."):
            text = text[:-1].rstrip()
        for wrapper in _WRAPPERS:
            match = wrapper.fullmatch(text)
            if match and _balanced(match.group(1)) and "$" not in match.group(1):
                text = match.group(1).strip()
                break
        if text == before:
            break
    return text


def _decimal(sign: str, digits: str, exponent: str | None) -> Decimal | None:
    if sum(c.isdigit() for c in digits) > MAX_NUMBER_DIGITS:
        return None
    text = ("-" if sign in ("-", "−") else "") + digits.replace(",", "")
    if text.endswith("."):
        text = text[:-1]
    if exponent:
        text += f"e{exponent}"
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def plain_number(text: str) -> Decimal | None:
    """``text`` (already unwrapped) as one plain number with an optional unit, or None."""
    match = _PLAIN_NUMBER.fullmatch(text)
    if match is None:
        return None
    return _decimal(match["sign"] or "", match["digits"], match["exponent"])


def single_number(text: str) -> Decimal | None:
    """The one number written anywhere in ``text``, or None when there are none or several."""
    found = _NUMBER_IN_TEXT.findall(text)
    if len(found) != 1:
        return None
    number = found[0]
    sign = number[0] if number[0] in "-+−" else ""
    return _decimal(sign, number[len(sign) :], None)


def numbers_match(prediction: Decimal, truth: Decimal, precision: int | None = None) -> bool:
    """Exact decimal equality; with ``precision`` p, equality after rounding both half-up to p decimals.

    MathVista's scorer rounds the prediction to p decimals and compares it with the answer as a string; half-up
    rounding on exact decimals is that rule without binary-float surprises (``round(2.675, 2) == 2.67``).
    """
    if precision is None:
        return prediction == truth
    with localcontext() as context:
        context.prec = 2 * MAX_NUMBER_DIGITS + 1000
        quantum = Decimal(1).scaleb(-precision)
        try:
            return prediction.quantize(quantum, ROUND_HALF_UP) == truth.quantize(quantum, ROUND_HALF_UP)
        except InvalidOperation:  # an exponent too large to quantize: compare as written
            return prediction == truth


# ---------------------------------------------------------------------------------------------- math-verify

# Limits of the static screen. Each was measured on this project's machine with math-verify 0.9 / sympy:
# nesting depth 7 takes 0.3 s and 10 takes 0.8 s (500 takes 5 s); "(a+b+c+d+e+f)^{9}" 6 s and
# "(a+b+c+d)^{99}" never finished; "\sin(B^{99})" for a 40-digit B 2.4 s; "\binom{10^{10}}{10^{5}}" 22 s;
# "(10^{10})!" and "9^{9^{9^{9}}}" never finished. The worst cases we found that the screen lets through
# ("\sin(999^{99})", "(x+1)" forty times) take about 0.5 s.
MAX_NESTING = 5
MAX_SCREENED_DIGITS = 20
MAX_CARETS = 2
MAX_EXPONENT_DIGITS = 2
# digits of the largest number written x product of the numeric exponents: a bound on the digits of the
# largest integer sympy may build ("999^{99}" -> 297; "(10^{99})^{99}" -> 19,602 is refused).
MAX_POWER_DIGITS = 400
# With free variables, products and powers expand symbolically ("(a+b+c+d+e+f)" nine times over: 10 s;
# "(a+b+c)" 28 times: 1.5 s): at most 3 distinct letters, 4 brackets, one power with an exponent <= 3. Text
# with more letters is prose ("The answer is 12"), which the one-number fallback reads instead.
MAX_SYMBOLIC_EXPONENT = 3
MAX_VARIABLES = 3
MAX_SYMBOLIC_BRACKETS = 4
MAX_FACTORIAL_DIGITS = 2
# Functions that grow faster than any power, which sympy evaluates exactly: nested or on a long number they
# never finished ("\Gamma(\Gamma(\Gamma(5)))"; "\lfloor\exp(\exp(22))\rfloor" needs the 1.5e9 digits of
# e^(e^22)). So at most one per answer, no digit run longer than an exponent's (\exp(n) is e^n, \Gamma(n) is
# (n-1)!) and none inside an exponent. Screened worst cases: "\exp(99)" 0.22 s, "\lfloor\exp(99)^{99}\rfloor"
# 0.16 s, "\Gamma(99)" 0.06 s. \operatorname names any function, so it counts as one of them.
_GROWING = re.compile(r"\\(?:Gamma|exp|sinh|cosh|operatorname)(?![A-Za-z])")
# Binomials are computed exactly too: "\binom{9999}{5000}" 0.03 s, "\binom{99999}{50000}" 0.7 s,
# "\binom{999999}{500000}" over 20 s ("\binom{99999999999999999999}{9999999999}" never finished).
MAX_BINOMIAL_DIGITS = 4

_FORBIDDEN = re.compile(r"\*\*|\\(?:sum|prod|int|iint|oint|lim)(?![A-Za-z])")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_TEXT_GROUP = re.compile(r"\\(?:text|mathrm|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
_DIGIT_RUN = re.compile(r"\d+")


def _exponent_at(text: str, caret: int) -> tuple[str, int]:
    """The exponent after the ``^`` at index ``caret`` (a ``{...}`` group, a ``\\command`` or one character)
    and the index just after it."""
    i = caret + 1
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return "", i
    if text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j], j + 1
        return text[i + 1 :], len(text)
    if text[i] == "\\":
        match = _COMMAND.match(text, i)
        if match:
            return match.group(0), match.end()
    return text[i], i + 1


def safe_for_math_verify(text: str) -> bool:
    """Whether ``text`` is small and tame enough to hand to math-verify (see the limits above).

    Refused: longer than MAX_ANSWER_CHARS; brackets nested deeper than MAX_NESTING; a digit run longer than
    MAX_SCREENED_DIGITS; ``**``, sums, products, integrals, limits; more than MAX_CARETS powers, a power of a
    power, an exponent holding ``^``/``!`` or a number of more than MAX_EXPONENT_DIGITS digits, or powers
    that could build an integer of more than MAX_POWER_DIGITS digits; a factorial of anything but a number of
    at most MAX_FACTORIAL_DIGITS digits; a binomial together with a power or a factorial, or with a number of
    more than MAX_BINOMIAL_DIGITS digits; more than one fast-growing function (``_GROWING``), one with a number
    of more than MAX_EXPONENT_DIGITS digits, or one in an exponent; and, with free
    variables (letters outside LaTeX commands and ``\\text{}``), more than MAX_VARIABLES of them, more than
    MAX_SYMBOLIC_BRACKETS brackets, more than one power or an exponent above MAX_SYMBOLIC_EXPONENT.
    """
    if len(text) > MAX_ANSWER_CHARS or _FORBIDDEN.search(text):
        return False
    depth = 0
    for char in text:
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth > MAX_NESTING:
            return False
    digit_runs = _DIGIT_RUN.findall(text)
    longest = max((len(run) for run in digit_runs), default=0)
    if longest > MAX_SCREENED_DIGITS:
        return False
    # Factorials: only of a short literal number ("5!", "12!").
    for index, char in enumerate(text):
        if char == "!":
            before = text[:index].rstrip()
            digits = len(before) - len(before.rstrip("0123456789"))
            if digits == 0 or digits > MAX_FACTORIAL_DIGITS:
                return False
    growing = _GROWING.findall(text)
    if len(growing) > 1 or (growing and longest > MAX_EXPONENT_DIGITS):
        return False
    carets = [i for i, char in enumerate(text) if char == "^"]
    if ("binom" in text or "choose" in text) and (carets or "!" in text or longest > MAX_BINOMIAL_DIGITS):
        return False
    if len(carets) > MAX_CARETS:
        return False
    exponent_product = 1
    largest_exponent = 0
    for caret in carets:
        exponent, end = _exponent_at(text, caret)
        if not exponent or "^" in exponent or "!" in exponent or _GROWING.search(exponent):
            return False
        rest = text[end:].lstrip(" }")
        if rest.startswith("^"):  # a^b^c, {a^b}^c
            return False
        runs = _DIGIT_RUN.findall(exponent)
        if any(len(run) > MAX_EXPONENT_DIGITS for run in runs):
            return False
        value = max((int(run) for run in runs), default=1)
        exponent_product *= max(value, 1)
        largest_exponent = max(largest_exponent, value)
    if carets and max(longest, 1) * exponent_product > MAX_POWER_DIGITS:
        return False
    letters = set(re.findall(r"[A-Za-z]", _COMMAND.sub(" ", _TEXT_GROUP.sub(" ", text))))
    if letters:
        brackets = sum(text.count(bracket) for bracket in "([{")
        if len(letters) > MAX_VARIABLES or brackets > MAX_SYMBOLIC_BRACKETS:
            return False
        if len(carets) > 1 or largest_exponent > MAX_SYMBOLIC_EXPONENT:
            return False
    return True


class _NoTimeoutWarning:
    """Drops math-verify's one-time "Timeout is disabled" warning: we pass timeouts of None on purpose and
    guard the calls ourselves (see the module docstring)."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.cache
def _math_verify():
    """math-verify, imported on first use (sympy costs ~0.4 s; most runs of other tasks never need it)."""
    import logging

    import math_verify
    from math_verify import LatexExtractionConfig

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutWarning())
    # The first parse loads the LaTeX grammar (~0.4 s): do it here, once per process, so that the
    # first graded answer of a run is not timed out.
    math_verify.parse("$1$", parsing_timeout=None)
    # Every side is handed over as one LaTeX expression ("$...$"): plain-text extraction reads only the last
    # number ("2\sqrt{221}" -> 2, "[1, 2, 3]" -> 3), which would grade wrong answers as right.
    return math_verify, [LatexExtractionConfig()]


@functools.lru_cache(maxsize=8192)
def _parsed(text: str) -> tuple:
    """math-verify's parse of ``text`` as one LaTeX expression (no time limit here: the reward's deadline bounds it)."""
    module, config = _math_verify()
    return tuple(
        module.parse(f"${text}$", extraction_config=config, fallback_mode="no_fallback", parsing_timeout=None)
    )


def math_verify_equal(prediction: str, truth: str, precision: int | None = None) -> bool | None:
    """math-verify's verdict on two unwrapped answers: True/False, or None when either side is refused by
    ``safe_for_math_verify``, does not parse, or math-verify raises. No time limit here: the reward's deadline
    (``vlm_grpo_ma.task_api.reward_pool``) bounds it wherever it runs."""
    if not (safe_for_math_verify(prediction) and safe_for_math_verify(truth)):
        return None
    module, _ = _math_verify()

    try:
        gold, predicted = _parsed(truth), _parsed(prediction)
        if not gold or not predicted:
            return None
        rounding = precision if precision is not None else 6
        return bool(module.verify(list(gold), list(predicted), float_rounding=rounding, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - sympy raises many kinds of error on odd input: not equivalent
        return None


# ---------------------------------------------------------------------------------------------- reward


def is_text_answer(truth: str) -> bool:
    """A ground truth with letters but no digits and no LaTeX (``bread``, ``Yes``) is compared as text."""
    return not re.search(r"[\d\\]", truth) and bool(re.search(r"[A-Za-z]", truth))


# Forms of an answer that are wrong however its numbers compare (see "Answers that are not the answer" in the
# module docstring). All three patterns are linear: no quantifier is nested or next to another that can match
# the same characters.
_NEGATION = re.compile(
    r"(?<![A-Za-z])(?:not|no|never|none|cannot|wrong|false|incorrect|untrue)(?![A-Za-z])|n['’]t(?![A-Za-z])"
    r"|\\(?:neq?|not|neg|lnot)(?![A-Za-z])|[≠¬]",
    re.IGNORECASE,
)
_HEDGE = re.compile(
    r"\\approx|≈|≃|\\simeq|\\sim\s*[-+]?\d|(?<!\S)~\s*[-+]?\d"
    r"|(?<![A-Za-z])(?:about|approx|approximately|around|roughly|nearly|almost|circa|estimated)(?![A-Za-z])",
    re.IGNORECASE,
)
# "and"/"or" in words or in logic: "x=5 \lor x=6" names two values.
_LIST_WORD = re.compile(r"(?<![A-Za-z])(?:and|or)(?![A-Za-z])|\\(?:lor|land|vee|wedge)(?![A-Za-z])|[∨∧]", re.IGNORECASE)
# A relation between values ("5 = 6", "5 \equiv 6"): math-verify grades one side of it. Only "name = value"
# ("x = 6", "x_1 = 6", "\theta = 6") gives the answer.
_RELATION = re.compile(r"=|\\(?:equiv|cong)(?![A-Za-z])|[≡≅]")
_NAMED_VALUE = re.compile(r"\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?\s*=")
# A dollar sign that does not start a number ("$5" is a price): what is left of several math spans ("5$ $6",
# from "$5$ $6$"), of which math-verify grades any one.
_SPAN_BREAK = re.compile(r"(?<!\\)\$(?!\s*[-+−]?\d)")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _lists_values(text: str) -> bool:
    """Whether ``text`` lists several values: a comma or semicolon outside all brackets (thousands commas
    such as ``1,000`` aside), or the word "and"/"or"."""
    depth = 0
    for char in _THOUSANDS_COMMA.sub("", text):
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth <= 0 and char in ",;":
            return True
    return _LIST_WORD.search(text) is not None


def _one_value(text: str) -> bool:
    """A ground truth that is one value: no comma, semicolon, matrix cell or row, "and"/"or" anywhere."""
    return not re.search(r"[,;&]|\\\\", text) and _LIST_WORD.search(text) is None


def _relates_values(text: str) -> bool:
    """Whether ``text`` states a relation other than naming its value: "5 = 6", "5 \\equiv 6", "x = y = 6"."""
    relations = _RELATION.findall(text)
    return bool(relations) and not (len(relations) == 1 and relations[0] == "=" and _NAMED_VALUE.match(text))


def refused_form(prediction: str, truth: str, precision: int | None = None) -> bool:
    """Whether ``prediction`` is wrong by its form alone (after unwrapping): it negates ("not 6", "x \\neq 6",
    "\\neg 6", "6 is wrong") and the truth does not; it hedges ("\\approx 6", "about 6") and the truth is exact
    (no ``precision``, no hedge of its own); it relates values ("5 = 6", "5 \\equiv 6") and the truth does not;
    or it lists several values ("6, 6", "6 and 7", "x=5 \\lor x=6", "5$ $6") where the truth is one value."""
    if _NEGATION.search(prediction) and not _NEGATION.search(truth):
        return True
    if _HEDGE.search(prediction) and precision is None and not _HEDGE.search(truth):
        return True
    if _relates_values(prediction) and not _RELATION.search(truth):
        return True
    return _one_value(truth) and (_lists_values(prediction) or _SPAN_BREAK.search(prediction) is not None)


_FACTORIAL = re.compile(r"[\d)}\]]\s*!")
_BINOMIAL = re.compile(r"\\[dt]?binom(?![A-Za-z])|\\choose(?![A-Za-z])")


def applies_a_function(text: str) -> bool:
    """Whether ``text`` applies one of the functions the screen guards (``_GROWING``, a factorial, a binomial)
    to its numbers: its one number is then not its value (``\\Gamma(\\Gamma(5))`` is not 5). Other commands
    (``\\sqrt{5}``) pass the screen and math-verify judges them; formatting (``\\textbf{5}``) stays readable."""
    return any(pattern.search(text) for pattern in (_GROWING, _FACTORIAL, _BINOMIAL))


def is_equivalent(
    prediction: str, truth: str, precision: int | None = None, *, as_text: bool = False
) -> bool:
    """Whether answer ``prediction`` means ground truth ``truth`` (the four rules of the module docstring).

    Total on any input: malformed, hostile or non-finite predictions are simply not equivalent.
    """
    if not isinstance(prediction, str) or len(prediction) > 4 * MAX_ANSWER_CHARS:
        return False
    predicted, gold = unwrap_answer(prediction), unwrap_answer(str(truth))
    if not predicted or not gold or len(predicted) > MAX_ANSWER_CHARS:
        return False
    if as_text or is_text_answer(gold):
        return normalise_answer(predicted) == normalise_answer(gold) != ""
    if refused_form(predicted, gold, precision):
        return False
    gold_number, predicted_number = plain_number(gold), plain_number(predicted)
    if gold_number is not None and predicted_number is not None:
        return numbers_match(predicted_number, gold_number, precision)
    verdict = math_verify_equal(predicted, gold, precision)
    if verdict is not None:
        return verdict
    if applies_a_function(predicted):
        return False
    gold_number = gold_number if gold_number is not None else single_number(gold)
    predicted_number = predicted_number if predicted_number is not None else single_number(predicted)
    if gold_number is None or predicted_number is None:
        return False
    return numbers_match(predicted_number, gold_number, precision)


def prediction(completion: Completion, sample: Sample) -> str | None:
    """The text of the single ``<answer>`` tag, stripped; None when there is no single complete tag or it is
    blank (what the reward grades, for evaluation dumps)."""
    text = extract_tag(completion.text, "answer")
    if text is None or not text.strip():
        return None
    return text.strip()


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "accuracy", "format"}`` for one completion; never raises on model output.

    ``sample.answer`` is the ground-truth answer string; ``sample.meta`` may hold ``precision`` (decimal
    places) and ``answer_type`` (``"text"`` forces a text comparison).
    """
    answer = prediction(completion, sample)
    correct = answer is not None and is_equivalent(
        answer,
        sample.answer,
        sample.meta.get("precision"),
        as_text=sample.meta.get("answer_type") == "text",
    )
    parts = {
        "accuracy": float(correct),
        "format": float(answer is not None and has_think_answer_format(completion.text)),
    }
    reference_thought = sample.meta.get("reference_thought")
    if reference_thought is not None:
        parts["right_thought"] = float(right_thought(completion.text, reference_thought))
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


# ---------------------------------------------------------------------------------------------- loading


def load(split: str = "train", source: str | None = None, *, image_root: str | None = None) -> list[Sample]:
    """Math samples.

    ``source=None``: the embedded split ``data/math/{split}.jsonl`` (``split`` in EMBEDDED_SPLITS).
    Otherwise ``source`` is a local ``.jsonl``/``.json``/``.parquet`` file (a JSON file is a list of rows or a
    dict of rows keyed by id, as MathVista's ``testmini.json``) whose columns pick the schema (SCHEMAS, first
    match wins; ``split`` is then ignored):
      ``project``     {"id", "question", "answer", "images"?: [paths] (may be empty) or "image"?: path,
                      "precision"?: int, "answer_type"?: "text", "reference_thought"?: str};
      ``geometry3k``  Hugging Face ``hiyouga/geometry3k`` rows {images: [image cells], problem (with
                      "<image>", removed), answer, id?}; "Round to the nearest tenth/hundredth/thousandth"
                      in the problem sets the precision to 1/2/3;
      ``mathvista``   MathVista rows (parquet, JSON list, or ``testmini.json``); ``free_form`` rows only
                      (``multi_choice`` belongs to the vqa task); the image from ``decoded_image`` bytes,
                      else the ``image`` path; a hint from ``answer_type``/``precision`` is appended to the
                      question;
      ``gsm8k``       {question, answer}: the final answer follows "#### " (commas dropped); the worked
                      solution before it becomes ``meta["reference_thought"]``.
    Relative image paths resolve against ``image_root`` when given, else the data file's folder. Images are
    not opened here (bytes are wrapped in a lazily decoded PIL image). A sample without an image has
    ``images=()``. Each Sample: ``answer`` = the ground truth as a string; ``meta`` = {"source": schema name,
    "precision": int | None, and schema-specific fields ("reference_thought", "answer_type", "unit", ...)}.
    """
    if source is None:
        path = embedded_split_file(NAME, split, EMBEDDED_SPLITS, DATA_DIR, "python data/make_math.py")
    else:
        path = checked_source_file(source, NAME, SOURCE_SUFFIXES)
    rows = read_rows(path)
    schema = detect_schema(rows, path, SCHEMAS, NAME)
    loader = {
        "project": _project_sample,
        "geometry3k": _geometry3k_sample,
        "mathvista": _mathvista_sample,
        "gsm8k": _gsm8k_sample,
    }[schema]
    root = Path(image_root) if image_root is not None else path.parent
    samples = rows_to_samples(rows, lambda row, sample_id, where: loader(row, sample_id, root, where), path)
    if not samples and schema == "mathvista":
        raise ValueError(
            f"{path}: no MathVista rows with question_type 'free_form'; multi_choice rows belong to the vqa task"
        )
    return samples


def _images(cells: Any, root: Path, where: str) -> tuple:
    if cells is None:
        return ()
    if not isinstance(cells, list | tuple):
        raise ValueError(f"{where}: 'images' must be a list of images (paths or image cells), got {cells!r}")
    return tuple(image for image in (image_from_cell(cell, root, where) for cell in cells) if image is not None)


def _precision(value: Any, where: str) -> int | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
        raise ValueError(f"{where}: 'precision' must be a whole number of decimal places, got {value!r}")
    return int(value)


def _answer(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float) or not str(value).strip():
        raise ValueError(f"{where}: an answer must be a non-empty string or a number, got {value!r}")
    return str(value).strip()


def _sample(sample_id: str, question: str, images: tuple, answer: str, meta: dict) -> Sample:
    return Sample(task=NAME, id=sample_id, question=question.strip(), images=images, answer=answer, meta=meta)


def _project_sample(row: dict, sample_id: str, root: Path, where: str) -> Sample:
    """The project's JSONL (see ``data/make_math.py``); extra keys (``objects``, ``program``) are ignored."""
    require_keys(row, PROJECT_COLUMNS, where)
    if "images" in row:
        images = _images(row["images"], root, where)
    else:
        image = image_from_cell(row.get("image"), root, where)
        images = (image,) if image is not None else ()
    meta = {"source": "project", "precision": _precision(row.get("precision"), where)}
    meta.update({k: row[k] for k in ("answer_type", "reference_thought") if row.get(k)})
    return _sample(str(row["id"]), str(row["question"]), images, _answer(row["answer"], where), meta)


_ROUND_TO = re.compile(r"nearest\s+(tenth|hundredth|thousandth)", re.IGNORECASE)
_ROUNDING_PRECISION = {"tenth": 1, "hundredth": 2, "thousandth": 3}


def _geometry3k_sample(row: dict, sample_id: str, root: Path, where: str) -> Sample:
    require_keys(row, GEOMETRY3K_COLUMNS, where)
    problem = str(row["problem"]).replace("<image>", " ")
    rounding = _ROUND_TO.search(problem)
    meta = {
        "source": "geometry3k",
        # The answers are written at the asked rounding ("Round to the nearest tenth." -> "10.8"), so the
        # prediction is rounded the same way before it is compared.
        "precision": _ROUNDING_PRECISION[rounding.group(1).lower()] if rounding else None,
    }
    identifier = row.get("id")
    sample_id = str(identifier) if identifier is not None else sample_id
    return _sample(
        sample_id,
        " ".join(problem.split()),
        _images(row["images"], root, where),
        _answer(row["answer"], where),
        meta,
    )


def mathvista_hint(answer_type: str | None, precision: int | None) -> str:
    """The answer-form hint appended to a MathVista question (MathVista's own ``query`` carries a longer one
    that asks for the answer "at the end", which our instruction replaces)."""
    if answer_type == "integer":
        return "Answer with an integer."
    if answer_type == "float" and precision is not None:
        return f"Answer with a number with {precision} decimal place{'s' if precision != 1 else ''}."
    if answer_type == "float":
        return "Answer with a number."
    if answer_type == "list":
        return "Answer with a list, e.g. [1, 2, 3]."
    return ""


def _mathvista_sample(row: dict, sample_id: str, root: Path, where: str) -> Sample | None:
    require_keys(row, MATHVISTA_COLUMNS, where)
    if row["question_type"] != "free_form":
        return None
    precision = _precision(row.get("precision"), where)
    image = image_from_cell(row.get("decoded_image"), root, where) or image_from_cell(row.get("image"), root, where)
    meta = {
        "source": "mathvista",
        "precision": precision,
        "answer_type": row.get("answer_type"),
        "unit": row.get("unit") or None,
        # MathVista's own prompt, kept for comparison with its scorer; the model sees question + hint.
        "query": row.get("query"),
    }
    question = " ".join(
        part
        for part in (str(row["question"]).strip(), mathvista_hint(row.get("answer_type"), precision))
        if part
    )
    images = (image,) if image is not None else ()
    return _sample(str(row["pid"]), question, images, _answer(row["answer"], where), meta)


_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def _gsm8k_sample(row: dict, sample_id: str, root: Path, where: str) -> Sample:
    require_keys(row, GSM8K_COLUMNS, where)
    solution = str(row["answer"])
    if "####" not in solution:
        raise ValueError(
            f"{where}: a GSM8K answer must end with '#### <final answer>', got {solution[-60:]!r}"
        )
    worked, final = solution.rsplit("####", 1)
    final = final.strip().replace(",", "")
    if not final:
        raise ValueError(f"{where}: nothing after '####' in the GSM8K answer")
    meta = {"source": "gsm8k", "precision": None}
    # GSM8K's solutions carry calculator annotations ("<<48/2=24>>"), which are not reasoning text.
    thought = " ".join(_CALCULATOR_ANNOTATION.sub("", worked).split())
    if thought:
        meta["reference_thought"] = thought
    return _sample(sample_id, str(row["question"]), (), final, meta)


TASK = register_task(
    Task(
        name=NAME,
        load=load,
        reward=reward,
        instruction=INSTRUCTION,
        metrics=("accuracy", "format", "right_thought"),
        reward_weights=dict(REWARD_WEIGHTS),
        success="accuracy",
        parse=prediction,
    )
)
