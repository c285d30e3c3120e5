"""Grounding (referring expression comprehension): given an image and an expression, output the box.

Reward parts (all in [0, 1]):
  ``format``     1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer holds
                 exactly one parseable box, else 0.0;
  ``iou``        IoU, in original-image pixels, between the answer's box and the ground truth; 0.0 without
                 a single answer tag holding a single finite box;
  ``acc_iou50``  1.0 when ``iou >= 0.5`` (the RefCOCO accuracy metric), else 0.0;
  ``right_thought``  only for samples with a reference thought (the embedded scenes: "the large red square
                 is at the middle right"): 1.0 when the think part is that sentence word for word, else 0.0.
                 It tells whether the reasoning found the target, apart from how well the box was drawn;
  ``reward``     ``weighted_reward(parts, REWARD_WEIGHTS)``; ``acc_iou50`` and ``right_thought`` are logged,
                 not rewarded.

``iou`` does not require the format: a box in a single ``<answer>`` tag is graded even when the think
part is missing or text surrounds the tags; the format part is what punishes those.

Sources for ``load``: the embedded synthetic shapes set (``data/grounding``, made by
``data/make_grounding.py``), the project's JSONL, lmms-lab RefCOCO/RefCOCO+/RefCOCOg parquet files,
and VLM-R1 REC JSON files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from PIL import Image

from vlm_grpo_ma.task_api import (
    PREDICTION_COLOUR,
    TRUTH_COLOUR,
    Completion,
    ImageLoadError,
    Sample,
    Task,
    checked_source_file,
    clip_box,
    draw_marks,
    embedded_split_file,
    extract_tag,
    has_think_answer_format,
    header_size,
    iou,
    jsonl_rows,
    open_lazily,
    order_corners,
    parse_box,
    register_task,
    require_keys,
    right_thought,
    skip_row,
    weighted_reward,
)

NAME = "grounding"

# Short on purpose: the default model is tiny and every prompt token costs CPU time.
INSTRUCTION = "Think in <think></think>, then answer with the box [x1,y1,x2,y2] in <answer></answer>."

# IoU is the goal; the format bonus is half of a perfect box so that a well-formed wrong answer still
# beats malformed output early in training without outweighing localisation.
REWARD_WEIGHTS = {"iou": 1.0, "format": 0.5}

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "grounding"
EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl", ".parquet", ".json")

LMMS_REFCOCO_COLUMNS = ("question_id", "image", "answer", "bbox")
VLM_R1_KEYS = ("image", "problem", "solution")


def question_for(expression: str) -> str:
    """The text the model sees before the trainer appends INSTRUCTION: ``"Locate: <expression>."``."""
    return f"Locate: {expression.strip().rstrip('.').strip()}."


# ---------------------------------------------------------------------------------------------- reward


def answer_box(completion: Completion) -> list[float] | None:
    """The box written in the single ``<answer>`` tag, in the model's frame as written; None if absent.

    None when there is no single complete answer tag (absent, repeated, or cut off) or it holds no single
    finite box (see ``parse_box``).
    """
    answer_text = extract_tag(completion.text, "answer")
    return parse_box(answer_text) if answer_text is not None else None


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "iou", "format", "acc_iou50"}`` for one completion; never raises on model output.

    ``sample.answer`` is the ground-truth ``[x1, y1, x2, y2]`` in original pixels and
    ``sample.meta["width"/"height"]`` the original image size.
    """
    predicted = prediction(completion, sample)
    overlap = iou(predicted["box"], sample.answer) if predicted is not None else 0.0
    parts = {
        "iou": overlap,
        "format": float(answer_box(completion) is not None and has_think_answer_format(completion.text)),
        "acc_iou50": float(overlap >= 0.5),
    }
    reference_thought = sample.meta.get("reference_thought")
    if reference_thought is not None:
        parts["right_thought"] = float(right_thought(completion.text, reference_thought))
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def prediction(completion: Completion, sample: Sample) -> dict | None:
    """The answer's box as the reward grades it: ``{"box": [x1, y1, x2, y2]}`` in original-image pixels.

    The model-frame box goes through ``completion.to_original_pixels`` (the one conversion), then its corners
    are sorted and it is clipped to the original image (the part of a box outside the image is not something
    the model could have meant). None without a box, or when the conversion overflows (a finite 1e308 in
    the model's frame can become inf in pixels).
    """
    box = answer_box(completion)
    if box is None:
        return None
    pixels = completion.to_original_pixels(box)
    if not all(math.isfinite(v) for v in pixels):
        return None
    return {"box": clip_box(order_corners(pixels), sample.meta["width"], sample.meta["height"])}


def draw(image: Image.Image, sample: Sample, predicted: dict | None) -> Image.Image:
    """The ground-truth box in green and the predicted box (if any) in red."""
    boxes = [(sample.answer, TRUTH_COLOUR)]
    if predicted is not None:
        boxes.append((predicted["box"], PREDICTION_COLOUR))
    return draw_marks(image, boxes=boxes)


# ---------------------------------------------------------------------------------------------- loading


def load(split: str = "train", source: str | None = None, *, image_root: str | None = None) -> list[Sample]:
    """Grounding samples.

    ``source=None``: the embedded split ``data/grounding/{split}.jsonl`` (``split`` in EMBEDDED_SPLITS).
    Otherwise ``source`` is a local file whose suffix picks the format (``split`` is then ignored):
      ``.jsonl``   the project's format (see ``data/make_grounding.py``);
      ``.parquet`` lmms-lab RefCOCO / RefCOCO+ / RefCOCOg;
      ``.json``    VLM-R1 REC (a list of {image, problem, solution, height, width, ...}).
    Relative image paths resolve against ``image_root`` when given, else the data file's folder.
    Each Sample: ``answer`` = ground-truth ``[x1, y1, x2, y2]`` floats in original pixels,
    ``images`` = (absolute path str or PIL.Image,), ``meta`` = {"width", "height"[, "reference_thought"]}.
    """
    if source is None:
        path = embedded_split_file(NAME, split, EMBEDDED_SPLITS, DATA_DIR, "python data/make_grounding.py")
        return _load_project_jsonl(path, image_root)
    path = checked_source_file(source, NAME, SOURCE_SUFFIXES)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _load_project_jsonl(path, image_root)
    if suffix == ".parquet":
        return _load_lmms_refcoco_parquet(path, image_root)
    return _load_vlm_r1_json(path, image_root)


def _resolve_image(relative: str, path: Path, image_root: str | None) -> str:
    root = Path(image_root) if image_root is not None else path.parent
    return str((root / relative).resolve())


def _box(values: Any, where: str) -> list[float]:
    if not isinstance(values, list | tuple) or len(values) != 4:
        raise ValueError(f"{where}: a box needs 4 numbers [x1, y1, x2, y2], got {values!r}")
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: a box needs 4 numbers [x1, y1, x2, y2], got {values!r}") from None


def _checked_box(box: list[float], width: float, height: float, where: str) -> list[float]:
    """The ground truth as the reward compares it: corners sorted, clipped to the image.

    A box partly outside the image is clipped (the prediction is clipped the same way, so the part outside
    could never be matched); a non-finite box, or one with no area inside the image, could only ever score
    IoU 0 and is refused."""
    if not all(math.isfinite(v) for v in box):
        raise ValueError(f"{where}: box {box} must hold finite numbers")
    clipped = clip_box(order_corners(box), width, height)
    if not (clipped[0] < clipped[2] and clipped[1] < clipped[3]):
        raise ValueError(
            f"{where}: box {box} has no area inside the {width:g}x{height:g} image "
            "(x1 < x2 <= width and y1 < y2 <= height after sorting the corners)"
        )
    return clipped


def _size(meta: dict, where: str) -> tuple[float, float]:
    """``meta["width"], meta["height"]``, checked: positive finite numbers."""
    size = meta["width"], meta["height"]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in size):
        got = f"{size[0]!r} and {size[1]!r}"
        raise ValueError(f"{where}: width and height must be positive numbers, got {got}")
    return size


def _sample(
    sample_id: str, expression: Any, image: Any, box: list[float], meta: dict, where: str
) -> Sample | None:
    """The Sample, or None (skipped and counted) when its size must come from an unreadable image."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError(f"{where}: 'expression' must be a non-empty string, got {expression!r}")
    if "width" not in meta or "height" not in meta:
        try:
            meta["width"], meta["height"] = header_size(image)
        except FileNotFoundError:
            raise FileNotFoundError(f"{where}: image file not found: {image}") from None
        except ImageLoadError as error:
            skip_row("broken_images", where, error)
            return None
    box = _checked_box(box, *_size(meta, where), where)
    return Sample(
        task=NAME, id=sample_id, question=question_for(expression), images=(image,), answer=box, meta=meta
    )


def _load_project_jsonl(path: Path, image_root: str | None) -> list[Sample]:
    """Rows {"id", "image", "expression", "box" x1y1x2y2 pixels, "width"?, "height"?, "reference_thought"?}."""
    samples = []
    for where, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        require_keys(row, ("id", "image", "expression", "box"), where)
        if not isinstance(row["image"], str):
            raise ValueError(f"{where}: 'image' must be a path string, got {row['image']!r}")
        meta = {k: row[k] for k in ("width", "height", "reference_thought") if k in row}
        image = _resolve_image(row["image"], path, image_root)
        box = _box(row["box"], where)
        samples.append(_sample(str(row["id"]), row["expression"], image, box, meta, where))
    return [sample for sample in samples if sample is not None]


def _load_lmms_refcoco_parquet(path: Path, image_root: str | None) -> list[Sample]:
    """lmms-lab RefCOCO/RefCOCO+/RefCOCOg parquet: one Sample per row, image decoded lazily from bytes.

    In these files ``question`` is a fixed captioning prompt ("Please carefully observe the area circled
    in the image and come up with a caption for the area.") and ``answer`` is the list of referring
    expressions for the box, so the expression is taken from ``answer``. We use the first expression only,
    one Sample per box; lmms-eval's ``refcoco_bbox_rec`` tasks instead make one item per expression, so
    its Acc@0.5 averages over more (and differently weighted) items than ours.
    ``bbox`` is COCO ``[x, y, w, h]`` in absolute pixels, converted to ``[x, y, x + w, y + h]``.
    """
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    missing = [c for c in LMMS_REFCOCO_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"{path}: not an lmms-lab RefCOCO parquet, missing columns {', '.join(missing)}; "
            f"required: {', '.join(LMMS_REFCOCO_COLUMNS)}"
        )
    wanted = [c for c in (*LMMS_REFCOCO_COLUMNS, "file_name") if c in columns]
    samples = []
    for row in pq.read_table(path, columns=wanted).to_pylist():
        where = f"{path}: question_id {row['question_id']}"
        expressions = [row["answer"]] if isinstance(row["answer"], str) else list(row["answer"] or [])
        if not expressions or not str(expressions[0]).strip():
            raise ValueError(f"{where}: no referring expression in 'answer'")
        x, y, w, h = _box(row["bbox"], where)
        try:
            image = _parquet_image(row["image"], path, image_root, where)
        except ImageLoadError as error:
            skip_row("broken_images", where, error)
            continue
        meta = {"file_name": row["file_name"]} if row.get("file_name") else {}
        samples.append(
            _sample(str(row["question_id"]), str(expressions[0]), image, [x, y, x + w, y + h], meta, where)
        )
    return [sample for sample in samples if sample is not None]


def _parquet_image(cell: Any, path: Path, image_root: str | None, where: str) -> Any:
    """A Hugging Face ``Image`` feature cell {"bytes", "path"} -> lazily opened PIL image (or a path).

    ``Image.open`` on bytes reads only the header; pixels are decoded when the policy first uses the
    image, so a whole RefCOCO split does not sit decoded in memory.
    """
    if isinstance(cell, dict) and cell.get("bytes"):
        return open_lazily(cell["bytes"], where)
    if isinstance(cell, dict) and cell.get("path"):
        return _resolve_image(cell["path"], path, image_root)
    raise ValueError(f"{where}: image cell has neither bytes nor path")


def _load_vlm_r1_json(path: Path, image_root: str | None) -> list[Sample]:
    """VLM-R1 REC JSON: a list of {image, problem, solution [x1,y1,x2,y2] pixels, width, height, ...}.

    ``problem`` is the referring expression; ``normalized_solution`` (0-1000) is ignored because the
    ground truth is kept in original pixels and every model frame converts to pixels through the
    Completion. ``image`` may be a one-element list (VLM-R1's JSONL variant).
    """
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a VLM-R1 REC file is a JSON list of rows, got {type(rows).__name__}")
    samples = []
    for index, row in enumerate(rows):
        where = f"{path}: row {index}"
        require_keys(row, VLM_R1_KEYS, where)
        image_ref = (
            row["image"][0] if isinstance(row["image"], list) and len(row["image"]) == 1 else row["image"]
        )
        if not isinstance(image_ref, str):
            raise ValueError(f"{where}: 'image' must be one path, got {row['image']!r}")
        solution = row["solution"]
        box = parse_box(solution) if isinstance(solution, str) else solution
        meta = {k: row[k] for k in ("width", "height") if k in row}
        expression = str(row["problem"]).replace("<image>", "")
        image = _resolve_image(image_ref, path, image_root)
        samples.append(
            _sample(
                str(row.get("id", f"{path.stem}_{index}")), expression, image, _box(box, where), meta, where
            )
        )
    return [sample for sample in samples if sample is not None]


TASK = register_task(
    Task(
        name=NAME,
        load=load,
        reward=reward,
        instruction=INSTRUCTION,
        metrics=("iou", "format", "acc_iou50", "right_thought"),
        reward_weights=dict(REWARD_WEIGHTS),
        success="acc_iou50",
        parse=prediction,
        draw=draw,
    )
)
