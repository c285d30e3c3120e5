"""Affordance pointing: given an image and an action ("Where would you grasp the mug?"), point to where it applies.

Reward parts (all in [0, 1]):
  ``inside``     the fraction of the answer's points that lie in the target region, in original-image pixels:
                 the target mask when the sample has one, else its box. Points outside the image are misses.
                 Spraying is capped: an answer of more than MAX_POINTS points is not an answer and scores 0
                 on every part (and within the cap every miss lowers the fraction, so extra points only pay
                 when they hit). One box ``[x1, y1, x2, y2]`` is accepted in place of points: it scores the
                 fraction of its pixels that are target pixels (Where2Place grades box answers the same way);
  ``format``     1.0 when the whole text is ``<think>...</think><answer>...</answer>`` and the answer holds
                 1..MAX_POINTS finite points or one finite box, else 0.0;
  ``point_acc``  1.0 when the first point (of a box answer: its centre) lies in the target region, else 0.0:
                 the point a robot would act on, and the single-point accuracy RoboRefIt-style benchmarks
                 report; logged, not rewarded by default;
  ``reward``     ``weighted_reward(parts, REWARD_WEIGHTS)``.

``inside`` and ``point_acc`` do not require the format: points in a single ``<answer>`` tag are graded even
when the think part is missing; the format part is what punishes that. Every reward part is 0.0 when the
answer has no single complete ``<answer>`` tag with points or a box in it (see ``answer_geometry``), and when
the sample's target cannot be read (a mask file deleted or corrupted after loading: logged once, not raised).

Geometry, in original pixels: pixel (c, r) covers [c, c + 1) x [r, r + 1). A point (x, y) is in a mask
when 0 <= x < width, 0 <= y < height and pixel (floor(x), floor(y)) is a target pixel; in a box
[x1, y1, x2, y2] when x1 <= x < x2 and y1 <= y < y2 (half-open like the pixels, so a box and its rasterised
mask agree on integer corners). A box answer (or box target, when grading a box answer) covers the pixels
whose centres (c + 0.5, r + 0.5) lie in it; its pixels outside the image count as misses, and a box that
covers no pixel centre scores 0 on ``inside`` and ``point_acc``.

Targets: ``sample.answer`` is an ``AffordanceTarget(mask=..., box=...)`` (a dict with the same keys is
accepted too): ``mask`` is a path to a greyscale image the size of the original image (PNG/JPG, read
lazily on first use and cached) or a 2-D array [H, W]; ``box`` is ``[x1, y1, x2, y2]`` in original pixels.
At least one of them is set; the mask wins when both are. A mask pixel is a target pixel when its value is
more than half the mask's maximum: 0/255 masks, 0/1 label images, boolean arrays and JPEG masks (whose
compression leaves faint nonzero ringing next to the region, as Where2Place's do) all read as drawn.
``sample.meta`` holds "width"/"height" of the original image.

Sources for ``load``: the embedded synthetic scenes (``data/affordance``, made by ``data/make_affordance.py``),
the project's JSONL, Where2Place (``point_questions.jsonl`` + ``images/`` + ``masks/``), and RoboRefIt
(``roborefit_{split}.json`` rows with text, bbox, rgb_path, mask_path). See ``load``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlm_grpo_ma.task_api import (
    PREDICTION_COLOUR,
    TRUTH_COLOUR,
    Completion,
    ImageLoadError,
    Sample,
    Task,
    checked_source_file,
    draw_marks,
    embedded_split_file,
    extract_tag,
    has_think_answer_format,
    header_size,
    jsonl_rows,
    order_corners,
    parse_box,
    parse_points,
    register_task,
    require_keys,
    skip_row,
    weighted_reward,
)

log = logging.getLogger(__name__)

NAME = "affordance"

# At most this many points are graded. Where2Place's reference answers and RoboPoint's outputs list a
# handful of points; 10 leaves room for that and keeps a grid of points over the image from being an answer.
MAX_POINTS = 10

# Short on purpose: the default model is tiny and every prompt token costs CPU time.
INSTRUCTION = (
    f"Think in <think></think>, then answer with up to {MAX_POINTS} points [(x,y),...] in <answer></answer>."
)

# Hitting the region is the goal; the format bonus is half of a perfect answer (as in grounding) so that a
# well-formed miss still beats malformed output early in training without outweighing localisation.
REWARD_WEIGHTS = {"inside": 1.0, "format": 0.5}

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "affordance"
EMBEDDED_SPLITS = ("train", "test")
SOURCE_SUFFIXES = (".jsonl", ".json")
ROBOREFIT_SPLITS = ("train", "testA", "testB")

PROJECT_KEYS = ("id", "image", "question")
WHERE2PLACE_KEYS = ("question_id", "image", "text")
ROBOREFIT_KEYS = ("text", "bbox", "rgb_path")
WHERE2PLACE_QUESTIONS = "point_questions.jsonl"

# Masks decoded at reward time, by path. 512 masks of 640x480 are about 150 MiB as booleans: enough for
# the prompts of many steps, bounded for RoboRefIt's tens of thousands of masks.
MASK_CACHE_SIZE = 512


def binarise_mask(values: np.ndarray) -> np.ndarray:
    """A 2-D mask of any dtype -> boolean [H, W]: a pixel is target when its value is over half the maximum."""
    if values.dtype == np.bool_:
        return values.copy()
    values = values.astype(np.float64)
    top = float(values.max()) if values.size else 0.0
    if not top > 0.0:
        return np.zeros(values.shape, dtype=bool)
    return values > top / 2.0


@functools.lru_cache(maxsize=MASK_CACHE_SIZE)
def read_mask(path: str) -> np.ndarray | None:
    """The boolean mask [H, W] stored at ``path``, or None (logged once) when it cannot be read."""
    try:
        with Image.open(path) as image:
            image.load()
            grey = image if image.mode in ("1", "L", "I", "I;16", "F") else image.convert("L")
            values = np.asarray(grey)
    # Missing, not an image, truncated, or a decompression bomb: a reward must not crash on a data file.
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        log.warning("affordance mask %s cannot be read (%s); its samples score 0", path, error)
        return None
    if values.ndim != 2:
        log.warning("affordance mask %s is not a single-channel image; its samples score 0", path)
        return None
    mask = binarise_mask(values)
    mask.setflags(write=False)  # shared by every reward call through the cache
    return mask


@dataclass(frozen=True, eq=False)
class AffordanceTarget:
    """Where an action applies: a mask (path or 2-D array) and/or a box ``(x1, y1, x2, y2)``, original pixels.

    A box is stored with sorted corners; an array mask is stored binarised (``binarise_mask``) and read-only.
    ``eq=False``: a target may hold an array, so compare ``mask``/``box`` yourself.
    """

    mask: str | np.ndarray | None = None
    box: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.mask is None and self.box is None:
            raise ValueError("an affordance target needs a mask, a box, or both; got neither")
        if self.box is not None:
            values = list(self.box) if isinstance(self.box, list | tuple) else None
            if values is None or len(values) != 4 or not all(_is_finite_number(v) for v in values):
                raise ValueError(f"a target box needs 4 finite numbers [x1, y1, x2, y2], got {self.box!r}")
            box = tuple(order_corners(values))
            if not (box[0] < box[2] and box[1] < box[3]):
                raise ValueError(f"a target box needs a positive area, got {self.box!r}")
            object.__setattr__(self, "box", box)
        if isinstance(self.mask, np.ndarray):
            if self.mask.ndim != 2:
                raise ValueError(f"a target mask array must be 2-D [H, W], got shape {self.mask.shape}")
            mask = binarise_mask(self.mask)
            mask.setflags(write=False)
            object.__setattr__(self, "mask", mask)
        elif self.mask is not None:
            if not isinstance(self.mask, str | Path):
                raise ValueError(f"a target mask is a path or a 2-D array, got {type(self.mask).__name__}")
            object.__setattr__(self, "mask", str(self.mask))

    def mask_pixels(self) -> np.ndarray | None:
        """The boolean mask [H, W]; None when there is no mask or its file cannot be read."""
        if isinstance(self.mask, np.ndarray):
            return self.mask
        return read_mask(self.mask) if self.mask is not None else None


def _is_finite_number(value: Any) -> bool:
    # numbers.Real also admits numpy scalars; bool is an int subclass but not a coordinate.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------- reward


def answer_geometry(completion: Completion) -> tuple[str, list] | None:
    """What the single ``<answer>`` tag holds, in the model's frame as written.

    ``("points", [(x, y), ...])`` for 1..MAX_POINTS finite points (see ``parse_points``), else
    ``("box", [x1, y1, x2, y2])`` for one finite box (see ``parse_box``), else None: no single complete answer
    tag, nothing parseable, any non-finite number, or more than MAX_POINTS points.
    """
    answer_text = extract_tag(completion.text, "answer")
    if answer_text is None:
        return None
    points = parse_points(answer_text)
    if points is not None:
        return ("points", points) if len(points) <= MAX_POINTS else None
    box = parse_box(answer_text)
    return ("box", box) if box is not None else None


def _as_target(answer: Any) -> AffordanceTarget | None:
    if isinstance(answer, AffordanceTarget):
        return answer
    if isinstance(answer, dict):
        try:
            return AffordanceTarget(mask=answer.get("mask"), box=answer.get("box"))
        except ValueError:
            return None
    return None


def point_in_target(
    x: float, y: float, mask: np.ndarray | None, box: tuple[float, ...] | None, width: int, height: int
) -> bool:
    """Whether the original-pixel point (x, y) lies in ``mask`` (when given) or else ``box``, inside the image."""
    if not (math.isfinite(x) and math.isfinite(y) and 0.0 <= x < width and 0.0 <= y < height):
        return False
    if mask is not None:
        column, row = int(x), int(y)  # floor: both are non-negative here
        return row < mask.shape[0] and column < mask.shape[1] and bool(mask[row, column])
    return box[0] <= x < box[2] and box[1] <= y < box[3]


def _pixel_range(low: float, high: float) -> tuple[int, int]:
    """Indices [first, stop) of the pixels whose centres c + 0.5 lie in [low, high)."""
    return math.ceil(low - 0.5), math.ceil(high - 0.5)


def box_pixels(box: list[float]) -> tuple[int, int, int, int] | None:
    """(first column, stop column, first row, stop row) of the pixels whose centres lie in an original-pixel
    box (corners in any order); None when a corner is not finite or the box covers no pixel centre."""
    x1, y1, x2, y2 = order_corners(box)
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
        return None
    (c0, c1), (r0, r1) = _pixel_range(x1, x2), _pixel_range(y1, y2)
    return (c0, c1, r0, r1) if c1 > c0 and r1 > r0 else None


def box_fraction_in_target(
    box: list[float], mask: np.ndarray | None, target_box: tuple[float, ...] | None, width: int, height: int
) -> float:
    """The fraction of an original-pixel box's pixels (by centre) that are target pixels; 0.0 if it covers none.

    The target is ``mask`` when given, else ``target_box`` rasterised by pixel centres the same way.
    """
    pixels = box_pixels(box)
    if pixels is None:
        return 0.0
    c0, c1, r0, r1 = pixels
    covered = (c1 - c0) * (r1 - r0)  # Python ints: exact even for a box of 1e300 pixels
    if mask is None:
        mask = np.zeros((height, width), dtype=bool)
        tc0, tc1, tr0, tr1 = box_pixels(list(target_box)) or (0, 0, 0, 0)
        mask[max(tr0, 0) : max(tr1, 0), max(tc0, 0) : max(tc1, 0)] = True
    rows = slice(min(max(r0, 0), height), min(max(r1, 0), height))
    columns = slice(min(max(c0, 0), width), min(max(c1, 0), width))
    return float(int(mask[rows, columns].sum()) / covered)


def _zero_parts() -> dict[str, float]:
    parts = {"inside": 0.0, "format": 0.0, "point_acc": 0.0}
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def reward(completion: Completion, sample: Sample) -> dict[str, float]:
    """``{"reward", "inside", "format", "point_acc"}`` for one completion; never raises on model output.

    ``sample.answer`` is an ``AffordanceTarget`` (or a dict with its fields) in original pixels and
    ``sample.meta["width"/"height"]`` the original image size.
    """
    target = _as_target(sample.answer)
    mask = target.mask_pixels() if target is not None else None
    if target is None or (target.mask is not None and mask is None):
        return _zero_parts()  # the target cannot be read: nothing to grade against
    width = int(sample.meta.get("width", mask.shape[1] if mask is not None else 0))
    height = int(sample.meta.get("height", mask.shape[0] if mask is not None else 0))

    geometry = answer_geometry(completion)
    inside = first_inside = 0.0
    if geometry is not None and geometry[0] == "points":
        flat = [v for point in geometry[1] for v in point]
        pixels = completion.to_original_pixels(flat)
        hits = [
            point_in_target(pixels[i], pixels[i + 1], mask, target.box, width, height)
            for i in range(0, len(pixels), 2)
        ]
        inside, first_inside = sum(hits) / len(hits), float(hits[0])
    elif geometry is not None:  # one box
        x1, y1, x2, y2 = completion.to_original_pixels(geometry[1])
        # A box that covers no pixel centre (zero width, or thinner than a pixel between two centres) marks
        # no place at all: 0 on both parts, even when its centre happens to lie in the target.
        if box_pixels([x1, y1, x2, y2]) is not None:
            inside = box_fraction_in_target([x1, y1, x2, y2], mask, target.box, width, height)
            centre_x, centre_y = x1 / 2 + x2 / 2, y1 / 2 + y2 / 2  # halves first: no overflow near 1e308
            first_inside = float(point_in_target(centre_x, centre_y, mask, target.box, width, height))
    parts = {
        "inside": float(inside),
        "format": float(geometry is not None and has_think_answer_format(completion.text)),
        "point_acc": first_inside,
    }
    parts["reward"] = weighted_reward(parts, REWARD_WEIGHTS)
    return parts


def prediction(completion: Completion, sample: Sample) -> dict | None:
    """The answer's points (``{"points": [[x, y], ...]}``) or box (``{"box": [...]}``) in original pixels,
    as the reward grades them; None when the answer holds neither (or the conversion overflows)."""
    geometry = answer_geometry(completion)
    if geometry is None:
        return None
    kind, values = geometry
    flat = [v for point in values for v in point] if kind == "points" else values
    pixels = completion.to_original_pixels(flat)
    if not all(math.isfinite(v) for v in pixels):
        return None
    if kind == "points":
        return {"points": [[pixels[i], pixels[i + 1]] for i in range(0, len(pixels), 2)]}
    return {"box": order_corners(pixels)}


def draw(image: Image.Image, sample: Sample, predicted: dict | None) -> Image.Image:
    """The target mask tinted green (its box outlined green when there is no mask), the prediction in red."""
    target = _as_target(sample.answer)
    mask = target.mask_pixels() if target is not None else None
    image = image.convert("RGB")
    if mask is not None and mask.shape == (image.size[1], image.size[0]):
        tinted = Image.new("RGB", image.size, TRUTH_COLOUR)
        image = Image.composite(Image.blend(image, tinted, 0.45), image, Image.fromarray(mask.astype(np.uint8) * 255))
    boxes = [(target.box, TRUTH_COLOUR)] if target is not None and target.box is not None and mask is None else []
    points = []
    if predicted is not None and "box" in predicted:
        boxes.append((predicted["box"], PREDICTION_COLOUR))
    elif predicted is not None:
        points = [(point, PREDICTION_COLOUR) for point in predicted["points"]]
    return draw_marks(image, boxes=boxes, points=points)


# ---------------------------------------------------------------------------------------------- loading


def load(split: str = "train", source: str | None = None, *, image_root: str | None = None) -> list[Sample]:
    """Affordance samples.

    ``source=None``: the embedded split ``data/affordance/{split}.jsonl`` (``split`` in EMBEDDED_SPLITS).
    Otherwise ``source`` is a local file or folder:
      a ``.jsonl`` file whose first row decides the format (``split`` is ignored):
        {id, image, question, ...}      the project's format (see ``_load_project_jsonl``);
        {question_id, image, text}      Where2Place ``point_questions.jsonl`` (see ``_load_where2place``);
        {text, bbox, rgb_path, ...}     RoboRefIt rows, one per line;
      a ``.json`` file: RoboRefIt (a list of {text, bbox, rgb_path, mask_path, ...}; ``split`` is ignored);
      a folder holding ``point_questions.jsonl``: Where2Place;
      a folder holding ``final_dataset/{split}/roborefit_{split}.json``: RoboRefIt (``split`` in
        ROBOREFIT_SPLITS).
    Relative image paths resolve against ``image_root`` when given (see each format for its default).
    Each Sample: ``answer`` = ``AffordanceTarget`` (mask path resolved to an absolute str, and/or box),
    ``images`` = (absolute path str,), ``meta`` = {"width", "height", ...}. A mask file that is missing,
    not an image, or not the size of its image raises here, naming the path.
    """
    if source is None:
        path = embedded_split_file(NAME, split, EMBEDDED_SPLITS, DATA_DIR, "python data/make_affordance.py")
        return _load_project_jsonl(path, _read_jsonl(path), image_root)
    path = Path(source)
    if path.is_dir():
        if (path / WHERE2PLACE_QUESTIONS).is_file():
            questions = path / WHERE2PLACE_QUESTIONS
            return _load_where2place(questions, _read_jsonl(questions), image_root)
        if (path / "final_dataset").is_dir():
            if split not in ROBOREFIT_SPLITS:
                raise ValueError(
                    f"unknown RoboRefIt split {split!r} for {source!r}; valid splits: {', '.join(ROBOREFIT_SPLITS)}"
                )
            annotation = path / "final_dataset" / split / f"roborefit_{split}.json"
            if not annotation.is_file():
                raise FileNotFoundError(f"RoboRefIt annotation file not found: {annotation}")
            return _load_roborefit(annotation, _read_json_list(annotation), image_root)
        raise ValueError(
            f"affordance source folder {source!r} holds neither {WHERE2PLACE_QUESTIONS} (Where2Place) nor "
            f"final_dataset/ (RoboRefIt)"
        )
    path = checked_source_file(source, NAME, SOURCE_SUFFIXES, folders=True)
    if path.suffix.lower() == ".json":
        return _load_roborefit(path, _read_json_list(path), image_root)
    rows = _read_jsonl(path)  # read once: the first row picks the format
    if not rows:
        raise ValueError(f"{path}: no rows")
    first = rows[0]
    if all(k in first for k in PROJECT_KEYS):
        return _load_project_jsonl(path, rows, image_root)
    if all(k in first for k in WHERE2PLACE_KEYS):
        return _load_where2place(path, rows, image_root)
    if all(k in first for k in ROBOREFIT_KEYS):
        return _load_roborefit(path, rows, image_root)
    raise ValueError(
        f"{path}: first row has keys {sorted(first)}, which match no affordance format; required: "
        f"project {', '.join(PROJECT_KEYS)} | Where2Place {', '.join(WHERE2PLACE_KEYS)} | "
        f"RoboRefIt {', '.join(ROBOREFIT_KEYS)}"
    )


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for where, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read_json_list(path: Path) -> list[dict]:
    with open(path, encoding="utf-8-sig") as f:  # some RoboRefIt releases carry a byte-order mark
        rows = json.load(f)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: a RoboRefIt file is a JSON list of rows, got {type(rows).__name__}")
    return rows


def _image_size(path: str, where: str, what: str = "image") -> tuple[int, int] | None:
    """(width, height) from the file header, or a clear error naming the file. A present but unreadable
    (corrupt, over PIL's pixel limit) scene image is skipped and counted: None; a broken mask is an error."""
    try:
        return header_size(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: {what} file not found: {path}") from None
    except ImageLoadError as error:
        if what != "mask":
            skip_row("broken_images", where, error)
            return None
        reason = error.__cause__
        raise ValueError(f"{where}: {what} file {path} cannot be read as an image ({reason})") from None


def _checked_mask(path: str, size: tuple[int, int], where: str) -> str:
    """``path`` after checking that it is an image of ``size`` (header only; pixels are read at reward time)."""
    mask_size = _image_size(path, where, "mask")
    if mask_size != tuple(size):
        raise ValueError(
            f"{where}: mask {path} is {mask_size[0]}x{mask_size[1]} but its image is {size[0]}x{size[1]}"
        )
    return path


def _target(mask: str | None, box: Any, where: str) -> AffordanceTarget:
    try:
        return AffordanceTarget(mask=mask, box=box)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _load_project_jsonl(path: Path, rows: list[dict], image_root: str | None) -> list[Sample]:
    """The project's JSONL: one row per sample.

    {"id", "image", "question", "mask"?, "box"?, "width"?, "height"?, "point"?, "reference_thought"?, "kind"?}
    ``image``/``mask`` are paths, relative ones resolved against ``image_root`` when given, else the JSONL's
    folder; ``mask`` is a greyscale image of the image's size; ``box`` is [x1, y1, x2, y2] in pixels; at least
    one of the two. ``width``/``height`` are read from the image header when absent. ``point`` (a reference
    pixel in the target) becomes ``meta["reference_point"]``; ``reference_thought`` and ``kind`` are kept in
    ``meta`` as they are.
    """
    root = Path(image_root) if image_root is not None else path.parent
    samples = []
    for line_number, row in enumerate(rows, start=1):
        where = f"{path}:{line_number}"
        require_keys(row, PROJECT_KEYS, where)
        if row.get("mask") is None and row.get("box") is None:
            raise ValueError(f"{where}: a row needs a mask, a box, or both; it has neither")
        image = str((root / row["image"]).resolve())
        if "width" in row and "height" in row:
            size = (int(row["width"]), int(row["height"]))
        elif (size := _image_size(image, where)) is None:
            continue
        mask = row.get("mask")
        if mask is not None:
            mask = _checked_mask(str((root / mask).resolve()), size, where)
        meta: dict[str, Any] = {"width": size[0], "height": size[1]}
        if "point" in row:
            meta["reference_point"] = [float(v) for v in row["point"]]
        meta.update({k: row[k] for k in ("reference_thought", "kind") if k in row})
        samples.append(
            Sample(
                task=NAME,
                id=str(row["id"]),
                question=str(row["question"]).strip(),
                images=(image,),
                answer=_target(mask, row.get("box"), where),
                meta=meta,
            )
        )
    return samples


def where2place_question(text: str) -> str:
    """Where2Place's question without its closing format request.

    Each ``text`` ends "Your answer should be formatted as a list of tuples ... The coordinates should be between
    0 and 1 ...". That is cut: INSTRUCTION states the answer format, and the coordinate frame is the model's
    (converted by the Completion), which 0-1 coordinates would contradict.
    """
    cut = text.find("Your answer should")
    return (text[:cut] if cut >= 0 else text).strip()


def _load_where2place(path: Path, rows: list[dict], image_root: str | None) -> list[Sample]:
    """Where2Place: ``point_questions.jsonl`` rows {question_id, image, text}.

    The image is ``images/{image}`` next to the JSONL (or ``{image_root}/{image}``), the target mask
    ``masks/{question_id:02d}.jpg`` next to the JSONL (a JPEG: read with the half-maximum rule). Where2Place's
    own answers are points, but only the mask is needed to grade.
    """
    image_dir = Path(image_root) if image_root is not None else path.parent / "images"
    samples = []
    for line_number, row in enumerate(rows, start=1):
        where = f"{path}:{line_number}"
        require_keys(row, WHERE2PLACE_KEYS, where)
        question_id = row["question_id"]
        if (
            isinstance(question_id, bool)
            or not isinstance(question_id, int | str)
            or not str(question_id).isdigit()
        ):
            raise ValueError(f"{where}: question_id must be a non-negative integer, got {question_id!r}")
        image = str((image_dir / row["image"]).resolve())
        if (size := _image_size(image, where)) is None:
            continue
        mask = _checked_mask(
            str((path.parent / "masks" / f"{int(question_id):02d}.jpg").resolve()), size, where
        )
        samples.append(
            Sample(
                task=NAME,
                id=f"where2place_{question_id}",
                question=where2place_question(str(row["text"])),
                images=(image,),
                answer=_target(mask, None, where),
                meta={"width": size[0], "height": size[1]},
            )
        )
    return samples


def roborefit_question(text: str) -> str:
    """RoboRefIt ``text`` is a referring expression or a request ("give me the red cup on the left")."""
    return f"Point to the object meant by: {text.strip().rstrip('.').strip()}."


def _roborefit_path(raw: Any, annotation: Path, image_root: str | None, where: str, what: str) -> str:
    """A RoboRefIt media path (Windows separators, relative to the dataset root) -> an existing absolute path.

    Rows say e.g. ``final_dataset\\train\\image\\0000000.png``: relative to the folder that holds
    ``final_dataset``. Without ``image_root`` that folder is found by walking up from the annotation file.
    """
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"{where}: {what} must be a path, got {raw!r}")
    relative = Path(raw.strip().replace("\\", "/"))
    roots = [Path(image_root)] if image_root is not None else [annotation.parent, *annotation.parent.parents]
    for root in roots:
        candidate = root / relative
        if candidate.is_file():
            return str(candidate.resolve())
    searched = str(roots[0]) if image_root is not None else f"{annotation.parent} and its parents"
    raise FileNotFoundError(f"{where}: {what} file not found: {raw!r} (searched below {searched})")


def _load_roborefit(path: Path, rows: list, image_root: str | None) -> list[Sample]:
    """RoboRefIt: rows {num?, text, bbox [x1, y1, x2, y2] pixels (of 640x480 images), rgb_path, mask_path?, ...}.

    The target is the mask when ``mask_path`` is given (the referred object's segmentation), with ``bbox``
    kept as the box; ``class`` and ``scene`` go to ``meta``.
    """
    samples = []
    for index, row in enumerate(rows):
        where = f"{path}: row {index}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        require_keys(row, ROBOREFIT_KEYS, where)
        image = _roborefit_path(row["rgb_path"], path, image_root, where, "rgb_path")
        if (size := _image_size(image, where, "rgb_path")) is None:
            continue
        mask = None
        if row.get("mask_path"):
            mask = _checked_mask(
                _roborefit_path(row["mask_path"], path, image_root, where, "mask_path"), size, where
            )
        meta: dict[str, Any] = {"width": size[0], "height": size[1]}
        meta.update({k: row[k] for k in ("class", "scene") if k in row})
        sample_id = f"roborefit_{row['num']}" if "num" in row else f"{path.stem}_{index}"
        samples.append(
            Sample(
                task=NAME,
                id=sample_id,
                question=roborefit_question(str(row["text"])),
                images=(image,),
                answer=_target(mask, row["bbox"], where),
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
        metrics=("inside", "format", "point_acc"),
        reward_weights=dict(REWARD_WEIGHTS),
        success="point_acc",
        parse=prediction,
        draw=draw,
    )
)
