"""Video question answering: a question about a clip, answered with an option letter or a number.

Reward parts (all in [0, 1]):
  ``accuracy``  1.0 when the single ``<answer>`` tag holds the right answer, else 0.0. Graded by the vqa task's
                rules (``tasks.vqa.is_correct``, one copy of them): multiple choice is right when every reading
                of the answer (letter, labelled option, option text) names the correct option and at least one
                does, so "A B C D", "A, B" or "A or B" score 0; numbers are compared as numbers ("3", "3.0",
                "three"), so "0 1 2 3" is no number and scores 0;
  ``format``    1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer is not
                blank, else 0.0;
  ``reward``    ``weighted_reward(parts, REWARD_WEIGHTS)``.

``accuracy`` does not require the format (the format part punishes text around the tags); no single complete
answer tag (absent, repeated, cut off) scores 0 on both parts.

Sources for ``load``: the embedded clips (``data/video``, made by ``data/make_video.py``: direction, first,
crossings), the project's JSONL/JSON rows, Video-R1's JSON (Video-R1-260k.json, Video-R1-COT-165k.json) and
NExT-QA's CSV (multiple choice). Samples keep their videos as paths; the trainer decodes each process's share
under the ``model.video_*`` budget and skips a missing or corrupt video with a count. Only a wrong root is an
error at load: when none of the first ROOT_CHECK_ROWS samples' files exist. A file that cannot be read as its
schema (not UTF-8, not CSV, a missing column) is an error naming the file and line; a row whose values do not
fit (a blank option, an answer not in its type's form, a NUL byte in a path) is skipped and counted
(``BadRow``: "malformed_rows"), logged once per file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from tasks.vqa import LETTERS, as_number, is_correct, question_with_choices
from vlm_grpo_ma.task_api import (
    PREDICTION_COLOUR,
    TRUTH_COLOUR,
    BadRow,
    Completion,
    FrameList,
    Sample,
    Task,
    checked_source_file,
    detect_schema,
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

NAME = "video"

# Short on purpose: every prompt token costs time, and a clip already costs many vision tokens.
INSTRUCTION = "Think in <think></think>, then put only the option letter or the number in <answer></answer>."

# Accuracy is the goal; the format bonus is half of a right answer (the vqa and grounding balance).
REWARD_WEIGHTS = {"accuracy": 1.0, "format": 0.5}

# The meta["kind"] values tasks.vqa.is_correct reads.
MULTIPLE_CHOICE = "multiple_choice"
SHORT_ANSWER = "short_answer"

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "video"
EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl", ".json", ".csv")

PROJECT_COLUMNS = ("id", "video", "question", "answer")
VIDEO_R1_COLUMNS = ("problem_id", "problem", "data_type", "problem_type", "solution", "path")
NEXTQA_COLUMNS = ("video", "question", "answer", "qid", "a0", "a1", "a2", "a3", "a4")
# Checked in this order by detect_schema (the first whose columns the first row has wins).
SCHEMAS = {"video_r1": VIDEO_R1_COLUMNS, "project": PROJECT_COLUMNS}

# Video-R1 problem types and how they are graded; "regression" (a number graded by closeness) has no exact
# answer for is_correct and is skipped, as is any type not listed.
VIDEO_R1_SHORT_TYPES = ("numerical", "ocr", "free-form")

# At load, a wrong root is told apart from a few missing files: none of this many samples' files existing is
# an error, anything less is left to the trainer's per-video skip.
ROOT_CHECK_ROWS = 20

# Placeholders some data sets leave in the question text (the prompt builder places the media itself).
_PLACEHOLDERS = re.compile(r"<(?:image|video)>")
# An option written with its label: "A. red", "(A) red", "A) red", "A: red".
_OPTION_LABEL = re.compile(r"\s*\(?([A-Z])[.):]\s*(.*)", re.DOTALL)
# A letter answer as data sets write it: "B", "B.", "(B)", "B. red" (the label only).
_ANSWER_LETTER = re.compile(r"\(?([A-Z])\)?(?:[.):](?:\s.*)?)?", re.DOTALL)


# ---------------------------------------------------------------------------------------------- reward


def parse(completion: Completion, sample: Sample) -> str | None:
    """The answer tag's text, stripped; None without a single complete, non-blank answer tag."""
    answer = extract_tag(completion.text, "answer")
    if answer is None or not answer.strip():
        return None
    return answer.strip()


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "accuracy", "format"}`` for one completion; never raises on model output.

    ``sample.answer`` is the correct letter (``meta["kind"] == "multiple_choice"``, ``meta["choices"]`` the
    option texts) or the short answer (``"short_answer"``, numbers compared as numbers)."""
    answer = parse(completion, sample)
    parts = {
        "accuracy": float(answer is not None and is_correct(answer, sample)),
        "format": float(answer is not None and has_think_answer_format(completion.text)),
    }
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def _fit(draw: ImageDraw.ImageDraw, text: str, font: Any, width: float) -> str:
    """``text`` cut (with "...") to fit ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def draw(image: Image.Image, sample: Sample, prediction: str | None) -> Image.Image:
    """A new image: ``image`` (the clip's frame strip) over a white band of three lines: the question (on one
    line, cut to fit), "answer: <prediction>" in PREDICTION_COLOUR and "truth: <answer>" in TRUTH_COLOUR."""
    font = ImageFont.load_default()
    line_height = font.getbbox("Ag")[3] + 4
    band = 3 * line_height + 6
    strip = image.convert("RGB")
    out = Image.new("RGB", (strip.width, strip.height + band), (255, 255, 255))
    out.paste(strip, (0, 0))
    pen = ImageDraw.Draw(out)
    truth = str(sample.answer)
    if sample.meta.get("answer_text"):
        truth += f" ({sample.meta['answer_text']})"
    lines = [
        (" ".join(sample.question.split()), (0, 0, 0)),
        (f"answer: {prediction if prediction is not None else '(none)'}", PREDICTION_COLOUR),
        (f"truth: {truth}", TRUTH_COLOUR),
    ]
    for row, (text, colour) in enumerate(lines):
        text = _fit(pen, text, font, strip.width - 6)
        pen.text((3, strip.height + 3 + row * line_height), text, fill=colour, font=font)
    return out


# ---------------------------------------------------------------------------------------------- samples


def _multiple_choice(sample_id: str, stem: str, choices: tuple[str, ...], index: int, media: dict, meta: dict) -> Sample:
    """A multiple-choice sample with the meta tasks.vqa.is_correct reads; the model sees the options under the
    stem, lettered A, B, ..."""
    meta = {"kind": MULTIPLE_CHOICE, "choices": choices, "answer_text": choices[index], "precision": None, **meta}
    question = question_with_choices(stem, choices)
    return Sample(task=NAME, id=sample_id, question=question, answer=LETTERS[index], meta=meta, **media)


def _short_answer(sample_id: str, stem: str, answer: Any, media: dict, meta: dict, where: str) -> Sample:
    """A short-answer sample; BadRow (the row is skipped) for an answer that is blank, not a string or a number,
    or a non-finite number (JSON's NaN, "inf": no model answer could match it, or "nan" would)."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
        raise BadRow(f"{where}: a short answer must be a non-empty string or a number, got {answer!r}")
    try:
        finite = math.isfinite(float(answer))
    except (ValueError, OverflowError):  # text, or an integer past float's range: not a non-finite number
        finite = True
    if not finite:
        raise BadRow(f"{where}: a short answer must be a finite number or text, got {answer!r}")
    meta = {"kind": SHORT_ANSWER, "precision": None, **meta}
    return Sample(task=NAME, id=sample_id, question=stem.strip(), answer=str(answer).strip(), meta=meta, **media)


def _choices(values: Any, where: str) -> tuple[str, ...]:
    """The option texts; BadRow (the row is skipped) unless 2 to len(LETTERS) options, none of them blank or
    missing (a None would be the option "None")."""
    if not isinstance(values, list | tuple) or len(values) < 2 or len(values) > len(LETTERS):
        raise BadRow(f"{where}: 'choices' must be a list of 2 to {len(LETTERS)} options, got {values!r}")
    if any(value is None or not str(value).strip() for value in values):
        raise BadRow(f"{where}: an option is blank or missing: {values!r}")
    return tuple(str(value).strip() for value in values)


def _choice_index(answer: Any, choices: tuple[str, ...], where: str) -> int:
    """The correct option from a letter ("B", "(B)", "B."), an option text, or a 0-based index."""
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        return answer
    if isinstance(answer, str):
        text = answer.strip()
        if text in choices:
            return choices.index(text)
        letter = _ANSWER_LETTER.fullmatch(text)
        if letter and LETTERS.index(letter.group(1)) < len(choices):
            return LETTERS.index(letter.group(1))
    valid = ", ".join(f"{LETTERS[i]}/{i}/{choice!r}" for i, choice in enumerate(choices))
    raise BadRow(f"{where}: answer {answer!r} is not one of the choices (letter/index/text: {valid})")


def _media_path(reference: Any, root: Path, where: str, key: str) -> str:
    """The absolute path of a row's file; BadRow (the row is skipped) for a blank one or one with a NUL byte
    (``resolved_path``)."""
    if not isinstance(reference, str) or not reference.strip():
        raise BadRow(f"{where}: {key!r} must be a file path, got {reference!r}")
    return resolved_path(reference, root, where)


def _question(text: Any, where: str) -> str:
    """The question without media placeholders; BadRow (the row is skipped) when nothing is left."""
    question = _PLACEHOLDERS.sub("", str(text if text is not None else "")).strip()
    if not question:
        raise BadRow(f"{where}: the question is blank: {text!r}")
    return question


# ---------------------------------------------------------------------------------------------- schemas


def _project_sample(row: dict, sample_id: str, root: Path, where: str) -> Sample:
    """{"id", "video": path or [frame paths], "question", "answer", "choices"?, "kind"?, "reference_thought"?,
    "fps"?, "frames"?}: with choices, "answer" is the letter, the option text or its index; without, the
    short answer (a number or text)."""
    require_keys(row, PROJECT_COLUMNS, where)
    video = row["video"]
    if isinstance(video, list) and video:
        frames = [_media_path(frame, root, where, "video") for frame in video]
        try:  # the row's "fps" is its frames' rate (none: the model's video_fps apart)
            media = {"images": (), "videos": (FrameList(frames, fps=row.get("fps")),)}
        except ValueError as error:  # not a positive number: the row is skipped and counted
            raise BadRow(f"{where}: {error}") from None
    else:
        media = {"images": (), "videos": (_media_path(video, root, where, "video"),)}
    meta = {"source": "project", **{key: row[key] for key in ("reference_thought", "fps", "frames") if key in row}}
    if "kind" in row:
        meta["clip_kind"] = row["kind"]  # the embedded clips' question kind (meta["kind"] is the grading kind)
    if row.get("choices"):
        choices = _choices(row["choices"], where)
        index = _choice_index(row["answer"], choices, where)
        return _multiple_choice(str(row["id"]), _question(row["question"], where), choices, index, media, meta)
    return _short_answer(str(row["id"]), _question(row["question"], where), row["answer"], media, meta, where)


def _video_r1_options(values: Any, where: str) -> tuple[str, ...]:
    """Video-R1's ["A. red", "B. blue"] -> ("red", "blue") (labels dropped; the task letters them again)."""
    choices = _choices(values, where)
    texts = []
    for i, choice in enumerate(choices):
        labelled = _OPTION_LABEL.fullmatch(choice)
        texts.append(labelled.group(2).strip() if labelled and labelled.group(1) == LETTERS[i] else choice)
    return tuple(texts)


def _video_r1_sample(row: dict, sample_id: str, root: Path, where: str) -> Sample:
    """A Video-R1 row: "problem_type" picks the grading, "data_type" whether "path" is a video or an image.
    BadRow (skipped and counted) for a type without an exact answer ("unsupported_rows") and for a row whose
    values do not fit its type ("malformed_rows": a numerical solution that is no number, such as "[1]")."""
    require_keys(row, VIDEO_R1_COLUMNS, where)
    problem_type = str(row["problem_type"]).strip().lower()
    if problem_type != "multiple choice" and problem_type not in VIDEO_R1_SHORT_TYPES:
        raise BadRow(f"{where}: problem_type {row['problem_type']!r} has no exact answer to grade", "unsupported_rows")
    data_type = str(row["data_type"]).strip().lower()
    path = _media_path(row["path"], root, where, "path")
    if data_type == "video":
        media = {"images": (), "videos": (path,)}
    elif data_type == "image":
        media = {"images": (path,), "videos": ()}
    else:
        raise BadRow(f"{where}: 'data_type' must be 'video' or 'image', got {row['data_type']!r}")
    solution = row["solution"]
    if isinstance(solution, bool) or not isinstance(solution, str | int | float):  # a list [1], null, ...
        raise BadRow(f"{where}: a solution must be text or a number, got {solution!r}")
    solution = str(solution)
    tagged = extract_tag(solution, "answer")  # "<answer>B</answer>"; a bare solution is taken whole
    answer = (tagged if tagged is not None else solution).strip()
    meta = {"source": "video-r1", "problem_type": problem_type, "data_source": row.get("data_source")}
    # The file's id (deduplicated in load); sample_id (the row's place) is not used.
    problem_id = str(row["problem_id"])
    if problem_type == "multiple choice":
        if "options" not in row:
            raise BadRow(f"{where}: a multiple choice row needs 'options'")
        choices = _video_r1_options(row["options"], where)
        index = _choice_index(answer, choices, where)
        return _multiple_choice(problem_id, _question(row["problem"], where), choices, index, media, meta)
    if problem_type == "numerical" and as_number(answer) is None:  # graded as a number: it must be one
        raise BadRow(f"{where}: a numerical solution must be a number, got {answer!r}")
    return _short_answer(problem_id, _question(row["problem"], where), answer, media, meta, where)


def _nextqa_samples(path: Path, video_root: str | None) -> tuple[list[Sample], Path]:
    """NExT-QA's CSV (video, frame_count, width, height, question, answer, qid, type, a0..a4): multiple choice
    with 5 options, "answer" the index of the right one, the clip at ``{root}/{video}.mp4``."""
    rows = read_rows(path)  # ValueError naming the file and line: not UTF-8, not CSV
    if not rows:
        raise ValueError(f"{path}: no rows")
    root = Path(video_root) if video_root is not None else _nextqa_root(path, rows)
    samples = rows_to_samples(rows, lambda row, sample_id, where: _nextqa_sample(row, root, where), path)
    return samples, root


def _nextqa_sample(row: dict, root: Path, where: str) -> Sample:
    """One NExT-QA row; BadRow (skipped and counted) for a row of more or fewer fields than the header (an
    unquoted comma in a question), a blank option, an answer that is not an index 0..4 ("nan"), a blank question
    or video name."""
    require_keys(row, NEXTQA_COLUMNS, where)
    extra, missing = row.get(None) or [], [key for key, value in row.items() if value is None]
    if extra or missing:  # csv.DictReader's reading of a short or long row: str(None) would be the option "None"
        header = len(row) - (None in row)
        raise BadRow(f"{where}: {header - len(missing) + len(extra)} fields under a header of {header}")
    choices = _choices([row[f"a{i}"] for i in range(5)], where)
    try:
        index = int(row["answer"].strip())
    except ValueError:
        index = -1
    if not 0 <= index < 5:
        raise BadRow(f"{where}: NExT-QA 'answer' must be an option index 0..4, got {row['answer']!r}")
    stem = _question(row["question"], where)
    stem = stem[:1].upper() + stem[1:]
    if not stem.endswith("?"):
        stem += "?"
    if not row["video"].strip():
        raise BadRow(f"{where}: 'video' must name a clip, got {row['video']!r}")
    media = {"images": (), "videos": (_media_path(f"{row['video']}.mp4", root, where, "video"),)}
    meta = {"source": "nextqa", "question_type": row.get("type"), "video_id": row["video"]}
    return _multiple_choice(f"nextqa-{row['video']}-{row['qid']}", stem, choices, index, media, meta)


def _nextqa_root(path: Path, rows: list[tuple[str | None, str, dict]]) -> Path:
    """The CSV's folder, or its ``videos/`` subfolder when that holds the first rows' clips and the folder does
    not."""
    names = [f"{row.get('video')}.mp4" for _, _, row in rows[:ROOT_CHECK_ROWS]]
    for candidate in (path.parent, path.parent / "videos"):
        if any((candidate / name).is_file() for name in names):
            return candidate
    return path.parent


# ---------------------------------------------------------------------------------------------- loading


def load(split: str = "train", source: str | None = None, *, video_root: str | None = None) -> list[Sample]:
    """Video samples (videos and images kept as absolute paths, never decoded here).

    ``source=None``: the embedded ``data/video/{split}.jsonl`` (``split`` in EMBEDDED_SPLITS). Otherwise a
    local file (``split`` is ignored):
      ``.jsonl``/``.json``  the project's rows {"id", "video", "question", "answer", "choices"?, ...} (see
                   ``data/make_video.py``), or Video-R1's JSON list {"problem_id", "problem", "data_type",
                   "problem_type", "options", "solution", "path", "data_source"}: "multiple choice" -> the
                   letter, "numerical" -> a number, "OCR"/"free-form" -> text (exact after normalising, where
                   Video-R1 scores these by overlap); "regression" and unknown types are skipped and counted
                   (``unsupported_rows``); "image" rows become image samples;
      ``.csv``     NExT-QA's multiple choice CSV (5 options).
    Relative paths resolve against ``video_root`` when given, else the data file's folder (NExT-QA: the
    CSV's folder, or its ``videos/`` subfolder when that holds the clips). FileNotFoundError when none of the
    first ROOT_CHECK_ROWS samples' files exist (a wrong root), naming the root and the first missing file;
    ValueError naming the file and line for a file that is not UTF-8 or not CSV, or a row without a column of
    its schema. A row with a value its type cannot use (a blank or missing option, a numerical answer that is
    no number, NaN, an answer index outside 0..4, a NUL byte in a path) is skipped and counted
    (``malformed_rows``); a file of nothing else is a ValueError. Each Sample: ``answer`` = the correct letter
    or the short answer; ``meta`` = {"kind": "multiple_choice" | "short_answer", "choices", "answer_text"
    (multiple choice), "precision": None, "source", ...}.
    """
    if source is None:
        path = embedded_split_file(NAME, split, EMBEDDED_SPLITS, DATA_DIR, "python data/make_video.py")
        source_path, schema = path, "project"
        rows = read_rows(path)
    else:
        source_path = checked_source_file(source, NAME, SOURCE_SUFFIXES)
        if source_path.suffix.lower() == ".csv":
            samples, root = _nextqa_samples(source_path, video_root)
            _check_root(samples, root, source_path)
            return samples
        rows = read_rows(source_path)
        schema = detect_schema(rows, source_path, SCHEMAS, NAME)
    root = Path(video_root) if video_root is not None else source_path.parent
    make = _video_r1_sample if schema == "video_r1" else _project_sample
    samples = rows_to_samples(rows, lambda row, sample_id, where: make(row, sample_id, root, where), source_path)
    if schema == "video_r1":
        samples = _unique_ids(samples)
    _check_root(samples, root, source_path)
    return samples


def _unique_ids(samples: list[Sample]) -> list[Sample]:
    """Video-R1's problem ids, made unique by order of appearance: the second "17" becomes "17#2" (stable
    for one file)."""
    seen: dict[str, int] = {}
    unique = []
    for sample in samples:
        seen[sample.id] = seen.get(sample.id, 0) + 1
        if seen[sample.id] > 1:
            sample = dataclasses.replace(sample, id=f"{sample.id}#{seen[sample.id]}")
        unique.append(sample)
    return unique


def _media_files(sample: Sample) -> list[str]:
    """The file paths a sample points at (a frame list counts by its first frame)."""
    files = []
    for video in sample.videos:
        first = video[0] if isinstance(video, list | tuple) and video else video
        if isinstance(first, str):
            files.append(first)
    files += [image for image in sample.images if isinstance(image, str)]
    return files


def _check_root(samples: list[Sample], root: Path, source: Path) -> None:
    """FileNotFoundError when none of the first ROOT_CHECK_ROWS samples' files exist: the root is wrong."""
    files = [file for sample in samples[:ROOT_CHECK_ROWS] for file in _media_files(sample)]
    if files and not any(Path(file).is_file() for file in files):
        raise FileNotFoundError(
            f"{source}: none of the first {min(len(samples), ROOT_CHECK_ROWS)} samples' video/image files exist "
            f"under {root.resolve()} (first missing: {files[0]}); relative paths resolve against the data file's "
            "folder: put the file where its paths start (from Python: load(..., video_root=FOLDER))"
        )


TASK = register_task(
    Task(
        name=NAME,
        load=load,
        reward=reward,
        instruction=INSTRUCTION,
        metrics=("accuracy", "format"),
        reward_weights=dict(REWARD_WEIGHTS),
        success="accuracy",
        parse=parse,
        draw=draw,
    )
)
