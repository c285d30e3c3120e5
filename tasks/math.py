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
  2. both sides are read by the grammar of ``tasks/_math_grammar.py``,
     ``answer := [lead] [label relation] [hedge] [currency] value [unit]`` (``x = 5``, ``AB = 5``,
     ``m\\angle ABC = 30^\\circ``, ``\\text{Area} = 24``, ``$5``, ``12 cm``, "The answer is 12"); an answer
     whose form says it is not the answer is wrong whatever its numbers (below). Otherwise the values are
     compared, labels and units dropped (the whole answers when the truth is a relation such as ``x \\neq 6``).
  3. when both values are plain numbers (``1,000``, ``10\\,000``, ``-2.5``, ``1e3``) they are compared exactly
     as decimals, or, with ``meta["precision"] = p`` (MathVista's number of decimals), after rounding both
     half-up to p decimals;
  4. otherwise math-verify decides (``1/2`` == ``0.5`` == ``\\frac{1}{2}`` == ``\\boxed{\\frac12}``,
     ``2\\sqrt{221}`` == ``\\sqrt{884}``, matrices, vectors and tuples element by element), rounding floats to
     p decimals when a precision is given (6 otherwise, math-verify's default); its unit stripping is off
     (units are the grammar's), and two numbers that a 30-digit evaluation tells apart are unequal without
     it (``_numerically_apart``: sympy's simplify takes minutes on some, and calls ``\\sqrt{\\infty}`` 6);
  5. when math-verify cannot judge (a side does not parse, or the screen below refuses it), a value that is
     one number in redundant brackets (``((((((5))))))``, past the screen's nesting limit) is that number;
     anything else is wrong.
Answers longer than MAX_ANSWER_CHARS are wrong without being read: no ground truth is that long.

Answers that are not the answer (rule 2). Math-verify and a one-number fallback read the value out of an
answer whatever was written around it ("not 6", ``6 \\text{ is bogus}``, ``\\cancel{6}``, "perhaps 6" scored
as 6), and the word lists of negations and hedges that replaced them missed every word they did not list
while refusing labelled answers (``AB = 5``, ``f(2) = 6``) as relations. The grammar says instead what an
answer may be, and ``refusal`` names what breaks it; unless the truth has the same, an answer is wrong with
a character outside ASCII and a few math symbols (look-alike letters and digits), a LaTeX command outside
the grammar's list (``\\nequiv``, ``\\cancel``, ``\\neg``, ``\\lor``), a relation other than
"label = value" (``5 = 6``, ``x = y = 6``, ``x \\neq 6``), a stray ``$`` (``5$ $6``), several values
("6, 6"), a word in its value that is not a unit ("perhaps 6", "6 maybe", "6 and 7"), or a box that is not
its whole value (``7 \\boxed{6}``: math-verify reads only the box). A hedge
(``\\approx 6``, "~6", "about 6") is accepted only when the truth is approximate: ``meta["precision"]`` is
set (MathVista floats, Geometry3K's "round to the nearest tenth") or the truth hedges itself.

Guarding math-verify. Sympy can take minutes or exhaust memory on short hostile input (``9^{9^{9^{9}}}``,
``(10^{10})!``, ``\\binom{10^{10}}{10^{5}}``, ``(a+b+c+d)^{99}``, ``\\Gamma(\\Gamma(\\Gamma(5)))``), and much of
that time is spent inside single C-level big-integer operations that no timer can interrupt. So an answer
first has to pass a static screen (``safe_for_math_verify``: bounded length, nesting, digits, exponents,
factorials, binomials, and at most one function that grows faster than any power (``\\Gamma``, ``\\exp``,
the hyperbolic functions), of a short argument, with no power, factorial or binomial beside it);
``\\begin{...}``/``\\end{...}`` environment names are not variables. What the screen
lets through unbounded is bounded by the reward's deadline: every task reward runs in a worker process that is
killed when it passes ``rollout.reward_timeout_s`` (``vlm_grpo_ma/task_api/reward_pool.py``), in training and
evaluation alike, from any thread. (A SIGALRM timer used to guard the main thread only; it is gone.) The
screen lives in ``tasks/_math_grammar.py`` with the grammar; the measurements behind each limit are in the
comments at the limits. Every regex here and there is linear-time.

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

from tasks._math_grammar import (  # noqa: F401 - re-exported: the screen and unwrapping are math's API
    MAX_ANSWER_CHARS,
    read_answer,
    refusal,
    safe_for_math_verify,
    unwrap_answer,
)
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

# The longest digit run in a plain number: 40 digits is far past any benchmark answer and keeps Decimal work
# trivial.
MAX_NUMBER_DIGITS = 40


# ---------------------------------------------------------------------------------------------- numbers

# One plain number as a whole value (labels, currency and units are the grammar's): sign, digits (with
# optional thousands commas), decimals, exponent. ASCII digits only: a fullwidth "６" is a look-alike.
# nan/inf are not numbers here: a non-finite value matches nothing.
_PLAIN_NUMBER = re.compile(
    r"(?:(?P<sign>[-+−]) ?)?(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)"
    r"(?:[eE](?P<exponent>[-+]?\d{1,3}))?",
    re.ASCII,
)


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
    """``text`` (a value, as the grammar reads it) as one plain number, or None."""
    match = _PLAIN_NUMBER.fullmatch(text.strip())
    if match is None:
        return None
    return _decimal(match["sign"] or "", match["digits"], match["exponent"])


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


class _NoTimeoutWarning:
    """Drops math-verify's one-time "Timeout is disabled" warning: we pass timeouts of None on purpose and
    guard the calls ourselves (see the module docstring)."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.cache
def _math_verify():
    """math-verify, imported on first use (sympy costs ~0.4 s; most runs of other tasks never need it)."""
    import logging
    from dataclasses import replace

    import math_verify
    from math_verify import LatexExtractionConfig

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutWarning())
    # The first parse loads the LaTeX grammar (~0.4 s): do it here, once per process, so that the
    # first graded answer of a run is not timed out.
    math_verify.parse("$1$", parsing_timeout=None)
    # Every side is handed over as one LaTeX expression ("$...$"): plain-text extraction reads only the last
    # number ("2\sqrt{221}" -> 2, "[1, 2, 3]" -> 3), which would grade wrong answers as right. Units are the
    # grammar's: math-verify's own unit stripping drops whatever follows a number and looks like one ("6 d 7"
    # and "6\text{, 7}" were read as 6).
    units_off = replace(LatexExtractionConfig().normalization_config, units=False)
    return math_verify, [LatexExtractionConfig(normalization_config=units_off)]


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
        if _numerically_apart(gold[0], predicted[0], rounding):
            return False
        return bool(module.verify(list(gold), list(predicted), float_rounding=rounding, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - sympy raises many kinds of error on odd input: not equivalent
        return None


def _numerically_apart(gold, predicted, rounding: int) -> bool:
    """Whether two numbers (sympy expressions without free symbols) differ by more than ``rounding`` decimals
    allow, by a 30-digit evaluation (milliseconds). Math-verify ends in sympy's simplify, which takes minutes
    on numbers the screen lets through ("\\cos(\\frac{4\\pi}{99})^{99}": 430 s; "(\\sqrt2+\\sqrt3+\\sqrt5+
    \\sqrt7)^{99}": 50 s) and calls infinities equal to random numbers ("\\sqrt{\\infty}" = 6, by hash seed).
    Anything else (sets, relations, matrices, variables, NaN) is math-verify's alone."""
    from sympy import Expr

    if not (isinstance(gold, Expr) and isinstance(predicted, Expr)):
        return False
    if gold.free_symbols or predicted.free_symbols:
        return False
    try:
        gap = abs((gold - predicted).evalf(30))
        return bool(gap > 10**-rounding + abs(gold.evalf(30)) * 10**-20)
    except Exception:  # noqa: BLE001 - NaN (oo - oo) has no order; what sympy cannot evaluate, math-verify judges
        return False


# ---------------------------------------------------------------------------------------------- reward


def is_text_answer(truth: str) -> bool:
    """A ground truth with letters but no digits and no LaTeX (``bread``, ``Yes``) is compared as text."""
    return not re.search(r"[\d\\]", truth) and bool(re.search(r"[A-Za-z]", truth))


_REDUNDANT_BRACKETS = re.compile(r"[({]*[^(){}]*[)}]*")  # disjoint neighbours: linear


def _bracketed_number(value: str) -> Decimal | None:
    """A value that is one plain number inside redundant brackets (``((((((5))))))``), as that number."""
    if value.count("(") != value.count(")") or value.count("{") != value.count("}"):
        return None
    if not _REDUNDANT_BRACKETS.fullmatch(value):
        return None
    return plain_number(value.strip("(){} "))


def is_equivalent(
    prediction: str, truth: str, precision: int | None = None, *, as_text: bool = False
) -> bool:
    """Whether answer ``prediction`` means ground truth ``truth`` (the five rules of the module docstring).

    Total on any input: malformed, hostile or non-finite predictions are simply not equivalent.
    """
    if not isinstance(prediction, str) or len(prediction) > 4 * MAX_ANSWER_CHARS:
        return False
    predicted, gold = unwrap_answer(prediction), unwrap_answer(str(truth))
    if not predicted or not gold or len(predicted) > MAX_ANSWER_CHARS:
        return False
    if as_text or is_text_answer(gold):
        return normalise_answer(predicted) == normalise_answer(gold) != ""
    gold_form, form = read_answer(gold), read_answer(predicted)
    if refusal(form, gold_form, approximate=precision is not None) is not None:
        return False
    whole = form.relation or gold_form.relation  # "x \\neq 6": the relation is the answer
    predicted, gold = (form.text, gold_form.text) if whole else (form.value, gold_form.value)
    gold_number, predicted_number = plain_number(gold), plain_number(predicted)
    if gold_number is not None and predicted_number is not None:
        return numbers_match(predicted_number, gold_number, precision)
    verdict = math_verify_equal(predicted, gold, precision)
    if verdict is not None:
        return verdict
    gold_number, predicted_number = _bracketed_number(gold), _bracketed_number(predicted)
    return gold_number is not None and predicted_number is not None and numbers_match(
        predicted_number, gold_number, precision
    )


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
