"""Open visual question answering: a free-form question about an image ("What is unusual in this picture?"),
answered in free text and graded by the run's served judge against several reference phrasings (docs/JUDGE.md).

Reward parts (all in [0, 1]):
  ``accuracy``  the judge's verdict (``completion.judgement``: 1.0 when the answer means what a reference
                answer means, 0.0 when not, in between for a ``score`` judge); 0.0 when the judge gave none
                (failed, timed out, unreadable) and always 0.0 without a single non-blank ``<answer>`` tag,
                whatever ``judgement`` holds: only an answer the judge was asked about can pay;
  ``format``    1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer is not
                blank, else 0.0;
  ``reward``    ``weighted_reward(parts, REWARD_WEIGHTS)``.

The judge is asked (``judge_query``) about the text of the single ``<answer>`` tag, the question without the
instruction, every reference and the image's path (sent when ``judge.send_images`` is on). No single complete
answer tag (absent, repeated, cut off) or a blank one asks nothing and scores 0 on both parts. ``accuracy``
does not require the format: the format part is what punishes text around the tags.

Sources for ``load``: the embedded synthetic scenes (``data/vqa_open``, made by ``data/make_vqa_open.py``:
odd one out, the object in the middle, what the shapes have in common, the background) and local JSONL files
of the same rows: {"id", "image": path (relative to the file's folder), "question", "references": [str, ...],
"thought"?: a reference thought, "kind"?}. A row with a missing key, a blank question, no usable reference
or an image file that is not there is skipped and counted (``BadRow``: "malformed_rows", "broken_images"),
logged once per file; a file whose every row is skipped is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlm_grpo_ma.task_api import (
    BadRow,
    Completion,
    JudgeQuery,
    Sample,
    Task,
    checked_source_file,
    embedded_split_file,
    extract_tag,
    has_think_answer_format,
    read_rows,
    register_task,
    require_keys,
    resolved_path,
    rows_to_samples,
    weighted_reward,
)

NAME = "vqa_open"

# Short on purpose: the default model is tiny and every prompt token costs CPU time.
INSTRUCTION = "Think in <think></think>, then put a short answer in words in <answer></answer>."

# Accuracy is the goal; the format bonus is half of a right answer (the same balance as vqa and grounding).
REWARD_WEIGHTS = {"accuracy": 1.0, "format": 0.5}

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "vqa_open"
EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl",)
COLUMNS = ("id", "image", "question", "references")

# The thought of ``target`` for a row without one.
DEFAULT_THOUGHT = "I look at the picture and answer the question."


# ---------------------------------------------------------------------------------------------- reward


def answer_text(completion: Completion) -> str | None:
    """The text of the single ``<answer>`` tag, or None when there is no single complete one or it is blank."""
    answer = extract_tag(completion.text, "answer")
    return answer if answer is not None and answer.strip() else None


def judge_query(completion: Completion, sample: Sample) -> JudgeQuery | None:
    """What the judge is asked about ``completion``: the question, the references, the answer tag's text and
    the image's path; None (nothing asked, accuracy 0) without an answer to judge (``answer_text``)."""
    answer = answer_text(completion)
    if answer is None:
        return None
    image = str(sample.images[0]) if sample.images else None
    return JudgeQuery(question=sample.question, references=tuple(sample.answer), answer=answer, image=image)


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "accuracy", "format"}`` for one completion; never raises on model output.

    ``sample.answer`` is the tuple of reference answers (the judge's business); ``completion.judgement`` the
    judge's verdict on the answer tag, or None."""
    answered = answer_text(completion) is not None
    parts = {
        "accuracy": float(completion.judgement or 0.0) if answered else 0.0,
        "format": float(answered and has_think_answer_format(completion.text)),
    }
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def prediction(completion: Completion, sample: Sample) -> dict | None:
    """What the answer tag says, as the judge was asked it."""
    answer = answer_text(completion)
    return None if answer is None else {"answer": answer.strip()}


def target(sample: Sample) -> str:
    """The reference thought (a template where the row has none) and the first reference answer."""
    thought = sample.meta.get("thought") or DEFAULT_THOUGHT
    return f"<think>{thought}</think><answer>{sample.answer[0]}</answer>"


# ---------------------------------------------------------------------------------------------- loading


def load(split: str = "train", source: str | None = None) -> list[Sample]:
    """Open VQA samples.

    ``source=None``: the embedded split ``data/vqa_open/{split}.jsonl`` (``split`` in EMBEDDED_SPLITS); else
    ``source`` is a local ``.jsonl`` file of the same rows (``split`` is then ignored). Image paths resolve
    against the data file's folder. Each Sample: ``answer`` = the references (a tuple of str), ``images`` =
    (absolute path str,) (a path, so that the judge can send the file), ``meta`` = {"thought"?, "kind"?}.
    """
    if source is None:
        path = embedded_split_file(NAME, split, EMBEDDED_SPLITS, DATA_DIR, "python data/make_vqa_open.py")
    else:
        path = checked_source_file(source, NAME, SOURCE_SUFFIXES)
    return rows_to_samples(
        read_rows(path), lambda row, sample_id, where: _sample(row, path.parent, where), path
    )


def _text(value: Any, where: str, key: str) -> str:
    """``value`` stripped; BadRow (the row is skipped) unless it is a non-blank string."""
    if not isinstance(value, str) or not value.strip():
        raise BadRow(f"{where}: {key!r} must be non-blank text, got {value!r}")
    return value.strip()


def _sample(row: dict, root: Path, where: str) -> Sample:
    try:
        require_keys(row, COLUMNS, where)
    except ValueError as error:  # one row without a key is a malformed row; every row without it, a bad file
        raise BadRow(str(error)) from None
    references = row["references"]
    if not isinstance(references, list) or not references:
        raise BadRow(f"{where}: 'references' must be a non-empty list of answers, got {references!r}")
    references = tuple(_text(reference, where, "references") for reference in references)
    image = resolved_path(_text(row["image"], where, "image"), root, where)
    if not Path(image).is_file():
        raise BadRow(f"{where}: image file not found: {image}", "broken_images")
    meta = {key: _text(row[key], where, key) for key in ("thought", "kind") if row.get(key) is not None}
    return Sample(task=NAME, id=_text(str(row["id"]), where, "id"), question=_text(row["question"], where, "question"),
                  images=(image,), answer=references, meta=meta)  # fmt: skip


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
        target=target,
        judge_query=judge_query,
    )
)
