"""Thinking with images: answer about a detail too small to read at the model's resolution; the thought may zoom.

The thought may call ``image_zoom_in_tool`` (``ZOOM_TOOL``) between ``<tool_call>`` and ``</tool_call>``; the crop
of the ORIGINAL image comes back as a new turn and the thought goes on (docs/TASKS.md, "Tools").

Reward parts (all in [0, 1]):
  ``accuracy``  1.0 when the single ``<answer>`` tag holds the right answer, graded by the vqa task's rules
                (``tasks.vqa.is_correct``, one copy of them): a colour word compared after normalising (case,
                punctuation, articles), so "red or blue" and "red, blue" name no one colour and score 0; for the
                multiple-choice benchmarks the option letter or the option's text, where "A B C D" or "A or B"
                names no one option and scores 0;
  ``format``    1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer is not blank
                (the thought holds the tool turns' text between its tags), else 0.0;
  ``tool``      1.0 when the answer is right AND a tool returned an image in the thought
                (``completion.tool_images > 0``), else 0.0: DeepEyes' conditional bonus, which pays only for looks
                that led to a right answer (a bonus per call pays for calls whether or not they help);
  ``looked``    1.0 when a tool returned an image, right or wrong: logged, not rewarded;
  ``crop_hit``  only for samples whose target box is known (the embedded scenes): 1.0 when some crop the thought
                saw holds the whole target box: logged, not rewarded (did it look in the right place);
  ``reward``    ``weighted_reward(parts, REWARD_WEIGHTS)``.

``accuracy`` does not require the format (the format part punishes text around the tags); no single complete
answer tag (absent, repeated, cut off) scores 0 on accuracy, format and tool.

Sources for ``load``: the embedded scenes (``data/zoom``, made by ``data/make_zoom.py``: "What colour is the small
shape inside the frame?" on a 672x672 scene the model sees at 168x168), a folder or ``.jsonl`` of rows in their
format, V* Bench (``craigwu/vstar_bench``: ``test_questions.jsonl`` or its folder; lmms-lab's parquet copy too)
and HR-Bench (``DreamMr/HR-Bench``: ``hr_bench_4k``/``hr_bench_8k`` as ``.parquet`` or ``.tsv``, images in base64).
A file that cannot be read as its schema (not UTF-8, a missing column) is an error naming it; a row whose values
do not fit (no options, an answer that is no option, a blank question, base64 that is not) is skipped and counted
(``BadRow``: "malformed_rows"), and one whose image bytes are unreadable too ("broken_images").
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import zlib
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.vqa import LETTERS, is_correct, question_with_choices
from vlm_grpo_ma.task_api import (
    PREDICTION_COLOUR,
    TRUTH_COLOUR,
    ZOOM_TOOL,
    BadRow,
    Completion,
    Sample,
    Task,
    ToolContext,
    checked_source_file,
    detect_schema,
    draw_marks,
    embedded_split_file,
    extract_tag,
    has_think_answer_format,
    image_from_cell,
    open_lazily,
    read_rows,
    register_task,
    rows_to_samples,
    weighted_reward,
)

NAME = "zoom"

# The call written out: the chat template declares the tool too, but the embedded model reads only the prompt.
INSTRUCTION = (
    "Think in <think></think>; inside it you may zoom in with "
    '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [x1, y1, x2, y2]}}</tool_call>. '
    "Then put only the answer word or option letter in <answer></answer>."
)

# Accuracy is the goal; the format bonus is half of a right answer (the vqa and grounding balance); the tool bonus
# is half again, paid only on a right answer that looked.
REWARD_WEIGHTS = {"accuracy": 1.0, "format": 0.5, "tool": 0.5}

# The meta["kind"] values tasks.vqa.is_correct reads.
MULTIPLE_CHOICE = "multiple_choice"
SHORT_ANSWER = "short_answer"

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "zoom"
EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl", ".parquet", ".tsv")
VSTAR_QUESTIONS = "test_questions.jsonl"  # V* Bench's question file, at the root of its snapshot

PROJECT_COLUMNS = ("id", "image", "question", "answer")
VSTAR_COLUMNS = ("image", "text", "label")
HRBENCH_COLUMNS = ("index", "question", "answer", "A", "B", "image")
# Checked in this order by detect_schema (the first whose columns the first row has wins).
SCHEMAS = {"hrbench": HRBENCH_COLUMNS, "vstar": VSTAR_COLUMNS, "project": PROJECT_COLUMNS}

# HR-Bench TSV rows hold whole images in base64 (several MB a row): pyarrow reads them in blocks at least this big
TSV_BLOCK_BYTES = 1 << 28

# V*'s option markers "(A) ", "(B) ", ... at a line's start or after a space: its "text" is the question, the
# options one per line, then "Answer with the option's letter from the given choices directly."
_VSTAR_OPTION = re.compile(r"(?:^|(?<=\s))\(([A-Z])\)[ \t]*", re.MULTILINE)


# ---------------------------------------------------------------------------------------------- reward


def parse_answer(completion: Completion) -> str | None:
    """The answer tag's text, stripped; None without a single complete, non-blank answer tag."""
    answer = extract_tag(completion.text, "answer")
    if answer is None or not answer.strip():
        return None
    return answer.strip()


def _holds(outer: Any, inner: Any) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "accuracy", "format", "tool", "looked"[, "crop_hit"]}`` for one completion; never raises on
    model output.

    ``sample.answer`` is the colour word (``meta["kind"] == "short_answer"``) or the correct option letter
    (``"multiple_choice"``, ``meta["choices"]`` the option texts); ``meta["target_box"]``, when present, the
    target in original pixels."""
    answer = parse_answer(completion)
    accuracy = float(answer is not None and is_correct(answer, sample))
    looked = float(completion.tool_images > 0)
    parts = {
        "accuracy": accuracy,
        "format": float(answer is not None and has_think_answer_format(completion.text)),
        "tool": accuracy * looked,
        "looked": looked,
    }
    target = sample.meta.get("target_box")
    if target is not None:
        parts["crop_hit"] = float(any(_holds(box, target) for box in completion.tool_boxes))
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def prediction(completion: Completion, sample: Sample) -> dict:
    """What the answer tag says (None without one) and where the thought zoomed: ``{"answer", "crop_boxes"}``,
    the crops as ``[x1, y1, x2, y2]`` in original pixels."""
    return {"answer": parse_answer(completion), "crop_boxes": [list(box) for box in completion.tool_boxes]}


def draw(image: Image.Image, sample: Sample, predicted: dict | None) -> Image.Image:
    """The frame (the truth, where known) in green and every crop the thought saw in red."""
    boxes = [(sample.meta["frame_box"], TRUTH_COLOUR)] if sample.meta.get("frame_box") is not None else []
    boxes += [(box, PREDICTION_COLOUR) for box in (predicted or {}).get("crop_boxes", [])]
    return draw_marks(image, boxes=boxes)


# ---------------------------------------------------------------------------------------------- warm start

# The warm start's planted flaw (``target``): on this share of the training scenes, chosen by the sample's id, the
# target looks in the wrong place (the frame's box moved half the image across in both directions, kept inside the
# image: a region away from the frame, though the thought names the frame's place), sees no shape
# there and guesses MISLOOK_GUESS. The warm-started model therefore zooms into the frame on about half its thoughts
# and elsewhere on the rest; RL has a systematic error to correct whose fix shows as held-out accuracy and as the
# share of useful looks (``crop_hit``), as the loose boxes do for grounding.
MISLOOK_RATE = 0.5
MISLOOK_GUESS = "red"


def misses(sample: Sample) -> bool:
    """Whether ``target`` looks in the wrong place for ``sample`` (a fixed choice by its id)."""
    return zlib.crc32(sample.id.encode()) % 1000 < MISLOOK_RATE * 1000


def target(sample: Sample, context: ToolContext) -> str:
    """What the warm start imitates: one zoom call in the thought, on the frame (the box in the model's frame on
    the image as it saw it, through ``context``), the colour read from the crop, and the answer; with the planted
    flaw (``misses``) a call on an empty region and a guess. Only the embedded scenes (they know the frame)."""
    frame = sample.meta.get("frame_box")
    if frame is None:
        raise ValueError(f"sample {sample.id!r} has no frame_box: only the embedded scenes have a target")
    x1, y1, x2, y2 = frame
    if misses(sample):
        width, height = context.original_sizes[0]
        centre_x, centre_y = ((x1 + x2) / 2 + width / 2) % width, ((y1 + y2) / 2 + height / 2) % height
        half_w, half_h = (x2 - x1) / 2, (y2 - y1) / 2
        centre_x, centre_y = min(max(centre_x, half_w), width - half_w), min(max(centre_y, half_h), height - half_h)
        x1, y1, x2, y2 = centre_x - half_w, centre_y - half_h, centre_x + half_w, centre_y + half_h
    box = [round(v) for v in context.from_original_pixels([x1, y1, x2, y2])]
    call = json.dumps({"name": ZOOM_TOOL.name, "arguments": {"bbox_2d": box}})
    seen = MISLOOK_GUESS if misses(sample) else sample.answer
    place = sample.meta.get("frame_place", "here")
    return f"<think>the frame is {place}<tool_call>{call}</tool_call>{seen}</think><answer>{seen}</answer>"



# ---------------------------------------------------------------------------------------------- loading


def load(split: str = "train", source: str | None = None) -> list[Sample]:
    """Zoom samples.

    ``source=None``: the embedded split ``data/zoom/{split}.jsonl`` (``split`` in EMBEDDED_SPLITS). A folder: V*
    Bench's snapshot (it holds ``test_questions.jsonl``; ``split`` is ignored) or a folder of the project's
    ``{split}.jsonl``. A file (``split`` ignored), whose columns pick the schema (SCHEMAS, first match wins):
      ``project``  {"id", "image": path, "question", "answer": the short answer, "frame_box"?, "target_box"?
                   ([x1, y1, x2, y2] original pixels), "width"?, "height"?} (``.jsonl``);
      ``vstar``    V* Bench {"image": path under the file's folder, "text": question, "(A) option" lines and an
                   answering hint, "label": the correct letter, "category", "question_id"} (``.jsonl``), or the
                   same columns with the image inside (lmms-lab's ``.parquet``);
      ``hrbench``  HR-Bench {"index", "question", "answer": the correct letter, "A".."D": options (blank: none),
                   "category", "cycle_category", "image": base64} (``.parquet`` or ``.tsv``; the 4 rows of a
                   question share one image, decoded once).
    Relative image paths resolve against the file's folder. Each Sample: ``answer`` = the colour word (short
    answer) or the correct letter; ``meta`` = {"kind": "short_answer" | "multiple_choice", "precision": None,
    "source": schema name, for multiple choice "choices" (option texts) and "answer_text", plus "frame_box",
    "target_box", "width", "height" (project rows) or "category" (and "cycle_category": HR-Bench)}.
    """
    if source is None:
        path = embedded_split_file(NAME, split, EMBEDDED_SPLITS, DATA_DIR, "python data/make_zoom.py")
    elif Path(source).is_dir():
        path = _folder_file(Path(source), split)
    else:
        path = checked_source_file(source, NAME, SOURCE_SUFFIXES, folders=True)
    rows = _tsv_rows(path) if path.suffix.lower() == ".tsv" else read_rows(path)
    schema = detect_schema(rows, path, SCHEMAS, NAME)
    make = {"project": _project_sample, "vstar": _vstar_sample, "hrbench": _hrbench_sample}[schema]
    images: dict[str, Any] = {}  # HR-Bench: one decoded image per distinct base64 cell
    return rows_to_samples(
        rows, lambda row, sample_id, where: make(row, sample_id, path.parent, where, images), path
    )


def _folder_file(folder: Path, split: str) -> Path:
    if (folder / VSTAR_QUESTIONS).is_file():
        return folder / VSTAR_QUESTIONS
    if (folder / f"{split}.jsonl").is_file():
        return folder / f"{split}.jsonl"
    raise FileNotFoundError(
        f"zoom source folder {str(folder)!r} holds neither {VSTAR_QUESTIONS} (V* Bench) nor {split}.jsonl "
        "(the project's rows, data/make_zoom.py's format)"
    )


def _tsv_rows(path: Path) -> list[tuple[None, str, dict]]:
    """``read_rows``'s triples for a VLMEvalKit TSV (HR-Bench's): pyarrow reads it, since its base64 image fields
    exceed the csv module's field limit; every column as text, as pandas' TSV leaves it."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    with open(path, "rb") as f:
        header = f.readline().decode("utf-8-sig", errors="replace").rstrip("\r\n").split("\t")
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(block_size=TSV_BLOCK_BYTES),
            parse_options=pacsv.ParseOptions(delimiter="\t", newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(column_types={name: pa.string() for name in header}),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a tab-separated file of rows ({error})") from None
    return [(None, f"{path}: row {index}", row) for index, row in enumerate(table.to_pylist())]


def _text(value: Any) -> str:
    """A cell as stripped text; a missing cell (None, NaN from pandas) as ""."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value).strip()


def _box(value: Any, where: str, name: str) -> list[float]:
    if not isinstance(value, list | tuple) or len(value) != 4:
        raise BadRow(f"{where}: {name} must be [x1, y1, x2, y2], got {value!r}")
    try:
        box = [float(v) for v in value]
    except (TypeError, ValueError):
        raise BadRow(f"{where}: {name} must be [x1, y1, x2, y2], got {value!r}") from None
    if not all(math.isfinite(v) for v in box) or not (box[0] < box[2] and box[1] < box[3]):
        raise BadRow(f"{where}: {name} must hold finite numbers with x1 < x2 and y1 < y2, got {value!r}")
    return box


def _image(cell: Any, root: Path, where: str) -> Any:
    """A row's image from a path or a Hugging Face image cell (``image_from_cell``); BadRow (skipped and counted)
    when the row has none, or a value that is neither."""
    if not isinstance(cell, str | dict) or not cell:
        raise BadRow(f"{where}: no image: 'image' must be a path or an image cell, got {str(cell)[:80]!r}")
    image = image_from_cell(cell, root, where)
    if image is None:
        raise BadRow(f"{where}: no image")
    return image


def _multiple_choice(
    sample_id: str, question: str, choices: list[str], label: Any, image: Any, meta: dict, where: str
) -> Sample:
    """The multiple-choice Sample, after checking that ``label`` is one option's letter."""
    if not question:
        raise BadRow(f"{where}: the question is blank")
    if len(choices) < 2:
        raise BadRow(f"{where}: a multiple-choice question needs at least 2 options, got {len(choices)}")
    letter = _text(label).strip("()").upper()
    if len(letter) != 1 or letter not in LETTERS[: len(choices)]:
        raise BadRow(
            f"{where}: the answer {label!r} is not one of the option letters {LETTERS[: len(choices)]}"
        )
    index = LETTERS.index(letter)
    meta = {
        "kind": MULTIPLE_CHOICE,
        "precision": None,
        "choices": tuple(choices),
        "answer_text": choices[index],
        **meta,
    }
    return Sample(
        task=NAME,
        id=sample_id,
        question=question_with_choices(question, choices),
        images=(image,),
        answer=letter,
        meta=meta,
    )


def _project_sample(row: dict, sample_id: str, root: Path, where: str, images: dict) -> Sample:
    question, answer = _text(row["question"]), _text(row["answer"])
    if not question or not answer:
        raise BadRow(
            f"{where}: 'question' and 'answer' must be non-blank, got {row['question']!r} and {row['answer']!r}"
        )
    image = _image(row["image"], root, where)
    meta = {"kind": SHORT_ANSWER, "precision": None, "source": "project"}
    for name in ("frame_box", "target_box"):
        if row.get(name) is not None:
            meta[name] = _box(row[name], where, name)
    meta.update({key: row[key] for key in ("width", "height") if key in row})
    if isinstance(row.get("frame_place"), str):  # the frame's grid cell in words ("at the top left")
        meta["frame_place"] = row["frame_place"][:40]
    return Sample(
        task=NAME,
        id=_text(row["id"]) or sample_id,
        question=question,
        images=(image,),
        answer=answer,
        meta=meta,
    )


def _vstar_sample(row: dict, sample_id: str, root: Path, where: str, images: dict) -> Sample:
    """V* Bench: the question and options are read out of "text"; the answering hint after the options is
    dropped (the task's instruction says how to answer)."""
    text = row["text"] if isinstance(row["text"], str) else ""
    marks = list(_VSTAR_OPTION.finditer(text))
    first = next((i for i, mark in enumerate(marks) if mark.group(1) == "A"), None)
    if first is None:
        raise BadRow(f"{where}: 'text' holds no options '(A) ...'")
    run = [marks[first]]
    for mark in marks[first + 1 :]:
        if mark.group(1) != LETTERS[len(run)]:
            break
        run.append(mark)
    ends = [mark.start() for mark in run[1:]] + [len(text)]
    choices = [text[mark.end() : end].strip() for mark, end in zip(run, ends, strict=True)]
    choices[-1] = choices[-1].split("\n")[0].strip()  # the last option's line; the answering hint follows
    if not all(choices):
        raise BadRow(f"{where}: a blank option in 'text'")
    image = _image(row["image"], root, where)
    question_id = _text(row.get("question_id"))
    meta = {"source": "vstar", "category": _text(row.get("category"))}
    return _multiple_choice(
        question_id or sample_id, text[: run[0].start()].strip(), choices, row["label"], image, meta, where
    )


def _hrbench_sample(row: dict, sample_id: str, root: Path, where: str, images: dict) -> Sample:
    choices = []
    for letter in LETTERS:
        option = _text(row.get(letter))
        if not option:
            break
        choices.append(option)
    if any(_text(row.get(letter)) for letter in LETTERS[len(choices) :]):
        raise BadRow(f"{where}: the options skip a letter: option {LETTERS[len(choices)]} is blank")
    meta = {
        "source": "hrbench",
        "category": _text(row.get("category")),
        "cycle_category": _text(row.get("cycle_category")),
    }
    image = _hrbench_image(row["image"], root, where, images)
    return _multiple_choice(
        _text(row["index"]) or sample_id, _text(row["question"]), choices, row["answer"], image, meta, where
    )


def _hrbench_image(cell: Any, root: Path, where: str, images: dict) -> Any:
    """HR-Bench's image cell: base64 text (its TSV and parquet), raw bytes, or a Hugging Face image cell. Decoded
    once per distinct cell: HR-Bench asks each question 4 times with the options rotated, over one image."""
    if isinstance(cell, bytes) and cell:
        return open_lazily(cell, where)
    if not isinstance(cell, str) or not cell:
        return _image(cell, root, where)
    if cell not in images:
        try:
            data = base64.b64decode(cell, validate=True)
        except (binascii.Error, ValueError):
            raise BadRow(f"{where}: 'image' is not base64 ({len(cell):,} characters)") from None
        images[cell] = open_lazily(data, where)
    return images[cell]


TASK = register_task(
    Task(
        name=NAME,
        load=load,
        reward=reward,
        instruction=INSTRUCTION,
        metrics=("accuracy", "format", "tool", "looked", "crop_hit"),
        reward_weights=dict(REWARD_WEIGHTS),
        success="accuracy",
        parse=prediction,
        draw=draw,
        tools=(ZOOM_TOOL,),
        target=target,
        default_config=str(Path(__file__).resolve().parents[1] / "configs" / "tiny-zoom.yaml"),
    )
)
