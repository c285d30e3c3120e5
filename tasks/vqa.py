"""Visual question answering: multiple choice (answer with the option letter or its text) and short answer.

Reward parts (all in [0, 1]):
  ``accuracy``  1.0 when the single ``<answer>`` tag holds the right answer (rules below), else 0.0;
  ``format``    1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer is not
                blank, else 0.0;
  ``reward``    ``weighted_reward(parts, REWARD_WEIGHTS)``.

``accuracy`` does not require the format: an answer in a single ``<answer>`` tag is graded even when the
think part is missing or text surrounds the tags; the format part is what punishes those. No single complete
answer tag (absent, repeated, cut off) scores 0 on both parts.

Multiple choice (``sample.meta["kind"] == "multiple_choice"``). The answer is read every way it can be meant:
as a letter (``B``, ``(B)``, ``[B]``, ``B.``, ``B)``, ``B:``; upper case only, because a lone ``a`` is an
article as often as a letter), as a labelled option (``B. dog``, ``(B) dog``: the text must be option B's
text, otherwise the answer names two options), and as option text (compared like a short answer). It is
right when every reading that names an option names the correct one and at least one does. So ``A, B``,
``A or B``, ``AB`` and a letter past the last option name no option and are wrong, and ``B. cat`` with cat
option A names two options and is wrong.

Short answer (``"short_answer"``). Numbers are compared as numbers: ``3``, ``3.0``, ``three``, ``1,000``,
``1/2`` are read as numbers (nan/inf never match); with ``meta["precision"] = p`` (decimal places, as
MathVista gives them) a prediction is right when it is within half a unit of the p-th decimal (it rounds to
the truth; exact ties are not taken), otherwise within a relative 1e-6. Anything else is compared after
``normalise_short``: lower case, punctuation and the articles a/an/the dropped, whitespace collapsed, number
words zero..twenty and thirty..ninety written as digits.

Sources for ``load``: the installed ``easy-vqa`` package (``source=None``, splits train/test, offline) and
local files whose suffix (``.jsonl``, ``.json``, ``.parquet``) picks the container and whose columns pick
the schema: the project's JSONL, ScienceQA (Hugging Face ``derek-thomas/ScienceQA`` rows, or the original
``problems.json``), MathVista (``multi_choice`` rows only; free-form rows belong to the math task) and R1-V
CLEVR counting (``clevr_cogen_a_train``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from vlm_grpo_ma.task_api import (
    Completion,
    Sample,
    Task,
    checked_source_file,
    detect_schema,
    extract_tag,
    has_think_answer_format,
    image_from_cell,
    normalise_answer,
    read_rows,
    register_task,
    require_keys,
    rows_to_samples,
    weighted_reward,
)

NAME = "vqa"

# Short on purpose: the default model is tiny and every prompt token costs CPU time.
INSTRUCTION = (
    "Think in <think></think>, then put only the option letter or the short answer in <answer></answer>."
)

# Accuracy is the goal; the format bonus is half of a right answer so that a well-formed wrong answer still
# beats malformed output early in training (the same balance as grounding).
REWARD_WEIGHTS = {"accuracy": 1.0, "format": 0.5}

MULTIPLE_CHOICE = "multiple_choice"
SHORT_ANSWER = "short_answer"

EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# The columns that identify each file schema, checked in this order (the first whose columns are all
# present wins). The project's rows carry "id"; ScienceQA rows do not, so an "id" column means the project's
# schema (whose loader also reads a ScienceQA-style integer answer and image cell).
MATHVISTA_COLUMNS = ("pid", "question", "choices", "answer", "question_type")
R1V_CLEVR_COLUMNS = ("image", "problem", "solution")
PROJECT_COLUMNS = ("id", "question", "answer")
SCIENCEQA_COLUMNS = ("question", "choices", "answer")
SCHEMAS = {
    "mathvista": MATHVISTA_COLUMNS,
    "r1v_clevr": R1V_CLEVR_COLUMNS,
    "project": PROJECT_COLUMNS,
    "scienceqa": SCIENCEQA_COLUMNS,
}

# ScienceQA fields worth keeping for per-subject/grade breakdowns in evaluation.
SCIENCEQA_META = ("subject", "topic", "category", "skill", "grade")


def question_with_choices(question: str, choices: list[str] | tuple[str, ...], context: str = "") -> str:
    """The text the model sees before INSTRUCTION: optional ``Context: ...`` line, the question, then one
    ``A. option`` line per choice (none for a short-answer question)."""
    lines = [f"Context: {context.strip()}"] if context and context.strip() else []
    lines.append(question.strip())
    lines += [f"{LETTERS[i]}. {str(choice).strip()}" for i, choice in enumerate(choices)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- matching

_NUMBER_WORDS = {
    word: value
    for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
}
_NUMBER_WORDS.update(
    {word: 10 * tens for tens, word in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), 3)}
)

# A plain decimal number; nan/inf are deliberately not numbers here (a non-finite answer matches nothing).
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRACTION = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")

# Both patterns run on stripped text and never put two whitespace quantifiers side by side, so a long run
# of spaces in model output cannot make them backtrack quadratically.
# A letter alone, in brackets and/or with a trailing period/colon: "B", "(B)", "[B]", "B.", "B)", "B:".
_LETTER = re.compile(r"[(\[]?([A-Z])[)\]]?[.:]?")
# A letter label followed by text: "B. dog", "(B) dog", "B) dog", "B: dog" (not "B dog": "A cat" is an
# article and a noun, read as option text).
_LABELLED = re.compile(r"[(\[]?([A-Z])(?:[)\]][.:]?|[.:])\s+(\S.*)", re.DOTALL)


def as_number(text: str) -> float | None:
    """``text`` as one finite number, or None.

    Read: a plain decimal (``-3``, ``2.50``, ``1e3``, a trailing period ``3.``), thousands separators
    (``1,000``), a simple fraction (``1/2``) and one number word (``three``). Units, symbols, ``nan`` and
    ``inf`` make it not a number.
    """
    s = text.strip().lower()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].strip()
    if s in _NUMBER_WORDS:
        return float(_NUMBER_WORDS[s])
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    value = None
    if _PLAIN_NUMBER.fullmatch(s):
        value = float(s)
    else:
        fraction = _FRACTION.fullmatch(s)
        # float(), not int(): int() refuses strings over 4,300 digits; huge parts become inf and then fail
        # the finiteness check below.
        if fraction and float(fraction.group(2)) != 0.0:
            value = float(fraction.group(1)) / float(fraction.group(2))
    return value if value is not None and math.isfinite(value) else None


def numbers_match(prediction: float, truth: float, precision: int | None = None) -> bool:
    """True when ``prediction`` rounds to ``truth`` at ``precision`` decimals, or (no precision) is within a
    relative 1e-6 of it. A strict half-unit bound: a tie at exactly half a unit is not taken."""
    if not (math.isfinite(prediction) and math.isfinite(truth)):
        return False
    if precision is not None:
        return abs(prediction - truth) < 0.5 * 10.0 ** (-precision)
    return math.isclose(prediction, truth, rel_tol=1e-6, abs_tol=0.0)


def normalise_short(text: str) -> str:
    """``normalise_answer`` (lower case, no punctuation or articles, single spaces) with number words as digits."""
    return " ".join(str(_NUMBER_WORDS.get(token, token)) for token in normalise_answer(text).split())


def answers_match(prediction: str, truth: str, precision: int | None = None) -> bool:
    """Short-answer match: numerically when ``truth`` is a number, else by ``normalise_short`` (a blank
    prediction never matches)."""
    truth_number = as_number(truth)
    if truth_number is not None:
        prediction_number = as_number(prediction)
        return prediction_number is not None and numbers_match(prediction_number, truth_number, precision)
    truth_key = normalise_short(truth)
    if not truth_key:
        # A truth that normalises to nothing is an article or a symbol, such as the option "A" (the article
        # rule deletes it): compare it as written, ignoring case and surrounding space.
        return prediction.strip().lower() == truth.strip().lower() != ""
    return normalise_short(prediction) == truth_key


def chosen_options(answer: str, choices: list[str] | tuple[str, ...]) -> set[int] | None:
    """Indices of the options ``answer`` can be read as naming; None when it names an option inconsistently
    (a labelled answer ``B. text`` whose text is not option B's). See the module docstring."""
    answer = answer.strip()
    readings: set[int] = set()
    letter = _LETTER.fullmatch(answer)
    if letter and LETTERS.index(letter.group(1)) < len(choices):
        readings.add(LETTERS.index(letter.group(1)))
    labelled = _LABELLED.fullmatch(answer)
    if labelled:
        index = LETTERS.index(labelled.group(1))
        if index >= len(choices) or not answers_match(labelled.group(2), choices[index]):
            return None
        readings.add(index)
    # Option text is compared without the benchmark precision: an option is a value to name, not to round to.
    readings.update(i for i, choice in enumerate(choices) if answers_match(answer, str(choice)))
    return readings


def is_correct(answer: str, sample: Sample) -> bool:
    """Whether the answer text (the inside of the answer tag) is right for ``sample`` (either kind)."""
    if sample.meta["kind"] == MULTIPLE_CHOICE:
        readings = chosen_options(answer, sample.meta["choices"])
        return readings == {LETTERS.index(sample.answer)}
    return answers_match(answer, sample.answer, sample.meta.get("precision"))


# ---------------------------------------------------------------------------------------------- reward


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "accuracy", "format"}`` for one completion; never raises on model output.

    ``sample.answer`` is the correct letter (multiple choice) or the ground-truth string (short answer);
    ``sample.meta["kind"]`` says which, ``meta["choices"]`` holds the options and ``meta["precision"]``
    the decimal places numbers are compared at (None: relative 1e-6).
    """
    text = completion.text
    answer = extract_tag(text, "answer")
    answered = answer is not None and bool(answer.strip())
    parts = {
        "accuracy": float(answered and is_correct(answer, sample)),
        "format": float(answered and has_think_answer_format(text)),
    }
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def prediction(completion: Completion, sample: Sample) -> dict | None:
    """What the answer tag says, and for multiple choice the option letters it was read as."""
    answer = extract_tag(completion.text, "answer")
    if answer is None or not answer.strip():
        return None
    if sample.meta["kind"] == MULTIPLE_CHOICE:
        readings = chosen_options(answer, sample.meta["choices"]) or set()
        return {"answer": answer.strip(), "options": sorted(LETTERS[i] for i in readings)}
    return {"answer": answer.strip()}


# ---------------------------------------------------------------------------------------------- loading


def load(split: str = "train", source: str | None = None, *, image_root: str | None = None) -> list[Sample]:
    """VQA samples.

    ``source=None``: easy-vqa's ``split`` (in EMBEDDED_SPLITS) from the installed package: 38,575 train /
    9,673 test questions over 4,000 / 1,000 64x64 images, short answers from its 13 words.
    Otherwise ``source`` is a local ``.jsonl``/``.json``/``.parquet`` file; its columns pick the schema
    (SCHEMAS, first match wins):
      ``project``    {"id", "question", "answer", "image"?: path or HF image cell, "images"?: [paths],
                     "choices"?: [str], "precision"?: int}; with choices, "answer" is the option text, its
                     letter or its 0-based index; without, the short answer (numbers become strings);
      ``scienceqa``  Hugging Face ``derek-thomas/ScienceQA`` rows (image cell or None, question, choices,
                     answer index, hint, ...); or the original ``problems.json`` (a dict keyed by problem id,
                     rows filtered by ``split`` == their "split", images at ``images/{split}/{id}/{image}``
                     under ``image_root`` or the file's folder);
      ``mathvista``  MathVista rows (dict keyed by pid, or a list/parquet); ``multi_choice`` rows only,
                     "answer" being the option text; the image from ``decoded_image`` bytes, else ``image``;
      ``r1v_clevr``  R1-V CLEVR counting {image, problem, solution "<answer> 3 </answer>"}: short answer.
    ``split`` is ignored for files except ScienceQA's ``problems.json``. Relative image paths resolve against
    ``image_root`` when given, else the data file's folder. Images are not opened here (bytes are wrapped in
    a lazily decoded PIL image); a sample without an image has ``images=()``.
    Each Sample: ``answer`` = the correct letter ("B") or the short answer string; ``meta`` = {"kind":
    "multiple_choice" | "short_answer", "precision": int | None, "source": schema name, and for multiple
    choice "choices" (tuple of option texts) and "answer_text" (the correct option's text), plus
    schema-specific fields}.
    """
    if source is None:
        if split not in EMBEDDED_SPLITS:
            raise ValueError(
                f"unknown vqa split {split!r}; embedded (easy-vqa) splits: {', '.join(EMBEDDED_SPLITS)}"
            )
        return _load_easy_vqa(split)
    path = checked_source_file(source, NAME, SOURCE_SUFFIXES)
    rows = read_rows(path)
    keyed = bool(rows) and rows[0][0] is not None  # a JSON dict of rows keyed by id
    schema = detect_schema(rows, path, SCHEMAS, NAME)
    if schema == "scienceqa" and keyed:
        rows = _scienceqa_split(rows, split, path)
    loader = {
        "project": _project_sample,
        "scienceqa": _scienceqa_sample,
        "mathvista": _mathvista_sample,
        "r1v_clevr": _r1v_clevr_sample,
    }[schema]
    root = Path(image_root) if image_root is not None else path.parent
    if schema == "scienceqa" and keyed and image_root is None:
        root = path.parent / "images"
    samples = rows_to_samples(rows, lambda row, sample_id, where: loader(row, sample_id, root, where, keyed), path)
    if not samples and schema == "mathvista":
        raise ValueError(
            f"{path}: no MathVista rows with question_type 'multi_choice'; free-form rows belong to the math task"
        )
    return samples


def _scienceqa_split(rows: list[tuple[str | None, str, Any]], split: str, path: Path) -> list:
    splits = sorted({str(row.get("split")) for _, _, row in rows})
    kept = [(key, where, row) for key, where, row in rows if row.get("split") == split]
    if not kept:
        raise ValueError(
            f"{path}: no ScienceQA problems in split {split!r}; splits in the file: {', '.join(splits)}"
        )
    return kept


def _choices(values: Any, where: str) -> tuple[str, ...]:
    if not isinstance(values, list | tuple) or len(values) < 2:
        raise ValueError(f"{where}: 'choices' must be a list of at least 2 options, got {values!r}")
    if len(values) > len(LETTERS):
        raise ValueError(f"{where}: {len(values)} choices, more than the {len(LETTERS)} letters A-Z")
    return tuple(str(v).strip() for v in values)


def _answer_index(answer: Any, choices: tuple[str, ...], where: str) -> int:
    """The correct option from an index, an option text, or a letter (tried in that order)."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        if 0 <= answer < len(choices):
            return answer
    elif isinstance(answer, str):
        text = answer.strip()
        if text in choices:
            return choices.index(text)
        matches = [i for i, choice in enumerate(choices) if answers_match(text, choice)]
        if len(matches) == 1:
            return matches[0]
        if len(text) == 1 and text in LETTERS[: len(choices)]:
            return LETTERS.index(text)
    valid = ", ".join(f"{LETTERS[i]}/{i}/{c!r}" for i, c in enumerate(choices))
    raise ValueError(f"{where}: answer {answer!r} is not one of the choices (letter/index/text: {valid})")


def _precision(value: Any, where: str) -> int | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
        raise ValueError(f"{where}: 'precision' must be a whole number of decimal places, got {value!r}")
    return int(value)


def _multiple_choice(
    sample_id: str, question: str, choices: tuple[str, ...], index: int, images: tuple, meta: dict
) -> Sample:
    meta = {"kind": MULTIPLE_CHOICE, "choices": choices, "answer_text": choices[index], **meta}
    return Sample(task=NAME, id=sample_id, question=question, images=images, answer=LETTERS[index], meta=meta)


def _short_answer(
    sample_id: str, question: str, answer: Any, images: tuple, meta: dict, where: str
) -> Sample:
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
        raise ValueError(f"{where}: a short answer must be a non-empty string or a number, got {answer!r}")
    meta = {"kind": SHORT_ANSWER, **meta}
    return Sample(
        task=NAME,
        id=sample_id,
        question=question.strip(),
        images=images,
        answer=str(answer).strip(),
        meta=meta,
    )


def _project_sample(row: dict, sample_id: str, root: Path, where: str, keyed: bool) -> Sample:
    require_keys(row, PROJECT_COLUMNS, where)
    cells = row.get("images") or ([row["image"]] if row.get("image") else [])
    if not isinstance(cells, list | tuple):
        raise ValueError(f"{where}: 'images' must be a list of image paths, got {cells!r}")
    images = tuple(image for image in (image_from_cell(c, root, where) for c in cells) if image is not None)
    meta = {"source": "project", "precision": _precision(row.get("precision"), where)}
    if row.get("choices"):
        choices = _choices(row["choices"], where)
        index = _answer_index(row["answer"], choices, where)
        question = question_with_choices(str(row["question"]), choices)
        return _multiple_choice(str(row["id"]), question, choices, index, images, meta)
    return _short_answer(str(row["id"]), str(row["question"]), row["answer"], images, meta, where)


def _scienceqa_sample(row: dict, sample_id: str, root: Path, where: str, keyed: bool) -> Sample:
    require_keys(row, SCIENCEQA_COLUMNS, where)
    choices = _choices(row["choices"], where)
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(
            f"{where}: ScienceQA 'answer' must be an option index 0..{len(choices) - 1}, got {answer!r}"
        )
    cell = row.get("image")
    if keyed and isinstance(cell, str) and cell:
        cell = (
            f"{row.get('split')}/{sample_id}/{cell}"  # the original release: images/{split}/{pid}/image.png
        )
    image = image_from_cell(cell, root, where)
    meta = {"source": "scienceqa", "precision": None, **{k: row[k] for k in SCIENCEQA_META if row.get(k)}}
    question = question_with_choices(str(row["question"]), choices, context=str(row.get("hint") or ""))
    return _multiple_choice(sample_id, question, choices, answer, (image,) if image is not None else (), meta)


def _mathvista_sample(row: dict, sample_id: str, root: Path, where: str, keyed: bool) -> Sample | None:
    require_keys(row, MATHVISTA_COLUMNS, where)
    if row["question_type"] != "multi_choice":
        return None
    choices = _choices(row["choices"], where)
    index = _answer_index(row["answer"], choices, where)
    image = image_from_cell(row.get("decoded_image"), root, where) or image_from_cell(row.get("image"), root, where)
    meta = {
        "source": "mathvista",
        "precision": _precision(row.get("precision"), where),
        "answer_type": row.get("answer_type"),
        # MathVista's own prompt (hint + question + "(A) ..." choices), kept for comparison with its scorer;
        # the model sees question_with_choices instead, whose format matches the instruction.
        "query": row.get("query"),
    }
    question = question_with_choices(str(row["question"]), choices)
    return _multiple_choice(
        str(row["pid"]), question, choices, index, (image,) if image is not None else (), meta
    )


def _r1v_clevr_sample(row: dict, sample_id: str, root: Path, where: str, keyed: bool) -> Sample:
    require_keys(row, R1V_CLEVR_COLUMNS, where)
    solution = str(row["solution"])
    # R1-V's own accuracy reward takes the inside of <answer> when present, else the whole solution.
    tagged = extract_tag(solution, "answer")
    answer = (tagged if tagged is not None else solution).strip()
    image = image_from_cell(row["image"], root, where)
    question = str(row["problem"]).replace("<image>", "")
    meta = {"source": "r1v_clevr", "precision": None}
    return _short_answer(sample_id, question, answer, (image,) if image is not None else (), meta, where)


def _load_easy_vqa(split: str) -> list[Sample]:
    """easy-vqa from the installed package, offline. Images are referenced by absolute path, never opened
    (all are 64x64 PNGs); every answer is checked against the package's 13-word answer set."""
    import easy_vqa

    if split == "train":
        texts, answers, image_ids = easy_vqa.get_train_questions()
        paths = easy_vqa.get_train_image_paths()
    else:
        texts, answers, image_ids = easy_vqa.get_test_questions()
        paths = easy_vqa.get_test_image_paths()
    answer_set = frozenset(easy_vqa.get_answers())
    samples = []
    for index, (text, answer, image_id) in enumerate(zip(texts, answers, image_ids, strict=True)):
        if answer not in answer_set or image_id not in paths:
            raise ValueError(
                f"easy-vqa {split} question {index}: answer {answer!r} or image {image_id} is not in the package"
            )
        question = text[:1].upper() + text[1:]
        meta = {"kind": SHORT_ANSWER, "precision": None, "source": "easy-vqa", "image_id": image_id}
        samples.append(
            Sample(
                task=NAME,
                id=f"easy-vqa-{split}-{index}",
                question=question,
                images=(paths[image_id],),
                answer=answer,
                meta=meta,
            )
        )
    return samples


TASK = register_task(
    Task(
        name=NAME,
        load=load,
        reward=reward,
        instruction=INSTRUCTION,
        metrics=("accuracy", "format"),
        reward_weights=dict(REWARD_WEIGHTS),
        success="accuracy",
        parse=prediction,
    )
)
